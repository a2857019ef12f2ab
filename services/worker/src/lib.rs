//! The reconcile worker of a region: it claims dedicated inferences from the regional store under
//! leases ([`queue`]), reconciles each one against DigitalOcean and its VPC cluster's Kubernetes
//! API ([`reconcile`]) with a client per cluster that it keeps and renews before the cluster's
//! credentials expire ([`cluster_clients`]), keeps per cluster the watches that its resyncs read
//! instead of listing and that wake a DI whose objects change behind its back ([`watch_cache`]),
//! scales deployments that declare `autoscaling` on what their model servers and endpoint picker
//! report ([`scaling`], deciding with [`plan::autoscale`]), and runs N such passes at once
//! ([`runtime`]), serving Prometheus metrics ([`metrics`]). What to realise is decided by the
//! `worker-plan` crate (re-exported as [`plan`]): pure functions from a DI's desired spec and what
//! was observed to the node pools, Kubernetes objects, TLS certificate, endpoints and status, in a
//! crate that cannot do I/O. The worker holds no SQL (the store crate does) and never logs a
//! secret.

pub mod cluster_clients;
pub mod metrics;
pub mod queue;
pub mod reconcile;
pub mod runtime;
pub mod scaling;
pub mod watch_cache;

/// The worker's decisions, in a crate of their own that cannot do I/O.
pub use worker_plan as plan;
