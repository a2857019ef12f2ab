//! Runs one simulated cluster with a GPU node and a CPU node until Ctrl-C, and
//! writes its kubeconfig to the path given as the first argument (default
//! `sim-kube.kubeconfig` in the current directory), for poking at it with kubectl.

use serde_json::json;
use sim_kube::{Cluster, ClusterConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "sim-kube.kubeconfig".into());
    let cluster = Cluster::start("sim", ClusterConfig::default()).await?;
    cluster.upsert_node(json!({
        "metadata": {"name": "cpu-1", "labels": {"doks.digitalocean.com/node-pool": "default"}},
        "status": {"capacity": {"cpu": "4", "memory": "8Gi", "pods": "110"}}
    }));
    cluster.upsert_node(json!({
        "metadata": {"name": "gpu-1", "labels": {
            "doks.digitalocean.com/node-pool": "gpu", "doks.digitalocean.com/gpu-brand": "nvidia"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "20", "memory": "240Gi", "pods": "110", "nvidia.com/gpu": "1"}}
    }));
    std::fs::write(&path, cluster.kubeconfig_yaml())?;
    println!("serving {} (kubeconfig: {path})", cluster.url());
    tokio::signal::ctrl_c().await?;
    cluster.shutdown().await;
    Ok(())
}
