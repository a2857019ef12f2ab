//! The worker end to end against the region simulator: a fresh regional database, the store
//! used directly (as the regional service would), one or two in-process workers.
//!
//! Needs DATABASE_URL (a Postgres the tests may create databases in).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::*;
use test_support::{eventually, until};
use worker::reconcile::{Reconciler, Settings};
use worker::runtime::Worker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_serve_scale_and_delete() {
    let env = env_with(None).await;
    let w1 = env.worker().await;
    let w2 = env.worker().await;
    let (rec, token) = env.create(1).await;
    let id = rec.id;

    // Active, with its endpoint answering the customer's token through the data plane.
    let active = env.wait_active(id, 1).await;
    assert_eq!(active.status_reason, None);
    let fqdn = active
        .public_endpoint_fqdn
        .clone()
        .expect("a public endpoint");
    assert!(
        fqdn.strip_prefix("https://")
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|a| a.ip().is_loopback()),
        "recorded as a URL: {fqdn}"
    );
    assert!(active.private_endpoint_fqdn.is_some());
    let accelerators = env
        .store
        .accelerators_list(id, env.team, None, 1, 20)
        .await
        .unwrap();
    assert_eq!(accelerators.total, 1, "{:?}", accelerators.items);
    assert_eq!(accelerators.items[0].slug, GPU);
    let ca = env.store.ca_certificate(id, env.team).await.unwrap();
    let client = ca_client(&ca);
    assert_eq!(chat(&client, &fqdn, &token).await, reqwest::StatusCode::OK);
    assert_eq!(
        chat(&client, &fqdn, "di_not-a-real-token").await,
        reqwest::StatusCode::UNAUTHORIZED
    );

    // Scale to 2: updating, then active v2.
    let model_id = active.spec.as_ref().unwrap().model_deployments[0].model_id;
    let mut spec = env.spec(2, model_id);
    spec.version = 1;
    env.store
        .dedicated_inference_patch(id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    let v2 = env.wait_active(id, 2).await;
    assert_eq!(
        v2.spec.as_ref().unwrap().model_deployments[0].accelerators[0].scale,
        2
    );
    two_accelerators(&env, id).await;
    let fqdn = v2.public_endpoint_fqdn.clone().unwrap();
    assert_eq!(chat(&client, &fqdn, &token).await, reqwest::StatusCode::OK);

    // Delete: gone, and nothing left in the region.
    env.store
        .dedicated_inference_delete(id, env.team)
        .await
        .unwrap();
    env.wait_gone(id).await;
    assert!(w1.stats().passes + w2.stats().passes > 0);
    w1.shutdown().await;
    w2.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pass_over_an_active_di_writes_nothing() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;
    w.shutdown().await;

    // A fresh reconciler, as another worker would be.
    let cloud = env.cloud();
    let r = Reconciler::new(env.store.clone(), cloud, env.config().settings);
    let do_before = env.sim.do_mutations();
    let kube_before = env.sim.kube_mutations();
    for _ in 0..2 {
        let pass = r.reconcile(rec.id).await.unwrap();
        assert_eq!(pass.waiting, None, "{pass:?}");
        assert_eq!((pass.do_writes, pass.kube_writes), (0, 0), "{pass:?}");
    }
    assert_eq!(
        env.sim.do_mutations(),
        do_before,
        "{:?}",
        env.sim.stats().mutation_log
    );
    // Not even a no-op server-side apply reaches the clusters: the passes only read.
    assert_eq!(
        env.sim.kube_mutations(),
        kube_before,
        "{:?}",
        env.sim.stats().requests
    );
    assert_eq!(r.kube_writes(), 0);
    assert_eq!(r.do_mutations(), 0);
    let after = env.store.dedicated_inference_any(rec.id).await.unwrap();
    assert_eq!(after.status, Status::Active);
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dis_of_a_new_vpc_claimed_together_share_one_cluster_without_a_failure() {
    let env = env_with(None).await;
    let (a, _) = env.create(1).await;
    let (b, _) = env.create(1).await;
    // Both are due before the worker starts, so their first passes run side by side; slow
    // DigitalOcean answers make both find no cluster before either creates one. The pass whose
    // create is refused waits for the other's cluster.
    env.sim.set_faults(region_sim::FaultConfig {
        do_api: region_sim::ApiFaults {
            latency_ms: 100,
            ..Default::default()
        },
        ..Default::default()
    });
    let w = env.worker().await;
    env.wait_active(a.id, 1).await;
    env.wait_active(b.id, 1).await;
    assert_eq!(w.stats().transient_failures, 0, "{:?}", w.stats());
    let cloud = env.cloud();
    assert_eq!(cloud.cluster_list().await.unwrap().len(), 1);
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_moved_is_recorded_by_the_next_resync() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, token) = env.create(1).await;
    let before = env.wait_active(rec.id, 1).await;
    w.shutdown().await;

    // The private load balancer's Service is deleted behind the worker's back; the one it
    // applies again gets another address.
    env.delete_private_service(rec.id).await;
    let cloud = env.cloud();

    let r = Reconciler::new(env.store.clone(), cloud, env.config().settings);
    converge(&r, rec.id, "the resync").await;
    let after = env.store.dedicated_inference_any(rec.id).await.unwrap();
    assert_eq!(after.status, Status::Active);
    assert_eq!(after.public_endpoint_fqdn, before.public_endpoint_fqdn);
    assert_ne!(after.private_endpoint_fqdn, before.private_endpoint_fqdn);
    let ca = env.store.certificate_authority(rec.id).await.unwrap();
    let endpoint = after.private_endpoint_fqdn.as_deref().unwrap();
    assert_eq!(
        chat(&ca_client(&ca.cert_pem), endpoint, &token).await,
        reqwest::StatusCode::OK
    );
    let events = env
        .store
        .events_list(rec.id, env.team, 1, 100)
        .await
        .unwrap();
    assert!(
        events.items.iter().any(|e| e.reason == "EndpointsChanged"),
        "{:?}",
        events.items
    );
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repair_of_an_active_di_is_told_in_its_events() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;

    // The private load balancer's Service is deleted behind the worker's back, and the DI's
    // resync is made due at once.
    env.delete_private_service(rec.id).await;
    region_store::sqlx::query("UPDATE work_items SET next_check_after = now() WHERE di_id = $1")
        .bind(rec.id)
        .execute(env.store.pool())
        .await
        .unwrap();

    let reasons = eventually(Duration::from_secs(30), "a Repaired event", || async {
        let events = env
            .store
            .events_list(rec.id, env.team, 1, 100)
            .await
            .unwrap();
        let reasons: Vec<String> = events.items.iter().map(|e| e.reason.clone()).collect();
        reasons.iter().any(|r| r == "Repaired").then_some(reasons)
    })
    .await;
    let count = |reason: &str| reasons.iter().filter(|r| *r == reason).count();
    assert_eq!(
        (
            count("Repairing"),
            count("EndpointsChanged"),
            count("Repaired")
        ),
        (1, 1, 1),
        "{reasons:?}"
    );
    let after = env.store.dedicated_inference_any(rec.id).await.unwrap();
    assert_eq!(after.status, Status::Active);
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// DigitalOcean requests (reads included) the simulator has served.
fn do_requests(env: &Env) -> u64 {
    env.sim
        .stats()
        .requests
        .get("do")
        .map(|by_kind| by_kind.values().sum())
        .unwrap_or(0)
}

/// DIs in new VPCs, one each: a cluster recorded nowhere cannot exist, so none of theirs is
/// looked for in a list of the region's clusters; filling a region with VPCs costs no list per
/// VPC (it did: one list of every cluster, page by page, for each new VPC). Deleting them
/// reads each DI's cluster by the id its ledger recorded (a teardown pass listed every cluster
/// of the region).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_filled_and_emptied_by_new_vpcs_never_lists_its_clusters() {
    let env = env_with(None).await;
    let mut dis = Vec::new();
    for i in 0..4 {
        let vpc = env.new_vpc(&format!("vpc-{i}")).await;
        dis.push(env.create_in(vpc, 1).await.0);
    }
    let w = env.worker().await;
    for di in &dis {
        env.wait_active(di.id, 1).await;
    }
    let lists = || {
        let requests = env.sim.stats().requests;
        let lists = requests
            .get("do")
            .and_then(|by_kind| by_kind.get("GET /v2/kubernetes/clusters"))
            .copied()
            .unwrap_or(0);
        (lists, format!("{requests:?}"))
    };
    assert_eq!(lists().0, 0, "{}", lists().1);
    assert_eq!(env.cloud().cluster_list().await.unwrap().len(), 4);
    let listed = lists().0;
    for di in &dis {
        env.store
            .dedicated_inference_delete(di.id, env.team)
            .await
            .unwrap();
    }
    // The VPCs are the customer's and stay: no wait_gone, which counts them as leftovers.
    for di in &dis {
        env.wait_for(di.id, "gone", Duration::from_secs(60), |r| r.gone)
            .await;
    }
    assert_eq!(lists().0, listed, "{}", lists().1);
    assert_eq!(env.cloud().cluster_list().await.unwrap().len(), 0);
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_asks_digitalocean_nothing_until_the_nodes_change() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;
    w.shutdown().await;

    let cloud = env.cloud();
    let r = Reconciler::new(env.store.clone(), cloud.clone(), env.config().settings);
    // The first pass of a fresh worker finds the cluster through DigitalOcean; the next one
    // reaches it directly and sees the pool's nodes as planned.
    r.reconcile(rec.id).await.unwrap();
    let before = do_requests(&env);
    let pass = r.reconcile(rec.id).await.unwrap();
    assert_eq!(pass.waiting, None, "{pass:?}");
    assert_eq!(do_requests(&env), before, "{:?}", env.sim.stats().requests);

    // The pool deleted behind the worker's back: once its node is gone from the cluster, a
    // resync notices and creates the pool again.
    let cluster = cloud.cluster_list().await.unwrap().remove(0);
    let pools = cloud.node_pool_list(&cluster.id).await.unwrap();
    let gpu = pools.iter().find(|p| p.size.starts_with("gpu-")).unwrap();
    cloud.node_pool_delete(&cluster.id, &gpu.id).await.unwrap();
    until(
        Duration::from_secs(30),
        "the deleted pool noticed",
        || async { r.reconcile(rec.id).await.unwrap().do_writes > 0 },
    )
    .await;
    let pools = cloud.node_pool_list(&cluster.id).await.unwrap();
    assert!(
        pools.iter().any(|p| p.name == gpu.name && p.id != gpu.id),
        "{pools:?}"
    );
    env.sim.shutdown().await;
}

/// What a claim or a release of DI `id`'s work item changes: its holder, its lease and when its
/// last pass was released.
async fn work_item(
    env: &Env,
    id: uuid::Uuid,
) -> (Option<String>, Option<uuid::Uuid>, Option<String>) {
    region_store::sqlx::query_as(
        "SELECT holder, lease_token, checked_at::text FROM work_items WHERE di_id = $1",
    )
    .bind(id)
    .fetch_one(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_gpu_capacity_is_an_error_with_a_reason_until_the_spec_changes() {
    let env = env_with(Some(BTreeMap::from([(GPU.to_string(), 1)]))).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(2).await;
    let failed = env
        .wait_for(rec.id, "error", Duration::from_secs(30), |r| {
            r.status == Status::Error
        })
        .await;
    assert_eq!(failed.status_reason.as_deref(), Some("CapacityExhausted"));
    // Not retried: it stays in error, even with a retry and a resync due (its work item is
    // aged past both). Another DI that fails the same way shows that the worker has claimed
    // work since, and this one's item, due long before, would have come first.
    // The failed pass records the error before it gives its lease back; aged before that
    // release, the item would be reset by it and the check below would prove nothing.
    until(
        Duration::from_secs(10),
        "the failed pass's lease released",
        async || work_item(&env, rec.id).await.0.is_none(),
    )
    .await;
    let before = w.stats();
    env.age(rec.id, Duration::from_secs(3600)).await;
    let item = work_item(&env, rec.id).await;
    let (other, _) = env.create(2).await;
    env.wait_for(
        other.id,
        "the other DI in error",
        Duration::from_secs(30),
        |r| r.status == Status::Error,
    )
    .await;
    assert_eq!(
        work_item(&env, rec.id).await,
        item,
        "an error DI is not claimed again"
    );
    assert_eq!(
        w.stats().permanent_failures,
        before.permanent_failures + 1,
        "the other DI's failure alone: an error DI is not retried"
    );
    env.delete_until_gone(other.id).await;
    // A spec that fits: it recovers.
    let model_id = failed.pending_spec.as_ref().unwrap().model_deployments[0].model_id;
    let spec = env.spec(1, model_id);
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    env.wait_active(rec.id, 2).await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_lease_expires_and_another_finishes() {
    let env = env_with(None).await;
    let mut cfg = env.config();
    cfg.lease = Duration::from_secs(1);
    let w1 = Worker::start(cfg).await.unwrap();
    let (rec, token) = env.create(1).await;
    // Let w1 start provisioning, then kill it mid-way.
    env.wait_for(rec.id, "provisioning", Duration::from_secs(20), |r| {
        r.status == Status::Provisioning
    })
    .await;
    w1.kill();
    let w2 = env.worker().await;
    let active = env.wait_active(rec.id, 1).await;
    let inv = env.sim.inventory();
    let gpu_pools = inv
        .cloud
        .node_pools
        .iter()
        .filter(|p| p["size"] == GPU)
        .count();
    assert_eq!(gpu_pools, 1, "no duplicate node pool");
    assert_eq!(inv.cloud.clusters.len(), 1, "no duplicate cluster");
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    assert_eq!(
        chat(
            &client,
            active.public_endpoint_fqdn.as_deref().unwrap(),
            &token
        )
        .await,
        reqwest::StatusCode::OK
    );
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w2.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_during_provisioning_leaves_nothing() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_for(rec.id, "provisioning", Duration::from_secs(20), |r| {
        r.status == Status::Provisioning
    })
    .await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// Silences "unused" for the settings constructor used by other test files.
#[allow(dead_code)]
fn _settings() -> Settings {
    Settings::new("atl1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_with_faults_injected_on_every_api() {
    let env = env_with(None).await;
    env.sim.set_faults(region_sim::FaultConfig {
        do_api: region_sim::ApiFaults {
            error_rate: 0.2,
            rate_limit_rate: 0.1,
            retry_after_secs: 0,
            latency_ms: 0,
            ..Default::default()
        },
        kube: region_sim::ApiFaults {
            error_rate: 0.1,
            rate_limit_rate: 0.05,
            retry_after_secs: 0,
            latency_ms: 0,
            ..Default::default()
        },
        data_plane: region_sim::ApiFaults {
            error_rate: 0.2,
            ..Default::default()
        },
    });
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;
    let model_id = env
        .store
        .dedicated_inference_any(rec.id)
        .await
        .unwrap()
        .spec
        .unwrap()
        .model_deployments[0]
        .model_id;
    let mut spec = env.spec(2, model_id);
    spec.version = 1;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    env.wait_active(rec.id, 2).await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_mid_rollout_supersedes_the_spec_rolling_out() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, token) = env.create(1).await;
    let active = env.wait_active(rec.id, 1).await;
    let model_id = active.spec.unwrap().model_deployments[0].model_id;
    let mut v2 = env.spec(3, model_id);
    v2.version = 1;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&v2), None, false)
        .await
        .unwrap();
    let mut v3 = env.spec(2, model_id);
    v3.version = 2;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&v3), None, false)
        .await
        .unwrap();
    let done = env.wait_active(rec.id, 3).await;
    assert_eq!(
        done.spec.unwrap().model_deployments[0].accelerators[0].scale,
        2
    );
    two_accelerators(&env, rec.id).await;
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    assert_eq!(
        chat(
            &client,
            done.public_endpoint_fqdn.as_deref().unwrap(),
            &token
        )
        .await,
        reqwest::StatusCode::OK
    );
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase_without_progress_becomes_an_event_then_an_error() {
    let env = env_with(None).await;
    // Model servers that never finish loading.
    let mut d = small_delays();
    d.model_load_ms = 3_600_000;
    env.sim.set_delays(d);
    let mut cfg = env.config();
    cfg.stall_timeout = Duration::from_secs(2);
    let w = Worker::start(cfg).await.unwrap();
    let (rec, _token) = env.create(1).await;
    let failed = env
        .wait_for(rec.id, "stalled", Duration::from_secs(30), |r| {
            r.status == Status::Error
        })
        .await;
    assert_eq!(failed.status_reason.as_deref(), Some("Stalled"));
    let events = env
        .store
        .events_list(rec.id, env.team, 1, 100)
        .await
        .unwrap();
    let reasons: Vec<&str> = events.items.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"Slow"), "{reasons:?}");
    assert!(reasons.contains(&"Stalled"), "{reasons:?}");
    // Delete still cleans up.
    env.sim.set_delays(small_delays());
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// Two DIs of one VPC share its cluster, a namespace each. Their NetworkPolicies, as the worker
/// wrote them and as a CNI reads them, admit into a DI's namespace only its own gateway (to
/// its EPP and model servers) and the load balancers (to the gateway's HTTPS port), and both
/// endpoints still serve. Deleting one DI takes its policies with its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dis_sharing_a_cluster_are_isolated_by_network_policies() {
    use region_sim::routing::{ingress_admits, Source};
    use serde_json::{json, Value};
    use std::sync::Arc;
    use worker::plan::names;

    let env = env_with(None).await;
    let w = env.worker().await;
    let dis = env.create_active(2).await;
    for d in &dis {
        assert_eq!(
            chat(&d.client, &d.url, &d.token).await,
            reqwest::StatusCode::OK
        );
    }
    let (a, b) = (&dis[0].record, &dis[1].record);

    let kube = env.cluster_kube().await;
    let objects = |ns: String| {
        let kube = kube.clone();
        async move {
            let mut objs = Vec::new();
            for (api_version, kind) in [("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Pod")] {
                objs.extend(kube.list(api_version, kind, Some(&ns), "").await.unwrap());
            }
            objs.into_iter().map(Arc::new).collect::<Vec<Arc<Value>>>()
        }
    };
    let (ns_a, ns_b) = (names::namespace(&a.id), names::namespace(&b.id));
    let objs = objects(ns_a.clone()).await;
    assert!(objs.iter().any(|o| o["kind"] == "NetworkPolicy"));
    let model = a.spec.as_ref().unwrap().model_deployments[0]
        .model_id
        .unwrap();
    let vllm = worker::plan::manifests::pool_selector(&model);
    let epp = json!({names::EPP_LABEL: names::inference_pool(&model)});
    let gateway = json!({names::GATEWAY_NAME_LABEL: names::GATEWAY});
    let own_gateway = Source::Pod {
        ns: &ns_a,
        labels: &gateway,
    };
    let own_epp = Source::Pod {
        ns: &ns_a,
        labels: &epp,
    };
    let other_gateway = Source::Pod {
        ns: &ns_b,
        labels: &gateway,
    };
    let other_vllm = Source::Pod {
        ns: &ns_b,
        labels: &vllm,
    };
    let admits =
        |labels: &Value, port: i64, from: Source| ingress_admits(&objs, &ns_a, labels, port, from);
    // The data path.
    assert!(
        admits(&gateway, 443, Source::Outside),
        "load balancer → gateway"
    );
    assert!(admits(&epp, 9002, own_gateway), "gateway → EPP");
    assert!(admits(&vllm, 8000, own_gateway), "gateway → vLLM");
    assert!(admits(&vllm, 8000, own_epp), "EPP → vLLM metrics");
    // Nothing else: not the other DI's pods, not the outside, not other ports.
    for from in [other_gateway, other_vllm, Source::Outside] {
        assert!(!admits(&vllm, 8000, from), "{from:?} → vLLM");
        assert!(!admits(&epp, 9002, from), "{from:?} → EPP");
        assert!(!admits(&epp, 9090, from), "{from:?} → EPP metrics");
    }
    assert!(!admits(&epp, 9090, own_gateway), "only the ext-proc port");
    assert!(
        !admits(&gateway, 15021, Source::Outside),
        "only the HTTPS port"
    );
    let anything = json!({"app": "something-else"});
    assert!(!admits(&anything, 80, own_gateway), "default deny");

    // Deleting A removes its policies with its namespace; B keeps its own and keeps serving.
    env.delete_until_gone(a.id).await;
    assert!(kube
        .list("networking.k8s.io/v1", "NetworkPolicy", Some(&ns_a), "")
        .await
        .unwrap()
        .is_empty());
    assert!(objects(ns_b)
        .await
        .iter()
        .any(|o| o["kind"] == "NetworkPolicy"));
    let b = &dis[1];
    assert_eq!(
        chat(&b.client, &b.url, &b.token).await,
        reqwest::StatusCode::OK
    );
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// The worker probes each endpoint with a credential of that DI alone: DIs become active (the
/// probe passes), one DI's probe token is refused by another DI's endpoint (they share a
/// cluster), a rotated probe token stops working within seconds while the new one works, and
/// the token is deleted with its DI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_credential_is_one_dis_own_and_revocable() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (a, _) = env.create(1).await;
    let (b, token_b) = env.create(1).await;
    let mut endpoints = Vec::new();
    for id in [a.id, b.id] {
        let active = env.wait_active(id, 1).await;
        let client = ca_client(&env.store.ca_certificate(id, env.team).await.unwrap());
        endpoints.push((client, active.public_endpoint_fqdn.unwrap()));
    }
    let [(client_a, url_a), (client_b, url_b)] = &endpoints[..] else {
        unreachable!()
    };
    let probe_a = env.store.probe_token(a.id).await.unwrap();
    let probe_b = env.store.probe_token(b.id).await.unwrap();
    assert_ne!(probe_a, probe_b);
    assert_eq!(
        env.store.probe_token(a.id).await.unwrap(),
        probe_a,
        "stable"
    );
    let (ok, refused) = (reqwest::StatusCode::OK, reqwest::StatusCode::UNAUTHORIZED);
    // Each endpoint takes its own DI's probe token; another DI's in the same cluster refuses it.
    for (client, url, token, status) in [
        (client_a, url_a, &probe_a, ok),
        (client_b, url_b, &probe_a, refused),
        (client_a, url_a, &probe_b, refused),
    ] {
        assert_eq!(chat(client, url, token).await, status, "{url}");
    }

    // Rotation: the old token is refused within seconds, the new one works, B is untouched.
    env.store.probe_token_rotate(a.id).await.unwrap();
    let rotated = env.store.probe_token(a.id).await.unwrap();
    assert_ne!(rotated, probe_a);
    until(
        Duration::from_secs(5),
        "the old probe token refused",
        || async { chat(client_a, url_a, &probe_a).await == refused },
    )
    .await;
    for (client, url, token) in [
        (client_a, url_a, &rotated),
        (client_b, url_b, &token_b),
        (client_b, url_b, &probe_b),
    ] {
        assert_eq!(chat(client, url, token).await, ok, "{url}");
    }

    // Deleted with its DI.
    env.delete_until_gone(a.id).await;
    assert!(matches!(
        env.store.probe_token(a.id).await,
        Err(region_store::StoreError::NotFound)
    ));
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// Runs passes of `r` over DI `id` until one has nothing left to wait for.
async fn converge(r: &Reconciler, id: uuid::Uuid, what: &str) {
    until(
        Duration::from_secs(30),
        format!("{what}: converged"),
        || async { r.reconcile(id).await.unwrap().waiting.is_none() },
    )
    .await;
}

/// Waits until DI `id` shows its two accelerators.
async fn two_accelerators(env: &Env, id: uuid::Uuid) {
    until(Duration::from_secs(20), "two accelerators", || async {
        let a = env
            .store
            .accelerators_list(id, env.team, None, 1, 20)
            .await
            .unwrap();
        a.total == 2
    })
    .await;
}

/// A cluster that refuses the worker's credentials before they are due for renewal (revoked):
/// the pass that meets the 401 fetches fresh ones and finishes, in a resync and in an update,
/// instead of failing and waiting for a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_cluster_credentials_are_replaced_within_the_pass() {
    let env = env_with(None).await;
    let (rec, _token) = env.create(1).await;
    // No retries inside the clients: a pass that fails shows.
    let r = env.reconciler(cloud_clients::RetryConfig::none());
    converge(&r, rec.id, "active").await;
    // A resync: the worker reaches the cluster with the client it keeps.
    let fetched = env.sim.stats().credential_requests();
    let pass = r.reconcile(rec.id).await.unwrap();
    assert_eq!(pass.waiting, None, "{pass:?}");
    assert_eq!(
        env.sim.stats().credential_requests(),
        fetched,
        "a fresh client is kept"
    );

    env.sim.revoke_cluster_credentials();
    let pass = r
        .reconcile(rec.id)
        .await
        .expect("a resync on revoked credentials renews them and succeeds");
    assert_eq!(pass.waiting, None, "{pass:?}");
    assert_eq!(env.sim.stats().credential_requests(), fetched + 1);

    // An update: the first pass of the rollout meets revoked credentials.
    let active = env.wait_active(rec.id, 1).await;
    let mut spec = env.spec(
        2,
        active.spec.as_ref().unwrap().model_deployments[0].model_id,
    );
    spec.version = 1;
    env.patch(rec.id, &spec).await;
    env.sim.revoke_cluster_credentials();
    let pass = r
        .reconcile(rec.id)
        .await
        .expect("an update's pass on revoked credentials renews them and goes on");
    assert_eq!(pass.status, Some(Status::Updating), "{pass:?}");
    assert_eq!(env.sim.stats().credential_requests(), fetched + 2);
    converge(&r, rec.id, "the update").await;
    env.wait_active(rec.id, 2).await;
    env.sim.shutdown().await;
}

/// Credentials due for renewal while DigitalOcean fails the renewal: the worker goes on with the
/// current ones, which the cluster still accepts, and renews them at the next chance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_goes_on_with_credentials_still_valid() {
    // Renewal is due two thirds into the 3 s: after 2 s, with 1 s still valid.
    let env = env_with_sim(|cfg| cfg.credential_ttl = Duration::from_secs(3)).await;
    let (rec, _token) = env.create(1).await;
    let r = env.reconciler(cloud_clients::RetryConfig::none());
    converge(&r, rec.id, "active").await;
    // Fresh credentials for the resyncs to come, then wait until they are due.
    env.sim.revoke_cluster_credentials();
    r.reconcile(rec.id).await.unwrap();
    env.clock.advance(Duration::from_millis(2200));
    // The resync reads the cluster (call 0), then asks for credentials (call 1): refused.
    let fetched = env.sim.stats().credential_requests();
    env.sim
        .arm_fault(region_sim::Api::Do, 1, region_sim::ArmedKind::Refuse)
        .unwrap();
    let pass = r
        .reconcile(rec.id)
        .await
        .expect("the pass goes on with the credentials still valid");
    assert_eq!(pass.waiting, None, "{pass:?}");
    let fired = env.sim.fired_faults();
    assert!(
        fired
            .last()
            .is_some_and(|f| f.request.ends_with("/credentials")),
        "the renewal was refused: {fired:?}"
    );
    assert_eq!(env.sim.stats().credential_requests(), fetched + 1);
    // The next pass renews them.
    r.reconcile(rec.id).await.unwrap();
    assert_eq!(env.sim.stats().credential_requests(), fetched + 2);
    env.sim.shutdown().await;
}

/// A Hugging Face Hub for the model servers (the simulator's stand-in for the public Hub): the
/// model's repository is gated; tokens in `granted` may read it, others get huggingface.co's
/// 403 `GatedRepo` answer. Returns its URL.
async fn gated_hub(granted: std::sync::Arc<std::sync::Mutex<Vec<String>>>) -> String {
    use axum::http::{HeaderMap, StatusCode};
    let app = axum::Router::new()
        .route(
            "/{*path}",
            axum::routing::get(
                |axum::extract::Path(path): axum::extract::Path<String>,
                 axum::extract::State(granted): axum::extract::State<
                    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
                >,
                 headers: HeaderMap| async move {
                    let token = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "))
                        .unwrap_or_default()
                        .to_string();
                    let mut refusal = HeaderMap::new();
                    if path != format!("{MODEL}/resolve/main/config.json") {
                        refusal.insert("x-error-code", "RepoNotFound".parse().unwrap());
                        return (StatusCode::UNAUTHORIZED, refusal, "");
                    }
                    if granted.lock().unwrap().contains(&token) {
                        return (StatusCode::OK, refusal, "{}");
                    }
                    refusal.insert("x-error-code", "GatedRepo".parse().unwrap());
                    (StatusCode::FORBIDDEN, refusal, "")
                },
            ),
        )
        .with_state(granted);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Creates a DI whose model servers get `hf_token` (as a customer's Hugging Face token).
async fn create_with_hf_token(env: &Env, hf_token: &str) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    let req = api_types::regional::CreateRequest {
        id,
        team_id: env.team,
        spec: env.spec(1, None),
        hugging_face_token: Some(hf_token.into()),
        managed_token: api_types::regional::NewToken {
            id: uuid::Uuid::new_v4(),
            name: "managed".into(),
            sha256_hex: common::tokens::sha256_hex(&common::tokens::mint("di_")),
        },
    };
    env.store
        .dedicated_inference_create(&req, &regional::ca::generate(id).expect("CA"))
        .await
        .unwrap();
    id
}

/// A model server whose Hub refuses its repository crash-loops; after its second restart the
/// DI is `error` with reason ModelLoadFailed and the Hub's refusal (never the token) in its
/// message, while a DI of the same model whose token the Hub accepts becomes active. Once the
/// Hub grants the token and the spec is submitted again, the next restart loads: active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_the_hub_refuses_is_an_error_with_the_hubs_words() {
    let granted = std::sync::Arc::new(std::sync::Mutex::new(vec!["hf_granted".to_string()]));
    let hub = gated_hub(granted.clone()).await;
    let env = env_with_sim(|cfg| cfg.default_hub = Some(hub.clone())).await;
    let w = env.worker().await;
    let served = create_with_hf_token(&env, "hf_granted").await;
    let refused = create_with_hf_token(&env, "hf_not_granted_0123456789abcdef").await;

    let failed = env
        .wait_for(refused, "error", Duration::from_secs(30), |r| {
            r.status == Status::Error
        })
        .await;
    assert_eq!(failed.status_reason.as_deref(), Some("ModelLoadFailed"));
    let events = env
        .store
        .events_list(refused, env.team, 1, 100)
        .await
        .unwrap();
    let error = events
        .items
        .iter()
        .find(|e| e.reason == "ModelLoadFailed")
        .unwrap_or_else(|| panic!("{:#?}", events.items));
    let url = format!("{hub}/{MODEL}/resolve/main/config.json");
    assert!(
        error
            .message
            .starts_with(&format!("Model {MODEL} failed to load (pod vllm-")),
        "{}",
        error.message
    );
    assert!(
        error.message.ends_with(&format!(
            "restarted 2 times): GatedRepoError: 403 Client Error. Cannot access gated repo for url {url}."
        )),
        "{}",
        error.message
    );
    assert!(
        !error.message.contains("hf_not_granted"),
        "{}",
        error.message
    );
    env.wait_active(served, 1).await;

    // In error it still serves, so it keeps its token check: the auth objects of a DI that went
    // to error before they existed (removed here behind the worker's back) come back with the
    // next token change, as the token Secret does.
    let kube = env.cluster_kube().await;
    let ns = format!("di-{refused}");
    let policy = ("gateway.envoyproxy.io/v1alpha1", "SecurityPolicy");
    kube.delete(policy.0, policy.1, Some(&ns), "endpoint-auth")
        .await
        .unwrap();
    kube.delete("apps/v1", "Deployment", Some(&ns), "endpoint-auth")
        .await
        .unwrap();
    let value = common::tokens::mint("di_");
    let new_token = api_types::regional::NewToken {
        id: uuid::Uuid::new_v4(),
        name: "after-error".into(),
        sha256_hex: common::tokens::sha256_hex(&value),
    };
    env.store
        .token_create(refused, env.team, &new_token)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the auth policy back on the DI in error",
        async || {
            let p = kube
                .get(policy.0, policy.1, Some(&ns), "endpoint-auth")
                .await
                .ok()??;
            (p["status"]["ancestors"][0]["conditions"][0]["status"] == "True").then_some(())
        },
    )
    .await;

    // Access granted; the same spec again: the failure from before is not held against it,
    // and the crash-looping server's next restart loads.
    granted
        .lock()
        .unwrap()
        .push("hf_not_granted_0123456789abcdef".into());
    let model_id = failed.pending_spec.as_ref().unwrap().model_deployments[0].model_id;
    env.patch(refused, &env.spec(1, model_id)).await;
    env.wait_active(refused, 2).await;

    for id in [served, refused] {
        env.delete_until_gone(id).await;
    }
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// A scale-down removes the least busy model server: the worker marks each with its requests in
/// flight as its pod-deletion-cost before the Deployment shrinks, so the one streaming a long
/// answer stays and its stream completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_keeps_the_busy_model_server_and_its_stream() {
    let env = env_with(None).await;
    env.serving_model_on();
    let w = env.worker().await;
    let (rec, token) = env.create(2).await;
    let active = env.wait_active(rec.id, 1).await;
    let fqdn = active.public_endpoint_fqdn.clone().unwrap();
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    let stream = client
        .post(format!("{fqdn}/v1/chat/completions"))
        .bearer_auth(&token)
        .json(&serde_json::json!({
            "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": 1500, "ignore_eos": true, "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let busy = stream.headers()["x-sim-backend"]
        .to_str()
        .unwrap()
        .to_string();

    let model_id = active.spec.as_ref().unwrap().model_deployments[0].model_id;
    env.patch(rec.id, &env.spec(1, model_id)).await;
    env.wait_active(rec.id, 2).await;
    let kube = env.cluster_kube().await;
    let ns = format!("di-{}", rec.id);
    let servers = eventually(
        Duration::from_secs(30),
        "one model server left",
        async || {
            let pods = kube
                .list("v1", "Pod", Some(&ns), "llm-d.ai/inference-serving=true")
                .await
                .ok()?;
            let live: Vec<String> = pods
                .iter()
                .filter(|p| {
                    p.pointer("/metadata/deletionTimestamp")
                        .is_none_or(|t| t.is_null())
                })
                .filter_map(|p| p.pointer("/metadata/name")?.as_str().map(str::to_string))
                .collect();
            (live.len() == 1).then_some(live)
        },
    )
    .await;
    assert_eq!(servers, [busy], "the busy server stays");
    let body = stream.text().await.unwrap();
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "the stream completes: {}",
        &body[body.len().saturating_sub(200)..]
    );
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// A worker told to stop (SIGTERM in production) lets the pass it is running finish, gives the
/// DI's lease back and withdraws from the workers' roster, so another worker takes the DI at
/// once: not when the lease runs out, nor when the stopped worker counts as silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_finishes_its_pass_and_hands_the_di_on_at_once() {
    let env = env_with(None).await;
    let (rec, _token) = env.create(1).await;
    // Slow DigitalOcean answers: the first pass (find or make the VPC's cluster) takes seconds,
    // so the stop comes while it runs.
    env.sim.set_faults(region_sim::FaultConfig {
        do_api: region_sim::ApiFaults {
            latency_ms: 1000,
            ..Default::default()
        },
        ..Default::default()
    });
    let mut config = env.config();
    // A lease that outlasts the test: only a release can free the DI in time.
    config.lease = Duration::from_secs(600);
    let stopping_id = config.worker_id.clone();
    let stopping = Worker::start(config).await.unwrap();
    until(
        Duration::from_secs(30),
        "the first pass running",
        || async { work_item(&env, rec.id).await.0.is_some() },
    )
    .await;
    let (holder, _, checked) = work_item(&env, rec.id).await;
    assert_eq!(holder.as_deref(), Some(stopping_id.as_str()));
    assert_eq!(checked, None, "no pass has finished yet");

    stopping.shutdown().await;
    let (holder, lease, checked) = work_item(&env, rec.id).await;
    assert_eq!((holder, lease), (None, None), "the lease was given back");
    assert!(
        checked.is_some(),
        "the running pass finished and was recorded"
    );
    let roster: i64 =
        region_store::sqlx::query_scalar("SELECT count(*) FROM workers WHERE worker_id = $1")
            .bind(&stopping_id)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(roster, 0, "the stopped worker withdrew");

    env.sim.set_faults(region_sim::FaultConfig::default());
    let next = env.worker().await;
    env.wait_active(rec.id, 1).await;
    next.shutdown().await;
    env.sim.shutdown().await;
}
