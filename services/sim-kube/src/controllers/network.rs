//! The cloud controller and gateway implementation: LoadBalancer Services and
//! Gateways get addresses after their delays; HTTPRoutes and InferencePools get
//! the parent status a Gateway API implementation would write; Envoy Gateway's SecurityPolicies
//! get the ancestor status Envoy Gateway writes (Accepted, or not with the reason).
//!
//! Addresses are only assigned while empty: the crate that wires the simulated
//! data plane may overwrite them through `/status`, and that must stick.

use std::collections::HashMap;

use tokio::time::Instant;

use serde_json::{json, Value};

use super::{is_deleting, set_condition, uid, Snapshot, Timers};
use crate::managed::Scope;
use crate::ops;
use crate::resources::{GATEWAY_GROUP, INFERENCE_GROUP};
use crate::store::{Key, Store};
use crate::ClusterConfig;

const CCM: &str = "cloud-controller-manager";
pub const GATEWAY_CONTROLLER: &str = "sim.doks.digitalocean.com/gateway-controller";
const GATEWAY_MANAGER: &str = "sim-gateway-controller";
const NETWORK_ANNOTATION: &str = "service.beta.kubernetes.io/do-loadbalancer-network";

fn address(store: &Store, internal: bool) -> String {
    let n = store.next_seq();
    if internal {
        format!("10.124.{}.{}", (n / 250) % 250, n % 250 + 2)
    } else {
        // TEST-NET-3: public-looking, never routable, never contacted.
        format!("203.0.113.{}", n % 250 + 2)
    }
}

fn is_internal(annotations: Option<&Value>) -> bool {
    annotations
        .and_then(|a| a.get(NETWORK_ANNOTATION))
        .and_then(Value::as_str)
        .is_some_and(|v| v.eq_ignore_ascii_case("INTERNAL"))
}

pub fn run(store: &Store, snap: &Snapshot, timers: &mut Timers, config: &ClusterConfig) {
    load_balancers(store, snap, timers, config);
    gateway_classes(store, snap);
    gateways(store, snap, timers, config);
    routes(store, snap);
    pools(store, snap);
    policies(store, snap);
}

fn load_balancers(store: &Store, snap: &Snapshot, timers: &mut Timers, config: &ClusterConfig) {
    for (key, svc) in snap.of_kind("Service") {
        if is_deleting(svc) {
            continue;
        }
        let has_ingress = svc
            .pointer("/status/loadBalancer/ingress")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        let is_lb = svc.pointer("/spec/type").and_then(Value::as_str) == Some("LoadBalancer");
        if !is_lb {
            if has_ingress {
                ops::mutate(store, key, Scope::Status, CCM, |s| {
                    s["status"]["loadBalancer"] = json!({})
                });
            }
            continue;
        }
        if has_ingress {
            continue;
        }
        let start = *timers
            .first_seen
            .entry(uid(svc))
            .or_insert_with(Instant::now);
        if !timers.elapsed(start, config.lb_address_delay) {
            continue;
        }
        let ip = address(store, is_internal(svc.pointer("/metadata/annotations")));
        ops::mutate(store, key, Scope::Status, CCM, |s| {
            let empty = s
                .pointer("/status/loadBalancer/ingress")
                .and_then(Value::as_array)
                .is_none_or(|a| a.is_empty());
            if empty {
                s["status"]["loadBalancer"]["ingress"] = json!([{"ip": ip, "ipMode": "VIP"}]);
            }
        });
    }
}

fn gateway_classes(store: &Store, snap: &Snapshot) {
    for (key, gc) in snap.of_kind("GatewayClass") {
        let generation = gc["metadata"]["generation"].as_i64();
        ops::mutate_status(store, key, GATEWAY_MANAGER, |st| {
            set_condition(
                &mut st["conditions"],
                "Accepted",
                "True",
                "Accepted",
                "Handled by the simulated gateway controller",
                generation,
                false,
            );
        });
    }
}

/// The Gateway a parentRef points at, if it exists: (namespace, name).
fn parent_gateway<'a>(
    snap: &'a Snapshot,
    route_ns: &str,
    pref: &Value,
) -> Option<(String, &'a Value)> {
    let group = pref["group"].as_str().unwrap_or(GATEWAY_GROUP);
    let kind = pref["kind"].as_str().unwrap_or("Gateway");
    if group != GATEWAY_GROUP || kind != "Gateway" {
        return None;
    }
    let ns = pref["namespace"].as_str().unwrap_or(route_ns).to_string();
    let gw = snap.get("Gateway", &ns, pref["name"].as_str().unwrap_or_default())?;
    (!is_deleting(gw)).then_some((ns, gw))
}

/// Whether a listener admits routes from `route_ns` (allowedRoutes.namespaces.from).
fn listener_admits(listener: &Value, gw_ns: &str, route_ns: &str) -> bool {
    match listener
        .pointer("/allowedRoutes/namespaces/from")
        .and_then(Value::as_str)
        .unwrap_or("Same")
    {
        "All" | "Selector" => true,
        _ => gw_ns == route_ns,
    }
}

/// Listeners of `gw` a route's parentRef attaches to.
fn attached_listeners<'a>(
    gw: &'a Value,
    gw_ns: &str,
    route_ns: &str,
    pref: &Value,
) -> Vec<&'a Value> {
    let section = pref["sectionName"].as_str();
    gw.pointer("/spec/listeners")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|l| section.is_none_or(|s| l["name"] == s))
        .filter(|l| listener_admits(l, gw_ns, route_ns))
        .collect()
}

/// The HTTPRoutes (not being deleted) under each (namespace, name) that `targets` names for
/// them, in snapshot order, each once: filed once per pass, so that a Gateway or pool looks at
/// the routes that name it rather than at every route of the cluster.
fn routes_by<'s>(
    snap: &'s Snapshot,
    targets: impl Fn(&'s Key, &'s Value) -> Vec<(&'s str, &'s str)>,
) -> HashMap<(&'s str, &'s str), Vec<(&'s Key, &'s Value)>> {
    let mut by: HashMap<_, Vec<(&Key, &Value)>> = HashMap::new();
    for (rk, route) in snap.of_kind("HTTPRoute") {
        if is_deleting(route) {
            continue;
        }
        for target in targets(rk, route) {
            let routes = by.entry(target).or_default();
            if routes.last().is_none_or(|(k, _)| *k != rk) {
                routes.push((rk, route));
            }
        }
    }
    by
}

fn parent_refs(route: &Value) -> impl Iterator<Item = &Value> {
    route
        .pointer("/spec/parentRefs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn gateways(store: &Store, snap: &Snapshot, timers: &mut Timers, config: &ClusterConfig) {
    // By the Gateway their parentRefs name (a parentRef may name another namespace's).
    let routes_by_parent = routes_by(snap, |rk, route| {
        parent_refs(route)
            .map(|p| {
                let ns = p["namespace"].as_str().unwrap_or(&rk.ns);
                (ns, p["name"].as_str().unwrap_or_default())
            })
            .collect()
    });
    for (key, gw) in snap.of_kind("Gateway") {
        if is_deleting(gw) {
            continue;
        }
        let generation = gw["metadata"]["generation"].as_i64();
        let start = *timers
            .first_seen
            .entry(uid(gw))
            .or_insert_with(Instant::now);
        let programmed = timers.elapsed(start, config.gateway_address_delay);
        let has_address = gw
            .pointer("/status/addresses")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        let new_address = (programmed && !has_address).then(|| {
            match gw
                .pointer("/spec/addresses/0/value")
                .and_then(Value::as_str)
            {
                Some(v) => v.to_string(),
                None => address(
                    store,
                    is_internal(gw.pointer("/spec/infrastructure/annotations")),
                ),
            }
        });
        let mut listeners = Vec::new();
        for l in gw
            .pointer("/spec/listeners")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let lname = l["name"].as_str().unwrap_or_default();
            let attached = routes_by_parent
                .get(&(key.ns.as_str(), key.name.as_str()))
                .into_iter()
                .flatten()
                .filter(|(rk, r)| {
                    parent_refs(r).any(|p| {
                        parent_gateway(snap, &rk.ns, p).is_some_and(|(ns, g)| {
                            ns == key.ns
                                && g["metadata"]["name"] == key.name.as_str()
                                && attached_listeners(gw, &key.ns, &rk.ns, p)
                                    .iter()
                                    .any(|al| al["name"] == lname)
                        })
                    })
                })
                .count();
            let missing_cert = l
                .pointer("/tls/certificateRefs")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| {
                    let kind = c["kind"].as_str().unwrap_or("Secret");
                    let ns = c["namespace"].as_str().unwrap_or(&key.ns);
                    kind != "Secret"
                        || snap
                            .get("Secret", ns, c["name"].as_str().unwrap_or_default())
                            .is_none()
                })
                .map(|c| c["name"].as_str().unwrap_or_default().to_string());
            let mut conds = json!([]);
            set_condition(
                &mut conds,
                "Accepted",
                "True",
                "Accepted",
                "Listener is accepted",
                generation,
                false,
            );
            match &missing_cert {
                None => {
                    set_condition(
                        &mut conds,
                        "ResolvedRefs",
                        "True",
                        "ResolvedRefs",
                        "All references resolved",
                        generation,
                        false,
                    );
                    let (s, r) = if programmed {
                        ("True", "Programmed")
                    } else {
                        ("False", "Pending")
                    };
                    set_condition(&mut conds, "Programmed", s, r, "", generation, false);
                }
                Some(name) => {
                    set_condition(
                        &mut conds,
                        "ResolvedRefs",
                        "False",
                        "InvalidCertificateRef",
                        &format!("Secret {name} not found"),
                        generation,
                        false,
                    );
                    set_condition(
                        &mut conds,
                        "Programmed",
                        "False",
                        "Invalid",
                        "Listener has unresolved certificate references",
                        generation,
                        false,
                    );
                }
            }
            listeners.push((lname.to_string(), attached, conds));
        }
        ops::mutate_status(store, key, GATEWAY_MANAGER, |st| {
            if let Some(ip) = &new_address {
                let empty = st
                    .pointer("/addresses")
                    .and_then(Value::as_array)
                    .is_none_or(|a| a.is_empty());
                if empty {
                    st["addresses"] = json!([{"type": "IPAddress", "value": ip}]);
                }
            }
            set_condition(
                &mut st["conditions"],
                "Accepted",
                "True",
                "Accepted",
                "Gateway is accepted",
                generation,
                false,
            );
            let (s, r, m) = if programmed {
                ("True", "Programmed", "Gateway is programmed")
            } else {
                ("False", "Pending", "Waiting for the load balancer")
            };
            set_condition(
                &mut st["conditions"],
                "Programmed",
                s,
                r,
                m,
                generation,
                false,
            );
            let old_listeners = st["listeners"].as_array().cloned().unwrap_or_default();
            let list: Vec<Value> = listeners
                .iter()
                .map(|(name, attached, conds)| {
                    // Keep transition times from the previous status of this listener.
                    let mut merged = old_listeners
                        .iter()
                        .find(|l| l["name"] == name.as_str())
                        .map(|l| l["conditions"].clone())
                        .unwrap_or(json!([]));
                    for c in conds.as_array().into_iter().flatten() {
                        set_condition(
                            &mut merged,
                            c["type"].as_str().unwrap_or_default(),
                            c["status"].as_str().unwrap_or_default(),
                            c["reason"].as_str().unwrap_or_default(),
                            c["message"].as_str().unwrap_or_default(),
                            generation,
                            false,
                        );
                    }
                    json!({
                        "name": name,
                        "attachedRoutes": attached,
                        "supportedKinds": [{"group": GATEWAY_GROUP, "kind": "HTTPRoute"}],
                        "conditions": merged,
                    })
                })
                .collect();
            st["listeners"] = json!(list);
        });
    }
}

/// Whether a backendRef resolves: (group, kind, namespace, name) exists.
fn backend_exists(snap: &Snapshot, route_ns: &str, b: &Value) -> bool {
    let group = b["group"].as_str().unwrap_or("");
    let kind = b["kind"].as_str().unwrap_or("Service");
    let ns = b["namespace"].as_str().unwrap_or(route_ns);
    let name = b["name"].as_str().unwrap_or_default();
    match (group, kind) {
        ("", "Service") => snap.get("Service", ns, name).is_some(),
        (INFERENCE_GROUP, "InferencePool") => snap.get("InferencePool", ns, name).is_some(),
        _ => false,
    }
}

fn backend_refs(route: &Value) -> impl Iterator<Item = &Value> {
    route
        .pointer("/spec/rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|r| r["backendRefs"].as_array().into_iter().flatten())
}

fn routes(store: &Store, snap: &Snapshot) {
    for (key, route) in snap.of_kind("HTTPRoute") {
        if is_deleting(route) {
            continue;
        }
        let generation = route["metadata"]["generation"].as_i64();
        let missing: Vec<String> = backend_refs(route)
            .filter(|b| !backend_exists(snap, &key.ns, b))
            .map(|b| b["name"].as_str().unwrap_or_default().to_string())
            .collect();
        let old = route
            .pointer("/status/parents")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let parents: Vec<Value> = parent_refs(route)
            .map(|pref| {
                let mut conds = old
                    .iter()
                    .find(|p| &p["parentRef"] == pref)
                    .map(|p| p["conditions"].clone())
                    .unwrap_or(json!([]));
                let accepted = parent_gateway(snap, &key.ns, pref)
                    .filter(|(ns, gw)| !attached_listeners(gw, ns, &key.ns, pref).is_empty());
                match (parent_gateway(snap, &key.ns, pref), accepted) {
                    (_, Some(_)) => set_condition(&mut conds, "Accepted", "True", "Accepted", "Route is accepted", generation, false),
                    (Some(_), None) => set_condition(&mut conds, "Accepted", "False", "NotAllowedByListeners", "No listener of the Gateway admits this route", generation, false),
                    (None, None) => set_condition(&mut conds, "Accepted", "False", "NoMatchingParent", "Parent Gateway not found", generation, false),
                }
                if missing.is_empty() {
                    set_condition(&mut conds, "ResolvedRefs", "True", "ResolvedRefs", "All references resolved", generation, false);
                } else {
                    set_condition(&mut conds, "ResolvedRefs", "False", "BackendNotFound", &format!("backend(s) not found: {}", missing.join(", ")), generation, false);
                }
                json!({"parentRef": pref, "controllerName": GATEWAY_CONTROLLER, "conditions": conds})
            })
            .collect();
        ops::mutate_status(store, key, GATEWAY_MANAGER, |st| {
            st["parents"] = json!(parents)
        });
    }
}

fn pools(store: &Store, snap: &Snapshot) {
    // By the pool their backendRefs name (a backendRef may name another namespace's).
    let routes_by_pool = routes_by(snap, |rk, route| {
        backend_refs(route)
            .filter(|b| b["group"] == INFERENCE_GROUP && b["kind"] == "InferencePool")
            .filter_map(|b| {
                let ns = b["namespace"].as_str().unwrap_or(&rk.ns);
                Some((ns, b["name"].as_str()?))
            })
            .collect()
    });
    for (key, pool) in snap.of_kind("InferencePool") {
        if is_deleting(pool) {
            continue;
        }
        let generation = pool["metadata"]["generation"].as_i64();
        // Gateways whose accepted routes send traffic to this pool.
        let mut gws: Vec<(String, String)> = Vec::new();
        let targeting = routes_by_pool
            .get(&(key.ns.as_str(), key.name.as_str()))
            .into_iter()
            .flatten();
        for (rk, route) in targeting {
            for pref in parent_refs(route) {
                if let Some((ns, gw)) = parent_gateway(snap, &rk.ns, pref) {
                    if attached_listeners(gw, &ns, &rk.ns, pref).is_empty() {
                        continue;
                    }
                    let entry = (
                        ns,
                        gw["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                    );
                    if !gws.contains(&entry) {
                        gws.push(entry);
                    }
                }
            }
        }
        let epp = pool.pointer("/spec/endpointPickerRef");
        let epp_ok = epp.is_some_and(|e| {
            e["kind"].as_str().unwrap_or("Service") == "Service"
                && snap
                    .get("Service", &key.ns, e["name"].as_str().unwrap_or_default())
                    .is_some()
        });
        let old = pool
            .pointer("/status/parents")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let parents: Vec<Value> = gws
            .iter()
            .map(|(ns, name)| {
                let pref = json!({"group": GATEWAY_GROUP, "kind": "Gateway", "name": name, "namespace": ns});
                let mut conds = old
                    .iter()
                    .find(|p| p["parentRef"] == pref)
                    .map(|p| p["conditions"].clone())
                    .unwrap_or(json!([]));
                set_condition(&mut conds, "Accepted", "True", "Accepted", "InferencePool is accepted by the Gateway", generation, false);
                match (epp, epp_ok) {
                    (_, true) => set_condition(&mut conds, "ResolvedRefs", "True", "ResolvedRefs", "All references resolved", generation, false),
                    (None, _) => set_condition(&mut conds, "ResolvedRefs", "True", "ResolvedRefs", "No endpoint picker configured", generation, false),
                    (Some(_), false) => set_condition(&mut conds, "ResolvedRefs", "False", "InvalidExtensionRef", "The endpoint picker Service does not exist", generation, false),
                }
                json!({"parentRef": pref, "controllerName": GATEWAY_CONTROLLER, "conditions": conds})
            })
            .collect();
        ops::mutate_status(store, key, GATEWAY_MANAGER, |st| {
            if parents.is_empty() {
                if let Some(st) = st.as_object_mut() {
                    st.remove("parents");
                }
            } else {
                st["parents"] = json!(parents);
            }
        });
    }
}

/// Envoy Gateway's status of its policies on a Gateway (SecurityPolicy, BackendTrafficPolicy):
/// one ancestor per Gateway targeted (a policy on a Gateway reports the Gateway itself),
/// Accepted when the Gateway exists and what the policy refers to does; otherwise Accepted
/// False. A refused SecurityPolicy makes every route under the Gateway answer 500, as Envoy
/// Gateway does; a refused BackendTrafficPolicy is not applied (the data plane reads the same
/// conditions).
fn policies(store: &Store, snap: &Snapshot) {
    let policies = snap
        .of_kind("SecurityPolicy")
        .chain(snap.of_kind("BackendTrafficPolicy"));
    for (key, policy) in policies {
        if is_deleting(policy) {
            continue;
        }
        let generation = policy["metadata"]["generation"].as_i64();
        let problem = targets_problem(snap, &key.ns, policy).or_else(|| {
            if policy["kind"] == "SecurityPolicy" {
                security_policy_problem(snap, &key.ns, policy)
            } else {
                traffic_policy_problem(policy)
            }
        });
        let old = policy
            .pointer("/status/ancestors")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let ancestors: Vec<Value> = policy
            .pointer("/spec/targetRefs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|t| t["kind"] == "Gateway")
            .map(|t| {
                let aref = json!({"group": GATEWAY_GROUP, "kind": "Gateway",
                                  "name": t["name"], "namespace": key.ns});
                let mut conds = old
                    .iter()
                    .find(|a| a["ancestorRef"] == aref)
                    .map(|a| a["conditions"].clone())
                    .unwrap_or(json!([]));
                match &problem {
                    None => set_condition(&mut conds, "Accepted", "True", "Accepted", "Policy has been accepted.", generation, false),
                    Some(why) => set_condition(&mut conds, "Accepted", "False", "Invalid", why, generation, false),
                }
                json!({"ancestorRef": aref, "controllerName": GATEWAY_CONTROLLER, "conditions": conds})
            })
            .collect();
        ops::mutate_status(store, key, GATEWAY_MANAGER, |st| {
            st["ancestors"] = json!(ancestors)
        });
    }
}

/// A policy's target that Envoy Gateway would not find (only Gateways are simulated targets).
fn targets_problem(snap: &Snapshot, ns: &str, policy: &Value) -> Option<String> {
    for t in policy["spec"]["targetRefs"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = t["name"].as_str().unwrap_or_default();
        if t["kind"] != "Gateway" || snap.get("Gateway", ns, name).is_none() {
            return Some(format!("Gateway {name} not found"));
        }
    }
    None
}

/// Why Envoy Gateway would not accept a SecurityPolicy: an extAuth backend Service is missing,
/// or it asks for something this simulation does not enforce.
fn security_policy_problem(snap: &Snapshot, ns: &str, policy: &Value) -> Option<String> {
    let spec = &policy["spec"];
    let Some(http) = spec.pointer("/extAuth/http") else {
        return Some("only extAuth over HTTP is simulated".into());
    };
    let refs = http["backendRefs"].as_array().cloned().unwrap_or_default();
    if refs.is_empty() {
        return Some("extAuth has no backendRefs".into());
    }
    for b in &refs {
        let name = b["name"].as_str().unwrap_or_default();
        let kind = b["kind"].as_str().unwrap_or("Service");
        let b_ns = b["namespace"].as_str().unwrap_or(ns);
        if kind != "Service" || b_ns != ns || snap.get("Service", ns, name).is_none() {
            return Some(format!("backend Service {b_ns}/{name} not found"));
        }
    }
    None
}

/// What of a BackendTrafficPolicy this simulation does not enforce: anything but local
/// `responseOverride`s (no redirects, no bodies from a ConfigMap).
fn traffic_policy_problem(policy: &Value) -> Option<String> {
    let spec = policy["spec"].as_object()?;
    if let Some(k) = spec
        .keys()
        .find(|k| *k != "targetRefs" && *k != "responseOverride")
    {
        return Some(format!("only responseOverride is simulated, not {k}"));
    }
    let overrides = spec.get("responseOverride").and_then(Value::as_array);
    for o in overrides.into_iter().flatten() {
        if o.get("response").is_none() || o.pointer("/response/body/valueRef").is_some() {
            return Some("only inline local responses are simulated".into());
        }
        let m = &o["match"];
        for s in m["statusCodes"].as_array().into_iter().flatten() {
            let valid = match s["type"].as_str().unwrap_or("Value") {
                "Range" => s.pointer("/range/start").is_some() && s.pointer("/range/end").is_some(),
                _ => s["value"].is_u64(),
            };
            if !valid {
                return Some("a statusCodes entry without its value or range".into());
            }
        }
        for h in m["responseHeaders"].as_array().into_iter().flatten() {
            if h.pointer("/value/type").and_then(Value::as_str) == Some("RegularExpression") {
                return Some("RegularExpression header matches are not simulated".into());
            }
        }
    }
    None
}
