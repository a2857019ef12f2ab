//! Reading a cluster's objects (JSON, as the simulated API server stores them): a snapshot
//! filed by namespace, kind and name ([`Objects`]), lookups in it, labels and selectors,
//! readiness, and what a pod's containers run (command lines, flags, the model a vLLM pod
//! serves). Routing, the serving model, the endpoint picker and the pods' metrics all read the
//! cluster through these.

use std::collections::HashMap;
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

/// A cluster's objects (a snapshot, in the API server's order), filed once by namespace, kind
/// and name, so that a lookup reads only the objects of the kind it wants in the namespace it
/// looks in. The cloud controller derives the wiring of every load balancer of a cluster from
/// one snapshot, and a cluster holds many DIs, one namespace each: a lookup scanning the whole
/// snapshot made a pass cost the square of the cluster's DIs.
pub struct Objects<'a> {
    /// Namespace → kind → its objects.
    filed: HashMap<&'a str, HashMap<&'a str, Kind<'a>>>,
}

/// The objects of one kind in one namespace, in snapshot order, and by name (the cluster-scoped
/// ones, Nodes and Namespaces, are as many as the cluster's nodes and DIs).
#[derive(Default)]
struct Kind<'a> {
    all: Vec<&'a Value>,
    by_name: HashMap<&'a str, Vec<&'a Value>>,
}

impl<'a> Objects<'a> {
    pub fn new(all: &'a [Arc<Value>]) -> Objects<'a> {
        let mut filed: HashMap<_, HashMap<_, Kind>> = HashMap::new();
        for o in all {
            // Every lookup names a kind: an object without one is never found.
            if let Some(kind) = o["kind"].as_str() {
                let k = filed.entry(ns_of(o)).or_default().entry(kind).or_default();
                k.all.push(o);
                k.by_name.entry(name_of(o)).or_default().push(o);
            }
        }
        Objects { filed }
    }

    fn kind(&self, ns: &str, kind: &str) -> Option<&Kind<'a>> {
        self.filed.get(ns)?.get(kind)
    }

    /// The objects of `kind` in namespace `ns`, in snapshot order. Cluster-scoped objects
    /// (Nodes, Namespaces) have no namespace: they are filed under `default`, as [`ns_of`]
    /// reads them.
    pub fn in_namespace(&self, ns: &str, kind: &str) -> &[&'a Value] {
        self.kind(ns, kind).map_or(&[], |k| &k.all)
    }

    /// Those of them in API `group`, but for those being deleted.
    pub fn live(
        &self,
        ns: &str,
        kind: &str,
        group: &'static str,
    ) -> impl Iterator<Item = &'a Value> + '_ {
        self.in_namespace(ns, kind)
            .iter()
            .copied()
            .filter(move |o| group_of(o) == group && !deleting(o))
    }

    /// Those of them named `name`, whatever their API group and even if being deleted.
    pub fn named(&self, ns: &str, kind: &str, name: &str) -> &[&'a Value] {
        self.kind(ns, kind)
            .and_then(|k| k.by_name.get(name))
            .map_or(&[], Vec::as_slice)
    }
}

/// The object of `kind` in API `group` (`""` for the core API) named `ns`/`name`, unless it is
/// being deleted.
pub fn find<'a>(
    objs: &Objects<'a>,
    kind: &str,
    group: &str,
    ns: &str,
    name: &str,
) -> Option<&'a Value> {
    objs.named(ns, kind, name)
        .iter()
        .copied()
        .find(|o| group_of(o) == group && !deleting(o))
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
pub fn gateway_policy<'a>(objs: &Objects<'a>, kind: &str, ns: &str, gw: &str) -> Option<&'a Value> {
    objs.live(ns, kind, "gateway.envoyproxy.io").find(|o| {
        o.pointer("/spec/targetRefs")
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

fn owner<'a>(objs: &Objects<'a>, obj: &Value, kind: &str, group: &str) -> Option<&'a Value> {
    let refs = obj.pointer("/metadata/ownerReferences")?.as_array()?;
    let r = refs.iter().find(|r| r["kind"] == kind)?;
    find(objs, kind, group, ns_of(obj), r["name"].as_str()?)
}

/// The served model of a pod: its own containers' (a pod keeps the model it was started with,
/// whatever its Deployment says now), else its owning Deployment's (through its ReplicaSet).
pub(crate) fn pod_model(objs: &Objects, pod: &Value) -> Option<String> {
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
