//! Reaching the VPC's cluster: found, created, or trusted from the last pass.

use std::collections::BTreeMap;

use api_types::regional::Record;
use cloud_clients::digitalocean::{
    Cluster, ClusterCreateRequest, ClusterState, NodePoolCreateRequest,
};
use cloud_clients::{DoError, KubeClient};

use super::ledger::Ledger;
use super::{Pass, ReconcileError, Reconciler, Result, LEDGER_CLUSTER};
use crate::cluster_clients;
use crate::plan::{names, ClusterWait, Waiting};

impl Reconciler {
    /// The VPC's cluster `name` (its id) with a client, once it runs; until then, the pass to
    /// end with. Creates the cluster when there is none, recorded in the ledger first.
    pub(super) async fn running_cluster(
        &self,
        name: &str,
        rec: &Record,
        pass: &Pass,
        ledger: &mut Ledger<'_>,
    ) -> Result<std::result::Result<(String, KubeClient), Pass>> {
        let poll = self.settings.poll;
        let Some(cluster) = self.existing_cluster(name).await? else {
            let creating = self.start_creating_cluster(name, rec, pass, ledger).await?;
            return Ok(Err(creating));
        };
        if !ledger.use_cluster(name, &cluster.id).await? {
            // The last DI of the VPC is deleting it: once it is going, a new one is made.
            let wait = Waiting::Cluster {
                name: name.to_string(),
                state: ClusterWait::BeingDeleted,
            };
            return Ok(Err(pass.clone().wait(wait, poll)));
        }
        if cluster.status.state != ClusterState::Running {
            let state = format!("{:?}", cluster.status.state).to_lowercase();
            let wait = Waiting::Cluster {
                name: name.to_string(),
                state: ClusterWait::State(state),
            };
            return Ok(Err(pass.clone().wait(wait, poll)));
        }
        Ok(Ok((cluster.id.clone(), self.kube_for(&cluster.id).await?)))
    }

    /// The VPC's cluster `name`, if there is one (one being deleted does not count).
    async fn existing_cluster(&self, name: &str) -> Result<Option<Cluster>> {
        // A new VPC's cluster is recorded nowhere yet: then none exists, and the region's
        // clusters are not listed (a list for every new VPC made filling a region quadratic).
        // One known by id, or recorded, is looked for as before.
        let known = self
            .cluster_ids
            .lock()
            .expect("cluster ids")
            .contains_key(name);
        if known || self.store.ledger_cluster_recorded(name).await? {
            self.find_cluster(name, false).await
        } else {
            Ok(None)
        }
    }

    /// Creates the VPC's cluster `name`, recorded in the ledger first; returns the pass that
    /// waits for it to run.
    async fn start_creating_cluster(
        &self,
        name: &str,
        rec: &Record,
        pass: &Pass,
        ledger: &mut Ledger<'_>,
    ) -> Result<Pass> {
        let poll = self.settings.poll;
        ledger.record(LEDGER_CLUSTER, name, "", None).await?;
        let c = match self.create_cluster(name, rec).await {
            Ok(c) => c,
            // Another DI of the VPC (or a retried attempt) created it first: look again
            // at the next check, not after a failure's backoff.
            Err(e) if e.is_already_exists() => {
                let wait = Waiting::Cluster {
                    name: name.to_string(),
                    state: ClusterWait::BeingCreated,
                };
                return Ok(pass.clone().wait(wait, poll));
            }
            Err(e) => return Err(e.into()),
        };
        self.cluster_ids
            .lock()
            .expect("cluster ids")
            .insert(name.to_string(), c.id.clone());
        // Nobody can be retiring a cluster this pass just made.
        ledger.use_cluster(name, &c.id).await?;
        let wait = Waiting::Cluster {
            name: name.to_string(),
            state: ClusterWait::Creating,
        };
        Ok(pass.clone().wait(wait, poll))
    }

    /// The cluster `name` as the last pass that reached it left it: its id and a client, when
    /// both are still known and the client's credentials are not due for renewal (then the pass
    /// asks DigitalOcean, for the cluster and new credentials).
    pub(super) fn trusted_cluster(&self, name: &str) -> Option<(String, KubeClient)> {
        let id = self
            .cluster_ids
            .lock()
            .expect("cluster ids")
            .get(name)
            .cloned()?;
        let kube = self.kube.fresh(&id)?;
        Some((id, kube))
    }

    /// Forgets how to reach the cluster `name` (id `id`): the next pass asks DigitalOcean.
    pub(super) fn distrust_cluster(&self, name: &str, id: &str) {
        self.cluster_ids.lock().expect("cluster ids").remove(name);
        self.forget_kube(id);
    }

    pub(super) async fn create_cluster(
        &self,
        name: &str,
        rec: &Record,
    ) -> std::result::Result<Cluster, DoError> {
        let s = &self.settings;
        let mut system = NodePoolCreateRequest::new(
            format!("{name}-system"),
            &s.system_pool_size,
            s.system_pool_count.max(1),
        );
        system.labels = BTreeMap::from([(
            names::MANAGED_BY_LABEL.to_string(),
            names::MANAGED_BY.to_string(),
        )]);
        system.tags = vec!["dedicated-inference".to_string()];
        let req = ClusterCreateRequest {
            name: name.to_string(),
            region: s.region.clone(),
            version: s.kubernetes_version.clone(),
            vpc_uuid: Some(rec.vpc_uuid.to_string()),
            tags: vec!["dedicated-inference".to_string()],
            node_pools: vec![system],
            ..Default::default()
        };
        tracing::info!(di = %rec.id, cluster = name, "creating cluster");
        self.cloud.cluster_create(&req).await
    }

    /// The cluster named `name`; a cluster being deleted counts only when `deleting_too`.
    /// A cluster seen before is read by id (one small request); otherwise, or when that one is
    /// gone or no longer fits, the region's clusters are listed.
    pub(super) async fn find_cluster(
        &self,
        name: &str,
        deleting_too: bool,
    ) -> Result<Option<Cluster>> {
        let fits = |c: &Cluster| {
            c.name == name
                && (deleting_too
                    || !matches!(
                        c.status.state,
                        ClusterState::Deleting | ClusterState::Deleted
                    ))
        };
        let known = self
            .cluster_ids
            .lock()
            .expect("cluster ids")
            .get(name)
            .cloned();
        if let Some(id) = known {
            match self.cloud.cluster_get(&id).await {
                Ok(c) if fits(&c) => return Ok(Some(c)),
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
            self.cluster_ids.lock().expect("cluster ids").remove(name);
        }
        let clusters = self.cloud.cluster_list().await?;
        // Remember every live cluster the list shows, not just this one: the other DIs of the
        // region then read theirs by id instead of listing again.
        let mut ids = self.cluster_ids.lock().expect("cluster ids");
        for c in &clusters {
            if !matches!(
                c.status.state,
                ClusterState::Deleting | ClusterState::Deleted
            ) {
                ids.insert(c.name.clone(), c.id.clone());
            }
        }
        drop(ids);
        Ok(clusters.into_iter().find(fits))
    }

    /// A client of cluster `cluster_id` (see [`ClusterClients::get`]).
    pub(super) async fn kube_for(&self, cluster_id: &str) -> Result<KubeClient> {
        self.kube
            .get(&self.cloud, cluster_id)
            .await
            .map_err(|e| match e {
                cluster_clients::Error::Cloud(e) => e.into(),
                cluster_clients::Error::Kube(e) => ReconcileError::Transient(e.to_string()),
            })
    }

    pub(super) fn forget_kube(&self, cluster_id: &str) {
        self.kube.forget(cluster_id);
    }
}
