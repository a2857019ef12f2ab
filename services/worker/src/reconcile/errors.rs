//! Why a pass failed, and how each dependency's errors count.

use cloud_clients::{DoError, KubeError};
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
        if e.is_capacity() {
            return ReconcileError::permanent(
                "CapacityExhausted",
                format!(
                    "The region has no capacity for the requested GPUs: {}",
                    e.message().unwrap_or("insufficient capacity")
                ),
            );
        }
        if e.is_transient() || e.is_not_found() || e.is_already_exists() {
            // A 404 or 409 means the world moved since we looked: look again.
            return ReconcileError::Transient(e.to_string());
        }
        match e.status() {
            Some(401) | Some(403) => ReconcileError::Transient(e.to_string()),
            Some(_) => ReconcileError::permanent(
                "CloudRejected",
                format!(
                    "DigitalOcean rejected a request: {}",
                    e.message().unwrap_or("unknown error")
                ),
            ),
            None => ReconcileError::Transient(e.to_string()),
        }
    }
}

impl From<KubeError> for ReconcileError {
    fn from(e: KubeError) -> Self {
        match &e {
            e if e.is_transient() || e.is_not_found() || e.is_forbidden() => {
                ReconcileError::Transient(e.to_string())
            }
            e if e.is_unauthorized() => ReconcileError::CredentialsRefused(e.to_string()),
            KubeError::Api { code, message, .. } if (400..500).contains(code) => {
                ReconcileError::permanent(
                    "KubernetesRejected",
                    format!("The cluster rejected an object: {message}"),
                )
            }
            _ => ReconcileError::Transient(e.to_string()),
        }
    }
}

impl From<StoreError> for ReconcileError {
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
