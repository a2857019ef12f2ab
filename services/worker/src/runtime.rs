//! The worker runtime: claims DIs from the regional store (woken by `LISTEN di_work`, by the
//! checks it scheduled itself and by a periodic tick), runs up to N reconcile passes at once, each
//! under a renewed lease, and turns each pass's outcome into the lease's next check: soon while
//! waiting for the cloud (sooner while the cloud is visibly moving), a jittered
//! backoff after a transient failure, `error` after a permanent one or a stall. Beside the claim
//! loop it serves `/metrics` and `/healthz` and samples the work queue's depth.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cloud_clients::{DoClient, DoClientOptions, KubeClientOptions, RetryConfig};
use common::seal::Sealer;
use region_store::{Claim, Store};
use tokio::sync::{oneshot, watch, Notify, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;
use uuid::Uuid;

use crate::metrics;
use crate::plan::progress::{self, Fingerprint, Report};
use crate::plan::Waiting;
use crate::queue::{self, Queue};
use crate::reconcile::{Pass, ReconcileError, Reconciler, Settings};

/// Everything a worker needs. Secrets are redacted from `Debug`.
#[derive(Clone)]
pub struct Config {
    pub worker_id: String,
    pub database_url: String,
    /// Key (base64) that opens the sealed secrets in the regional store (and seals the ones the
    /// worker makes).
    pub seal_key: String,
    /// More keys that only open: the previous `seal_key` while a rotation re-seals.
    pub seal_open_keys: Vec<String>,
    pub do_api_url: String,
    pub do_token: String,
    pub settings: Settings,
    /// Reconcile passes running at once.
    pub concurrency: usize,
    pub lease: Duration,
    /// Look for due work at least this often (besides notifications and this worker's own
    /// scheduled checks).
    pub tick: Duration,
    /// The first look after a pass that waits for the cloud, while what it waits for keeps
    /// changing; the wait then grows with the time nothing changed, up to `settings.poll`.
    pub poll_min: Duration,
    /// First and largest delay of the backoff after transient failures.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// No progress for this long in a phase: an event at half of it, `error` at all of it.
    pub stall_timeout: Duration,
    /// A pass that takes longer is abandoned as a transient failure (and tried again): a cloud
    /// API that accepts a connection and never answers must not hold a DI for ever.
    pub pass_timeout: Duration,
    /// How the DigitalOcean and Kubernetes clients retry a failing call within a pass: briefly.
    /// A longer outage ends the pass and the queue's backoff takes over, so that a customer's
    /// change (a revoked token) is never stuck behind a pass sleeping in retries.
    pub cloud_retry: RetryConfig,
    pub db_max_connections: u32,
    /// Where `/metrics` and `/healthz` are served; port 0 picks a free port (see
    /// [`WorkerHandle::metrics_addr`]).
    pub metrics_listen: SocketAddr,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("worker_id", &self.worker_id)
            .field("do_api_url", &self.do_api_url)
            .field("settings", &self.settings)
            .field("concurrency", &self.concurrency)
            .field("lease", &self.lease)
            .field("tick", &self.tick)
            .field("poll_min", &self.poll_min)
            .field("stall_timeout", &self.stall_timeout)
            .field("pass_timeout", &self.pass_timeout)
            .field("metrics_listen", &self.metrics_listen)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// Defaults for everything but the connections and secrets. The metrics server listens on a
    /// free loopback port, so that several workers can run in one process (tests); the binary
    /// sets `--metrics-listen` (default `0.0.0.0:9090`).
    pub fn new(
        region: &str,
        database_url: &str,
        seal_key: &str,
        do_api_url: &str,
        do_token: &str,
    ) -> Self {
        Config {
            worker_id: format!("worker-{}", Uuid::new_v4().simple()),
            database_url: database_url.to_string(),
            seal_key: seal_key.to_string(),
            seal_open_keys: Vec::new(),
            do_api_url: do_api_url.to_string(),
            do_token: do_token.to_string(),
            settings: Settings::new(region),
            concurrency: 8,
            lease: Duration::from_secs(10),
            tick: Duration::from_secs(1),
            poll_min: Duration::from_millis(50),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(30 * 60),
            pass_timeout: Duration::from_secs(120),
            cloud_retry: RetryConfig {
                max_attempts: 3,
                max_elapsed: Duration::from_secs(2),
                max_retry_after: Duration::from_secs(2),
                ..RetryConfig::default()
            },
            db_max_connections: 10,
            metrics_listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        }
    }
}

/// Counters of what a worker did, for tests and metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    pub passes: u64,
    pub transient_failures: u64,
    pub permanent_failures: u64,
    pub leases_lost: u64,
}

struct Shared {
    queue: Queue,
    reconciler: Reconciler,
    store: Store,
    config: Config,
    wake: Arc<Notify>,
    /// When the DIs this worker released become due, soonest first, so that the claim loop
    /// wakes for them instead of waiting for the next tick.
    due: Mutex<BinaryHeap<Reverse<Instant>>>,
    attempts: Mutex<HashMap<Uuid, u32>>,
    stats: Mutex<Stats>,
}

/// The worker entry point.
pub struct Worker;

/// A running worker.
pub struct WorkerHandle {
    stop: watch::Sender<bool>,
    main: tokio::task::JoinHandle<()>,
    listener: tokio::task::JoinHandle<()>,
    /// Keeps the database session that stands for this worker (see [`Queue::keep_session`]);
    /// stopped once the passes have released their leases.
    session_stop: watch::Sender<bool>,
    session: tokio::task::JoinHandle<()>,
    sampler: tokio::task::JoinHandle<()>,
    waker: tokio::task::JoinHandle<()>,
    /// The metrics server stops last, so that it can be scraped while passes finish.
    metrics_stop: oneshot::Sender<()>,
    metrics_server: tokio::task::JoinHandle<()>,
    metrics_addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Worker {
    /// Connects to the store, builds the DigitalOcean client, opens the metrics listener and
    /// starts claiming work.
    pub async fn start(config: Config) -> anyhow::Result<WorkerHandle> {
        let (pool, store, reconciler) = connect(&config).await?;
        let metrics_listener = tokio::net::TcpListener::bind(config.metrics_listen)
            .await
            .map_err(|e| anyhow::anyhow!("metrics listener on {}: {e}", config.metrics_listen))?;
        let metrics_addr = metrics_listener.local_addr()?;
        let shared = Arc::new(Shared {
            queue: Queue::new(store.clone(), &config.worker_id, config.lease),
            reconciler,
            store,
            config,
            wake: Arc::new(Notify::new()),
            due: Mutex::new(BinaryHeap::new()),
            attempts: Mutex::new(HashMap::new()),
            stats: Mutex::new(Stats::default()),
        });
        metrics::register();
        let (stop, stop_rx) = watch::channel(false);
        let running = Arc::new(AtomicBool::new(true));
        let listener = tokio::spawn(queue::listen(pool, shared.wake.clone(), stop_rx.clone()));
        // The session outlives the claim loop: it stands for this worker's leases until every
        // pass has finished and released them (see `shutdown`).
        let (session_stop, session_stop_rx) = watch::channel(false);
        let session = tokio::spawn({
            let queue = shared.queue.clone();
            let url = shared.config.database_url.clone();
            let draining = stop_rx.clone();
            async move { queue.keep_session(url, draining, session_stop_rx).await }
        });
        let sampler = tokio::spawn(sample_queue_depth(shared.clone(), stop_rx.clone()));
        let waker = tokio::spawn(wake_changed(shared.clone(), stop_rx.clone()));
        let main = tokio::spawn(run(shared.clone(), stop_rx, running.clone()));
        let (metrics_stop, metrics_stop_rx) = oneshot::channel();
        let metrics_server =
            tokio::spawn(metrics::serve(metrics_listener, running, metrics_stop_rx));
        tracing::info!(worker = %shared.config.worker_id, %metrics_addr, "worker started");
        Ok(WorkerHandle {
            stop,
            main,
            listener,
            session_stop,
            session,
            sampler,
            waker,
            metrics_stop,
            metrics_server,
            metrics_addr,
            shared,
        })
    }
}

/// The worker's connections: its database pool, its store over that pool, and the reconciler
/// with its clients to the cloud, its rendering registered in the store.
async fn connect(config: &Config) -> anyhow::Result<(sqlx::PgPool, Store, Reconciler)> {
    // As in central and regional: a broken connection fails its query, the pass is retried,
    // and the pool replaces the connection. A pass waits for a connection as long as sqlx's
    // default, 30 s.
    let pool = common::db::pool_options(config.db_max_connections.max(2), Duration::from_secs(30))
        .connect(&config.database_url)
        .await?;
    let sealer = Sealer::from_keys(&config.seal_key, &config.seal_open_keys)
        .map_err(|_| anyhow::anyhow!("a seal key is not a valid base64 key"))?;
    let store = Store::new(pool.clone(), sealer);
    let cloud = DoClient::with_options(
        &config.do_api_url,
        &config.do_token,
        DoClientOptions {
            retry: config.cloud_retry.clone(),
            ..DoClientOptions::default()
        },
    )?;
    let reconciler = Reconciler::new(store.clone(), cloud, config.settings.clone())
        .with_kube_options(KubeClientOptions {
            retry: config.cloud_retry.clone(),
            ..KubeClientOptions::default()
        });
    reconciler
        .register_rendering()
        .await
        .map_err(|e| anyhow::anyhow!("registering the worker's rendering: {e}"))?;
    tracing::info!(rendering = %reconciler.rendering(), "rendering registered");
    Ok((pool, store, reconciler))
}

impl WorkerHandle {
    pub fn worker_id(&self) -> &str {
        &self.shared.config.worker_id
    }

    pub fn stats(&self) -> Stats {
        self.shared.stats.lock().expect("stats").clone()
    }

    pub fn reconciler(&self) -> &Reconciler {
        &self.shared.reconciler
    }

    /// The address `/metrics` and `/healthz` are served on (the bound port when the configured
    /// one was 0).
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Stops claiming, lets running passes finish (they release their leases), then stops the
    /// metrics server and returns.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.main.await;
        let _ = self.listener.await;
        let _ = self.session_stop.send(true);
        let _ = self.session.await;
        let _ = self.sampler.await;
        let _ = self.waker.await;
        let _ = self.metrics_stop.send(());
        let _ = self.metrics_server.await;
        tracing::info!(worker = %self.shared.config.worker_id, "worker stopped");
    }

    /// Stops at once without releasing anything, as a killed process would: its database
    /// session closes, so other workers take its leases at once.
    pub fn kill(self) {
        self.main.abort();
        self.listener.abort();
        self.session.abort();
        self.sampler.abort();
        self.waker.abort();
        self.metrics_server.abort();
    }
}

/// Clears the health flag when the claim loop ends, however it ends (return, panic, abort).
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<bool>, running: Arc<AtomicBool>) {
    let _running = Running(running);
    let slots = Arc::new(Semaphore::new(shared.config.concurrency.max(1)));
    let mut tasks: JoinSet<()> = JoinSet::new();
    loop {
        if *stop.borrow() {
            break;
        }
        let free = slots.available_permits();
        let mut full_batch = false;
        if free > 0 {
            match shared.queue.claim(free).await {
                Ok(claims) => {
                    full_batch = claims.len() == free;
                    for claim in claims {
                        let permit = slots.clone().try_acquire_owned().expect("a slot per claim");
                        let shared = shared.clone();
                        tasks.spawn(async move {
                            run_one(&shared, claim).await;
                            drop(permit);
                            shared.wake.notify_one();
                        });
                    }
                }
                Err(e) => tracing::warn!(error = %e, "claiming work failed"),
            }
        }
        while tasks.try_join_next().is_some() {}
        if full_batch && slots.available_permits() > 0 {
            continue;
        }
        let wait = shared.next_wait(Instant::now());
        tokio::select! {
            _ = shared.wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {}
        }
    }
    // Graceful: let running passes finish and release their leases.
    while tasks.join_next().await.is_some() {}
}

impl Shared {
    /// How long the claim loop may sleep: until the soonest check this worker scheduled, at
    /// most a tick. Checks already due are forgotten (the claim that follows takes them).
    fn next_wait(&self, now: Instant) -> Duration {
        let mut due = self.due.lock().expect("due");
        while due.peek().is_some_and(|Reverse(at)| *at <= now) {
            due.pop();
        }
        due.peek().map_or(self.config.tick, |Reverse(at)| {
            (*at - now).min(self.config.tick)
        })
    }

    /// Remembers that a DI released now is due again after `after` (if within a tick).
    fn schedule(&self, after: Duration) {
        if after < self.config.tick {
            self.due
                .lock()
                .expect("due")
                .push(Reverse(Instant::now() + after));
        }
    }
}

/// The wait before the next look at a DI whose pass is waiting for the cloud: short while what
/// it waits for keeps changing, then half the time it has been unchanged, never less than
/// `min` nor more than `max` (the pass's own `next_check`).
fn poll_delay(unchanged_for: Duration, min: Duration, max: Duration) -> Duration {
    (unchanged_for / 2).clamp(min.min(max), max)
}

/// One reconcile pass under `claim`, in a span that joins the trace of the request that caused
/// the work (carried through the queue), or starts its own for periodic resyncs.
async fn run_one(shared: &Shared, claim: Claim) {
    let span = tracing::info_span!(
        "reconcile",
        otel.kind = "internal",
        service = "worker",
        di_id = %claim.di_id,
        phase = tracing::field::Empty,
        status = tracing::field::Empty,
        outcome = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    common::telemetry::continue_from_traceparent(&span, claim.traceparent.as_deref());
    run_pass(shared, claim).instrument(span).await
}

async fn run_pass(shared: &Shared, claim: Claim) {
    let id = claim.di_id;
    let lost = Arc::new(Notify::new());
    let keep = shared.queue.keep_alive(claim.clone(), lost.clone());
    let deadline = shared.config.pass_timeout;
    // Everything the pass and its bookkeeping write is fenced by the lease.
    let reconciler = shared.reconciler.under_lease(&claim);
    let store = reconciler.store().clone();
    let outcome = tokio::select! {
        r = tokio::time::timeout(deadline, reconciler.reconcile(id)) => Some(r.unwrap_or_else(|_| {
            Err(ReconcileError::Transient(format!("the pass took longer than {deadline:?}")))
        })),
        _ = lost.notified() => None,
    };
    drop(keep);
    let retry = matches!(&outcome, Some(Err(e)) if e.is_transient());
    let next = match outcome {
        // The renewal said the lease is gone, or a write was refused for want of it: the
        // pass stopped, and the lease's holder (if any) carries on.
        None | Some(Err(ReconcileError::LeaseLost)) => {
            shared.stats.lock().expect("stats").leases_lost += 1;
            metrics::lease_lost(1);
            // If the lease is still ours after all (a renewal that failed on a database that
            // has come back), give it back so that the DI is not left until it runs out.
            let _ = shared.queue.release_to_retry(&claim, Duration::ZERO).await;
            return;
        }
        Some(Ok(pass)) => after_pass(shared, &store, id, &pass).await,
        Some(Err(ReconcileError::Transient(why) | ReconcileError::CredentialsRefused(why))) => {
            after_transient_failure(shared, &store, id, &why).await
        }
        Some(Err(ReconcileError::Permanent {
            reason,
            message,
            version,
        })) => {
            shared.attempts.lock().expect("attempts").remove(&id);
            shared.stats.lock().expect("stats").permanent_failures += 1;
            tracing::warn!(di = %id, %reason, %message, "permanent failure");
            if let Err(e) = store.error_set(id, version, &reason, &message).await {
                tracing::warn!(di = %id, error = %e, "recording the error failed");
            }
            shared.config.settings.resync
        }
    };
    let released = if retry {
        shared.queue.release_to_retry(&claim, next).await
    } else {
        shared.queue.release(&claim, next).await
    };
    match released {
        Ok(_) => shared.schedule(next),
        Err(e) => {
            tracing::warn!(di = %id, error = %e, "releasing the lease failed; it will expire")
        }
    }
}

/// After a pass that ended: when to look again. A DI waiting on something that has not moved
/// for a while is looked at less often, up to the pass's own limit.
async fn after_pass(
    shared: &Shared,
    store: &region_store::Store,
    id: Uuid,
    pass: &Pass,
) -> Duration {
    shared.attempts.lock().expect("attempts").remove(&id);
    shared.stats.lock().expect("stats").passes += 1;
    tracing::debug!(di = %id, status = ?pass.status, waiting = ?pass.waiting,
        do_writes = pass.do_writes, kube_writes = pass.kube_writes, "pass");
    let unchanged_for = watch_progress(shared, store, id, pass).await;
    match (&pass.waiting, unchanged_for) {
        (Some(_), Some(unchanged)) => {
            poll_delay(unchanged, shared.config.poll_min, pass.next_check)
        }
        _ => pass.next_check,
    }
}

/// After a pass that failed transiently: the DI's progress says it is retrying (so that a
/// failure that lasts becomes a stall the customer hears of), and the next try backs off.
async fn after_transient_failure(
    shared: &Shared,
    store: &region_store::Store,
    id: Uuid,
    why: &str,
) -> Duration {
    let attempt = {
        let mut a = shared.attempts.lock().expect("attempts");
        let n = a.entry(id).or_insert(0);
        *n += 1;
        *n
    };
    shared.stats.lock().expect("stats").transient_failures += 1;
    tracing::warn!(di = %id, attempt, error = %why, "transient failure; will retry");
    let rec = shared
        .store
        .dedicated_inference_any(id)
        .await
        .ok()
        .filter(|r| !r.gone);
    let pass = Pass {
        status: rec.as_ref().map(|r| r.status),
        version: rec
            .as_ref()
            .and_then(|r| r.pending_spec.as_ref().or(r.spec.as_ref()))
            .map(|s| s.version),
        waiting: Some(Waiting::Retrying),
        next_check: Duration::ZERO,
        do_writes: 0,
        kube_writes: 0,
        platform_update: false,
    };
    watch_progress(shared, store, id, &pass).await;
    let cfg = &shared.config;
    queue::backoff(attempt, cfg.backoff_base, cfg.backoff_max)
}

/// Gathers a burst of watch events (a rollout's pods) into one statement.
const WAKE_GATHER: Duration = Duration::from_millis(250);

/// Makes due the DIs whose objects the cluster watches saw change (see
/// [`crate::watch_cache`]), so that a change behind the worker's back is repaired in seconds
/// rather than at the next resync, and looks for work at once. Every worker of the region
/// learns of them: the DI is due for whichever claims it. A failed write is tried again with
/// the next batch.
async fn wake_changed(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let wakes = shared.reconciler.wakes();
    loop {
        tokio::select! {
            _ = wakes.notified() => {}
            _ = stop.changed() => return,
        }
        tokio::time::sleep(WAKE_GATHER).await;
        let ids = wakes.take();
        if ids.is_empty() {
            continue;
        }
        match shared.store.work_wake(&ids).await {
            Ok(woken) => {
                metrics::watch_wakes(woken as usize);
                if woken > 0 {
                    tracing::debug!(
                        woken,
                        seen = ids.len(),
                        "DIs changed in their clusters; looking at them now"
                    );
                    shared.wake.notify_one();
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, count = ids.len(), "waking changed DIs failed; trying again");
                for id in ids {
                    wakes.wake(id);
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    }
}

/// Samples the work queue's depth and the newest fleet rollout into their gauges every tick (at most once a second: scrapes are
/// far apart, and a short test tick should not add database load) until `stop` turns true. A
/// failed sample keeps the last value (the claim loop reports database trouble already).
async fn sample_queue_depth(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let every = shared.config.tick.max(Duration::from_secs(1));
    loop {
        match shared.store.work_depth().await {
            Ok(depth) => metrics::queue_depth(depth.ready, depth.leased),
            Err(e) => tracing::debug!(error = %e, "sampling the work queue depth failed"),
        }
        match shared.store.fleet_progress().await {
            Ok(rollouts) => {
                if let Some(newest) = rollouts.first() {
                    metrics::fleet_progress(newest);
                }
            }
            Err(e) => tracing::debug!(error = %e, "sampling the fleet rollout failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Records the fingerprint a pass leaves and reports what its history calls for (see
/// [`plan::progress`]: stalls and repairs). Returns how long the fingerprint of a moving or
/// repairing DI has been unchanged (None otherwise, or when it could not be recorded).
async fn watch_progress(
    shared: &Shared,
    store: &region_store::Store,
    id: Uuid,
    pass: &Pass,
) -> Option<Duration> {
    let fingerprint = Fingerprint::of(pass.status, pass.waiting.as_ref()).key();
    let key = fingerprint
        .as_deref()
        .unwrap_or(region_store::PROGRESS_IDLE);
    let stall = match store.work_progress(id, key).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(di = %id, error = %e, "recording progress failed");
            return None;
        }
    };
    let history = progress::History {
        previous: stall.previous.as_deref(),
        unchanged_for: stall.unchanged_for,
        reported: stall.reported,
    };
    let timeout = shared.config.stall_timeout;
    for report in progress::reports(pass.status, pass.waiting.as_ref(), history, timeout) {
        match report {
            // A fleet rollout restarting the DI is told by its own events (`PlatformUpdate`…):
            // the DI is not out of step with its spec.
            Report::Event("Repairing" | "Repaired", _) if pass.platform_update => {}
            Report::Event(reason, msg) => {
                let appended = store.event_append(id, reason, &msg).await.is_ok();
                if appended && reason == "Slow" {
                    let _ = store.work_stall_reported(id).await;
                }
            }
            // The stall is about the spec the pass worked towards: one accepted since is tried.
            Report::Stalled(msg) => {
                if let Err(e) = store.error_set(id, pass.version, "Stalled", &msg).await {
                    tracing::warn!(di = %id, error = %e, "recording the stall failed");
                }
            }
        }
    }
    fingerprint.map(|_| stall.unchanged_for)
}

#[cfg(test)]
mod tests {
    use super::poll_delay;
    use std::time::Duration;

    #[test]
    fn poll_delay_starts_short_and_grows_to_the_pass_limit() {
        let ms = Duration::from_millis;
        let (min, max) = (ms(50), ms(2000));
        // Something just changed: look again soon.
        assert_eq!(poll_delay(ms(0), min, max), min);
        // Unchanged for a while: half of that.
        assert_eq!(poll_delay(ms(600), min, max), ms(300));
        // Never beyond what the pass asked for.
        assert_eq!(poll_delay(ms(60_000), min, max), max);
        // A pass that asks for less than the minimum gets what it asked for.
        assert_eq!(poll_delay(ms(0), min, ms(10)), ms(10));
    }
}
