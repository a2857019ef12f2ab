//! Helpers shared by the integration tests: a cluster plus a kube-rs client
//! built from the cluster's own kubeconfig (so the kubeconfig is tested too).
#![allow(dead_code)]

use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;
use serde_json::{json, Value};
use sim_kube::{Cluster, ClusterConfig};

pub async fn start() -> (Cluster, Client) {
    start_with(ClusterConfig::default()).await
}

pub async fn start_with(config: ClusterConfig) -> (Cluster, Client) {
    let cluster = Cluster::start("test", config)
        .await
        .expect("cluster starts");
    let client = client_for(&cluster).await;
    (cluster, client)
}

pub async fn client_for(cluster: &Cluster) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(&cluster.kubeconfig_yaml()).expect("kubeconfig parses");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig loads");
    Client::try_from(config).expect("client builds")
}

/// Polls `check` until it returns Some, or panics after `timeout`.
pub async fn eventually<T>(
    timeout: Duration,
    what: &str,
    check: impl AsyncFnMut() -> Option<T>,
) -> T {
    test_support::eventually(timeout, what, check).await
}

/// A DOKS-like GPU node of pool `pool`.
pub fn gpu_node(name: &str, pool: &str, brand: &str, gpus: u32) -> Value {
    let resource = if brand == "amd" {
        "amd.com/gpu"
    } else {
        "nvidia.com/gpu"
    };
    json!({
        "metadata": {
            "name": name,
            "labels": {
                "doks.digitalocean.com/node-pool": pool,
                "doks.digitalocean.com/gpu-brand": brand,
            }
        },
        "spec": {"taints": [{"key": resource, "effect": "NoSchedule"}]},
        "status": {
            "capacity": {"cpu": "20", "memory": "240Gi", "pods": "110", resource: gpus.to_string()},
        }
    })
}

pub fn cpu_node(name: &str, pool: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"doks.digitalocean.com/node-pool": pool}},
        "status": {"capacity": {"cpu": "4", "memory": "8Gi", "pods": "110"}}
    })
}
