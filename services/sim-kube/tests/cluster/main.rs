//! The simulated cluster driven from outside, as one test binary: its API-server surface through
//! a real kube-rs client, an unmodified kube-rs `Controller` against it, and the simulated world
//! (scheduling, readiness, rollouts, node loss, garbage collection, load balancers), and a
//! cluster served in process.

mod api;
mod common;
mod controller;
mod in_process;
mod pod_proxy;
mod world;
