//! Fleet-safe upgrades: what a pass does when this worker would render a DI's Deployments with a
//! different pod template than the cluster runs, though nobody changed the DI (a new image, a
//! new argument, in a new version of the worker). Such a change restarts the DI's pods, so it is
//! not applied at the DI's next resync as any other change would be: it waits for a slot of the
//! region's rollout, which gives canaries first and then a few DIs at once, and halts when one
//! fails to serve. Meanwhile the Deployment keeps the template it runs, and everything else that
//! changed (replicas, a label, a Service) is applied in place.
//!
//! A Deployment's template is known by the hash in its annotation
//! [`names::TEMPLATE_HASH_ANNOTATION`] (on the Deployment, beside its template): a template edited
//! behind the worker's back keeps the hash, so that repair is applied at once; a Deployment
//! without the annotation counts as a restart.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::manifests::{manifests, Images, ManifestInput, TlsPair};
use crate::model::{GpuVendor, Model};
use crate::names;

/// What a rollout calls this worker's rendering: a digest of the pod templates it renders for a
/// few DIs of different shapes (one model or two, NVIDIA or AMD, scaling to zero or not, a
/// Hugging Face token or not). A new version that renders them the same is the same rollout:
/// nothing to roll.
pub fn rendering_id(
    images: &Images,
    gateway_class: &str,
    hub_endpoint: Option<&str>,
    cold_start_hold: std::time::Duration,
) -> String {
    let model = |n: u128, vendor, scales_to_zero| Model {
        model_id: Uuid::from_u128(n),
        model_slug: format!("model-{n}"),
        repository: "org/model".into(),
        revision: None,
        accelerator_slug: "gpu-sample".into(),
        role: "inference".into(),
        scale: 1,
        gpus_per_node: 1,
        vendor,
        scales_to_zero,
    };
    let shapes = [
        (vec![model(1, GpuVendor::Nvidia, false)], None),
        (
            vec![
                model(2, GpuVendor::Amd, true),
                model(3, GpuVendor::Nvidia, false),
            ],
            Some("hf_sample".to_string()),
        ),
    ];
    let mut digest = Sha256::new();
    // The build too: a sample cannot show every shape a new version renders differently, and a
    // version mistaken for an older one would take turns with it on the DIs. A version that
    // renders the same simply finds nothing to restart.
    digest.update(env!("CARGO_PKG_VERSION"));
    digest.update(option_env!("SOURCE_COMMIT").unwrap_or(""));
    for (models, hugging_face_token) in shapes {
        let mut input = ManifestInput::new(
            Uuid::nil(),
            models,
            true,
            TlsPair {
                cert_pem: String::new(),
                key_pem: String::new(),
            },
        );
        input.hugging_face_token = hugging_face_token;
        input.images = images.clone();
        input.gateway_class = gateway_class.to_string();
        input.hub_endpoint = hub_endpoint.map(str::to_string);
        input.cold_start_hold = cold_start_hold;
        for d in manifests(&input)
            .iter()
            .filter(|o| o["kind"] == "Deployment")
        {
            digest.update(serde_json::to_vec(&d["spec"]["template"]).expect("JSON serialises"));
        }
    }
    hex::encode(&digest.finalize()[..8])
}

fn name(o: &Value) -> Option<&str> {
    o.pointer("/metadata/name").and_then(Value::as_str)
}

fn template_hash(o: &Value) -> Option<&str> {
    o.pointer("/metadata/annotations")
        .and_then(|a| a.get(names::TEMPLATE_HASH_ANNOTATION))
        .and_then(Value::as_str)
}

fn observed_deployment<'a>(observed: &'a [Value], n: &str) -> Option<&'a Value> {
    observed
        .iter()
        .find(|o| o["kind"] == "Deployment" && name(o) == Some(n))
}

/// The Deployments of `desired` that exist in `observed` with another pod template: applying
/// them restarts their pods. A Deployment to create restarts nothing. One from before the hash
/// annotation restarts only if its template lacks something the desired one says (the API server
/// adds defaults, never removes what was applied).
pub fn restarts(desired: &[Value], observed: &[Value]) -> Vec<String> {
    desired
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .filter_map(|d| {
            let n = name(d)?;
            let o = observed_deployment(observed, n)?;
            let restarts = match template_hash(o) {
                Some(running) => Some(running) != template_hash(d),
                None => !says_all(&o["spec"]["template"], &d["spec"]["template"]),
            };
            restarts.then(|| n.to_string())
        })
        .collect()
}

/// `live` says everything `wanted` says: objects field by field, lists element by element; the
/// API server returns quantities and int-or-string values as strings.
fn says_all(live: &Value, wanted: &Value) -> bool {
    match (live, wanted) {
        (Value::Object(l), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| l.get(k).is_some_and(|lv| says_all(lv, wv))),
        (Value::Array(l), Value::Array(w)) => {
            l.len() == w.len() && l.iter().zip(w).all(|(lv, wv)| says_all(lv, wv))
        }
        (Value::String(l), Value::Number(w)) => *l == w.to_string(),
        (l, w) => l == w,
    }
}

/// The templates the Deployments `names` run, as `observed` shows them: what a DI keeps while
/// it waits for a slot, and goes back to if its slot fails. `{name: {template, hash}}`.
pub fn running(observed: &[Value], names: &[String]) -> Value {
    let mut out = Map::new();
    for n in names {
        if let Some(o) = observed_deployment(observed, n) {
            out.insert(
                n.clone(),
                json!({"template": o["spec"]["template"], "hash": template_hash(o)}),
            );
        }
    }
    Value::Object(out)
}

/// `desired` with the Deployments named in `kept` (the output of [`running`]) keeping those
/// templates: the rest of each Deployment (replicas, labels, strategy) is as desired.
pub fn keep(desired: &mut [Value], kept: &Value) {
    for d in desired.iter_mut().filter(|d| d["kind"] == "Deployment") {
        let Some(k) = name(d).and_then(|n| kept.get(n)) else {
            continue;
        };
        if k["template"].is_null() {
            continue;
        }
        d["spec"]["template"] = k["template"].clone();
        if let Some(annotations) = d
            .pointer_mut("/metadata/annotations")
            .and_then(Value::as_object_mut)
        {
            match k["hash"].as_str() {
                Some(h) => {
                    annotations.insert(names::TEMPLATE_HASH_ANNOTATION.into(), json!(h));
                }
                None => {
                    annotations.remove(names::TEMPLATE_HASH_ANNOTATION);
                }
            }
        }
    }
}

/// A DI's slot, as far as this worker's decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// No slot in the rollout of this worker's rendering.
    None,
    Rolling,
    /// Served the rendering and answered the probe.
    Done,
    /// Could not serve it: the DI runs what it ran before.
    Failed,
}

/// Whether the probe can be answered: the first model server Deployment of `desired` (the
/// model of the default route, which the probe reaches) has replicas. A deployment scaled to
/// zero has none to probe.
pub fn serves(desired: &[Value]) -> bool {
    desired
        .iter()
        .find(|d| {
            d["kind"] == "Deployment"
                && d.pointer("/spec/template/metadata/labels")
                    .and_then(|l| l.get(names::SERVING_LABEL))
                    .is_some()
        })
        .is_some_and(|d| d.pointer("/spec/replicas").and_then(Value::as_i64) > Some(0))
}

/// Why a pod of the DI cannot start at all, as the kubelet says it (an image that cannot be
/// pulled, a container that cannot be created): a new template that does this does not start by
/// waiting, and a slot fails on it at once rather than at its timeout.
pub fn start_failure(observed: &[Value]) -> Option<String> {
    const CANNOT_START: &[&str] = &[
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    ];
    observed
        .iter()
        .filter(|o| o["kind"] == "Pod")
        .find_map(|p| {
            let statuses = p.pointer("/status/containerStatuses")?.as_array()?;
            statuses.iter().find_map(|cs| {
                let reason = cs.pointer("/state/waiting/reason")?.as_str()?;
                CANNOT_START.contains(&reason).then(|| {
                    let message = cs
                        .pointer("/state/waiting/message")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    format!(
                        "pod {} cannot start: {reason} {message}",
                        name(p).unwrap_or("?")
                    )
                    .trim_end()
                    .to_string()
                })
            })
        })
}

/// What a pass does about the restarts its rendering asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Apply everything as rendered.
    Apply,
    /// A customer's change, on a DI with a slot: apply everything as rendered, and give the slot
    /// up. The DI now runs what the customer's rollout verifies, and the templates a failed slot
    /// saved are older than the customer's spec: going back to them would undo it.
    Release,
    /// Ask the region's rollout for a slot: apply everything if granted, else keep the templates
    /// the cluster runs ([`running`]).
    Ask,
    /// Go back to the templates the DI ran before its slot (the slot's `previous`).
    GoBack,
}

/// Whether `restarts` wait for a slot. A customer's change (a pass that is not a resync:
/// provisioning, an update) is never held back by a fleet rollout; a resync is. A DI whose slot
/// failed runs what it ran before, whatever the cluster runs now (the failed templates, until
/// the pass that goes back).
pub fn step(resync: bool, restarts: &[String], slot: Slot) -> Step {
    if !resync {
        return if slot == Slot::None {
            Step::Apply
        } else {
            Step::Release
        };
    }
    match slot {
        Slot::Failed => Step::GoBack,
        _ if restarts.is_empty() => Step::Apply,
        Slot::Rolling => Step::Apply,
        Slot::None | Slot::Done => Step::Ask,
    }
}

/// How a rolling slot stands at the end of a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotEnd {
    /// Still rolling (pods starting, or changes just applied).
    Rolling,
    /// Serving the new templates: the probe decides whether the slot is done.
    Probe,
    /// Settled with no model server to serve (scaled to zero): done without a probe, which would
    /// wait for a replica to start and start one.
    Done,
    /// The DI cannot serve the new templates: the slot fails and the rollout halts.
    Failed(String),
}

/// Where a rolling slot is: failed on `failure` (a model server of the new template that cannot
/// load its model, a pod that cannot start), or if the DI has not served within `timeout_ms` of
/// the slot; to probe once the DI is settled with nothing left to restart.
pub fn slot_end(
    settled: bool,
    restarts_left: bool,
    serving: bool,
    failure: Option<&str>,
    rolling_for_ms: i64,
    timeout_ms: i64,
) -> SlotEnd {
    if let Some(f) = failure {
        return SlotEnd::Failed(f.to_string());
    }
    if settled && !restarts_left && !serving {
        return SlotEnd::Done;
    }
    // Before the probe: a DI that settles but never answers it must not hold its slot for ever.
    if rolling_for_ms >= timeout_ms {
        return SlotEnd::Failed(format!(
            "not serving {} s after its pods began to restart",
            timeout_ms / 1000
        ));
    }
    if settled && !restarts_left {
        return SlotEnd::Probe;
    }
    SlotEnd::Rolling
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::LoadFailure;

    fn deployment(n: &str, image: &str, hash: Option<&str>) -> Value {
        let mut d = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": n, "annotations": {}},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [{"image": image}]}}}});
        if let Some(h) = hash {
            d["metadata"]["annotations"][names::TEMPLATE_HASH_ANNOTATION] = json!(h);
        }
        d
    }

    #[test]
    fn a_new_template_is_a_restart_and_a_new_deployment_is_not() {
        let desired = vec![
            deployment("vllm-a", "v2", Some("h2")),
            deployment("vllm-b", "v1", Some("h1")),
            deployment("vllm-c", "v2", Some("h2")),
        ];
        let observed = vec![
            deployment("vllm-a", "v1", Some("h1")),
            deployment("vllm-b", "v1", Some("h1")),
        ];
        assert_eq!(restarts(&desired, &observed), ["vllm-a"]);
        // A template edited behind the worker's back keeps its hash: repaired at once.
        let edited = vec![
            deployment("vllm-a", "edited", Some("h2")),
            deployment("vllm-b", "v1", Some("h1")),
        ];
        assert!(restarts(&desired, &edited).is_empty());
        // From before the annotation: a restart only if the running template lacks something.
        let mut defaulted = deployment("vllm-b", "v1", None);
        defaulted["spec"]["template"]["spec"]["dnsPolicy"] = json!("ClusterFirst");
        assert!(restarts(&desired, &[defaulted]).is_empty());
        let older = vec![deployment("vllm-b", "v0", None)];
        assert_eq!(restarts(&desired, &older), ["vllm-b"]);
    }

    #[test]
    fn a_kept_template_changes_nothing_else() {
        let observed = vec![deployment("vllm-a", "v1", Some("h1"))];
        let mut desired = vec![deployment("vllm-a", "v2", Some("h2"))];
        desired[0]["spec"]["replicas"] = json!(5);
        let kept = running(&observed, &restarts(&desired, &observed));
        keep(&mut desired, &kept);
        assert_eq!(
            desired[0]["spec"]["template"],
            observed[0]["spec"]["template"]
        );
        assert_eq!(
            desired[0]["spec"]["replicas"], 5,
            "the autoscaler's count applies"
        );
        assert!(restarts(&desired, &observed).is_empty());
        // A Deployment from before the annotation keeps going without one.
        let legacy = vec![deployment("vllm-a", "v1", None)];
        let mut desired = vec![deployment("vllm-a", "v2", Some("h2"))];
        keep(&mut desired, &running(&legacy, &["vllm-a".into()]));
        assert!(desired[0]["metadata"]["annotations"]
            .get(names::TEMPLATE_HASH_ANNOTATION)
            .is_none());
        assert_eq!(
            desired[0]["spec"]["template"],
            legacy[0]["spec"]["template"]
        );
    }

    #[test]
    fn only_a_resync_waits_for_a_slot() {
        let r = vec!["vllm-a".to_string()];
        assert_eq!(
            step(false, &r, Slot::None),
            Step::Apply,
            "a customer's update"
        );
        assert_eq!(step(true, &[], Slot::None), Step::Apply, "nothing restarts");
        assert_eq!(step(true, &r, Slot::None), Step::Ask);
        assert_eq!(step(true, &r, Slot::Done), Step::Ask);
        assert_eq!(step(true, &r, Slot::Rolling), Step::Apply);
        assert_eq!(step(true, &r, Slot::Failed), Step::GoBack);
        assert_eq!(
            step(true, &[], Slot::Failed),
            Step::GoBack,
            "the failed templates run: they go"
        );
        assert_eq!(
            step(false, &r, Slot::Failed),
            Step::Release,
            "a customer's update"
        );
        assert_eq!(step(false, &[], Slot::Rolling), Step::Release);
    }

    #[test]
    fn a_slot_ends_by_the_probe_a_load_failure_or_its_timeout() {
        assert_eq!(slot_end(true, false, true, None, 10, 100), SlotEnd::Probe);
        assert_eq!(
            slot_end(true, false, false, None, 10, 100),
            SlotEnd::Done,
            "scaled to zero: nothing to probe"
        );
        assert_eq!(
            slot_end(false, false, true, None, 10, 100),
            SlotEnd::Rolling
        );
        assert_eq!(slot_end(true, true, true, None, 10, 100), SlotEnd::Rolling);
        assert!(matches!(
            slot_end(false, false, true, None, 100, 100),
            SlotEnd::Failed(_)
        ));
        assert!(
            matches!(
                slot_end(true, false, true, None, 100, 100),
                SlotEnd::Failed(_)
            ),
            "a probe that never answers does not hold the slot for ever"
        );
        let failure = LoadFailure {
            deployment: "vllm-a".into(),
            model: Some("org/m".into()),
            pod: "vllm-a-1".into(),
            restarts: 3,
            message: "boom".into(),
        }
        .to_string();
        assert!(matches!(
            slot_end(true, false, true, Some(&failure), 10, 100),
            SlotEnd::Failed(m) if m.contains("boom")
        ));
    }

    #[test]
    fn a_deployment_scaled_to_zero_serves_nothing_to_probe() {
        let rendered = |scale| {
            let d = crate::model::tests::deployment(
                "00000000-0000-0000-0000-000000000001",
                "m",
                "gpu-h100x1-80gb",
                scale,
            );
            let m = Model::from_deployment(&d).unwrap();
            let tls = TlsPair {
                cert_pem: String::new(),
                key_pem: String::new(),
            };
            manifests(&ManifestInput::new(Uuid::nil(), vec![m], true, tls))
        };
        assert!(serves(&rendered(2)));
        assert!(
            !serves(&rendered(0)),
            "the picker and endpoint-auth are no model servers"
        );
    }

    #[test]
    fn a_pod_that_cannot_start_is_named() {
        let pod = |reason: &str| {
            json!({"kind": "Pod", "metadata": {"name": "vllm-a-1"}, "status": {"containerStatuses": [
                {"name": "vllm", "state": {"waiting": {"reason": reason, "message": "no such tag"}}}]}})
        };
        assert_eq!(start_failure(&[pod("ContainerCreating")]), None);
        let why = start_failure(&[pod("ImagePullBackOff")]).unwrap();
        assert!(
            why.contains("vllm-a-1") && why.contains("no such tag"),
            "{why}"
        );
    }

    #[test]
    fn the_rendering_id_follows_the_templates() {
        let images = Images::default();
        let hold = std::time::Duration::from_secs(900);
        let a = rendering_id(&images, "gw", None, hold);
        assert_eq!(a, rendering_id(&images, "gw", None, hold));
        let mut newer = images.clone();
        newer.vllm_nvidia = "vllm/vllm-openai:v9".into();
        assert_ne!(a, rendering_id(&newer, "gw", None, hold));
        assert_ne!(a, rendering_id(&images, "gw", Some("http://mirror"), hold));
        assert_ne!(
            a,
            rendering_id(&images, "gw", None, hold * 2),
            "the picker's queue TTL restarts it"
        );
    }
}
