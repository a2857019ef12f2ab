//! The gateway's checks before a request is routed, in a gateway's order ([`admit`]): faults,
//! route match, authentication, a ready backend, and, when the pool's picker runs with flow
//! control and no backend is ready, holding the request ([`hold`]) and counting it for its pool
//! ([`held_requests`]). What the gateway decides, apart from what the model answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use region_sim_base::faults::{Api, Verdict};
use serde_json::json;

use super::endpoint::Inner;
use super::{oai_error, Backend, ModelTiming, PoolRoute, Route};
use crate::auth::Authentication;

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

/// What the gateway decided for a request that passed its checks.
pub(super) struct Admitted {
    /// The pod the request goes to (re-chosen among the pods serving the request's model once
    /// its body names one).
    pub(super) backend: String,
    pub(super) backends: Vec<Backend>,
    /// This request's turn in the round robin (one per request, whichever pods it may use).
    pub(super) turn: usize,
    /// When the request was routed (after any wait in the picker's queue, which Envoy's route
    /// timer does not count).
    routed_at: tokio::time::Instant,
}

impl Admitted {
    /// When the route's timeout cuts the answer of the chosen pod: its rule's timeout in the
    /// time the model runs on (simulated seconds when the serving model is on).
    pub(super) fn deadline(&self, timing: &ModelTiming) -> Option<tokio::time::Instant> {
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
pub(super) async fn admit(
    inner: &Inner,
    path: &str,
    headers: &HeaderMap,
) -> Result<Admitted, Response> {
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
// The refusal is the answer the caller relays with `?`: boxing it would only add an allocation
// per refused request.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_prefix_is_element_wise() {
        assert!(path_prefix_matches("/", "/v1/models"));
        assert!(path_prefix_matches("/v1", "/v1/models"));
        assert!(path_prefix_matches("/v1/", "/v1/models"));
        assert!(!path_prefix_matches("/v1", "/v10/models"));
        assert!(!path_prefix_matches("/v2", "/v1/models"));
    }
}
