//! Production clients for the clouds the control plane drives: DigitalOcean's public API (VPCs,
//! DOKS clusters with their kubeconfigs and expiring credentials, node pools, load balancers),
//! the Kubernetes API servers of those clusters (server-side apply, get, list and delete of the
//! kinds we render; a client notes when its credentials are refused), and the Hugging Face Hub
//! (whose a customer's token is, a model repository's info and `config.json`, and whether the
//! token may read a gated or private one; see [`hugging_face`]). This crate
//! owns transport concerns only: authentication, timeouts, typed request and response shapes,
//! classifying errors (each error's `common::errors::Classify::class`, decided here and nowhere
//! else), retrying transient ones with jittered backoff,
//! and counting the writes it sends and every call it makes (in the process-wide Prometheus
//! registry of `common::metrics`, see [`metrics`]). It knows nothing of dedicated inferences, databases or
//! planning, and it must never log a credential.

pub mod digitalocean;
pub mod hugging_face;
pub mod kubernetes;
pub mod metrics;
pub mod retry;

pub use digitalocean::{DoClient, DoClientOptions, DoError};
pub use hugging_face::{HubClient, HubClientOptions, HubError};
pub use kubernetes::{
    Applied, Before, Deleted, KubeClient, KubeClientOptions, KubeError, WatchEvent,
};
pub use retry::RetryConfig;
