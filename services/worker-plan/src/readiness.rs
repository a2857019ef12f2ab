//! From observed objects to progress: is every replica ready and does every load balancer have
//! an address, which endpoint URLs to record, which accelerators (nodes) the DI has, which
//! model deployments are rolling out (for node pool sizing), and whether a model server cannot
//! load its model (which no amount of waiting fixes).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use serde_json::Value;
use uuid::Uuid;

use super::names;

/// Whether the DI's objects are ready, and if not, which objects the worker is waiting for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    pub ready: bool,
    pub waiting_for: Vec<ObjectWait>,
}

/// An object of the DI not yet as declared. Its text (an event's message, and part of the
/// progress fingerprint that passes record) is what it was when these were strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectWait {
    Deployment {
        name: String,
        state: DeploymentWait,
    },
    /// A LoadBalancer Service without an address.
    LoadBalancer {
        name: String,
    },
    /// A policy of the gateway (the endpoint's authentication) that its controller has not
    /// accepted for the current generation; `refused`: the reason it gave, if it refused.
    Policy {
        /// The policy's kind, in lower case.
        kind: String,
        name: String,
        refused: Option<String>,
    },
}

/// How far a Deployment is from what the pass declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeploymentWait {
    NotCreated,
    /// It carries another template than the one declared.
    NotApplied,
    /// Its controller has not observed the latest generation.
    ControllerBehind,
    Replicas {
        ready: i64,
        wanted: i64,
        /// Replicas of an older template still running.
        old: i64,
        /// A pod the scheduler cannot place.
        unschedulable: Option<String>,
        /// A pod that cannot load its model, with the container's message (without the
        /// restart count: the text must not change while the pod keeps failing alike).
        cannot_load: Option<(String, String)>,
    },
}

impl std::fmt::Display for ObjectWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectWait::LoadBalancer { name } => {
                write!(f, "service {name}: waiting for a load balancer address")
            }
            ObjectWait::Deployment { name, state } => write!(f, "deployment {name}: {state}"),
            ObjectWait::Policy {
                kind,
                name,
                refused: None,
            } => write!(f, "{kind} {name}: not accepted yet"),
            ObjectWait::Policy {
                kind,
                name,
                refused: Some(why),
            } => write!(f, "{kind} {name}: not accepted: {why}"),
        }
    }
}

impl std::fmt::Display for DeploymentWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeploymentWait::NotCreated => f.write_str("not created yet"),
            DeploymentWait::NotApplied => f.write_str("new version not applied yet"),
            DeploymentWait::ControllerBehind => {
                f.write_str("waiting for the controller to see the change")
            }
            DeploymentWait::Replicas {
                ready,
                wanted,
                old,
                unschedulable,
                cannot_load,
            } => {
                write!(f, "{ready} of {wanted} replicas ready")?;
                if *old > 0 {
                    write!(f, ", {old} old replicas still running")?;
                }
                if let Some(pod) = unschedulable {
                    write!(f, ", pod {pod} unschedulable")?;
                }
                if let Some((pod, message)) = cannot_load {
                    write!(f, ", pod {pod} cannot load its model: {message}")?;
                }
                Ok(())
            }
        }
    }
}

/// One GPU node of the DI's node pools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedAccelerator {
    /// The Kubernetes Node name.
    pub name: String,
    /// The Droplet size slug (`node.kubernetes.io/instance-type`).
    pub slug: String,
    /// `active` when the Node is Ready, `provisioning` otherwise, `deleting` while it goes.
    pub status: String,
    /// The node pool (`doks.digitalocean.com/node-pool`).
    pub pool: String,
    /// The model deployment whose pool the node belongs to, from the pool's labels.
    pub model_id: Option<Uuid>,
}

/// Everything [`assess`] derives.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Assessment {
    pub progress: Progress,
    /// `https://<address>[:<port>]` of the `inference-public` Service, once it has an address.
    pub public_endpoint: Option<String>,
    /// The same for `inference-private`.
    pub private_endpoint: Option<String>,
    pub accelerators: Vec<ObservedAccelerator>,
}

fn s<'a>(v: &'a Value, ptr: &str) -> Option<&'a str> {
    v.pointer(ptr).and_then(Value::as_str)
}

fn int(v: &Value, ptr: &str) -> i64 {
    v.pointer(ptr).and_then(Value::as_i64).unwrap_or(0)
}

fn deleting(v: &Value) -> bool {
    v.pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
}

fn same_object(a: &Value, b: &Value) -> bool {
    a["kind"] == b["kind"]
        && a["apiVersion"] == b["apiVersion"]
        && a.pointer("/metadata/name") == b.pointer("/metadata/name")
        && a.pointer("/metadata/namespace") == b.pointer("/metadata/namespace")
}

fn observed_of<'a>(desired: &Value, observed: &'a [Value]) -> Option<&'a Value> {
    observed
        .iter()
        .find(|o| same_object(desired, o) && !deleting(o))
}

fn condition(v: &Value, ty: &str) -> Option<&'static str> {
    let cs = v.pointer("/status/conditions")?.as_array()?;
    let c = cs.iter().find(|c| c["type"] == ty)?;
    Some(match c["status"].as_str() {
        Some("True") => "True",
        Some("False") => "False",
        _ => "Unknown",
    })
}

fn labels_match(selector: &Value, obj: &Value) -> bool {
    let Some(sel) = selector.as_object() else {
        return false;
    };
    !sel.is_empty()
        && sel
            .iter()
            .all(|(k, v)| obj.pointer("/metadata/labels").and_then(|l| l.get(k)) == Some(v))
}

/// Pods of `deployment` (same namespace, matching its selector) in `observed`.
fn pods_of<'a>(deployment: &Value, observed: &'a [Value]) -> Vec<&'a Value> {
    let sel = &deployment["spec"]["selector"]["matchLabels"];
    let ns = deployment.pointer("/metadata/namespace");
    observed
        .iter()
        .filter(|o| o["kind"] == "Pod" && o.pointer("/metadata/namespace") == ns)
        .filter(|p| labels_match(sel, p))
        .collect()
}

fn pod_finished(p: &Value) -> bool {
    matches!(s(p, "/status/phase"), Some("Succeeded" | "Failed"))
}

fn template_hash(v: &Value) -> Option<&str> {
    v.pointer("/metadata/annotations")
        .and_then(|a| a.get(names::TEMPLATE_HASH_ANNOTATION))
        .and_then(Value::as_str)
}

fn deployment_waits(desired: &Value, observed: &[Value]) -> Option<ObjectWait> {
    let name = s(desired, "/metadata/name").unwrap_or("").to_string();
    let wait = |state| {
        Some(ObjectWait::Deployment {
            name: name.clone(),
            state,
        })
    };
    let Some(o) = observed_of(desired, observed) else {
        return wait(DeploymentWait::NotCreated);
    };
    if template_hash(desired) != template_hash(o) {
        return wait(DeploymentWait::NotApplied);
    }
    let replicas = int(desired, "/spec/replicas");
    if int(o, "/status/observedGeneration") < int(o, "/metadata/generation") {
        return wait(DeploymentWait::ControllerBehind);
    }
    let ready = int(o, "/status/readyReplicas");
    let available = int(o, "/status/availableReplicas");
    let updated = int(o, "/status/updatedReplicas");
    let total = int(o, "/status/replicas");
    if updated >= replicas && ready >= replicas && available >= replicas && total <= replicas {
        return None;
    }
    let unschedulable = pods_of(o, observed).into_iter().find(|p| {
        !pod_finished(p)
            && p.pointer("/status/conditions")
                .and_then(Value::as_array)
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c["type"] == "PodScheduled"
                            && c["status"] == "False"
                            && c["reason"] == "Unschedulable"
                    })
                })
    });
    wait(DeploymentWait::Replicas {
        ready: ready.min(available),
        wanted: replicas,
        old: (total - updated).max(0),
        unschedulable: unschedulable.map(|p| s(p, "/metadata/name").unwrap_or("?").to_string()),
        cannot_load: deployment_load_failure(desired, observed, None).map(|f| (f.pod, f.message)),
    })
}

/// A gateway policy is in force once its controller reports it Accepted, for its current
/// generation, on every ancestor (the Gateway) it reports: Envoy Gateway writes one ancestor
/// status per target. A policy that is not in force leaves the endpoint unauthenticated or
/// answering 500, so the DI must not be declared active on it.
fn policy_waits(desired: &Value, observed: &[Value]) -> Option<ObjectWait> {
    let name = s(desired, "/metadata/name").unwrap_or("").to_string();
    let kind = s(desired, "/kind").unwrap_or("").to_ascii_lowercase();
    let wait = |refused| {
        Some(ObjectWait::Policy {
            kind: kind.clone(),
            name: name.clone(),
            refused,
        })
    };
    match observed_of(desired, observed).map(policy_state) {
        Some(PolicyState::InForce) => None,
        Some(PolicyState::Refused(why)) => wait(Some(why)),
        Some(PolicyState::Pending) | None => wait(None),
    }
}

enum PolicyState {
    InForce,
    Pending,
    Refused(String),
}

fn policy_state(o: &Value) -> PolicyState {
    let generation = int(o, "/metadata/generation");
    let ancestors = o
        .pointer("/status/ancestors")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty());
    let Some(ancestors) = ancestors else {
        return PolicyState::Pending;
    };
    for a in ancestors {
        let accepted = a["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Accepted");
        match accepted {
            Some(c) if c["observedGeneration"].as_i64().unwrap_or(0) < generation => {
                return PolicyState::Pending
            }
            Some(c) if c["status"] == "True" => {}
            Some(c) => {
                return PolicyState::Refused(c["message"].as_str().unwrap_or("").to_string())
            }
            None => return PolicyState::Pending,
        }
    }
    PolicyState::InForce
}

/// Whether the gateway's controller accepted policy `o` (as listed) for its generation.
pub fn policy_in_force(o: &Value) -> bool {
    matches!(policy_state(o), PolicyState::InForce)
}

/// The status reason of a DI whose model server cannot load its model.
pub const MODEL_LOAD_FAILED: &str = "ModelLoadFailed";
/// Restarts after which a crash-looping model server counts as failing to load: one failure
/// may be a blip (a Hub hiccup); the same failure again after a restart is not.
pub const LOAD_FAILURE_RESTARTS: i64 = 2;
/// The longest container message a status or event carries, in characters.
pub const MAX_LOAD_MESSAGE_CHARS: usize = 500;

/// A model server that cannot load its model: a pod of the vLLM Deployment's desired template
/// whose container waits in `CrashLoopBackOff` after at least [`LOAD_FAILURE_RESTARTS`]
/// restarts, with the message its last run ended with (vLLM exits with huggingface_hub's error
/// when the Hub refuses the repository: deleted, gated without access, token revoked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadFailure {
    /// The vLLM Deployment.
    pub deployment: String,
    /// The repository the Deployment loads (`--model`), when its args name one.
    pub model: Option<String>,
    pub pod: String,
    pub restarts: i64,
    /// The container's last termination message, whitespace collapsed, token-like words
    /// masked, cut to [`MAX_LOAD_MESSAGE_CHARS`].
    pub message: String,
}

impl std::fmt::Display for LoadFailure {
    /// The DI's error message: `Model org/m failed to load (pod vllm-…, restarted 2 times): <the
    /// container's message>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.model {
            Some(m) => write!(f, "Model {m} failed to load")?,
            None => write!(f, "Deployment {} failed to load its model", self.deployment)?,
        }
        write!(
            f,
            " (pod {}, restarted {} times): {}",
            self.pod, self.restarts, self.message
        )
    }
}

/// The value following `flag` in a container's args.
fn arg<'a>(container: &'a Value, flag: &str) -> Option<&'a str> {
    let args = container["args"].as_array()?;
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1)?.as_str()
}

/// A container message fit for a DI's status: one line, no token-like words (`hf_…`), at most
/// [`MAX_LOAD_MESSAGE_CHARS`] characters. A longer one keeps its end: a message taken from the
/// container's log (`FallbackToLogsOnError`) is a Python traceback, whose last lines say why.
fn clean_message(raw: &str) -> String {
    let words: Vec<String> = raw.split_whitespace().map(mask_tokens).collect();
    let line = words.join(" ");
    let chars = line.chars().count();
    if chars <= MAX_LOAD_MESSAGE_CHARS {
        return line;
    }
    let tail: String = line
        .chars()
        .skip(chars + 1 - MAX_LOAD_MESSAGE_CHARS)
        .collect();
    format!("…{tail}")
}

/// Masks what looks like a Hugging Face token (`hf_` and at least 20 letters or digits) in `w`.
fn mask_tokens(w: &str) -> String {
    let mut out = String::new();
    let mut rest = w;
    while let Some(i) = rest.find("hf_") {
        let after = &rest[i + 3..];
        let len = after
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(after.len());
        out.push_str(&rest[..i]);
        if len >= 20 {
            out.push_str("hf_***");
        } else {
            out.push_str(&rest[i..i + 3 + len]);
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// An RFC 3339 timestamp as Kubernetes writes them (`2025-01-02T03:04:05Z`, fractions and
/// offsets accepted).
fn parse_time(t: &str) -> Option<SystemTime> {
    let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
    let b = t.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut rest = &t[19..];
    let mut nanos = 0u32;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(frac.len());
        let kept = &frac[..digits.min(9)];
        nanos = format!("{kept:0<9}").parse().ok()?;
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 && matches!(&o[..1], "+" | "-") && &o[3..4] == ":" => {
            let mins = o[1..3].parse::<i64>().ok()? * 60 + o[4..6].parse::<i64>().ok()?;
            if o.starts_with('-') {
                -mins * 60
            } else {
                mins * 60
            }
        }
        _ => return None,
    };
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset;
    let whole = u64::try_from(secs).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::new(whole, nanos))
}

/// The first failing model server (by pod name) of the vLLM Deployment `desired`, if any; with
/// `since`, only one whose last run ended after it.
fn deployment_load_failure(
    desired: &Value,
    observed: &[Value],
    since: Option<SystemTime>,
) -> Option<LoadFailure> {
    let want = template_hash(desired)?;
    observed_of(desired, observed)?;
    let mut pods: Vec<&Value> = pods_of(desired, observed)
        .into_iter()
        .filter(|p| !pod_finished(p) && !deleting(p) && template_hash(p) == Some(want))
        .collect();
    pods.sort_by_key(|p| s(p, "/metadata/name"));
    pods.into_iter().find_map(|p| {
        let statuses = p.pointer("/status/containerStatuses")?.as_array()?;
        statuses.iter().find_map(|cs| {
            let restarts = int(cs, "/restartCount");
            let waiting = s(cs, "/state/waiting/reason");
            let message = s(cs, "/lastState/terminated/message")
                .map(str::trim)
                .filter(|m| !m.is_empty())?;
            let recent = since.is_none_or(|since| {
                s(cs, "/lastState/terminated/finishedAt")
                    .and_then(parse_time)
                    .is_some_and(|finished| finished > since)
            });
            (restarts >= LOAD_FAILURE_RESTARTS && waiting == Some("CrashLoopBackOff") && recent)
                .then(|| LoadFailure {
                    deployment: s(desired, "/metadata/name").unwrap_or("").to_string(),
                    model: desired
                        .pointer("/spec/template/spec/containers")
                        .and_then(Value::as_array)
                        .and_then(|cs| cs.iter().find_map(|c| arg(c, "--model")))
                        .map(str::to_string),
                    pod: s(p, "/metadata/name").unwrap_or("?").to_string(),
                    restarts,
                    message: clean_message(message),
                })
        })
    })
}

/// The first model server of `desired` (the output of [`super::manifests::manifests`]) that
/// cannot load its model, as `observed` shows it: crash-looping after
/// [`LOAD_FAILURE_RESTARTS`] restarts, its last run ended after `since` (when the rollout
/// began: a failure from before it may be fixed by then, e.g. by a new token or granted access,
/// and the next restart will tell). Only pods of a vLLM Deployment's desired template count:
/// the pods of an older template are being replaced (and keep serving until their replacements
/// are ready).
pub fn load_failure(
    desired: &[Value],
    observed: &[Value],
    since: SystemTime,
) -> Option<LoadFailure> {
    desired
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .find_map(|d| deployment_load_failure(d, observed, Some(since)))
}

/// The URL to record for a LoadBalancer Service, once it has an address:
/// `https://<ingress[0].ip or hostname>`, with `:<ingress[0].ports[0].port>` when that port is
/// reported and is not 443 (the simulator reports the local port it serves the endpoint on).
pub fn endpoint_url(service: &Value) -> Option<String> {
    let ing = service.pointer("/status/loadBalancer/ingress/0")?;
    let host = ing
        .get("ip")
        .and_then(Value::as_str)
        .or_else(|| ing.get("hostname").and_then(Value::as_str))
        .filter(|h| !h.is_empty())?;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    match ing.pointer("/ports/0/port").and_then(Value::as_i64) {
        Some(port) if port != 443 => Some(format!("https://{host}:{port}")),
        _ => Some(format!("https://{host}")),
    }
}

/// How long after its deletion time a pod that is still there stops holding its node: its
/// kubelet should have stopped it by then (the deletion time is when its grace period ends), so
/// it is stuck on a node that does not answer, and it would hold that node forever.
pub const STUCK_POD_GRACE: Duration = Duration::from_secs(60);

/// Nodes that run a pod that has not finished at `now`: a pool must not lose them. A pod being
/// deleted holds its node until it is gone (its requests finish), unless it is stuck (see
/// [`STUCK_POD_GRACE`]).
pub fn busy_nodes(pods: &[Value], now: SystemTime) -> BTreeSet<String> {
    let stuck = |p: &Value| {
        s(p, "/metadata/deletionTimestamp")
            .and_then(parse_time)
            .is_some_and(|at| at + STUCK_POD_GRACE < now)
    };
    pods.iter()
        .filter(|p| p["kind"] == "Pod" && !pod_finished(p) && !stuck(p))
        .filter_map(|p| s(p, "/spec/nodeName"))
        .map(str::to_string)
        .collect()
}

/// The node pools (by name) that a model server may still be placed on: a pool whose nodes are
/// all idle now can still be about to receive a pod, and a node removed as idle then takes the
/// pod with it once it goes (after the pod may have turned ready and the Deployment let the
/// old ones go: an outage). A pool is awaited when
/// - a pod of the DI that asks for it (`nodeSelector`) has no node yet, or
/// - the Deployment `desired` points at it has not settled: it is not applied as desired yet,
///   its controller has not seen its last change, or fewer of its current pods are on a node
///   than it wants (the controller creates the others when it gets to them).
///
/// Only an idle node of a pool that is not awaited can go: nothing can be placed there
/// between this look and the deletion.
pub fn awaited_pools(desired: &[Value], observed: &[Value]) -> BTreeSet<String> {
    let pool_of = |pod_spec: &Value| {
        pod_spec
            .pointer("/nodeSelector")
            .and_then(|s| s.get(names::NODE_POOL_LABEL))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let mut awaited: BTreeSet<String> = observed
        .iter()
        .filter(|p| p["kind"] == "Pod" && !pod_finished(p) && !deleting(p))
        .filter(|p| s(p, "/spec/nodeName").is_none_or(str::is_empty))
        .filter_map(|p| pool_of(&p["spec"]))
        .collect();
    for d in desired.iter().filter(|d| d["kind"] == "Deployment") {
        let Some(pool) = pool_of(&d["spec"]["template"]["spec"]) else {
            continue;
        };
        let settled = observed_of(d, observed).is_some_and(|o| {
            let want = template_hash(d);
            let placed = pods_of(d, observed)
                .into_iter()
                .filter(|p| !pod_finished(p) && !deleting(p) && template_hash(p) == want)
                .filter(|p| s(p, "/spec/nodeName").is_some_and(|n| !n.is_empty()))
                .count() as i64;
            template_hash(o) == want
                && int(o, "/status/observedGeneration") >= int(o, "/metadata/generation")
                && placed >= int(o, "/spec/replicas")
                // A scale-up this pass applies: the new pods are still to come.
                && int(d, "/spec/replicas") <= int(o, "/spec/replicas")
        });
        if !settled {
            awaited.insert(pool);
        }
    }
    awaited
}

/// Model deployments whose vLLM Deployment is replacing pods, each with the nodes its old pods
/// run on (where the old pods are decides whether the rollout needs a spare node).
pub type Rollouts = BTreeMap<Uuid, BTreeSet<String>>;

/// The model deployments whose vLLM Deployment is replacing pods: it exists and either carries
/// another template than `desired` or still has pods of another template. A scale change or a
/// first creation is not a rollout.
pub fn rollouts(desired: &[Value], observed: &[Value]) -> Rollouts {
    desired
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .filter_map(|d| {
            let model = s(
                d,
                &format!(
                    "/metadata/labels/{}",
                    names::MODEL_ID_LABEL.replace('/', "~1")
                ),
            )?
            .parse::<Uuid>()
            .ok()?;
            // The hash the pods carry: only the model servers' templates have one.
            let want = template_hash(&d["spec"]["template"])?;
            let o = observed_of(d, observed)?;
            let old_pods: Vec<&Value> = pods_of(d, observed)
                .into_iter()
                .filter(|p| !pod_finished(p) && !deleting(p) && template_hash(p) != Some(want))
                .collect();
            let nodes = old_pods
                .iter()
                .filter_map(|p| s(p, "/spec/nodeName"))
                .map(str::to_string)
                .collect();
            (template_hash(o) != Some(want) || !old_pods.is_empty()).then_some((model, nodes))
        })
        .collect()
}

/// The DI's GPU nodes: Nodes labelled with its id (node pools carry the label and DOKS puts
/// pool labels on their nodes), sorted by name.
pub fn accelerators(di_id: &Uuid, observed: &[Value]) -> Vec<ObservedAccelerator> {
    let di = di_id.to_string();
    let label = |n: &Value, k: &str| {
        n.pointer("/metadata/labels")
            .and_then(|l| l.get(k))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let mut out: Vec<ObservedAccelerator> = observed
        .iter()
        .filter(|n| n["kind"] == "Node" && label(n, names::DI_ID_LABEL).as_deref() == Some(&di))
        .map(|n| ObservedAccelerator {
            name: s(n, "/metadata/name").unwrap_or("").to_string(),
            slug: label(n, names::INSTANCE_TYPE_LABEL).unwrap_or_default(),
            status: if deleting(n) {
                "deleting"
            } else if condition(n, "Ready") == Some("True") {
                "active"
            } else {
                "provisioning"
            }
            .to_string(),
            pool: label(n, names::NODE_POOL_LABEL).unwrap_or_default(),
            model_id: label(n, names::MODEL_ID_LABEL).and_then(|m| m.parse().ok()),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Whether [`assess`] judges an object of this kind by its status, so that the server's answer
/// to an apply of it says whether the change has taken effect. Other kinds (routes, pools,
/// configuration, secrets) show that nowhere the assessment reads: a later pass sees them.
pub fn judged_by_status(o: &Value) -> bool {
    matches!(o["kind"].as_str(), Some("Deployment" | "SecurityPolicy"))
        || (o["kind"] == "Service" && o["spec"]["type"] == "LoadBalancer")
}

/// Compares `desired` (the output of [`super::manifests::manifests`]) with `observed` (the
/// Deployments, Pods and Services of the DI's namespace and the cluster's Nodes, in any order).
/// Ready means every Deployment has all replicas of the desired template ready and no old ones,
/// and every LoadBalancer Service has an address.
pub fn assess(di_id: &Uuid, desired: &[Value], observed: &[Value]) -> Assessment {
    let mut waiting_for = Vec::new();
    let mut out = Assessment::default();
    for d in desired {
        match d["kind"].as_str() {
            Some("Deployment") => waiting_for.extend(deployment_waits(d, observed)),
            Some("SecurityPolicy") => waiting_for.extend(policy_waits(d, observed)),
            Some("Service") if d["spec"]["type"] == "LoadBalancer" => {
                let name = s(d, "/metadata/name").unwrap_or("");
                let url = observed_of(d, observed).and_then(endpoint_url);
                match (&url, name) {
                    (None, _) => waiting_for.push(ObjectWait::LoadBalancer {
                        name: name.to_string(),
                    }),
                    (Some(_), names::PUBLIC_SERVICE) => out.public_endpoint = url,
                    (Some(_), names::PRIVATE_SERVICE) => out.private_endpoint = url,
                    _ => {}
                }
            }
            _ => {}
        }
    }
    out.progress = Progress {
        ready: waiting_for.is_empty(),
        waiting_for,
    };
    out.accelerators = accelerators(di_id, observed);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits as an event would print them, one per line.
    fn text(waits: &[ObjectWait]) -> String {
        waits
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    }
    use crate::manifests::{manifests, ManifestInput, TlsPair};
    use crate::model::{models, tests::deployment};
    use serde_json::json;

    const DI: &str = "0d1e2f3a-0000-4000-8000-00000000d1d1";
    const M1: &str = "aaaaaaaa-0000-4000-8000-000000000001";

    fn di() -> Uuid {
        DI.parse().unwrap()
    }

    fn desired(scale: i32, public: bool, hf: bool) -> Vec<Value> {
        let mut i = ManifestInput::new(
            di(),
            models(&[deployment(M1, "org/m", "gpu-h100x1-80gb", scale)]).unwrap(),
            public,
            TlsPair {
                cert_pem: "C".into(),
                key_pem: "K".into(),
            },
        );
        if hf {
            i.hugging_face_token = Some("hf".into());
        }
        manifests(&i)
    }

    /// The desired objects as a converged cluster would show them.
    fn converged(desired: &[Value]) -> Vec<Value> {
        let mut out = Vec::new();
        for d in desired {
            let mut o = d.clone();
            if d["kind"] == "Deployment" {
                let r = d["spec"]["replicas"].as_i64().unwrap();
                o["metadata"]["generation"] = json!(2);
                o["status"] = json!({"observedGeneration": 2, "replicas": r, "updatedReplicas": r,
                                     "readyReplicas": r, "availableReplicas": r});
                for i in 0..r {
                    let mut meta = d["spec"]["template"]["metadata"].clone();
                    meta["name"] =
                        json!(format!("{}-{i}", d["metadata"]["name"].as_str().unwrap()));
                    meta["namespace"] = d["metadata"]["namespace"].clone();
                    out.push(json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                        "spec": {"nodeName": format!("node-{i}")},
                        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}));
                }
            }
            if d["kind"] == "SecurityPolicy" {
                o["metadata"]["generation"] = json!(1);
                o["status"] = json!({"ancestors": [{"ancestorRef": d["spec"]["targetRefs"][0],
                    "controllerName": "c", "conditions": [{"type": "Accepted", "status": "True",
                    "observedGeneration": 1}]}]});
            }
            if d["spec"]["type"] == "LoadBalancer" {
                let port = if d["metadata"]["name"] == "inference-public" {
                    8443
                } else {
                    443
                };
                o["status"] = json!({"loadBalancer": {"ingress": [{"ip": "127.0.0.1", "ports": [{"port": port, "protocol": "TCP"}]}]}});
            }
            out.push(o);
        }
        out
    }

    fn node(name: &str, di: &str, ready: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            names::DI_ID_LABEL: di, names::MODEL_ID_LABEL: M1,
            names::INSTANCE_TYPE_LABEL: "gpu-h100x1-80gb", names::NODE_POOL_LABEL: "p"}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}})
    }

    /// The endpoint's authentication is in force only once the gateway's controller accepted
    /// the policy, for its current generation.
    #[test]
    fn an_auth_policy_not_accepted_keeps_the_di_waiting() {
        let d = desired(1, true, false);
        let mut o = converged(&d);
        let policy = |o: &mut Vec<Value>| {
            o.iter_mut()
                .find(|x| x["kind"] == "SecurityPolicy")
                .unwrap()
                .clone()
        };
        let set = |o: &mut Vec<Value>, v: Value| {
            *o.iter_mut()
                .find(|x| x["kind"] == "SecurityPolicy")
                .unwrap() = v;
        };
        assert!(assess(&di(), &d, &o).progress.ready);
        let mut p = policy(&mut o);
        p["metadata"]["generation"] = json!(2);
        set(&mut o, p.clone());
        let a = assess(&di(), &d, &o);
        assert_eq!(
            text(&a.progress.waiting_for),
            "securitypolicy endpoint-auth: not accepted yet"
        );
        p["status"]["ancestors"][0]["conditions"] = json!([{"type": "Accepted",
            "status": "False", "observedGeneration": 2, "message": "backend Service di-x/endpoint-auth not found"}]);
        set(&mut o, p.clone());
        let a = assess(&di(), &d, &o);
        assert_eq!(
            text(&a.progress.waiting_for),
            "securitypolicy endpoint-auth: not accepted: backend Service di-x/endpoint-auth not found"
        );
        p["status"] = json!({});
        set(&mut o, p);
        assert!(!assess(&di(), &d, &o).progress.ready);
        o.retain(|x| x["kind"] != "SecurityPolicy");
        assert!(!assess(&di(), &d, &o).progress.ready, "a missing policy");
    }

    /// The gateway's traffic policy (`Retry-After` after a cold start) is best effort: a
    /// controller that never accepts it leaves the DI serving, and so ready.
    #[test]
    fn a_traffic_policy_not_accepted_keeps_nothing_waiting() {
        let d = desired(1, true, false);
        let mut o = converged(&d);
        let p = o
            .iter_mut()
            .find(|x| x["kind"] == "BackendTrafficPolicy")
            .expect("rendered");
        p["status"] =
            json!({"ancestors": [{"conditions": [{"type": "Accepted", "status": "False"}]}]});
        assert!(assess(&di(), &d, &o).progress.ready);
        o.retain(|x| x["kind"] != "BackendTrafficPolicy");
        assert!(assess(&di(), &d, &o).progress.ready);
    }

    #[test]
    fn converged_cluster_is_ready_with_endpoints() {
        let d = desired(2, true, false);
        let a = assess(&di(), &d, &converged(&d));
        assert_eq!(
            a.progress,
            Progress {
                ready: true,
                waiting_for: vec![]
            }
        );
        assert_eq!(a.private_endpoint.as_deref(), Some("https://127.0.0.1"));
        assert_eq!(a.public_endpoint.as_deref(), Some("https://127.0.0.1:8443"));
    }

    #[test]
    fn nothing_observed_waits_for_everything() {
        let d = desired(1, true, false);
        let a = assess(&di(), &d, &[]);
        assert!(!a.progress.ready);
        let w = text(&a.progress.waiting_for);
        assert!(
            w.contains("deployment vllm-aaaaaaaa: not created yet"),
            "{w}"
        );
        assert!(
            w.contains("deployment pool-aaaaaaaa-epp: not created yet"),
            "{w}"
        );
        assert!(w.contains("service inference-private: waiting"), "{w}");
        assert!(w.contains("service inference-public: waiting"), "{w}");
        assert_eq!(a.public_endpoint, None);
    }

    #[test]
    fn replicas_not_ready_and_old_pods_are_reported() {
        let d = desired(2, false, false);
        let mut o = converged(&d);
        let dep = o
            .iter_mut()
            .find(|o| o["metadata"]["name"] == "vllm-aaaaaaaa" && o["kind"] == "Deployment")
            .unwrap();
        dep["status"]["readyReplicas"] = json!(1);
        dep["status"]["availableReplicas"] = json!(1);
        dep["status"]["replicas"] = json!(3);
        let a = assess(&di(), &d, &o);
        assert!(!a.progress.ready);
        assert_eq!(
            text(&a.progress.waiting_for),
            "deployment vllm-aaaaaaaa: 1 of 2 replicas ready, 1 old replicas still running"
        );
    }

    #[test]
    fn unapplied_template_or_stale_generation_is_not_ready() {
        let d = desired(1, false, false);
        let o = converged(&desired(1, false, true));
        let a = assess(&di(), &d, &o);
        assert!(
            a.progress.waiting_for[0]
                .to_string()
                .contains("new version not applied"),
            "{a:?}"
        );
        let mut o = converged(&d);
        for x in o.iter_mut().filter(|x| x["kind"] == "Deployment") {
            x["metadata"]["generation"] = json!(3);
        }
        assert!(!assess(&di(), &d, &o).progress.ready);
    }

    #[test]
    fn rollouts_detect_template_changes_not_scale_changes() {
        let d1 = desired(2, false, false);
        let m1: Uuid = M1.parse().unwrap();
        // First creation: nothing observed, no rollout.
        assert!(rollouts(&d1, &[]).is_empty());
        // Converged: none.
        assert!(rollouts(&d1, &converged(&d1)).is_empty());
        // Scale change only: none.
        assert!(rollouts(&desired(4, false, false), &converged(&d1)).is_empty());
        // Template change, not applied yet: rollout.
        let d2 = desired(2, false, true);
        assert_eq!(
            rollouts(&d2, &converged(&d1)).keys().collect::<Vec<_>>(),
            vec![&m1]
        );
        // Applied, old pods still there: rollout.
        let mut mid = converged(&d1);
        let new_dep = converged(&d2)
            .into_iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "vllm-aaaaaaaa")
            .unwrap();
        for x in mid.iter_mut() {
            if x["kind"] == "Deployment" && x["metadata"]["name"] == "vllm-aaaaaaaa" {
                *x = new_dep.clone();
            }
        }
        assert_eq!(rollouts(&d2, &mid).keys().collect::<Vec<_>>(), vec![&m1]);
        // Old pods gone: over.
        assert!(rollouts(&d2, &converged(&d2)).is_empty());
    }

    #[test]
    fn a_pool_is_awaited_until_every_pod_it_wants_is_on_a_node() {
        let d = desired(2, false, false);
        let vllm =
            |o: &Value| o["kind"] == "Deployment" && o["metadata"]["name"] == "vllm-aaaaaaaa";
        let pool = d.iter().find(|o| vllm(o)).unwrap()["spec"]["template"]["spec"]["nodeSelector"]
            [names::NODE_POOL_LABEL]
            .as_str()
            .unwrap()
            .to_string();
        let is_vllm_pod = |o: &Value| {
            o["kind"] == "Pod"
                && o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("vllm-"))
        };
        // Not applied yet: its pods are still to come.
        assert!(awaited_pools(&d, &[]).contains(&pool));
        // Every pod it wants on a node: nothing more can be placed there.
        assert!(awaited_pools(&d, &converged(&d)).is_empty());
        // A pod waiting to be placed.
        let mut waiting = converged(&d);
        let pod = waiting.iter_mut().find(|o| is_vllm_pod(o)).unwrap();
        pod["spec"] = json!({"nodeSelector": {names::NODE_POOL_LABEL: pool}});
        assert_eq!(awaited_pools(&d, &waiting), BTreeSet::from([pool.clone()]));
        // One pod of the two it wants not created yet (the controller gets to it).
        let mut short = converged(&d);
        let first = short.iter().position(is_vllm_pod).unwrap();
        short.remove(first);
        assert!(awaited_pools(&d, &short).contains(&pool));
        // A scale-up this pass applies: its new pods are still to come.
        assert!(awaited_pools(&desired(3, false, false), &converged(&d)).contains(&pool));
        // The controller has not seen the last change.
        let mut stale = converged(&d);
        let dep = stale.iter_mut().find(|o| vllm(o)).unwrap();
        dep["status"]["observedGeneration"] = json!(1);
        assert!(awaited_pools(&d, &stale).contains(&pool));
    }

    #[test]
    fn accelerators_are_the_dis_nodes() {
        let other = Uuid::new_v4().to_string();
        let observed = vec![
            node("n-b", DI, "False"),
            node("n-a", DI, "True"),
            node("n-x", &other, "True"),
        ];
        let acc = accelerators(&di(), &observed);
        assert_eq!(acc.len(), 2);
        assert_eq!(acc[0].name, "n-a");
        assert_eq!(acc[0].status, "active");
        assert_eq!(acc[0].slug, "gpu-h100x1-80gb");
        assert_eq!(acc[0].model_id, Some(M1.parse().unwrap()));
        assert_eq!(acc[1].status, "provisioning");
    }

    #[test]
    fn endpoint_urls() {
        let svc = |ing: Value| json!({"status": {"loadBalancer": {"ingress": ing}}});
        assert_eq!(endpoint_url(&svc(json!([]))), None);
        assert_eq!(
            endpoint_url(&svc(json!([{"ip": "10.1.2.3"}]))).as_deref(),
            Some("https://10.1.2.3")
        );
        assert_eq!(
            endpoint_url(&svc(
                json!([{"ip": "127.0.0.1", "ports": [{"port": 40123}]}])
            ))
            .as_deref(),
            Some("https://127.0.0.1:40123")
        );
        assert_eq!(
            endpoint_url(&svc(json!([{"hostname": "lb.example"}]))).as_deref(),
            Some("https://lb.example")
        );
        assert_eq!(
            endpoint_url(&svc(json!([{"ip": "2001:db8::1"}]))).as_deref(),
            Some("https://[2001:db8::1]")
        );
    }

    #[test]
    fn busy_nodes_ignore_finished_and_stuck_pods() {
        let pods = vec![
            json!({"kind": "Pod", "spec": {"nodeName": "a"}, "status": {"phase": "Running"}}),
            json!({"kind": "Pod", "spec": {"nodeName": "b"}, "status": {"phase": "Succeeded"}}),
            json!({"kind": "Pod", "spec": {}, "status": {"phase": "Pending"}}),
            // Going, its grace period not over: its requests finish there.
            json!({"kind": "Pod", "metadata": {"deletionTimestamp": "1970-01-01T00:16:40Z"},
                   "spec": {"nodeName": "c"}, "status": {"phase": "Running"}}),
        ];
        let busy = |now: u64| busy_nodes(&pods, at(now));
        assert_eq!(
            busy(1000),
            BTreeSet::from(["a".to_string(), "c".to_string()])
        );
        // Long past it: stuck on a node that does not answer, it holds it no more.
        assert_eq!(busy(1100), BTreeSet::from(["a".to_string()]));
    }

    /// `converged(d)` with pod `vllm-aaaaaaaa-{i}` crash-looping after `restarts` restarts, its
    /// last run having ended at `finished` with `message`.
    fn crash_looping(
        d: &[Value],
        i: usize,
        restarts: i64,
        finished: &str,
        message: &str,
    ) -> Vec<Value> {
        let mut o = converged(d);
        let pod = o
            .iter_mut()
            .find(|p| p["kind"] == "Pod" && p["metadata"]["name"] == format!("vllm-aaaaaaaa-{i}"))
            .unwrap();
        pod["status"] = json!({"phase": "Running",
            "conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
            "containerStatuses": [{"name": "vllm", "ready": false, "restartCount": restarts,
                "state": {"waiting": {"reason": "CrashLoopBackOff",
                    "message": "back-off 20s restarting failed container=vllm pod=x"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                    "startedAt": "2030-01-01T00:00:04Z", "finishedAt": finished}}}]});
        let dep = o
            .iter_mut()
            .find(|x| x["kind"] == "Deployment" && x["metadata"]["name"] == "vllm-aaaaaaaa")
            .unwrap();
        dep["status"]["readyReplicas"] = json!(1);
        dep["status"]["availableReplicas"] = json!(1);
        o
    }

    const REFUSED: &str = "RepositoryNotFoundError: 401 Client Error.\n\nRepository Not Found for url: http://hub/org/m/resolve/main/config.json.";

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// 2030-01-01T00:00:00Z: when the rollout in these tests began.
    const BEGAN: u64 = 1_893_456_000;

    #[test]
    fn a_model_server_crash_looping_since_the_rollout_began_cannot_load_its_model() {
        let d = desired(2, false, false);
        let o = crash_looping(&d, 1, 2, "2030-01-01T00:00:05Z", REFUSED);
        let f = load_failure(&d, &o, at(BEGAN)).expect("a load failure");
        assert_eq!(
            f,
            LoadFailure {
                deployment: "vllm-aaaaaaaa".into(),
                model: Some("org/m".into()),
                pod: "vllm-aaaaaaaa-1".into(),
                restarts: 2,
                message: "RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: http://hub/org/m/resolve/main/config.json.".into(),
            }
        );
        assert_eq!(
            f.to_string(),
            "Model org/m failed to load (pod vllm-aaaaaaaa-1, restarted 2 times): RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: http://hub/org/m/resolve/main/config.json."
        );
        // While the pass waits, it says which pod fails and why (without the restart count, so
        // the text stays the same while the pod keeps failing alike).
        let a = assess(&di(), &d, &o);
        assert_eq!(
            text(&a.progress.waiting_for),
            format!("deployment vllm-aaaaaaaa: 1 of 2 replicas ready, pod vllm-aaaaaaaa-1 cannot load its model: {}", f.message)
        );
    }

    #[test]
    fn a_blip_a_failure_before_the_rollout_a_restarted_server_or_an_old_template_is_not_a_load_failure(
    ) {
        let d = desired(2, false, false);
        // One failure may be a blip.
        let o = crash_looping(&d, 0, 1, "2030-01-01T00:00:05Z", REFUSED);
        assert_eq!(load_failure(&d, &o, at(BEGAN)), None);
        // A failure from before the rollout began: the next restart may load (a new token).
        let o = crash_looping(&d, 0, 3, "2029-12-31T23:59:59Z", REFUSED);
        assert_eq!(load_failure(&d, &o, at(BEGAN)), None);
        // Restarted and loading again: not crash-looping now.
        let mut o = crash_looping(&d, 0, 3, "2030-01-01T00:00:05Z", REFUSED);
        for p in o.iter_mut().filter(|p| p["kind"] == "Pod") {
            if let Some(cs) = p.pointer_mut("/status/containerStatuses/0") {
                cs["state"] = json!({"running": {"startedAt": "2030-01-01T00:00:06Z"}});
            }
        }
        assert_eq!(load_failure(&d, &o, at(BEGAN)), None);
        // No message to tell: not this.
        let o = crash_looping(&d, 0, 3, "2030-01-01T00:00:05Z", "  ");
        assert_eq!(load_failure(&d, &o, at(BEGAN)), None);
        // Pods of the template being replaced do not count: the new one has not been tried.
        let o = crash_looping(&d, 0, 3, "2030-01-01T00:00:05Z", REFUSED);
        assert_eq!(load_failure(&desired(2, false, true), &o, at(BEGAN)), None);
        // Nothing failing.
        assert_eq!(load_failure(&d, &converged(&d), at(BEGAN)), None);
    }

    #[test]
    fn container_messages_are_one_line_without_tokens_and_cut_short() {
        assert_eq!(clean_message("a\n\n  b\tc "), "a b c");
        assert_eq!(
            clean_message(
                "Bearer hf_abcdefghijklmnopqrstuvwxyz012 refused (token=hf_ABCDEFGHIJKLMNOPQRSTU)"
            ),
            "Bearer hf_*** refused (token=hf_***)"
        );
        assert_eq!(clean_message("org/hf_model"), "org/hf_model");
        let traceback = format!(
            "Traceback (most recent call last):\n{}huggingface_hub.errors.GatedRepoError: 403 Client Error.",
            "  File \"/usr/lib/python3/x.py\", line 1, in f\n".repeat(40)
        );
        let long = clean_message(&traceback);
        assert_eq!(long.chars().count(), MAX_LOAD_MESSAGE_CHARS);
        assert!(long.starts_with('…'), "{long}");
        assert!(
            long.ends_with("huggingface_hub.errors.GatedRepoError: 403 Client Error."),
            "{long}"
        );
    }

    #[test]
    fn kubernetes_timestamps_parse() {
        assert_eq!(
            parse_time("1970-01-01T00:00:00Z"),
            Some(SystemTime::UNIX_EPOCH)
        );
        assert_eq!(parse_time("2030-01-01T00:00:00Z"), Some(at(BEGAN)));
        assert_eq!(
            parse_time("2024-02-29T12:34:56.5+01:00"),
            Some(at(1_709_206_496) + Duration::from_millis(500))
        );
        assert_eq!(parse_time("2024-02-29"), None);
        assert_eq!(parse_time("2024-13-01T00:00:00Z"), None);
        assert_eq!(parse_time("not a time at all!!"), None);
    }
}
