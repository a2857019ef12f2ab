//! The address the kubeconfig points at: the cluster's site on the region's front, serving
//! HTTPS with a certificate from the cluster's CA. It checks the bearer token against the
//! cluster's live credentials (see [`super::Tokens`]), counts the call, injects the `kube`
//! faults and hands the request to the cluster's simulated API server in process.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use region_sim_base::faults::{Api, CallVerdict, Faults, Verdict};
use region_sim_base::front::Site;
use serde_json::json;
use tokio::sync::watch;

use super::{kube, Tokens};
use crate::Stats;

/// How long a connection may stay idle between requests: the Kubernetes API server's
/// `IdleTimeout`.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

struct Proxy {
    kube: kube::Handle,
    tokens: Arc<Tokens>,
    faults: Arc<Faults>,
    stats: Arc<Stats>,
}

/// A Kubernetes `Status` error, which is what clients parse on failures.
fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        axum::Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        })),
    )
        .into_response()
}

async fn forward(State(p): State<Arc<Proxy>>, mut req: Request) -> Response {
    let authorized = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| p.tokens.valid(t));
    // An expired token is refused exactly like an unknown one, as the real API server does.
    if !authorized {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    }
    // Counted once authenticated, faulted or not (the client did send it).
    let kind = p.stats.record_kube(
        req.method(),
        req.uri().path(),
        req.uri().query().unwrap_or(""),
        req.headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
    );
    let is_write = crate::is_mutating(req.method());
    let lose_response = match p.faults.apply_call(Api::Kube, is_write, &kind).await {
        CallVerdict::Now(Verdict::Pass) => false,
        CallVerdict::LoseResponse => true,
        CallVerdict::Now(Verdict::Error) => {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "Internal error occurred: injected fault",
            )
        }
        CallVerdict::Now(Verdict::RateLimited(secs)) => {
            let mut r = status(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                "Too many requests, please try again later.",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return r;
        }
    };
    // The API server behind the front authenticates nothing itself.
    req.headers_mut().remove(header::AUTHORIZATION);
    let resp = p.kube.call(req).await;
    if lose_response {
        // The API server has answered, so the call took effect; the client never learns
        // how. The body is not read: a watch's would never end.
        return status(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            "Timeout: the server did not answer in time",
        );
    }
    // Streamed as the API server produces it, so that watches flow through as they happen.
    resp
}

/// The cluster API's site: HTTPS with `tls`, closed (open watches too, as a deleted
/// cluster's would be) when `stop` changes.
pub fn site(
    kube: kube::Handle,
    tls: Arc<rustls::ServerConfig>,
    tokens: Arc<Tokens>,
    faults: Arc<Faults>,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) -> Site {
    let app = Router::new().fallback(forward).with_state(Arc::new(Proxy {
        kube,
        tokens,
        faults,
        stats,
    }));
    Site {
        tls: Arc::new(move || Some(tls.clone())),
        app,
        stop,
        idle_timeout: IDLE_TIMEOUT,
    }
}
