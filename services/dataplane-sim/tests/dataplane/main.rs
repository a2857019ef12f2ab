//! The simulated data plane driven from outside, as one test binary, without a simulated cloud:
//! data-plane endpoints on their own, the serving model and the endpoint picker behind them,
//! and the front that serves every load balancer and cluster API.

mod data_plane;
mod front;
mod serving;
