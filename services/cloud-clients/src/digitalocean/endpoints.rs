//! The API's endpoints the workers call, one [`DoClient`] method each: VPCs, DOKS clusters
//! (with their kubeconfig and credentials), node pools and their nodes, and load balancers.
//! How a call is sent, retried, counted and decoded is the client's (`mod.rs`).

use reqwest::Method;

use super::{
    seg, Cluster, ClusterCreateRequest, ClusterCredentials, DoClient, DoError, LoadBalancer,
    NodePool, NodePoolCreateRequest, NodePoolUpdateRequest, Vpc,
};

impl DoClient {
    // -------------------------------------------------------------- VPCs

    pub async fn vpc_list(&self) -> Result<Vec<Vpc>, DoError> {
        self.list_all("/v2/vpcs", "vpcs").await
    }

    pub async fn vpc_get(&self, vpc_id: &str) -> Result<Vpc, DoError> {
        self.get(&format!("/v2/vpcs/{}", seg(vpc_id)), "vpc").await
    }

    // -------------------------------------------------------------- clusters

    pub async fn cluster_list(&self) -> Result<Vec<Cluster>, DoError> {
        self.list_all("/v2/kubernetes/clusters", "kubernetes_clusters")
            .await
    }

    /// 201 with the cluster in `provisioning`. A live cluster with the same name is a 409.
    pub async fn cluster_create(&self, req: &ClusterCreateRequest) -> Result<Cluster, DoError> {
        self.json(
            Method::POST,
            "/v2/kubernetes/clusters",
            Some(req),
            "kubernetes_cluster",
        )
        .await
    }

    pub async fn cluster_get(&self, cluster_id: &str) -> Result<Cluster, DoError> {
        self.get(
            &format!("/v2/kubernetes/clusters/{}", seg(cluster_id)),
            "kubernetes_cluster",
        )
        .await
    }

    /// 204; the cluster is `deleting`, then 404. Deleting a deleting cluster is accepted.
    pub async fn cluster_delete(&self, cluster_id: &str) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!("/v2/kubernetes/clusters/{}", seg(cluster_id)),
        )
        .await
    }

    /// The cluster's kubeconfig (YAML, token user). Available as soon as the cluster exists.
    pub async fn kubeconfig(&self, cluster_id: &str) -> Result<String, DoError> {
        let reply = self
            .send(
                Method::GET,
                &format!("/v2/kubernetes/clusters/{}/kubeconfig", seg(cluster_id)),
                None,
            )
            .await?;
        String::from_utf8(reply.body).map_err(|e| DoError::Decode {
            status: reply.status.as_u16(),
            detail: format!("kubeconfig is not UTF-8: {e}"),
        })
    }

    /// New token credentials for the cluster's API, valid for the API's default lifetime (7
    /// days on DOKS); `expires_at` says until when.
    pub async fn cluster_credentials(
        &self,
        cluster_id: &str,
    ) -> Result<ClusterCredentials, DoError> {
        let reply = self
            .send(
                Method::GET,
                &format!("/v2/kubernetes/clusters/{}/credentials", seg(cluster_id)),
                None,
            )
            .await?;
        ClusterCredentials::from_body(&reply.body).map_err(|detail| DoError::Decode {
            status: reply.status.as_u16(),
            detail,
        })
    }

    // -------------------------------------------------------------- node pools

    pub async fn node_pool_list(&self, cluster_id: &str) -> Result<Vec<NodePool>, DoError> {
        self.get(
            &format!("/v2/kubernetes/clusters/{}/node_pools", seg(cluster_id)),
            "node_pools",
        )
        .await
    }

    /// 201. Beyond the region's capacity for the size: a permanent 422 ([`DoError::is_capacity`]).
    pub async fn node_pool_create(
        &self,
        cluster_id: &str,
        req: &NodePoolCreateRequest,
    ) -> Result<NodePool, DoError> {
        self.json(
            Method::POST,
            &format!("/v2/kubernetes/clusters/{}/node_pools", seg(cluster_id)),
            Some(req),
            "node_pool",
        )
        .await
    }

    pub async fn node_pool_get(
        &self,
        cluster_id: &str,
        pool_id: &str,
    ) -> Result<NodePool, DoError> {
        self.get(
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
            "node_pool",
        )
        .await
    }

    /// 202. Scaling beyond capacity is a permanent 422 ([`DoError::is_capacity`]).
    pub async fn node_pool_update(
        &self,
        cluster_id: &str,
        pool_id: &str,
        req: &NodePoolUpdateRequest,
    ) -> Result<NodePool, DoError> {
        self.json(
            Method::PUT,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
            Some(req),
            "node_pool",
        )
        .await
    }

    /// 204; the pool's nodes are `deleting`, then the pool is gone (404).
    pub async fn node_pool_delete(&self, cluster_id: &str, pool_id: &str) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
        )
        .await
    }

    /// Deletes one node (`replace = true`: DOKS puts a new one in its place; otherwise the pool's
    /// count drops by one). 202 on DigitalOcean.
    pub async fn node_delete(
        &self,
        cluster_id: &str,
        pool_id: &str,
        node_id: &str,
        replace: bool,
    ) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}/nodes/{}?replace={}",
                seg(cluster_id),
                seg(pool_id),
                seg(node_id),
                u8::from(replace)
            ),
        )
        .await
    }

    // -------------------------------------------------------------- load balancers

    pub async fn load_balancer_list(&self) -> Result<Vec<LoadBalancer>, DoError> {
        self.list_all("/v2/load_balancers", "load_balancers").await
    }

    pub async fn load_balancer_get(&self, lb_id: &str) -> Result<LoadBalancer, DoError> {
        self.get(
            &format!("/v2/load_balancers/{}", seg(lb_id)),
            "load_balancer",
        )
        .await
    }
}
