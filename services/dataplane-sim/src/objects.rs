//! Reading a cluster's objects (JSON, as the simulated API server stores them): lookups by kind
//! and name, labels and selectors, readiness, and what a pod's containers run (command lines,
//! flags, the model a vLLM pod serves). Routing, the serving model, the endpoint picker and the
//! pods' metrics all read the cluster through these.

use std::sync::Arc;

use serde_json::{Map, Value};

pub(crate) fn s<'a>(v: &'a Value, ptr: &str) -> Option<&'a str> {
    v.pointer(ptr).and_then(Value::as_str)
}

pub(crate) fn ns_of(v: &Value) -> &str {
    s(v, "/metadata/namespace").unwrap_or("default")
}

pub(crate) fn name_of(v: &Value) -> &str {
    s(v, "/metadata/name").unwrap_or("")
}

pub(crate) fn group_of(v: &Value) -> &str {
    s(v, "/apiVersion")
        .and_then(|a| a.rsplit_once('/').map(|(g, _)| g))
        .unwrap_or("")
}

pub(crate) fn deleting(v: &Value) -> bool {
    v.pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
}

/// The object of `kind` in API `group` (`""` for the core API) named `ns`/`name`, unless it is
/// being deleted.
pub fn find<'a>(
    objs: &'a [Arc<Value>],
    kind: &str,
    group: &str,
    ns: &str,
    name: &str,
) -> Option<&'a Value> {
    objs.iter().map(Arc::as_ref).find(|o| {
        o["kind"] == kind
            && group_of(o) == group
            && ns_of(o) == ns
            && name_of(o) == name
            && !deleting(o)
    })
}

pub(crate) fn labels_match(selector: &Map<String, Value>, labels: Option<&Value>) -> bool {
    !selector.is_empty()
        && selector
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

pub(crate) fn pod_ready(p: &Value) -> bool {
    !deleting(p)
        && s(p, "/status/phase") == Some("Running")
        && p.pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
}

/// The value of flag `name` on a command line: `name value` or `name=value`.
pub(crate) fn flag_value(args: &[String], name: &str) -> Option<String> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == name {
            return it.next().cloned();
        }
        if let Some(v) = a.strip_prefix(&format!("{name}=")) {
            return Some(v.to_string());
        }
    }
    None
}

/// The Envoy Gateway policy of `kind` (`gateway.envoyproxy.io`) in `ns` whose `targetRefs`
/// name Gateway `gw`, unless it is being deleted.
pub fn gateway_policy<'a>(
    objs: &'a [Arc<Value>],
    kind: &str,
    ns: &str,
    gw: &str,
) -> Option<&'a Value> {
    objs.iter().map(Arc::as_ref).find(|o| {
        o["kind"] == kind
            && group_of(o) == "gateway.envoyproxy.io"
            && ns_of(o) == ns
            && !deleting(o)
            && o.pointer("/spec/targetRefs")
                .and_then(Value::as_array)
                .is_some_and(|ts| ts.iter().any(|t| t["kind"] == "Gateway" && t["name"] == gw))
    })
}

/// The model name a vLLM command line serves: `--served-model-name`, else `--model`, else the
/// positional argument of `vllm serve`.
pub fn served_model_name(args: &[String]) -> Option<String> {
    let flag = |name: &str| flag_value(args, name);
    flag("--served-model-name")
        .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
        .filter(|v| !v.is_empty())
        .or_else(|| flag("--model"))
        .or_else(|| {
            args.iter()
                .position(|a| a == "serve")
                .and_then(|i| args.get(i + 1))
                .filter(|a| !a.starts_with('-'))
                .cloned()
        })
}

/// A container's command line: its `command`, then its `args`.
pub(crate) fn command_line(container: &Value) -> Vec<String> {
    let mut all = Vec::new();
    for field in ["command", "args"] {
        if let Some(a) = container.get(field).and_then(Value::as_array) {
            all.extend(a.iter().filter_map(Value::as_str).map(str::to_string));
        }
    }
    all
}

fn container_args(pod_spec: &Value) -> Vec<Vec<String>> {
    pod_spec
        .get("containers")
        .and_then(Value::as_array)
        .map(|cs| cs.iter().map(command_line).collect())
        .unwrap_or_default()
}

fn owner<'a>(objs: &'a [Arc<Value>], obj: &Value, kind: &str, group: &str) -> Option<&'a Value> {
    let refs = obj.pointer("/metadata/ownerReferences")?.as_array()?;
    let r = refs.iter().find(|r| r["kind"] == kind)?;
    find(objs, kind, group, ns_of(obj), r["name"].as_str()?)
}

/// The served model of a pod: its own containers' (a pod keeps the model it was started with,
/// whatever its Deployment says now), else its owning Deployment's (through its ReplicaSet).
pub(crate) fn pod_model(objs: &[Arc<Value>], pod: &Value) -> Option<String> {
    let from = |spec: Option<&Value>| {
        spec.map(container_args)
            .unwrap_or_default()
            .iter()
            .find_map(|a| served_model_name(a))
    };
    from(pod.get("spec")).or_else(|| {
        let deployment = owner(objs, pod, "Deployment", "apps").or_else(|| {
            owner(objs, pod, "ReplicaSet", "apps")
                .and_then(|rs| owner(objs, rs, "Deployment", "apps"))
        });
        deployment.and_then(|d| from(d.pointer("/spec/template/spec")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_name_flags() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(served_model_name(&v(&["--model", "m"])), Some("m".into()));
        assert_eq!(
            served_model_name(&v(&["--model=m", "--served-model-name=n"])),
            Some("n".into())
        );
        assert_eq!(
            served_model_name(&v(&["vllm", "serve", "org/m"])),
            Some("org/m".into())
        );
        assert_eq!(served_model_name(&v(&["--port", "8000"])), None);
    }
}
