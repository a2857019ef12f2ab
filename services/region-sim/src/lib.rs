//! Region simulator: a stand-in for one DigitalOcean region that the control plane cannot tell
//! from the real thing. It must not contain control-plane logic (it only reacts to what a real
//! cloud would see), must not reach any network beyond loopback, and production code must never
//! need to know it is talking to it: a base URL, a token and the cluster credentials
//! (kubeconfig) it hands out, which expire as DOKS's do, are the whole interface.
//!
//! This crate is the simulated cloud, and it starts the rest. It owns the accounts and their
//! VPCs, DOKS clusters, node pools, nodes, load balancers and GPU capacity ([`world`]) behind a
//! DigitalOcean API subset ([`do_api`]), in which the platform's credential can act for one
//! customer account (`X-Acting-Account`, see [`do_api::ACTING_ACCOUNT_HEADER`]); starts one
//! simulated Kubernetes API server (the `sim-kube` crate, in process) per cluster behind an
//! HTTPS front with the cluster's own CA and expiring credentials, and plays the cloud's part in
//! it (nodes, load balancer addresses, and model servers that fetch their repository from the
//! Hugging Face Hub they name and crash-loop when it refuses: [`hub_loader`]); and starts the
//! simulated data plane (the `dataplane-sim` crate: a fake OpenAI-compatible gateway, model
//! servers that behave like vLLM, their endpoint picker, the pods' metrics) for every load
//! balancer wired to a gateway. Every cluster API and load balancer has a loopback address of its
//! own (`127.x.y.z`), all served by one listener ([`region_sim_base::front`]), so the process's
//! sockets follow the connections clients keep open, not the clusters and load balancers that
//! exist. It also offers fault injection and an inventory of everything it holds
//! ([`Inventory`]), under `/_sim/`.
//!
//! What tests set a region up with is at this crate's root, whichever crate owns it
//! ([`ModelTiming`], [`ServingConfig`], [`FaultConfig`], ...), as is [`routing`], the data
//! plane's reading of a cluster's wiring.

pub mod do_api;
pub mod hub_loader;
pub mod inventory;
pub mod world;

mod clusters;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use dataplane_sim::data_plane::ModelTiming;
pub use dataplane_sim::routing;
pub use dataplane_sim::serving::ServingConfig;
pub use inventory::Inventory;
pub use region_sim_base::faults::{
    Api, ApiFaults, ArmedFault, ArmedKind, Counting, FaultConfig, FiredFault,
};
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
    /// The port every cluster API and load balancer shares, each at a loopback address of its
    /// own (see [`region_sim_base::front`]); 0 picks a free one.
    pub front_port: u16,
    pub delays: Delays,
    /// GPU capacity per size slug, in nodes. GPU sizes not listed have none.
    pub gpu_capacity: BTreeMap<String, u32>,
    pub faults: FaultConfig,
    pub model: ModelTiming,
    /// How often the simulated cloud controller checks a settled cluster (every load balancer
    /// active; while one is not, it looks every 100 ms) for changes it missed: it re-derives the
    /// cluster only if its resourceVersion moved since (changes are normally seen at once).
    /// Defaults to 100 ms.
    pub cloud_controller_idle_ms: u64,
    /// How long the cluster credentials the kubeconfig and credentials endpoints issue stay
    /// valid when the request does not ask (`expiry_seconds` absent or 0): 7 days, as on DOKS.
    /// Tests shorten it to see credentials expire.
    pub credential_ttl: Duration,
    /// The clock the simulated cloud's credentials expire by: the system's, unless a test
    /// shares one with the worker it runs in the same process and advances both.
    pub clock: common::clock::Clock,
    /// The Hugging Face Hub standing in for the public one (`https://huggingface.co`): where the
    /// simulated model servers whose environment names no `HF_ENDPOINT` download from. `None`
    /// (the default): their loads succeed without asking anyone. See [`hub_loader`].
    pub default_hub: Option<String>,
}

/// DOKS's default lifetime of cluster credentials.
pub const DEFAULT_CREDENTIAL_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

impl SimConfig {
    pub fn new(region: &str, token: &str) -> Self {
        Self {
            region: region.to_string(),
            token: token.to_string(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            front_port: 0,
            delays: Delays::default(),
            gpu_capacity: world::default_capacity(),
            faults: FaultConfig::default(),
            model: ModelTiming::default(),
            cloud_controller_idle_ms: 100,
            credential_ttl: DEFAULT_CREDENTIAL_TTL,
            clock: common::clock::Clock::system(),
            default_hub: None,
        }
    }
}

/// Counts of DigitalOcean and Kubernetes API calls, for "a second pass writes nothing" assertions
/// and benchmarks.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    mutations: AtomicU64,
    kube_mutations: AtomicU64,
    mutation_log: Mutex<Vec<String>>,
    recent: Mutex<VecDeque<String>>,
    /// Calls by API (`do`, `kube`) and [`do_kind`] / [`kube_kind`].
    requests: Mutex<BTreeMap<&'static str, BTreeMap<String, u64>>>,
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
    /// Authenticated POST/PUT/PATCH/DELETE calls to the clusters' Kubernetes APIs (through the
    /// kubeconfig's server), including ones answered with a fault.
    #[serde(default)]
    pub kube_mutations: u64,
    /// Every authenticated call, reads included, by API (`do`, `kube`) and kind: for `do`
    /// `METHOD /path` with ids replaced by `{id}`; for `kube` `METHOD resource[/subresource]`,
    /// where a collection GET is `LIST`, a watch `WATCH`, and a PATCH names its patch type
    /// (`PATCH deployments (apply)`).
    #[serde(default)]
    pub requests: BTreeMap<String, BTreeMap<String, u64>>,
    /// Requests the data-plane endpoints that exist now have served (not cleared by a reset).
    #[serde(default)]
    pub data_plane_requests: u64,
}

impl StatsSnapshot {
    /// Cluster credentials requested so far: kubeconfig and credentials calls (each issues a
    /// token).
    pub fn credential_requests(&self) -> u64 {
        self.requests
            .get("do")
            .map(|kinds| {
                kinds
                    .iter()
                    .filter(|(k, _)| k.ends_with("/credentials") || k.ends_with("/kubeconfig"))
                    .map(|(_, n)| n)
                    .sum()
            })
            .unwrap_or(0)
    }
}

fn is_mutating(method: &http::Method) -> bool {
    matches!(
        *method,
        http::Method::POST | http::Method::PUT | http::Method::PATCH | http::Method::DELETE
    )
}

/// `METHOD /path` of a DigitalOcean API call with its ids (UUIDs, numbers) replaced by `{id}`.
pub fn do_kind(method: &http::Method, path: &str) -> String {
    let path: Vec<&str> = path
        .split('/')
        .map(|seg| {
            let id = !seg.is_empty()
                && (uuid::Uuid::parse_str(seg).is_ok() || seg.bytes().all(|b| b.is_ascii_digit()));
            if id {
                "{id}"
            } else {
                seg
            }
        })
        .collect();
    format!("{method} {}", path.join("/"))
}

/// The kind of a Kubernetes API call: `METHOD resource[/subresource]` (`GET` on a collection is
/// `LIST`, with `watch=` in the query `WATCH`; a PATCH names its type: `apply`, `merge`,
/// `strategic-merge` or `json`). Paths that are not resource paths (`/version`, `/apis`) are
/// `METHOD /path`.
pub fn kube_kind(method: &http::Method, path: &str, query: &str, content_type: &str) -> String {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/… or /apis/<group>/<version>/…
    let rest = match segs.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return format!("{method} {path}"),
    };
    let rest = match rest {
        ["namespaces", _ns, more @ ..] if !more.is_empty() => more,
        other => other,
    };
    let (resource, named, sub) = match rest {
        [] => return format!("{method} {path}"),
        [resource] => (*resource, false, None),
        [resource, _name] => (*resource, true, None),
        [resource, _name, sub, ..] => (*resource, true, Some(*sub)),
    };
    let watch = query
        .split('&')
        .any(|kv| kv.starts_with("watch=") && !kv.ends_with("=false") && !kv.ends_with("=0"));
    let verb = match *method {
        http::Method::GET if watch => "WATCH".to_string(),
        http::Method::GET if !named => "LIST".to_string(),
        http::Method::PATCH => {
            let kind = match content_type.split(';').next().unwrap_or("").trim() {
                "application/apply-patch+yaml" | "application/apply-patch+json" => "apply",
                "application/merge-patch+json" => "merge",
                "application/strategic-merge-patch+json" => "strategic-merge",
                "application/json-patch+json" => "json",
                _ => "other",
            };
            return match sub {
                Some(sub) => format!("PATCH {resource}/{sub} ({kind})"),
                None => format!("PATCH {resource} ({kind})"),
            };
        }
        ref m => m.to_string(),
    };
    match sub {
        Some(sub) => format!("{verb} {resource}/{sub}"),
        None => format!("{verb} {resource}"),
    }
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

    fn count(&self, api: &'static str, kind: String) {
        *self
            .requests
            .lock()
            .expect("stats lock")
            .entry(api)
            .or_default()
            .entry(kind)
            .or_insert(0) += 1;
    }

    /// An authenticated DigitalOcean API call (before faults are applied); returns its kind.
    pub(crate) fn record_do(&self, method: &http::Method, path: &str) -> String {
        if is_mutating(method) {
            self.record_mutation(format!("{method} {path}"));
        }
        let kind = do_kind(method, path);
        self.count("do", kind.clone());
        kind
    }

    /// An authenticated Kubernetes API call (before faults are applied); returns its kind.
    pub(crate) fn record_kube(
        &self,
        method: &http::Method,
        path: &str,
        query: &str,
        content_type: &str,
    ) -> String {
        if is_mutating(method) {
            self.kube_mutations.fetch_add(1, Ordering::SeqCst);
        }
        let kind = kube_kind(method, path, query, content_type);
        self.count("kube", kind.clone());
        kind
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
            kube_mutations: self.kube_mutations.load(Ordering::SeqCst),
            requests: self
                .requests
                .lock()
                .expect("stats lock")
                .iter()
                .map(|(api, kinds)| (api.to_string(), kinds.clone()))
                .collect(),
            data_plane_requests: 0,
        }
    }

    fn reset(&self) {
        self.mutations.store(0, Ordering::SeqCst);
        self.kube_mutations.store(0, Ordering::SeqCst);
        self.mutation_log.lock().expect("stats lock").clear();
        self.recent.lock().expect("stats lock").clear();
        self.requests.lock().expect("stats lock").clear();
    }
}

/// State shared by the HTTP handlers and the background driver.
pub(crate) struct Shared {
    pub(crate) world: world::World,
    pub(crate) faults: Arc<region_sim_base::faults::Faults>,
    pub(crate) token: String,
    pub(crate) base_url: String,
    pub(crate) stats: Arc<Stats>,
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

    /// The call counts, with the data plane's request count filled in.
    pub(crate) fn stats(&self) -> StatsSnapshot {
        StatsSnapshot {
            data_plane_requests: self.clusters.data_plane_requests(),
            ..self.stats.snapshot()
        }
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
        let front = region_sim_base::front::Front::start(cfg.front_port).await?;
        let shared = Arc::new(Shared {
            world: world::World::with_addresses(
                &cfg.region,
                cfg.delays.clone(),
                cfg.gpu_capacity.clone(),
                front.addresses().clone(),
            ),
            faults: Arc::new(region_sim_base::faults::Faults::new(cfg.faults.clone())),
            token: cfg.token.clone(),
            base_url: format!("http://{addr}"),
            stats: Arc::new(Stats::default()),
            clusters: clusters::Clusters::new(
                cfg.delays.clone(),
                Duration::from_millis(cfg.cloud_controller_idle_ms),
                cfg.credential_ttl,
                cfg.clock.clone(),
                Arc::new(hub_loader::HubLoader::new(cfg.default_hub.clone())?),
                front.clone(),
            ),
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
        tracing::info!(region = %cfg.region, %addr, front_port = front.port(), "region simulator listening");
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

    /// The port every cluster API and load balancer shares (each at an address of its own).
    pub fn front_port(&self) -> u16 {
        self.shared.clusters.front().port()
    }

    /// TCP connections open now to cluster APIs and load balancers.
    pub fn open_connections(&self) -> usize {
        self.shared.clusters.front().open_connections()
    }

    /// Loopback addresses held now by clusters and load balancers.
    pub fn addresses_in_use(&self) -> usize {
        self.shared.clusters.front().addresses().in_use()
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

    /// Arms a fault for the `nth` call to `api` (DigitalOcean or Kubernetes) from now; 0 is
    /// the next call. See [`ArmedKind`] for what it does to that call.
    pub fn arm_fault(&self, api: Api, nth: u64, kind: ArmedKind) -> anyhow::Result<ArmedFault> {
        self.arm(api, Counting::Calls, nth, kind)
    }

    /// As [`RegionSim::arm_fault`] for the `nth` write (POST, PUT, PATCH, DELETE) from now.
    pub fn arm_fault_on_write(
        &self,
        api: Api,
        nth: u64,
        kind: ArmedKind,
    ) -> anyhow::Result<ArmedFault> {
        self.arm(api, Counting::Writes, nth, kind)
    }

    fn arm(
        &self,
        api: Api,
        counting: Counting,
        nth: u64,
        kind: ArmedKind,
    ) -> anyhow::Result<ArmedFault> {
        let armed = self.shared.faults.arm(api, counting, nth, kind);
        armed.map_err(anyhow::Error::msg)
    }

    /// Armed faults still waiting for their call, and outages.
    pub fn armed_faults(&self) -> Vec<ArmedFault> {
        self.shared.faults.armed()
    }

    /// Removes every armed fault and ends every outage; returns them.
    pub fn disarm_faults(&self) -> Vec<ArmedFault> {
        self.shared.faults.disarm()
    }

    /// Armed faults that hit their call, oldest first (the last thousand).
    pub fn fired_faults(&self) -> Vec<FiredFault> {
        self.shared.faults.fired()
    }

    /// Authenticated calls to `api` (DigitalOcean or Kubernetes) since the simulator started,
    /// faulted ones included: the numbering armed faults use. Not cleared by
    /// [`RegionSim::reset_stats`]; 0 for the data plane.
    pub fn calls(&self, api: Api) -> u64 {
        self.shared.faults.calls(api, Counting::Calls).unwrap_or(0)
    }

    /// As [`RegionSim::calls`], writes only.
    pub fn writes(&self, api: Api) -> u64 {
        self.shared.faults.calls(api, Counting::Writes).unwrap_or(0)
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

    /// DigitalOcean and Kubernetes API call accounting.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats()
    }

    pub fn reset_stats(&self) {
        self.shared.stats.reset();
    }

    /// Number of mutating DigitalOcean API calls so far.
    pub fn do_mutations(&self) -> u64 {
        self.shared.stats.mutations.load(Ordering::SeqCst)
    }

    /// Number of mutating Kubernetes API calls (to any cluster) so far.
    pub fn kube_mutations(&self) -> u64 {
        self.shared.stats.kube_mutations.load(Ordering::SeqCst)
    }

    /// Revokes every cluster credential (kubeconfig or credentials token) issued so far, as
    /// revoking the DigitalOcean API token they were issued with does: the clusters' APIs refuse
    /// them (401) from now on, before they expire. Credentials fetched afterwards work.
    pub fn revoke_cluster_credentials(&self) {
        self.shared.clusters.revoke_credentials();
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
        self.shared.clusters.front().shutdown();
    }
}
