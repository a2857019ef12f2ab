//! The autoscaler's look at a cluster: for each model deployment that declares `autoscaling`,
//! read its ready model servers' vLLM metrics and its endpoint picker's queue through the API
//! server's pod proxy (as a control plane outside a DOKS cluster reads them), and let
//! [`plan::autoscale::decide`] say how many replicas it should run. Deployments without
//! `autoscaling` keep their spec's scale. The counts then flow through the same converge as a
//! customer's scale change: node pools, then the vLLM Deployment, without dropping a request.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use api_types::regional::StoredSpec;
use cloud_clients::KubeClient;
use region_store::DeploymentReplicas;
use serde_json::Value;
use uuid::Uuid;

use crate::plan::autoscale::{self, Decision, Look, Memory, Policy, Scrape};
use crate::plan::{manifests, names};

/// A deployment's count for this pass.
#[derive(Debug, Clone)]
pub struct Scaled {
    pub model_id: Uuid,
    pub wanted: u32,
    /// The autoscaler's memory to keep (`None`: not autoscaled, or not steady).
    pub memory: Option<Memory>,
    /// Whether `memory` says what the recorded memory does not and a takeover would need
    /// ([`Memory::news_since`]); when not, it is kept in [`Recall`] only.
    pub memory_news: bool,
    pub decision: Option<Decision>,
    /// Requests in flight on each ready model server, when this pass read them.
    pub in_flight: BTreeMap<String, f64>,
}

fn label<'a>(o: &'a Value, key: &str) -> Option<&'a str> {
    o.pointer("/metadata/labels")
        .and_then(|l| l.get(key))
        .and_then(Value::as_str)
}

fn running_and_ready(pod: &Value) -> bool {
    let deleting = pod
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null());
    let ready = pod
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
    !deleting && pod.pointer("/status/phase").and_then(Value::as_str) == Some("Running") && ready
}

fn pod_name(pod: &Value) -> &str {
    pod.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// The ready model servers of a deployment, by pod name: the pods its InferencePool selects
/// (its endpoint picker carries the deployment's id too, but is not one).
pub fn ready_servers(observed: &[Value], model_id: &Uuid) -> Vec<String> {
    let selector = manifests::pool_selector(model_id);
    let selector = selector.as_object().expect("a label map");
    let mut pods: Vec<String> = observed
        .iter()
        .filter(|o| o["kind"] == "Pod")
        .filter(|o| selector.iter().all(|(k, v)| label(o, k) == v.as_str()))
        .filter(|o| running_and_ready(o))
        .map(|o| pod_name(o).to_string())
        .collect();
    pods.sort();
    pods
}

/// How long one metrics read may take: a server that answers slower is left out of the look.
const READ_TIMEOUT: Duration = Duration::from_secs(3);

async fn read(
    get: impl std::future::Future<Output = Result<String, cloud_clients::KubeError>>,
) -> Result<String, String> {
    match tokio::time::timeout(READ_TIMEOUT, get).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {READ_TIMEOUT:?}")),
    }
}

/// One look at the deployment's servers and picker. A server that cannot be read is left out
/// (it counts as not ready for this look); an unreadable picker holds nothing.
async fn look(kube: &KubeClient, ns: &str, observed: &[Value], model_id: &Uuid) -> Look {
    let servers = ready_servers(observed, model_id);
    let reads = servers.iter().map(|pod| async move {
        let text = read(kube.pod_proxy_get(ns, pod, manifests::VLLM_PORT, "/metrics")).await;
        (pod.clone(), text)
    });
    let pool = names::inference_pool(model_id);
    let picker = observed
        .iter()
        .filter(|o| o["kind"] == "Pod" && label(o, names::EPP_LABEL) == Some(pool.as_str()))
        .find(|o| o.pointer("/status/phase").and_then(Value::as_str) == Some("Running"))
        .map(|o| pod_name(o).to_string());
    let held = async {
        let pod = picker?;
        let text = read(kube.pod_proxy_get(ns, &pod, manifests::EPP_METRICS_PORT, "/metrics"))
            .await
            .map_err(|e| tracing::debug!(pod, error = %e, "endpoint picker metrics unreadable"))
            .ok()?;
        Some(autoscale::parse_epp_queue(&text, &pool))
    };
    let (reads, held) = futures::join!(futures::future::join_all(reads), held);
    let unread: Vec<String> = reads
        .iter()
        .filter(|(_, t)| t.is_err())
        .map(|(pod, _)| pod.clone())
        .collect();
    let ready: BTreeMap<String, Scrape> = reads
        .into_iter()
        .filter_map(|(pod, text)| match text {
            Ok(t) => Some((pod, autoscale::parse_vllm(&t))),
            Err(e) => {
                tracing::debug!(pod, error = %e, "model server metrics unreadable");
                None
            }
        })
        .collect();
    Look {
        ready,
        held,
        unread,
    }
}

/// The memory recorded for deployment `model_id`, if any and readable.
fn recorded_memory(recorded: &[DeploymentReplicas], model_id: Uuid) -> Option<Memory> {
    let value = recorded
        .iter()
        .find(|r| r.model_id == model_id)?
        .autoscaler
        .clone()?;
    serde_json::from_value(value).ok()
}

/// The newest memory of each autoscaled deployment this worker looked at, where a look changed
/// only what is not worth a write ([`Memory::news_since`]): under load every look moves the
/// servers' counters, and writing them made each look a transaction (about 100 a second at
/// 1,000 autoscaled DIs). Each entry names the recorded memory it grew from and is used only
/// while that is still what the database holds: once another worker has written the
/// deployment's memory, this one starts from the record again.
#[derive(Default)]
pub struct Recall(Mutex<RecallInner>);

#[derive(Default)]
struct RecallInner {
    /// Deployment (model id) → (the recorded memory, the newest, when last used).
    newest: HashMap<Uuid, (Option<serde_json::Value>, Memory, Instant)>,
    swept: Option<Instant>,
}

/// Entries no look used for this long are dropped: their DIs are gone, or another worker
/// looks at them.
const RECALL_UNUSED: Duration = Duration::from_secs(30 * 60);

impl Recall {
    /// The newest memory of `model_id`, if it grew from what `recorded` holds for it.
    fn newest(&self, model_id: Uuid, recorded: &[DeploymentReplicas]) -> Option<Memory> {
        let held = recorded
            .iter()
            .find(|r| r.model_id == model_id)
            .and_then(|r| r.autoscaler.as_ref());
        let mut inner = self.0.lock().expect("recall");
        let (from, memory, used) = inner.newest.get_mut(&model_id)?;
        if from.as_ref() != held {
            return None;
        }
        *used = Instant::now();
        Some(memory.clone())
    }

    /// Keeps `newest` as grown from `recorded`, the memory the database holds now.
    pub fn keep(&self, model_id: Uuid, recorded: Option<serde_json::Value>, newest: Memory) {
        let now = Instant::now();
        let mut inner = self.0.lock().expect("recall");
        if inner
            .swept
            .is_none_or(|t| now.duration_since(t) >= RECALL_UNUSED)
        {
            inner.swept = Some(now);
            inner
                .newest
                .retain(|_, (_, _, used)| now.duration_since(*used) < RECALL_UNUSED);
        }
        inner.newest.insert(model_id, (recorded, newest, now));
    }
}

/// Each deployment's count for this pass. `steady`: the DI is active with nothing to roll
/// out. An autoscaled deployment keeps its count across a customer's change (a PATCH that
/// raises `max_replicas` under load must not shrink it back to `scale`), clamped to the new
/// bounds and to at least one while the change rolls out (the rollout ends with a call that a
/// replica must answer); a deployment seen for the first time starts at its spec's `scale`.
#[allow(clippy::too_many_arguments)]
pub async fn decide_all(
    kube: &KubeClient,
    ns: &str,
    spec: &StoredSpec,
    steady: bool,
    observed: &[Value],
    recorded: &[DeploymentReplicas],
    recall: &Recall,
    now_ms: i64,
    scale_down_window: Duration,
) -> Vec<Scaled> {
    let mut out = Vec::new();
    for md in &spec.model_deployments {
        let Some(model_id) = md.model_id else {
            continue;
        };
        let scale = md
            .accelerators
            .first()
            .map_or(0, |g| u32::try_from(g.scale).unwrap_or(0));
        let Some(policy) = Policy::of(md) else {
            out.push(Scaled {
                model_id,
                wanted: scale,
                memory: None,
                memory_news: false,
                decision: None,
                in_flight: BTreeMap::new(),
            });
            continue;
        };
        let remembered = remembered_memory(recall, recorded, model_id);
        let carried = remembered.as_ref().map_or(scale, |m| m.wanted);
        if !steady {
            out.push(rolling_out(model_id, &policy, carried, remembered));
            continue;
        }
        let memory = steady_memory(remembered, spec.version, &policy, carried, now_ms);
        let seen = look(kube, ns, observed, &model_id).await;
        let outcome = autoscale::decide(&policy, &memory, &seen, now_ms, scale_down_window);
        let memory_news = recorded_memory(recorded, model_id)
            .is_none_or(|r| outcome.memory.news_since(&r, policy.memory_slack()));
        out.push(Scaled {
            model_id,
            wanted: outcome.memory.wanted,
            decision: outcome.decision,
            memory: Some(outcome.memory),
            memory_news,
            in_flight: in_flight(&seen),
        });
    }
    out
}

/// The memory deployment `model_id` carries on from: this worker's newest while it grew from
/// the record ([`Recall`]), else the recorded one (an unreadable one is warned of and dropped).
fn remembered_memory(
    recall: &Recall,
    recorded: &[DeploymentReplicas],
    model_id: Uuid,
) -> Option<Memory> {
    recall.newest(model_id, recorded).or_else(|| {
        recorded_memory(recorded, model_id).or_else(|| {
            let unreadable = recorded
                .iter()
                .any(|r| r.model_id == model_id && r.autoscaler.is_some());
            if unreadable {
                tracing::warn!(model = %model_id, "autoscaler memory unreadable; starting again");
            }
            None
        })
    })
}

/// While the DI is not steady, an autoscaled deployment keeps its `carried` count, within the
/// bounds and at least one; its servers are not looked at.
fn rolling_out(
    model_id: Uuid,
    policy: &Policy,
    carried: u32,
    remembered: Option<Memory>,
) -> Scaled {
    let wanted = carried.clamp(policy.min.max(1), policy.max.max(1));
    Scaled {
        model_id,
        wanted,
        // Kept with its old version: the first steady look starts from this count.
        memory: remembered.map(|m| Memory { wanted, ..m }),
        memory_news: true,
        decision: None,
        in_flight: BTreeMap::new(),
    }
}

/// The memory a steady look decides from: the remembered one if it is of the spec's `version`,
/// else a new start.
fn steady_memory(
    remembered: Option<Memory>,
    version: i32,
    policy: &Policy,
    carried: u32,
    now_ms: i64,
) -> Memory {
    match remembered {
        Some(m) if m.version == version => m,
        // A new version starts from the count it rolled out with, and from the servers'
        // last counters (the same servers may serve on: their history is not new load).
        other => {
            let start = carried.clamp(policy.min, policy.max.max(policy.min));
            Memory {
                last: other.map(|m| m.last).unwrap_or_default(),
                ..Memory::start(version, start, now_ms)
            }
        }
    }
}

fn in_flight(seen: &Look) -> BTreeMap<String, f64> {
    seen.ready
        .iter()
        .map(|(pod, s)| (pod.clone(), s.running + s.waiting))
        .collect()
}

/// Before a model deployment's vLLM Deployment shrinks (the autoscaler's count or the
/// customer's scale below what it runs), marks each ready model server with its requests in
/// flight as its `pod-deletion-cost`, so that Kubernetes removes the least busy ones and the
/// busiest keep their streams. Reads the servers when this pass has not. A mark that cannot be
/// written leaves the choice to Kubernetes: worth a warning, not a failed pass.
pub async fn mark_least_busy(kube: &KubeClient, ns: &str, observed: &[Value], scaled: &[Scaled]) {
    for x in scaled {
        let name = names::vllm_deployment(&x.model_id);
        let running = observed
            .iter()
            .find(|o| {
                o["kind"] == "Deployment"
                    && o.pointer("/metadata/name").and_then(Value::as_str) == Some(&name)
            })
            .and_then(|d| d.pointer("/spec/replicas").and_then(Value::as_i64))
            .unwrap_or(0);
        if i64::from(x.wanted) >= running {
            continue;
        }
        let in_flight = if x.in_flight.is_empty() {
            self::in_flight(&look(kube, ns, observed, &x.model_id).await)
        } else {
            x.in_flight.clone()
        };
        let marked: BTreeMap<String, String> = observed
            .iter()
            .filter(|o| o["kind"] == "Pod")
            .filter_map(|p| {
                let cost = p
                    .pointer("/metadata/annotations")?
                    .get(autoscale::POD_DELETION_COST)?;
                Some((pod_name(p).to_string(), cost.as_str()?.to_string()))
            })
            .collect();
        for (pod, cost) in autoscale::deletion_costs(&in_flight, &marked) {
            let marked = kube
                .annotate(
                    "v1",
                    "Pod",
                    Some(ns),
                    &pod,
                    autoscale::POD_DELETION_COST,
                    &cost,
                )
                .await;
            if let Err(e) = marked {
                tracing::warn!(pod, error = %e, "could not mark the model server's deletion cost; Kubernetes chooses which replica goes");
            }
        }
    }
}

/// How long after the cloud refused a scale-up (no GPU capacity) the autoscaler waits before
/// asking again.
pub const REFUSED_BACKOFF_MS: i64 = 5 * 60 * 1000;

/// The counts after the cloud refused to grow a node pool: each autoscaled deployment that
/// wanted more than it runs goes back to what it runs (within its bounds), asks for no more for
/// [`REFUSED_BACKOFF_MS`], and says why in an event. `None` when no autoscaled count can come
/// down: the refusal is then the DI's error, as for a customer's own scale.
pub fn after_refusal(
    spec: &StoredSpec,
    scaled: &[Scaled],
    observed: &[Value],
    why: &str,
    now_ms: i64,
) -> Option<Vec<Scaled>> {
    let mut lowered = false;
    let out = scaled
        .iter()
        .map(|x| {
            let policy = spec
                .model_deployments
                .iter()
                .find(|md| md.model_id == Some(x.model_id))
                .and_then(Policy::of);
            let (Some(policy), Some(memory)) = (policy, &x.memory) else {
                return x.clone();
            };
            let ready = ready_servers(observed, &x.model_id).len() as u32;
            let back = ready.max(policy.min);
            if back >= x.wanted {
                return x.clone();
            }
            lowered = true;
            Scaled {
                model_id: x.model_id,
                wanted: back,
                in_flight: x.in_flight.clone(),
                memory_news: true,
                memory: Some(Memory {
                    wanted: back,
                    changed_at: now_ms,
                    calm_since: None,
                    up_refused_until: Some(now_ms + REFUSED_BACKOFF_MS),
                    ..memory.clone()
                }),
                decision: Some(Decision {
                    reason: "ScaleUpRefused",
                    message: format!(
                        "{why}: {} → {back} replicas; no scale-up for {} minutes",
                        x.wanted,
                        REFUSED_BACKOFF_MS / 60_000
                    ),
                }),
            }
        })
        .collect();
    lowered.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The endpoint picker's pod carries the deployment's model-id label, so `ready_servers`
    /// counts it as a model server: its port 8000 never answers, every look has `unread` >= 1,
    /// and the deployment never scales down or to zero (and GET shows ready = replicas + 1).
    #[test]
    fn the_endpoint_picker_is_not_a_model_server() {
        use crate::plan::{manifests, names};
        use api_types::spec::{AcceleratorGroup, ModelDeployment};
        const M1: &str = "aaaaaaaa-0000-4000-8000-000000000001";
        let di: uuid::Uuid = "0d1e2f3a-0000-4000-8000-00000000d1d1".parse().unwrap();
        let model_id: uuid::Uuid = M1.parse().unwrap();
        let md = ModelDeployment {
            model_id: Some(model_id),
            model_slug: "meta-llama/Llama-3.1-8B-Instruct".into(),
            model_provider: "hugging_face".into(),
            provider_model_id: String::new(),
            source: api_types::spec::ModelSource::default(),
            workload_config: serde_json::json!({"autoscaling": {"min_replicas": 0, "max_replicas": 2}}),
            accelerators: vec![AcceleratorGroup {
                accelerator_slug: "gpu-h100x1-80gb".into(),
                role: "prefill_decode".into(),
                scale: 1,
            }],
        };
        let input = manifests::ManifestInput::new(
            di,
            crate::plan::models(&[md]).unwrap(),
            false,
            manifests::TlsPair {
                cert_pem: "CERT".into(),
                key_pem: "KEY".into(),
            },
        );
        let objs = crate::plan::manifests(&input);
        let epp = objs
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == names::epp(&model_id))
            .expect("the EPP Deployment");
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "epp-xyz", "labels": epp["spec"]["template"]["metadata"]["labels"]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        assert_eq!(ready_servers(&[pod], &model_id), Vec::<String>::new());
    }
}
