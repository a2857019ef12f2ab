//! Small pieces every service shares: sealing secrets at rest (`seal`), minting and hashing
//! bearer tokens (`tokens`), request ids (`request_id`), Prometheus metrics (`metrics`), logging
//! set-up (`telemetry`), the services' TCP listener settings (`listener`), and which database
//! errors are an outage and how pools recover from one (`db`), and the clock time-dependent code
//! reads, which tests can move (`clock`).
//! Nothing here knows about dedicated inferences, tables or HTTP routes.

pub mod clock;
pub mod db;
pub mod listener;
pub mod metrics;
pub mod request_id;
pub mod seal;
pub mod telemetry;
pub mod tokens;
