//! The only place that talks to the `sim-kube` crate.

use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::world::Delays;

/// Field manager of the simulated DigitalOcean cloud controller's writes.
const CCM_MANAGER: &str = "digitalocean-cloud-controller-manager";

fn config(d: &Delays, loader: &Arc<dyn sim_kube::ModelLoader>) -> sim_kube::ClusterConfig {
    sim_kube::ClusterConfig {
        model_load_delay: std::time::Duration::from_millis(d.model_load_ms),
        // The region simulator is the cloud controller: it assigns load balancer addresses
        // itself (pointing at the data plane), so sim-kube's placeholder addresses must not
        // appear first.
        lb_address_delay: std::time::Duration::from_secs(365 * 24 * 3600),
        gateway_address_delay: std::time::Duration::from_millis(d.gateway_address_ms),
        bearer_token: None,
        // Pods load their model as vLLM does: from the Hub their environment names.
        model_loader: Some(loader.clone()),
        // Pods answer `pods/proxy` with their metrics (vLLM's, or the endpoint picker's).
        pod_proxy: Some(Arc::new(dataplane_sim::pod_proxy::PodMetrics)),
    }
}

#[derive(Clone)]
pub struct Handle {
    cluster: sim_kube::Cluster,
    loader: Arc<dyn sim_kube::ModelLoader>,
}

impl Handle {
    /// An API server in this process, without a listener of its own (the front serves it).
    pub fn start(
        name: &str,
        d: &Delays,
        loader: Arc<dyn sim_kube::ModelLoader>,
    ) -> anyhow::Result<Handle> {
        Ok(Handle {
            cluster: sim_kube::Cluster::start_in_process(name, config(d, &loader))?,
            loader,
        })
    }
    /// One API request, served in process.
    pub async fn call(
        &self,
        req: http::Request<axum::body::Body>,
    ) -> http::Response<axum::body::Body> {
        self.cluster.call(req).await
    }
    pub fn upsert_node(&self, node: Value) {
        self.cluster.upsert_node(node);
    }
    pub fn delete_node(&self, name: &str) {
        self.cluster.delete_node(name);
    }
    pub fn list_all(&self) -> Vec<Value> {
        self.cluster.list_all()
    }
    pub fn snapshot(&self) -> Vec<std::sync::Arc<Value>> {
        self.cluster.snapshot()
    }
    pub fn subscribe(&self) -> broadcast::Receiver<u64> {
        self.cluster.subscribe()
    }
    pub fn resource_version(&self) -> u64 {
        self.cluster.resource_version()
    }
    pub fn set_delays(&self, d: &Delays) {
        let mut c = config(d, &self.loader);
        c.bearer_token = self.cluster.config().bearer_token;
        self.cluster.set_config(c);
    }
    /// Writes the Service's load balancer ingress through the `/status` subresource, as the
    /// DigitalOcean cloud controller does: the same request it would send, served in process.
    pub async fn set_service_ingress(
        &self,
        ns: &str,
        name: &str,
        ingress: Value,
    ) -> anyhow::Result<()> {
        let body = json!({"status": {"loadBalancer": {"ingress": ingress}}});
        let req = http::Request::patch(format!(
            "/api/v1/namespaces/{ns}/services/{name}/status?fieldManager={CCM_MANAGER}"
        ))
        .header("content-type", "application/merge-patch+json")
        .body(axum::body::Body::from(serde_json::to_vec(&body)?))?;
        let resp = self.cluster.call(req).await;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = axum::body::to_bytes(resp.into_body(), 64 * 1024)
                .await
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            anyhow::bail!("patching {ns}/{name} status: {status} {text}");
        }
        Ok(())
    }
    pub async fn shutdown(&self) {
        self.cluster.shutdown().await;
    }
}
