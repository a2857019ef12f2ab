//! What a failed Kubernetes API call is ([`KubeError`]), read from the `Status` the server
//! answered or from what kube reported, and its class ([`Classify`]), decided here once.

use std::time::Duration;

use common::errors::{Classify, ErrorClass};

/// A failed Kubernetes API call.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The API server answered with a failure `Status`.
    #[error("Kubernetes API {code} {reason}: {message}")]
    Api {
        code: u16,
        /// `NotFound`, `Conflict`, `Invalid`, `Forbidden`, `TooManyRequests`, ...
        reason: String,
        message: String,
        /// `details.retryAfterSeconds`, when the server sent it.
        retry_after: Option<Duration>,
    },
    /// The request did not complete (connection refused or reset, timeout).
    #[error("Kubernetes API unreachable: {0}")]
    Transport(#[source] kube::Error),
    /// Anything else kube reported (undecodable response, auth plugin failure, ...).
    #[error("Kubernetes client error: {0}")]
    Client(#[source] kube::Error),
    /// The kubeconfig could not be used.
    #[error("kubeconfig: {0}")]
    Config(String),
    /// A kind missing from the static table.
    #[error("unsupported kind {kind} in {api_version}")]
    UnknownKind { api_version: String, kind: String },
    /// A manifest without what the call needs (apiVersion, kind, metadata.name, a namespace for
    /// a namespaced kind).
    #[error("invalid object: {0}")]
    InvalidObject(String),
}

impl Classify for KubeError {
    /// Decided here, from the `Status` the server answered, once: the worker acts on the class
    /// and never decides again whether a code passes.
    fn class(&self) -> ErrorClass {
        match self {
            KubeError::Api {
                code, retry_after, ..
            } => match code {
                // 409 is a write that met another (a stale resourceVersion, an object replaced
                // meanwhile): the API conventions say retry, and a forced apply or a delete
                // sent again does not conflict with itself.
                429 | 409 | 500.. => ErrorClass::Transient {
                    retry_after: *retry_after,
                },
                404 => ErrorClass::NotFound,
                401 => ErrorClass::Unauthorized,
                // Our credentials are the cluster's admin's, so what forbids a request is not
                // who sends it but the state of the cluster: most often a namespace that is
                // terminating and takes no new objects until it is gone (admission's 403).
                403 => ErrorClass::Conflict,
                400..=499 => ErrorClass::Refused,
                _ => ErrorClass::Permanent,
            },
            KubeError::Transport(_) => ErrorClass::TRANSIENT,
            KubeError::Client(_)
            | KubeError::Config(_)
            | KubeError::UnknownKind { .. }
            | KubeError::InvalidObject(_) => ErrorClass::Permanent,
        }
    }
}

impl KubeError {
    pub fn is_not_found(&self) -> bool {
        self.class() == ErrorClass::NotFound
    }

    /// The HTTP status of an API error.
    pub fn code(&self) -> Option<u16> {
        match self {
            KubeError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The `Status.reason` of an API error.
    pub fn reason(&self) -> Option<&str> {
        match self {
            KubeError::Api { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// The `Status.message` of an API error: what the server says is wrong.
    pub fn message(&self) -> Option<&str> {
        match self {
            KubeError::Api { message, .. } => Some(message),
            _ => None,
        }
    }
}

impl From<kube::Error> for KubeError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => KubeError::Api {
                code: s.code,
                reason: s.reason.clone(),
                message: s.message.clone(),
                retry_after: s
                    .details
                    .as_ref()
                    .map(|d| d.retry_after_seconds)
                    .filter(|s| *s > 0)
                    .map(|s| Duration::from_secs(s.into())),
            },
            e @ (kube::Error::HyperError(_)
            | kube::Error::Service(_)
            | kube::Error::ReadEvents(_)) => KubeError::Transport(e),
            e => KubeError::Client(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_classes() {
        let api = |code: u16| KubeError::Api {
            code,
            reason: String::new(),
            message: String::new(),
            retry_after: None,
        };
        for code in [409, 429, 500, 503] {
            assert_eq!(api(code).class(), ErrorClass::TRANSIENT, "{code}");
        }
        let slow_down = KubeError::Api {
            code: 429,
            reason: "TooManyRequests".into(),
            message: String::new(),
            retry_after: Some(Duration::from_secs(4)),
        };
        assert_eq!(
            slow_down.class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(4))
            }
        );
        assert_eq!(api(404).class(), ErrorClass::NotFound);
        assert!(api(404).is_not_found() && !api(410).is_not_found());
        assert_eq!(api(401).class(), ErrorClass::Unauthorized);
        assert_eq!(api(403).class(), ErrorClass::Conflict);
        for code in [400, 410, 415, 422] {
            assert_eq!(api(code).class(), ErrorClass::Refused, "{code}");
        }
        assert_eq!(api(302).class(), ErrorClass::Permanent);
        for local in [
            KubeError::InvalidObject("x".into()),
            KubeError::Config("x".into()),
            KubeError::UnknownKind {
                api_version: "v1".into(),
                kind: "Thing".into(),
            },
        ] {
            assert_eq!(local.class(), ErrorClass::Permanent, "{local}");
        }
    }

    #[test]
    fn a_status_keeps_its_retry_hint() {
        let status = |code: u16, after: u32| {
            let mut s = kube::core::Status::failure("m", "TooManyRequests").with_code(code);
            s.details = Some(kube::core::response::StatusDetails {
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                causes: Vec::new(),
                retry_after_seconds: after,
            });
            KubeError::from(kube::Error::Api(Box::new(s)))
        };
        assert_eq!(
            status(429, 2).class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        // Zero seconds is the field's absence.
        assert_eq!(status(429, 0).class(), ErrorClass::TRANSIENT);
        assert_eq!(status(403, 2).class(), ErrorClass::Conflict);
    }
}
