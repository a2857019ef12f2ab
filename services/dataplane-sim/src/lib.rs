//! The simulated data plane of a region: what a client reaches at a load balancer and what
//! answers it. Each load balancer wired to a gateway is an OpenAI-compatible HTTPS endpoint
//! ([`data_plane`]) that authenticates and routes as a Gateway API implementation with the
//! Inference Extension would (Envoy Gateway: its SecurityPolicy asks our endpoint-auth service,
//! [`auth`]; a BackendTrafficPolicy rewrites its answers, [`overrides`]), by a route derived from the cluster's objects ([`routing`], reading them through
//! [`objects`]); a gateway whose pool's picker runs with flow control holds requests
//! while the pool has no ready replica (scale from zero). Behind it, each model-server pod
//! behaves like vLLM ([`serving`]), chosen by the pool's endpoint picker ([`picker`]); the pods
//! answer the cluster API's `pods/proxy` with their metrics (vLLM's, or the endpoint picker's
//! pool gauges: [`pod_proxy`]).
//!
//! It knows nothing of the cloud: the region simulator (`region-sim`) starts an endpoint at each
//! load balancer's address on the region's front ([`region_sim_base::front`]), reconfigures it
//! with what [`routing`] derives from the cluster's objects whenever they change, and hooks
//! [`pod_proxy`] into its clusters. The model behind it is fake but deterministic.

pub mod auth;
pub mod data_plane;
pub mod objects;
pub mod overrides;
pub mod picker;
pub mod pod_proxy;
pub mod routing;
pub mod serving;
