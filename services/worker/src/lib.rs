//! The reconcile worker of a region: it claims dedicated inferences from the regional store under
//! leases ([`queue`]), reconciles each one against DigitalOcean and its VPC cluster's Kubernetes
//! API ([`reconcile`]) with a client per cluster that it keeps and renews before the cluster's
//! credentials expire ([`cluster_clients`]), scales deployments that declare `autoscaling` on
//! what their model servers and endpoint picker report ([`scaling`], deciding with
//! [`plan::autoscale`]), and runs N such passes at once ([`runtime`]),
//! serving Prometheus metrics ([`metrics`]). The planning layer ([`plan`]) holds pure functions from a DI's desired spec and
//! what was observed to the node pools, Kubernetes objects, TLS certificate, endpoints and status
//! to realise; it owns every name derived from our ids and every object's shape, and must not do
//! I/O of any kind (no network, no database, no clock or environment reads: time comes in as an
//! argument), so that it can be tested exhaustively and a second pass over an unchanged input
//! yields identical output. The worker holds no SQL (the store crate does) and never logs a
//! secret.

pub mod cluster_clients;
pub mod metrics;
pub mod plan;
pub mod queue;
pub mod reconcile;
pub mod runtime;
pub mod scaling;
