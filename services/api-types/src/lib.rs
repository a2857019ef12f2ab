//! Wire types, and nothing else: the public DigitalOcean-compatible Dedicated Inference API
//! (`public`), the internal API between central and the regional services (`regional`), and the
//! normalised spec both sides agree on (`spec`). Types here carry no I/O and no policy beyond
//! shape; validation against the catalog lives in central, lifecycle rules in the regional store.

pub mod public;
pub mod regional;
pub mod spec;
