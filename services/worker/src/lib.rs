//! The reconcile worker of a region. For now it holds only the planning layer ([`plan`]): pure
//! functions from a dedicated inference's desired spec and what was observed in the cloud to the
//! DigitalOcean node pools, Kubernetes objects, TLS certificate, endpoints and status the worker
//! should realise or record. The planning layer owns every name derived from our ids and every
//! object's shape; it must not do I/O of any kind (no network, no database, no clock or
//! environment reads: time comes in as an argument), so that it can be tested exhaustively and
//! a second pass over an unchanged input yields identical output.

pub mod plan;
