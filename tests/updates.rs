//! Updates never interrupt serving, with delays like a real cloud's (seconds for nodes and model
//! loads, not milliseconds): a client calling both endpoints every 50 ms through every kind of
//! update sees no failed call, and a pure scale change adds or removes model servers without
//! touching the ones that serve.

use std::collections::BTreeSet;
use std::future::ready;
use std::time::Duration;

use region_sim::{Delays, Inventory};
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{CloudOptions, System};
use test_support::within;
use uuid::Uuid;

use crate::lifecycle::{
    assert_chat_ok, ca_client, create, di_path, fetch_ca, objects, spec, start, wait_active,
    CallLog, Caller,
};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";
const OTHER_MODEL: &str = "openai/gpt-oss-20b";
const H100: &str = "gpu-h100x1-80gb";
const H200: &str = "gpu-h200x1-141gb";

/// Seconds, as on a real cloud (scaled down from minutes, but long enough that any window
/// without a ready model server is seen by a client calling every 50 ms).
fn realistic() -> CloudOptions {
    CloudOptions {
        delays: Delays {
            cluster_provision_ms: 1000,
            node_provision_ms: 2000,
            deletion_ms: 2000,
            lb_provision_ms: 500,
            model_load_ms: 2000,
            gateway_address_ms: 200,
        },
        ..CloudOptions::default()
    }
}

/// The DI's model-server (vLLM) pods that are ready, by name.
fn ready_pods(sys: &System, region: &str, id: &str) -> BTreeSet<String> {
    ready_pods_in(&sys.cloud(region).sim.inventory(), id)
}

/// The DI's model-server (vLLM) pods, ready or not.
fn model_server_pods<'a>(inv: &'a Inventory, id: &str) -> Vec<&'a Value> {
    objects(inv, "Pod", id)
        .into_iter()
        .filter(|p| {
            p["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("vllm-"))
        })
        .collect()
}

fn ready_pods_in(inv: &Inventory, id: &str) -> BTreeSet<String> {
    model_server_pods(inv, id)
        .into_iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter(|p| {
            p["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// Whether nothing is under way in the region: every node running, every model server of the
/// DI ready and none leaving.
fn at_rest(inv: &Inventory, id: &str) -> bool {
    let servers = model_server_pods(inv, id).len();
    inv.cloud.nodes.iter().all(|n| n["state"] == "running")
        && servers > 0
        && ready_pods_in(inv, id).len() == servers
}

struct Update<'a> {
    sys: &'a System,
    api: &'a str,
    region: &'a str,
    id: &'a str,
    endpoints: Vec<String>,
    client: reqwest::Client,
    token: String,
}

impl Update<'_> {
    /// PATCHes `spec` (version `version - 1`) while a client calls every endpoint with `models`
    /// (see [`Caller::start`]), waits until the DI is active on `version` and returns what the
    /// client saw, after checking that not one call failed.
    async fn apply(&self, what: &str, spec: Value, version: i64, models: &[&str]) -> CallLog {
        let caller = Caller::start(
            self.client.clone(),
            self.endpoints.clone(),
            self.token.clone(),
            models.iter().map(|m| m.to_string()).collect(),
        );
        // Let the client get going on the old spec first: two answers from every endpoint.
        caller.until_ok(2 * self.endpoints.len() as u64).await;
        let patched = self
            .sys
            .call(
                Method::PATCH,
                &di_path(self.id, ""),
                self.api,
                Some(json!({ "spec": spec })),
            )
            .await;
        assert_eq!(patched.status, 202, "{what}: {}", patched.body);
        let (_, seen) = wait_active(self.sys, self.api, self.region, self.id, version).await;
        // And keep calling a little after the rollout: what it left must serve too. Four rounds
        // at the caller's pace are about half a second.
        caller.more_rounds(4).await;
        let log = caller.finish().await;
        println!("{what}: {seen:?}, {} calls ok, {:?}", log.ok, log.switches);
        assert!(
            log.failures.is_empty(),
            "{what}: {} failed calls (of {}): {:#?}",
            log.failures.len(),
            log.failures.len() as u64 + log.ok,
            log.failures
        );
        assert!(
            log.ok >= 10,
            "{what}: the client must have been calling: {log:?}"
        );
        log
    }
}

/// Scale up, GPU size, scale down, model, a deployment added and removed, a name change: each
/// under continuous calls to both endpoints, with node and model-load delays of seconds. The
/// PATCHes carry the `model_id` of each deployment, as a client that read the DI back does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_update_drops_a_request() {
    every_update(true).await;
}

/// The same with PATCH bodies as curl users, doctl spec files and a first Terraform apply write
/// them: the create's body with a change, no `model_id`. A deployment is still recognised as the
/// same one (by model, then by position), so a scale change is not a replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_update_without_model_ids_drops_a_request() {
    every_update(false).await;
}

async fn every_update(with_ids: bool) {
    let sys = start(realistic()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, region, "steady", MODEL, 1).await;
    let id = di.id.as_str();
    let (active, _) = wait_active(&sys, &api, region, id, 1).await;
    let endpoints: Vec<String> = ["public_endpoint_fqdn", "private_endpoint_fqdn"]
        .iter()
        .map(|k| {
            active["endpoints"][k]
                .as_str()
                .expect("an endpoint")
                .to_string()
        })
        .collect();
    let client = ca_client(&fetch_ca(&sys, &api, id).await);
    for e in &endpoints {
        assert_chat_ok(&client, e, &di.token, MODEL).await;
    }
    let u = Update {
        sys: &sys,
        api: &api,
        region,
        id,
        endpoints,
        client,
        token: di.token.clone(),
    };
    let at = |name: &str, model: &str, gpu: &str, scale: i64, version: i64| {
        let mut s = spec(region, name, model, scale);
        s["version"] = json!(version);
        if with_ids {
            s["model_deployments"][0]["model_id"] = json!(di.model_id);
        }
        s["model_deployments"][0]["accelerators"][0]["accelerator_slug"] = json!(gpu);
        s
    };

    // Scale 1 → 2 adds a model server and leaves the serving one alone.
    let before = ready_pods(&sys, region, id);
    assert_eq!(before.len(), 1, "{before:?}");
    u.apply("scale 1 → 2", at("steady", MODEL, H100, 2, 1), 2, &[MODEL])
        .await;
    let after = ready_pods(&sys, region, id);
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        before.is_subset(&after),
        "a scale-up must not replace the serving model server: {before:?} → {after:?}"
    );

    // Another GPU size: new nodes and new model servers, the old ones serve until they are ready.
    u.apply("H100 → H200", at("steady", MODEL, H200, 2, 2), 3, &[MODEL])
        .await;

    // Scale 2 → 1 removes a model server and leaves the other alone.
    let before = ready_pods(&sys, region, id);
    u.apply("scale 2 → 1", at("steady", MODEL, H200, 1, 3), 4, &[MODEL])
        .await;
    let after = ready_pods(&sys, region, id);
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(
        after.is_subset(&before),
        "a scale-down must keep a serving model server: {before:?} → {after:?}"
    );

    // Another model in the same deployment: the old one answers until the new one does.
    u.apply(
        "model change",
        at("steady", OTHER_MODEL, H200, 1, 4),
        5,
        &[MODEL, OTHER_MODEL],
    )
    .await;

    // A second deployment added, then removed: the first keeps serving throughout.
    let mut two = at("steady", OTHER_MODEL, H200, 1, 5);
    two["model_deployments"]
        .as_array_mut()
        .unwrap()
        .push(json!({
            "model_slug": MODEL, "model_provider": "hugging_face", "workload_config": {},
            "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": H100}]
        }));
    u.apply("deployment added", two, 6, &[OTHER_MODEL]).await;
    u.apply(
        "deployment removed",
        at("steady", OTHER_MODEL, H200, 1, 6),
        7,
        &[OTHER_MODEL],
    )
    .await;

    // A new name changes nothing that serves.
    let before = ready_pods(&sys, region, id);
    u.apply(
        "rename",
        at("steady-renamed", OTHER_MODEL, H200, 1, 7),
        8,
        &[OTHER_MODEL],
    )
    .await;
    assert_eq!(ready_pods(&sys, region, id), before);
}

/// Updates faster than a rollout: a model change, a scale-down before it finished, then a GPU
/// size the region has none of (as the soak drove it). The last update fails (`error`), and
/// what the earlier ones left keeps answering: the old model until the new one is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_that_fails_mid_rollout_leaves_the_endpoint_serving() {
    let sys = start(realistic()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let at = |model: &str, gpu: &str, scale: i64, version: i64| {
        let mut s = spec(region, "hurried", model, scale);
        s["version"] = json!(version);
        s["model_deployments"][0]["accelerators"][0]["accelerator_slug"] = json!(gpu);
        s
    };
    let body = json!({"spec": at(OTHER_MODEL, H200, 2, 0)});
    let created = sys
        .call(Method::POST, "/v2/dedicated-inferences", &api, Some(body))
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["dedicated_inference"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let token = created.body["token"]["value"].as_str().unwrap().to_string();
    let (active, _) = wait_active(&sys, &api, region, &id, 1).await;
    let model_id = active["spec"]["model_deployments"][0]["model_id"].clone();
    let endpoints: Vec<String> = ["public_endpoint_fqdn", "private_endpoint_fqdn"]
        .iter()
        .map(|k| active["endpoints"][k].as_str().unwrap().to_string())
        .collect();
    let client = ca_client(&fetch_ca(&sys, &api, &id).await);
    sys.cloud(region)
        .sim
        .set_gpu_capacity([(H200.to_string(), 8)].into_iter().collect());

    let caller = Caller::start(
        client,
        endpoints,
        token,
        vec![OTHER_MODEL.to_string(), MODEL.to_string()],
    );
    // Under way on the first spec: two answers from each endpoint.
    caller.until_ok(4).await;
    let mut last_gpu = at(MODEL, H100, 1, 3);
    last_gpu["model_deployments"][0]["model_id"] = model_id;
    for (spec, pause) in [
        (at(MODEL, H200, 2, 1), 1500),
        (at(MODEL, H200, 1, 2), 1500),
        (last_gpu, 0),
    ] {
        let patched = sys
            .call(
                Method::PATCH,
                &di_path(&id, ""),
                &api,
                Some(json!({ "spec": spec })),
            )
            .await;
        assert_eq!(patched.status, 202, "{}", patched.body);
        // A pace, not a wait: the next update comes in the middle of this one's rollout (nodes
        // and model loads take seconds), as the soak sent them.
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    let errored = sys
        .wait_status(&api, &id, "error", Duration::from_secs(60))
        .await;
    // Keep calling through what follows the failure: until what was under way in the region
    // (nodes going, model servers loading or leaving) has come to rest, and a few rounds on.
    let inventory = || sys.cloud(region).sim.inventory();
    let rest = within(Duration::from_secs(30), || {
        ready(at_rest(&inventory(), &id).then_some(()))
    })
    .await;
    if rest.is_none() {
        let inv = inventory();
        panic!(
            "the region did not come to rest after the failure: nodes {:?}, model servers {:#?}",
            inv.cloud.nodes,
            model_server_pods(&inv, &id)
        );
    }
    caller.more_rounds(4).await;
    let log = caller.finish().await;
    println!("{errored}\n{} calls ok, {:?}", log.ok, log.switches);
    assert!(
        log.failures.is_empty(),
        "{} failed calls (of {}): {:#?}",
        log.failures.len(),
        log.failures.len() as u64 + log.ok,
        log.failures
    );
}
