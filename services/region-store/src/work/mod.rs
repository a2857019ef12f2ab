//! The workers' side of the store: the work queue with leases, stall tracking, and the teardown
//! ledger of external resources.

mod ledger;
mod pass_inputs;
mod queue;
mod stalls;
mod workers;

pub use ledger::{ClusterRelease, LedgerEntry};
pub use pass_inputs::{DeploymentReplicas, PassInputs};
pub(crate) use queue::HOLDER_GONE;
pub use queue::{Claim, ClaimOptions};
pub use stalls::{Stall, PROGRESS_IDLE};
pub use workers::{
    worker_deregister, worker_heartbeat, worker_register, HolderSession, WORKER_SILENT,
};
