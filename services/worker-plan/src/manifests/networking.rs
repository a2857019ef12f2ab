//! The DI's network: the load balancers in front of its Gateway and the NetworkPolicies that
//! isolate its namespace.

use serde_json::{json, Value};
use uuid::Uuid;

use super::{
    meta, pool_selector, ManifestInput, ENDPOINT_AUTH_PORT, EPP_GRPC_PORT, EPP_METRICS_PORT,
    HTTPS_PORT, VLLM_PORT,
};
use crate::names;

pub(super) fn load_balancer(
    input: &ManifestInput,
    name: &str,
    which: &str,
    network: &str,
) -> Value {
    let mut metadata = meta(&input.di_id, name, &[]);
    metadata["annotations"] = json!({
        "service.beta.kubernetes.io/do-loadbalancer-type": "REGIONAL_NETWORK",
        "service.beta.kubernetes.io/do-loadbalancer-network": network,
        "service.beta.kubernetes.io/do-loadbalancer-name": names::load_balancer(&input.di_id, which),
    });
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "LoadBalancer",
            "selector": {names::GATEWAY_NAME_LABEL: names::GATEWAY},
            "ports": [{"name": "https", "port": HTTPS_PORT, "targetPort": HTTPS_PORT, "protocol": "TCP"}],
        },
    })
}

fn network_policy(di: &Uuid, name: &str, extra: &[(&str, String)], spec: Value) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(di, name, extra),
        "spec": spec,
    })
}

/// The API server's way to the pods on DOKS, as a NetworkPolicy peer: the Konnectivity agents
/// (pods of `kube-system` labelled `k8s-app: konnectivity-agent`) through which `pods/proxy`
/// requests arrive, the autoscaler's metrics reads among them. Only callers the API server
/// authorised for `pods/proxy` come this way.
fn konnectivity_peer() -> Value {
    json!({
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}},
    })
}

/// The pods of the DI's gateway, as a NetworkPolicy peer (same namespace).
fn gateway_peer() -> Value {
    json!({"podSelector": {"matchLabels": {names::GATEWAY_NAME_LABEL: names::GATEWAY}}})
}

fn tcp(port: u16) -> Value {
    json!({"protocol": "TCP", "port": port})
}

/// The namespace's isolation (the DIs of a team share a cluster, one namespace each): a
/// default deny of all ingress, then the narrow allows the data path needs. Ingress only:
/// pods still reach the Kubernetes API (EPP), Hugging Face (vLLM) and their gateway's control
/// plane. Kubelet probes come from the node, which the CNI admits without a rule.
///
/// - the gateway's pods admit TCP 443 from anywhere: that is the endpoint, which the load
///   balancers forward to (from client or node addresses, depending on the CNI and traffic
///   policy, so no peer can be named) and the worker's probe arrives through; every request
///   there must carry one of the DI's tokens;
/// - endpoint-auth admits only the gateway, which asks it about every request;
/// - each model's EPP admits only the gateway, on its ext-proc gRPC port, and the API server's
///   Konnectivity agents on its metrics port (the autoscaler reads it through `pods/proxy`);
/// - each model's vLLM pods admit only the gateway (requests), their own EPP (it scrapes
///   `/metrics` for its scorers) and the Konnectivity agents (the autoscaler's reads), on the
///   serving port.
///
/// Nothing admits another namespace but those agents of `kube-system`, so another DI of the
/// cluster reaches this one only as any client does: through the load balancer, with a token.
pub(super) fn network_policies(input: &ManifestInput) -> Vec<Value> {
    let di = &input.di_id;
    let mut out = vec![network_policy(
        di,
        names::GATEWAY_POLICY,
        &[],
        json!({
            "podSelector": {"matchLabels": {names::GATEWAY_NAME_LABEL: names::GATEWAY}},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [tcp(HTTPS_PORT)]}],
        }),
    )];
    out.push(network_policy(
        di,
        names::ENDPOINT_AUTH,
        &[],
        json!({
            "podSelector": {"matchLabels": {names::ENDPOINT_AUTH_LABEL: "true"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [gateway_peer()], "ports": [tcp(ENDPOINT_AUTH_PORT)]}],
        }),
    ));
    for m in &input.models {
        let extra = [(names::MODEL_ID_LABEL, m.model_id.to_string())];
        let epp_pods = json!({names::EPP_LABEL: names::inference_pool(&m.model_id)});
        out.push(network_policy(
            di,
            &names::epp(&m.model_id),
            &extra,
            json!({
                "podSelector": {"matchLabels": epp_pods},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {"from": [gateway_peer()], "ports": [tcp(EPP_GRPC_PORT)]},
                    {"from": [konnectivity_peer()], "ports": [tcp(EPP_METRICS_PORT)]},
                ],
            }),
        ));
        out.push(network_policy(
            di,
            &names::vllm_deployment(&m.model_id),
            &extra,
            json!({
                "podSelector": {"matchLabels": pool_selector(&m.model_id)},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [gateway_peer(), {"podSelector": {"matchLabels": epp_pods}}, konnectivity_peer()],
                    "ports": [tcp(VLLM_PORT)],
                }],
            }),
        ));
    }
    // Last in apply order, so that a namespace gaining these policies is never isolated before
    // its allows exist.
    out.push(network_policy(
        di,
        names::DEFAULT_DENY_POLICY,
        &[],
        json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
    ));
    out
}

/// Whether `obj` is the namespace's default-deny policy (applied after everything else).
pub fn is_default_deny(obj: &Value) -> bool {
    obj["kind"] == "NetworkPolicy"
        && obj.pointer("/metadata/name") == Some(&json!(names::DEFAULT_DENY_POLICY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::manifests;
    use crate::manifests::tests::{find, one, two, M1, M2};

    #[test]
    fn public_service_only_when_enabled() {
        let objs = manifests(&one());
        let private = find(&objs, "Service", "inference-private");
        let public = find(&objs, "Service", "inference-public");
        let ann = |s: &Value, k: &str| s["metadata"]["annotations"][k].clone();
        let net = "service.beta.kubernetes.io/do-loadbalancer-network";
        let ty = "service.beta.kubernetes.io/do-loadbalancer-type";
        assert_eq!(ann(private, net), "INTERNAL");
        assert_eq!(ann(public, net), "EXTERNAL");
        assert_eq!(ann(private, ty), "REGIONAL_NETWORK");
        assert_eq!(ann(public, ty), "REGIONAL_NETWORK");
        for s in [private, public] {
            assert_eq!(s["spec"]["type"], "LoadBalancer");
            assert_eq!(
                s["spec"]["selector"],
                json!({"gateway.networking.k8s.io/gateway-name": "inference-gateway"})
            );
            assert_eq!(
                s["spec"]["ports"][0],
                json!({"name": "https", "port": 443, "targetPort": 443, "protocol": "TCP"})
            );
        }
        let mut i = one();
        i.enable_public_endpoint = false;
        let objs = manifests(&i);
        assert!(!objs
            .iter()
            .any(|o| o["metadata"]["name"] == "inference-public"));
        find(&objs, "Service", "inference-private");
    }

    fn policies(objs: &[Value]) -> Vec<&Value> {
        objs.iter()
            .filter(|o| o["kind"] == "NetworkPolicy")
            .collect()
    }

    #[test]
    fn namespace_denies_ingress_by_default_then_allows_the_data_path() {
        let objs = manifests(&two());
        let ps = policies(&objs);
        // Namespace-wide: the gateway's HTTPS, endpoint-auth and the default deny; per model:
        // EPP and vLLM.
        assert_eq!(ps.len(), 3 + 2 * 2);
        for p in &ps {
            assert_eq!(p["apiVersion"], "networking.k8s.io/v1");
            assert_eq!(p["spec"]["policyTypes"], json!(["Ingress"]), "{p}");
            // No rule admits another namespace or an address block: only peers of this
            // namespace (a podSelector alone), the API server's Konnectivity agents or, for the
            // gateway, any source.
            for rule in p["spec"]["ingress"].as_array().into_iter().flatten() {
                for peer in rule["from"].as_array().into_iter().flatten() {
                    if *peer == konnectivity_peer() {
                        continue;
                    }
                    assert_eq!(
                        peer.as_object().unwrap().keys().collect::<Vec<_>>(),
                        ["podSelector"],
                        "{p}"
                    );
                }
            }
        }
        let deny = find(&objs, "NetworkPolicy", "default-deny-ingress");
        assert_eq!(deny["spec"]["podSelector"], json!({}), "selects every pod");
        assert!(deny["spec"].get("ingress").is_none(), "admits nothing");
        // Applied after the allows: a running DI gaining policies is never cut off.
        let pos = |name: &str| {
            objs.iter()
                .position(|o| o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == name)
                .unwrap()
        };
        assert!(ps
            .iter()
            .all(|p| pos(p["metadata"]["name"].as_str().unwrap()) <= pos("default-deny-ingress")));
        assert!(is_default_deny(deny));
        assert!(!is_default_deny(find(
            &objs,
            "NetworkPolicy",
            "inference-gateway-https"
        )));

        let gw = find(&objs, "NetworkPolicy", "inference-gateway-https");
        let gateway_pods = json!({"gateway.networking.k8s.io/gateway-name": "inference-gateway"});
        assert_eq!(gw["spec"]["podSelector"]["matchLabels"], gateway_pods);
        // The load balancers forward client or node addresses: any source, port 443 only.
        assert_eq!(
            gw["spec"]["ingress"],
            json!([{"ports": [{"protocol": "TCP", "port": 443}]}])
        );
        let gateway_peer = json!({"podSelector": {"matchLabels": gateway_pods}});
        // Only the gateway asks endpoint-auth.
        let auth = find(&objs, "NetworkPolicy", "endpoint-auth");
        assert_eq!(
            auth["spec"]["ingress"],
            json!([{"from": [gateway_peer], "ports": [{"protocol": "TCP", "port": 8080}]}])
        );
        for (m, model) in [(M1, "aaaaaaaa"), (M2, "bbbbbbbb")] {
            let epp = find(&objs, "NetworkPolicy", &format!("pool-{model}-epp"));
            let epp_pods = &find(&objs, "Deployment", &format!("pool-{model}-epp"))["spec"]
                ["template"]["metadata"]["labels"];
            for (k, v) in epp["spec"]["podSelector"]["matchLabels"]
                .as_object()
                .unwrap()
            {
                assert_eq!(&epp_pods[k], v, "selects the EPP's pods");
            }
            // The gateway on the ext-proc port; the autoscaler, through the API server's
            // Konnectivity agents, on the metrics port only.
            assert_eq!(
                epp["spec"]["ingress"],
                json!([{"from": [gateway_peer], "ports": [{"protocol": "TCP", "port": 9002}]},
                       {"from": [konnectivity_peer()], "ports": [{"protocol": "TCP", "port": 9090}]}])
            );
            let vllm = find(&objs, "NetworkPolicy", &format!("vllm-{model}"));
            assert_eq!(
                vllm["spec"]["podSelector"]["matchLabels"],
                pool_selector(&m.parse().unwrap())
            );
            assert_eq!(
                vllm["spec"]["ingress"],
                json!([{"from": [gateway_peer, {"podSelector": epp["spec"]["podSelector"]}, konnectivity_peer()],
                        "ports": [{"protocol": "TCP", "port": 8000}]}])
            );
            assert_eq!(vllm["metadata"]["labels"][names::MODEL_ID_LABEL], m);
        }
    }
}
