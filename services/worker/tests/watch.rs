//! The worker's watch caches against the simulated region's Kubernetes API: resyncs of converged
//! DIs read the cluster's watches instead of listing, and what changes behind the worker's back
//! is put back within seconds, not at the next resync.

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;
use test_support::eventually;
use worker::plan::names;
use worker::runtime::Worker;

/// Kubernetes requests the simulator has served whose kind starts with `kind` (`LIST `; `` for
/// all).
fn kube_requests(env: &Env, kind: &str) -> u64 {
    env.sim
        .stats()
        .requests
        .get("kube")
        .map(|by_kind| {
            by_kind
                .iter()
                .filter(|(k, _)| k.starts_with(kind))
                .map(|(_, n)| n)
                .sum()
        })
        .unwrap_or(0)
}

/// Resyncs every half second over three converged DIs: dozens of passes, and no list beyond
/// what the watches themselves need (each pass listed every kind, 16 lists, before the caches),
/// and, as nothing changes, no read at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resyncs_of_converged_dis_read_the_watch_cache() {
    let env = env_with(None).await;
    let mut config = env.config();
    config.settings.resync = Duration::from_millis(500);
    // Passes half a second apart: the watches (on loopback) lag by far less.
    config.settings.cache_margin = Duration::from_millis(100);
    let w = Worker::start(config).await.unwrap();
    let dis = env.create_active(3).await;
    // The caches have listed once the DIs resync from them.
    let passes = w.stats().passes;
    eventually(Duration::from_secs(30), "a resync of each DI", async || {
        (w.stats().passes >= passes + 3).then_some(())
    })
    .await;

    env.sim.reset_stats();
    let passes = w.stats().passes;
    eventually(Duration::from_secs(60), "30 resyncs", async || {
        (w.stats().passes >= passes + 30).then_some(())
    })
    .await;
    let resyncs = w.stats().passes - passes;
    let listed = kube_requests(&env, "LIST ");
    // Nothing changed since each DI's last full pass: its resyncs end before reading anything
    // (each read its namespace, and parsed and rendered its objects).
    let read = kube_requests(&env, "GET ");
    assert!(
        listed < 16 && read < 6,
        "{listed} lists and {read} reads in {resyncs} resyncs: {:?}",
        env.sim.stats().requests.get("kube")
    );
    for d in &dis {
        assert_eq!(chat(&d.client, &d.url, &d.token).await, 200);
    }
    // A change of a pass's inputs (a new token) is applied by the next pass.
    let d = &dis[0];
    let value = env.token_create(d.record.id, "new").await;
    eventually(Duration::from_secs(30), "the new token works", async || {
        (chat(&d.client, &d.url, &value).await == 200).then_some(())
    })
    .await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// With resyncs five minutes apart, objects deleted or edited behind the worker's back come back
/// as the worker renders them within seconds: the cluster's watches wake the DI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_behind_the_workers_back_is_repaired_at_once() {
    let env = env_with(None).await;
    let mut config = env.config();
    config.settings.resync = Duration::from_secs(300);
    let w = Worker::start(config).await.unwrap();
    let dis = env.create_active(2).await;
    let (di, other) = (dis[0].record.id, dis[1].record.id);
    let ns = names::namespace(&di);
    let kube = env.cluster_kube().await;
    let deployment = |name: &str| {
        let kube = kube.clone();
        let (ns, name) = (ns.clone(), name.to_string());
        async move {
            kube.get("apps/v1", "Deployment", Some(&ns), &name)
                .await
                .unwrap()
        }
    };
    let models = kube
        .list("apps/v1", "Deployment", Some(&ns), "")
        .await
        .unwrap();
    let vllm = models
        .iter()
        .filter_map(|d| d["metadata"]["name"].as_str())
        .find(|n| n.starts_with("vllm-"))
        .expect("a model server Deployment")
        .to_string();
    let replicas = deployment(&vllm).await.unwrap()["spec"]["replicas"].clone();
    let routes = kube
        .list("gateway.networking.k8s.io/v1", "HTTPRoute", Some(&ns), "")
        .await
        .unwrap();
    let route = routes[0]["metadata"]["name"].as_str().unwrap().to_string();
    let other_ns = names::namespace(&other);
    let generations = async || {
        let theirs = kube
            .list("apps/v1", "Deployment", Some(&other_ns), "")
            .await
            .unwrap();
        theirs
            .iter()
            .map(|d| {
                (
                    d["metadata"]["name"].clone(),
                    d["metadata"]["generation"].clone(),
                )
            })
            .collect::<Vec<_>>()
    };
    let theirs = generations().await;
    let passes = w.stats().passes;

    // Someone deletes the DI's route and scales its model server to zero with a tool of theirs.
    kube.delete(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        Some(&ns),
        &route,
    )
    .await
    .unwrap();
    let intruder = cloud_clients::KubeClient::from_client(
        kube.client(),
        "kubectl-edit",
        cloud_clients::RetryConfig::default(),
    );
    intruder
        .apply(&json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": vllm, "namespace": ns},
            "spec": {"replicas": 0},
        }))
        .await
        .unwrap();

    eventually(
        Duration::from_secs(20),
        "the route and replicas back",
        async || {
            let route = kube
                .get(
                    "gateway.networking.k8s.io/v1",
                    "HTTPRoute",
                    Some(&ns),
                    &route,
                )
                .await
                .ok()??;
            let d = deployment(&vllm).await?;
            (d["spec"]["replicas"] == replicas).then_some(route)
        },
    )
    .await;
    let d = &dis[0];
    eventually(Duration::from_secs(30), "the DI serves again", async || {
        (chat(&d.client, &d.url, &d.token).await == 200).then_some(())
    })
    .await;
    // Woken, not resynced: a handful of passes, and the other DI's objects untouched.
    let woken = w.stats().passes - passes;
    assert!(woken <= 10, "{woken} passes");
    assert_eq!(generations().await, theirs);
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// An autoscaled DI is looked at every `autoscale_interval`: each look reads its metrics (one
/// pod-proxy request per ready model server, one for the endpoint picker) and its namespace,
/// and its objects from the watch cache. Before the caches a look also listed 16 kinds: 108
/// requests a minute at one server and production's 10 s interval, against 18 now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_autoscaled_dis_looks_read_its_metrics_and_no_lists() {
    let env = env_with(None).await;
    let mut config = env.config();
    config.settings.autoscale_interval = Duration::from_millis(300);
    config.settings.cache_margin = Duration::from_millis(100);
    let w = Worker::start(config).await.unwrap();
    let (rec, _) = env.create(1).await;
    let active = env.wait_active(rec.id, 1).await;
    let mut spec = env.spec(
        1,
        active.spec.as_ref().unwrap().model_deployments[0].model_id,
    );
    spec.model_deployments[0].workload_config =
        json!({"autoscaling": {"min_replicas": 1, "max_replicas": 2}});
    env.patch(rec.id, &spec).await;
    env.wait_active(rec.id, 2).await;
    let passes = w.stats().passes;
    eventually(Duration::from_secs(30), "a few looks", async || {
        (w.stats().passes >= passes + 3).then_some(())
    })
    .await;

    env.sim.reset_stats();
    let written = replicas_row_version(&env, rec.id).await;
    let passes = w.stats().passes;
    eventually(Duration::from_secs(60), "20 looks", async || {
        (w.stats().passes >= passes + 20).then_some(())
    })
    .await;
    let looks = w.stats().passes - passes;
    // Nothing served and nothing changed: the looks wrote nothing (the autoscaler's memory
    // included), where each could have been a transaction.
    assert_eq!(
        replicas_row_version(&env, rec.id).await,
        written,
        "idle looks rewrote the deployment's replicas row"
    );
    let (requests, listed) = (kube_requests(&env, ""), kube_requests(&env, "LIST "));
    let per_look = requests as f64 / looks as f64;
    println!("{per_look:.2} Kubernetes requests per look ({requests} in {looks}), {listed} lists");
    assert!(
        listed < 16 && per_look <= 3.5,
        "{requests} requests in {looks} looks: {:?}",
        env.sim.stats().requests.get("kube")
    );
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// Under steady load an autoscaled DI's looks move its servers' counters at every look: they
/// are kept in the worker, and the database is written only when the count or its timers
/// change, or when the recorded time of the last request is a tenth of the idle time to zero
/// stale (here 2 s; a minute at most). Each look under load was a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn looks_under_steady_load_write_only_what_a_takeover_needs() {
    let env = env_with(None).await;
    env.serving_model_on();
    let mut config = env.config();
    config.settings.autoscale_interval = Duration::from_millis(300);
    config.settings.cache_margin = Duration::from_millis(100);
    let w = Worker::start(config).await.unwrap();
    let serving = env.create_active(1).await.remove(0);
    let rec = &serving.record;
    let mut spec = env.spec(1, rec.spec.as_ref().unwrap().model_deployments[0].model_id);
    spec.model_deployments[0].workload_config = json!({"autoscaling":
        {"min_replicas": 1, "max_replicas": 2, "scale_to_zero_after_seconds": 20}});
    env.patch(rec.id, &spec).await;
    env.wait_active(rec.id, 2).await;
    let load = tokio::spawn({
        let (client, url, token) = (
            serving.client.clone(),
            serving.url.clone(),
            serving.token.clone(),
        );
        async move {
            loop {
                chat(&client, &url, &token).await;
            }
        }
    });
    // The first looks under load decide something (the load's start); then it is steady.
    let passes = w.stats().passes;
    eventually(
        Duration::from_secs(30),
        "a few looks under load",
        async || (w.stats().passes >= passes + 5).then_some(()),
    )
    .await;
    // Each write seen, by the time of the last request it recorded.
    let recorded = async || -> (String, i64) {
        region_store::sqlx::query_as(
            "SELECT xmin::text, (autoscaler->>'last_request_at')::bigint FROM deployment_replicas WHERE di_id = $1",
        )
        .bind(rec.id)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
    };
    let passes = w.stats().passes;
    let mut writes = vec![recorded().await];
    while w.stats().passes < passes + 30 {
        let now = recorded().await;
        if now.0 != writes.last().unwrap().0 {
            writes.push(now);
        }
        // Real time: the writes are the worker's, in Postgres; sampled far finer than the 2 s
        // between writes that the test asserts, so none is missed.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    load.abort();
    let apart: Vec<i64> = writes.windows(2).map(|w| w[1].1 - w[0].1).collect();
    // 30 looks at least 300 ms apart: a write once the recorded time is 2 s stale, each of the
    // new time (every look wrote, before).
    assert!(
        !apart.is_empty() && apart.iter().all(|ms| *ms >= 2000),
        "30 looks under load wrote the replicas row {} times, recording times {apart:?} ms apart",
        apart.len()
    );
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// The transaction that last wrote DI `id`'s replicas row (Postgres's `xmin`): it changes with
/// every write, even of the same values.
async fn replicas_row_version(env: &Env, id: uuid::Uuid) -> String {
    region_store::sqlx::query_scalar("SELECT xmin::text FROM deployment_replicas WHERE di_id = $1")
        .bind(id)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}
