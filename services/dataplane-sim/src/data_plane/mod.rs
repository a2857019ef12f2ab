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
//!
//! Split by concern: what an endpoint is told (`config`: [`EndpointConfig`], [`Route`],
//! [`Backend`]); the HTTPS server at the load balancer's address (`endpoint`: [`Endpoint`]); the
//! gateway's checks before a request is routed, holding it while the pool is empty
//! (`admission`); the OpenAI API it answers (`openai`); how an answer is paced and cut at the
//! route's timeout (`pacing`); and the fake model's deterministic text (`generation`).
//!
//! [`Front`]: region_sim_base::front::Front

mod admission;
mod config;
mod endpoint;
mod generation;
mod openai;
mod pacing;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub use admission::{held_requests, DROPPED_REASON};
pub use config::{
    Backend, EndpointConfig, ModelTiming, PoolRoute, Route, ROUTE_IDLE_FLOOR, ROUTE_TIMEOUT,
    STREAM_IDLE_TIMEOUT,
};
pub use endpoint::{Endpoint, IDLE_TIMEOUT};
pub use generation::{count_tokens, generate, generate_at_least, token_hash, Generation};

/// An error in OpenAI's shape.
fn oai_error(status: StatusCode, kind: &str, code: Value, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}})),
    )
        .into_response()
}
