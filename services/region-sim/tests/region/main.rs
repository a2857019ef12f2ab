//! The simulated region driven from outside, as one test binary: its DigitalOcean API, the DOKS
//! side (kubeconfigs, Nodes, load balancers, wired endpoints), model loads from a Hugging Face
//! Hub, the data plane on its own, and the front that serves every load balancer and cluster API.

mod data_plane;
mod do_api;
mod doks;
mod front;
mod hub;
mod scale_from_zero;
mod serving;
