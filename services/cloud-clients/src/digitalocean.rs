//! A client for the subset of DigitalOcean's public API the workers use: VPCs, DOKS clusters
//! (with their kubeconfig), node pools and nodes, and load balancers.
//!
//! Every call is retried on transient failures per [`RetryConfig`]; every attempt of a mutating
//! call (POST, PUT, DELETE) is counted, so tests can assert that a second reconcile pass over an
//! unchanged spec writes nothing; every attempt is also counted in the Prometheus registry by
//! method and outcome ([`crate::metrics`]). The token is sent as a sensitive header and never
//! logged.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use common::errors::{Classify, ErrorClass};

use crate::metrics::{self, Outcome};
use crate::retry::{retry, RetryConfig};

/// Largest page DigitalOcean serves.
const MAX_PER_PAGE: usize = 200;
/// A bound on pages followed in one list, against a server that never stops paginating.
const MAX_PAGES: usize = 1000;

// ------------------------------------------------------------------ errors

/// A failed DigitalOcean API call.
#[derive(Debug, thiserror::Error)]
pub enum DoError {
    /// 404: the resource (or the route) does not exist.
    #[error("DigitalOcean API 404 not_found: {message}")]
    NotFound {
        message: String,
        request_id: Option<String>,
    },
    /// 429: rate limited; transient.
    #[error("DigitalOcean API 429 too_many_requests: {message}")]
    RateLimited {
        message: String,
        request_id: Option<String>,
        /// The `Retry-After` header, in seconds, when the server sent one.
        retry_after: Option<Duration>,
    },
    /// 5xx; transient.
    #[error("DigitalOcean API {status} {id}: {message}")]
    Server {
        status: u16,
        id: String,
        message: String,
        request_id: Option<String>,
    },
    /// Any other status (400, 401, 403, 409, 422, ...); not retried. Its class says what it
    /// is: a conflict, refused credentials, a refusal. GPU capacity exhaustion is a 422 whose
    /// message mentions "capacity" (see [`DoError::is_capacity`]).
    #[error("DigitalOcean API {status} {id}: {message}")]
    Api {
        status: u16,
        id: String,
        message: String,
        request_id: Option<String>,
    },
    /// The request did not complete: connection refused or reset, timeout, body cut short.
    #[error("DigitalOcean API unreachable: {0}")]
    Transport(#[source] reqwest::Error),
    /// A successful response whose body is not what the API documents.
    #[error("unexpected DigitalOcean API response (HTTP {status}): {detail}")]
    Decode { status: u16, detail: String },
    /// The client could not be built (bad base URL or token characters).
    #[error("invalid DigitalOcean client configuration: {0}")]
    Config(String),
}

impl Classify for DoError {
    /// Decided here, from the answer, once: the worker and the regional service act on the
    /// class and never decide again whether a status passes.
    fn class(&self) -> ErrorClass {
        match self {
            DoError::RateLimited { retry_after, .. } => ErrorClass::Transient {
                retry_after: *retry_after,
            },
            DoError::Server { .. } => ErrorClass::TRANSIENT,
            // A request that could not even be built would not be built the next time either.
            DoError::Transport(e) if e.is_builder() => ErrorClass::Permanent,
            DoError::Transport(_) => ErrorClass::TRANSIENT,
            DoError::NotFound { .. } => ErrorClass::NotFound,
            // After a retried create this can mean the first attempt landed: look the resource
            // up by name.
            DoError::Api { status: 409, .. } => ErrorClass::Conflict,
            DoError::Api {
                status: 422,
                message,
                ..
            } if message.to_ascii_lowercase().contains("already exists") => ErrorClass::Conflict,
            // The token is expired, revoked, or may not do this.
            DoError::Api {
                status: 401 | 403, ..
            } => ErrorClass::Unauthorized,
            // Validation, and a region out of capacity for a size ([`DoError::is_capacity`]).
            DoError::Api {
                status: 400..=499, ..
            } => ErrorClass::Refused,
            DoError::Api { .. } | DoError::Decode { .. } | DoError::Config(_) => {
                ErrorClass::Permanent
            }
        }
    }
}

impl DoError {
    /// Whether the same request may succeed later ([`ErrorClass::Transient`]).
    pub fn is_transient(&self) -> bool {
        self.class().is_transient()
    }

    pub fn is_not_found(&self) -> bool {
        self.class() == ErrorClass::NotFound
    }

    /// A 422 because the region has no capacity for the requested size (e.g. GPUs): a refusal
    /// ([`ErrorClass::Refused`]) that names a domain fact of its own.
    pub fn is_capacity(&self) -> bool {
        matches!(self, DoError::Api { status: 422, message, .. }
            if message.to_ascii_lowercase().contains("capacity"))
    }

    /// A 409, or a 422 saying the name is taken ([`ErrorClass::Conflict`]). After a retried
    /// create this can mean the first attempt landed: look the resource up by name.
    pub fn is_already_exists(&self) -> bool {
        self.class() == ErrorClass::Conflict
    }

    /// The HTTP status, when the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            DoError::NotFound { .. } => Some(404),
            DoError::RateLimited { .. } => Some(429),
            DoError::Server { status, .. } | DoError::Api { status, .. } => Some(*status),
            DoError::Decode { status, .. } => Some(*status),
            DoError::Transport(e) => e.status().map(|s| s.as_u16()),
            DoError::Config(_) => None,
        }
    }

    /// The server's message, when it sent one (for events shown to customers: it never contains
    /// credentials).
    pub fn message(&self) -> Option<&str> {
        match self {
            DoError::NotFound { message, .. }
            | DoError::RateLimited { message, .. }
            | DoError::Server { message, .. }
            | DoError::Api { message, .. } => Some(message),
            _ => None,
        }
    }

    /// The `x-request-id` / `request_id` DigitalOcean gave the failed call, for support tickets.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            DoError::NotFound { request_id, .. }
            | DoError::RateLimited { request_id, .. }
            | DoError::Server { request_id, .. }
            | DoError::Api { request_id, .. } => request_id.as_deref(),
            _ => None,
        }
    }
}

/// DigitalOcean's error body.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ErrorBody {
    id: String,
    message: String,
    request_id: Option<String>,
}

fn error_from_response(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> DoError {
    let parsed: ErrorBody = serde_json::from_slice(body).unwrap_or_else(|_| ErrorBody {
        message: String::from_utf8_lossy(body).chars().take(500).collect(),
        ..Default::default()
    });
    let request_id = parsed.request_id.or_else(|| {
        headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    });
    let code = status.as_u16();
    let id = if parsed.id.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("error")
            .to_ascii_lowercase()
            .replace(' ', "_")
    } else {
        parsed.id
    };
    let message = parsed.message;
    match status {
        StatusCode::NOT_FOUND => DoError::NotFound {
            message,
            request_id,
        },
        StatusCode::TOO_MANY_REQUESTS => DoError::RateLimited {
            message,
            request_id,
            retry_after: headers
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs),
        },
        s if s.is_server_error() => DoError::Server {
            status: code,
            id,
            message,
            request_id,
        },
        _ => DoError::Api {
            status: code,
            id,
            message,
            request_id,
        },
    }
}

// ------------------------------------------------------------------ types

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A VPC.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Vpc {
    pub id: String,
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub description: String,
    pub region: String,
    pub ip_range: String,
    /// The region's default VPC (clusters created without `vpc_uuid` land in it).
    pub default: bool,
    #[serde(deserialize_with = "null_as_default")]
    pub urn: String,
    pub created_at: String,
}

/// A node pool taint.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(default)]
pub struct Taint {
    pub key: String,
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// A node's lifecycle state as DigitalOcean reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Provisioning,
    Running,
    Draining,
    Deleting,
    /// Any state this client does not know.
    #[default]
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeStatus {
    pub state: NodeState,
    #[serde(deserialize_with = "null_as_default")]
    pub message: String,
}

/// A node (droplet) of a node pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Node {
    pub id: String,
    /// Also the Kubernetes Node name.
    pub name: String,
    pub status: NodeStatus,
    #[serde(deserialize_with = "null_as_default")]
    pub droplet_id: String,
    pub created_at: String,
    pub updated_at: String,
}

/// A DOKS node pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodePool {
    pub id: String,
    pub name: String,
    /// Size slug, e.g. `gpu-h100x1-80gb`.
    pub size: String,
    pub count: u32,
    /// Includes the tags DOKS adds (`k8s`, `k8s:<cluster id>`, `k8s:worker`).
    #[serde(deserialize_with = "null_as_default")]
    pub tags: Vec<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub labels: BTreeMap<String, String>,
    #[serde(deserialize_with = "null_as_default")]
    pub taints: Vec<Taint>,
    pub auto_scale: bool,
    /// 0 unless `auto_scale`.
    pub min_nodes: u32,
    /// 0 unless `auto_scale`.
    pub max_nodes: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub nodes: Vec<Node>,
}

impl NodePool {
    /// Nodes in `running` state.
    pub fn running_nodes(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.status.state == NodeState::Running)
            .count()
    }
}

/// A cluster's lifecycle state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    Running,
    Provisioning,
    Degraded,
    Error,
    Deleted,
    Upgrading,
    Deleting,
    /// Any state this client does not know.
    #[default]
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterStatus {
    pub state: ClusterState,
    #[serde(deserialize_with = "null_as_default")]
    pub message: String,
}

/// A cluster's maintenance window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MaintenancePolicy {
    /// `HH:MM`, UTC.
    pub start_time: String,
    /// Read-only, e.g. `4h0m0s`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub duration: String,
    /// `any`, `monday`, ... `sunday`.
    pub day: String,
}

/// A DOKS cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cluster {
    pub id: String,
    pub name: String,
    pub region: String,
    /// Version slug, e.g. `1.33.1-do.3`.
    pub version: String,
    pub vpc_uuid: String,
    pub cluster_subnet: String,
    pub service_subnet: String,
    /// The Kubernetes API URL; empty until the cluster is running.
    #[serde(deserialize_with = "null_as_default")]
    pub endpoint: String,
    #[serde(deserialize_with = "null_as_default")]
    pub ipv4: String,
    /// Includes the tags DOKS adds (`k8s`, `k8s:<cluster id>`).
    #[serde(deserialize_with = "null_as_default")]
    pub tags: Vec<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub node_pools: Vec<NodePool>,
    pub status: ClusterStatus,
    pub maintenance_policy: Option<MaintenancePolicy>,
    pub auto_upgrade: bool,
    pub surge_upgrade: bool,
    pub ha: bool,
    pub created_at: String,
    pub updated_at: String,
}

/// Token credentials for a DOKS cluster's API (`GET /v2/kubernetes/clusters/{id}/credentials`).
/// `Debug` leaves the token out.
#[derive(Clone, PartialEq)]
pub struct ClusterCredentials {
    /// The API server's URL.
    pub server: String,
    /// Base64 of the PEM CA certificate(s) the API server's certificate chains to, as the API
    /// returns it (and as a kubeconfig's `certificate-authority-data` carries it); empty when
    /// the response has none.
    pub certificate_authority_data: String,
    pub token: String,
    /// When the token stops being accepted; `None` when the response does not say.
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl fmt::Debug for ClusterCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCredentials")
            .field("server", &self.server)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl ClusterCredentials {
    /// How long the token has left at `now`: zero once expired, `None` when the response did
    /// not say when it expires.
    pub fn expires_in(&self, now: std::time::SystemTime) -> Option<Duration> {
        let at = std::time::SystemTime::from(self.expires_at?);
        Some(at.duration_since(now).unwrap_or(Duration::ZERO))
    }

    /// Parses a credentials response. Errors never quote the body: it holds the token.
    fn from_body(body: &[u8]) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct Wire {
            server: String,
            #[serde(default)]
            certificate_authority_data: Option<String>,
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            expires_at: Option<String>,
        }
        let w: Wire = serde_json::from_slice(body).map_err(|e| {
            format!(
                "credentials are not the documented shape ({:?} error at line {} column {})",
                e.classify(),
                e.line(),
                e.column()
            )
        })?;
        let token = w.token.filter(|t| !t.is_empty()).ok_or_else(|| {
            "the credentials carry no token (certificate-only clusters are not supported)"
                .to_string()
        })?;
        // RFC 3339; DigitalOcean's examples also write a space for the `T`, which the relaxed
        // parser of `FromStr` accepts.
        let expires_at = match w.expires_at.filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(
                s.parse::<chrono::DateTime<chrono::FixedOffset>>()
                    .map_err(|_| format!("expires_at {s:?} is not a date-time"))?
                    .with_timezone(&chrono::Utc),
            ),
        };
        Ok(ClusterCredentials {
            server: w.server,
            certificate_authority_data: w.certificate_authority_data.unwrap_or_default(),
            token,
            expires_at,
        })
    }
}

/// Body of `POST /v2/kubernetes/clusters/{id}/node_pools`, and a pool in a cluster create.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodePoolCreateRequest {
    pub name: String,
    pub size: String,
    pub count: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_scale: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<u32>,
}

impl NodePoolCreateRequest {
    pub fn new(name: impl Into<String>, size: impl Into<String>, count: u32) -> Self {
        Self {
            name: name.into(),
            size: size.into(),
            count,
            ..Default::default()
        }
    }
}

/// Body of `PUT /v2/kubernetes/clusters/{id}/node_pools/{pool_id}`. DigitalOcean requires `name`
/// and `count`; the size cannot change. `None` leaves a field as it is; `Some` replaces it
/// (DOKS keeps a label removed from the pool on existing nodes; a removed taint goes).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodePoolUpdateRequest {
    pub name: String,
    pub count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_scale: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<u32>,
}

impl NodePoolUpdateRequest {
    pub fn new(name: impl Into<String>, count: u32) -> Self {
        Self {
            name: name.into(),
            count,
            ..Default::default()
        }
    }
}

/// Body of `POST /v2/kubernetes/clusters`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClusterCreateRequest {
    pub name: String,
    pub region: String,
    /// A version slug, or `latest`.
    pub version: String,
    /// Empty: the region's default VPC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpc_uuid: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// At least one, with at least one node in all.
    pub node_pools: Vec<NodePoolCreateRequest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maintenance_policy: Option<MaintenancePolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_upgrade: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub surge_upgrade: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ha: Option<bool>,
}

/// A load balancer forwarding rule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForwardingRule {
    pub entry_protocol: String,
    pub entry_port: u32,
    pub target_protocol: String,
    pub target_port: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub certificate_id: String,
    pub tls_passthrough: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionRef {
    pub slug: String,
    pub name: String,
}

/// A load balancer (DOKS creates them for LoadBalancer Services).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadBalancer {
    pub id: String,
    pub name: String,
    /// Empty until the load balancer is active.
    #[serde(deserialize_with = "null_as_default")]
    pub ip: String,
    /// `new`, `active` or `errored`.
    pub status: String,
    pub vpc_uuid: String,
    /// `EXTERNAL` or `INTERNAL`.
    #[serde(deserialize_with = "null_as_default")]
    pub network: String,
    /// `REGIONAL`, `REGIONAL_NETWORK` or `GLOBAL`.
    #[serde(rename = "type", deserialize_with = "null_as_default")]
    pub lb_type: String,
    /// DOKS sets `k8s:<cluster id>`.
    #[serde(deserialize_with = "null_as_default")]
    pub tag: String,
    #[serde(deserialize_with = "null_as_default")]
    pub forwarding_rules: Vec<ForwardingRule>,
    pub region: Option<RegionRef>,
    pub created_at: String,
}

// ------------------------------------------------------------------ client

/// Transport settings of a [`DoClient`].
#[derive(Debug, Clone)]
pub struct DoClientOptions {
    /// Whole-request timeout (connect, send, receive).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub retry: RetryConfig,
    pub user_agent: String,
    /// `per_page` of list calls (1..=200; DigitalOcean's maximum is the sensible value).
    pub page_size: usize,
}

impl Default for DoClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retry: RetryConfig::default(),
            user_agent: concat!("di-control-plane/", env!("CARGO_PKG_VERSION")).to_string(),
            page_size: MAX_PER_PAGE,
        }
    }
}

struct Inner {
    http: reqwest::Client,
    base: String,
    retry: RetryConfig,
    page_size: usize,
    mutations: AtomicU64,
}

/// The header with which the platform's credential acts for one customer account (a team: a
/// DigitalOcean team is an account, with the same UUID). The API then answers as that account
/// sees it: its own VPCs only, its default VPC made on first use.
pub const ACTING_ACCOUNT_HEADER: &str = "x-acting-account";

/// A DigitalOcean API client for one account token. Cheap to clone; clones share the connection
/// pool and the mutation counter.
#[derive(Clone)]
pub struct DoClient {
    inner: Arc<Inner>,
    /// The customer account this client acts for ([`DoClient::acting_for`]); none: the
    /// credential's own.
    account: Option<uuid::Uuid>,
}

impl fmt::Debug for DoClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the token.
        f.debug_struct("DoClient")
            .field("base_url", &self.inner.base)
            .field("account", &self.account)
            .field("retry", &self.inner.retry)
            .finish_non_exhaustive()
    }
}

/// A successful response, read in full.
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
}

impl DoClient {
    /// A client for `base_url` (e.g. `https://api.digitalocean.com`; paths start with `/v2`)
    /// with default timeouts and retries.
    pub fn new(base_url: &str, token: &str) -> Result<DoClient, DoError> {
        Self::with_options(base_url, token, DoClientOptions::default())
    }

    pub fn with_options(
        base_url: &str,
        token: &str,
        options: DoClientOptions,
    ) -> Result<DoClient, DoError> {
        let base = base_url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base)
            .map_err(|e| DoError::Config(format!("base URL {base:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(DoError::Config(format!(
                "base URL {base:?}: scheme must be http or https"
            )));
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", token.trim()))
            .map_err(|_| DoError::Config("the token contains invalid characters".into()))?;
        auth.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, auth);
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .user_agent(options.user_agent)
            .timeout(options.timeout)
            .connect_timeout(options.connect_timeout)
            .build()
            .map_err(|e| DoError::Config(format!("HTTP client: {e}")))?;
        Ok(DoClient {
            inner: Arc::new(Inner {
                http,
                base,
                retry: options.retry,
                page_size: options.page_size.clamp(1, MAX_PER_PAGE),
                mutations: AtomicU64::new(0),
            }),
            account: None,
        })
    }

    /// This client acting for customer `account`: what that account may see and do, with the
    /// platform's credential (e.g. whether a team owns a VPC). Shares the connection pool.
    pub fn acting_for(&self, account: uuid::Uuid) -> DoClient {
        DoClient {
            inner: self.inner.clone(),
            account: Some(account),
        }
    }

    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// Mutating requests (POST, PUT, DELETE) sent by this client and its clones, counting every
    /// attempt, retries included (which is also how DigitalOcean and the simulator count them).
    pub fn mutating_calls(&self) -> u64 {
        self.inner.mutations.load(Ordering::SeqCst)
    }

    /// One attempt, counted in [`metrics::DO_REQUESTS`].
    async fn send_once(
        &self,
        method: &Method,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Reply, DoError> {
        let result = self.request(method, path, body).await;
        metrics::digitalocean(method.as_str(), Outcome::of_result(&result));
        result
    }

    async fn request(
        &self,
        method: &Method,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Reply, DoError> {
        let url = format!("{}{path}", self.inner.base);
        let mut req = self.inner.http.request(method.clone(), &url);
        if let Some(account) = self.account {
            req = req.header(ACTING_ACCOUNT_HEADER, account.to_string());
        }
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_vec());
        }
        if *method != Method::GET && *method != Method::HEAD {
            self.inner.mutations.fetch_add(1, Ordering::SeqCst);
        }
        let resp = req.send().await.map_err(DoError::Transport)?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.map_err(DoError::Transport)?;
        tracing::debug!(%method, path, status = status.as_u16(), "DigitalOcean API call");
        if status.is_success() {
            Ok(Reply {
                status,
                body: bytes.to_vec(),
            })
        } else {
            Err(error_from_response(status, &headers, &bytes))
        }
    }

    /// With retries.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Reply, DoError> {
        let what = format!("{method} {path}");
        retry(&self.inner.retry, &what, || {
            self.send_once(&method, path, body.as_deref())
        })
        .await
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
        key: &str,
    ) -> Result<T, DoError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| DoError::Config(format!("request body: {e}")))?;
        let reply = self.send(method, path, body).await?;
        decode_key(&reply, key)
    }

    async fn get<T: DeserializeOwned>(&self, path: &str, key: &str) -> Result<T, DoError> {
        self.json(Method::GET, path, None::<&()>, key).await
    }

    async fn no_content(&self, method: Method, path: &str) -> Result<(), DoError> {
        self.send(method, path, None).await.map(|_| ())
    }

    /// Follows DigitalOcean pagination (`page`/`per_page`, `links.pages.next`).
    async fn list_all<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
    ) -> Result<Vec<T>, DoError> {
        let mut out = Vec::new();
        for page in 1..=MAX_PAGES {
            let reply = self
                .send(
                    Method::GET,
                    &format!("{path}?page={page}&per_page={}", self.inner.page_size),
                    None,
                )
                .await?;
            let v: Value = decode(&reply)?;
            let items: Vec<T> = match v.get(key) {
                Some(items) => {
                    serde_json::from_value(items.clone()).map_err(|e| DoError::Decode {
                        status: reply.status.as_u16(),
                        detail: format!("{key}: {e}"),
                    })?
                }
                None => {
                    return Err(DoError::Decode {
                        status: reply.status.as_u16(),
                        detail: format!("missing {key:?}"),
                    })
                }
            };
            let n = items.len();
            out.extend(items);
            let has_next = v
                .pointer("/links/pages/next")
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty());
            if !has_next || n == 0 {
                break;
            }
        }
        Ok(out)
    }

    // -------------------------------------------------------------- VPCs

    pub async fn vpc_list(&self) -> Result<Vec<Vpc>, DoError> {
        self.list_all("/v2/vpcs", "vpcs").await
    }

    pub async fn vpc_get(&self, vpc_id: &str) -> Result<Vpc, DoError> {
        self.get(&format!("/v2/vpcs/{}", seg(vpc_id)), "vpc").await
    }

    // -------------------------------------------------------------- clusters

    pub async fn cluster_list(&self) -> Result<Vec<Cluster>, DoError> {
        self.list_all("/v2/kubernetes/clusters", "kubernetes_clusters")
            .await
    }

    /// 201 with the cluster in `provisioning`. A live cluster with the same name is a 409.
    pub async fn cluster_create(&self, req: &ClusterCreateRequest) -> Result<Cluster, DoError> {
        self.json(
            Method::POST,
            "/v2/kubernetes/clusters",
            Some(req),
            "kubernetes_cluster",
        )
        .await
    }

    pub async fn cluster_get(&self, cluster_id: &str) -> Result<Cluster, DoError> {
        self.get(
            &format!("/v2/kubernetes/clusters/{}", seg(cluster_id)),
            "kubernetes_cluster",
        )
        .await
    }

    /// 204; the cluster is `deleting`, then 404. Deleting a deleting cluster is accepted.
    pub async fn cluster_delete(&self, cluster_id: &str) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!("/v2/kubernetes/clusters/{}", seg(cluster_id)),
        )
        .await
    }

    /// The cluster's kubeconfig (YAML, token user). Available as soon as the cluster exists.
    pub async fn kubeconfig(&self, cluster_id: &str) -> Result<String, DoError> {
        let reply = self
            .send(
                Method::GET,
                &format!("/v2/kubernetes/clusters/{}/kubeconfig", seg(cluster_id)),
                None,
            )
            .await?;
        String::from_utf8(reply.body).map_err(|e| DoError::Decode {
            status: reply.status.as_u16(),
            detail: format!("kubeconfig is not UTF-8: {e}"),
        })
    }

    /// New token credentials for the cluster's API, valid for the API's default lifetime (7
    /// days on DOKS); `expires_at` says until when.
    pub async fn cluster_credentials(
        &self,
        cluster_id: &str,
    ) -> Result<ClusterCredentials, DoError> {
        let reply = self
            .send(
                Method::GET,
                &format!("/v2/kubernetes/clusters/{}/credentials", seg(cluster_id)),
                None,
            )
            .await?;
        ClusterCredentials::from_body(&reply.body).map_err(|detail| DoError::Decode {
            status: reply.status.as_u16(),
            detail,
        })
    }

    // -------------------------------------------------------------- node pools

    pub async fn node_pool_list(&self, cluster_id: &str) -> Result<Vec<NodePool>, DoError> {
        self.get(
            &format!("/v2/kubernetes/clusters/{}/node_pools", seg(cluster_id)),
            "node_pools",
        )
        .await
    }

    /// 201. Beyond the region's capacity for the size: a permanent 422 ([`DoError::is_capacity`]).
    pub async fn node_pool_create(
        &self,
        cluster_id: &str,
        req: &NodePoolCreateRequest,
    ) -> Result<NodePool, DoError> {
        self.json(
            Method::POST,
            &format!("/v2/kubernetes/clusters/{}/node_pools", seg(cluster_id)),
            Some(req),
            "node_pool",
        )
        .await
    }

    pub async fn node_pool_get(
        &self,
        cluster_id: &str,
        pool_id: &str,
    ) -> Result<NodePool, DoError> {
        self.get(
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
            "node_pool",
        )
        .await
    }

    /// 202. Scaling beyond capacity is a permanent 422 ([`DoError::is_capacity`]).
    pub async fn node_pool_update(
        &self,
        cluster_id: &str,
        pool_id: &str,
        req: &NodePoolUpdateRequest,
    ) -> Result<NodePool, DoError> {
        self.json(
            Method::PUT,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
            Some(req),
            "node_pool",
        )
        .await
    }

    /// 204; the pool's nodes are `deleting`, then the pool is gone (404).
    pub async fn node_pool_delete(&self, cluster_id: &str, pool_id: &str) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}",
                seg(cluster_id),
                seg(pool_id)
            ),
        )
        .await
    }

    /// Deletes one node (`replace = true`: DOKS puts a new one in its place; otherwise the pool's
    /// count drops by one). 202 on DigitalOcean.
    pub async fn node_delete(
        &self,
        cluster_id: &str,
        pool_id: &str,
        node_id: &str,
        replace: bool,
    ) -> Result<(), DoError> {
        self.no_content(
            Method::DELETE,
            &format!(
                "/v2/kubernetes/clusters/{}/node_pools/{}/nodes/{}?replace={}",
                seg(cluster_id),
                seg(pool_id),
                seg(node_id),
                u8::from(replace)
            ),
        )
        .await
    }

    // -------------------------------------------------------------- load balancers

    pub async fn load_balancer_list(&self) -> Result<Vec<LoadBalancer>, DoError> {
        self.list_all("/v2/load_balancers", "load_balancers").await
    }

    pub async fn load_balancer_get(&self, lb_id: &str) -> Result<LoadBalancer, DoError> {
        self.get(
            &format!("/v2/load_balancers/{}", seg(lb_id)),
            "load_balancer",
        )
        .await
    }
}

fn decode<T: DeserializeOwned>(reply: &Reply) -> Result<T, DoError> {
    serde_json::from_slice(&reply.body).map_err(|e| DoError::Decode {
        status: reply.status.as_u16(),
        detail: e.to_string(),
    })
}

fn decode_key<T: DeserializeOwned>(reply: &Reply, key: &str) -> Result<T, DoError> {
    let mut v: Value = decode(reply)?;
    let item = v
        .get_mut(key)
        .map(Value::take)
        .ok_or_else(|| DoError::Decode {
            status: reply.status.as_u16(),
            detail: format!("missing {key:?}"),
        })?;
    serde_json::from_value(item).map_err(|e| DoError::Decode {
        status: reply.status.as_u16(),
        detail: format!("{key}: {e}"),
    })
}

/// Percent-encodes a path segment (ids are UUIDs, but a stray `/` or `?` must not change the
/// route).
pub(crate) fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(status: u16, body: &str, retry_after: Option<&str>) -> DoError {
        let mut h = HeaderMap::new();
        if let Some(r) = retry_after {
            h.insert(RETRY_AFTER, HeaderValue::from_str(r).unwrap());
        }
        error_from_response(StatusCode::from_u16(status).unwrap(), &h, body.as_bytes())
    }

    #[test]
    fn classifies_errors() {
        let capacity = err(
            422,
            r#"{"id":"unprocessable_entity","message":"insufficient capacity: size gpu-h100x1-80gb has 0 of 1 requested nodes available","request_id":"r1"}"#,
            None,
        );
        assert_eq!(capacity.class(), ErrorClass::Refused);
        assert!(capacity.is_capacity() && !capacity.is_transient());
        assert_eq!(capacity.status(), Some(422));
        assert_eq!(capacity.request_id(), Some("r1"));

        let invalid = err(
            422,
            r#"{"id":"unprocessable_entity","message":"name is required"}"#,
            None,
        );
        assert_eq!(invalid.class(), ErrorClass::Refused);
        assert!(!invalid.is_capacity() && !invalid.is_already_exists());
        for status in [400, 405, 412] {
            assert_eq!(
                err(status, "", None).class(),
                ErrorClass::Refused,
                "{status}"
            );
        }

        let nf = err(404, r#"{"id":"not_found","message":"gone"}"#, None);
        assert_eq!(nf.class(), ErrorClass::NotFound);
        assert!(nf.is_not_found() && !nf.is_transient());

        let rl = err(
            429,
            r#"{"id":"too_many_requests","message":"slow down"}"#,
            Some("3"),
        );
        assert_eq!(
            rl.class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        assert!(rl.is_transient());
        // A Retry-After that is not a number of seconds is no hint.
        assert_eq!(err(429, "", Some("soon")).class(), ErrorClass::TRANSIENT);

        for status in [500, 502, 503] {
            assert_eq!(
                err(status, "", None).class(),
                ErrorClass::TRANSIENT,
                "{status}"
            );
        }
        let five = err(503, "upstream unavailable", None);
        assert_eq!(five.status(), Some(503));
        assert_eq!(five.message(), Some("upstream unavailable"));

        let conflict = err(
            409,
            r#"{"id":"conflict","message":"a cluster named x already exists"}"#,
            None,
        );
        assert_eq!(conflict.class(), ErrorClass::Conflict);
        assert!(!conflict.is_transient() && conflict.is_already_exists());
        let taken = err(
            422,
            r#"{"id":"unprocessable_entity","message":"a node pool with this name Already Exists"}"#,
            None,
        );
        assert_eq!(taken.class(), ErrorClass::Conflict);
        assert!(taken.is_already_exists());

        for status in [401, 403] {
            let refused = err(
                status,
                r#"{"id":"unauthorized","message":"Unable to authenticate you."}"#,
                None,
            );
            assert_eq!(refused.class(), ErrorClass::Unauthorized, "{status}");
            assert!(!refused.is_transient() && !refused.is_already_exists());
        }

        // Neither a 4xx nor a 5xx: nothing says a retry or another request would do better.
        assert_eq!(err(304, "", None).class(), ErrorClass::Permanent);
        let undecodable = DoError::Decode {
            status: 200,
            detail: "missing \"vpc\"".into(),
        };
        assert_eq!(undecodable.class(), ErrorClass::Permanent);
        assert_eq!(DoError::Config("x".into()).class(), ErrorClass::Permanent);
    }

    #[tokio::test]
    async fn requests_that_did_not_complete_are_transient_unless_never_made() {
        let http = reqwest::Client::new();
        // Nothing listens on port 1 of the loopback address.
        let refused = http.get("http://127.0.0.1:1/").send().await.unwrap_err();
        assert_eq!(DoError::Transport(refused).class(), ErrorClass::TRANSIENT);
        let unbuildable = http.get("http://[::1").send().await.unwrap_err();
        assert!(unbuildable.is_builder());
        assert_eq!(
            DoError::Transport(unbuildable).class(),
            ErrorClass::Permanent
        );
    }

    #[test]
    fn path_segments_are_escaped() {
        assert_eq!(seg("5f0e-ab_c.d~"), "5f0e-ab_c.d~");
        assert_eq!(seg("a/b?c"), "a%2Fb%3Fc");
    }

    #[test]
    fn debug_never_shows_the_token() {
        let c = DoClient::new("http://127.0.0.1:1", "dop_v1_secret_value").unwrap();
        assert!(!format!("{c:?}").contains("secret_value"));
    }

    #[test]
    fn credentials_parse_and_never_show_the_token() {
        // As DigitalOcean's own example writes it: a space for the `T`.
        let c = ClusterCredentials::from_body(
            br#"{"server":"https://k.example","certificate_authority_data":"TFMw","client_certificate_data":null,"client_key_data":null,"token":"tok_secret_value","expires_at":"2019-11-09 11:50:28.889080+00:00"}"#,
        )
        .unwrap();
        assert_eq!(c.token, "tok_secret_value");
        assert_eq!(c.certificate_authority_data, "TFMw");
        assert_eq!(
            c.expires_at.unwrap().to_rfc3339(),
            "2019-11-09T11:50:28.889080+00:00"
        );
        assert!(!format!("{c:?}").contains("secret_value"));
        let z = ClusterCredentials::from_body(
            br#"{"server":"https://k","token":"t","expires_at":"2026-01-01T00:00:00.5Z"}"#,
        )
        .unwrap();
        assert_eq!(z.expires_at.unwrap().timestamp_millis() % 1000, 500);
        assert_eq!(z.certificate_authority_data, "");
        let none = ClusterCredentials::from_body(br#"{"server":"https://k","token":"t"}"#).unwrap();
        assert_eq!(none.expires_at, None);
        // Errors name what is wrong without echoing the body.
        for bad in [
            &br#"{"server":"https://k","token":42,"x":"tok_secret_value"}"#[..],
            br#"{"server":"https://k","token":"tok_secret_value","expires_at":"soon"}"#,
            br#"{"server":"https://k","token":""}"#,
        ] {
            let e = ClusterCredentials::from_body(bad).unwrap_err();
            assert!(!e.contains("secret_value"), "{e}");
        }
    }

    #[test]
    fn pool_with_null_labels_reads_as_empty() {
        let p: NodePool = serde_json::from_str(
            r#"{"id":"p","name":"n","size":"s-1vcpu-2gb","count":1,"labels":null,"taints":[],"nodes":[{"id":"x","name":"n-abcde","status":{"state":"running"}}]}"#,
        )
        .unwrap();
        assert!(p.labels.is_empty());
        assert_eq!(p.running_nodes(), 1);
        let n: Node = serde_json::from_str(r#"{"status":{"state":"something-new"}}"#).unwrap();
        assert_eq!(n.status.state, NodeState::Unknown);
    }
}
