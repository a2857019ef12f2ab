//! Shared test scaffolding: an in-process simulated region and clients pointed at it.

#![allow(dead_code)]

use std::time::Duration;

use cloud_clients::digitalocean::{ClusterCreateRequest, NodePoolCreateRequest};
use cloud_clients::{DoClient, DoClientOptions, KubeClient, KubeClientOptions, RetryConfig};
use region_sim::{Delays, FaultConfig, RegionSim, SimConfig};

pub const TOKEN: &str = "dop_v1_cloud_clients_test";
pub const REGION: &str = "atl1";
pub const FIELD_MANAGER: &str = "di-worker";

/// Quick retries so fault tests take milliseconds, not the production seconds.
pub fn fast_retry() -> RetryConfig {
    RetryConfig {
        min_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(40),
        max_attempts: 50,
        max_elapsed: Duration::from_secs(10),
        max_retry_after: Duration::from_secs(3),
        jitter: true,
    }
}

pub async fn start_sim(delays: Delays) -> RegionSim {
    let mut cfg = SimConfig::new(REGION, TOKEN);
    cfg.delays = delays;
    RegionSim::start(cfg).await.expect("start simulator")
}

pub fn do_client(sim: &RegionSim, retry: RetryConfig) -> DoClient {
    DoClient::with_options(
        &sim.base_url(),
        &sim.token(),
        DoClientOptions {
            timeout: Duration::from_secs(10),
            retry,
            ..Default::default()
        },
    )
    .expect("client")
}

pub fn cpu_cluster(name: &str) -> ClusterCreateRequest {
    ClusterCreateRequest {
        name: name.to_string(),
        region: REGION.to_string(),
        version: "latest".to_string(),
        tags: vec!["dedicated-inference".to_string()],
        node_pools: vec![NodePoolCreateRequest::new("cpu", "s-2vcpu-4gb", 1)],
        ..Default::default()
    }
}

pub async fn kube_client(do_api: &DoClient, cluster_id: &str, retry: RetryConfig) -> KubeClient {
    let yaml = do_api.kubeconfig(cluster_id).await.expect("kubeconfig");
    KubeClient::from_kubeconfig_yaml_with(
        &yaml,
        FIELD_MANAGER,
        KubeClientOptions {
            retry,
            ..Default::default()
        },
    )
    .await
    .expect("kube client")
}

/// Polls `f` until it yields a value (about 10 s at most).
pub async fn eventually<T>(what: &str, f: impl AsyncFnMut() -> Option<T>) -> T {
    test_support::eventually(Duration::from_secs(10), what, f).await
}

pub fn no_faults() -> FaultConfig {
    FaultConfig::default()
}

/// Calls answered with `status` in the simulator's recent-call log.
pub fn calls_answered(sim: &RegionSim, status: u16) -> usize {
    let suffix = format!("-> {status}");
    sim.stats()
        .recent_calls
        .iter()
        .filter(|c| c.ends_with(&suffix))
        .count()
}
