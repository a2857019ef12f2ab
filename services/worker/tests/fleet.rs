//! A new version of the worker whose rendering restarts model servers (a new image, a broken Hub
//! mirror) rolls across a region's active DIs a few at a time, canaries first, and halts by
//! itself when a canary cannot serve, against the simulated region and a real Postgres.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use region_store::{FleetBudget, RolloutState};
use serde_json::Value;
use support::*;
use test_support::eventually;
use worker::runtime::Worker;

const NEW_IMAGE: &str = "vllm/vllm-openai:v0.20.0";

/// The namespaces (DIs) whose model server Deployment runs `image` but has not finished rolling
/// to it, as the cluster shows them, and those running it at all.
fn rolling_to(deployments: &[Value], image: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut rolling = BTreeSet::new();
    let mut on = BTreeSet::new();
    for d in deployments {
        let name = d
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !name.starts_with("vllm-") {
            continue;
        }
        let runs = d
            .pointer("/spec/template/spec/containers/0/image")
            .and_then(Value::as_str)
            == Some(image);
        if !runs {
            continue;
        }
        let ns = d["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let int = |p: &str| d.pointer(p).and_then(Value::as_i64).unwrap_or(0);
        let wanted = int("/spec/replicas");
        let done = int("/status/observedGeneration") >= int("/metadata/generation")
            && int("/status/updatedReplicas") == wanted
            && int("/status/readyReplicas") == wanted
            && int("/status/replicas") == wanted;
        if !done {
            rolling.insert(ns.clone());
        }
        on.insert(ns);
    }
    (rolling, on)
}

async fn slots(env: &Env, query: &str) -> i64 {
    region_store::sqlx::query_scalar(query)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}

/// The upgrade of the issue: 100 active DIs, a worker version with a new model-server image and
/// a budget of 10 with 2 canaries. Never more than 10 DIs roll at once (in the store and in the
/// cluster), the canaries serve before any other DI starts, a DI called all along loses no
/// request, and every DI ends on the new image, active.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_image_rolls_a_few_dis_at_a_time_canaries_first() {
    // A node per DI, and one more for each DI rolling (its surge pod).
    let env = env_with(Some([(GPU.to_string(), 120)].into())).await;
    let mut config = env.config();
    config.concurrency = 16;
    config.db_max_connections = 8;
    // Room for 100 endpoint pickers (250m each) and 200 endpoint-auth replicas on the CPU pool.
    config.settings.system_pool_size = "s-4vcpu-8gb".into();
    config.settings.system_pool_count = 8;
    let old = Worker::start(config.clone()).await.unwrap();
    let mut dis = Vec::new();
    let n = 100;
    for _ in 0..n {
        dis.push(env.create(1).await);
    }
    eventually(Duration::from_secs(300), "100 DIs active", async || {
        let active = slots(
            &env,
            "SELECT count(*) FROM dedicated_inferences WHERE status = 'active'",
        )
        .await;
        (active == n as i64).then_some(())
    })
    .await;
    old.shutdown().await;

    let kube = env.cluster_kube().await;
    let before = kube.list("apps/v1", "Deployment", None, "").await.unwrap();
    assert!(rolling_to(&before, NEW_IMAGE).1.is_empty());

    // A customer calls one DI all through the upgrade.
    let calls = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let caller = {
        let (calls, failures, mut stopped) = (calls.clone(), failures.clone(), stopped.clone());
        let (rec, token) = dis[n / 2].clone();
        let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
        let rec = env.store.dedicated_inference_any(rec.id).await.unwrap();
        let url = rec.public_endpoint_fqdn.clone().expect("a public endpoint");
        tokio::spawn(async move {
            while !*stopped.borrow_and_update() {
                let status = chat(&client, &url, &token).await;
                calls.fetch_add(1, Ordering::SeqCst);
                if status != 200 {
                    failures.lock().unwrap().push(status);
                }
            }
        })
    };
    drop(stopped);

    config.settings.images.vllm_nvidia = NEW_IMAGE.into();
    config.settings.resync = Duration::from_secs(5);
    config.settings.fleet_budget = FleetBudget {
        max_rolling: 10,
        canaries: 2,
    };
    // The old worker's resync interval has passed: every DI is due for the new worker.
    region_store::sqlx::query("UPDATE work_items SET next_check_after = now()")
        .execute(env.store.pool())
        .await
        .unwrap();
    let new = Worker::start(config).await.unwrap();

    let (mut most_in_store, mut most_in_cluster) = (0, 0);
    eventually(
        Duration::from_secs(240),
        "every DI on the new image",
        async || {
            let rolling = slots(
                &env,
                "SELECT count(*) FROM fleet_slots WHERE state = 'rolling'",
            )
            .await;
            most_in_store = most_in_store.max(rolling);
            let deployments = kube.list("apps/v1", "Deployment", None, "").await.ok()?;
            let (in_cluster, on) = rolling_to(&deployments, NEW_IMAGE);
            most_in_cluster = most_in_cluster.max(in_cluster.len());
            let done = slots(
                &env,
                "SELECT count(*) FROM fleet_slots WHERE state = 'done'",
            )
            .await;
            (done == n as i64 && on.len() == n && in_cluster.is_empty()).then_some(())
        },
    )
    .await;
    stop.send(true).unwrap();
    caller.await.unwrap();

    assert!(most_in_store <= 10, "{most_in_store} slots rolling at once");
    assert!(
        most_in_cluster <= 10,
        "{most_in_cluster} DIs rolling at once"
    );
    assert!(
        most_in_cluster >= 2,
        "the rollout went several at once: {most_in_cluster}"
    );
    assert_eq!(
        slots(&env, "SELECT count(*) FROM fleet_slots WHERE canary").await,
        2
    );
    let canaries_first = slots(
        &env,
        "SELECT count(*) FROM fleet_slots s WHERE NOT canary
           AND started_at < (SELECT max(finished_at) FROM fleet_slots WHERE canary)",
    )
    .await;
    assert_eq!(canaries_first, 0, "a DI started before the canaries served");
    let failures = failures.lock().unwrap().clone();
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls > 20, "the customer called all along: {calls} calls");
    assert!(
        failures.is_empty(),
        "{} of {calls} calls failed: {failures:?}",
        failures.len()
    );
    for (d, _) in &dis {
        let r = env.store.dedicated_inference_any(d.id).await.unwrap();
        assert_eq!(r.status, Status::Active, "{}", d.id);
    }
    let events = env
        .store
        .events_list(dis[57].0.id, env.team, 1, 50)
        .await
        .unwrap();
    let reasons: Vec<&str> = events.items.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons.contains(&"PlatformUpdate") && reasons.contains(&"PlatformUpdated"),
        "the customer is told: {reasons:?}"
    );
    assert!(
        !reasons.contains(&"Repairing"),
        "a platform update is no repair: {reasons:?}"
    );
    let progress = env.store.fleet_progress().await.unwrap();
    assert_eq!((progress[0].done, progress[0].rolling), (100, 0));
    new.shutdown().await;
    env.sim.shutdown().await;
}

/// A version whose model servers cannot load (it points them at a Hub mirror that is down): the
/// canaries fail, the rollout halts with every other DI untouched, and the canaries go back to
/// what they ran and serve. A version that renders the same objects writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_canary_that_cannot_serve_halts_the_rollout_and_goes_back() {
    let env = env_with(None).await;
    let mut config = env.config();
    config.concurrency = 8;
    config.settings.resync = Duration::from_millis(500);
    let old = Worker::start(config.clone()).await.unwrap();
    let dis = env.create_active(6).await;

    // The same version again: nothing restarts, nothing is written.
    let same = Worker::start(config.clone()).await.unwrap();
    old.shutdown().await;
    // Two resyncs of each DI, counted rather than waited for.
    eventually(
        Duration::from_secs(60),
        "two resyncs of each DI",
        async || (same.stats().passes >= 12).then_some(()),
    )
    .await;
    assert_eq!(same.reconciler().kube_writes(), 0);
    assert!(env.store.fleet_progress().await.unwrap()[0].done == 0);
    same.shutdown().await;

    let kube = env.cluster_kube().await;
    let generations = async || {
        let deployments = kube.list("apps/v1", "Deployment", None, "").await.unwrap();
        deployments
            .iter()
            .map(|d| {
                (
                    format!("{}/{}", d["metadata"]["namespace"], d["metadata"]["name"]),
                    d["spec"]["template"].clone(),
                )
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let before = generations().await;

    let mut broken = config;
    broken.settings.hub_endpoint = Some("http://127.0.0.1:1".into());
    broken.settings.fleet_budget = FleetBudget {
        max_rolling: 10,
        canaries: 2,
    };
    let w = Worker::start(broken).await.unwrap();
    let halted = eventually(Duration::from_secs(120), "the rollout halts", async || {
        let p = env.store.fleet_progress().await.ok()?.remove(0);
        (p.state == RolloutState::Halted).then_some(p)
    })
    .await;
    assert!(
        halted
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("127.0.0.1:1"),
        "the halt says why: {halted:?}"
    );
    // Both canaries go back, and the rollout stays halted with no other DI touched.
    eventually(
        Duration::from_secs(60),
        "the canaries run what they ran",
        async || (generations().await == before).then_some(()),
    )
    .await;
    let took = slots(&env, "SELECT count(*) FROM fleet_slots").await;
    assert!(took <= 2, "{took} DIs took a slot");
    for d in &dis {
        let r = env
            .store
            .dedicated_inference_any(d.record.id)
            .await
            .unwrap();
        assert_eq!(r.status, Status::Active);
        assert_eq!(chat(&d.client, &d.url, &d.token).await, 200);
    }
    // Every DI resynced twice more while halted, counted rather than waited for.
    let passes = w.stats().passes;
    eventually(
        Duration::from_secs(60),
        "two more resyncs of each DI",
        async || (w.stats().passes >= passes + 12).then_some(()),
    )
    .await;
    assert_eq!(generations().await, before, "no DI rolls while halted");

    // A customer's token change is no spec change: its pass applies the token and keeps the
    // running templates, whether or not the DI took a slot.
    for d in &dis {
        let value = env.token_create(d.record.id, "while-halted").await;
        eventually(Duration::from_secs(30), "the new token works", async || {
            (chat(&d.client, &d.url, &value).await == 200).then_some(())
        })
        .await;
    }
    assert_eq!(generations().await, before, "a token change rolls no DI");
    assert_eq!(
        env.store.fleet_progress().await.unwrap()[0].state,
        RolloutState::Halted
    );
    w.shutdown().await;
    env.sim.shutdown().await;
}
