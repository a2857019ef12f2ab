//! What a DI's pass waits for: a typed reason from every place a pass stops short of done, with
//! the text events and stall reports show (unchanged from when these were strings, so progress
//! fingerprints recorded before an upgrade still compare equal) and a bounded kind for metrics.

use std::fmt;

use crate::readiness::ObjectWait;

/// Why a pass left a DI short of serving as declared (or of being gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiting {
    /// The VPC's cluster is not running: being created, provisioning, being deleted.
    Cluster { name: String, state: ClusterWait },
    /// The cluster is still provisioning, so a teardown cannot reach its API yet.
    ClusterUnreachable,
    /// The cloud refused the autoscaler's scale-up; the DI serves with what it runs.
    ScaleUpRefused { message: String },
    /// The pass changed this many objects or pools; the next pass looks at their effect.
    Applied { changes: u64 },
    /// Objects not yet as declared.
    Rollout { waiting_for: Vec<ObjectWait> },
    /// The gateway has no address yet.
    EndpointAddress,
    /// The endpoint does not yet answer the probe as it would answer a customer.
    Probe { url: String, why: String },
    /// The rollout was superseded while the pass ran (a newer spec, a delete): the next pass
    /// converges on what is current.
    Superseded { why: String },
    /// A namespace of the DI is still terminating.
    NamespaceTerminating { name: String },
    /// The pass failed transiently and is retried with backoff.
    Retrying,
}

/// How far a cluster that is not running has come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterWait {
    /// Another DI of the VPC (or an earlier attempt) is creating it.
    BeingCreated,
    /// This pass asked for it.
    Creating,
    /// The last DI of the VPC is deleting it; a new one is made once it is going.
    BeingDeleted,
    /// This teardown asked for its deletion.
    Deleting,
    /// Any other state DigitalOcean reports, lower-cased (`provisioning`, `degraded`, ...).
    State(String),
}

impl Waiting {
    /// A label for metrics: one of a fixed set.
    pub fn kind(&self) -> &'static str {
        match self {
            Waiting::Cluster { .. } => "cluster",
            Waiting::ClusterUnreachable => "cluster_unreachable",
            Waiting::ScaleUpRefused { .. } => "scale_up_refused",
            Waiting::Applied { .. } => "applied",
            Waiting::Rollout { .. } => "rollout",
            Waiting::EndpointAddress => "endpoint_address",
            Waiting::Probe { .. } => "probe",
            Waiting::Superseded { .. } => "superseded",
            Waiting::NamespaceTerminating { .. } => "namespace_terminating",
            Waiting::Retrying => "retrying",
        }
    }

    /// Waiting only because the pass failed and is retried: not a sign that the DI is out of
    /// step with its spec.
    pub fn is_retrying(&self) -> bool {
        matches!(self, Waiting::Retrying)
    }
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Waiting::Cluster { name, state } => write!(f, "cluster {name}: {state}"),
            Waiting::ClusterUnreachable => f.write_str("cluster not reachable yet"),
            Waiting::ScaleUpRefused { message } => write!(f, "scale-up refused: {message}"),
            Waiting::Applied { changes } => write!(f, "applied {changes} changes"),
            Waiting::Rollout { waiting_for } => {
                for (i, w) in waiting_for.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{w}")?;
                }
                Ok(())
            }
            Waiting::EndpointAddress => f.write_str("waiting for an endpoint address"),
            Waiting::Probe { url, why } => write!(f, "endpoint {url}: {why}"),
            Waiting::Superseded { why } => f.write_str(why),
            Waiting::NamespaceTerminating { name } => write!(f, "namespace {name}: terminating"),
            Waiting::Retrying => f.write_str("retrying after transient failures"),
        }
    }
}

impl fmt::Display for ClusterWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterWait::BeingCreated => f.write_str("being created"),
            ClusterWait::Creating => f.write_str("creating"),
            ClusterWait::BeingDeleted => f.write_str("being deleted"),
            ClusterWait::Deleting => f.write_str("deleting"),
            ClusterWait::State(state) => f.write_str(state),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::DeploymentWait;

    /// Progress fingerprints are compared with those recorded before the reasons were typed:
    /// the text must stay what it was.
    #[test]
    fn the_text_is_what_passes_recorded_before() {
        let cases = [
            (
                Waiting::Cluster {
                    name: "di-vpc-1".into(),
                    state: ClusterWait::BeingDeleted,
                },
                "cluster di-vpc-1: being deleted",
            ),
            (
                Waiting::Cluster {
                    name: "di-vpc-1".into(),
                    state: ClusterWait::State("provisioning".into()),
                },
                "cluster di-vpc-1: provisioning",
            ),
            (Waiting::Applied { changes: 3 }, "applied 3 changes"),
            (
                Waiting::Rollout {
                    waiting_for: vec![
                        ObjectWait::Deployment {
                            name: "vllm-a".into(),
                            state: DeploymentWait::Replicas {
                                ready: 1,
                                wanted: 2,
                                old: 1,
                                unschedulable: Some("vllm-a-2".into()),
                                cannot_load: None,
                            },
                        },
                        ObjectWait::LoadBalancer {
                            name: "inference-public".into(),
                        },
                    ],
                },
                "deployment vllm-a: 1 of 2 replicas ready, 1 old replicas still running, pod \
                 vllm-a-2 unschedulable; service inference-public: waiting for a load balancer \
                 address",
            ),
            (
                Waiting::Probe {
                    url: "https://e".into(),
                    why: "503".into(),
                },
                "endpoint https://e: 503",
            ),
            (Waiting::Retrying, "retrying after transient failures"),
        ];
        for (waiting, text) in cases {
            assert_eq!(waiting.to_string(), text);
        }
    }
}
