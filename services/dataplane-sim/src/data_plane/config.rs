//! What an endpoint is told: the fake model's timing ([`ModelTiming`]), where the gateway's
//! route leads ([`Route`], [`PoolRoute`], [`Backend`]) with Envoy's timeouts, and the whole
//! [`EndpointConfig`] that `routing` derives from the cluster's objects. Plain data, apart from
//! the server that acts on it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::Authentication;

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
    /// A stable key (the pool's UID): held requests are counted under it
    /// ([`held_requests`](super::held_requests)).
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
