//! Black-box tests of the whole system through its public surfaces: the API's contract and
//! dialects, bad input, retries and outages, the official Python clients, and the lifecycle
//! end to end on the simulated cloud. Each module says what it covers.

mod api;
mod autoscaling;
mod bad_input;
mod byom;
mod byom_clients;
mod credentials;
mod database_restart;
mod lifecycle;
mod pydo_compat;
mod quotas;
mod region_tls;
mod resilience;
mod revocation;
mod secrets;
mod shared_vpc;
mod supervise;
mod tenancy;
mod updates;
