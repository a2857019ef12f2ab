//! The decisions of a converge pass, in the order the worker's executor meets them: the status
//! change it starts with, whether it reads the node pools, which Kubernetes writes it makes in
//! which order, and what it concludes once its writes are done. Each is a function of what the
//! pass has observed; the executor (the worker's `reconcile::converge`) does the I/O between
//! them and nothing else decides.

use std::time::Duration;

use api_types::lifecycle::Status;
use serde_json::Value;
use uuid::Uuid;

use crate::manifests::{is_default_deny, prune, ObjectKey};
use crate::names;
use crate::readiness::{policy_in_force, Assessment, LoadFailure, MODEL_LOAD_FAILED};
use crate::waiting::Waiting;

/// How soon a DI whose node pools wait for pods (to be placed, or to leave) is looked at again.
pub const POOLS_HELD_RECHECK: Duration = Duration::from_secs(10);

/// The status change a pass makes before it looks at the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// A new DI: the pass provisions it.
    Provision,
    /// An active DI with a pending spec: the pass rolls it out.
    Update,
    /// Nothing to record: the status stays.
    Continue,
}

pub fn begin(status: Status, pending: bool) -> Begin {
    match status {
        Status::New => Begin::Provision,
        Status::Active if pending => Begin::Update,
        _ => Begin::Continue,
    }
}

/// A pass that finds the DI active with nothing pending: a resync. It reaches the cluster it
/// reached last time without asking DigitalOcean, and reads the node pools only when the
/// cluster's nodes are not as planned.
pub fn is_resync(status: Status, pending: bool) -> bool {
    status == Status::Active && !pending
}

/// Whether the pass reads the node pools from DigitalOcean: always, except on a resync that
/// finds nothing rolling and the nodes as planned (at 1,000 DIs a read per resync would exceed
/// the API's hourly budget).
pub fn reads_pools(resync: bool, rolling: bool, nodes_as_planned: bool) -> bool {
    !(resync && !rolling && nodes_as_planned)
}

/// Whether the pass may read the DI's objects from its cluster's watch cache rather than list
/// them: only a resync (a moving DI judges its own writes) that reached the cluster as the last
/// pass left it, not restarting under a fleet slot, and whose DI's previous pass ended at least
/// `margin` ago. A watch lags the server: a pass reading a copy older than what the previous
/// pass saw (this worker's list, another worker's cache) could undo what it did, such as
/// recording an old address again.
pub fn reads_cache(
    resync: bool,
    trusted: bool,
    fleet_moving: bool,
    since_last_pass: Option<Duration>,
    margin: Duration,
) -> bool {
    resync && trusted && !fleet_moving && since_last_pass.is_some_and(|d| d >= margin)
}

/// One object to apply, with its copy as the pass listed it (an object listed up to date costs
/// no request).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Apply<'a> {
    pub object: &'a Value,
    pub listed: Option<&'a Value>,
}

/// The Kubernetes writes of a pass, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectWrites<'a> {
    /// Applied one wave after another; the objects of one wave at once. Namespaces first
    /// (everything else lives in them), then the rest, then each namespace's default-deny
    /// NetworkPolicy: a namespace that gains its policies while it serves is never isolated
    /// before the allows exist.
    pub waves: [Vec<Apply<'a>>; 3],
    /// Rendered objects of the DI that the spec no longer asks for, deleted after the waves.
    pub prune: Vec<ObjectKey>,
}

/// The writes that take the DI's `rendered` objects (as listed) to `desired`. Two objects wait
/// for what makes them safe, the first time only (once they exist they are kept as declared):
/// the load balancers until the SecurityPolicy is in force and endpoint-auth can answer (an
/// address must never serve without the token check, nor fail every request with 503 because
/// the check has no replica), and the SecurityPolicy until endpoint-auth can answer while a
/// load balancer already serves (a DI from before the policy would otherwise answer 503 to
/// everything meanwhile). A new DI has no address yet, so its policy goes with everything else
/// and the load balancers follow as soon as both are ready: one pass fewer per create.
pub fn object_writes<'a>(
    di: &Uuid,
    desired: &'a [Value],
    rendered: &'a [Value],
) -> ObjectWrites<'a> {
    let apply = |object: &'a Value| Apply {
        object,
        listed: listed(rendered, object),
    };
    let named = |kind: &str, name: &str| {
        rendered.iter().find(|o| {
            o["kind"] == kind && o.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
        })
    };
    let auth_answers = named("Deployment", names::ENDPOINT_AUTH).is_some_and(|d| {
        d.pointer("/status/availableReplicas")
            .and_then(Value::as_i64)
            >= Some(1)
    });
    let serving = rendered.iter().any(is_load_balancer);
    let held = |object: &Value| {
        if listed(rendered, object).is_some() {
            return false;
        }
        match object["kind"].as_str() {
            Some("SecurityPolicy") => serving && !auth_answers,
            Some("Service") if is_load_balancer(object) => {
                !(auth_answers
                    && named("SecurityPolicy", names::ENDPOINT_AUTH).is_some_and(policy_in_force))
            }
            _ => false,
        }
    };
    let mut waves: [Vec<Apply<'a>>; 3] = Default::default();
    for object in desired.iter().filter(|o| !held(o)) {
        let wave = if object["kind"] == "Namespace" {
            0
        } else if is_default_deny(object) {
            2
        } else {
            1
        };
        waves[wave].push(apply(object));
    }
    ObjectWrites {
        waves,
        prune: prune(di, desired, rendered),
    }
}

/// The listed copy of `obj` (same kind and name; everything listed is in the DI's namespace).
fn is_load_balancer(o: &Value) -> bool {
    o["kind"] == "Service" && o["spec"]["type"] == "LoadBalancer"
}

fn listed<'a>(listed: &'a [Value], obj: &Value) -> Option<&'a Value> {
    listed.iter().find(|o| {
        o["kind"] == obj["kind"]
            && o["apiVersion"] == obj["apiVersion"]
            && o.pointer("/metadata/name") == obj.pointer("/metadata/name")
    })
}

/// Of a pass's writes, how many only a later pass can see the effect of. A rollout (a create or
/// an update) judges the objects it applied whose state the assessment reads from their status
/// ([`crate::readiness::judged_by_status`]) by the server's answers, which carry that state (a
/// Deployment whose template just changed answers with its generation ahead of the one its
/// controller observed: not ready), so a pass that applied only those goes straight on to wait
/// for readiness, or to probe, instead of leaving that to another pass. Other objects (a route,
/// a configuration, the endpoint certificate: the probe could still meet the old one), node
/// pools (their nodes come later) and deletions are seen by the next pass. A resync waits on
/// all its repairs, so that a repair is reported (`Repairing`, then `Repaired`) and confirmed
/// by a pass that read it back.
pub fn unseen_writes(rollout: bool, judged_applies: u64, other_writes: u64) -> u64 {
    if rollout {
        other_writes
    } else {
        judged_applies + other_writes
    }
}

/// What a pass has seen once its writes are done.
#[derive(Debug, Clone, Copy)]
pub struct Written<'a> {
    pub status: Status,
    /// The spec version being rolled out, if any.
    pub pending: Option<i32>,
    /// Writes this pass made whose effect is for the next pass to see (see [`unseen_writes`]).
    pub writes: u64,
    pub assessment: &'a Assessment,
    /// A model server that cannot load its model since the rollout began.
    pub load_failure: Option<&'a LoadFailure>,
    /// The endpoints the store has for the DI: (public, private).
    pub recorded: (Option<&'a str>, Option<&'a str>),
}

/// What a pass concludes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The rollout cannot succeed by waiting: the DI goes to `error` with this reason.
    Fail {
        reason: &'static str,
        message: String,
    },
    Wait(Waiting),
    /// Serving as declared with nothing to roll out. `endpoints_moved`: the endpoints differ
    /// from those recorded (a load balancer replaced, the cluster rebuilt) and are recorded.
    Settled {
        endpoints_moved: bool,
    },
    /// Serving as declared: the rollout of `version` completes once the endpoint at `url`
    /// answers the probe as it would answer a customer.
    Probe {
        url: String,
        version: i32,
    },
}

pub fn verdict(w: Written<'_>) -> Verdict {
    let a = w.assessment;
    // A model server that cannot load its model does not load by waiting: the rollout fails in
    // its words. (On a resync the DI keeps serving with its other replicas; the wait names the
    // failing pod.)
    if let (Some(_), Some(failure)) = (w.pending, w.load_failure) {
        return Verdict::Fail {
            reason: MODEL_LOAD_FAILED,
            message: failure.to_string(),
        };
    }
    if w.writes > 0 {
        return Verdict::Wait(Waiting::Applied { changes: w.writes });
    }
    if !a.progress.ready {
        let waiting_for = a.progress.waiting_for.clone();
        return Verdict::Wait(Waiting::Rollout { waiting_for });
    }
    let Some(version) = w.pending else {
        let endpoints_moved = w.status == Status::Active
            && (w.recorded.0 != a.public_endpoint.as_deref()
                || w.recorded.1 != a.private_endpoint.as_deref());
        return Verdict::Settled { endpoints_moved };
    };
    match a.public_endpoint.as_ref().or(a.private_endpoint.as_ref()) {
        Some(url) => Verdict::Probe {
            url: url.clone(),
            version,
        },
        None => Verdict::Wait(Waiting::EndpointAddress),
    }
}

/// When a converged DI is looked at again: every resync, or every autoscale interval when it
/// autoscales; sooner while node pools wait for pods to be placed or to leave (which on a real
/// cluster takes up to their grace period), though nothing customers asked for is waiting.
pub fn next_look(
    autoscaled: bool,
    resync: Duration,
    autoscale: Duration,
    pools_held: bool,
) -> Duration {
    let converged = if autoscaled {
        autoscale.min(resync)
    } else {
        resync
    };
    if pools_held {
        converged.min(POOLS_HELD_RECHECK)
    } else {
        converged
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::readiness::{ObjectWait, Progress};

    #[test]
    fn only_a_settled_resync_reads_the_watch_cache() {
        let s = Duration::from_secs;
        let margin = s(2);
        assert!(reads_cache(true, true, false, Some(s(300)), margin));
        // A moving DI, a cluster reached anew, a DI restarting under a fleet slot: lists.
        assert!(!reads_cache(false, true, false, Some(s(300)), margin));
        assert!(!reads_cache(true, false, false, Some(s(300)), margin));
        assert!(!reads_cache(true, true, true, Some(s(300)), margin));
        // Just after another pass (the watch may not have caught up with what it saw), or with
        // no pass before: lists.
        assert!(!reads_cache(true, true, false, Some(s(1)), margin));
        assert!(!reads_cache(true, true, false, None, margin));
        assert!(reads_cache(true, true, false, Some(margin), margin));
    }

    fn assessment(ready: bool, public: Option<&str>) -> Assessment {
        Assessment {
            progress: Progress {
                ready,
                waiting_for: if ready {
                    vec![]
                } else {
                    vec![ObjectWait::LoadBalancer { name: "x".into() }]
                },
            },
            public_endpoint: public.map(str::to_string),
            private_endpoint: None,
            accelerators: vec![],
        }
    }

    fn written(a: &Assessment, pending: Option<i32>, writes: u64) -> Written<'_> {
        Written {
            status: if pending.is_some() {
                Status::Updating
            } else {
                Status::Active
            },
            pending,
            writes,
            assessment: a,
            load_failure: None,
            recorded: (Some("https://1.2.3.4"), None),
        }
    }

    #[test]
    fn a_pass_begins_by_recording_the_phase_it_enters() {
        assert_eq!(begin(Status::New, false), Begin::Provision);
        assert_eq!(begin(Status::Active, true), Begin::Update);
        assert_eq!(begin(Status::Active, false), Begin::Continue);
        assert_eq!(begin(Status::Updating, true), Begin::Continue);
        assert_eq!(begin(Status::Provisioning, false), Begin::Continue);
    }

    #[test]
    fn a_resync_reads_pools_only_when_something_moves() {
        assert!(!reads_pools(true, false, true));
        assert!(reads_pools(true, true, true), "a rollout in flight");
        assert!(reads_pools(true, false, false), "nodes not as planned");
        assert!(reads_pools(false, false, true), "not a resync");
    }

    #[test]
    fn namespaces_go_first_and_isolation_last() {
        let di = Uuid::nil();
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n"}});
        let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}});
        let desired = vec![svc.clone(), ns.clone()];
        let rendered = vec![svc.clone()];
        let w = object_writes(&di, &desired, &rendered);
        assert_eq!(
            w.waves[0],
            vec![Apply {
                object: &ns,
                listed: None
            }]
        );
        assert_eq!(
            w.waves[1],
            vec![Apply {
                object: &desired[0],
                listed: Some(&rendered[0])
            }]
        );
        assert!(w.waves[2].is_empty());
    }

    /// The token check comes before the address: the load balancers wait for the policy in
    /// force and a replica of endpoint-auth; the policy waits for that replica only where a
    /// load balancer already serves (a DI from before the policy, which keeps its load
    /// balancers meanwhile). Once they exist they are never held back.
    #[test]
    fn the_load_balancers_wait_for_the_check_and_a_serving_di_gets_its_policy_once_it_answers() {
        let di = Uuid::nil();
        let auth = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "endpoint-auth"}});
        let policy = json!({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "SecurityPolicy",
            "metadata": {"name": "endpoint-auth", "generation": 1}});
        let lb = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "inference-public"},
            "spec": {"type": "LoadBalancer"}});
        let desired = vec![auth.clone(), policy.clone(), lb.clone()];
        let written = |rendered: &[Value]| -> Vec<String> {
            object_writes(&di, &desired, rendered).waves[1]
                .iter()
                .map(|a| a.object["kind"].as_str().unwrap().to_string())
                .collect()
        };
        // A new DI: nothing serves, so the policy goes at once; no address yet.
        assert_eq!(written(&[]), ["Deployment", "SecurityPolicy"]);
        let mut available = auth.clone();
        available["status"] = json!({"availableReplicas": 1});
        assert_eq!(
            written(&[available.clone()]),
            ["Deployment", "SecurityPolicy"]
        );
        let mut accepted = policy.clone();
        accepted["status"] = json!({"ancestors": [{"conditions": [
            {"type": "Accepted", "status": "True", "observedGeneration": 1}]}]});
        let mut pending = accepted.clone();
        pending["metadata"]["generation"] = json!(2);
        assert_eq!(
            written(&[available.clone(), pending]),
            ["Deployment", "SecurityPolicy"],
            "accepted for an older generation only"
        );
        assert_eq!(
            written(&[auth.clone(), accepted.clone()]),
            ["Deployment", "SecurityPolicy"],
            "in force, but endpoint-auth has no replica to answer"
        );
        assert_eq!(
            written(&[available.clone(), accepted]),
            ["Deployment", "SecurityPolicy", "Service"]
        );
        // A DI that serves without the policy gets it once endpoint-auth answers, and keeps
        // its load balancers meanwhile.
        assert_eq!(
            written(&[auth.clone(), lb.clone()]),
            ["Deployment", "Service"]
        );
        assert_eq!(
            written(&[available.clone(), lb.clone()]),
            ["Deployment", "SecurityPolicy", "Service"]
        );
        // Existing objects are kept as declared whatever the others' state.
        assert_eq!(
            written(&[auth.clone(), policy.clone(), lb.clone()]),
            ["Deployment", "SecurityPolicy", "Service"]
        );
    }

    #[test]
    fn a_rollout_sees_its_applies_in_their_answers_and_a_resync_reads_its_repairs_back() {
        assert_eq!(unseen_writes(true, 5, 0), 0);
        assert_eq!(
            unseen_writes(true, 5, 2),
            2,
            "pools and deletions show in no answer"
        );
        assert_eq!(unseen_writes(false, 5, 0), 5);
        assert_eq!(unseen_writes(false, 5, 2), 7);
    }

    #[test]
    fn writes_and_rollouts_are_waited_on_before_the_probe() {
        let ready = assessment(true, Some("https://1.2.3.4"));
        assert_eq!(
            verdict(written(&ready, Some(2), 3)),
            Verdict::Wait(Waiting::Applied { changes: 3 })
        );
        let rolling = assessment(false, Some("https://1.2.3.4"));
        assert!(matches!(
            verdict(written(&rolling, Some(2), 0)),
            Verdict::Wait(Waiting::Rollout { .. })
        ));
        assert_eq!(
            verdict(written(&ready, Some(2), 0)),
            Verdict::Probe {
                url: "https://1.2.3.4".into(),
                version: 2
            }
        );
        let unaddressed = assessment(true, None);
        assert_eq!(
            verdict(written(&unaddressed, Some(2), 0)),
            Verdict::Wait(Waiting::EndpointAddress)
        );
    }

    #[test]
    fn a_resync_notices_endpoints_that_moved() {
        let same = assessment(true, Some("https://1.2.3.4"));
        assert_eq!(
            verdict(written(&same, None, 0)),
            Verdict::Settled {
                endpoints_moved: false
            }
        );
        let moved = assessment(true, Some("https://5.6.7.8"));
        assert_eq!(
            verdict(written(&moved, None, 0)),
            Verdict::Settled {
                endpoints_moved: true
            }
        );
    }

    #[test]
    fn held_pools_bring_the_next_look_closer() {
        let (resync, autoscale) = (Duration::from_secs(300), Duration::from_secs(5));
        assert_eq!(next_look(false, resync, autoscale, false), resync);
        assert_eq!(next_look(true, resync, autoscale, false), autoscale);
        assert_eq!(
            next_look(false, resync, autoscale, true),
            POOLS_HELD_RECHECK
        );
        assert_eq!(next_look(true, resync, autoscale, true), autoscale);
    }
}
