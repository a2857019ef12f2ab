//! How a load balancer's traffic reaches a model, derived from a cluster's objects the way a
//! Gateway API implementation with Inference Extension support derives it.
//!
//! The chain is: LoadBalancer Service whose selector has
//! `gateway.networking.k8s.io/gateway-name: <gw>` (the label gateway implementations put on the
//! gateway pods they deploy, so such a Service fronts Gateway `<gw>` in its namespace) → the
//! Gateway's HTTPS listener → its `tls.certificateRefs` Secret → an HTTPRoute whose parentRef is
//! the Gateway → a backendRef of kind `InferencePool` → the pool's `spec.selector.matchLabels` →
//! ready Pods. Requests are authenticated as the SecurityPolicy on the Gateway says
//! ([`crate::auth`]).
//! Everything here is a pure function of JSON objects, read through the snapshot's filing by
//! namespace ([`Objects`]): what a Service's wiring reads is in its own namespace, but for what
//! a reference names in another (a certificate Secret, an authorization Service) and the
//! cluster-scoped Namespaces a NetworkPolicy's peers select.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde_json::{Map, Value};

use crate::data_plane::{
    Backend, EndpointConfig, PoolRoute, Route, ROUTE_IDLE_FLOOR, ROUTE_TIMEOUT, STREAM_IDLE_TIMEOUT,
};
use crate::objects::{find, labels_match, name_of, ns_of, pod_model, pod_ready, s, Objects};

/// Selector label that ties a Service to the Gateway it fronts.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";
const INFERENCE_GROUP: &str = "inference.networking.k8s.io";

/// An endpoint's configuration and what is wrong with the wiring, if anything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Wiring {
    pub config: EndpointConfig,
    pub problems: Vec<String>,
}

/// Reads a Secret entry from `data` (base64) or, for objects stored as written, `stringData`.
fn secret_value(secret: &Value, key: &str) -> Option<String> {
    if let Some(b64) = secret
        .pointer("/data")
        .and_then(|d| d.get(key))
        .and_then(Value::as_str)
    {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .ok()?;
        return String::from_utf8(bytes).ok();
    }
    secret
        .pointer("/stringData")
        .and_then(|d| d.get(key))
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Where traffic to a pod comes from, as NetworkPolicy rules see it.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// Outside the cluster: a load balancer forwarding a client's connection.
    Outside,
    /// A pod of namespace `ns` with these labels.
    Pod { ns: &'a str, labels: &'a Value },
}

fn selects(selector: &Value, labels: Option<&Value>) -> bool {
    sim_kube::LabelSelector::from_object(selector).matches_labels(labels)
}

fn peer_admits(objs: &Objects, ns: &str, peer: &Value, from: Source) -> bool {
    let has = |k: &str| peer.get(k).is_some_and(|v| !v.is_null());
    match from {
        // An address block names sources outside the cluster (Cilium, DOKS's CNI, never
        // matches a pod by address); selectors name pods.
        Source::Outside => has("ipBlock"),
        Source::Pod {
            ns: from_ns,
            labels,
        } => {
            if has("ipBlock") {
                return false;
            }
            let ns_ok = match peer.get("namespaceSelector").filter(|v| !v.is_null()) {
                None => from_ns == ns,
                Some(sel) => {
                    // Namespaces are cluster-scoped: filed under `default`.
                    let ns_labels = objs
                        .named("default", "Namespace", from_ns)
                        .first()
                        .and_then(|n| n.pointer("/metadata/labels").cloned())
                        .unwrap_or_else(
                            || serde_json::json!({"kubernetes.io/metadata.name": from_ns}),
                        );
                    selects(sel, Some(&ns_labels))
                }
            };
            ns_ok
                && peer
                    .get("podSelector")
                    .filter(|v| !v.is_null())
                    .is_none_or(|sel| selects(sel, Some(labels)))
        }
    }
}

fn port_admits(p: &Value, port: i64) -> bool {
    p["protocol"].as_str().unwrap_or("TCP") == "TCP"
        && match &p["port"] {
            Value::Null => true,
            Value::Number(n) => {
                let first = n.as_i64().unwrap_or(0);
                let last = p["endPort"].as_i64().unwrap_or(first);
                (first..=last).contains(&port)
            }
            // A named port would need the pod's container ports; the worker writes numbers.
            _ => false,
        }
}

/// Whether the NetworkPolicies of namespace `ns` let `from` open a TCP connection to `port` of
/// a pod there with `labels`: a pod no ingress policy selects admits everything; a selected
/// pod admits what at least one of those policies' rules allows (port and peer). `objs` is a
/// plain list of objects (a test's, read from a cluster's API); [`ingress_admits_in`] reads a
/// filed snapshot.
pub fn ingress_admits(
    objs: &[Arc<Value>],
    ns: &str,
    labels: &Value,
    port: i64,
    from: Source,
) -> bool {
    ingress_admits_in(&Objects::new(objs), ns, labels, port, from)
}

/// [`ingress_admits`], reading a filed snapshot.
pub fn ingress_admits_in(
    objs: &Objects,
    ns: &str,
    labels: &Value,
    port: i64,
    from: Source,
) -> bool {
    let policies: Vec<&Value> = objs
        .live(ns, "NetworkPolicy", "networking.k8s.io")
        .filter(|o| {
            o.pointer("/spec/policyTypes")
                .and_then(Value::as_array)
                .is_none_or(|ts| ts.iter().any(|t| t == "Ingress"))
                && selects(&o["spec"]["podSelector"], Some(labels))
        })
        .collect();
    if policies.is_empty() {
        return true;
    }
    let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
    policies.iter().any(|p| {
        list(&p["spec"]["ingress"]).iter().any(|rule| {
            let ports = list(&rule["ports"]);
            let peers = list(&rule["from"]);
            (ports.is_empty() || ports.iter().any(|q| port_admits(q, port)))
                && (peers.is_empty() || peers.iter().any(|q| peer_admits(objs, ns, q, from)))
        })
    })
}

/// Derives the endpoint configuration for LoadBalancer Service `svc` from the cluster's objects.
pub fn wire(svc: &Value, objs: &Objects) -> Wiring {
    let ns = ns_of(svc).to_string();
    let mut w = Wiring::default();
    let Some(gw_name) = s(
        svc,
        &format!("/spec/selector/{}", GATEWAY_NAME_LABEL.replace('/', "~1")),
    ) else {
        w.problems.push(format!(
            "service selector has no {GATEWAY_NAME_LABEL}: it fronts no gateway"
        ));
        return w;
    };
    let Some(gw) = find(objs, "Gateway", "gateway.networking.k8s.io", &ns, gw_name) else {
        w.problems.push(format!("gateway {ns}/{gw_name} not found"));
        return w;
    };
    let svc_ports: Vec<i64> = svc
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .map(|ps| ps.iter().filter_map(|p| p["port"].as_i64()).collect())
        .unwrap_or_default();
    let listeners: Vec<&Value> = gw
        .pointer("/spec/listeners")
        .and_then(Value::as_array)
        .map(|ls| ls.iter().filter(|l| l["protocol"] == "HTTPS").collect())
        .unwrap_or_default();
    let listener = listeners
        .iter()
        .find(|l| l["port"].as_i64().is_some_and(|p| svc_ports.contains(&p)))
        .or_else(|| listeners.first())
        .copied();
    let Some(listener) = listener else {
        w.problems
            .push(format!("gateway {ns}/{gw_name} has no HTTPS listener"));
        return w;
    };
    let listener_name = listener["name"].as_str().unwrap_or("");
    // The load balancer forwards to the gateway's pods on the listener's port: a policy that
    // does not admit it leaves connections unanswered (no TLS handshake completes).
    let gateway_pods = serde_json::json!({ GATEWAY_NAME_LABEL: gw_name });
    let listener_port = listener["port"].as_i64().unwrap_or(0);
    if !ingress_admits_in(objs, &ns, &gateway_pods, listener_port, Source::Outside) {
        w.problems.push(format!(
            "network policy in {ns} denies the load balancer the gateway's port {listener_port}"
        ));
        return w;
    }
    let (auth, problem) = crate::auth::authentication(objs, &ns, gw_name, &gateway_pods);
    w.config.auth = auth;
    w.problems.extend(problem);
    let (overrides, problem) = crate::overrides::overrides(objs, &ns, gw_name);
    w.config.overrides = overrides;
    w.problems.extend(problem);
    // TLS: the first certificateRef, a kubernetes.io/tls Secret.
    match listener.pointer("/tls/certificateRefs/0") {
        None => w.problems.push(format!(
            "listener {listener_name} has no tls.certificateRefs"
        )),
        Some(r) => {
            let kind = r["kind"].as_str().unwrap_or("Secret");
            let sns = r["namespace"].as_str().unwrap_or(&ns);
            let sname = r["name"].as_str().unwrap_or("");
            match (kind, find(objs, "Secret", "", sns, sname)) {
                ("Secret", Some(secret)) => {
                    match (
                        secret_value(secret, "tls.crt"),
                        secret_value(secret, "tls.key"),
                    ) {
                        (Some(c), Some(k)) => w.config.tls = Some((c, k)),
                        _ => w
                            .problems
                            .push(format!("secret {sns}/{sname} lacks tls.crt or tls.key")),
                    }
                }
                _ => w
                    .problems
                    .push(format!("certificate secret {sns}/{sname} not found")),
            }
        }
    }
    // The first HTTPRoute attached to this gateway (and listener, if it names one).
    let attached = objs
        .live(&ns, "HTTPRoute", "gateway.networking.k8s.io")
        .filter(|o| {
            o.pointer("/spec/parentRefs")
                .and_then(Value::as_array)
                .is_some_and(|ps| {
                    ps.iter().any(|p| {
                        p["name"] == gw_name
                            && p["kind"].as_str().unwrap_or("Gateway") == "Gateway"
                            && p["namespace"].as_str().unwrap_or(&ns) == ns
                            && p["sectionName"]
                                .as_str()
                                .is_none_or(|sn| sn == listener_name)
                    })
                })
        });
    let mut routes: Vec<&Value> = attached.collect();
    // Gateway API precedence between routes: oldest first, then by name.
    routes.sort_by_key(|r| {
        (
            s(r, "/metadata/creationTimestamp")
                .unwrap_or("")
                .to_string(),
            name_of(r).to_string(),
        )
    });
    let Some(route) = routes.first() else {
        w.problems
            .push(format!("no HTTPRoute attached to gateway {ns}/{gw_name}"));
        return w;
    };
    let rules = route
        .pointer("/spec/rules")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    // Every rule leading to an InferencePool counts (the worker writes one per model
    // deployment, each matching its model's name); the gateway sends a request to a pod serving
    // the model it names, which is what those matches amount to.
    let mut paths = Vec::new();
    let mut pool_names = Vec::new();
    // Per pool (the first rule leading to it decides): how long the gateway lets a held request
    // sit idle, Envoy's stream idle timeout unless the rule sets a request timeout, which Envoy
    // Gateway turns into a route idle timeout of at least an hour; and how long a response may
    // take, the rule's request timeout, else Envoy's route timeout of 15 s (a zero timeout: no
    // limit on either).
    let mut idle_limits: Vec<(Option<Duration>, Option<Duration>)> = Vec::new();
    for rule in &rules {
        let backend = rule
            .get("backendRefs")
            .and_then(Value::as_array)
            .and_then(|bs| bs.first());
        let Some(b) = backend else { continue };
        if b["kind"] != "InferencePool" || b["group"] != INFERENCE_GROUP {
            continue;
        }
        let Some(name) = b["name"].as_str() else {
            continue;
        };
        if !pool_names.iter().any(|n| n == name) {
            pool_names.push(name.to_string());
            let limit = match rule.pointer("/timeouts/request").and_then(Value::as_str) {
                None => (Some(STREAM_IDLE_TIMEOUT), Some(ROUTE_TIMEOUT)),
                Some(t) => match gateway_duration(t) {
                    Some(d) if d.is_zero() => (None, None),
                    Some(d) => (Some(d.max(ROUTE_IDLE_FLOOR)), Some(d)),
                    None => {
                        w.problems.push(format!(
                            "HTTPRoute {ns}/{} has an invalid timeouts.request {t:?}",
                            name_of(route),
                        ));
                        (Some(STREAM_IDLE_TIMEOUT), Some(ROUTE_TIMEOUT))
                    }
                },
            };
            idle_limits.push(limit);
        }
        for m in rule
            .get("matches")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
        {
            let v = m
                .pointer("/path/value")
                .and_then(Value::as_str)
                .unwrap_or("/");
            let path = match m.pointer("/path/type").and_then(Value::as_str) {
                Some("Exact") => format!("={v}"),
                _ => v.to_string(),
            };
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
    }
    if pool_names.is_empty() {
        w.problems.push(format!(
            "HTTPRoute {ns}/{} has no backendRef to an {INFERENCE_GROUP} InferencePool",
            name_of(route)
        ));
    }
    let gateway = Source::Pod {
        ns: &ns,
        labels: &gateway_pods,
    };
    let mut endpoints = Vec::new();
    let mut pools = Vec::new();
    for (pool_name, (stream_idle, route_timeout)) in pool_names.iter().zip(idle_limits) {
        let (ready, spec) = pool_endpoints(objs, &ns, pool_name, gateway, &mut w.problems);
        endpoints.extend(ready.into_iter().map(|b| Backend { route_timeout, ..b }));
        pools.push(PoolRoute {
            name: pool_name.clone(),
            key: spec.key.clone(),
            flow_control: spec.picker.as_ref().is_some_and(|p| p.flow_control),
            queue_ttl: spec
                .picker
                .as_ref()
                .and_then(|p| p.queue_ttl)
                .unwrap_or(crate::picker::DEFAULT_QUEUE_TTL),
            stream_idle,
        });
    }
    endpoints.sort_by(|a, b| a.pod.cmp(&b.pod));
    endpoints.dedup_by(|a, b| a.pod == b.pod);
    // A route to nothing that resolves: the gateway answers 5xx (or holds the request, when
    // a pool's picker runs with flow control).
    w.config.route = Route::Pool {
        paths,
        endpoints,
        pools,
    };
    w
}

/// A Gateway API duration (`1h`, `30s`, `500ms`, `1m30s`: one to four number-unit pairs, units
/// `h`, `m`, `s`, `ms`, numbers of at most five digits), as HTTPRoute `timeouts` take them.
pub fn gateway_duration(text: &str) -> Option<Duration> {
    let mut rest = text;
    let mut total = Duration::ZERO;
    let mut pairs = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 5 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (Duration::from_millis(1), 2)
        } else if rest.starts_with('h') {
            (Duration::from_secs(3600), 1)
        } else if rest.starts_with('m') {
            (Duration::from_secs(60), 1)
        } else if rest.starts_with('s') {
            (Duration::from_secs(1), 1)
        } else {
            return None;
        };
        rest = &rest[len..];
        total += unit * n as u32;
        pairs += 1;
    }
    (1..=4).contains(&pairs).then_some(total)
}

/// The ready pods of InferencePool `pool_name` that the gateway may reach, with their models;
/// what is missing or denied goes to `problems`.
fn pool_endpoints(
    objs: &Objects,
    ns: &str,
    pool_name: &str,
    gateway: Source,
    problems: &mut Vec<String>,
) -> (Vec<Backend>, Arc<crate::picker::PoolSpec>) {
    let pool = find(objs, "InferencePool", INFERENCE_GROUP, ns, pool_name);
    let selector = pool.and_then(|p| {
        p.pointer("/spec/selector/matchLabels")
            .or_else(|| p.pointer("/spec/selector"))
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter(|(_, v)| v.is_string())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Map<_, _>>()
            })
    });
    let Some(selector) = selector else {
        problems.push(format!(
            "InferencePool {ns}/{pool_name} not found or has no selector"
        ));
        let spec = crate::picker::pool_spec(objs, ns, pool, pool_name, problems);
        return (Vec::new(), Arc::new(spec));
    };
    let pods: Vec<&Value> = objs
        .in_namespace(ns, "Pod")
        .iter()
        .copied()
        .filter(|o| labels_match(&selector, o.pointer("/metadata/labels")))
        .collect();
    // The gateway connects to each pod on the pool's target port, subject to the namespace's
    // NetworkPolicies: a pod they do not admit it to is no endpoint.
    let target_port = pool
        .and_then(|p| p.pointer("/spec/targetPorts/0/number"))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let (reachable, denied): (Vec<&&Value>, Vec<&&Value>) =
        pods.iter().filter(|p| pod_ready(p)).partition(|p| {
            let labels = p.pointer("/metadata/labels").unwrap_or(&Value::Null);
            ingress_admits_in(objs, ns, labels, target_port, gateway)
        });
    if !denied.is_empty() {
        problems.push(format!(
            "network policy in {ns} denies the gateway port {target_port} of {} ready pods",
            denied.len()
        ));
    }
    // What the serving model needs: the pool's endpoint picker and each pod's GPUs and flags.
    let pool_spec = Arc::new(crate::picker::pool_spec(
        objs, ns, pool, pool_name, problems,
    ));
    let endpoints: Vec<Backend> = reachable
        .iter()
        .map(|p| {
            let mut b = Backend::new(name_of(p), pod_model(objs, p).as_deref());
            b.serving = crate::serving::BackendServing::new(
                crate::serving::ReplicaSpec::of_pod(objs, p),
                Some(pool_spec.clone()),
            );
            b
        })
        .collect();
    if endpoints.is_empty() {
        problems.push(format!(
            "InferencePool {ns}/{pool_name} has no ready pods ({} matching)",
            pods.len()
        ));
    }
    (endpoints, pool_spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ready pod as a rule without `timeouts.request` routes to it (Envoy's 15 s).
    fn routed(pod: &str, model: Option<&str>) -> Backend {
        Backend {
            route_timeout: Some(ROUTE_TIMEOUT),
            ..Backend::new(pod, model)
        }
    }
    use serde_json::json;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn objects() -> Vec<Arc<Value>> {
        [
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tls", "namespace": "di-1"},
                   "type": "kubernetes.io/tls", "data": {"tls.crt": b64("CERT"), "tls.key": b64("KEY")}}),
            json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": "gw", "namespace": "di-1"},
                   "spec": {"gatewayClassName": "x", "listeners": [
                       {"name": "http", "port": 80, "protocol": "HTTP"},
                       {"name": "https", "port": 443, "protocol": "HTTPS", "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "tls"}]}}]}}),
            json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r", "namespace": "di-1"},
                   "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                       "backendRefs": [{"group": INFERENCE_GROUP, "kind": "InferencePool", "name": "pool"}]}]}}),
            json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool", "namespace": "di-1"},
                   "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}}),
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm", "namespace": "di-1"},
                   "spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": ["--model", "org/big", "--served-model-name", "big"]}]}}}}),
            json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "vllm-1", "namespace": "di-1",
                   "ownerReferences": [{"kind": "Deployment", "name": "vllm"}]}}),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-1-a", "namespace": "di-1", "labels": {"app": "vllm"},
                   "ownerReferences": [{"kind": "ReplicaSet", "name": "vllm-1"}]},
                   "spec": {"containers": [{"name": "vllm", "args": []}]},
                   "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-1-b", "namespace": "di-1", "labels": {"app": "vllm"}},
                   "status": {"phase": "Pending"}}),
        ]
        .into_iter()
        .map(Arc::new)
        .chain(crate::auth::tests::objects("di-1", "secret-token"))
        .collect()
    }

    fn svc() -> Value {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lb", "namespace": "di-1"},
               "spec": {"type": "LoadBalancer", "selector": {GATEWAY_NAME_LABEL: "gw"}, "ports": [{"port": 443}]}})
    }

    /// The route with the serving facts left out (tested on their own below).
    fn without_serving(route: &Route) -> Route {
        let mut r = route.clone();
        if let Route::Pool {
            endpoints, pools, ..
        } = &mut r
        {
            for b in endpoints {
                b.serving = Default::default();
            }
            pools.clear();
        }
        r
    }

    #[test]
    fn full_chain() {
        let w = wire(&svc(), &Objects::new(&objects()));
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        assert_eq!(w.config.tls, Some(("CERT".into(), "KEY".into())));
        assert!(
            matches!(&w.config.auth, crate::auth::Authentication::External { hashes: Some(h), .. } if h.len() == 1)
        );
        assert_eq!(
            without_serving(&w.config.route),
            Route::Pool {
                paths: vec!["/".into()],
                endpoints: vec![routed("vllm-1-a", Some("big"))],
                pools: vec![],
            }
        );
    }

    /// A Deployment rolling from one model to another: its older pod still serves the model it
    /// was started with, the newer one the Deployment's current model; the endpoint serves both.
    #[test]
    fn each_pod_serves_the_model_it_was_started_with() {
        let mut objs = objects();
        objs.retain(|o| o["kind"] != "Pod");
        let pod = |name: &str, model: &str| {
            Arc::new(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "di-1", "labels": {"app": "vllm"},
                             "ownerReferences": [{"kind": "ReplicaSet", "name": "vllm-1"}]},
                "spec": {"containers": [{"name": "vllm", "args": ["--model", model]}]},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}))
        };
        objs.push(pod("vllm-old", "org/small"));
        objs.push(pod("vllm-new", "big"));
        let w = wire(&svc(), &Objects::new(&objs));
        assert_eq!(
            without_serving(&w.config.route),
            Route::Pool {
                paths: vec!["/".into()],
                endpoints: vec![
                    routed("vllm-new", Some("big")),
                    routed("vllm-old", Some("org/small")),
                ],
                pools: vec![],
            }
        );
    }

    /// A DI with two model deployments: a rule and a pool per model; the endpoint serves both.
    #[test]
    fn every_rule_of_the_route_leads_to_its_pool() {
        let mut objs = objects();
        for o in objs.iter_mut() {
            if o["kind"] == "HTTPRoute" {
                let mut route = (**o).clone();
                let mut second = route["spec"]["rules"][0].clone();
                second["backendRefs"][0]["name"] = json!("pool-2");
                route["spec"]["rules"].as_array_mut().unwrap().push(second);
                *o = Arc::new(route);
            }
        }
        objs.push(Arc::new(json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "pool-2", "namespace": "di-1"},
            "spec": {"selector": {"matchLabels": {"app": "vllm-2"}}, "targetPorts": [{"number": 8000}]}})));
        objs.push(Arc::new(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vllm-2-a", "namespace": "di-1", "labels": {"app": "vllm-2"}},
            "spec": {"containers": [{"name": "vllm", "args": ["--model", "small"]}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})));
        let w = wire(&svc(), &Objects::new(&objs));
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        assert_eq!(
            without_serving(&w.config.route),
            Route::Pool {
                paths: vec!["/".into()],
                endpoints: vec![
                    routed("vllm-1-a", Some("big")),
                    routed("vllm-2-a", Some("small")),
                ],
                pools: vec![],
            }
        );
    }

    /// The pool's endpoint picker configuration, found as the EPP finds it (pool → Service →
    /// Deployment → `--config-file` → mounted ConfigMap), and each pod's GPUs from its node.
    #[test]
    fn pools_carry_their_picker_config_and_pods_their_gpus() {
        use crate::picker::Scorer;
        let mut objs = objects();
        for o in objs.iter_mut() {
            if o["kind"] == "InferencePool" {
                let mut p = (**o).clone();
                p["metadata"]["uid"] = json!("pool-uid");
                p["spec"]["endpointPickerRef"] =
                    json!({"kind": "Service", "name": "pool-epp", "port": {"number": 9002}});
                *o = Arc::new(p);
            }
            if o["kind"] == "Pod" && o["metadata"]["name"] == "vllm-1-a" {
                let mut p = (**o).clone();
                p["metadata"]["uid"] = json!("pod-uid");
                p["spec"] = json!({"nodeName": "gpu-abcde", "containers": [{"name": "vllm",
                    "args": ["--model", "org/Llama-3.1-8B", "--max-num-seqs", "8", "--gpu-memory-utilization=0.85"],
                    "resources": {"limits": {"nvidia.com/gpu": "2"}}}]});
                *o = Arc::new(p);
            }
        }
        let config = "kind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n\
                      schedulingProfiles: [{name: default, plugins: [{pluginRef: queue-scorer, weight: 4}]}]\n";
        objs.extend(
            [
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-abcde", "labels": {
                    "doks.digitalocean.com/gpu-model": "h200", "node.kubernetes.io/instance-type": "gpu-h200x8-1128gb"}}}),
                json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "pool-epp", "namespace": "di-1"},
                       "spec": {"selector": {"epp": "pool"}}}),
                json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "pool-epp", "namespace": "di-1"},
                       "spec": {"template": {"metadata": {"labels": {"epp": "pool"}}, "spec": {
                           "containers": [{"name": "epp", "args": ["--config-file", "/config/config.yaml"],
                                           "volumeMounts": [{"name": "config", "mountPath": "/config"}]}],
                           "volumes": [{"name": "config", "configMap": {"name": "pool-epp"}}]}}}}),
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pool-epp", "namespace": "di-1"},
                       "data": {"config.yaml": config}}),
            ]
            .into_iter()
            .map(Arc::new),
        );
        let backend = |w: &Wiring| match &w.config.route {
            Route::Pool { endpoints, .. } => endpoints[0].serving.clone(),
            _ => panic!("no pool"),
        };
        let w = wire(&svc(), &Objects::new(&objs));
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        let b = backend(&w);
        let pool = b.pool.as_ref().unwrap();
        assert_eq!(pool.key, "pool-uid");
        assert_eq!(
            pool.picker.as_ref().unwrap().scorers,
            vec![(Scorer::Queue, 4.0)]
        );
        assert_eq!(
            b.replica,
            crate::serving::ReplicaSpec {
                uid: Some("pod-uid".into()),
                gpu_model: Some("h200".into()),
                gpus: 2,
                model_repo: Some("org/Llama-3.1-8B".into()),
                max_num_seqs: Some(8),
                gpu_memory_utilization_pct: Some(85),
                ..Default::default()
            }
        );
        // A configuration that does not parse: reported, and the pool routes round robin.
        let broken: Vec<Arc<Value>> = objs
            .iter()
            .map(|o| {
                if o["kind"] == "ConfigMap" {
                    let mut c = (**o).clone();
                    c["data"]["config.yaml"] = json!("kind: Nope");
                    Arc::new(c)
                } else {
                    o.clone()
                }
            })
            .collect();
        let w = wire(&svc(), &Objects::new(&broken));
        assert!(backend(&w).pool.unwrap().picker.is_none());
        assert!(
            w.problems.iter().any(|p| p.contains("endpoint picker")),
            "{:?}",
            w.problems
        );
        // No picker at all (its Service gone): round robin, and nothing to report.
        let without_picker: Vec<Arc<Value>> = objs
            .iter()
            .filter(|o| o["kind"] != "Service" || o["metadata"]["name"] == "auth")
            .cloned()
            .collect();
        let w = wire(&svc(), &Objects::new(&without_picker));
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        assert!(backend(&w).pool.unwrap().picker.is_none());
    }

    /// A listener's certificate named in another namespace is read there, not from a Secret of
    /// the same name in the gateway's.
    #[test]
    fn a_certificate_of_another_namespace_is_read_there() {
        let mut objs = objects();
        for gw in objs.iter_mut().filter(|o| o["kind"] == "Gateway") {
            let cert = &mut Arc::make_mut(gw)["spec"]["listeners"][1]["tls"]["certificateRefs"][0];
            cert["namespace"] = json!("certs");
        }
        let w = wire(&svc(), &Objects::new(&objs));
        assert_eq!(w.config.tls, None);
        assert!(
            w.problems
                .contains(&"certificate secret certs/tls not found".to_string()),
            "{:?}",
            w.problems
        );
        objs.push(Arc::new(
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tls", "namespace": "certs"},
                   "type": "kubernetes.io/tls", "data": {"tls.crt": b64("SHARED"), "tls.key": b64("KEY")}}),
        ));
        let w = wire(&svc(), &Objects::new(&objs));
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        assert_eq!(w.config.tls, Some(("SHARED".into(), "KEY".into())));
    }

    #[test]
    fn gateway_api_durations() {
        assert_eq!(gateway_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(gateway_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(gateway_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(
            gateway_duration("1h2m3s4ms"),
            Some(Duration::from_millis(3_723_004))
        );
        assert_eq!(gateway_duration("0s"), Some(Duration::ZERO));
        for bad in [
            "",
            "30",
            "s",
            "1.5s",
            "-1s",
            "123456s",
            "1h1h1h1h1h",
            "10 s",
            "1d",
        ] {
            assert_eq!(gateway_duration(bad), None, "{bad:?}");
        }
    }

    /// A held request sits idle until Envoy's stream idle timeout (5 minutes) unless the rule
    /// sets a request timeout (then at least an hour); the picker's queue TTL is its default.
    #[test]
    fn pools_carry_the_gateways_idle_limit_and_the_pickers_ttl() {
        let w = wire(&svc(), &Objects::new(&objects()));
        let Route::Pool { pools, .. } = &w.config.route else {
            panic!("{:?}", w.config.route)
        };
        assert_eq!(pools.len(), 1);
        assert_eq!(pools[0].name, "pool");
        assert_eq!(pools[0].stream_idle, Some(STREAM_IDLE_TIMEOUT));
        assert_eq!(pools[0].queue_ttl, crate::picker::DEFAULT_QUEUE_TTL);
        assert!(!pools[0].flow_control);
        let with_timeout = |t: &str| {
            let mut objs = objects();
            for o in objs.iter_mut() {
                if o["kind"] == "HTTPRoute" {
                    let mut route = (**o).clone();
                    route["spec"]["rules"][0]["timeouts"] = json!({"request": t});
                    *o = Arc::new(route);
                }
            }
            let w = wire(&svc(), &Objects::new(&objs));
            let Route::Pool { pools, .. } = &w.config.route else {
                panic!("{:?}", w.config.route)
            };
            pools[0].stream_idle
        };
        assert_eq!(with_timeout("1m30s"), Some(ROUTE_IDLE_FLOOR));
        assert_eq!(with_timeout("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(with_timeout("0s"), None);
    }

    #[test]
    fn missing_pieces_degrade_like_a_gateway() {
        let mut objs = objects();
        objs.retain(|o| o["kind"] != "HTTPRoute");
        let w = wire(&svc(), &Objects::new(&objs));
        assert_eq!(w.config.route, Route::None);
        assert!(w.config.tls.is_some());

        let mut objs = objects();
        objs.retain(|o| o["kind"] != "Pod");
        let w = wire(&svc(), &Objects::new(&objs));
        assert!(
            matches!(w.config.route, Route::Pool { ref endpoints, .. } if endpoints.is_empty())
        );

        let mut objs = objects();
        objs.retain(|o| o["metadata"]["name"] != "tls");
        let w = wire(&svc(), &Objects::new(&objs));
        assert!(w.config.tls.is_none());
        assert!(w.problems.iter().any(|p| p.contains("certificate")));

        let mut objs = objects();
        objs.retain(|o| o["kind"] != "SecurityPolicy");
        let w = wire(&svc(), &Objects::new(&objs));
        assert_eq!(w.config.auth, crate::auth::Authentication::Open);
        assert!(w.problems.iter().any(|p| p.contains("not authenticated")));

        let mut other = svc();
        other["spec"]["selector"] = json!({"app": "x"});
        assert_eq!(wire(&other, &Objects::new(&objects())).config.tls, None);
    }

    fn policy(name: &str, spec: Value) -> Arc<Value> {
        Arc::new(
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                        "metadata": {"name": name, "namespace": "di-1"}, "spec": spec}),
        )
    }

    fn endpoints(w: &Wiring) -> Vec<String> {
        match &w.config.route {
            Route::Pool { endpoints, .. } => endpoints.iter().map(|b| b.pod.clone()).collect(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn network_policies_gate_the_load_balancer_and_the_gateway() {
        let deny = policy(
            "deny",
            json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
        );
        let https = policy(
            "https",
            json!({"podSelector": {"matchLabels": {GATEWAY_NAME_LABEL: "gw"}},
            "ingress": [{"ports": [{"protocol": "TCP", "port": 443}]}]}),
        );
        let from_gateway = |port: u16| {
            policy(
                "vllm",
                json!({"podSelector": {"matchLabels": {"app": "vllm"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {GATEWAY_NAME_LABEL: "gw"}}}],
                         "ports": [{"protocol": "TCP", "port": port}]}]}),
            )
        };
        let with = |extra: &[Arc<Value>]| {
            let mut objs = objects();
            objs.extend(extra.iter().cloned());
            wire(&svc(), &Objects::new(&objs))
        };
        // Default deny alone: the load balancer reaches nothing.
        let w = with(std::slice::from_ref(&deny));
        assert!(w.config.tls.is_none(), "no handshake completes");
        assert!(
            w.problems.iter().any(|p| p.contains("load balancer")),
            "{:?}",
            w.problems
        );
        // The gateway's port open, the model servers still closed: no endpoints.
        let w = with(&[deny.clone(), https.clone()]);
        assert!(w.config.tls.is_some());
        assert!(endpoints(&w).is_empty());
        assert!(
            w.problems.iter().any(|p| p.contains("port 8000")),
            "{:?}",
            w.problems
        );
        // Allowed on another port than the pool's: still no endpoints.
        assert!(endpoints(&with(&[deny.clone(), https.clone(), from_gateway(9000)])).is_empty());
        // The data path's allows: served, but the authorization service is closed off.
        let w = with(&[deny.clone(), https.clone(), from_gateway(8000)]);
        assert_eq!(endpoints(&w), ["vllm-1-a"]);
        assert!(
            w.problems
                .iter()
                .any(|p| p.contains("authorization service")),
            "{:?}",
            w.problems
        );
        let auth = policy(
            "auth",
            json!({"podSelector": {"matchLabels": {"app": "auth"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {GATEWAY_NAME_LABEL: "gw"}}}],
                         "ports": [{"protocol": "TCP", "port": 8080}]}]}),
        );
        let w = with(&[deny.clone(), https.clone(), from_gateway(8000), auth]);
        assert!(w.problems.is_empty(), "{:?}", w.problems);
        assert_eq!(endpoints(&w), ["vllm-1-a"]);
        // A pod of another namespace is not the gateway, even with the gateway's labels.
        let gw_labels = json!({GATEWAY_NAME_LABEL: "gw"});
        let objs: Vec<Arc<Value>> = [deny, https, from_gateway(8000)].into();
        let vllm = json!({"app": "vllm"});
        let other = Source::Pod {
            ns: "di-2",
            labels: &gw_labels,
        };
        assert!(!ingress_admits(&objs, "di-1", &vllm, 8000, other));
        let same = Source::Pod {
            ns: "di-1",
            labels: &gw_labels,
        };
        assert!(ingress_admits(&objs, "di-1", &vllm, 8000, same));
        assert!(!ingress_admits(&objs, "di-1", &vllm, 8000, Source::Outside));
        // An ipBlock admits the outside, not pods; no policy at all admits everyone.
        let block = [policy(
            "b",
            json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]}),
        )];
        assert!(ingress_admits(&block, "di-1", &vllm, 8000, Source::Outside));
        assert!(!ingress_admits(&block, "di-1", &vllm, 8000, same));
        assert!(ingress_admits(&[], "di-1", &vllm, 8000, other));
    }
}
