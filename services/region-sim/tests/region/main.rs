//! The simulated region driven from outside, as one test binary: its DigitalOcean API, the DOKS
//! side (kubeconfigs, Nodes, load balancers, wired endpoints), model loads from a Hugging Face
//! Hub, and the data plane on its own.

mod data_plane;
mod do_api;
mod doks;
mod hub;
mod serving;
