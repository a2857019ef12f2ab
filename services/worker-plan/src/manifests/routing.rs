//! How the Gateway routes requests: each model's InferencePool, the HTTPRoute from the
//! Gateway to them, and the BackendTrafficPolicy on the Gateway for requests held through a
//! cold start.

use serde_json::{json, Value};

use super::{
    cold_start_hold, meta, pool_selector, ManifestInput, COLD_START_RETRY_AFTER,
    DROPPED_REASON_HEADER, DROPPED_REASON_PREFIX, EPP_GRPC_PORT, RESPONSE_TIMEOUT, VLLM_PORT,
};
use crate::model::Model;
use crate::names;

/// Envoy Gateway's BackendTrafficPolicy on the DI's Gateway: when the endpoint picker gives up
/// on a request it held through a cold start (503 with a dropped reason), the client gets
/// `Retry-After` and an error in OpenAI's shape instead of the picker's bare answer.
///
/// Best effort, so the DI's readiness does not wait for it: Envoy Gateway overrides responses
/// with Envoy's custom response filter, and whether that filter sees a reply the picker's
/// ext_proc filter makes itself depends on where the inference extension puts ext_proc in the
/// filter chain, which the documents do not settle; where it does not (or the policy is not
/// accepted), the client still gets the picker's 503, which OpenAI's and DigitalOcean's clients
/// retry with their own backoff. The message holds for any 503 it could match.
pub(super) fn traffic_policy(input: &ManifestInput) -> Value {
    let body = json!({"error": {
        "message": "No replica could take the request in time (a model starting from zero replicas takes minutes); retry shortly.",
        "type": "server_error",
        "code": 503,
    }});
    json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "BackendTrafficPolicy",
        "metadata": meta(&input.di_id, names::TRAFFIC_POLICY, &[]),
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": names::GATEWAY}],
            "responseOverride": [{
                "match": {
                    "statusCodes": [{"type": "Value", "value": 503}],
                    "responseHeaders": [{"name": DROPPED_REASON_HEADER,
                                         "value": {"type": "Prefix", "value": DROPPED_REASON_PREFIX}}],
                },
                "response": {
                    "contentType": "application/json",
                    "body": {"type": "Inline", "inline": body.to_string()},
                    "header": {"add": [{"name": "Retry-After", "value": COLD_START_RETRY_AFTER.to_string()}]},
                },
            }],
        },
    })
}

pub(super) fn inference_pool(input: &ManifestInput, m: &Model) -> Value {
    let extra = [(names::MODEL_ID_LABEL, m.model_id.to_string())];
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": meta(&input.di_id, &names::inference_pool(&m.model_id), &extra),
        "spec": {
            "selector": {"matchLabels": pool_selector(&m.model_id)},
            "targetPorts": [{"number": VLLM_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": names::epp(&m.model_id),
                "port": {"number": EPP_GRPC_PORT},
                // Serve (without cache-aware picking) rather than fail when the picker is down.
                "failureMode": "FailOpen",
            },
        },
    })
}

pub(super) fn http_route(input: &ManifestInput) -> Value {
    let several = input.models.len() > 1;
    let rules: Vec<Value> = input
        .models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let all = json!({"path": {"type": "PathPrefix", "value": "/"}});
            let matches = if several {
                let by_header = json!({
                    "path": {"type": "PathPrefix", "value": "/"},
                    "headers": [{"type": "Exact", "name": names::MODEL_HEADER, "value": m.model_slug}],
                });
                // The first model also takes requests without the header. A header match is
                // more specific, so the other models' rules still win for their header.
                if i == 0 {
                    vec![by_header, all]
                } else {
                    vec![by_header]
                }
            } else {
                vec![all]
            };
            // A model that scales to zero may hold its request for the cold start first (if
            // Envoy's route timer counts the picker's wait too, it still fits).
            let timeout = if m.scales_to_zero {
                RESPONSE_TIMEOUT + cold_start_hold(m, input.cold_start_hold)
            } else {
                RESPONSE_TIMEOUT
            };
            json!({
                "matches": matches,
                "backendRefs": [{
                    "group": "inference.networking.k8s.io",
                    "kind": "InferencePool",
                    "name": names::inference_pool(&m.model_id),
                }],
                "timeouts": {"request": format!("{}s", timeout.as_secs())},
            })
        })
        .collect();
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": meta(&input.di_id, names::HTTP_ROUTE, &[]),
        "spec": {
            "parentRefs": [{
                "group": "gateway.networking.k8s.io",
                "kind": "Gateway",
                "name": names::GATEWAY,
                "sectionName": "https",
            }],
            "rules": rules,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::tests::{find, one, two};
    use crate::manifests::{manifests, DEFAULT_GATEWAY_CLASS};

    /// The picker's 503 after a hold gets `Retry-After` from the gateway's own policy.
    #[test]
    fn the_gateway_adds_retry_after_when_a_cold_start_runs_out() {
        let objs = manifests(&one());
        let p = find(&objs, "BackendTrafficPolicy", names::TRAFFIC_POLICY);
        assert_eq!(p["spec"]["targetRefs"][0]["name"], names::GATEWAY);
        let o = &p["spec"]["responseOverride"][0];
        assert_eq!(o["match"]["statusCodes"][0]["value"], 503);
        assert_eq!(
            o["match"]["responseHeaders"][0]["value"]["value"],
            DROPPED_REASON_PREFIX
        );
        assert_eq!(o["response"]["header"]["add"][0]["name"], "Retry-After");
        let body: Value =
            serde_json::from_str(o["response"]["body"]["inline"].as_str().unwrap()).unwrap();
        assert_eq!(body["error"]["code"], 503, "OpenAI's error shape");
    }

    #[test]
    fn gateway_and_single_model_route() {
        let objs = manifests(&one());
        let gw = find(&objs, "Gateway", "inference-gateway");
        assert_eq!(gw["spec"]["gatewayClassName"], DEFAULT_GATEWAY_CLASS);
        let l = &gw["spec"]["listeners"][0];
        assert_eq!(
            (l["port"].clone(), l["protocol"].clone()),
            (json!(443), json!("HTTPS"))
        );
        assert_eq!(l["tls"]["certificateRefs"][0]["name"], "inference-tls");
        let r = find(&objs, "HTTPRoute", "inference-route");
        assert_eq!(r["spec"]["parentRefs"][0]["name"], "inference-gateway");
        let rules = r["spec"]["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 1);
        assert!(rules[0]["matches"][0].get("headers").is_none());
        assert_eq!(
            rules[0]["backendRefs"][0],
            json!({"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool-aaaaaaaa"})
        );
        let mut custom = one();
        custom.gateway_class = "istio".into();
        assert_eq!(
            find(&manifests(&custom), "Gateway", "inference-gateway")["spec"]["gatewayClassName"],
            "istio"
        );
    }

    #[test]
    fn several_models_route_by_header_first_is_default() {
        let objs = manifests(&two());
        let r = find(&objs, "HTTPRoute", "inference-route");
        let rules = r["spec"]["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 2);
        let header = |rule: &Value, i: usize| rule["matches"][i]["headers"][0].clone();
        assert_eq!(
            header(&rules[0], 0),
            json!({"type": "Exact", "name": "X-Gateway-Model-Name", "value": "org/first"})
        );
        assert!(rules[0]["matches"][1].get("headers").is_none(), "catch-all");
        assert_eq!(rules[1]["matches"].as_array().unwrap().len(), 1);
        assert_eq!(header(&rules[1], 0)["value"], "org/second");
        assert_eq!(rules[1]["backendRefs"][0]["name"], "pool-bbbbbbbb");
    }
}
