//! The scheduler and the kubelet's part: binds pending pods to nodes whose
//! labels, taints and free resources fit, gives them an IP and marks them
//! Running, and once the model-load delay has passed asks the cluster's
//! [`ModelLoader`] (if any) whether their containers loaded: Ready, or
//! crash-looping with back-off and asked again after each restart.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use base64::Engine;
use serde_json::{json, Value};

use super::{is_deleting, set_condition, uid, Snapshot, Timers};
use crate::managed::Scope;
use crate::ops;
use crate::resources::{index_of, TYPES};
use crate::selector::LabelSelector;
use crate::store::{now_rfc3339, Key, Store};
use crate::{ClusterConfig, LoadRequest, ModelLoader};

const SCHEDULER: &str = "kube-scheduler";
const KUBELET: &str = "kubelet";

/// Parses a Kubernetes quantity ("500m", "8Gi", "1.5", "2e3") into base units.
pub fn parse_quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    const SUFFIXES: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, mult) in SUFFIXES {
        if let Some(num) = s.strip_suffix(suffix) {
            return num.parse::<f64>().ok().map(|n| n * mult);
        }
    }
    s.parse::<f64>().ok()
}

fn quantity(v: &Value) -> f64 {
    match v {
        Value::String(s) => parse_quantity(s).unwrap_or(0.0),
        Value::Number(n) => n.as_f64().unwrap_or(0.0),
        _ => 0.0,
    }
}

/// Resources a pod asks for: per container, requests, or limits where a request
/// is missing (the API server defaults requests to limits).
pub fn pod_requests(pod: &Value) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for c in pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let mut per: BTreeMap<String, f64> = BTreeMap::new();
        for src in ["limits", "requests"] {
            if let Some(m) = c
                .pointer(&format!("/resources/{src}"))
                .and_then(Value::as_object)
            {
                for (k, v) in m {
                    per.insert(k.clone(), quantity(v));
                }
            }
        }
        for (k, v) in per {
            *out.entry(k).or_insert(0.0) += v;
        }
    }
    *out.entry("pods".into()).or_insert(0.0) += 1.0;
    out
}

fn tolerates(pod: &Value, taint: &Value) -> bool {
    let effect = taint["effect"].as_str().unwrap_or_default();
    if effect == "PreferNoSchedule" {
        return true;
    }
    let key = taint["key"].as_str().unwrap_or_default();
    let value = taint["value"].as_str().unwrap_or_default();
    pod.pointer("/spec/tolerations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|t| {
            let t_effect = t["effect"].as_str().unwrap_or_default();
            if !t_effect.is_empty() && t_effect != effect {
                return false;
            }
            let t_key = t["key"].as_str().unwrap_or_default();
            match t["operator"].as_str().unwrap_or("Equal") {
                "Exists" => t_key.is_empty() || t_key == key,
                _ => t_key == key && t["value"].as_str().unwrap_or_default() == value,
            }
        })
}

fn node_ready(node: &Value) -> bool {
    super::condition_true(node, "Ready")
        && node.pointer("/spec/unschedulable") != Some(&json!(true))
}

fn selector_fits(pod: &Value, node: &Value) -> bool {
    let labels = node.pointer("/metadata/labels");
    let simple = pod
        .pointer("/spec/nodeSelector")
        .map(|s| LabelSelector::from_object(&json!({"matchLabels": s})).matches_labels(labels))
        .unwrap_or(true);
    let terms = pod
        .pointer("/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
        .and_then(Value::as_array);
    let affinity = match terms {
        Some(ts) if !ts.is_empty() => ts.iter().any(|t| {
            LabelSelector::from_object(&json!({"matchExpressions": t["matchExpressions"]}))
                .matches_labels(labels)
        }),
        _ => true,
    };
    simple && affinity
}

/// Why a node cannot take a pod, in the words of the real scheduler's message.
fn misfit(pod: &Value, node: &Value, used: &BTreeMap<String, f64>) -> Option<String> {
    if !node_ready(node) {
        return Some("node(s) were unschedulable".into());
    }
    if !selector_fits(pod, node) {
        return Some("node(s) didn't match Pod's node affinity/selector".into());
    }
    for taint in node
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if !tolerates(pod, taint) {
            return Some(format!(
                "node(s) had untolerated taint {{{}: {}}}",
                taint["key"].as_str().unwrap_or_default(),
                taint["value"].as_str().unwrap_or_default()
            ));
        }
    }
    let allocatable = node.pointer("/status/allocatable");
    for (res, want) in pod_requests(pod) {
        if want <= 0.0 {
            continue;
        }
        let have = allocatable
            .and_then(|a| a.get(&res))
            .map(quantity)
            .unwrap_or(0.0);
        let in_use = used.get(&res).copied().unwrap_or(0.0);
        if in_use + want > have + 1e-9 {
            return Some(format!("Insufficient {res}"));
        }
    }
    None
}

/// Fills in what a kubelet would report for a node the simulator adds.
pub fn complete_node(node: &mut Value, seq: u64) {
    let name = node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let labels = &mut node["metadata"]["labels"];
    for (k, v) in [
        ("kubernetes.io/hostname", name.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
    ] {
        if labels.get(k).is_none() {
            labels[k] = json!(v);
        }
    }
    let status = &mut node["status"];
    for (k, v) in [("cpu", "8"), ("memory", "32Gi"), ("pods", "110")] {
        if status.pointer(&format!("/capacity/{k}")).is_none() {
            status["capacity"][k] = json!(v);
        }
    }
    if status.get("allocatable").is_none() {
        status["allocatable"] = status["capacity"].clone();
    }
    if status.get("conditions").is_none() {
        let now = now_rfc3339();
        status["conditions"] = json!([{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now, "lastTransitionTime": now
        }]);
    }
    if status.get("addresses").is_none() {
        status["addresses"] = json!([
            {"type": "InternalIP", "address": format!("10.116.{}.{}", (seq / 250) % 250, seq % 250 + 2)},
            {"type": "Hostname", "address": name}
        ]);
    }
    if status.get("nodeInfo").is_none() {
        status["nodeInfo"] = json!({
            "kubeletVersion": "v1.34.1", "kubeProxyVersion": "v1.34.1", "operatingSystem": "linux",
            "architecture": "amd64", "containerRuntimeVersion": "containerd://1.7.0",
            "osImage": "Debian GNU/Linux 12 (bookworm)", "kernelVersion": "6.1.0",
            "machineID": "", "systemUUID": "", "bootID": ""
        });
    }
    if status.get("phase").is_none() {
        status["phase"] = json!("Running");
    }
}

fn pod_active(pod: &Value) -> bool {
    !is_deleting(pod)
        && !matches!(
            pod.pointer("/status/phase").and_then(Value::as_str),
            Some("Succeeded" | "Failed")
        )
}

pub fn run(store: &Store, snap: &Snapshot, timers: &mut Timers, config: &ClusterConfig) {
    let nodes: Vec<&Value> = snap.of_kind("Node").map(|(_, n)| n).collect();
    let mut used: HashMap<String, BTreeMap<String, f64>> = HashMap::new();
    for (_, pod) in snap.of_kind("Pod") {
        if let Some(n) = pod.pointer("/spec/nodeName").and_then(Value::as_str) {
            if pod_active(pod) || is_deleting(pod) {
                let entry = used.entry(n.to_string()).or_default();
                for (r, q) in pod_requests(pod) {
                    *entry.entry(r).or_insert(0.0) += q;
                }
            }
        }
    }
    let mut pending: Vec<(&Key, &Value)> = snap
        .of_kind("Pod")
        .filter(|(_, p)| {
            p.pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .is_empty()
                && pod_active(p)
        })
        .collect();
    pending.sort_by_key(|(k, p)| {
        (
            p.pointer("/metadata/creationTimestamp")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            (*k).clone(),
        )
    });
    let pod_scope = Scope::for_main(&TYPES[index_of("Pod")]);
    for (key, pod) in pending {
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let mut best: Option<(&Value, f64)> = None;
        for node in &nodes {
            let name = node["metadata"]["name"].as_str().unwrap_or_default();
            let u = used.get(name).cloned().unwrap_or_default();
            match misfit(pod, node, &u) {
                Some(r) => *reasons.entry(r).or_default() += 1,
                None => {
                    // Spread: prefer the node running the fewest pods.
                    let load = u.get("pods").copied().unwrap_or(0.0);
                    if best.is_none_or(|(_, l)| load < l) {
                        best = Some((node, load));
                    }
                }
            }
        }
        match best {
            Some((node, _)) => {
                let node_name = node["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let host_ip = node
                    .pointer("/status/addresses")
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().find(|x| x["type"] == "InternalIP"))
                    .and_then(|x| x["address"].as_str())
                    .unwrap_or("10.116.0.2")
                    .to_string();
                let bound = ops::mutate(store, key, pod_scope, SCHEDULER, |p| {
                    p["spec"]["nodeName"] = json!(node_name)
                });
                if bound.is_none() {
                    continue;
                }
                let entry = used.entry(node_name.clone()).or_default();
                for (r, q) in pod_requests(pod) {
                    *entry.entry(r).or_insert(0.0) += q;
                }
                let seq = store.next_seq();
                let pod_ip = format!("10.244.{}.{}", (seq / 250) % 250, seq % 250 + 2);
                let now = now_rfc3339();
                ops::mutate(store, key, Scope::Status, KUBELET, |p| {
                    let containers = p.pointer("/spec/containers").cloned().unwrap_or(json!([]));
                    let st = &mut p["status"];
                    st["phase"] = json!("Running");
                    st["hostIP"] = json!(host_ip);
                    st["hostIPs"] = json!([{"ip": host_ip}]);
                    st["podIP"] = json!(pod_ip);
                    st["podIPs"] = json!([{"ip": pod_ip}]);
                    st["startTime"] = json!(now);
                    let conds = &mut st["conditions"];
                    set_condition(conds, "PodScheduled", "True", "", "", None, false);
                    set_condition(conds, "Initialized", "True", "", "", None, false);
                    set_condition(
                        conds,
                        "ContainersReady",
                        "False",
                        "ContainersNotReady",
                        "containers with unready status",
                        None,
                        false,
                    );
                    set_condition(
                        conds,
                        "Ready",
                        "False",
                        "ContainersNotReady",
                        "containers with unready status",
                        None,
                        false,
                    );
                    st["containerStatuses"] = container_statuses(&containers, false, &now);
                });
                timers.pod_bound.insert(uid(pod), Instant::now());
            }
            None => {
                let detail: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
                let message = if nodes.is_empty() {
                    "no nodes available to schedule pods".to_string()
                } else {
                    format!(
                        "0/{} nodes are available: {}.",
                        nodes.len(),
                        detail.join(", ")
                    )
                };
                ops::mutate(store, key, Scope::Status, SCHEDULER, |p| {
                    p["status"]["phase"] = json!("Pending");
                    set_condition(
                        &mut p["status"]["conditions"],
                        "PodScheduled",
                        "False",
                        "Unschedulable",
                        &message,
                        None,
                        false,
                    );
                });
            }
        }
    }

    // Bound pods' containers settle once the model-load delay has passed (a pod that loads no
    // model: at most a second): Ready, or crash-looping when the loader says their load failed.
    let loader = config.model_loader.as_deref();
    for (key, pod) in snap.of_kind("Pod") {
        if !pod_active(pod)
            || pod.pointer("/spec/nodeName").is_none()
            || super::condition_true(pod, "Ready")
        {
            continue;
        }
        if pod.pointer("/status/phase").and_then(Value::as_str) != Some("Running") {
            continue;
        }
        let id = uid(pod);
        if let Some(&at) = timers.restart_at.get(&id) {
            if Instant::now() < at {
                timers.wake_at(at);
                continue;
            }
            // The back-off is over: the crashed containers start again and load anew.
            timers.restart_at.remove(&id);
            timers.pod_bound.insert(id.clone(), at);
            restart_crashed(store, key);
        }
        let start = *timers.pod_bound.entry(id).or_insert_with(Instant::now);
        let delay = if loads_a_model(pod) {
            config.model_load_delay
        } else {
            config.model_load_delay.min(CONTAINER_START)
        };
        if !timers.elapsed(start, delay) {
            continue;
        }
        settle(store, snap, key, pod, timers, loader);
    }
}

/// The longest a container that loads no model takes to turn Ready (an image already pulled, a
/// process that starts): a picker or an auth service is not held as long as a model server.
const CONTAINER_START: Duration = Duration::from_secs(1);

/// Whether the pod loads a model before it is Ready: one of its containers asks for GPUs.
fn loads_a_model(pod: &Value) -> bool {
    pod.pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            ["limits", "requests"].iter().any(|k| {
                c["resources"][k]
                    .as_object()
                    .is_some_and(|r| r.keys().any(|r| r.ends_with("/gpu")))
            })
        })
}

/// Back-off before a crashed container's first restart; it doubles with every restart up to
/// [`MAX_RESTART_BACKOFF`] (a kubelet's 10 s to 5 min, scaled down to suit short tests).
const RESTART_BACKOFF: Duration = Duration::from_secs(1);
const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(10);
/// How soon a loader that does not know yet is asked again.
const LOADER_POLL: Duration = Duration::from_millis(50);

/// The back-off after a container's `restarts`-th crash.
fn restart_backoff(restarts: u32) -> Duration {
    (RESTART_BACKOFF * 2u32.pow(restarts.saturating_sub(1).min(8))).min(MAX_RESTART_BACKOFF)
}

/// A duration as Go prints it (the kubelet's messages do): `500ms`, `1s`, `10s`, `1m0s`.
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64();
    let fmt_secs = |s: f64| {
        let s = format!("{s:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    if secs < 60.0 {
        format!("{}s", fmt_secs(secs))
    } else {
        let m = (secs / 60.0).floor();
        format!("{m}m{}s", fmt_secs(secs - m * 60.0))
    }
}

fn container_status<'a>(pod: &'a Value, name: &str) -> Option<&'a Value> {
    pod.pointer("/status/containerStatuses")
        .and_then(Value::as_array)?
        .iter()
        .find(|s| s["name"] == name)
}

fn restart_count(status: Option<&Value>) -> u32 {
    status
        .and_then(|s| s["restartCount"].as_u64())
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The container's environment as the kubelet hands it over: plain values, and Secret keys of
/// the pod's namespace, decoded. Variables whose Secret or key is missing are left out.
fn resolved_env(snap: &Snapshot, ns: &str, container: &Value) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let Some(name) = e["name"].as_str() else {
            continue;
        };
        let value = match (e.get("value"), e.pointer("/valueFrom/secretKeyRef")) {
            (Some(v), _) => Some(v.as_str().unwrap_or_default().to_string()),
            (None, Some(r)) => {
                let secret = r["name"].as_str().unwrap_or_default();
                let key = r["key"].as_str().unwrap_or_default();
                snap.get("Secret", ns, secret)
                    .and_then(|s| s.pointer("/data")?.get(key)?.as_str())
                    .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
                    .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            }
            // Declared without a value: set, empty.
            (None, None) if e.get("valueFrom").is_none() => Some(String::new()),
            // Other sources (ConfigMaps, fields, resources) are not resolved.
            _ => None,
        };
        if let Some(v) = value {
            env.insert(name.to_string(), v);
        }
    }
    env
}

/// Asks the loader about every container of `pod` that is not ready yet and shows the answers:
/// loaded containers turn ready (the pod with them, once all are), failed ones crash-loop and
/// restart after a back-off; where the loader does not know yet, it is asked again soon.
fn settle(
    store: &Store,
    snap: &Snapshot,
    key: &Key,
    pod: &Value,
    timers: &mut Timers,
    loader: Option<&dyn ModelLoader>,
) {
    let ns = pod
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let pod_name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let pod_uid = uid(pod);
    let mut outcomes: BTreeMap<String, Result<(), String>> = BTreeMap::new();
    let mut unknown = false;
    for c in pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = c["name"].as_str().unwrap_or_default();
        let status = container_status(pod, name);
        if status.is_some_and(|s| s["ready"] == true) {
            continue;
        }
        let outcome = match loader {
            None => Some(Ok(())),
            Some(loader) => loader.load(&LoadRequest {
                pod_uid: pod_uid.clone(),
                namespace: ns.to_string(),
                pod_name: pod_name.to_string(),
                container: name.to_string(),
                args: c["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| a.as_str().unwrap_or_default().to_string())
                    .collect(),
                env: resolved_env(snap, ns, c),
                restart_count: restart_count(status),
            }),
        };
        match outcome {
            Some(o) => {
                outcomes.insert(name.to_string(), o);
            }
            None => unknown = true,
        }
    }
    if unknown {
        timers.wake_at(Instant::now() + LOADER_POLL);
    }
    if outcomes.is_empty() {
        return;
    }
    let now = now_rfc3339();
    let pod_ref = format!("{pod_name}_{ns}({pod_uid})");
    let mut backoff: Option<Duration> = None;
    ops::mutate(store, key, Scope::Status, KUBELET, |p| {
        let containers = p.pointer("/spec/containers").cloned().unwrap_or(json!([]));
        let mut statuses = Vec::new();
        for c in containers.as_array().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or_default();
            let mut st = container_status(p, name)
                .cloned()
                .unwrap_or_else(|| container_status_of(c, false, &now));
            match outcomes.get(name) {
                Some(Ok(())) => {
                    st["ready"] = json!(true);
                    st["started"] = json!(true);
                }
                Some(Err(message)) => {
                    let restarts = restart_count(Some(&st)) + 1;
                    let wait = restart_backoff(restarts);
                    backoff = Some(backoff.map_or(wait, |b| b.max(wait)));
                    crash(&mut st, message, restarts, wait, &pod_ref, &now);
                }
                None => {}
            }
            statuses.push(st);
        }
        let unready: Vec<String> = statuses
            .iter()
            .filter(|s| s["ready"] != true)
            .map(|s| s["name"].as_str().unwrap_or_default().to_string())
            .collect();
        let conds = &mut p["status"]["conditions"];
        if unready.is_empty() {
            set_condition(conds, "ContainersReady", "True", "", "", None, false);
            set_condition(conds, "Ready", "True", "", "", None, false);
        } else {
            let message = format!("containers with unready status: [{}]", unready.join(" "));
            for ty in ["ContainersReady", "Ready"] {
                set_condition(
                    conds,
                    ty,
                    "False",
                    "ContainersNotReady",
                    &message,
                    None,
                    false,
                );
            }
        }
        p["status"]["containerStatuses"] = Value::Array(statuses);
    });
    if let Some(wait) = backoff {
        let at = Instant::now() + wait;
        timers.restart_at.insert(pod_uid, at);
        timers.wake_at(at);
    }
}

/// A container whose start-up failed, as the kubelet shows it while it waits to restart it.
fn crash(st: &mut Value, message: &str, restarts: u32, wait: Duration, pod_ref: &str, now: &str) {
    let name = st["name"].as_str().unwrap_or_default().to_string();
    let started_at = st
        .pointer("/state/running/startedAt")
        .cloned()
        .unwrap_or_else(|| json!(now));
    st["lastState"] = json!({"terminated": {
        "exitCode": 1,
        "reason": "Error",
        "message": message,
        "startedAt": started_at,
        "finishedAt": now,
        "containerID": st["containerID"],
    }});
    st["state"] = json!({"waiting": {
        "reason": "CrashLoopBackOff",
        "message": format!(
            "back-off {} restarting failed container={name} pod={pod_ref}",
            go_duration(wait)
        ),
    }});
    st["restartCount"] = json!(restarts);
    st["ready"] = json!(false);
    st["started"] = json!(false);
}

/// The back-off is over: containers waiting in `CrashLoopBackOff` run again (a new container,
/// its last termination kept) and load anew.
fn restart_crashed(store: &Store, key: &Key) {
    let now = now_rfc3339();
    ops::mutate(store, key, Scope::Status, KUBELET, |p| {
        for st in p
            .pointer_mut("/status/containerStatuses")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if st.pointer("/state/waiting/reason") == Some(&json!("CrashLoopBackOff")) {
                st["state"] = json!({"running": {"startedAt": now}});
                st["containerID"] = json!(new_container_id());
                st["started"] = json!(true);
            }
        }
    });
}

fn new_container_id() -> String {
    format!("containerd://{}", uuid::Uuid::new_v4().simple())
}

fn container_status_of(c: &Value, ready: bool, now: &str) -> Value {
    json!({
        "name": c["name"],
        "image": c["image"],
        "imageID": "",
        "containerID": new_container_id(),
        "ready": ready,
        "started": true,
        "restartCount": 0,
        "state": {"running": {"startedAt": now}},
    })
}

fn container_statuses(containers: &Value, ready: bool, now: &str) -> Value {
    Value::Array(
        containers
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| container_status_of(c, ready, now))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("500m"), Some(0.5));
        assert_eq!(parse_quantity("2Gi"), Some(2147483648.0));
        assert_eq!(parse_quantity("1"), Some(1.0));
        assert_eq!(parse_quantity("1e3"), Some(1000.0));
    }

    #[test]
    fn taints_and_tolerations() {
        let taint = json!({"key": "nvidia.com/gpu", "effect": "NoSchedule"});
        let tolerant = json!({"spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}});
        assert!(tolerates(&tolerant, &taint));
        assert!(!tolerates(&json!({"spec": {}}), &taint));
        let amd = json!({"key": "amd.com/gpu", "effect": "NoSchedule"});
        assert!(!tolerates(&tolerant, &amd));
    }

    #[test]
    fn back_off_doubles_up_to_its_cap_and_reads_as_go_prints_it() {
        let b: Vec<String> = (1..=6).map(|n| go_duration(restart_backoff(n))).collect();
        assert_eq!(b, ["1s", "2s", "4s", "8s", "10s", "10s"]);
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_secs(300)), "5m0s");
    }
}
