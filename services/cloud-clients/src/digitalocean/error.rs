//! What a failed DigitalOcean API call is ([`DoError`]), read from the answer's status, headers
//! and error body, and its class ([`Classify`]), decided here once.

use std::time::Duration;

use reqwest::header::{HeaderMap, RETRY_AFTER};
use reqwest::StatusCode;
use serde::Deserialize;

use common::errors::{Classify, ErrorClass};

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

pub(super) fn error_from_response(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> DoError {
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

#[cfg(test)]
mod tests {
    use super::*;

    use reqwest::header::HeaderValue;

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
}
