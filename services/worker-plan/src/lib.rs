//! The worker's decisions: pure functions from a DI's desired spec and what was observed of it
//! to what should exist (node pools, Kubernetes objects, TLS certificates, scale) and how far it
//! has come. It owns every name derived from our ids and every object's shape. It does no I/O of
//! any kind, and cannot: its dependencies hold no client, store, async runtime or clock (time
//! comes in as an argument), so it is tested exhaustively without a cluster and a second look at
//! an unchanged input decides the same. See the worker's README for the object names, Secret
//! formats and routing convention these functions produce.

pub mod autoscale;
pub mod certificates;
pub mod fleet;
pub mod manifests;
pub mod model;
pub mod names;
pub mod pools;
pub mod progress;
pub mod readiness;
pub mod step;
pub mod waiting;

pub use certificates::{issue, needs_reissue, signing_ca};
pub use manifests::{
    endpoint_auth_manifests, manifests, prune, teardown_order, AccessTokenHash, Images,
    ManifestInput, ObjectKey, TlsPair,
};
pub use model::{models, GpuVendor, Model, PlanError};
pub use pools::{
    desired_pools, node_pools, nodes_match, DesiredPool, ObservedNode, ObservedPool, PoolAction,
    PoolPlan,
};
pub use readiness::{
    assess, load_failure, Assessment, LoadFailure, ObservedAccelerator, Progress, MODEL_LOAD_FAILED,
};
pub use waiting::{ClusterWait, Waiting};
