//! The admin view of every simulated resource, so tests can assert that nothing leaked.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::world::CloudInventory;

/// One data-plane endpoint (a load balancer's listener on this machine).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndpointInfo {
    pub cluster_id: String,
    pub namespace: String,
    /// The LoadBalancer Service it stands for.
    pub service: String,
    pub url: String,
    pub port: u16,
    /// Whether the listener has a usable certificate.
    pub tls: bool,
    /// `none`, or `pool` when an HTTPRoute leads to an InferencePool.
    pub route: String,
    /// The models the ready pods serve (two while a Deployment rolls from one to another).
    pub models: Vec<String>,
    pub ready_endpoints: Vec<String>,
    /// Why the endpoint is not fully wired, if it is not.
    pub problems: Vec<String>,
    pub requests: u64,
}

/// Everything the simulated region holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Inventory {
    pub region: String,
    pub cloud: CloudInventory,
    /// Every Kubernetes object of every cluster, by cluster id.
    pub kubernetes: BTreeMap<String, Vec<Value>>,
    pub endpoints: Vec<EndpointInfo>,
}

impl Inventory {
    /// Resources that exist beyond a fresh region's defaults (the default VPC), described
    /// briefly; empty when nothing is left behind.
    pub fn leftovers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for v in &self.cloud.vpcs {
            if v["default"] != Value::Bool(true) {
                out.push(format!("vpc {} ({})", v["name"], v["id"]));
            }
        }
        for c in &self.cloud.clusters {
            out.push(format!("cluster {} ({})", c["name"], c["id"]));
        }
        for p in &self.cloud.node_pools {
            out.push(format!("node pool {} ({})", p["name"], p["id"]));
        }
        for n in &self.cloud.nodes {
            out.push(format!("node {}", n["name"]));
        }
        for l in &self.cloud.load_balancers {
            out.push(format!("load balancer {} ({})", l["name"], l["id"]));
        }
        for e in &self.endpoints {
            out.push(format!("endpoint {}", e.url));
        }
        out
    }

    /// Kubernetes objects of `kind` in any cluster.
    pub fn kube_objects(&self, kind: &str) -> Vec<&Value> {
        self.kubernetes
            .values()
            .flatten()
            .filter(|o| o["kind"] == kind)
            .collect()
    }
}
