//! One reconcile pass over one dedicated inference: observe the cloud (DigitalOcean and the VPC
//! cluster's Kubernetes API), plan with the pure functions of [`crate::plan`], apply, and record
//! progress and status in the regional store. A pass never blocks on the cloud: when something
//! is still on its way (a cluster provisioning, pods loading a model) it says what it waits for
//! and when to look again.

mod clusters;
mod converge;
mod endpoint;
mod errors;
mod fleet;
mod kube_objects;
mod ledger;
mod node_pools;
mod records;
mod teardown;
mod unchanged;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api_types::lifecycle::Status;
use api_types::regional::Record;
use cloud_clients::{DoClient, KubeClientOptions};
use common::clock::Clock;
use region_store::{FleetBudget, Store, StoreError};
use uuid::Uuid;

pub use endpoint::probe_token_hash;
pub use errors::ReconcileError;

use crate::cluster_clients::ClusterClients;
use crate::metrics::{self, Outcome, Phase};
use crate::plan::{self, names, Images, Waiting};

/// Ledger kinds (see the `teardown_ledger` table).
pub const LEDGER_CLUSTER: &str = "cluster";
pub const LEDGER_NODE_POOL: &str = "node_pool";
pub const LEDGER_NAMESPACE: &str = "namespace";

/// What a worker needs beyond its clients.
#[derive(Clone)]
pub struct Settings {
    pub region: String,
    /// The Kubernetes field manager every object is applied under.
    pub field_manager: String,
    pub gateway_class: String,
    pub images: Images,
    /// DOKS version slug for new clusters (`latest` or e.g. `1.33.1-do.3`).
    pub kubernetes_version: String,
    /// The CPU node pool every new cluster gets (DOKS needs one; the EPP and gateway run there).
    pub system_pool_size: String,
    pub system_pool_count: u32,
    /// The Hugging Face Hub model servers download from; `None`: the public Hub.
    pub hub_endpoint: Option<String>,
    pub probe_timeout: Duration,
    /// How soon to look again while waiting for the cloud.
    pub poll: Duration,
    /// How soon to look again at a converged DI (periodic resync).
    pub resync: Duration,
    /// How often the autoscaler looks at a converged DI that declares `autoscaling`.
    pub autoscale_interval: Duration,
    /// How long after a DI's previous pass a resync may read its objects from the cluster's
    /// watch cache (see [`plan::step::reads_cache`]): more than a watch lags the server.
    pub cache_margin: Duration,
    /// Whether passes start and read the clusters' watch caches (see [`crate::watch_cache`]).
    pub watch_caches: bool,
    /// How long the load must have fit in one replica fewer before the autoscaler removes one.
    pub scale_down_window: Duration,
    /// The clock cluster credentials expire by (the system's; tests share one with the
    /// simulated cloud and move both).
    pub clock: Clock,
    /// How many DIs a fleet rollout (a new rendering that restarts pods of DIs nobody changed)
    /// restarts at once, and how many canaries must serve it first.
    pub fleet_budget: FleetBudget,
    /// A DI whose slot has not settled this long after it began fails it (and halts the rollout):
    /// long enough for a GPU node and a model load.
    pub fleet_slot_timeout: Duration,
    /// How long a request to a deployment scaled to zero is held while a replica starts.
    pub cold_start_hold: Duration,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("region", &self.region)
            .field("field_manager", &self.field_manager)
            .field("gateway_class", &self.gateway_class)
            .field("images", &self.images)
            .field("kubernetes_version", &self.kubernetes_version)
            .field("system_pool_size", &self.system_pool_size)
            .field("system_pool_count", &self.system_pool_count)
            .field("poll", &self.poll)
            .field("resync", &self.resync)
            .field("autoscale_interval", &self.autoscale_interval)
            .field("cache_margin", &self.cache_margin)
            .field("watch_caches", &self.watch_caches)
            .field("scale_down_window", &self.scale_down_window)
            .field("fleet_budget", &self.fleet_budget)
            .field("fleet_slot_timeout", &self.fleet_slot_timeout)
            .field("cold_start_hold", &self.cold_start_hold)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// Defaults for everything but the region.
    pub fn new(region: &str) -> Self {
        Settings {
            region: region.to_string(),
            field_manager: names::MANAGED_BY.to_string(),
            gateway_class: plan::manifests::DEFAULT_GATEWAY_CLASS.to_string(),
            images: Images::default(),
            kubernetes_version: "latest".to_string(),
            system_pool_size: "s-4vcpu-8gb".to_string(),
            system_pool_count: 2,
            hub_endpoint: None,
            probe_timeout: Duration::from_secs(5),
            poll: Duration::from_secs(2),
            resync: Duration::from_secs(300),
            autoscale_interval: Duration::from_secs(10),
            cache_margin: Duration::from_secs(2),
            watch_caches: true,
            scale_down_window: Duration::from_secs(120),
            clock: Clock::system(),
            fleet_budget: FleetBudget {
                max_rolling: 10,
                canaries: 2,
            },
            fleet_slot_timeout: Duration::from_secs(3600),
            cold_start_hold: plan::manifests::DEFAULT_COLD_START_HOLD,
        }
    }
}

/// Why a pass failed. Transient failures are retried with backoff; permanent ones put the DI in
/// The result of a successful pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    /// The DI's status as the pass left it; `None` once the DI exists no more.
    pub status: Option<Status>,
    /// The spec version the pass worked towards (pending, else current), if any.
    pub version: Option<i32>,
    /// What the DI still waits for; `None` when it is converged (or there is nothing to do).
    pub waiting: Option<Waiting>,
    /// When to look again (sooner if the DI changes).
    pub next_check: Duration,
    /// Mutating DigitalOcean calls made.
    pub do_writes: u64,
    /// Kubernetes writes that changed something (applies that changed an object, deletes).
    pub kube_writes: u64,
    /// The pass worked under the DI's slot of a fleet rollout: what it changed is a platform
    /// update, not a repair of a DI out of step with its spec.
    pub platform_update: bool,
}

impl Pass {
    fn new(status: Status, next_check: Duration) -> Self {
        Pass {
            status: Some(status),
            version: None,
            waiting: None,
            next_check,
            do_writes: 0,
            kube_writes: 0,
            platform_update: false,
        }
    }

    /// A pass over a DI that exists no more.
    fn gone(next_check: Duration) -> Self {
        Pass {
            status: None,
            ..Pass::new(Status::Deleting, next_check)
        }
    }

    fn wait(mut self, what: Waiting, next_check: Duration) -> Self {
        self.waiting = Some(what);
        self.next_check = next_check;
        self
    }
}

/// Reconciles DIs of one region. Cheap to share: one per worker, used by every concurrent pass;
/// each pass of the worker's runs on a copy whose store writes under that pass's lease (see
/// [`Reconciler::under_lease`]).
pub struct Reconciler {
    store: Store,
    shared: Arc<Clients>,
}

/// What every pass of a worker shares: its clients and what they learned.
pub struct Clients {
    cloud: DoClient,
    settings: Settings,
    /// A client per cluster, renewed before its credentials expire.
    kube: ClusterClients,
    /// Cluster ids by name, so that a pass reads its one cluster instead of listing them all.
    cluster_ids: Mutex<HashMap<String, String>>,
    kube_writes_total: AtomicU64,
    /// The autoscaler's newest memory of the deployments this worker looks at.
    recall: crate::scaling::Recall,
    /// How each DI's last full pass ended, so that a resync that nothing changed is skipped.
    converged: unchanged::Converged,
    /// See [`Reconciler::rendering`].
    rendering: String,
}

impl std::ops::Deref for Reconciler {
    type Target = Clients;
    fn deref(&self) -> &Clients {
        &self.shared
    }
}

type Result<T> = std::result::Result<T, ReconcileError>;
impl Reconciler {
    pub fn new(store: Store, cloud: DoClient, settings: Settings) -> Self {
        Reconciler {
            store,
            shared: Arc::new(Clients {
                cloud,
                kube: ClusterClients::new(
                    &settings.field_manager,
                    KubeClientOptions::default(),
                    settings.clock.clone(),
                    settings.resync,
                ),
                cluster_ids: Mutex::new(HashMap::new()),
                kube_writes_total: AtomicU64::new(0),
                recall: crate::scaling::Recall::default(),
                converged: unchanged::Converged::default(),
                rendering: plan::fleet::rendering_id(
                    &settings.images,
                    &settings.gateway_class,
                    settings.hub_endpoint.as_deref(),
                    settings.cold_start_hold,
                ),
                settings,
            }),
        }
    }

    /// This reconciler for one pass over DI `claim.di_id` under `claim`'s lease: every store
    /// write the pass makes is fenced by it (see [`Store::under_lease`]), so that a pass that
    /// outlived its lease writes nothing. The clients are shared.
    pub fn under_lease(&self, claim: &region_store::Claim) -> Reconciler {
        Reconciler {
            store: self.store.under_lease(claim.di_id, claim.lease_token),
            shared: self.shared.clone(),
        }
    }

    /// The same reconciler, making its cluster clients with `options` (the DigitalOcean client
    /// comes configured; tests that drive passes one by one want few or quick retries).
    /// The DIs that this worker's cluster watches saw change (see [`crate::watch_cache`]).
    pub fn wakes(&self) -> Arc<crate::watch_cache::Wakes> {
        self.kube.wakes()
    }

    pub fn with_kube_options(mut self, options: KubeClientOptions) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("options are set before the reconciler is shared")
            .kube
            .set_options(options);
        self
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Mutating DigitalOcean calls this reconciler's client sent (attempts, retries included).
    pub fn do_mutations(&self) -> u64 {
        self.cloud.mutating_calls()
    }

    /// Kubernetes writes that changed something, over every pass so far.
    pub fn kube_writes(&self) -> u64 {
        self.kube_writes_total.load(Ordering::SeqCst)
    }

    /// One pass over DI `id`, recorded in the pass metrics by phase and outcome.
    pub async fn reconcile(&self, id: Uuid) -> Result<Pass> {
        let started = Instant::now();
        // Fields of the pass's span (see `runtime::run_one`): the status it found and left.
        let span = tracing::Span::current();
        let (phase, result) = match self.store.dedicated_inference_any(id).await {
            Ok(rec) => {
                span.record("phase", rec.status.as_str());
                let phase = if rec.gone {
                    Phase::Idle
                } else {
                    Phase::of(rec.status, rec.pending_spec.is_some())
                };
                (phase, self.reconcile_record(&rec).await)
            }
            Err(StoreError::NotFound) => (Phase::Idle, Ok(Pass::gone(self.settings.resync))),
            Err(e) => (Phase::Unknown, Err(e.into())),
        };
        let outcome = match &result {
            Ok(pass) if pass.waiting.is_none() => Outcome::Converged,
            Ok(_) => Outcome::Progress,
            Err(ReconcileError::Transient(_) | ReconcileError::CredentialsRefused(_)) => {
                Outcome::Retry
            }
            Err(ReconcileError::LeaseLost) => Outcome::LeaseLost,
            Err(ReconcileError::Permanent { .. }) => Outcome::Error,
        };
        metrics::pass(phase, outcome, started.elapsed());
        if let Some(waiting) = result.as_ref().ok().and_then(|p| p.waiting.as_ref()) {
            metrics::waiting(waiting.kind());
        }
        if let Ok(pass) = &result {
            span.record("status", pass.status.map_or("gone", Status::as_str));
        }
        span.record("outcome", outcome.as_str());
        result
    }

    async fn reconcile_record(&self, rec: &Record) -> Result<Pass> {
        if rec.gone {
            return Ok(Pass::gone(self.settings.resync));
        }
        let kube_before = self.kube_writes();
        let do_before = self.cloud.mutating_calls();
        let target = |rec: &Record| {
            rec.pending_spec
                .as_ref()
                .or(rec.spec.as_ref())
                .map(|s| s.version)
        };
        let mut version = target(rec);
        let mut pass = match self.pass_for(rec, version).await {
            Err(ReconcileError::CredentialsRefused(why)) => {
                // The cluster's credentials lapsed or were revoked under this pass. The client
                // that met the 401 is never handed out again, so running the pass again fetches
                // fresh ones; nothing else was wrong, so it runs now rather than after a
                // failure's backoff. Passes are idempotent: what the first one did is found done;
                // the DI is read again, as the first one may have moved its status.
                tracing::info!(di = %rec.id, reason = %why, "cluster credentials refused; running the pass again with fresh ones");
                let rec = self.store.dedicated_inference_any(rec.id).await?;
                if rec.gone {
                    return Ok(Pass::gone(self.settings.resync));
                }
                version = target(&rec);
                match self.pass_for(&rec, version).await {
                    Err(ReconcileError::CredentialsRefused(why)) => Err(ReconcileError::Transient(
                        format!("fresh cluster credentials refused too: {why}"),
                    )),
                    r => r,
                }
            }
            r => r,
        }?;
        pass.version = version;
        pass.kube_writes = self.kube_writes() - kube_before;
        pass.do_writes = self.cloud.mutating_calls() - do_before;
        Ok(pass)
    }

    /// The pass the DI's status calls for.
    async fn pass_for(&self, rec: &Record, version: Option<i32>) -> Result<Pass> {
        Ok(match rec.status {
            // Deletion wins over everything: a refusal while tearing down is retried, never
            // parked in `error` (the store would not apply it to a deleting DI anyway).
            Status::Deleting => self.teardown(rec).await.map_err(|e| match e {
                ReconcileError::Permanent {
                    reason, message, ..
                } => ReconcileError::Transient(format!("{reason}: {message}")),
                e => e,
            })?,
            Status::Error => self
                .refresh_credentials(rec)
                .await
                .map_err(|e| e.during(version))?,
            Status::New | Status::Provisioning | Status::Active | Status::Updating => {
                self.converge(rec).await.map_err(|e| e.during(version))?
            }
        })
    }
}

/// A shared reconciler.
pub type SharedReconciler = Arc<Reconciler>;
