//! Small pieces every service shares: sealing secrets at rest (`seal`), minting and hashing
//! bearer tokens (`tokens`), request ids (`request_id`), Prometheus metrics (`metrics`), logging
//! set-up (`telemetry`), the services' TCP listener settings (`listener`), which database
//! errors are an outage and how pools recover from one (`db`), the clock time-dependent code
//! reads, which tests can move (`clock`), and the classes every dependency's errors fall into
//! (`errors`).
//! Nothing here knows about dedicated inferences, tables or HTTP routes.

pub mod clock;
pub mod db;
pub mod errors;
pub mod listener;
pub mod metrics;
pub mod request_id;
pub mod seal;
pub mod telemetry;
pub mod tokens;
