//! Every response carries `x-request-id`: the caller's own when it sent a sane one, else a fresh
//! UUID. Handlers read it from the request extensions to put it in error bodies and logs.
//!
//! The same layer opens the request's span: a child of the caller's trace when the request
//! carries `traceparent`, named after the service and the matched route.

use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";

#[derive(Clone, Debug)]
pub struct RequestId(pub String);

tokio::task_local! {
    /// The id of the request being served, so that error bodies can quote it without threading
    /// it through every function.
    static CURRENT: String;
}

/// The current request's id, or a fresh one outside a request.
pub fn current() -> String {
    CURRENT
        .try_with(Clone::clone)
        .unwrap_or_else(|_| uuid::Uuid::new_v4().to_string())
}

/// Use as `axum::middleware::from_fn_with_state("central", layer)`.
pub async fn layer(State(service): State<&'static str>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    req.extensions_mut().insert(RequestId(id.clone()));
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| req.uri().path().to_owned());
    let span = tracing::info_span!(
        "request",
        otel.name = %format_args!("{service} {} {route}", req.method()),
        otel.kind = "server",
        service,
        request_id = %id,
        method = %req.method(),
        path = %req.uri().path(),
        status = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    crate::telemetry::continue_from(&span, req.headers());
    let mut response = CURRENT
        .scope(id.clone(), next.run(req).instrument(span.clone()))
        .await;
    span.record("status", response.status().as_u16());
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, value);
    }
    response
}
