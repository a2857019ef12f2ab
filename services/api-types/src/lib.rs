//! Wire types: the public DigitalOcean-compatible Dedicated Inference API (`public`), the
//! internal API between central and the regional services (`regional`), the normalised spec
//! both sides agree on (`spec`), and the lifecycle's statuses with their one transition table
//! (`lifecycle`), which the regional store, the workers and the soak's checker share. Types here
//! carry no I/O; validation against the catalog lives in central, and the regional store applies
//! the transitions under its locks.

pub mod lifecycle;
pub mod public;
pub mod regional;
pub mod spec;
