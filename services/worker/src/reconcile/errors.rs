//! Why a pass failed, and how each dependency's errors count: the worker's one reading of error
//! classes. Whether a failure passes is the clients' and stores' to say (their `class()`); here
//! each class becomes what a pass does about it, per dependency.

use cloud_clients::{DoError, KubeError};
use common::errors::{Classify, ErrorClass};
use region_store::StoreError;

use crate::plan;

/// `error` until its spec changes.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("transient: {0}")]
    Transient(String),
    /// A cluster refused the worker's credentials for it (401): they expired or were revoked.
    /// Not an ordinary transient failure: the reconciler fetches fresh credentials and runs the
    /// pass again at once, and only when those are refused too does the queue retry it, as it
    /// retries a transient failure.
    #[error("cluster credentials refused: {0}")]
    CredentialsRefused(String),
    /// The pass's lease on the DI is no longer held (it ran out, or another worker took the
    /// DI): the pass stops and writes nothing more; the lease's holder carries on.
    #[error("the lease was lost")]
    LeaseLost,
    #[error("{reason}: {message}")]
    Permanent {
        reason: String,
        message: String,
        /// The spec version the pass was rolling out, when it was about one (see
        /// [`Store::error_set`]).
        version: Option<i32>,
    },
}

impl ReconcileError {
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ReconcileError::Transient(_) | ReconcileError::CredentialsRefused(_)
        )
    }

    pub(super) fn permanent(reason: &str, message: impl Into<String>) -> Self {
        ReconcileError::Permanent {
            reason: reason.to_string(),
            message: message.into(),
            version: None,
        }
    }

    /// A permanent failure while rolling out spec `version`.
    pub(super) fn during(self, version: Option<i32>) -> Self {
        match self {
            ReconcileError::Permanent {
                reason, message, ..
            } => ReconcileError::Permanent {
                reason,
                message,
                version,
            },
            e => e,
        }
    }
}

impl From<DoError> for ReconcileError {
    fn from(e: DoError) -> Self {
        // A refusal with a name of its own: the customer is told what ran out.
        if e.is_capacity() {
            return ReconcileError::permanent(
                "CapacityExhausted",
                format!(
                    "The region has no capacity for the requested GPUs: {}",
                    e.message().unwrap_or("insufficient capacity")
                ),
            );
        }
        match e.class() {
            // A 404 or 409 means the world moved since we looked: look again.
            ErrorClass::Transient { .. } | ErrorClass::NotFound | ErrorClass::Conflict => {
                ReconcileError::Transient(e.to_string())
            }
            // The platform's token was revoked or rotated: the operator's to fix, and nothing
            // the DI asks for is wrong, so it does not go to `error` meanwhile.
            ErrorClass::Unauthorized => ReconcileError::Transient(e.to_string()),
            // Refused, or answered in a way nobody can use (a success without the documented
            // body): the same spec would meet the same answer.
            ErrorClass::Refused | ErrorClass::Permanent => ReconcileError::permanent(
                "CloudRejected",
                format!(
                    "DigitalOcean rejected a request: {}",
                    e.message().unwrap_or("unknown error")
                ),
            ),
        }
    }
}

impl From<KubeError> for ReconcileError {
    fn from(e: KubeError) -> Self {
        match e.class() {
            // Including a 403 (a `Conflict`): a namespace that is terminating refuses creates
            // until it is gone, then takes them again.
            ErrorClass::Transient { .. } | ErrorClass::NotFound | ErrorClass::Conflict => {
                ReconcileError::Transient(e.to_string())
            }
            ErrorClass::Unauthorized => ReconcileError::CredentialsRefused(e.to_string()),
            ErrorClass::Refused => ReconcileError::permanent(
                "KubernetesRejected",
                format!(
                    "The cluster rejected an object: {}",
                    e.message().unwrap_or_default()
                ),
            ),
            // Failures of our own side (a kubeconfig, a kind, an object we could not send, an
            // answer kube could not read): not the spec's fault, so the DI is not failed for
            // them; the pass runs again.
            ErrorClass::Permanent => ReconcileError::Transient(e.to_string()),
        }
    }
}

impl From<StoreError> for ReconcileError {
    /// The worker's own database failing, whatever its class, is a pass to run again; only a
    /// lost lease stops the pass for good (another worker has the DI).
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::LeaseLost => ReconcileError::LeaseLost,
            e => ReconcileError::Transient(format!("store: {e}")),
        }
    }
}

impl From<plan::PlanError> for ReconcileError {
    fn from(e: plan::PlanError) -> Self {
        ReconcileError::permanent("InvalidSpec", e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(e: &ReconcileError) -> &str {
        match e {
            ReconcileError::Transient(_) => "transient",
            ReconcileError::CredentialsRefused(_) => "credentials_refused",
            ReconcileError::LeaseLost => "lease_lost",
            ReconcileError::Permanent { reason, .. } => reason,
        }
    }

    fn cloud(status: u16, message: &str) -> DoError {
        let (id, message, request_id) = ("x".to_string(), message.to_string(), None);
        match status {
            404 => DoError::NotFound {
                message,
                request_id,
            },
            429 => DoError::RateLimited {
                message,
                request_id,
                retry_after: None,
            },
            500.. => DoError::Server {
                status,
                id,
                message,
                request_id,
            },
            _ => DoError::Api {
                status,
                id,
                message,
                request_id,
            },
        }
    }

    fn kube(code: u16) -> KubeError {
        KubeError::Api {
            code,
            reason: "Reason".into(),
            message: "spec.x: Invalid value".into(),
            retry_after: None,
        }
    }

    #[test]
    fn digitalocean_errors_keep_their_answers() {
        let capacity = ReconcileError::from(cloud(422, "insufficient capacity for gpu-h100x8"));
        assert_eq!(reason(&capacity), "CapacityExhausted");
        assert!(capacity
            .to_string()
            .contains("insufficient capacity for gpu-h100x8"));
        for (status, message) in [
            (429, ""),
            (500, ""),
            (503, ""),
            (404, ""),
            (409, ""),
            (422, "a cluster with this name already exists"),
            (401, ""),
            (403, ""),
        ] {
            let e = ReconcileError::from(cloud(status, message));
            assert_eq!(reason(&e), "transient", "{status} {message}");
        }
        for status in [400, 405, 422] {
            let e = ReconcileError::from(cloud(status, "name is invalid"));
            assert_eq!(reason(&e), "CloudRejected", "{status}");
            assert!(e.to_string().contains("name is invalid"), "{e}");
        }
        // A success whose body is not the documented one is rejected, as before.
        let undecodable = DoError::Decode {
            status: 200,
            detail: "missing \"cluster\"".into(),
        };
        assert_eq!(reason(&ReconcileError::from(undecodable)), "CloudRejected");
    }

    /// The one answer that moved: a DigitalOcean request that could not even be made (a bad
    /// base URL or token, which the client refuses when it is built, before any pass) was
    /// retried for its lack of a status; now it fails as an unreadable answer always did.
    #[test]
    fn a_cloud_request_that_cannot_be_made_is_rejected() {
        let e = ReconcileError::from(DoError::Config(
            "the token contains invalid characters".into(),
        ));
        assert_eq!(reason(&e), "CloudRejected");
    }

    #[test]
    fn kubernetes_errors_keep_their_answers() {
        for code in [409, 429, 500, 503, 404, 403] {
            assert_eq!(reason(&kube(code).into()), "transient", "{code}");
        }
        assert_eq!(reason(&kube(401).into()), "credentials_refused");
        for code in [400, 410, 422] {
            let e = ReconcileError::from(kube(code));
            assert_eq!(reason(&e), "KubernetesRejected", "{code}");
            assert!(e.to_string().contains("spec.x: Invalid value"), "{e}");
        }
        for local in [
            KubeError::Config("x".into()),
            KubeError::InvalidObject("x".into()),
            KubeError::UnknownKind {
                api_version: "v1".into(),
                kind: "Thing".into(),
            },
            kube(302),
        ] {
            assert_eq!(reason(&local.into()), "transient");
        }
    }

    #[test]
    fn store_errors_keep_their_answers() {
        assert_eq!(reason(&StoreError::LeaseLost.into()), "lease_lost");
        for e in [
            StoreError::NotFound,
            StoreError::Conflict("x".into()),
            StoreError::Unprocessable("x".into()),
            StoreError::Seal,
            StoreError::Unavailable(region_store::sqlx::Error::PoolTimedOut),
            StoreError::Database(region_store::sqlx::Error::RowNotFound),
        ] {
            assert_eq!(reason(&e.into()), "transient");
        }
    }
}
