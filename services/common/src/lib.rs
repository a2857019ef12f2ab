//! Small pieces every service shares: sealing secrets at rest (`seal`), minting and hashing
//! bearer tokens (`tokens`), request ids (`request_id`), Prometheus metrics (`metrics`), logging
//! set-up (`telemetry`) and the services' TCP listener settings (`listener`).
//! Nothing here knows about dedicated inferences, databases or HTTP routes.

pub mod listener;
pub mod metrics;
pub mod request_id;
pub mod seal;
pub mod telemetry;
pub mod tokens;
