//! Interleavings the soak found, replayed step by step: passes driven one at a time against the
//! region simulator, with the cloud's delays arranged so that the world moves between what a
//! pass observed and what it does.
//!
//! Needs DATABASE_URL (a Postgres the tests may create databases in).

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cloud_clients::RetryConfig;
use region_sim::{ApiFaults, Delays, FaultConfig};
use support::*;
use uuid::Uuid;
use worker::reconcile::Reconciler;

const OTHER_GPU: &str = "gpu-h200x1-141gb";

/// Calls the endpoint every 30 ms until stopped; counts what failed.
struct Caller {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Caller {
    fn start(client: reqwest::Client, url: String, token: String) -> Caller {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
            let started = Instant::now();
            async move {
                while !stop.load(Ordering::SeqCst) {
                    let status = chat(&client, &url, &token).await;
                    if status.is_success() {
                        ok.fetch_add(1, Ordering::SeqCst);
                    } else {
                        let at = started.elapsed().as_secs_f64();
                        failures.lock().unwrap().push(format!("{at:.2}s: {status}"));
                    }
                    // A pace, not a wait for a condition: about 30 calls a second.
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
            }
        });
        Caller {
            stop,
            ok,
            failures,
            task,
        }
    }

    /// Calls made so far, answered well or not.
    fn calls(&self) -> u64 {
        self.ok.load(Ordering::SeqCst) + self.failures.lock().unwrap().len() as u64
    }

    /// Waits until `n` more calls than so far have been made.
    async fn more_calls(&self, n: u64) {
        let target = self.calls() + n;
        test_support::until(
            Duration::from_secs(30),
            format!("{n} more calls"),
            async || self.calls() >= target,
        )
        .await
    }

    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::SeqCst), failures)
    }
}

/// Clients that do not retry: each pass shows what it met.
fn single_attempt() -> RetryConfig {
    RetryConfig {
        max_attempts: 1,
        ..RetryConfig::default()
    }
}

/// Runs passes until DI `id` is active on `version` with nothing pending.
async fn drive_until_active(env: &Env, r: &Reconciler, id: Uuid, version: i32) {
    let last = std::sync::Mutex::new(None);
    let active = test_support::within(Duration::from_secs(60), || async {
        let pass = r.reconcile(id).await;
        let rec = env.store.dedicated_inference_any(id).await.unwrap();
        let done = rec.status == Status::Active
            && rec.pending_spec.is_none()
            && rec.spec.as_ref().map(|s| s.version) == Some(version)
            && matches!(&pass, Ok(p) if p.waiting.is_none());
        *last.lock().unwrap() = Some(format!("{pass:?}, status {}", rec.status));
        done.then_some(())
    })
    .await;
    let last = last.lock().unwrap().take();
    assert!(
        active.is_some(),
        "not active on v{version} within 60 s: {last:?}"
    );
}

/// The soak's outage during a GPU move (seed 11): a DI moving from 2 x H100 to 2 x H200 is
/// scaled to 1 x H200 while the new pool's nodes are still joining. The pass for the
/// scale-down saw the new pod waiting for a node and both new nodes idle, and by the time it
/// had read the pools from DigitalOcean the scheduler had put the pod on the first of them;
/// the pass removed that node as idle. The pod turned ready, the Deployment let the old pods
/// go, then the node went and took the only ready model server with it.
///
/// Here DigitalOcean answers slowly (2 s a call) for that one pass, so that the nodes join
/// (3 s after the pool was made) between the pass's look at the cluster and its node
/// deletions, as they did under the soak's load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_mid_move_keeps_the_node_a_waiting_pod_lands_on() {
    let env = env_with_delays(
        Some(BTreeMap::from([
            (GPU.to_string(), 4),
            (OTHER_GPU.to_string(), 4),
        ])),
        Delays {
            cluster_provision_ms: 300,
            node_provision_ms: 3000,
            deletion_ms: 1500,
            lb_provision_ms: 100,
            model_load_ms: 300,
            gateway_address_ms: 50,
        },
    )
    .await;
    let r = env.reconciler(single_attempt());
    let (rec, token) = env.create(2).await;
    drive_until_active(&env, &r, rec.id, 1).await;
    let active = env.store.dedicated_inference_any(rec.id).await.unwrap();
    let model_id = active.spec.as_ref().unwrap().model_deployments[0].model_id;
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    let caller = Caller::start(client, active.public_endpoint_fqdn.clone().unwrap(), token);

    // v2: the move. One pass makes the new pool (its nodes join in 3 s) and points the
    // Deployment at it: the new pod waits for a node.
    let mut v2 = env.spec(2, model_id);
    v2.model_deployments[0].accelerators[0].accelerator_slug = OTHER_GPU.into();
    env.patch(rec.id, &v2).await;
    let pass = r.reconcile(rec.id).await.unwrap();
    assert!(
        pass.do_writes > 0 && pass.kube_writes > 0,
        "the move's first pass makes the pool and applies the Deployment: {pass:?}"
    );

    // v3: the scale-down, whose pass looks at the cluster before the nodes join and deletes
    // after they did.
    let mut v3 = env.spec(1, model_id);
    v3.version = 2;
    v3.model_deployments[0].accelerators[0].accelerator_slug = OTHER_GPU.into();
    env.patch(rec.id, &v3).await;
    env.sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            latency_ms: 2000,
            ..ApiFaults::default()
        },
        ..FaultConfig::default()
    });
    let pass = r.reconcile(rec.id).await;
    env.sim.set_faults(FaultConfig::default());
    println!("the scale-down's pass: {pass:?}");

    drive_until_active(&env, &r, rec.id, 3).await;
    // A node deleted by mistake would still be going (1.5 s on the simulated cloud's clock),
    // and would take the only ready model server with it once gone: calls fail from then on
    // for as long as a new node takes (3 s). So: until nothing in the cloud is being deleted,
    // then calls made after that.
    test_support::until(
        Duration::from_secs(30),
        "no node or node pool being deleted",
        async || {
            let cloud = env.sim.inventory().cloud;
            cloud.node_pools.iter().all(|p| p["deleting"] != true)
                && cloud.nodes.iter().all(|n| n["state"] != "deleting")
        },
    )
    .await;
    caller.more_calls(20).await;
    let (ok, failures) = caller.finish().await;
    assert!(
        failures.is_empty(),
        "{} failed calls (of {}): {failures:#?}",
        failures.len(),
        failures.len() as u64 + ok
    );
    assert!(ok > 50, "the client must have been calling: {ok} calls");
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    test_support::until(Duration::from_secs(60), "gone", || async {
        let _ = r.reconcile(rec.id).await;
        env.store
            .dedicated_inference_any(rec.id)
            .await
            .unwrap()
            .gone
    })
    .await;
    env.wait_gone(rec.id).await;
    env.sim.shutdown().await;
}

/// A pass that outlived its lease (a stall; another worker has the DI now) writes nothing to
/// the store: the first write it tries is refused, and the pass stops there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_lost_its_lease_writes_nothing() {
    let env = env_with(None).await;
    let (rec, _token) = env.create(1).await;
    let claim = env
        .store
        .work_claim("stalled", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .remove(0);
    // The lease runs out by the database's clock: its work item is moved past the lease's end.
    env.age(rec.id, Duration::from_secs(60)).await;
    let taken = env
        .store
        .work_claim("next", Duration::from_secs(30), 1)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1, "the next worker holds the DI");
    let stalled = env.reconciler(single_attempt()).under_lease(&claim);
    let pass = stalled.reconcile(rec.id).await;
    assert!(
        matches!(pass, Err(worker::reconcile::ReconcileError::LeaseLost)),
        "{pass:?}"
    );
    let after = env.store.dedicated_inference_any(rec.id).await.unwrap();
    assert_eq!(
        after.status,
        Status::New,
        "not moved on by the stalled pass"
    );
    assert!(env.store.ledger_entries(rec.id).await.unwrap().is_empty());
    env.sim.shutdown().await;
}
