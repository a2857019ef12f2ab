//! The simulated region driven from outside, as one test binary: its DigitalOcean API, the DOKS
//! side (kubeconfigs, Nodes, load balancers, wired endpoints), model loads from a Hugging Face
//! Hub, and the data plane in a simulated cluster (the data plane on its own and the front are
//! `dataplane-sim`'s tests).

mod do_api;
mod doks;
mod hub;
mod scale_from_zero;
mod serving;
