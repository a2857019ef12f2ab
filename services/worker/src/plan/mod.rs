//! The pure planning layer: (desired, observed) → actions. See the crate README for the object
//! names, Secret formats and routing convention these functions produce.

pub mod autoscale;
pub mod certificates;
pub mod manifests;
pub mod model;
pub mod names;
pub mod pools;
pub mod readiness;

pub use certificates::{issue, needs_reissue, signing_ca};
pub use manifests::{
    manifests, prune, teardown_order, AccessTokenHash, Images, ManifestInput, ObjectKey, TlsPair,
};
pub use model::{models, GpuVendor, Model, PlanError};
pub use pools::{
    desired_pools, node_pools, nodes_match, DesiredPool, ObservedNode, ObservedPool, PoolAction,
    PoolPlan,
};
pub use readiness::{
    assess, load_failure, Assessment, LoadFailure, ObservedAccelerator, Progress, MODEL_LOAD_FAILED,
};
