//! From observed objects to progress: is every replica ready and does every load balancer have
//! an address, which endpoint URLs to record, which accelerators (nodes) the DI has, and which
//! model deployments are rolling out (for node pool sizing).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use uuid::Uuid;

use super::names;

/// Whether the DI's objects are ready, and if not, what the worker is waiting for (in a form
/// fit for an event message).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    pub ready: bool,
    pub waiting_for: Vec<String>,
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

fn deployment_waits(desired: &Value, observed: &[Value]) -> Option<String> {
    let name = s(desired, "/metadata/name").unwrap_or("");
    let Some(o) = observed_of(desired, observed) else {
        return Some(format!("deployment {name}: not created yet"));
    };
    if template_hash(desired) != template_hash(o) {
        return Some(format!("deployment {name}: new version not applied yet"));
    }
    let replicas = int(desired, "/spec/replicas");
    if int(o, "/status/observedGeneration") < int(o, "/metadata/generation") {
        return Some(format!(
            "deployment {name}: waiting for the controller to see the change"
        ));
    }
    let ready = int(o, "/status/readyReplicas");
    let available = int(o, "/status/availableReplicas");
    let updated = int(o, "/status/updatedReplicas");
    let total = int(o, "/status/replicas");
    if updated >= replicas && ready >= replicas && available >= replicas && total <= replicas {
        return None;
    }
    let mut msg = format!(
        "deployment {name}: {} of {replicas} replicas ready",
        ready.min(available)
    );
    if total > updated {
        msg.push_str(&format!(", {} old replicas still running", total - updated));
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
    if let Some(p) = unschedulable {
        msg.push_str(&format!(
            ", pod {} unschedulable",
            s(p, "/metadata/name").unwrap_or("?")
        ));
    }
    Some(msg)
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

/// Nodes that run a pod that has not finished: a pool must not lose them.
pub fn busy_nodes(pods: &[Value]) -> BTreeSet<String> {
    pods.iter()
        .filter(|p| p["kind"] == "Pod" && !pod_finished(p))
        .filter_map(|p| s(p, "/spec/nodeName"))
        .map(str::to_string)
        .collect()
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
            let want = template_hash(d)?;
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
            Some("Service") if d["spec"]["type"] == "LoadBalancer" => {
                let name = s(d, "/metadata/name").unwrap_or("");
                let url = observed_of(d, observed).and_then(endpoint_url);
                match (&url, name) {
                    (None, _) => waiting_for.push(format!(
                        "service {name}: waiting for a load balancer address"
                    )),
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
    use crate::plan::manifests::{manifests, ManifestInput, TlsPair};
    use crate::plan::model::{models, tests::deployment};
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
        let w = a.progress.waiting_for.join("\n");
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
            a.progress.waiting_for,
            vec!["deployment vllm-aaaaaaaa: 1 of 2 replicas ready, 1 old replicas still running"]
        );
    }

    #[test]
    fn unapplied_template_or_stale_generation_is_not_ready() {
        let d = desired(1, false, false);
        let o = converged(&desired(1, false, true));
        let a = assess(&di(), &d, &o);
        assert!(
            a.progress.waiting_for[0].contains("new version not applied"),
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
    fn busy_nodes_ignore_finished_pods() {
        let pods = vec![
            json!({"kind": "Pod", "spec": {"nodeName": "a"}, "status": {"phase": "Running"}}),
            json!({"kind": "Pod", "spec": {"nodeName": "b"}, "status": {"phase": "Succeeded"}}),
            json!({"kind": "Pod", "spec": {}, "status": {"phase": "Pending"}}),
        ];
        assert_eq!(busy_nodes(&pods), BTreeSet::from(["a".to_string()]));
    }
}
