//! The public API's one error type and its one `IntoResponse`: DigitalOcean's
//! `{id, message, request_id}` shape. Internal detail (`Internal`) is logged with the request id
//! and never returned. A dependency that is down (a region, central's own database) is `503` with
//! `Retry-After`, never `500`: clients and Terraform retry the one and report the other as a bug.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use api_types::public::ErrorBody;
use central_store::StoreError;
use common::errors::{Classify, ErrorClass};

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

    /// The public answer to a dependency's failure (central's database, a region) of `class`:
    /// the one place central turns classes into answers. `message` is what a conflict or a
    /// refusal tells the customer; `detail` is what the log says of anything unexpected.
    pub fn of_class(
        class: ErrorClass,
        message: impl Into<String>,
        detail: impl std::fmt::Display,
    ) -> ApiError {
        match class {
            // Nothing the customer asked is wrong and the retry they make works once the
            // dependency is back; a hint of when travels on.
            ErrorClass::Transient { retry_after } => ApiError::ServiceUnavailable {
                retry_after_secs: retry_after
                    .map_or(RETRY_AFTER_SECS, |d| d.as_secs_f64().ceil().max(1.0) as u64),
            },
            // Central's own credentials refused (a region's shared secret rotated on one side
            // only): likewise nothing changed, and the retry works once the operator mends it.
            ErrorClass::Unauthorized => ApiError::ServiceUnavailable {
                retry_after_secs: RETRY_AFTER_SECS,
            },
            ErrorClass::NotFound => ApiError::NotFound,
            ErrorClass::Conflict => ApiError::Conflict(message.into()),
            ErrorClass::Refused => ApiError::Unprocessable(message.into()),
            ErrorClass::Permanent => ApiError::internal(detail),
        }
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
        let class = e.class();
        if class.is_transient() {
            tracing::warn!(error = %e, "central's database is unavailable");
        }
        let message = match e {
            StoreError::NameTaken => {
                "A dedicated inference with this name already exists in your team."
            }
            _ => "",
        };
        ApiError::of_class(class, message, e)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn store_errors_keep_their_answers() {
        use central_store::sqlx;
        assert!(matches!(
            ApiError::from(StoreError::NameTaken),
            ApiError::Conflict(m) if m == "A dedicated inference with this name already exists in your team."
        ));
        assert!(matches!(
            ApiError::from(StoreError::NotFound),
            ApiError::NotFound
        ));
        assert!(matches!(
            ApiError::from(StoreError::Unavailable(sqlx::Error::PoolTimedOut)),
            ApiError::ServiceUnavailable {
                retry_after_secs: RETRY_AFTER_SECS
            }
        ));
        assert!(matches!(
            ApiError::from(StoreError::Database(sqlx::Error::RowNotFound)),
            ApiError::Internal(_)
        ));
    }

    #[test]
    fn a_transient_failure_passes_its_wait_on() {
        let after =
            |retry_after| match ApiError::of_class(ErrorClass::Transient { retry_after }, "", "") {
                ApiError::ServiceUnavailable { retry_after_secs } => retry_after_secs,
                other => panic!("{other:?}"),
            };
        assert_eq!(after(None), RETRY_AFTER_SECS);
        assert_eq!(after(Some(Duration::from_millis(1500))), 2);
        assert_eq!(after(Some(Duration::ZERO)), 1);
        assert!(matches!(
            ApiError::of_class(ErrorClass::Unauthorized, "", ""),
            ApiError::ServiceUnavailable {
                retry_after_secs: RETRY_AFTER_SECS
            }
        ));
    }
}
