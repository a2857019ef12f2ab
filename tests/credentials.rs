//! Cluster credentials expire (on DOKS after 7 days by default; here after 2 s) while DIs
//! provision, update and resync: the workers renew them before they lapse, and fetch new ones
//! when a cluster refuses the old (401), so every DI converges and none waits on a dead
//! credential.

use std::time::{Duration, Instant};

use region_sim::{Api, Delays};
use reqwest::Method;
use serde_json::json;
use system_tests::CloudOptions;
use uuid::Uuid;

use crate::lifecycle::{
    assert_chat_ok, ca_client, create, di_path, fetch_ca, spec, start, wait_active,
};
use crate::revocation::second_token;

const MODEL: &str = "qwen/qwen2.5-7b-instruct";
/// The simulators' credential lifetime: shorter than provisioning and than an update.
const TTL: Duration = Duration::from_secs(2);

fn expiring() -> CloudOptions {
    CloudOptions {
        delays: Delays {
            cluster_provision_ms: 300,
            node_provision_ms: 2000,
            deletion_ms: 300,
            lb_provision_ms: 300,
            model_load_ms: 2000,
            gateway_address_ms: 50,
        },
        credential_ttl: TTL,
        resync: Some(Duration::from_millis(300)),
        ..CloudOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiring_cluster_credentials_never_stall_a_di() {
    let sys = start(expiring()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let sim = &sys.cloud(region).sim;

    // Provisioning outlasts the cluster's first credentials (nodes and model loads take 4 s).
    let began = Instant::now();
    let di = create(&sys, &api, region, "expiring", MODEL, 1).await;
    let (active, _) = wait_active(&sys, &api, region, &di.id, 1).await;
    let took = began.elapsed();
    assert!(
        took > TTL,
        "provisioning must outlast a credential lifetime to test anything: {took:?}"
    );
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .expect("an endpoint")
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di.id).await);
    assert_chat_ok(&client, &endpoint, &di.token, MODEL).await;

    // An update (scale 1 → 2: a node and a model load, 4 s) on credentials that lapse meanwhile.
    let mut scaled = spec(region, "expiring", MODEL, 2);
    scaled["version"] = json!(1);
    scaled["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(&di.id, ""),
            &api,
            Some(json!({ "spec": scaled })),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    wait_active(&sys, &api, region, &di.id, 2).await;

    // Resyncs (every 300 ms) over three lifetimes: in each, the worker reaches the cluster (the
    // simulator counts only calls it authenticated), and it renews credentials as they age
    // rather than on every pass.
    let before = sim.stats().credential_requests();
    let mut reached = Vec::new();
    for _ in 0..3 {
        let calls = sim.calls(Api::Kube);
        // Real time: a credential lifetime runs on the simulator's clock; each look is one.
        tokio::time::sleep(TTL).await;
        reached.push(sim.calls(Api::Kube) - calls);
    }
    let renewed = sim.stats().credential_requests() - before;
    println!(
        "authenticated Kubernetes calls per lifetime {reached:?}; credentials fetched {renewed}"
    );
    assert!(
        reached.iter().all(|n| *n > 0),
        "resyncs must reach the cluster in every credential lifetime: {reached:?}"
    );
    assert!(
        (2..=6).contains(&renewed),
        "over three lifetimes the credentials are renewed a few times, not on every pass: {renewed}"
    );

    // A change after all that still reaches the cluster: a new access token is accepted.
    second_token(&sys, &api, &di, &client, &endpoint).await;

    // A second DI in the same VPC (the same cluster, reached with the worker's client of it)
    // comes up too.
    let second = create(&sys, &api, region, "expiring-2", MODEL, 1).await;
    let (active, _) = wait_active(&sys, &api, region, &second.id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .expect("an endpoint");
    let client = ca_client(&fetch_ca(&sys, &api, &second.id).await);
    assert_chat_ok(&client, endpoint, &second.token, MODEL).await;
}
