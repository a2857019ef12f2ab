//! One reconcile pass over one dedicated inference: observe the cloud (DigitalOcean and the VPC
//! cluster's Kubernetes API), plan with the pure functions of [`crate::plan`], apply, and record
//! progress and status in the regional store. A pass never blocks on the cloud: when something
//! is still on its way (a cluster provisioning, pods loading a model) it says what it waits for
//! and when to look again.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use api_types::lifecycle::Status;
use api_types::regional::{Record, StoredSpec};
use base64::Engine;
use cloud_clients::digitalocean::{
    Cluster, ClusterCreateRequest, ClusterState, NodePoolCreateRequest, NodePoolUpdateRequest,
};
use cloud_clients::{Deleted, DoClient, DoError, KubeClient, KubeClientOptions, KubeError};
use region_store::{
    ClusterRelease, DeploymentReplicas, Endpoints, LedgerEntry, NewCa, ObservedAccelerator, Store,
    StoreError,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::cluster_clients::{self, ClusterClients};
use crate::metrics::{self, Outcome, Phase};
use crate::plan::{
    self, names, AccessTokenHash, ClusterWait, Images, ManifestInput, PoolAction, TlsPair, Waiting,
};
use crate::scaling;

/// Ledger kinds (see the `teardown_ledger` table).
pub const LEDGER_CLUSTER: &str = "cluster";
pub const LEDGER_NODE_POOL: &str = "node_pool";
pub const LEDGER_NAMESPACE: &str = "namespace";

/// How soon a DI whose node pools wait for pods (to be placed, or to leave) is looked at again.
const POOLS_HELD_RECHECK: Duration = Duration::from_secs(10);

/// The kinds the worker renders, observed for readiness and pruning: (apiVersion, kind).
const RENDERED_KINDS: &[(&str, &str)] = &[
    ("v1", "Secret"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
];

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
    /// How long the load must have fit in one replica fewer before the autoscaler removes one.
    pub scale_down_window: Duration,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("region", &self.region)
            .field("field_manager", &self.field_manager)
            .field("gateway_class", &self.gateway_class)
            .field("kubernetes_version", &self.kubernetes_version)
            .field("system_pool_size", &self.system_pool_size)
            .field("system_pool_count", &self.system_pool_count)
            .field("poll", &self.poll)
            .field("resync", &self.resync)
            .field("autoscale_interval", &self.autoscale_interval)
            .field("scale_down_window", &self.scale_down_window)
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
            scale_down_window: Duration::from_secs(120),
        }
    }
}

/// Why a pass failed. Transient failures are retried with backoff; permanent ones put the DI in
/// `error` until its spec changes.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("transient: {0}")]
    Transient(String),
    /// A cluster refused the worker's credentials for it (401): they expired or were revoked.
    /// Not an ordinary transient failure: the reconciler fetches fresh credentials and runs the
    /// pass again at once, and only when those are refused too does the queue retry it, as it
    /// retries a transient failure.
    #[error("cluster credentials refused: {0}")]
    CredentialsRefused(String),
    /// The pass's lease on the DI is no longer held (it ran out, or another worker took the
    /// DI): the pass stops and writes nothing more; the lease's holder carries on.
    #[error("the lease was lost")]
    LeaseLost,
    #[error("{reason}: {message}")]
    Permanent {
        reason: String,
        message: String,
        /// The spec version the pass was rolling out, when it was about one (see
        /// [`Store::error_set`]).
        version: Option<i32>,
    },
}

impl ReconcileError {
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ReconcileError::Transient(_) | ReconcileError::CredentialsRefused(_)
        )
    }

    fn permanent(reason: &str, message: impl Into<String>) -> Self {
        ReconcileError::Permanent {
            reason: reason.to_string(),
            message: message.into(),
            version: None,
        }
    }

    /// A permanent failure while rolling out spec `version`.
    fn during(self, version: Option<i32>) -> Self {
        match self {
            ReconcileError::Permanent {
                reason, message, ..
            } => ReconcileError::Permanent {
                reason,
                message,
                version,
            },
            e => e,
        }
    }
}

impl From<DoError> for ReconcileError {
    fn from(e: DoError) -> Self {
        if e.is_capacity() {
            return ReconcileError::permanent(
                "CapacityExhausted",
                format!(
                    "The region has no capacity for the requested GPUs: {}",
                    e.message().unwrap_or("insufficient capacity")
                ),
            );
        }
        if e.is_transient() || e.is_not_found() || e.is_already_exists() {
            // A 404 or 409 means the world moved since we looked: look again.
            return ReconcileError::Transient(e.to_string());
        }
        match e.status() {
            Some(401) | Some(403) => ReconcileError::Transient(e.to_string()),
            Some(_) => ReconcileError::permanent(
                "CloudRejected",
                format!(
                    "DigitalOcean rejected a request: {}",
                    e.message().unwrap_or("unknown error")
                ),
            ),
            None => ReconcileError::Transient(e.to_string()),
        }
    }
}

impl From<KubeError> for ReconcileError {
    fn from(e: KubeError) -> Self {
        match &e {
            e if e.is_transient() || e.is_not_found() || e.is_forbidden() => {
                ReconcileError::Transient(e.to_string())
            }
            e if e.is_unauthorized() => ReconcileError::CredentialsRefused(e.to_string()),
            KubeError::Api { code, message, .. } if (400..500).contains(code) => {
                ReconcileError::permanent(
                    "KubernetesRejected",
                    format!("The cluster rejected an object: {message}"),
                )
            }
            _ => ReconcileError::Transient(e.to_string()),
        }
    }
}

impl From<StoreError> for ReconcileError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::LeaseLost => ReconcileError::LeaseLost,
            e => ReconcileError::Transient(format!("store: {e}")),
        }
    }
}

impl From<plan::PlanError> for ReconcileError {
    fn from(e: plan::PlanError) -> Self {
        ReconcileError::permanent("InvalidSpec", e.to_string())
    }
}

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
}

impl std::ops::Deref for Reconciler {
    type Target = Clients;
    fn deref(&self) -> &Clients {
        &self.shared
    }
}

type Result<T> = std::result::Result<T, ReconcileError>;

/// The entry of DI `di_id`'s probe token `value` among its access-token hashes.
///
/// Why a token of the DI's own rather than an unauthenticated health path: the probe must show
/// that a customer's request would succeed, through the load balancer, TLS, the token check,
/// the route and the endpoint picker to a model server, and a path that skips the token check
/// is a hole in every endpoint. Why not a key derived from the DI id with a region-wide secret
/// (as before): whoever holds that secret can mint the probe token of every DI, and no DI's can
/// be revoked without changing all of them. So each DI gets a random token, sealed in the
/// regional store (`Store::probe_token`), whose hash only that DI's gateway accepts; it is
/// rotated with `Store::probe_token_rotate` and deleted with the DI.
///
/// Its key in the Secret is fixed per DI (derived from the DI id), so a rotation replaces the
/// value in place and the customer's token ids never collide with it.
pub fn probe_token_hash(di_id: Uuid, value: &str) -> AccessTokenHash {
    let digest = Sha256::new()
        .chain_update(b"probe-token-id:")
        .chain_update(di_id.as_bytes())
        .finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    AccessTokenHash::from_value(uuid::Builder::from_random_bytes(b).into_uuid(), value)
}

fn b64_decode(v: &Value) -> Option<String> {
    let s = v.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
    String::from_utf8(bytes).ok()
}

/// The endpoint certificate: the one in the cluster unless it must be reissued, from the CA
/// [`plan::signing_ca`] picks among the DI's.
fn tls(cas: &[NewCa], observed: &[Value]) -> Result<TlsPair> {
    // The addresses the load balancers report: the names the certificate must cover.
    let mut hosts: Vec<String> = observed
        .iter()
        .filter(|o| o["kind"] == "Service" && o["spec"]["type"] == "LoadBalancer")
        .filter_map(|o| o.pointer("/status/loadBalancer/ingress/0"))
        .filter_map(|i| {
            i.get("ip")
                .and_then(Value::as_str)
                .or_else(|| i.get("hostname").and_then(Value::as_str))
        })
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    hosts.sort();
    hosts.dedup();
    let now = SystemTime::now();
    let ends: Vec<SystemTime> = cas.iter().map(|ca| ca.not_after.into()).collect();
    let ca = plan::signing_ca(&ends, now)
        .map(|i| &cas[i])
        .ok_or_else(|| ReconcileError::Transient("the DI has no certificate authority".into()))?;
    let existing = observed
        .iter()
        .find(|o| {
            o["kind"] == "Secret"
                && o.pointer("/metadata/name").and_then(Value::as_str) == Some(names::TLS_SECRET)
        })
        .and_then(|o| {
            Some(TlsPair {
                cert_pem: b64_decode(o.pointer("/data/tls.crt")?)?,
                key_pem: b64_decode(o.pointer("/data/tls.key")?)?,
            })
        });
    match existing {
        Some(pair) if !plan::needs_reissue(&pair.cert_pem, &ca.cert_pem, &hosts, now) => Ok(pair),
        _ => plan::issue(&ca.cert_pem, &ca.key_pem, &hosts, now).map_err(Into::into),
    }
}

/// A DI's teardown ledger as read at the start of a pass (the pass's lease makes it the only
/// writer): an entry already recorded is not written again, so a pass over a converged DI
/// writes nothing to the ledger.
struct Ledger<'a> {
    store: &'a Store,
    id: Uuid,
    known: Vec<LedgerEntry>,
}

impl Ledger<'_> {
    /// As [`Store::ledger_record`]: recorded before (or as) the resource is created.
    async fn record(
        &mut self,
        kind: &str,
        name: &str,
        scope: &str,
        external_id: Option<&str>,
    ) -> Result<()> {
        let known = self
            .known
            .iter()
            .position(|e| e.kind == kind && e.name == name);
        if let Some(i) = known {
            let e = &self.known[i];
            if e.scope == scope
                && (external_id.is_none() || e.external_id.as_deref() == external_id)
            {
                return Ok(());
            }
        }
        self.store
            .ledger_record(self.id, kind, name, scope, external_id)
            .await?;
        let external_id = external_id.map(str::to_string);
        match known {
            Some(i) => {
                let e = &mut self.known[i];
                e.scope = scope.to_string();
                if external_id.is_some() {
                    e.external_id = external_id;
                }
            }
            None => self.known.push(LedgerEntry {
                seq: 0,
                kind: kind.to_string(),
                name: name.to_string(),
                scope: scope.to_string(),
                external_id,
                retiring: false,
            }),
        }
        Ok(())
    }

    /// Records that the DI uses cluster `cluster_id` (the VPC's cluster `name`); `false` when
    /// its last user's teardown is deleting it (see [`Store::ledger_cluster_use`]).
    async fn use_cluster(&mut self, name: &str, cluster_id: &str) -> Result<bool> {
        let known = self.known.iter().any(|e| {
            e.kind == LEDGER_CLUSTER
                && e.name == name
                && e.external_id.as_deref() == Some(cluster_id)
        });
        if known {
            // Recorded by an earlier pass: no teardown can have retired it since, because
            // this DI's entry counts as a user.
            return Ok(true);
        }
        if !self
            .store
            .ledger_cluster_use(self.id, name, cluster_id)
            .await?
        {
            return Ok(false);
        }
        self.known
            .retain(|e| !(e.kind == LEDGER_CLUSTER && e.name == name));
        self.known.push(LedgerEntry {
            seq: 0,
            kind: LEDGER_CLUSTER.to_string(),
            name: name.to_string(),
            scope: String::new(),
            external_id: Some(cluster_id.to_string()),
            retiring: false,
        });
        Ok(true)
    }

    async fn remove(&mut self, kind: &str, name: &str) -> Result<()> {
        self.store.ledger_remove(self.id, kind, name).await?;
        self.known.retain(|e| !(e.kind == kind && e.name == name));
        Ok(())
    }
}

/// The tokens the gateway must accept: the DI's live access tokens and the worker's probe token
/// of this DI.
fn access_tokens(
    id: Uuid,
    hashes: Vec<(Uuid, String)>,
    probe_value: &str,
) -> Result<Vec<AccessTokenHash>> {
    let mut tokens: Vec<AccessTokenHash> = hashes
        .into_iter()
        .map(|(tid, hash)| AccessTokenHash::new(tid, &hash))
        .collect::<std::result::Result<_, _>>()?;
    tokens.push(probe_token_hash(id, probe_value));
    Ok(tokens)
}

/// The listed copy of `obj` (same kind and name; everything listed is in the DI's namespace).
fn listed<'a>(listed: &'a [Value], obj: &Value) -> Option<&'a Value> {
    listed.iter().find(|o| {
        o["kind"] == obj["kind"]
            && o["apiVersion"] == obj["apiVersion"]
            && o.pointer("/metadata/name") == obj.pointer("/metadata/name")
    })
}

fn label_selector(di_id: Uuid) -> String {
    format!(
        "{}={},{}={}",
        names::MANAGED_BY_LABEL,
        names::MANAGED_BY,
        names::DI_ID_LABEL,
        di_id
    )
}

impl Reconciler {
    pub fn new(store: Store, cloud: DoClient, settings: Settings) -> Self {
        Reconciler {
            store,
            shared: Arc::new(Clients {
                cloud,
                kube: ClusterClients::new(&settings.field_manager, KubeClientOptions::default()),
                cluster_ids: Mutex::new(HashMap::new()),
                kube_writes_total: AtomicU64::new(0),
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

    // -----------------------------------------------------------------------------------------
    // Converge

    async fn converge(&self, rec: &Record) -> Result<Pass> {
        let id = rec.id;
        let s = &self.settings;
        let Some(spec) = rec.pending_spec.as_ref().or(rec.spec.as_ref()) else {
            return Ok(Pass::new(rec.status, s.resync));
        };
        let pending = rec.pending_spec.as_ref().map(|p| p.version);
        let mut status = rec.status;
        if status == Status::New {
            status = self.store.provisioning_begin(id).await?.status;
        } else if status == Status::Active && pending.is_some() {
            status = self.store.updating_begin(id).await?.status;
        }
        let pass = Pass::new(status, s.poll);
        let mut models = plan::models(&spec.model_deployments)?;
        // A converged DI that autoscales is looked at every autoscale interval, not every resync.
        let autoscaled = spec
            .model_deployments
            .iter()
            .any(|md| plan::autoscale::Policy::of(md).is_some());
        let converged_check = if autoscaled {
            s.autoscale_interval.min(s.resync)
        } else {
            s.resync
        };
        let inputs = self.store.pass_inputs(id).await?;
        let mut ledger = Ledger {
            store: &self.store,
            id,
            known: inputs.ledger,
        };

        // The VPC's cluster: create it (recorded first), then wait for it to run.
        let cluster_name = names::cluster(&rec.vpc_uuid);
        // A resync of a converged DI reaches the cluster it reached last time without asking
        // DigitalOcean: at 1,000 DIs, two reads per resync would exceed the API's hourly budget
        // several times over. When the cluster does not answer, the next pass asks again.
        let resync = status == Status::Active && pending.is_none();
        let trusted = if resync {
            self.trusted_cluster(&cluster_name)
        } else {
            None
        };
        let trusting = trusted.is_some();
        let probe_value = inputs.probe_token;
        let tokens = access_tokens(id, inputs.token_hashes, &probe_value)?;
        if !resync {
            // A token created or revoked reaches the gateway before anything in this pass that
            // may wait on DigitalOcean (a slow or failing API must not delay a revocation).
            if let Some((_, kube)) = self.trusted_cluster(&cluster_name) {
                if let Err(e) = self.apply_tokens(&kube, id, &tokens).await {
                    tracing::debug!(di = %id, error = %e, "early token sync failed; the pass retries it");
                }
            }
        }
        let (cluster_id, kube) = match trusted {
            Some((cluster_id, kube)) => {
                if !ledger.use_cluster(&cluster_name, &cluster_id).await? {
                    self.distrust_cluster(&cluster_name, &cluster_id);
                    let wait = Waiting::Cluster {
                        name: cluster_name,
                        state: ClusterWait::BeingDeleted,
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                (cluster_id, kube)
            }
            None => match self
                .running_cluster(&cluster_name, rec, &pass, &mut ledger)
                .await?
            {
                Ok(ready) => ready,
                Err(wait) => return Ok(wait),
            },
        };

        // Observe.
        let ns = names::namespace(&id);
        let observed = match self.observe(&kube, id, &ns).await {
            Err(e) if trusting => {
                self.distrust_cluster(&cluster_name, &cluster_id);
                return Err(e);
            }
            r => r?,
        };
        let rendered: Vec<Value> = observed
            .iter()
            .filter(|o| o["kind"] != "Pod" && o["kind"] != "Node")
            .cloned()
            .collect();

        // The database's clock, not this machine's: the autoscaler's memory is shared by every
        // worker that takes the DI, and their clocks may disagree.
        let now_ms = inputs.now_ms;
        // Replicas: the spec's scale, or the autoscaler's count. Its decision is recorded
        // before anything applies it, so that a pass failing halfway does not forget it.
        let scaled = scaling::decide_all(
            &kube,
            &ns,
            spec,
            resync,
            &observed,
            &inputs.replicas,
            now_ms,
            s.scale_down_window,
        )
        .await;
        for m in &mut models {
            if let Some(x) = scaled.iter().find(|x| x.model_id == m.model_id) {
                m.scale = x.wanted;
            }
        }
        self.record_replicas(id, &scaled, &observed, &inputs.replicas)
            .await?;

        // Desired objects.
        let tls = tls(&inputs.cas, &observed)?;
        let input = ManifestInput {
            di_id: id,
            models: models.clone(),
            enable_public_endpoint: rec.enable_public_endpoint,
            hugging_face_token: inputs.hugging_face_token,
            tls,
            access_tokens: tokens,
            gateway_class: s.gateway_class.clone(),
            images: s.images.clone(),
            hub_endpoint: s.hub_endpoint.clone(),
        };
        let desired = plan::manifests(&input);

        // Node pools: read from DigitalOcean unless a resync finds the Nodes as planned.
        let rolling = plan::readiness::rollouts(&desired, &observed);
        let mut writes = 0u64;
        // Pool shrinks and deletions held back for pods to be placed or to leave: the pools
        // are not done, so the DI is looked at again soon even once it serves.
        let mut pools_held = Vec::new();
        if !(resync && rolling.is_empty() && plan::nodes_match(&id, &models, &observed)) {
            let awaited = plan::readiness::awaited_pools(&desired, &observed);
            match self
                .apply_node_pools(
                    id,
                    &cluster_id,
                    &models,
                    &rolling,
                    &awaited,
                    &observed,
                    &mut ledger,
                )
                .await
            {
                Ok((n, held)) => {
                    writes += n;
                    pools_held = held;
                }
                // The autoscaler asked for GPUs the cloud does not have: an active DI keeps
                // serving with what it runs, rather than turning to `error`.
                Err(e @ ReconcileError::Permanent { .. }) if resync => {
                    let ReconcileError::Permanent { message, .. } = &e else {
                        unreachable!("matched above")
                    };
                    let Some(back) =
                        scaling::after_refusal(spec, &scaled, &observed, message, now_ms)
                    else {
                        return Err(e);
                    };
                    self.record_replicas(id, &back, &observed, &[]).await?;
                    let wait = Waiting::ScaleUpRefused {
                        message: message.clone(),
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                Err(e) => return Err(e),
            }
        }

        // Kubernetes objects: the namespace is recorded before it is created.
        ledger
            .record(LEDGER_NAMESPACE, &ns, &cluster_id, None)
            .await?;
        // Namespaces first (everything else lives in them), then the rest at once, then the
        // namespace's default-deny NetworkPolicy: a namespace that gains its policies while it
        // serves is never isolated before the allows exist. Objects the last list shows up to
        // date cost no request.
        let (namespaces, namespaced): (Vec<&Value>, Vec<&Value>) =
            desired.iter().partition(|o| o["kind"] == "Namespace");
        let (isolation, namespaced): (Vec<&Value>, Vec<&Value>) = namespaced
            .into_iter()
            .partition(|o| plan::manifests::is_default_deny(o));
        let mut changed = Vec::new();
        for obj in namespaces {
            changed.push(kube.apply(obj).await?.changed);
        }
        let applies = namespaced
            .into_iter()
            .map(|obj| kube.apply_observed(obj, listed(&rendered, obj)));
        for applied in futures::future::try_join_all(applies).await? {
            changed.push(applied.changed);
        }
        for obj in isolation {
            changed.push(
                kube.apply_observed(obj, listed(&rendered, obj))
                    .await?
                    .changed,
            );
        }
        for _ in changed.into_iter().filter(|c| *c) {
            writes += 1;
            self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
        }
        for key in plan::prune(&id, &desired, &rendered) {
            let d = kube
                .delete(
                    &key.api_version,
                    &key.kind,
                    key.namespace.as_deref(),
                    &key.name,
                )
                .await?;
            if d != Deleted::AlreadyGone {
                writes += 1;
                self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
            }
        }

        // Progress.
        let assessment = plan::assess(&id, &desired, &observed);
        self.record_accelerators(id, spec, &assessment.accelerators, &inputs.accelerators)
            .await?;
        // A model server that cannot load its model since the rollout began does not load by
        // waiting: the rollout fails in its words. (On a resync the DI keeps serving with its
        // other replicas; the wait names the failing pod.)
        if pending.is_some() {
            let began = SystemTime::from(spec.created_at);
            if let Some(failure) = plan::load_failure(&desired, &observed, began) {
                return Err(ReconcileError::permanent(
                    plan::MODEL_LOAD_FAILED,
                    failure.to_string(),
                ));
            }
        }
        if writes > 0 {
            return Ok(pass.wait(Waiting::Applied { changes: writes }, s.poll));
        }
        if !assessment.progress.ready {
            let waiting_for = assessment.progress.waiting_for;
            return Ok(pass.wait(Waiting::Rollout { waiting_for }, s.poll));
        }
        let endpoints = Endpoints {
            public_fqdn: assessment.public_endpoint.clone(),
            private_fqdn: assessment.private_endpoint.clone(),
        };
        // Serving as declared, with pools still to shrink or go once pods have left (which on a
        // real cluster takes up to their grace period): looked at again soon, not at the next
        // resync, though nothing customers asked for is waiting.
        let settled = |status: Status| {
            if pools_held.is_empty() {
                return Pass::new(status, converged_check);
            }
            tracing::debug!(di = %id, held = %pools_held.join("; "), "node pools held back");
            Pass::new(status, converged_check.min(POOLS_HELD_RECHECK))
        };
        let Some(version) = pending else {
            // Converged and nothing to roll out: a resync. Endpoints that moved since the rollout
            // (a load balancer replaced, the cluster rebuilt) are recorded.
            if status == Status::Active
                && (rec.public_endpoint_fqdn != endpoints.public_fqdn
                    || rec.private_endpoint_fqdn != endpoints.private_fqdn)
            {
                self.store.endpoints_update(id, &endpoints).await?;
                tracing::info!(di = %id, ?endpoints, "endpoints moved");
            }
            return Ok(settled(status));
        };
        let Some(url) = assessment
            .public_endpoint
            .clone()
            .or_else(|| assessment.private_endpoint.clone())
        else {
            return Ok(pass.wait(Waiting::EndpointAddress, s.poll));
        };
        if let Err(why) = self.probe(&url, &inputs.cas, &probe_value).await {
            return Ok(pass.wait(Waiting::Probe { url, why }, s.poll));
        }
        match self.store.rollout_complete(id, version, &endpoints).await {
            // The pass leaves the DI active (its span says so): no later pass is needed to see it.
            Ok(done) => {
                tracing::info!(di = %id, version, "rollout complete");
                Ok(settled(done.status))
            }
            // Superseded by a newer spec (or deleted) meanwhile: the next pass converges on it.
            Err(StoreError::Conflict(why)) => {
                Ok(pass.wait(Waiting::Superseded { why }, Duration::ZERO))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A DI in `error` keeps serving with what its last good spec left in the cluster, and is
    /// not converged until its spec changes. What a customer changes meanwhile that is not the
    /// spec — its access tokens — must still reach the gateway: a revoked token is refused
    /// within seconds whatever the status.
    async fn refresh_credentials(&self, rec: &Record) -> Result<Pass> {
        let done = Pass::new(rec.status, self.settings.resync);
        let name = names::cluster(&rec.vpc_uuid);
        let (cluster_id, kube) = match self.trusted_cluster(&name) {
            Some(reached) => reached,
            None => match self.find_cluster(&name, false).await? {
                Some(c) if c.status.state == ClusterState::Running => {
                    (c.id.clone(), self.kube_for(&c.id).await?)
                }
                // No cluster: nothing serves.
                _ => return Ok(done),
            },
        };
        let hashes = self.store.token_hashes(rec.id).await?;
        let probe = self.store.probe_token(rec.id).await?;
        if let Err(e) = self
            .apply_tokens(&kube, rec.id, &access_tokens(rec.id, hashes, &probe)?)
            .await
        {
            self.distrust_cluster(&name, &cluster_id);
            return Err(e.into());
        }
        Ok(done)
    }

    /// Writes the DI's access-token Secret (what the gateway checks) on its own. A missing
    /// namespace means nothing serves yet: nothing to do.
    async fn apply_tokens(
        &self,
        kube: &KubeClient,
        id: Uuid,
        tokens: &[AccessTokenHash],
    ) -> std::result::Result<(), KubeError> {
        let secret = plan::manifests::access_tokens_secret(&id, tokens);
        match kube.apply(&secret).await {
            Ok(applied) => {
                if applied.changed {
                    self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            }
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Compares the DI's node pools in DigitalOcean with the plan and applies the difference;
    /// returns how many changes it made.
    async fn apply_node_pools(
        &self,
        id: Uuid,
        cluster_id: &str,
        models: &[plan::Model],
        rolling: &plan::readiness::Rollouts,
        awaited: &std::collections::BTreeSet<String>,
        observed: &[Value],
        ledger: &mut Ledger<'_>,
    ) -> Result<(u64, Vec<String>)> {
        let pools = self.cloud.node_pool_list(cluster_id).await?;
        let busy = plan::readiness::busy_nodes(observed, SystemTime::now());
        let observed_pools: Vec<plan::ObservedPool> = pools
            .iter()
            .map(|p| plan::ObservedPool {
                id: p.id.clone(),
                name: p.name.clone(),
                size: p.size.clone(),
                count: p.count,
                labels: p.labels.clone(),
                nodes: p
                    .nodes
                    .iter()
                    .map(|n| plan::ObservedNode {
                        id: n.id.clone(),
                        name: n.name.clone(),
                        busy: busy.contains(&n.name),
                    })
                    .collect(),
            })
            .collect();
        let plan = plan::node_pools(&id, models, rolling, &observed_pools, awaited);
        let changes = plan.actions.len() as u64;
        for action in plan.actions {
            match action {
                PoolAction::Create(d) => {
                    ledger
                        .record(LEDGER_NODE_POOL, &d.name, cluster_id, None)
                        .await?;
                    let mut req = NodePoolCreateRequest::new(&d.name, &d.size, d.count);
                    req.labels = d.labels.clone();
                    req.tags = d.tags.clone();
                    let created = self.cloud.node_pool_create(cluster_id, &req).await?;
                    ledger
                        .record(LEDGER_NODE_POOL, &d.name, cluster_id, Some(&created.id))
                        .await?;
                    tracing::info!(di = %id, pool = %d.name, "node pool created");
                }
                PoolAction::Resize {
                    pool_id,
                    name,
                    count,
                } => {
                    self.cloud
                        .node_pool_update(
                            cluster_id,
                            &pool_id,
                            &NodePoolUpdateRequest::new(&name, count),
                        )
                        .await?;
                    tracing::info!(di = %id, pool = %name, count, "node pool resized");
                }
                PoolAction::DeleteNode { pool_id, node_id } => {
                    match self
                        .cloud
                        .node_delete(cluster_id, &pool_id, &node_id, false)
                        .await
                    {
                        Err(e) if e.is_not_found() => {}
                        r => r?,
                    }
                }
                PoolAction::Delete { pool_id, name } => {
                    match self.cloud.node_pool_delete(cluster_id, &pool_id).await {
                        Err(e) if e.is_not_found() => {}
                        r => r?,
                    }
                    ledger.remove(LEDGER_NODE_POOL, &name).await?;
                    tracing::info!(di = %id, pool = %name, "node pool deleted");
                }
            }
        }
        Ok((changes, plan.held))
    }

    /// The VPC's cluster `name` (its id) with a client, once it runs; until then, the pass to
    /// end with. Creates the cluster when there is none, recorded in the ledger first.
    async fn running_cluster(
        &self,
        name: &str,
        rec: &Record,
        pass: &Pass,
        ledger: &mut Ledger<'_>,
    ) -> Result<std::result::Result<(String, KubeClient), Pass>> {
        let poll = self.settings.poll;
        let cluster = match self.find_cluster(name, false).await? {
            Some(c) => c,
            None => {
                ledger.record(LEDGER_CLUSTER, name, "", None).await?;
                let c = match self.create_cluster(name, rec).await {
                    Ok(c) => c,
                    // Another DI of the VPC (or a retried attempt) created it first: look again
                    // at the next check, not after a failure's backoff.
                    Err(e) if e.is_already_exists() => {
                        let wait = Waiting::Cluster {
                            name: name.to_string(),
                            state: ClusterWait::BeingCreated,
                        };
                        return Ok(Err(pass.clone().wait(wait, poll)));
                    }
                    Err(e) => return Err(e.into()),
                };
                self.cluster_ids
                    .lock()
                    .expect("cluster ids")
                    .insert(name.to_string(), c.id.clone());
                // Nobody can be retiring a cluster this pass just made.
                ledger.use_cluster(name, &c.id).await?;
                let wait = Waiting::Cluster {
                    name: name.to_string(),
                    state: ClusterWait::Creating,
                };
                return Ok(Err(pass.clone().wait(wait, poll)));
            }
        };
        if !ledger.use_cluster(name, &cluster.id).await? {
            // The last DI of the VPC is deleting it: once it is going, a new one is made.
            let wait = Waiting::Cluster {
                name: name.to_string(),
                state: ClusterWait::BeingDeleted,
            };
            return Ok(Err(pass.clone().wait(wait, poll)));
        }
        if cluster.status.state != ClusterState::Running {
            let state = format!("{:?}", cluster.status.state).to_lowercase();
            let wait = Waiting::Cluster {
                name: name.to_string(),
                state: ClusterWait::State(state),
            };
            return Ok(Err(pass.clone().wait(wait, poll)));
        }
        Ok(Ok((cluster.id.clone(), self.kube_for(&cluster.id).await?)))
    }

    /// The cluster `name` as the last pass that reached it left it: its id and a client, when
    /// both are still known and the client's credentials are not due for renewal (then the pass
    /// asks DigitalOcean, for the cluster and new credentials).
    fn trusted_cluster(&self, name: &str) -> Option<(String, KubeClient)> {
        let id = self
            .cluster_ids
            .lock()
            .expect("cluster ids")
            .get(name)
            .cloned()?;
        let kube = self.kube.fresh(&id)?;
        Some((id, kube))
    }

    /// Forgets how to reach the cluster `name` (id `id`): the next pass asks DigitalOcean.
    fn distrust_cluster(&self, name: &str, id: &str) {
        self.cluster_ids.lock().expect("cluster ids").remove(name);
        self.forget_kube(id);
    }

    async fn create_cluster(
        &self,
        name: &str,
        rec: &Record,
    ) -> std::result::Result<Cluster, DoError> {
        let s = &self.settings;
        let mut system = NodePoolCreateRequest::new(
            format!("{name}-system"),
            &s.system_pool_size,
            s.system_pool_count.max(1),
        );
        system.labels = BTreeMap::from([(
            names::MANAGED_BY_LABEL.to_string(),
            names::MANAGED_BY.to_string(),
        )]);
        system.tags = vec!["dedicated-inference".to_string()];
        let req = ClusterCreateRequest {
            name: name.to_string(),
            region: s.region.clone(),
            version: s.kubernetes_version.clone(),
            vpc_uuid: Some(rec.vpc_uuid.to_string()),
            tags: vec!["dedicated-inference".to_string()],
            node_pools: vec![system],
            ..Default::default()
        };
        tracing::info!(di = %rec.id, cluster = name, "creating cluster");
        self.cloud.cluster_create(&req).await
    }

    /// The cluster named `name`; a cluster being deleted counts only when `deleting_too`.
    /// A cluster seen before is read by id (one small request); otherwise, or when that one is
    /// gone or no longer fits, the region's clusters are listed.
    async fn find_cluster(&self, name: &str, deleting_too: bool) -> Result<Option<Cluster>> {
        let fits = |c: &Cluster| {
            c.name == name
                && (deleting_too
                    || !matches!(
                        c.status.state,
                        ClusterState::Deleting | ClusterState::Deleted
                    ))
        };
        let known = self
            .cluster_ids
            .lock()
            .expect("cluster ids")
            .get(name)
            .cloned();
        if let Some(id) = known {
            match self.cloud.cluster_get(&id).await {
                Ok(c) if fits(&c) => return Ok(Some(c)),
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
            self.cluster_ids.lock().expect("cluster ids").remove(name);
        }
        let clusters = self.cloud.cluster_list().await?;
        // Remember every live cluster the list shows, not just this one: the other DIs of the
        // region then read theirs by id instead of listing again.
        let mut ids = self.cluster_ids.lock().expect("cluster ids");
        for c in &clusters {
            if !matches!(
                c.status.state,
                ClusterState::Deleting | ClusterState::Deleted
            ) {
                ids.insert(c.name.clone(), c.id.clone());
            }
        }
        drop(ids);
        Ok(clusters.into_iter().find(fits))
    }

    /// A client of cluster `cluster_id` (see [`ClusterClients::get`]).
    async fn kube_for(&self, cluster_id: &str) -> Result<KubeClient> {
        self.kube
            .get(&self.cloud, cluster_id)
            .await
            .map_err(|e| match e {
                cluster_clients::Error::Cloud(e) => e.into(),
                cluster_clients::Error::Kube(e) => ReconcileError::Transient(e.to_string()),
            })
    }

    fn forget_kube(&self, cluster_id: &str) {
        self.kube.forget(cluster_id);
    }

    /// The DI's rendered objects, its pods and its nodes.
    async fn observe(&self, kube: &KubeClient, id: Uuid, ns: &str) -> Result<Vec<Value>> {
        let sel = label_selector(id);
        let node_sel = format!("{}={}", names::DI_ID_LABEL, id);
        // The lists are independent: issue them at once (the pass waits for one round trip, not
        // a dozen).
        let lists = RENDERED_KINDS
            .iter()
            .map(|(api_version, kind)| kube.list(api_version, kind, Some(ns), &sel))
            .chain([
                kube.list("v1", "Pod", Some(ns), ""),
                kube.list("v1", "Node", None, &node_sel),
            ]);
        let found = futures::future::try_join_all(lists).await?;
        Ok(found.into_iter().flatten().collect())
    }

    async fn record_accelerators(
        &self,
        id: Uuid,
        spec: &StoredSpec,
        seen: &[plan::ObservedAccelerator],
        recorded: &[ObservedAccelerator],
    ) -> Result<()> {
        let role = |model: Option<Uuid>| {
            spec.model_deployments
                .iter()
                .find(|m| m.model_id.is_some() && m.model_id == model)
                .and_then(|m| m.accelerators.first())
                .map(|g| g.role.clone())
                .unwrap_or_else(|| "prefill_decode".to_string())
        };
        let observed: Vec<ObservedAccelerator> = seen
            .iter()
            .map(|a| ObservedAccelerator {
                name: a.name.clone(),
                slug: a.slug.clone(),
                role: role(a.model_id),
                status: a.status.clone(),
            })
            .collect();
        let mut by_name: Vec<&ObservedAccelerator> = observed.iter().collect();
        by_name.sort_by(|a, b| a.name.cmp(&b.name));
        // `recorded` is sorted by name too: write only what changed.
        if !by_name.iter().copied().eq(recorded.iter()) {
            self.store.accelerators_replace(id, &observed).await?;
        }
        Ok(())
    }

    /// Records each deployment's ready model servers, wanted replicas and autoscaler memory,
    /// with an event per scaling decision; nothing when nothing changed.
    async fn record_replicas(
        &self,
        id: Uuid,
        scaled: &[scaling::Scaled],
        observed: &[Value],
        recorded: &[DeploymentReplicas],
    ) -> Result<()> {
        let mut rows: Vec<DeploymentReplicas> = scaled
            .iter()
            .map(|x| DeploymentReplicas {
                model_id: x.model_id,
                ready: scaling::ready_servers(observed, &x.model_id).len() as u32,
                wanted: x.wanted,
                autoscaler: x
                    .memory
                    .as_ref()
                    .map(|m| serde_json::to_value(m).expect("memory serialises")),
            })
            .collect();
        rows.sort_by_key(|r| r.model_id);
        let events: Vec<(&str, String)> = scaled
            .iter()
            .filter_map(|x| {
                let d = x.decision.as_ref()?;
                tracing::info!(di = %id, model = %x.model_id, reason = d.reason, message = %d.message, "autoscaler");
                Some((d.reason, format!("model {}: {}", x.model_id, d.message)))
            })
            .collect();
        if rows.as_slice() != recorded || !events.is_empty() {
            self.store.replicas_record(id, &rows, &events).await?;
        }
        Ok(())
    }

    /// `GET {url}/v1/models` with the probe token, trusting only the DI's CAs (as customers do
    /// with `GET …/ca`): 200 or why not.
    async fn probe(
        &self,
        url: &str,
        cas: &[NewCa],
        token: &str,
    ) -> std::result::Result<(), String> {
        let mut client = reqwest::Client::builder().tls_built_in_root_certs(false);
        for ca in cas {
            client = client.add_root_certificate(
                reqwest::Certificate::from_pem(ca.cert_pem.as_bytes())
                    .map_err(|e| e.to_string())?,
            );
        }
        let client = client
            .timeout(self.settings.probe_timeout)
            .build()
            .map_err(|e| e.to_string())?;
        let resp = client
            .get(format!("{}/v1/models", url.trim_end_matches('/')))
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| format!("not answering ({e})"))?;
        if resp.status() == reqwest::StatusCode::OK {
            Ok(())
        } else {
            Err(format!("answered {}", resp.status()))
        }
    }

    // -----------------------------------------------------------------------------------------
    // Teardown

    /// Deletes what the ledger records, newest first; every step treats "already gone" as done.
    /// The cluster goes only when no other DI uses it. Then the DI is gone.
    async fn teardown(&self, rec: &Record) -> Result<Pass> {
        let id = rec.id;
        let s = &self.settings;
        let pass = Pass::new(Status::Deleting, s.poll);
        let clusters = self.cloud.cluster_list().await?;
        let entries = self.store.ledger_entries(id).await?;
        for e in entries.iter().rev() {
            match e.kind.as_str() {
                LEDGER_NAMESPACE => {
                    let cluster = recorded_cluster(&clusters, &e.scope);
                    let Some(c) = cluster.filter(|c| c.status.state == ClusterState::Running)
                    else {
                        if cluster.is_some_and(|c| c.status.state == ClusterState::Provisioning) {
                            return Ok(pass.wait(Waiting::ClusterUnreachable, s.poll));
                        }
                        // The cluster is gone or going: so is the namespace.
                        self.store.ledger_remove(id, &e.kind, &e.name).await?;
                        continue;
                    };
                    let kube = self.kube_for(&c.id).await?;
                    let deleted = kube.delete("v1", "Namespace", None, &e.name).await?;
                    if deleted != Deleted::AlreadyGone {
                        self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
                    }
                    if deleted == Deleted::Deleting {
                        let name = e.name.clone();
                        return Ok(pass.wait(Waiting::NamespaceTerminating { name }, s.poll));
                    }
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
                LEDGER_NODE_POOL => {
                    if let Some(c) = recorded_cluster(&clusters, &e.scope) {
                        let pools = match self.cloud.node_pool_list(&c.id).await {
                            Err(err) if err.is_not_found() => Vec::new(),
                            r => r?,
                        };
                        if let Some(p) = pools.iter().find(|p| p.name == e.name) {
                            match self.cloud.node_pool_delete(&c.id, &p.id).await {
                                Err(err) if err.is_not_found() => {}
                                r => r?,
                            }
                        }
                    }
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
                LEDGER_CLUSTER => {
                    // The cluster this DI used: by id once known. A cluster of the same name
                    // made later (by another DI, after this one was deleted) is not it.
                    let found = match &e.external_id {
                        Some(cluster_id) => clusters.iter().find(|c| c.id == *cluster_id),
                        None => clusters.iter().find(|c| c.name == e.name && !is_going(c)),
                    };
                    let Some(c) = found else {
                        self.store.ledger_remove(id, &e.kind, &e.name).await?;
                        continue;
                    };
                    if !e.retiring {
                        // Sweep pools of this DI the ledger missed (e.g. recorded by a newer
                        // spec and removed out of order).
                        let di = id.to_string();
                        let pools = match self.cloud.node_pool_list(&c.id).await {
                            Err(err) if err.is_not_found() => Vec::new(),
                            r => r?,
                        };
                        for p in pools
                            .iter()
                            .filter(|p| p.labels.get(names::DI_ID_LABEL) == Some(&di))
                        {
                            match self.cloud.node_pool_delete(&c.id, &p.id).await {
                                Err(err) if err.is_not_found() => {}
                                r => r?,
                            }
                        }
                        let release = self
                            .store
                            .ledger_cluster_release(id, &e.name, &c.id)
                            .await?;
                        if release == ClusterRelease::Shared {
                            continue;
                        }
                    }
                    // The last user: delete it, and keep the entry until it is really gone.
                    if !is_going(c) {
                        match self.cloud.cluster_delete(&c.id).await {
                            Err(err) if err.is_not_found() => {}
                            r => r?,
                        }
                        self.forget_kube(&c.id);
                        tracing::info!(di = %id, cluster = %c.name, "cluster deleting");
                    }
                    let wait = Waiting::Cluster {
                        name: c.name.clone(),
                        state: ClusterWait::Deleting,
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                other => {
                    tracing::warn!(di = %id, kind = other, "unknown ledger entry; forgetting it");
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
            }
        }
        match self.store.gone(id).await {
            Ok(_) | Err(StoreError::NotFound) => {
                tracing::info!(di = %id, "gone");
                Ok(Pass::gone(s.resync))
            }
            Err(e) => Err(e.into()),
        }
    }
}

fn is_going(c: &Cluster) -> bool {
    matches!(
        c.status.state,
        ClusterState::Deleting | ClusterState::Deleted
    )
}

/// The cluster a namespace or node-pool entry names in its scope: by id, or (entries recorded
/// before ids were used) by name, preferring one that is not going.
fn recorded_cluster<'a>(clusters: &'a [Cluster], scope: &str) -> Option<&'a Cluster> {
    clusters.iter().find(|c| c.id == scope).or_else(|| {
        let named = || clusters.iter().filter(|c| c.name == scope);
        named().find(|c| !is_going(c)).or_else(|| named().next())
    })
}

/// A shared reconciler.
pub type SharedReconciler = Arc<Reconciler>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_token_keeps_its_key_across_rotations_and_differs_per_di() {
        let di = Uuid::new_v4();
        let (old, new) = (
            probe_token_hash(di, "di_old"),
            probe_token_hash(di, "di_new"),
        );
        assert_eq!(old.id(), new.id(), "a rotation replaces the value in place");
        assert_ne!(old.sha256_hex(), new.sha256_hex());
        assert_eq!(old, AccessTokenHash::from_value(old.id(), "di_old"));
        assert_ne!(probe_token_hash(Uuid::new_v4(), "di_old").id(), old.id());
    }
}
