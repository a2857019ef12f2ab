//! The workers' side of the store: worker sessions (`workers`), the work queue with leases
//! (`queue`), what a pass reads in one statement and the replicas it records (`pass_inputs`),
//! stall tracking (`stalls`), and the teardown ledger of external resources (`ledger`). This
//! module only re-exports.

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
