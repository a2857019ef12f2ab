//! The public API's one error type and its one `IntoResponse`: DigitalOcean's
//! `{id, message, request_id}` shape. Internal detail (`Internal`) is logged with the request id
//! and never returned. A dependency that is down (a region, central's own database) is `503` with
//! `Retry-After`, never `500`: clients and Terraform retry the one and report the other as a bug.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use api_types::public::ErrorBody;
use central_store::StoreError;

/// What a `503` asks the client to wait before it retries, seconds.
pub const RETRY_AFTER_SECS: u64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("unprocessable: {0}")]
    Unprocessable(String),
    #[error("unauthorized")]
    Unauthorized,
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("payload too large")]
    PayloadTooLarge,
    #[error("too many requests")]
    TooManyRequests { retry_after_secs: u64 },
    #[error("too many failed authentications")]
    TooManyFailedAuthentications { retry_after_secs: u64 },
    #[error("unavailable")]
    ServiceUnavailable { retry_after_secs: u64 },
    #[error("internal: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn internal(detail: impl std::fmt::Display) -> ApiError {
        ApiError::Internal(detail.to_string())
    }

    /// Status, error id and customer-facing message.
    pub fn parts(&self) -> (StatusCode, &'static str, String) {
        match self {
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, "bad_request", m.clone()),
            ApiError::Unprocessable(m) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "unprocessable_entity",
                m.clone(),
            ),
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Unable to authenticate you.".into(),
            ),
            ApiError::Forbidden(m) => (StatusCode::FORBIDDEN, "forbidden", m.clone()),
            ApiError::NotFound => (
                StatusCode::NOT_FOUND,
                "not_found",
                "The resource you were accessing could not be found.".into(),
            ),
            ApiError::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "This method is not allowed on this resource.".into(),
            ),
            ApiError::Conflict(m) => (StatusCode::CONFLICT, "conflict", m.clone()),
            ApiError::PayloadTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_entity_too_large",
                format!(
                    "The request body exceeds {} bytes.",
                    crate::body::MAX_BODY_BYTES
                ),
            ),
            ApiError::TooManyRequests { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "API rate limit exceeded.".into(),
            ),
            ApiError::TooManyFailedAuthentications { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "Too many failed authentications from your address; retry later.".into(),
            ),
            ApiError::ServiceUnavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "The service is temporarily unavailable. Please retry later.".into(),
            ),
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "Unexpected server-side error".into(),
            ),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            StoreError::NameTaken => ApiError::Conflict(
                "A dedicated inference with this name already exists in your team.".into(),
            ),
            StoreError::NotFound => ApiError::NotFound,
            StoreError::Unavailable(e) => {
                tracing::warn!(error = %e, "central's database is unavailable");
                ApiError::ServiceUnavailable {
                    retry_after_secs: RETRY_AFTER_SECS,
                }
            }
            StoreError::Database(e) => ApiError::internal(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let request_id = common::request_id::current();
        if let ApiError::Internal(detail) = &self {
            tracing::error!(%request_id, %detail, "request failed");
        }
        let (status, id, message) = self.parts();
        let mut response = (
            status,
            Json(ErrorBody {
                id: id.into(),
                message,
                request_id,
            }),
        )
            .into_response();
        let retry_after = match self {
            ApiError::TooManyRequests { retry_after_secs }
            | ApiError::TooManyFailedAuthentications { retry_after_secs }
            | ApiError::ServiceUnavailable { retry_after_secs } => Some(retry_after_secs),
            _ => None,
        };
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from(secs));
        }
        response
    }
}
