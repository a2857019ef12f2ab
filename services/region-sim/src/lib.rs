//! Region simulator: a stand-in for one DigitalOcean region that the control plane cannot tell
//! from the real thing. It owns the simulated cloud (VPCs, DOKS clusters, node pools, nodes, load
//! balancers, GPU capacity) behind a DigitalOcean API subset, starts one simulated Kubernetes API
//! server (the `sim-kube` crate) per cluster and plays the cloud's part in it (nodes, load
//! balancer addresses), and serves a fake OpenAI-compatible data plane for every load balancer
//! wired to a gateway. It also offers fault injection and an inventory of everything it holds,
//! under `/_sim/`. It must not contain control-plane logic (it only reacts to what a real cloud
//! would see), must not reach any network beyond loopback, and production code must never need
//! to know it is talking to it: a base URL, a token and the kubeconfig it hands out are the
//! whole interface.

pub mod data_plane;
pub mod do_api;
pub mod faults;
pub mod inventory;
pub mod routing;
pub mod sizes;
pub mod world;

mod clusters;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use data_plane::ModelTiming;
pub use faults::{ApiFaults, FaultConfig};
pub use inventory::Inventory;
pub use world::Delays;

/// How to start a simulated region.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Region slug, e.g. `atl1`.
    pub region: String,
    /// The DigitalOcean API bearer token the simulator accepts.
    pub token: String,
    /// Where the DO API (and `/_sim/`) listens; port 0 picks a free one.
    pub listen: SocketAddr,
    pub delays: Delays,
    /// GPU capacity per size slug, in nodes. GPU sizes not listed have none.
    pub gpu_capacity: BTreeMap<String, u32>,
    pub faults: FaultConfig,
    pub model: ModelTiming,
}

impl SimConfig {
    pub fn new(region: &str, token: &str) -> Self {
        Self {
            region: region.to_string(),
            token: token.to_string(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            delays: Delays::default(),
            gpu_capacity: world::default_capacity(),
            faults: FaultConfig::default(),
            model: ModelTiming::default(),
        }
    }
}

/// Counts of DigitalOcean API calls, for "a second pass writes nothing" assertions.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    mutations: AtomicU64,
    mutation_log: Mutex<Vec<String>>,
    recent: Mutex<VecDeque<String>>,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Authenticated POST/PUT/PATCH/DELETE calls to `/v2`, including ones answered with a fault.
    pub do_mutations: u64,
    /// `METHOD /path` of each of those calls, oldest first.
    pub mutation_log: Vec<String>,
    /// The last calls of any method with their status, oldest first.
    pub recent_calls: Vec<String>,
}

impl Stats {
    fn record_mutation(&self, line: String) {
        self.mutations.fetch_add(1, Ordering::SeqCst);
        self.mutation_log.lock().expect("stats lock").push(line);
    }

    fn record_call(&self, line: String) {
        let mut r = self.recent.lock().expect("stats lock");
        if r.len() >= 500 {
            r.pop_front();
        }
        r.push_back(line);
    }

    fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            do_mutations: self.mutations.load(Ordering::SeqCst),
            mutation_log: self.mutation_log.lock().expect("stats lock").clone(),
            recent_calls: self
                .recent
                .lock()
                .expect("stats lock")
                .iter()
                .cloned()
                .collect(),
        }
    }

    fn reset(&self) {
        self.mutations.store(0, Ordering::SeqCst);
        self.mutation_log.lock().expect("stats lock").clear();
        self.recent.lock().expect("stats lock").clear();
    }
}

/// State shared by the HTTP handlers and the background driver.
pub(crate) struct Shared {
    pub(crate) world: world::World,
    pub(crate) faults: Arc<faults::Faults>,
    pub(crate) token: String,
    pub(crate) base_url: String,
    pub(crate) stats: Stats,
    pub(crate) clusters: clusters::Clusters,
    pub(crate) model: Arc<RwLock<ModelTiming>>,
    /// Serialises world ticks so effects are applied in order.
    drive_lock: tokio::sync::Mutex<()>,
}

impl Shared {
    pub(crate) fn inventory(&self) -> Inventory {
        Inventory {
            region: self.world.region().to_string(),
            cloud: self.world.inventory(),
            kubernetes: self.clusters.objects(),
            endpoints: self.clusters.endpoints(),
        }
    }

    pub(crate) fn set_delays(&self, d: Delays) {
        self.world.set_delays(d.clone());
        self.clusters.set_delays(&d);
    }

    pub(crate) fn model_timing(&self) -> ModelTiming {
        self.model.read().expect("model lock").clone()
    }

    pub(crate) fn set_model_timing(&self, m: ModelTiming) {
        *self.model.write().expect("model lock") = m;
    }

    /// Advances the world and applies its effects to the simulated clusters.
    pub(crate) async fn drive(self: &Arc<Self>, now: Instant) {
        let _guard = self.drive_lock.lock().await;
        let effects = self.world.tick(now);
        if !effects.is_empty() {
            self.clusters.apply(self, effects).await;
        }
    }
}

/// A running simulated region.
pub struct RegionSim {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RegionSim {
    /// Binds the listener and starts the API, the world's clock and the cluster watchers.
    pub async fn start(cfg: SimConfig) -> anyhow::Result<RegionSim> {
        let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            world: world::World::new(&cfg.region, cfg.delays.clone(), cfg.gpu_capacity.clone()),
            faults: Arc::new(faults::Faults::new(cfg.faults.clone())),
            token: cfg.token.clone(),
            base_url: format!("http://{addr}"),
            stats: Stats::default(),
            clusters: clusters::Clusters::new(cfg.delays.clone()),
            model: Arc::new(RwLock::new(cfg.model.clone())),
            drive_lock: tokio::sync::Mutex::new(()),
        });
        let (stop, stop_rx) = watch::channel(false);
        let app = do_api::router(shared.clone());
        let mut rx = stop_rx.clone();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.changed().await;
                })
                .await;
        });
        let ticker_shared = shared.clone();
        let mut rx = stop_rx;
        let ticker = tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_millis(20));
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = rx.changed() => return,
                    _ = interval.tick() => {}
                }
                ticker_shared.drive(Instant::now()).await;
            }
        });
        tracing::info!(region = %cfg.region, %addr, "region simulator listening");
        Ok(RegionSim {
            shared,
            addr,
            stop,
            tasks: vec![server, ticker],
        })
    }

    /// `http://127.0.0.1:<port>`: the DigitalOcean API base URL (paths start with `/v2`).
    pub fn base_url(&self) -> String {
        self.shared.base_url.clone()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn token(&self) -> String {
        self.shared.token.clone()
    }

    pub fn region(&self) -> String {
        self.shared.world.region().to_string()
    }

    /// Every simulated resource, cloud and Kubernetes alike.
    pub fn inventory(&self) -> Inventory {
        self.shared.inventory()
    }

    pub fn faults(&self) -> FaultConfig {
        self.shared.faults.get()
    }

    pub fn set_faults(&self, f: FaultConfig) {
        self.shared.faults.set(f);
    }

    pub fn delays(&self) -> Delays {
        self.shared.world.delays()
    }

    pub fn set_delays(&self, d: Delays) {
        self.shared.set_delays(d);
    }

    pub fn set_gpu_capacity(&self, c: BTreeMap<String, u32>) {
        self.shared.world.set_capacity(c);
    }

    pub fn set_model_timing(&self, m: ModelTiming) {
        self.shared.set_model_timing(m);
    }

    /// DigitalOcean API call accounting.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    pub fn reset_stats(&self) {
        self.shared.stats.reset();
    }

    /// Number of mutating DigitalOcean API calls so far.
    pub fn do_mutations(&self) -> u64 {
        self.shared.stats.snapshot().do_mutations
    }

    /// Kills a node (by its Kubernetes name): NotReady at once, replaced after the delays.
    pub async fn kill_node(&self, name: &str) -> anyhow::Result<()> {
        self.shared
            .world
            .kill_node(name)
            .map_err(|e| anyhow::anyhow!("kill {name}: {e:?}"))?;
        self.shared.drive(Instant::now()).await;
        Ok(())
    }

    /// Stops the API, the clock, every simulated Kubernetes API server and every endpoint.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.shared.clusters.shutdown_all().await;
    }
}
