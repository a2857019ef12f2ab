//! A client for one Kubernetes API server, working on manifests as JSON values (`apiVersion`,
//! `kind`, `metadata`, ...), as the worker's planner renders them.
//!
//! Writes are server-side apply under one field manager with `force`, so a second pass over an
//! unchanged manifest writes nothing. Kinds resolve through a static table ([`known_resource`]),
//! so no discovery round trip is needed. Transient failures (429, 409, 5xx, connection errors)
//! are retried per [`RetryConfig`]; kube's own retry layer is turned off so that this is the only
//! retry policy and its time bound holds. Every request sent is counted by verb and outcome
//! ([`crate::metrics`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use either::Either;
use futures::StreamExt;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Config};

pub use kube::runtime::watcher::Event as WatchEvent;

/// How long the server keeps a watch open before the watcher starts the next one from where
/// it left off (kube-runtime's default is 290 s).
const WATCH_TIMEOUT_SECS: u32 = 240;
/// How often an HTTP/2 connection is pinged, and how long a ping may go unanswered before the
/// connection is taken for dead: what notices a cluster lost without a word under a watch,
/// which may be silent for minutes.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Idle HTTP/1.1 connections kept per cluster, for a server that does not speak HTTP/2: as many
/// as a pass's lists at once.
const MAX_IDLE_HTTP1: usize = 16;
use serde_json::Value;

use common::errors::{Classify, ErrorClass};

use crate::metrics::{self, Outcome};
use crate::retry::{retry, RetryConfig};

// ------------------------------------------------------------------ errors

/// A failed Kubernetes API call.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The API server answered with a failure `Status`.
    #[error("Kubernetes API {code} {reason}: {message}")]
    Api {
        code: u16,
        /// `NotFound`, `Conflict`, `Invalid`, `Forbidden`, `TooManyRequests`, ...
        reason: String,
        message: String,
        /// `details.retryAfterSeconds`, when the server sent it.
        retry_after: Option<Duration>,
    },
    /// The request did not complete (connection refused or reset, timeout).
    #[error("Kubernetes API unreachable: {0}")]
    Transport(#[source] kube::Error),
    /// Anything else kube reported (undecodable response, auth plugin failure, ...).
    #[error("Kubernetes client error: {0}")]
    Client(#[source] kube::Error),
    /// The kubeconfig could not be used.
    #[error("kubeconfig: {0}")]
    Config(String),
    /// A kind missing from the static table.
    #[error("unsupported kind {kind} in {api_version}")]
    UnknownKind { api_version: String, kind: String },
    /// A manifest without what the call needs (apiVersion, kind, metadata.name, a namespace for
    /// a namespaced kind).
    #[error("invalid object: {0}")]
    InvalidObject(String),
}

impl Classify for KubeError {
    /// Decided here, from the `Status` the server answered, once: the worker acts on the class
    /// and never decides again whether a code passes.
    fn class(&self) -> ErrorClass {
        match self {
            KubeError::Api {
                code, retry_after, ..
            } => match code {
                // 409 is a write that met another (a stale resourceVersion, an object replaced
                // meanwhile): the API conventions say retry, and a forced apply or a delete
                // sent again does not conflict with itself.
                429 | 409 | 500.. => ErrorClass::Transient {
                    retry_after: *retry_after,
                },
                404 => ErrorClass::NotFound,
                401 => ErrorClass::Unauthorized,
                // Our credentials are the cluster's admin's, so what forbids a request is not
                // who sends it but the state of the cluster: most often a namespace that is
                // terminating and takes no new objects until it is gone (admission's 403).
                403 => ErrorClass::Conflict,
                400..=499 => ErrorClass::Refused,
                _ => ErrorClass::Permanent,
            },
            KubeError::Transport(_) => ErrorClass::TRANSIENT,
            KubeError::Client(_)
            | KubeError::Config(_)
            | KubeError::UnknownKind { .. }
            | KubeError::InvalidObject(_) => ErrorClass::Permanent,
        }
    }
}

impl KubeError {
    pub fn is_not_found(&self) -> bool {
        self.class() == ErrorClass::NotFound
    }

    /// The HTTP status of an API error.
    pub fn code(&self) -> Option<u16> {
        match self {
            KubeError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The `Status.reason` of an API error.
    pub fn reason(&self) -> Option<&str> {
        match self {
            KubeError::Api { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// The `Status.message` of an API error: what the server says is wrong.
    pub fn message(&self) -> Option<&str> {
        match self {
            KubeError::Api { message, .. } => Some(message),
            _ => None,
        }
    }
}

impl From<kube::Error> for KubeError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => KubeError::Api {
                code: s.code,
                reason: s.reason.clone(),
                message: s.message.clone(),
                retry_after: s
                    .details
                    .as_ref()
                    .map(|d| d.retry_after_seconds)
                    .filter(|s| *s > 0)
                    .map(|s| Duration::from_secs(s.into())),
            },
            e @ (kube::Error::HyperError(_)
            | kube::Error::Service(_)
            | kube::Error::ReadEvents(_)) => KubeError::Transport(e),
            e => KubeError::Client(e),
        }
    }
}

// ------------------------------------------------------------------ kinds

/// (group, kind, plural, namespaced) of every kind the control plane writes or reads.
const KINDS: &[(&str, &str, &str, bool)] = &[
    ("", "Namespace", "namespaces", false),
    ("", "Node", "nodes", false),
    ("", "Secret", "secrets", true),
    ("", "ConfigMap", "configmaps", true),
    ("", "ServiceAccount", "serviceaccounts", true),
    ("", "Service", "services", true),
    ("", "Pod", "pods", true),
    ("", "Event", "events", true),
    ("events.k8s.io", "Event", "events", true),
    ("apps", "Deployment", "deployments", true),
    (
        "networking.k8s.io",
        "NetworkPolicy",
        "networkpolicies",
        true,
    ),
    (
        "policy",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        true,
    ),
    ("rbac.authorization.k8s.io", "Role", "roles", true),
    (
        "rbac.authorization.k8s.io",
        "RoleBinding",
        "rolebindings",
        true,
    ),
    (
        "gateway.networking.k8s.io",
        "GatewayClass",
        "gatewayclasses",
        false,
    ),
    ("gateway.networking.k8s.io", "Gateway", "gateways", true),
    ("gateway.networking.k8s.io", "HTTPRoute", "httproutes", true),
    (
        "gateway.envoyproxy.io",
        "SecurityPolicy",
        "securitypolicies",
        true,
    ),
    (
        "gateway.envoyproxy.io",
        "BackendTrafficPolicy",
        "backendtrafficpolicies",
        true,
    ),
    (
        "inference.networking.k8s.io",
        "InferencePool",
        "inferencepools",
        true,
    ),
];

/// A kind from the static table, at the version the caller asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownResource {
    pub api_resource: ApiResource,
    pub namespaced: bool,
}

/// Resolves `apiVersion` + `kind` without a discovery call. The version is taken as given (the
/// server answers 404 for one it does not serve); group and kind must be in the table.
pub fn known_resource(api_version: &str, kind: &str) -> Option<KnownResource> {
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    };
    if version.is_empty() {
        return None;
    }
    KINDS
        .iter()
        .find(|(g, k, _, _)| *g == group && *k == kind)
        .map(|(g, k, plural, namespaced)| KnownResource {
            api_resource: ApiResource {
                group: g.to_string(),
                version: version.to_string(),
                api_version: api_version.to_string(),
                kind: k.to_string(),
                plural: plural.to_string(),
            },
            namespaced: *namespaced,
        })
}

// ------------------------------------------------------------------ results

/// The outcome of [`KubeClient::apply`].
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The object was created, or the apply changed it (its `resourceVersion` moved and more
    /// than its status did). False for a second apply of the same manifest.
    pub changed: bool,
    /// The object as the server returned it.
    pub object: Value,
}

/// What the caller of [`KubeClient::apply_observed`] saw of the object before applying it.
#[derive(Debug, Clone, Copy)]
pub enum Before<'a> {
    /// Nothing: it is read first.
    Unknown,
    /// A list that would have shown it did not (its kind, its labels, its namespace).
    Absent,
    /// This copy, just listed.
    Listed(&'a Value),
}

/// The outcome of [`KubeClient::delete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// Nothing to delete: it was already gone (404), which is success.
    AlreadyGone,
    /// Deletion started but the object still exists (finalizers, a Terminating Namespace still
    /// emptying, foreground dependents). Delete again or get it later to see it go.
    Deleting,
    /// The object is gone.
    Deleted,
}

// ------------------------------------------------------------------ client

/// Transport settings of a [`KubeClient`].
#[derive(Debug, Clone)]
pub struct KubeClientOptions {
    pub connect_timeout: Duration,
    /// Time to wait for a response's headers (a watch's body then streams for minutes).
    pub read_timeout: Duration,
    /// How long an HTTP/1.1 connection no request used stays pooled. An HTTP/2 connection stays
    /// while its client lives: the cluster's watches run on it between requests.
    pub idle_timeout: Duration,
    pub retry: RetryConfig,
}

impl Default for KubeClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            retry: RetryConfig::default(),
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    mutating: AtomicU64,
    changes: AtomicU64,
    /// The server answered 401 to a request of this client (see [`KubeClient::credentials_rejected`]).
    rejected: AtomicBool,
}

/// A client for one cluster's API server, writing under one field manager. Cheap to clone;
/// clones share the connection pool and the counters.
#[derive(Clone)]
pub struct KubeClient {
    client: Client,
    field_manager: String,
    retry: RetryConfig,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClient")
            .field("field_manager", &self.field_manager)
            .finish_non_exhaustive()
    }
}

impl KubeClient {
    /// A client from a kubeconfig document (its current context), e.g. the one DigitalOcean's
    /// `/v2/kubernetes/clusters/{id}/kubeconfig` returns. Plain `http://` servers work.
    pub async fn from_kubeconfig_yaml(
        yaml: &str,
        field_manager: &str,
    ) -> Result<KubeClient, KubeError> {
        Self::from_kubeconfig_yaml_with(yaml, field_manager, KubeClientOptions::default()).await
    }

    pub async fn from_kubeconfig_yaml_with(
        yaml: &str,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        // Errors from here may quote the document; say what failed without echoing it (it
        // carries the cluster token).
        let kubeconfig = Kubeconfig::from_yaml(yaml).map_err(|_| {
            KubeError::Config("the kubeconfig is not valid YAML of a kubeconfig".into())
        })?;
        Self::from_kubeconfig(kubeconfig, field_manager, options).await
    }

    /// A client from a cluster's token credentials, as DigitalOcean's
    /// `/v2/kubernetes/clusters/{id}/credentials` returns them: the server is trusted through
    /// exactly the CA they carry (the system's roots when there is none).
    pub async fn from_credentials(
        credentials: &crate::digitalocean::ClusterCredentials,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        // The same document a kubeconfig download holds, so that both paths build clients the
        // same way (kube decodes the CA data and sets up TLS from it).
        let mut cluster = serde_json::json!({"server": credentials.server});
        if !credentials.certificate_authority_data.is_empty() {
            cluster["certificate-authority-data"] =
                credentials.certificate_authority_data.clone().into();
        }
        let doc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": "user", "user": {"token": credentials.token}}],
            "contexts": [{"name": "context", "context": {"cluster": "cluster", "user": "user"}}],
            "current-context": "context",
        });
        let kubeconfig: Kubeconfig = serde_json::from_value(doc)
            .map_err(|_| KubeError::Config("the credentials do not make a kubeconfig".into()))?;
        Self::from_kubeconfig(kubeconfig, field_manager, options).await
    }

    async fn from_kubeconfig(
        kubeconfig: Kubeconfig,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        if field_manager.is_empty() {
            return Err(KubeError::Config(
                "the field manager must not be empty".into(),
            ));
        }
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| {
                KubeError::Config(format!(
                    "the kubeconfig cannot be used: {}",
                    kubeconfig_error_kind(&e)
                ))
            })?;
        // A plain-http server never negotiates TLS, so it needs no trust store; without one,
        // kube-rs would load and parse the system's whole CA bundle for every client.
        if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
            config.root_cert = Some(Vec::new());
        }
        let client = one_connection_client(&config, &options, Protocol::Negotiated)?;
        let client = match speaks_http2(&client).await {
            true => one_connection_client(&config, &options, Protocol::Http2)?,
            false => client,
        };
        Ok(Self::from_client(client, field_manager, options.retry))
    }

    /// Wraps an existing kube client (its own retry layer should be off).
    pub fn from_client(client: Client, field_manager: &str, retry: RetryConfig) -> KubeClient {
        KubeClient {
            client,
            field_manager: field_manager.to_string(),
            retry,
            counters: Arc::new(Counters::default()),
        }
    }

    /// The same client with another retry policy (counters stay shared).
    pub fn with_retry(mut self, retry: RetryConfig) -> KubeClient {
        self.retry = retry;
        self
    }

    /// The underlying kube client, for typed APIs or watches.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// Write requests (apply PATCHes, DELETEs) sent, every attempt counted, no-op applies
    /// included.
    pub fn mutating_requests(&self) -> u64 {
        self.counters.mutating.load(Ordering::SeqCst)
    }

    /// Writes that changed something: applies with `changed == true` and deletes that found the
    /// object. A second reconcile pass over an unchanged spec leaves this unchanged.
    pub fn changes(&self) -> u64 {
        self.counters.changes.load(Ordering::SeqCst)
    }

    /// Whether the server has refused this client's credentials (401) since it was made: they
    /// expired or were revoked, and every later call will be refused too. A caller that caches
    /// clients makes a new one from fresh credentials.
    pub fn credentials_rejected(&self) -> bool {
        self.counters.rejected.load(Ordering::SeqCst)
    }

    /// Notes a 401 in `result` (see [`KubeClient::credentials_rejected`]).
    fn noted<T>(&self, result: Result<T, KubeError>) -> Result<T, KubeError> {
        if let Err(e) = &result {
            if e.class() == ErrorClass::Unauthorized {
                self.counters.rejected.store(true, Ordering::SeqCst);
            }
        }
        result
    }

    fn api(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        all_namespaces: bool,
    ) -> Result<(Api<DynamicObject>, ApiResource), KubeError> {
        let known = known_resource(api_version, kind).ok_or_else(|| KubeError::UnknownKind {
            api_version: api_version.to_string(),
            kind: kind.to_string(),
        })?;
        let ar = known.api_resource;
        let api = if !known.namespaced {
            Api::all_with(self.client.clone(), &ar)
        } else {
            match namespace.filter(|n| !n.is_empty()) {
                Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
                None if all_namespaces => Api::all_with(self.client.clone(), &ar),
                None => {
                    return Err(KubeError::InvalidObject(format!(
                        "{kind} is namespaced: a namespace is required"
                    )))
                }
            }
        };
        Ok((api, ar))
    }

    /// Server-side apply of `obj` under this client's field manager, with `force` (we own what
    /// we render). Fields this manager applied before and `obj` omits are removed.
    pub async fn apply(&self, obj: &Value) -> Result<Applied, KubeError> {
        self.apply_observed(obj, Before::Unknown).await
    }

    /// As [`KubeClient::apply`], given what the caller just saw of the object (`before`). When
    /// the listed copy is already up to date, nothing is sent at all (a steady-state pass then
    /// costs only its lists); when the list showed it absent, it is applied without reading it
    /// first; otherwise it is read afresh, so that an apply that changes nothing is known as
    /// such.
    pub async fn apply_observed(
        &self,
        obj: &Value,
        before: Before<'_>,
    ) -> Result<Applied, KubeError> {
        let field = |p: &str| {
            obj.pointer(p)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        let api_version =
            field("/apiVersion").ok_or_else(|| KubeError::InvalidObject("no apiVersion".into()))?;
        let kind = field("/kind").ok_or_else(|| KubeError::InvalidObject("no kind".into()))?;
        let name = field("/metadata/name")
            .ok_or_else(|| KubeError::InvalidObject(format!("{kind} without metadata.name")))?;
        let (api, _) = self.api(api_version, kind, field("/metadata/namespace"), false)?;
        let obj = &with_applied_hash(obj);
        let before = match before {
            Before::Listed(b) if up_to_date(b, obj) => {
                tracing::debug!(kind, name, "up to date (as listed)");
                return Ok(Applied {
                    changed: false,
                    object: b.clone(),
                });
            }
            // Not listed: created, or taken over from whoever made it without our labels;
            // either way the apply changes it.
            Before::Absent => None,
            Before::Listed(_) | Before::Unknown => self
                .noted(retry(&self.retry, "kubernetes get", || get_opt(&api, name)).await)?
                .map(|b| serde_json::to_value(&b))
                .transpose()
                .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?,
        };
        // Nothing to write when the object is what we applied last time and nobody has changed
        // any of it since: a steady-state resync then costs reads only.
        if let Some(b) = before.as_ref().filter(|b| up_to_date(b, obj)) {
            tracing::debug!(kind, name, "up to date");
            return Ok(Applied {
                changed: false,
                object: b.clone(),
            });
        }
        let params = PatchParams::apply(&self.field_manager).force();
        let after = retry(&self.retry, "kubernetes apply", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            counted("apply", api.patch(name, &params, &Patch::Apply(obj)).await)
        })
        .await;
        let after = self.noted(after)?;
        let after = serde_json::to_value(&after)
            .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?;
        let changed = match before {
            None => true,
            Some(b) => changed(&b, &after, &self.field_manager),
        };
        if changed {
            self.counters.changes.fetch_add(1, Ordering::SeqCst);
        }
        tracing::debug!(kind, name, changed, "applied");
        Ok(Applied {
            changed,
            object: after,
        })
    }

    /// Sets annotation `key` to `value` on one object with a JSON merge patch, leaving every
    /// other field (and its owner) alone: for marks on objects another controller owns, such as
    /// a pod's `controller.kubernetes.io/pod-deletion-cost`.
    pub async fn annotate(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<(), KubeError> {
        let (api, _) = self.api(api_version, kind, namespace, false)?;
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        let params = PatchParams::default();
        let done = retry(&self.retry, "kubernetes annotate", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            counted(
                "patch",
                api.patch(name, &params, &Patch::Merge(&patch)).await,
            )
        })
        .await;
        self.noted(done).map(|_| ())
    }

    /// The object, or `None` if it does not exist. `namespace` is ignored for cluster-scoped
    /// kinds and required for namespaced ones.
    pub async fn get(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Value>, KubeError> {
        let (api, ar) = self.api(api_version, kind, namespace, false)?;
        let got = self.noted(retry(&self.retry, "kubernetes get", || get_opt(&api, name)).await)?;
        got.map(|o| to_value(o, &ar)).transpose()
    }

    /// `GET path` on port `port` of pod `pod`, through the API server's pod proxy (how a
    /// control plane outside the cluster reads a pod's `/metrics`). Not retried: a reading is
    /// only worth its moment, and the caller looks again at its next pass.
    pub async fn pod_proxy_get(
        &self,
        namespace: &str,
        pod: &str,
        port: u16,
        path: &str,
    ) -> Result<String, KubeError> {
        let uri = format!(
            "/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/{}",
            path.trim_start_matches('/')
        );
        let req = http::Request::get(uri)
            .body(Vec::new())
            .map_err(|e| KubeError::InvalidObject(format!("pod proxy request: {e}")))?;
        self.noted(counted("proxy", self.client.request_text(req).await))
    }

    /// Objects matching `label_selector` (may be empty), in `namespace`, or in every namespace
    /// when `None`. Items carry `apiVersion` and `kind`.
    pub async fn list(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<Value>, KubeError> {
        let (api, ar) = self.api(api_version, kind, namespace, true)?;
        let mut params = ListParams::default();
        if !label_selector.is_empty() {
            params = params.labels(label_selector);
        }
        let list = retry(&self.retry, "kubernetes list", || async {
            counted("list", api.list(&params).await)
        })
        .await;
        let list = self.noted(list)?;
        list.items.into_iter().map(|o| to_value(o, &ar)).collect()
    }

    /// Every object of a kind in every namespace that matches `label_selector`, then every
    /// change to them: kube-runtime's watcher (a LIST, then a WATCH from its resourceVersion,
    /// re-listed when the server answers 410 Gone), objects as JSON with `apiVersion` and
    /// `kind`. Errors are yielded and the stream goes on, resuming after a backoff; a 401 marks
    /// the credentials rejected as any request's does.
    pub fn watch(
        &self,
        api_version: &str,
        kind: &str,
        label_selector: &str,
    ) -> Result<
        impl futures::Stream<Item = Result<WatchEvent<Value>, KubeError>> + Send + 'static,
        KubeError,
    > {
        let (_, ar) = self.api(api_version, kind, None, true)?;
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
        let mut config = watcher::Config::default().timeout(WATCH_TIMEOUT_SECS);
        if !label_selector.is_empty() {
            config = config.labels(label_selector);
        }
        let me = self.clone();
        // On a failure the watcher resumes from the last resourceVersion it saw (and lists
        // anew only when the server answers 410 Gone), after kube-runtime's backoff.
        Ok(watcher::watcher(api, config)
            .default_backoff()
            .map(move |event| {
                let event = match event {
                    Ok(e) => e,
                    Err(e) => {
                        let e = match e {
                            watcher::Error::InitialListFailed(e)
                            | watcher::Error::WatchStartFailed(e)
                            | watcher::Error::WatchFailed(e) => KubeError::from(e),
                            watcher::Error::WatchError(status) => {
                                KubeError::from(kube::Error::Api(status))
                            }
                            e @ watcher::Error::NoResourceVersion => {
                                KubeError::InvalidObject(e.to_string())
                            }
                        };
                        metrics::kubernetes("watch", Outcome::of(e.class()));
                        return me.noted(Err(e));
                    }
                };
                let value = |o| to_value(o, &ar);
                Ok(match event {
                    WatchEvent::Apply(o) => WatchEvent::Apply(value(o)?),
                    WatchEvent::Delete(o) => WatchEvent::Delete(value(o)?),
                    WatchEvent::Init => {
                        metrics::kubernetes("watch", Outcome::Ok);
                        WatchEvent::Init
                    }
                    WatchEvent::InitApply(o) => WatchEvent::InitApply(value(o)?),
                    WatchEvent::InitDone => WatchEvent::InitDone,
                })
            }))
    }

    /// Deletes with Background propagation. A missing object (or a missing namespace) is
    /// [`Deleted::AlreadyGone`], never an error, so a teardown is not blocked by a child that is
    /// already gone. A Namespace answers [`Deleted::Deleting`] while it is Terminating.
    pub async fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Deleted, KubeError> {
        let (api, _) = self.api(api_version, kind, namespace, false)?;
        let params = DeleteParams::background();
        let outcome = retry(&self.retry, "kubernetes delete", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            match counted("delete", api.delete(name, &params).await) {
                Ok(Either::Left(_still_there)) => Ok(Deleted::Deleting),
                Ok(Either::Right(_status)) => Ok(Deleted::Deleted),
                Err(e) if e.is_not_found() => Ok(Deleted::AlreadyGone),
                Err(e) => Err(e),
            }
        })
        .await;
        let outcome = self.noted(outcome)?;
        if outcome != Deleted::AlreadyGone {
            self.counters.changes.fetch_add(1, Ordering::SeqCst);
        }
        tracing::debug!(kind, name, ?outcome, "deleted");
        Ok(outcome)
    }
}

/// The HTTP versions a client may speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    /// HTTP/2 where the server picks it through ALPN, else HTTP/1.1, whose idle connections
    /// leave the pool after [`KubeClientOptions::idle_timeout`].
    Negotiated,
    /// HTTP/2 only, for a server seen to speak it: one connection is made at a time and shared,
    /// and it is kept while the client lives (its pings find it dead). hyper's pool would drop
    /// a connection no request used for its idle timeout, though watches still run on it, and
    /// the next request would open a second one beside it.
    Http2,
}

/// Whether the server answered `GET /version` over HTTP/2 (real API servers do, through ALPN).
/// Asked once when a client is made; if the question fails, the client negotiates as before.
async fn speaks_http2(client: &Client) -> bool {
    let Ok(request) = http::Request::get("/version").body(kube::client::Body::empty()) else {
        return false;
    };
    match client.send(request).await {
        Ok(response) => response.version() == http::Version::HTTP_2,
        Err(e) => {
            tracing::debug!(error = %e, "asking the API server its version failed");
            false
        }
    }
}

/// A kube client that speaks HTTP/2 to the cluster wherever the server offers it (real API
/// servers do, through ALPN): every request and watch of the cluster then shares one
/// connection, so a worker's descriptors grow with the clusters it uses, not with its requests
/// and watches. kube-rs's own stack offers HTTP/1.1 only. The rest is as kube-rs builds it:
/// its TLS configuration (the kubeconfig's CA, nothing else), base URI and authentication.
fn one_connection_client(
    config: &Config,
    options: &KubeClientOptions,
    protocol: Protocol,
) -> Result<Client, KubeError> {
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt;
    let failed = |e: &dyn std::fmt::Display| KubeError::Config(format!("building the client: {e}"));
    // What this stack does not do is refused rather than silently skipped (DOKS credentials
    // carry neither).
    if config.proxy_url.is_some() {
        return Err(failed(&"a proxy is not supported"));
    }
    if config.tls_server_name.is_some() {
        return Err(failed(&"tls-server-name is not supported"));
    }
    let tls = config.rustls_client_config().map_err(|e| failed(&e))?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(options.connect_timeout));
    // An HTTP/1.1 connection has no pings: TCP's keepalive notices a peer gone without a word
    // (a NAT or load balancer dropping the connection) under a quiet watch.
    http.set_keepalive(Some(KEEP_ALIVE_INTERVAL));
    http.set_keepalive_interval(Some(KEEP_ALIVE_INTERVAL / 3));
    http.set_keepalive_retries(Some(3));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    let mut builder = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(options.idle_timeout)
        .pool_max_idle_per_host(MAX_IDLE_HTTP1)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .http2_keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .http2_keep_alive_while_idle(true);
    if protocol == Protocol::Http2 {
        builder.http2_only(true).pool_idle_timeout(None);
    }
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> = builder.build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().map_err(|e| failed(&e))?)
        .layer(config.extra_headers_layer().map_err(|e| failed(&e))?)
        // Until the response's headers: a watch's body goes on for minutes after them.
        .layer(tower::timeout::TimeoutLayer::new(options.read_timeout))
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(Client::new(service, config.default_namespace.clone()))
}

/// Converts a request's error and counts the request in [`metrics::KUBE_REQUESTS`].
fn counted<T>(verb: &'static str, result: Result<T, kube::Error>) -> Result<T, KubeError> {
    let result = result.map_err(KubeError::from);
    metrics::kubernetes(verb, Outcome::of_result(&result));
    result
}

/// A counted GET that reads a 404 as `None` (kube's `get_opt`); on the wire it is a 404, so it
/// counts as `not_found`.
async fn get_opt(api: &Api<DynamicObject>, name: &str) -> Result<Option<DynamicObject>, KubeError> {
    let result = api.get_opt(name).await.map_err(KubeError::from);
    let outcome = match &result {
        Ok(Some(_)) => Outcome::Ok,
        Ok(None) => Outcome::NotFound,
        Err(e) => Outcome::of(e.class()),
    };
    metrics::kubernetes("get", outcome);
    result
}

/// Names the kind of kubeconfig problem without quoting values (which may hold the token).
fn kubeconfig_error_kind(e: &kube::config::KubeconfigError) -> String {
    let s = e.to_string();
    // The variants' messages are fixed strings followed by details; keep the fixed part.
    s.split(':').next().unwrap_or("invalid").trim().to_string()
}

fn to_value(obj: DynamicObject, ar: &ApiResource) -> Result<Value, KubeError> {
    let mut v = serde_json::to_value(&obj)
        .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.entry("apiVersion")
            .or_insert_with(|| Value::String(ar.api_version.clone()));
        m.entry("kind")
            .or_insert_with(|| Value::String(ar.kind.clone()));
    }
    Ok(v)
}

/// Whether an apply changed the object: its `resourceVersion` moved, and not only because a
/// controller wrote its status (or another manager's bookkeeping) between our get and our apply.
/// Annotation holding a digest of the configuration last applied, so that a field dropped from
/// the desired object (which a server-side apply would remove) still counts as a difference.
const APPLIED_HASH: &str = "inference.digitalocean.com/applied-hash";

/// `obj` with [`APPLIED_HASH`] set to the digest of `obj` itself.
fn with_applied_hash(obj: &Value) -> Value {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(serde_json::to_vec(obj).expect("JSON values serialise"));
    let hash: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    let mut obj = obj.clone();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(a) = annotations.as_object_mut() {
            a.insert(APPLIED_HASH.into(), Value::String(hash));
        }
    }
    obj
}

/// Whether applying `desired` (with its [`APPLIED_HASH`]) to `live` would change nothing: the
/// same configuration was applied last, and every field of it still has its value in `live`
/// (which also holds server defaults, status and other managers' fields).
fn up_to_date(live: &Value, desired: &Value) -> bool {
    let hash = |v: &Value| {
        v.pointer("/metadata/annotations")
            .and_then(|a| a.get(APPLIED_HASH))
            .cloned()
    };
    hash(live).is_some() && hash(live) == hash(desired) && contains(live, desired)
}

/// `live` says everything `desired` says: objects field by field, lists element by element.
fn contains(live: &Value, desired: &Value) -> bool {
    match (live, desired) {
        (Value::Object(l), Value::Object(d)) => d
            .iter()
            .all(|(k, dv)| l.get(k).is_some_and(|lv| contains(lv, dv))),
        (Value::Array(l), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| contains(lv, dv))
        }
        // The API server returns quantities and int-or-string values as strings.
        (Value::String(l), Value::Number(d)) => *l == d.to_string(),
        (l, d) => l == d,
    }
}

fn changed(before: &Value, after: &Value, manager: &str) -> bool {
    let rv = |v: &Value| v.pointer("/metadata/resourceVersion").cloned();
    if rv(before) == rv(after) {
        return false;
    }
    fingerprint(before, manager) != fingerprint(after, manager)
}

fn fingerprint(obj: &Value, manager: &str) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("status");
        if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
            meta.remove("generation");
            if let Some(mf) = meta.get_mut("managedFields").and_then(Value::as_array_mut) {
                mf.retain(|e| {
                    e.get("manager").and_then(Value::as_str) == Some(manager)
                        && e.get("subresource").is_none()
                });
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_object_is_up_to_date_only_with_the_same_applied_config_and_no_drift() {
        let desired = with_applied_hash(&json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {"a": "1"}},
            "data": {"k": "v"},
            "spec": {"replicas": 2, "ports": [{"port": 80}]}
        }));
        let mut live = desired.clone();
        // Server-side additions: metadata, defaults inside list elements, status.
        live["metadata"]["resourceVersion"] = json!("7");
        live["spec"]["ports"][0]["protocol"] = json!("TCP");
        live["spec"]["replicas"] = json!("2");
        live["status"] = json!({"ready": true});
        assert!(up_to_date(&live, &desired));

        let mut drifted = live.clone();
        drifted["data"]["k"] = json!("edited by hand");
        assert!(!up_to_date(&drifted, &desired), "drift is rewritten");

        let mut extra = live.clone();
        extra["spec"]["ports"] = json!([{"port": 80}, {"port": 81}]);
        assert!(!up_to_date(&extra, &desired), "list lengths must match");

        // A field dropped from the desired config changes the digest, though the rest is a
        // subset of what is live.
        let mut smaller = desired.clone();
        smaller["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(APPLIED_HASH);
        smaller["data"].as_object_mut().unwrap().remove("k");
        let smaller = with_applied_hash(&smaller);
        assert!(contains(&live, &{
            let mut s = smaller.clone();
            s["metadata"]["annotations"][APPLIED_HASH] =
                live["metadata"]["annotations"][APPLIED_HASH].clone();
            s
        }));
        assert!(!up_to_date(&live, &smaller), "a removed field is applied");

        let mut unannotated = live.clone();
        unannotated["metadata"]["annotations"] = json!({});
        assert!(
            !up_to_date(&unannotated, &desired),
            "objects we never applied are applied"
        );
    }

    #[test]
    fn resolves_kinds_and_scopes() {
        let ns = known_resource("v1", "Namespace").unwrap();
        assert!(!ns.namespaced);
        assert_eq!(ns.api_resource.plural, "namespaces");
        assert_eq!(ns.api_resource.group, "");
        let d = known_resource("apps/v1", "Deployment").unwrap();
        assert!(d.namespaced);
        assert_eq!(
            (
                d.api_resource.group.as_str(),
                d.api_resource.version.as_str()
            ),
            ("apps", "v1")
        );
        let route = known_resource("gateway.networking.k8s.io/v1", "HTTPRoute").unwrap();
        assert_eq!(route.api_resource.plural, "httproutes");
        let pool = known_resource("inference.networking.k8s.io/v1", "InferencePool").unwrap();
        assert_eq!(pool.api_resource.plural, "inferencepools");
        let policy = known_resource("networking.k8s.io/v1", "NetworkPolicy").unwrap();
        assert_eq!(policy.api_resource.plural, "networkpolicies");
        assert!(policy.namespaced);
        assert!(known_resource("v1", "Deployment").is_none());
        assert!(known_resource("apps/v1", "StatefulSet").is_none());
        assert!(known_resource("apps/", "Deployment").is_none());
        for (_, kind, _, _) in KINDS {
            assert!(KINDS.iter().filter(|(_, k, _, _)| k == kind).count() <= 2);
        }
    }

    #[test]
    fn status_only_changes_are_not_changes() {
        let before = json!({
            "metadata": {"name": "a", "resourceVersion": "5", "managedFields": [
                {"manager": "me", "operation": "Apply", "time": "t1"}]},
            "spec": {"x": 1}, "status": {"ready": 0}
        });
        let mut status_moved = before.clone();
        status_moved["metadata"]["resourceVersion"] = json!("6");
        status_moved["status"]["ready"] = json!(1);
        status_moved["metadata"]["managedFields"]
            .as_array_mut()
            .unwrap()
            .push(json!({"manager": "ctrl", "operation": "Update", "subresource": "status"}));
        assert!(!changed(&before, &status_moved, "me"));
        let mut spec_moved = status_moved.clone();
        spec_moved["spec"]["x"] = json!(2);
        assert!(changed(&before, &spec_moved, "me"));
        // Same resourceVersion: nothing was written, whatever the rest says.
        assert!(!changed(&before, &before, "me"));
    }

    #[test]
    fn error_classes() {
        let api = |code: u16| KubeError::Api {
            code,
            reason: String::new(),
            message: String::new(),
            retry_after: None,
        };
        for code in [409, 429, 500, 503] {
            assert_eq!(api(code).class(), ErrorClass::TRANSIENT, "{code}");
        }
        let slow_down = KubeError::Api {
            code: 429,
            reason: "TooManyRequests".into(),
            message: String::new(),
            retry_after: Some(Duration::from_secs(4)),
        };
        assert_eq!(
            slow_down.class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(4))
            }
        );
        assert_eq!(api(404).class(), ErrorClass::NotFound);
        assert!(api(404).is_not_found() && !api(410).is_not_found());
        assert_eq!(api(401).class(), ErrorClass::Unauthorized);
        assert_eq!(api(403).class(), ErrorClass::Conflict);
        for code in [400, 410, 415, 422] {
            assert_eq!(api(code).class(), ErrorClass::Refused, "{code}");
        }
        assert_eq!(api(302).class(), ErrorClass::Permanent);
        for local in [
            KubeError::InvalidObject("x".into()),
            KubeError::Config("x".into()),
            KubeError::UnknownKind {
                api_version: "v1".into(),
                kind: "Thing".into(),
            },
        ] {
            assert_eq!(local.class(), ErrorClass::Permanent, "{local}");
        }
    }

    #[test]
    fn a_status_keeps_its_retry_hint() {
        let status = |code: u16, after: u32| {
            let mut s = kube::core::Status::failure("m", "TooManyRequests").with_code(code);
            s.details = Some(kube::core::response::StatusDetails {
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                causes: Vec::new(),
                retry_after_seconds: after,
            });
            KubeError::from(kube::Error::Api(Box::new(s)))
        };
        assert_eq!(
            status(429, 2).class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        // Zero seconds is the field's absence.
        assert_eq!(status(429, 0).class(), ErrorClass::TRANSIENT);
        assert_eq!(status(403, 2).class(), ErrorClass::Conflict);
    }
}
