//! How the gateway authenticates a request, derived from a cluster's objects the way Envoy
//! Gateway derives it: the SecurityPolicy that targets the Gateway, its `extAuth.http` backend
//! Service, that Service's ready pods, and what those pods (`services/endpoint-auth`, whose
//! decision code this is) can read: the Secret named by their `--secret` argument in their own
//! namespace, if a Role bound to their ServiceAccount lets them watch it.
//!
//! Envoy Gateway's behaviour, followed here:
//! - no SecurityPolicy on the Gateway, or one its controller has not yet processed (no
//!   `Accepted` condition for its generation): Envoy has no authorization filter and admits
//!   every request;
//! - a SecurityPolicy it refused (`Accepted: False`): the routes under the Gateway answer 500;
//! - an accepted one: each request is checked with the authorization service first; when no
//!   replica can answer (none ready, none reachable through the namespace's NetworkPolicies,
//!   none able to read the Secret), the request fails with `statusOnError` (Envoy's default
//!   403), unless `failOpen`.

use endpoint_auth::TokenHashes;
use serde_json::Value;

use crate::objects::{deleting, find, gateway_policy, labels_match, ns_of, pod_ready, s, Objects};
use crate::routing::{ingress_admits_in, Source};

/// How the gateway treats a request before routing it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Authentication {
    /// No authorization filter: every request is admitted.
    #[default]
    Open,
    /// A policy the controller refused: every request gets 500.
    Refused,
    /// Checked by the authorization service: `hashes` are what its replicas read, `None` when
    /// no replica can answer (then `status_on_error`, or admitted if `fail_open`).
    External {
        hashes: Option<TokenHashes>,
        status_on_error: u16,
        fail_open: bool,
    },
}

impl Authentication {
    /// Checked against `hashes` by a service that answers, with Envoy Gateway's defaults.
    pub fn external(hashes: TokenHashes) -> Authentication {
        Authentication::External {
            hashes: Some(hashes),
            status_on_error: 403,
            fail_open: false,
        }
    }
}

/// endpoint-auth's `--secret` default.
const DEFAULT_SECRET: &str = "access-tokens";

/// The authentication of Gateway `gw` in namespace `ns`, whose pods carry `gateway_pods`
/// labels, and a note of what is wrong, if anything.
pub fn authentication(
    objs: &Objects,
    ns: &str,
    gw: &str,
    gateway_pods: &Value,
) -> (Authentication, Option<String>) {
    let policy = gateway_policy(objs, "SecurityPolicy", ns, gw);
    let Some(policy) = policy else {
        return (
            Authentication::Open,
            Some(format!(
                "no SecurityPolicy on gateway {ns}/{gw}: requests are not authenticated"
            )),
        );
    };
    match accepted(policy) {
        None => {
            return (
                Authentication::Open,
                Some(format!(
                    "SecurityPolicy {ns}/{} not processed yet",
                    s(policy, "/metadata/name").unwrap_or("")
                )),
            )
        }
        Some(false) => {
            return (
                Authentication::Refused,
                Some(format!(
                    "SecurityPolicy {ns}/{} not accepted: every request is 500",
                    s(policy, "/metadata/name").unwrap_or("")
                )),
            )
        }
        Some(true) => {}
    }
    let ext = &policy["spec"]["extAuth"];
    let status_on_error = ext["statusOnError"].as_u64().map_or(403, |c| c as u16);
    let fail_open = ext["failOpen"].as_bool().unwrap_or(false);
    let hashes = ext
        .pointer("/http/backendRefs/0")
        .and_then(|b| service_hashes(objs, ns, b, gateway_pods));
    let note = hashes
        .is_none()
        .then(|| format!("no replica of the authorization service of {ns}/{gw} can answer"));
    (
        Authentication::External {
            hashes,
            status_on_error,
            fail_open,
        },
        note,
    )
}

/// The policy's `Accepted` condition for its current generation: `None` while not processed.
pub(crate) fn accepted(policy: &Value) -> Option<bool> {
    let generation = policy["metadata"]["generation"].as_i64().unwrap_or(0);
    let ancestors = policy.pointer("/status/ancestors")?.as_array()?;
    let mut all = None;
    for a in ancestors {
        let c = a["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Accepted")?;
        if c["observedGeneration"].as_i64().unwrap_or(0) < generation {
            return None;
        }
        all = Some(all.unwrap_or(true) && c["status"] == "True");
    }
    all
}

/// The hashes the ready, reachable replicas behind backend `b` read; `None` if there are none.
fn service_hashes(
    objs: &Objects,
    ns: &str,
    b: &Value,
    gateway_pods: &Value,
) -> Option<TokenHashes> {
    let name = b["name"].as_str()?;
    let svc = find(
        objs,
        "Service",
        "",
        b["namespace"].as_str().unwrap_or(ns),
        name,
    )?;
    let selector = svc.pointer("/spec/selector")?.as_object()?;
    let port = b["port"].as_i64()?;
    let target = svc
        .pointer("/spec/ports")?
        .as_array()?
        .iter()
        .find(|p| p["port"].as_i64() == Some(port))
        .map(|p| p["targetPort"].as_i64().unwrap_or(port))?;
    // The Service may be in another namespace than the gateway: its pods are in its own.
    objs.in_namespace(ns_of(svc), "Pod")
        .iter()
        .copied()
        .filter(|p| {
            !deleting(p) && pod_ready(p) && labels_match(selector, p.pointer("/metadata/labels"))
        })
        .filter(|p| {
            let from = Source::Pod {
                ns,
                labels: gateway_pods,
            };
            let labels = p.pointer("/metadata/labels").cloned().unwrap_or_default();
            ingress_admits_in(objs, ns_of(p), &labels, target, from)
        })
        .find_map(|p| pod_hashes(objs, p))
}

/// What one endpoint-auth pod reads: the Secret its `--secret` argument names, in its own
/// namespace, if its ServiceAccount may watch it.
fn pod_hashes(objs: &Objects, pod: &Value) -> Option<TokenHashes> {
    let ns = ns_of(pod);
    let args: Vec<&str> = pod
        .pointer("/spec/containers/0/args")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let secret = args
        .iter()
        .position(|a| *a == "--secret")
        .and_then(|i| args.get(i + 1).copied())
        .or_else(|| args.iter().find_map(|a| a.strip_prefix("--secret=")))
        .unwrap_or(DEFAULT_SECRET);
    let account = s(pod, "/spec/serviceAccountName").unwrap_or("default");
    if !may_watch_secret(objs, ns, account, secret) {
        return None;
    }
    let secret = find(objs, "Secret", "", ns, secret)?;
    let secret = serde_json::from_value(secret.clone()).ok()?;
    Some(TokenHashes::from_secret(&secret))
}

/// Whether a RoleBinding of `ns` grants ServiceAccount `account` a Role that lets it get,
/// list and watch Secret `secret` (as the service's watch needs).
fn may_watch_secret(objs: &Objects, ns: &str, account: &str, secret: &str) -> bool {
    let has = |v: &Value, x: &str| {
        v.as_array()
            .is_some_and(|a| a.iter().any(|e| e == x || e == "*"))
    };
    objs.in_namespace(ns, "RoleBinding")
        .iter()
        .copied()
        .filter(|b| !deleting(b))
        .filter(|b| {
            b["subjects"].as_array().is_some_and(|ss| {
                ss.iter().any(|x| {
                    x["kind"] == "ServiceAccount"
                        && x["name"] == account
                        && x["namespace"].as_str().unwrap_or(ns) == ns
                })
            })
        })
        .filter(|b| b["roleRef"]["kind"] == "Role")
        .filter_map(|b| {
            find(
                objs,
                "Role",
                "rbac.authorization.k8s.io",
                ns,
                b["roleRef"]["name"].as_str()?,
            )
        })
        .any(|role| {
            role["rules"].as_array().into_iter().flatten().any(|r| {
                has(&r["apiGroups"], "")
                    && has(&r["resources"], "secrets")
                    && ["get", "list", "watch"].iter().all(|v| has(&r["verbs"], v))
                    && r["resourceNames"]
                        .as_array()
                        .is_none_or(|n| n.is_empty() || n.iter().any(|x| x == secret))
            })
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use base64::Engine;
    use serde_json::json;
    use std::sync::Arc;

    use crate::data_plane::token_hash;

    const GW_PODS: &str = "gateway.networking.k8s.io/gateway-name";

    /// The objects the worker renders for a DI's authentication in `ns`, as Envoy Gateway and
    /// the kubelet leave them: the policy accepted, one endpoint-auth pod ready, allowed to
    /// watch the Secret holding `token`'s hash.
    pub(crate) fn objects(ns: &str, token: &str) -> Vec<Arc<Value>> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        [
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tokens", "namespace": ns},
                   "data": {"tok-1": b64(&format!(" {} \n", token_hash(token).to_uppercase()))}}),
            json!({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "SecurityPolicy",
                   "metadata": {"name": "auth", "namespace": ns, "generation": 1},
                   "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}],
                            "extAuth": {"http": {"backendRefs": [{"name": "auth", "port": 8080}], "path": "/check"},
                                        "statusOnError": 503}},
                   "status": {"ancestors": [{"ancestorRef": {"name": "gw"}, "conditions": [
                       {"type": "Accepted", "status": "True", "observedGeneration": 1}]}]}}),
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "auth", "namespace": ns},
                   "spec": {"selector": {"app": "auth"}, "ports": [{"port": 8080, "targetPort": 8080}]}}),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "auth-1", "namespace": ns, "labels": {"app": "auth"}},
                   "spec": {"serviceAccountName": "auth", "containers": [{"name": "auth", "args": ["--secret", "tokens"]}]},
                   "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "auth", "namespace": ns},
                   "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tokens"],
                              "verbs": ["get", "list", "watch"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "auth", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "auth"},
                   "subjects": [{"kind": "ServiceAccount", "name": "auth", "namespace": ns}]}),
        ]
        .into_iter()
        .map(Arc::new)
        .collect()
    }

    fn auth(objs: &[Arc<Value>]) -> Authentication {
        authentication(&Objects::new(objs), "di-1", "gw", &json!({GW_PODS: "gw"})).0
    }

    fn edit(objs: &mut [Arc<Value>], kind: &str, f: impl Fn(&mut Value)) {
        for o in objs.iter_mut().filter(|o| o["kind"] == kind) {
            f(Arc::make_mut(o));
        }
    }

    fn answers(a: &Authentication) -> Option<&TokenHashes> {
        match a {
            Authentication::External {
                hashes,
                status_on_error: 503,
                fail_open: false,
            } => hashes.as_ref(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_accepted_policy_asks_the_service_which_reads_the_hashes() {
        let objs = objects("di-1", "tok");
        let hashes = answers(&auth(&objs)).expect("a replica answers").clone();
        let allow = |t: &str| endpoint_auth::decide(Some(&format!("Bearer {t}")), Some(&hashes));
        assert_eq!(allow("tok"), endpoint_auth::Decision::Allow);
        assert_eq!(allow("other"), endpoint_auth::Decision::Refuse);
        assert_eq!(
            endpoint_auth::decide(None, Some(&hashes)),
            endpoint_auth::Decision::Refuse
        );
    }

    #[test]
    fn without_an_accepted_policy_envoy_admits_everyone_or_answers_500() {
        let mut objs = objects("di-1", "tok");
        objs.retain(|o| o["kind"] != "SecurityPolicy");
        assert_eq!(auth(&objs), Authentication::Open);

        let mut objs = objects("di-1", "tok");
        edit(&mut objs, "SecurityPolicy", |p| {
            p["metadata"]["generation"] = json!(2)
        });
        assert_eq!(auth(&objs), Authentication::Open, "not processed yet");

        let mut objs = objects("di-1", "tok");
        edit(&mut objs, "SecurityPolicy", |p| {
            p["status"]["ancestors"][0]["conditions"][0]["status"] = json!("False")
        });
        assert_eq!(auth(&objs), Authentication::Refused);

        let mut objs = objects("di-1", "tok");
        edit(&mut objs, "SecurityPolicy", |p| {
            p["spec"]["targetRefs"][0]["name"] = json!("another")
        });
        assert_eq!(
            auth(&objs),
            Authentication::Open,
            "a policy on another Gateway"
        );
    }

    /// A way to break the objects the check reads.
    type Breakage = fn(&mut Vec<Arc<Value>>);

    /// Each way the service cannot answer: the check fails with `statusOnError`.
    #[test]
    fn no_replica_that_can_answer_fails_closed() {
        let cases: [(&str, Breakage); 6] = [
            ("no pod", |o| o.retain(|x| x["kind"] != "Pod")),
            ("pod not ready", |o| {
                edit(o, "Pod", |p| {
                    p["status"]["conditions"][0]["status"] = json!("False")
                })
            }),
            ("no Secret", |o| o.retain(|x| x["kind"] != "Secret")),
            ("no RoleBinding", |o| {
                o.retain(|x| x["kind"] != "RoleBinding")
            }),
            ("a Role for another Secret", |o| {
                edit(o, "Role", |r| {
                    r["rules"][0]["resourceNames"] = json!(["other"])
                })
            }),
            ("a NetworkPolicy that admits nobody", |o| {
                o.push(Arc::new(
                    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": "deny", "namespace": "di-1"},
                    "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}),
                ))
            }),
        ];
        for (what, break_it) in cases {
            let mut objs = objects("di-1", "tok");
            assert!(answers(&auth(&objs)).is_some());
            break_it(&mut objs);
            assert_eq!(answers(&auth(&objs)), None, "{what}");
        }
    }

    /// A policy whose backendRef names another namespace: the Service, its pods, what they may
    /// read and the NetworkPolicies that admit the gateway are that namespace's.
    #[test]
    fn an_authorization_service_of_another_namespace_is_asked_there() {
        let mut objs = objects("auth", "tok");
        edit(&mut objs, "SecurityPolicy", |p| {
            p["metadata"]["namespace"] = json!("di-1");
            p["spec"]["extAuth"]["http"]["backendRefs"][0]["namespace"] = json!("auth");
        });
        assert!(answers(&auth(&objs)).is_some());
        // Its namespace admits its own pods only: not the gateway of di-1.
        let policy = |from: Value| {
            Arc::new(
                json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": "auth", "namespace": "auth"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [from]}]}}),
            )
        };
        let gateway = json!({"matchLabels": {GW_PODS: "gw"}});
        let mut own = objs.clone();
        own.push(policy(json!({"podSelector": gateway})));
        assert_eq!(answers(&auth(&own)), None);
        // Admitting di-1's gateway by the namespace's name label (the API server sets it).
        let mut named = objs.clone();
        named.push(policy(json!({"podSelector": gateway,
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "di-1"}}})));
        assert!(answers(&auth(&named)).is_some());
        // By a label of the Namespace object (cluster-scoped: it has no namespace).
        let mut labelled = objs.clone();
        labelled.push(policy(json!({"podSelector": gateway,
            "namespaceSelector": {"matchLabels": {"team": "a"}}})));
        assert_eq!(answers(&auth(&labelled)), None);
        labelled.push(Arc::new(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "di-1", "labels": {"team": "a"}}})));
        assert!(answers(&auth(&labelled)).is_some());
    }

    #[test]
    fn a_network_policy_admitting_the_gateway_lets_it_ask() {
        let mut objs = objects("di-1", "tok");
        objs.push(Arc::new(
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "auth", "namespace": "di-1"},
            "spec": {"podSelector": {"matchLabels": {"app": "auth"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {GW_PODS: "gw"}}}],
                                  "ports": [{"protocol": "TCP", "port": 8080}]}]}}),
        ));
        assert!(answers(&auth(&objs)).is_some());
    }
}
