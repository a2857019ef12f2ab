//! The simulated data plane: one OpenAI-compatible HTTPS server per load balancer.
//!
//! An [`Endpoint`] is what a client reaches at a load balancer's address: a site of the region's
//! [`Front`] at the load balancer's own loopback address. It knows nothing about
//! Kubernetes: it is told (through [`EndpointConfig`]) which certificate the gateway listener
//! serves, which token hashes are valid, and where the route leads. It then fails the way a real
//! gateway does when something is missing: no certificate → the TLS handshake fails, no route →
//! 404, bad token → 401, no ready backend → 503. The model behind it is fake but deterministic.
//!
//! Scale from zero: when the pool's endpoint picker runs with flow control
//! ([`PoolRoute::flow_control`]) and the route has no ready backend, a request is held, as
//! the picker's flow control queues it, until a backend appears (it is then served normally),
//! the picker's queue TTL passes ([`PoolRoute::queue_ttl`]: 503 with the picker's dropped
//! reason) or the gateway's stream idle timeout does ([`PoolRoute::stream_idle`]: 408). Held
//! requests are counted per pool ([`held_requests`]): the EPP's queue-size gauge. Once routed,
//! a response must be complete within the route's timeout ([`Backend::route_timeout`]);
//! the wait in the picker's queue does not count, as Envoy's router, which keeps the timer,
//! comes after the picker's ext_proc filter.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use crate::auth::Authentication;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use region_sim_base::faults::{Api, Faults, Verdict};
use region_sim_base::front::{tls_config, Front, Site, SiteId};
use rustls::ServerConfig;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::future::Future;
use tokio::sync::watch;

/// How long a connection may stay idle between requests, as on DigitalOcean's load balancers
/// (`http_idle_timeout_seconds`, 60 by default).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How fast the fake model answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelTiming {
    /// Time to first token, in milliseconds (without the serving model).
    pub ttft_ms: u64,
    /// Delay between tokens, in milliseconds (without the serving model).
    pub per_token_ms: u64,
    /// The serving model ([`crate::serving`]); off (time scale 0) by default.
    pub serving: crate::serving::ServingConfig,
}

impl Default for ModelTiming {
    fn default() -> Self {
        Self {
            ttft_ms: 20,
            per_token_ms: 5,
            serving: Default::default(),
        }
    }
}

/// Where the gateway's route leads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Route {
    /// No HTTPRoute is attached to the gateway: every request is 404.
    #[default]
    None,
    /// An HTTPRoute sends matching requests to an InferencePool.
    Pool {
        /// Path matches of the route (`PathPrefix` values, or `=`-prefixed `Exact` values);
        /// empty means every path.
        paths: Vec<String>,
        /// The ready pods behind the pool.
        endpoints: Vec<Backend>,
        /// The InferencePools the route's rules lead to.
        pools: Vec<PoolRoute>,
    },
}

/// Envoy's stream idle timeout (the HTTP connection manager's `stream_idle_timeout`, 5 minutes
/// by default): a request with no bytes moving either way for this long is ended with 408. It
/// ends a held request too, unless its route raises it.
pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Envoy's route timeout when the route sets none: a response not complete 15 s after the
/// request was routed is cut (504 before its headers, a reset stream after).
pub const ROUTE_TIMEOUT: Duration = Duration::from_secs(15);

/// The idle timeout Envoy Gateway gives a route that sets a request timeout: the longer of an
/// hour and that timeout.
pub const ROUTE_IDLE_FLOOR: Duration = Duration::from_secs(3600);

/// An InferencePool a route leads to, as the gateway's flow control sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRoute {
    /// The pool's name.
    pub name: String,
    /// A stable key (the pool's UID): held requests are counted under it ([`held_requests`]).
    pub key: String,
    /// The pool's endpoint picker runs with the `flowControl` feature gate: while the route has
    /// no ready backend, requests wait for one instead of failing at once.
    pub flow_control: bool,
    /// How long the picker keeps a request it cannot place (`flowControl.defaultRequestTTL`,
    /// else [`crate::picker::DEFAULT_QUEUE_TTL`]); zero: until the client leaves.
    pub queue_ttl: Duration,
    /// How long the gateway lets the held request sit without a byte ([`STREAM_IDLE_TIMEOUT`],
    /// or the route's own, see [`ROUTE_IDLE_FLOOR`]); `None`: no limit (a zero request timeout).
    pub stream_idle: Option<Duration>,
}

impl Default for PoolRoute {
    fn default() -> Self {
        PoolRoute {
            name: String::new(),
            key: String::new(),
            flow_control: false,
            queue_ttl: crate::picker::DEFAULT_QUEUE_TTL,
            stream_idle: Some(STREAM_IDLE_TIMEOUT),
        }
    }
}

/// Held requests per pool key, shared by every endpoint (several load balancers may front one
/// pool, as one EPP serves them all). An entry lives while a request is held.
fn held_registry() -> &'static Mutex<HashMap<String, Weak<AtomicUsize>>> {
    static H: OnceLock<Mutex<HashMap<String, Weak<AtomicUsize>>>> = OnceLock::new();
    H.get_or_init(Default::default)
}

/// Requests the gateways currently hold for the pool with this key (the EPP's
/// `inference_extension_flow_control_queue_size`).
pub fn held_requests(pool_key: &str) -> usize {
    held_registry()
        .lock()
        .expect("held lock")
        .get(pool_key)
        .and_then(Weak::upgrade)
        .map_or(0, |n| n.load(Ordering::SeqCst))
}

/// One held request, counted for its pool until it is dropped (served, timed out, or its
/// client gone).
struct Held {
    count: Arc<AtomicUsize>,
}

impl Held {
    fn new(pool_key: &str) -> Held {
        let mut m = held_registry().lock().expect("held lock");
        let count = match m.get(pool_key).and_then(Weak::upgrade) {
            Some(c) => c,
            None => {
                m.retain(|_, w| w.strong_count() > 0);
                let c = Arc::new(AtomicUsize::new(0));
                m.insert(pool_key.to_string(), Arc::downgrade(&c));
                c
            }
        };
        count.fetch_add(1, Ordering::SeqCst);
        Held { count }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One ready pod behind a pool and the model it serves. A pod keeps the model it was started
/// with: while a Deployment rolls from one model to another, both are served.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Backend {
    pub pod: String,
    /// Served model name; `None` accepts any model name.
    pub model: Option<String>,
    /// What the serving model needs to know about the pod and its pool.
    pub serving: crate::serving::BackendServing,
    /// How long an answer from this pod may take once the request is routed to it (Envoy's
    /// route timeout: the `timeouts.request` of the rule leading to its pool, else
    /// [`ROUTE_TIMEOUT`]); `None`: no limit.
    pub route_timeout: Option<Duration>,
}

impl Backend {
    pub fn new(pod: impl Into<String>, model: Option<&str>) -> Self {
        Backend {
            pod: pod.into(),
            model: model.map(str::to_string),
            serving: Default::default(),
            route_timeout: None,
        }
    }
}

/// Everything an endpoint needs to know to serve, derived from the cluster's objects.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EndpointConfig {
    /// PEM certificate chain and private key of the gateway's HTTPS listener.
    pub tls: Option<(String, String)>,
    /// How requests are authenticated before they are routed.
    pub auth: Authentication,
    pub route: Route,
    /// How the gateway rewrites answers (Envoy Gateway's `responseOverride`).
    pub overrides: Vec<crate::overrides::ResponseOverride>,
}

struct Inner {
    config: RwLock<EndpointConfig>,
    tls: RwLock<Option<Arc<ServerConfig>>>,
    timing: Arc<RwLock<ModelTiming>>,
    faults: Arc<Faults>,
    next_backend: AtomicUsize,
    requests: AtomicU64,
    /// Bumped on every configuration update: held requests wake on it.
    updates: watch::Sender<u64>,
    /// True once the endpoint shuts down: held requests are released.
    stopped: watch::Receiver<bool>,
}

/// One OpenAI-compatible HTTPS server at a loopback address of its own.
pub struct Endpoint {
    addr: SocketAddr,
    inner: Arc<Inner>,
    shutdown: watch::Sender<bool>,
    front: Front,
    site: SiteId,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Endpoint {
    /// Starts serving at `ip` on `front` (the address is the caller's: a load balancer's). Until
    /// a certificate is configured every TLS handshake fails, as on a gateway whose listener has
    /// no valid certificate.
    pub fn start(
        front: &Front,
        ip: Ipv4Addr,
        timing: Arc<RwLock<ModelTiming>>,
        faults: Arc<Faults>,
    ) -> Endpoint {
        let (tx, rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            config: RwLock::new(EndpointConfig::default()),
            tls: RwLock::new(None),
            timing,
            faults,
            next_backend: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            updates: watch::channel(0).0,
            stopped: rx.clone(),
        });
        let tls_of = inner.clone();
        let site = front.register(
            ip,
            Site {
                tls: Arc::new(move || tls_of.tls.read().expect("tls lock").clone()),
                app: router(inner.clone()),
                stop: rx,
                idle_timeout: IDLE_TIMEOUT,
            },
        );
        Endpoint {
            addr: SocketAddr::from((ip, front.port())),
            inner,
            shutdown: tx,
            front: front.clone(),
            site,
        }
    }

    /// The load balancer's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.site.ip
    }

    /// The port every endpoint of the region shares.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Requests that reached the HTTP layer (after a successful handshake).
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    pub fn config(&self) -> EndpointConfig {
        self.inner.config.read().expect("endpoint lock").clone()
    }

    /// Applies a new configuration. The certificate is reloaded only when it changed; an invalid
    /// one leaves the listener without a certificate (handshakes fail) and is reported.
    pub fn update(&self, mut cfg: EndpointConfig) -> Result<(), String> {
        crate::serving::attach(&mut cfg, Arc::as_ptr(&self.inner) as usize);
        let mut current = self.inner.config.write().expect("endpoint lock");
        let mut result = Ok(());
        if current.tls != cfg.tls || self.inner.tls.read().expect("tls lock").is_none() {
            let built = match &cfg.tls {
                Some((c, k)) => match tls_config(c, k) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        result = Err(format!("{e:#}"));
                        None
                    }
                },
                None => None,
            };
            *self.inner.tls.write().expect("tls lock") = built;
        }
        *current = cfg;
        drop(current);
        // Held requests look again (a ready backend may have appeared).
        self.inner.updates.send_modify(|n| *n += 1);
        result
    }

    /// Stops serving: new connections to the address are closed at once, open ones too.
    pub fn shutdown(&self) {
        self.front.unregister(self.site);
        let _ = self.shutdown.send(true);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(fallback)
        .with_state(inner.clone())
        .layer(axum::middleware::map_response_with_state(
            inner,
            |State(inner): State<Arc<Inner>>, resp: Response| async move {
                let overrides = inner
                    .config
                    .read()
                    .expect("endpoint lock")
                    .overrides
                    .clone();
                crate::overrides::apply(&overrides, resp)
            },
        ))
}

/// An error in OpenAI's shape.
fn oai_error(status: StatusCode, kind: &str, code: Value, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}})),
    )
        .into_response()
}

/// What the gateway decided for a request that passed its checks.
struct Admitted {
    /// The pod the request goes to (re-chosen among the pods serving the request's model once
    /// its body names one).
    backend: String,
    backends: Vec<Backend>,
    /// This request's turn in the round robin (one per request, whichever pods it may use).
    turn: usize,
    /// When the request was routed (after any wait in the picker's queue, which Envoy's route
    /// timer does not count).
    routed_at: tokio::time::Instant,
}

impl Admitted {
    /// When the route's timeout cuts the answer of the chosen pod: its rule's timeout in the
    /// time the model runs on (simulated seconds when the serving model is on).
    fn deadline(&self, timing: &ModelTiming) -> Option<tokio::time::Instant> {
        let timeout = self
            .backends
            .iter()
            .find(|b| b.pod == self.backend)?
            .route_timeout?;
        let timeout = if timing.serving.enabled() {
            timeout.mul_f64(timing.serving.time_scale)
        } else {
            timeout
        };
        Some(self.routed_at + timeout)
    }
}

/// The gateway's checks, in a gateway's order: faults, route match, authentication, backend.
async fn admit(inner: &Inner, path: &str, headers: &HeaderMap) -> Result<Admitted, Response> {
    inner.requests.fetch_add(1, Ordering::Relaxed);
    match inner.faults.apply(Api::DataPlane).await {
        Verdict::Pass => {}
        Verdict::Error => {
            return Err(oai_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                json!(503),
                "upstream connect error or disconnect/reset before headers",
            ))
        }
        Verdict::RateLimited(secs) => {
            let mut r = oai_error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                json!(429),
                "Too many requests",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return Err(r);
        }
    }
    let cfg = inner.config.read().expect("endpoint lock").clone();
    let (paths, endpoints, pools) = match cfg.route {
        Route::None => {
            return Err(oai_error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                json!(404),
                "route not found",
            ))
        }
        Route::Pool {
            paths,
            endpoints,
            pools,
        } => (paths, endpoints, pools),
    };
    if !paths.is_empty()
        && !paths.iter().any(|p| match p.strip_prefix('=') {
            Some(exact) => path == exact,
            None => path_prefix_matches(p, path),
        })
    {
        return Err(oai_error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            json!(404),
            "route not found",
        ));
    }
    authenticate(&cfg.auth, headers)?;
    let endpoints = if !endpoints.is_empty() {
        endpoints
    } else if let Some(pool) = pools.iter().find(|p| p.flow_control) {
        // The route's first pool whose picker holds requests holds this one.
        hold(inner, pool).await?
    } else {
        return Err(no_healthy_upstream());
    };
    let turn = inner.next_backend.fetch_add(1, Ordering::Relaxed);
    Ok(Admitted {
        backend: endpoints[turn % endpoints.len()].pod.clone(),
        backends: endpoints,
        turn,
        routed_at: tokio::time::Instant::now(),
    })
}

/// What Envoy does with a request before routing it, under the Gateway's SecurityPolicy
/// ([`Authentication`]): a refusal is endpoint-auth's own answer (401 in OpenAI's error shape),
/// relayed as Envoy relays a denied check; Envoy's own answers have plain-text bodies.
// The refusal is the answer the caller relays with `?`, as `route` does its own: boxing it would
// only add an allocation per refused request.
#[allow(clippy::result_large_err)]
fn authenticate(auth: &Authentication, headers: &HeaderMap) -> Result<(), Response> {
    let envoy = |code: u16, body: &'static str| {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::FORBIDDEN);
        Err((status, body).into_response())
    };
    match auth {
        Authentication::Open => Ok(()),
        Authentication::Refused => envoy(500, ""),
        Authentication::External {
            hashes: None,
            fail_open: true,
            ..
        } => Ok(()),
        Authentication::External {
            hashes: None,
            status_on_error,
            ..
        } => envoy(*status_on_error, ""),
        Authentication::External {
            hashes: Some(hashes),
            ..
        } => {
            // Envoy sends a repeated header to the service as one, its values joined by commas.
            let values: Vec<&str> = headers
                .get_all(header::AUTHORIZATION)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let authorization = (!values.is_empty()).then(|| values.join(","));
            match endpoint_auth::decide(authorization.as_deref(), Some(hashes)) {
                endpoint_auth::Decision::Allow => Ok(()),
                endpoint_auth::Decision::Refuse => Err(endpoint_auth::refusal()),
            }
        }
    }
}

fn no_healthy_upstream() -> Response {
    oai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        json!(503),
        "no healthy upstream",
    )
}

/// `30 s`, `0.5 s`.
/// Waits, counted as held for `pool`, until the route has a ready backend (its backends), the
/// picker's queue TTL or the gateway's idle timeout passes, or the endpoint shuts down (the
/// answer). Wakes only on configuration
/// updates, on shutdown and at the deadline. Wall-clock time: the wait is the client's, not the
/// serving model's.
async fn hold(inner: &Inner, pool: &PoolRoute) -> Result<Vec<Backend>, Response> {
    let _held = Held::new(&pool.key);
    // Whichever ends first: the picker's queue (a zero TTL keeps the request until the client
    // leaves) or the gateway's idle timeout.
    let forever = Duration::from_secs(365 * 24 * 3600);
    let ttl = Some(pool.queue_ttl)
        .filter(|t| !t.is_zero())
        .unwrap_or(forever);
    let idle = pool.stream_idle.unwrap_or(forever);
    let deadline = tokio::time::Instant::now() + ttl.min(idle);
    // Subscribed before looking, so an update between the look and the wait is not missed.
    let mut updates = inner.updates.subscribe();
    let mut stopped = inner.stopped.clone();
    loop {
        if *stopped.borrow_and_update() {
            return Err(no_healthy_upstream());
        }
        match &inner.config.read().expect("endpoint lock").route {
            Route::Pool { endpoints, .. } if !endpoints.is_empty() => return Ok(endpoints.clone()),
            Route::Pool { .. } => {}
            Route::None => {
                return Err(oai_error(
                    StatusCode::NOT_FOUND,
                    "not_found_error",
                    json!(404),
                    "route not found",
                ))
            }
        }
        tokio::select! {
            r = updates.changed() => {
                if r.is_err() {
                    return Err(no_healthy_upstream());
                }
            }
            r = stopped.changed() => {
                if r.is_err() {
                    return Err(no_healthy_upstream());
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(if ttl <= idle {
                    queue_expired()
                } else {
                    // Envoy's own answer to a stream idle for too long.
                    (StatusCode::REQUEST_TIMEOUT, "stream timeout").into_response()
                });
            }
        }
    }
}

/// The picker's answer to a request its queue kept until the TTL with no endpoint to send it
/// to: an immediate response through the gateway, 503 in OpenAI's error shape, with the reason
/// in `x-llm-d-request-dropped-reason` (llm-d-router's `rejected-no-endpoints`). The picker says
/// nothing of when to retry.
fn queue_expired() -> Response {
    let mut r = oai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        json!(503),
        "no endpoint became available to serve the request",
    );
    r.headers_mut().insert(
        DROPPED_REASON,
        HeaderValue::from_static("rejected-no-endpoints"),
    );
    r
}

/// The header in which the picker says why it dropped a request.
pub const DROPPED_REASON: &str = "x-llm-d-request-dropped-reason";

/// Gateway API `PathPrefix` semantics: element-wise prefix, `/` matches everything.
fn path_prefix_matches(prefix: &str, path: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || path == prefix
        || (path.starts_with(prefix) && path.as_bytes().get(prefix.len()) == Some(&b'/'))
}

fn with_backend(mut resp: Response, backend: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(backend) {
        resp.headers_mut().insert("x-sim-backend", v);
    }
    resp
}

async fn fallback(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    match admit(&inner, req.uri().path(), req.headers()).await {
        Err(r) => r,
        Ok(a) => with_backend(
            oai_error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                json!(404),
                format!("{} {} is not served", req.method(), req.uri().path()),
            ),
            &a.backend,
        ),
    }
}

async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let a = match admit(&inner, "/v1/models", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mut names: Vec<String> = a.backends.iter().filter_map(|b| b.model.clone()).collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        names.push("model".into());
    }
    let created = chrono::Utc::now().timestamp();
    let data: Vec<Value> = names
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": name, "parent": null, "max_model_len": 8192,
            })
        })
        .collect();
    with_backend(
        Json(json!({"object": "list", "data": data})).into_response(),
        &a.backend,
    )
}

fn bad_request(msg: impl Into<String>) -> Response {
    oai_error(StatusCode::BAD_REQUEST, "BadRequestError", json!(400), msg)
}

/// The request fields both completion APIs share.
struct Common {
    body: Value,
    model: String,
    max_tokens: Option<u32>,
    /// vLLM's `min_tokens`, or `max_tokens` with `ignore_eos`: the answer is at least this long.
    min_tokens: u32,
    stream: bool,
    include_usage: bool,
}

/// Parses the common request fields, checks the model name the way vLLM does and sends the
/// request to a pod serving that model.
fn common(body: &Bytes, a: &mut Admitted) -> Result<Common, Box<Response>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Box::new(bad_request(format!("request body is not valid JSON: {e}"))))?;
    if !v.is_object() {
        return Err(Box::new(bad_request("request body must be a JSON object")));
    }
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| Box::new(bad_request("`model` is required")))?
        .to_string();
    let serving: Vec<&Backend> = a
        .backends
        .iter()
        .filter(|b| b.model.as_deref().is_none_or(|m| m == model))
        .collect();
    if serving.is_empty() {
        return Err(Box::new(oai_error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            json!(404),
            format!("The model `{model}` does not exist."),
        )));
    }
    a.backend = serving[a.turn % serving.len()].pod.clone();
    let max = v
        .get("max_completion_tokens")
        .filter(|m| !m.is_null())
        .or_else(|| v.get("max_tokens").filter(|m| !m.is_null()));
    let max_tokens = match max {
        None => None,
        Some(m) => match m.as_u64() {
            Some(n) if n >= 1 => Some(n.min(65_536) as u32),
            _ => {
                return Err(Box::new(bad_request(
                    "max_tokens must be a positive integer",
                )))
            }
        },
    };
    let min_tokens = if v.get("ignore_eos").and_then(Value::as_bool) == Some(true) {
        max_tokens.unwrap_or(0)
    } else {
        v.get("min_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(65_536) as u32
    };
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    })
}

fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

async fn chat(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut a = match admit(&inner, "/v1/chat/completions", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    } = match common(&body, &mut a) {
        Ok(x) => x,
        Err(r) => return with_backend(*r, &a.backend),
    };
    let Some(messages) = v.get("messages").and_then(Value::as_array) else {
        return with_backend(bad_request("`messages` is required"), &a.backend);
    };
    if messages.is_empty() {
        return with_backend(bad_request("`messages` must not be empty"), &a.backend);
    }
    let mut prompt = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        prompt.push_str(role);
        prompt.push_str(": ");
        prompt.push_str(&content_text(m.get("content").unwrap_or(&Value::Null)));
        prompt.push('\n');
    }
    let prompt_tokens = count_tokens(&prompt) + 3 * messages.len() as u32;
    let gen = generate_at_least(&model, &prompt, max_tokens, min_tokens);
    let timing = inner.timing.read().expect("timing lock").clone();
    let tokens = crate::serving::chat_tokens(&prompt);
    let session = match serve(&timing, &mut a, &model, tokens, &gen) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.tokens.len(),
        "total_tokens": prompt_tokens as usize + gen.tokens.len(),
    });
    if stream {
        let base = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        let chunk = move |delta: Value, finish: Value| {
            let mut c = base.clone();
            c["choices"] =
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
            c
        };
        let mut events = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        for t in &gen.tokens {
            events.push(chunk(json!({"content": t}), Value::Null));
        }
        events.push(chunk(json!({}), json!(gen.finish_reason)));
        if include_usage {
            let mut u = chunk(json!({}), Value::Null);
            u["choices"] = json!([]);
            u["usage"] = usage;
            events.push(u);
        }
        let deadline = a.deadline(&timing);
        let answer = answer_stream(session, events, timing, 1);
        return with_backend(cut_at(answer, deadline), &a.backend);
    }
    let deadline = a.deadline(&timing);
    if !answer_within(deadline, answer_after(session, &timing, gen.tokens.len())).await {
        return with_backend(route_timed_out(), &a.backend);
    }
    with_backend(
        Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": gen.tokens.concat(), "tool_calls": []},
                "logprobs": null,
                "finish_reason": gen.finish_reason,
            }],
            "usage": usage,
        }))
        .into_response(),
        &a.backend,
    )
}

async fn completions(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut a = match admit(&inner, "/v1/completions", &headers).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let Common {
        body: v,
        model,
        max_tokens,
        min_tokens,
        stream,
        include_usage,
    } = match common(&body, &mut a) {
        Ok(x) => x,
        Err(r) => return with_backend(*r, &a.backend),
    };
    let prompt = match v.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| i.to_string())
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => return with_backend(bad_request("`prompt` is required"), &a.backend),
    };
    // vLLM's default for /v1/completions is 16 tokens, as in OpenAI's legacy API.
    let gen = generate_at_least(&model, &prompt, Some(max_tokens.unwrap_or(16)), min_tokens);
    let prompt_tokens = count_tokens(&prompt);
    let timing = inner.timing.read().expect("timing lock").clone();
    let tokens = crate::serving::tokenize(&prompt);
    let session = match serve(&timing, &mut a, &model, tokens, &gen) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let created = chrono::Utc::now().timestamp();
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.tokens.len(),
        "total_tokens": prompt_tokens as usize + gen.tokens.len(),
    });
    if stream {
        let base =
            json!({"id": id, "object": "text_completion", "created": created, "model": model});
        let chunk = move |text: &str, finish: Value| {
            let mut c = base.clone();
            c["choices"] =
                json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]);
            c
        };
        let mut events: Vec<Value> = gen.tokens.iter().map(|t| chunk(t, Value::Null)).collect();
        events.push(chunk("", json!(gen.finish_reason)));
        if include_usage {
            let mut u = chunk("", Value::Null);
            u["choices"] = json!([]);
            u["usage"] = usage;
            events.push(u);
        }
        let deadline = a.deadline(&timing);
        let answer = answer_stream(session, events, timing, 0);
        return with_backend(cut_at(answer, deadline), &a.backend);
    }
    let deadline = a.deadline(&timing);
    if !answer_within(deadline, answer_after(session, &timing, gen.tokens.len())).await {
        return with_backend(route_timed_out(), &a.backend);
    }
    with_backend(
        Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": gen.tokens.concat(), "logprobs": null, "finish_reason": gen.finish_reason}],
            "usage": usage,
        }))
        .into_response(),
        &a.backend,
    )
}

/// Hands the request to the serving model when it is on ([`crate::serving::start`]): the pod
/// its picker chose answers it. `Err`: the answer already (a request no replica could hold).
fn serve(
    timing: &ModelTiming,
    a: &mut Admitted,
    model: &str,
    tokens: Vec<u64>,
    gen: &Generation,
) -> Result<Option<crate::serving::Session>, Box<Response>> {
    match crate::serving::start(&timing.serving, &a.backends, model, a.turn, tokens, gen) {
        Some(Err(e)) => Err(Box::new(with_backend(bad_request(e), &a.backend))),
        Some(Ok(s)) => {
            a.backend = s.pod().to_string();
            Ok(Some(s))
        }
        None => Ok(None),
    }
}

/// Streams `events` at the serving model's pace, else after the fixed delays.
fn answer_stream(
    session: Option<crate::serving::Session>,
    events: Vec<Value>,
    timing: ModelTiming,
    preamble: usize,
) -> Response {
    match session {
        Some(s) => s.sse(events, preamble),
        None => sse(events, timing, preamble),
    }
}

/// Whether `answer` is done before the route's `deadline`.
async fn answer_within(
    deadline: Option<tokio::time::Instant>,
    answer: impl Future<Output = ()>,
) -> bool {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, answer).await.is_ok(),
        None => {
            answer.await;
            true
        }
    }
}

/// Envoy's answer when the route's timeout passes before the upstream's headers.
fn route_timed_out() -> Response {
    (StatusCode::GATEWAY_TIMEOUT, "upstream request timeout").into_response()
}

/// `resp` with its body cut at the route's `deadline`, as Envoy resets a stream whose timeout
/// passes after the headers went out: the client sees the body end in an error, not a clean end.
fn cut_at(resp: Response, deadline: Option<tokio::time::Instant>) -> Response {
    let Some(deadline) = deadline else {
        return resp;
    };
    let (parts, body) = resp.into_parts();
    let body = futures::stream::unfold(Some(body.into_data_stream()), move |state| async move {
        let mut data = state?;
        tokio::select! {
            next = data.next() => next.map(|r| (r.map_err(std::io::Error::other), Some(data))),
            () = tokio::time::sleep_until(deadline) => {
                Some((Err(std::io::Error::other("upstream request timeout")), None))
            }
        }
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// Waits until the whole answer is generated.
async fn answer_after(session: Option<crate::serving::Session>, t: &ModelTiming, tokens: usize) {
    match session {
        Some(s) => s.finish().await,
        None => sleep_for(t, tokens).await,
    }
}

async fn sleep_for(t: &ModelTiming, tokens: usize) {
    let total = t.ttft_ms + t.per_token_ms * tokens.saturating_sub(1) as u64;
    if total > 0 {
        tokio::time::sleep(Duration::from_millis(total)).await;
    }
}

/// Server-sent events: `data: {json}` per chunk, then `data: [DONE]`. The first `preamble`
/// events (the role announcement) go out at once; the first token waits for the TTFT, the rest
/// for the per-token delay.
fn sse(events: Vec<Value>, timing: ModelTiming, preamble: usize) -> Response {
    let stream = sse_stream(events, timing, preamble);
    Sse::new(stream).into_response()
}

fn sse_stream(
    events: Vec<Value>,
    timing: ModelTiming,
    preamble: usize,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let total = events.len();
    futures::stream::unfold(
        (events.into_iter(), 0usize, false),
        move |(mut it, i, done)| {
            let timing = timing.clone();
            async move {
                if done {
                    return None;
                }
                match it.next() {
                    Some(ev) => {
                        let wait = if i < preamble {
                            0
                        } else if i == preamble {
                            timing.ttft_ms
                        } else if i + 1 < total {
                            timing.per_token_ms
                        } else {
                            0
                        };
                        if wait > 0 {
                            tokio::time::sleep(Duration::from_millis(wait)).await;
                        }
                        Some((
                            Ok(Event::default().data(ev.to_string())),
                            (it, i + 1, false),
                        ))
                    }
                    None => Some((Ok(Event::default().data("[DONE]")), (it, i + 1, true))),
                }
            }
        },
    )
}

/// Whitespace-separated words: a stable stand-in for a tokenizer.
pub fn count_tokens(text: &str) -> u32 {
    text.split_whitespace().count() as u32
}

/// A deterministic completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Token texts; concatenated they form the completion.
    pub tokens: Vec<String>,
    /// `stop` when the "model" finished on its own, `length` when `max_tokens` cut it.
    pub finish_reason: &'static str,
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "answers",
    "with",
    "a",
    "simulated",
    "sentence",
    "about",
    "gpus",
    "and",
    "tokens",
    "streaming",
    "quickly",
    "from",
    "this",
    "region",
    "while",
    "prompts",
    "shape",
    "every",
    "reply",
    "deterministically",
    "so",
    "tests",
    "can",
    "compare",
    "outputs",
    "across",
    "runs",
    "inference",
    "gateway",
    "routes",
    "requests",
    "to",
    "ready",
    "pods",
    "behind",
    "an",
    "pool",
    "of",
    "accelerators",
    "serving",
    "language",
    "kernels",
    "cache",
    "prefix",
    "memory",
    "batch",
    "latency",
    "throughput",
    "cluster",
    "node",
    "load",
    "balancer",
    "endpoint",
    "secure",
    "private",
    "public",
    "control",
    "plane",
    "reconciles",
    "desired",
    "state",
    "today",
];

/// Output derived only from (model, prompt, max_tokens): same input, same output.
pub fn generate(model: &str, prompt: &str, max_tokens: Option<u32>) -> Generation {
    generate_at_least(model, prompt, max_tokens, 0)
}

/// As [`generate`], continuing the same word sequence up to `min_tokens` (vLLM's `min_tokens`,
/// or `max_tokens` with `ignore_eos`) when the answer would stop earlier.
pub fn generate_at_least(
    model: &str,
    prompt: &str,
    max_tokens: Option<u32>,
    min_tokens: u32,
) -> Generation {
    let digest = Sha256::digest(format!("{model}\n{prompt}").as_bytes());
    let mut seed = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    let natural = 8 + (seed % 25) as u32;
    let n = max_tokens.map_or(natural.max(min_tokens), |m| m.min(natural.max(min_tokens)));
    let mut tokens = Vec::with_capacity(n as usize);
    for i in 0..n {
        // splitmix64: cheap, stable across platforms and versions.
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let w = WORDS[(z % WORDS.len() as u64) as usize];
        tokens.push(if i == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        });
    }
    Generation {
        tokens,
        // Cut by max_tokens, or forced on to it.
        finish_reason: if n < natural || (n > natural && max_tokens == Some(n)) {
            "length"
        } else {
            "stop"
        },
    }
}

/// The lowercase hex SHA-256 of a token, as stored in the access-token Secret.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_bounded() {
        let a = generate("m", "hello world", None);
        assert_eq!(a, generate("m", "hello world", None));
        assert_ne!(a, generate("m", "hello there", None));
        assert_eq!(a.finish_reason, "stop");
        let b = generate("m", "hello world", Some(3));
        assert_eq!(b.tokens.len(), 3);
        assert_eq!(b.finish_reason, "length");
        assert_eq!(b.tokens[..], a.tokens[..3]);
    }

    #[test]
    fn path_prefix_is_element_wise() {
        assert!(path_prefix_matches("/", "/v1/models"));
        assert!(path_prefix_matches("/v1", "/v1/models"));
        assert!(path_prefix_matches("/v1/", "/v1/models"));
        assert!(!path_prefix_matches("/v1", "/v10/models"));
        assert!(!path_prefix_matches("/v2", "/v1/models"));
    }
}
