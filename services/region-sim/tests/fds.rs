//! A region's open file descriptors follow the connections clients keep open, not the clusters
//! and load balancers that exist: cluster APIs and load balancers are addresses on one shared
//! listener, and the simulator does not connect to itself. A test binary of its own, so that no
//! other test opens or closes descriptors while it counts them.

use std::time::Duration;

use base64::Engine;
use region_sim::{Delays, RegionSim, SimConfig};
use reqwest::{Client, Method};
use serde_json::{json, Value};

const TOKEN: &str = "dop_v1_fds_test";
const CLUSTERS: usize = 60;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd (Linux)")
        .count()
}

async fn do_call(
    http: &Client,
    sim: &RegionSim,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Value {
    let mut req = http
        .request(method, format!("{}{path}", sim.base_url()))
        .bearer_auth(TOKEN);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.unwrap_or(Value::Null)
}

/// Polls until `f` answers, for up to 30 s.
async fn eventually<T>(what: &str, f: impl AsyncFnMut() -> Option<T>) -> T {
    test_support::eventually(Duration::from_secs(30), what, f).await
}

/// The open descriptors once their count stands still from one look to the next: descriptors a
/// request leaves go on the runtime's own schedule, so the count is read once that has run its
/// course, however long it takes.
async fn settled_fds() -> usize {
    let mut last = None;
    eventually("the open file descriptors to settle", async || {
        let now = open_fds();
        let settled = (last == Some(now)).then_some(now);
        last = Some(now);
        settled
    })
    .await
}

/// Through the cluster's credentials (its own address, its own CA), with a client of its own
/// that is dropped afterwards: creates a LoadBalancer Service.
async fn add_load_balancer(http: &Client, sim: &RegionSim, id: &str) -> String {
    let creds = do_call(
        http,
        sim,
        Method::GET,
        &format!("/v2/kubernetes/clusters/{id}/credentials"),
        None,
    )
    .await;
    let ca = base64::engine::general_purpose::STANDARD
        .decode(creds["certificate_authority_data"].as_str().unwrap())
        .unwrap();
    let kube = Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
        .build()
        .unwrap();
    let server = creds["server"].as_str().unwrap().to_string();
    let r = kube
        .post(format!("{server}/api/v1/namespaces/default/services"))
        .bearer_auth(creds["token"].as_str().unwrap())
        .json(
            &json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lb"},
            "spec": {"type": "LoadBalancer", "selector": {"app": "x"},
                     "ports": [{"port": 443, "protocol": "TCP"}]}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    server
}

#[tokio::test]
async fn clusters_and_load_balancers_do_not_hold_file_descriptors() {
    let mut cfg = SimConfig::new("atl1", TOKEN);
    cfg.delays = Delays::instant();
    let sim = RegionSim::start(cfg).await.unwrap();
    let http = Client::new();
    // Warm up: the DO API connection this client keeps, the runtime's own descriptors.
    do_call(&http, &sim, Method::GET, "/v2/vpcs", None).await;
    let before = settled_fds().await;

    let mut servers = Vec::new();
    for i in 0..CLUSTERS {
        let c = do_call(
            &http,
            &sim,
            Method::POST,
            "/v2/kubernetes/clusters",
            Some(json!({
            "name": format!("c{i}"), "region": "atl1", "version": "latest",
            "node_pools": [{"name": "cpu", "size": "s-2vcpu-4gb", "count": 1}]})),
        )
        .await;
        let id = c["kubernetes_cluster"]["id"].as_str().unwrap().to_string();
        servers.push(add_load_balancer(&http, &sim, &id).await);
    }
    // Every load balancer active, at an address of its own.
    let lbs = eventually("every load balancer active", async || {
        let v = do_call(
            &http,
            &sim,
            Method::GET,
            "/v2/load_balancers?per_page=200",
            None,
        )
        .await;
        let lbs = v["load_balancers"].as_array().cloned().unwrap_or_default();
        (lbs.len() == CLUSTERS && lbs.iter().all(|l| l["status"] == "active")).then_some(lbs)
    })
    .await;
    let mut addresses: Vec<&str> = lbs.iter().map(|l| l["ip"].as_str().unwrap()).collect();
    addresses.extend(
        servers
            .iter()
            .map(|s| s.trim_start_matches("https://").split(':').next().unwrap()),
    );
    addresses.sort();
    addresses.dedup();
    assert_eq!(
        addresses.len(),
        2 * CLUSTERS,
        "a cluster API and a load balancer per cluster, each at its own address"
    );
    assert_eq!(sim.addresses_in_use(), 2 * CLUSTERS);
    // The kube clients are gone; the server side of their connections closes as it reads EOF.
    let after = eventually("the clients' connections closed", async || {
        let n = open_fds();
        (n <= before + 4).then_some(n)
    })
    .await;
    eprintln!("open file descriptors: {before} before, {after} with {CLUSTERS} clusters and load balancers");

    // Deleting the clusters gives every address back.
    let ids: Vec<String> = do_call(
        &http,
        &sim,
        Method::GET,
        "/v2/kubernetes/clusters?per_page=200",
        None,
    )
    .await["kubernetes_clusters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    for id in ids {
        do_call(
            &http,
            &sim,
            Method::DELETE,
            &format!("/v2/kubernetes/clusters/{id}"),
            None,
        )
        .await;
    }
    eventually("every address given back", async || {
        (sim.addresses_in_use() == 0).then_some(())
    })
    .await;
    sim.shutdown().await;
}
