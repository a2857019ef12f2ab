//! Wire types: the public DigitalOcean-compatible Dedicated Inference API (`public`), the
//! internal API between central and the regional services (`regional`), the normalised spec
//! both sides agree on (`spec`), the lifecycle's statuses with their one transition table
//! (`lifecycle`), which the regional store, the workers and the soak's checker share, and the
//! catalog's shape (`catalog`), which central validates requests against and the regional
//! services size customers' own models with, and the contracts' operations as their clients
//! call them (`operations`). Types here carry no I/O; the regional store applies
//! the transitions under its locks.

pub mod catalog;
pub mod lifecycle;
pub mod operations;
pub mod public;
pub mod regional;
pub mod spec;
