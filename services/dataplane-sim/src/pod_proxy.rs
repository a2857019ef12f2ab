//! What the pods of a simulated cluster answer through the cluster API's `pods/proxy`
//! subresource (sim-kube's [`sim_kube::PodProxy`] hook): the `/metrics` of the two kinds of pod
//! an autoscaler reads in a real cluster.
//!
//! - A model server (a pod an InferencePool selects, or one started with a model): its vLLM
//!   metrics, [`crate::serving::pod_metrics_text`], on any port. At any time scale: a pod with
//!   no replica yet shows a freshly started vLLM (zeros).
//! - An endpoint picker (a pod the InferencePool's `endpointPickerRef` Service selects, or one
//!   started with `--pool-name <pool>`): the EPP's pool gauges, on any port (9090 in real
//!   deployments): `inference_extension_flow_control_queue_size{inference_pool}` (requests the
//!   gateways hold for the pool, [`crate::data_plane::held_requests`]),
//!   `inference_pool_ready_pods{name}`, and `inference_pool_average_queue_size{name}` /
//!   `inference_pool_average_kv_cache_utilization{name}` over the ready pods' replicas.
//!
//! Any other pod or path has nothing listening: the API server answers 503. So it does when the
//! pod's NetworkPolicies do not admit the API server's traffic: on DOKS the control plane reaches
//! pods through the Konnectivity agents, pods of `kube-system` labelled
//! `k8s-app: konnectivity-agent` (the DaemonSet of Kubernetes's "Set up Konnectivity service"),
//! so that is the source a policy must admit on the proxied port.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use sim_kube::{PodProxy, ProxyRequest, ProxyResponse};

use crate::objects;
use crate::serving;

const INFERENCE_GROUP: &str = "inference.networking.k8s.io";

/// The hook every simulated cluster is started with.
#[derive(Debug, Default)]
pub struct PodMetrics;

impl PodProxy for PodMetrics {
    fn proxy(&self, r: &ProxyRequest) -> Option<ProxyResponse> {
        if r.method != "GET" || r.path.trim_end_matches('/') != "/metrics" {
            return None;
        }
        // Filed once: each of the lookups below reads only the pod's namespace (and the
        // cluster-scoped objects), not every object of the cluster.
        let objs = &objects::Objects::new(&r.objects);
        if !konnectivity_admitted(r, objs) {
            return Some(ProxyResponse {
                status: 503,
                content_type: "text/plain".into(),
                body: b"error trying to reach service: dial tcp: i/o timeout".to_vec(),
            });
        }
        let pools = picker_pools(objs, &r.namespace, &r.pod);
        let text = if !pools.is_empty() {
            epp_metrics_text(objs, &r.namespace, &pools)
        } else if is_model_server(objs, &r.namespace, &r.pod) {
            serving::pod_metrics_text(objs, &r.pod)
        } else {
            return None;
        };
        Some(ProxyResponse {
            status: 200,
            content_type: serving::METRICS_CONTENT_TYPE.to_string(),
            body: text.into_bytes(),
        })
    }
}

/// The namespace and labels of the Konnectivity agents through which the API server reaches pods.
pub const KONNECTIVITY_NAMESPACE: &str = "kube-system";
pub const KONNECTIVITY_LABEL: (&str, &str) = ("k8s-app", "konnectivity-agent");

/// Whether the pod's NetworkPolicies admit the Konnectivity agents on the proxied port (a port
/// name is looked up in the pod's containers; none named: the pod's first port, as the API
/// server does).
fn konnectivity_admitted(r: &ProxyRequest, objs: &objects::Objects) -> bool {
    let ports: Vec<&Value> = r
        .pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .collect();
    let number = |p: &Value| p["containerPort"].as_i64();
    let port = match r.port.as_deref() {
        Some(n) => n.parse().ok().or_else(|| {
            ports
                .iter()
                .find(|p| p["name"] == n)
                .and_then(|p| number(p))
        }),
        None => ports.first().and_then(|p| number(p)),
    };
    // No port known: only a pod no policy selects admits it.
    let port = port.unwrap_or(0);
    let agent = serde_json::json!({KONNECTIVITY_LABEL.0: KONNECTIVITY_LABEL.1});
    let labels = r
        .pod
        .pointer("/metadata/labels")
        .cloned()
        .unwrap_or_default();
    let from = crate::routing::Source::Pod {
        ns: KONNECTIVITY_NAMESPACE,
        labels: &agent,
    };
    crate::routing::ingress_admits_in(objs, &r.namespace, &labels, port, from)
}

fn inference_pools<'o, 'a>(
    objs: &'o objects::Objects<'a>,
    ns: &str,
) -> impl Iterator<Item = &'a Value> + 'o {
    objs.in_namespace(ns, "InferencePool")
        .iter()
        .copied()
        .filter(|o| {
            o["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with(INFERENCE_GROUP))
                && !objects::deleting(o)
        })
}

/// The string labels of `selector` (`matchLabels`, or a plain map as in older pools).
fn pool_selector(pool: &Value) -> Option<Map<String, Value>> {
    pool.pointer("/spec/selector/matchLabels")
        .or_else(|| pool.pointer("/spec/selector"))
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter(|(_, v)| v.is_string())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
}

/// The pools whose endpoint picker this pod is: their `endpointPickerRef` Service selects it,
/// or it was started with `--pool-name <pool>`.
fn picker_pools<'a>(objs: &objects::Objects<'a>, ns: &str, pod: &Value) -> Vec<&'a Value> {
    let labels = pod.pointer("/metadata/labels");
    let named: Vec<String> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| objects::flag_value(&objects::command_line(c), "--pool-name"))
                .collect()
        })
        .unwrap_or_default();
    inference_pools(objs, ns)
        .filter(|pool| {
            let by_name = named.iter().any(|n| pool["metadata"]["name"] == n.as_str());
            let by_service = pool
                .pointer("/spec/endpointPickerRef/name")
                .and_then(Value::as_str)
                .and_then(|svc| objects::find(objs, "Service", "", ns, svc))
                .and_then(|svc| svc.pointer("/spec/selector").and_then(Value::as_object))
                .is_some_and(|sel| objects::labels_match(sel, labels));
            by_name || by_service
        })
        .collect()
}

fn is_model_server(objs: &objects::Objects, ns: &str, pod: &Value) -> bool {
    let labels = pod.pointer("/metadata/labels");
    inference_pools(objs, ns)
        .filter_map(pool_selector)
        .any(|sel| objects::labels_match(&sel, labels))
        || objects::pod_model(objs, pod).is_some()
}

/// The EPP's gauges for each of its pools.
fn epp_metrics_text(objs: &objects::Objects, ns: &str, pools: &[&Value]) -> String {
    let mut queue = String::new();
    let mut ready = String::new();
    let mut avg_queue = String::new();
    let mut avg_kv = String::new();
    for pool in pools {
        let name = objects::s(pool, "/metadata/name")
            .unwrap_or_default()
            .replace('"', "");
        // The key the data plane counts held requests under (see `picker::pool_spec`).
        let key = objects::s(pool, "/metadata/uid")
            .map(str::to_string)
            .unwrap_or_else(|| format!("{ns}/{name}"));
        let ready_pods: Vec<&Value> = match pool_selector(pool) {
            Some(sel) => objs
                .in_namespace(ns, "Pod")
                .iter()
                .copied()
                .filter(|o| {
                    objects::labels_match(&sel, o.pointer("/metadata/labels"))
                        && objects::pod_ready(o)
                })
                .collect(),
            None => Vec::new(),
        };
        let loads: Vec<serving::Load> = ready_pods
            .iter()
            .filter_map(|p| objects::s(p, "/metadata/uid"))
            .filter_map(serving::replica_by_uid)
            .map(|r| r.load())
            .collect();
        let n = ready_pods.len().max(1) as f64;
        let waiting: usize = loads.iter().map(|l| l.waiting).sum();
        let kv: f64 = loads.iter().map(|l| l.kv_usage).sum();
        let _ = writeln!(
            queue,
            "inference_extension_flow_control_queue_size{{inference_pool=\"{name}\"}} {}",
            crate::data_plane::held_requests(&key)
        );
        let _ = writeln!(
            ready,
            "inference_pool_ready_pods{{name=\"{name}\"}} {}",
            ready_pods.len()
        );
        let _ = writeln!(
            avg_queue,
            "inference_pool_average_queue_size{{name=\"{name}\"}} {}",
            waiting as f64 / n
        );
        let _ = writeln!(
            avg_kv,
            "inference_pool_average_kv_cache_utilization{{name=\"{name}\"}} {}",
            kv / n
        );
    }
    format!(
        "# HELP inference_extension_flow_control_queue_size Current number of requests held in the flow control queue.\n\
         # TYPE inference_extension_flow_control_queue_size gauge\n{queue}\
         # HELP inference_pool_ready_pods The number of ready pods in the inference server pool.\n\
         # TYPE inference_pool_ready_pods gauge\n{ready}\
         # HELP inference_pool_average_queue_size The average number of requests pending in the model server queue.\n\
         # TYPE inference_pool_average_queue_size gauge\n{avg_queue}\
         # HELP inference_pool_average_kv_cache_utilization The average kv cache utilization for an inference server pool.\n\
         # TYPE inference_pool_average_kv_cache_utilization gauge\n{avg_kv}"
    )
}
