//! What the region simulator's two halves share: the simulated cloud (`region-sim`) and the
//! simulated data plane (`dataplane-sim`) both serve at addresses of the region's one listener
//! and fail as its fault injection tells them. It owns that listener, which serves every
//! cluster API and every load balancer at a loopback address of its own ([`front`]), the faults
//! of the three simulated APIs, DigitalOcean, Kubernetes and the data plane ([`faults`]), and
//! what hardware a droplet size slug stands for ([`sizes`]: the cloud's GPU capacity and nodes,
//! the model servers' GPUs). It knows nothing of clusters, load balancers or models.

pub mod faults;
pub mod front;
pub mod sizes;
