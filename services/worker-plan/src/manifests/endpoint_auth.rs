//! The DI's endpoint authentication: endpoint-auth (the service that checks a request's
//! token against the DI's hashes) and the SecurityPolicy that makes the Gateway ask it.

use serde_json::{json, Value};
use uuid::Uuid;

use super::{
    labels_of, manifests, meta, Images, ManifestInput, TlsPair, ENDPOINT_AUTH_PATH,
    ENDPOINT_AUTH_PORT,
};
use crate::names;

/// The DI's endpoint authentication alone (endpoint-auth's objects and NetworkPolicy, then the
/// SecurityPolicy), as [`manifests`] renders it: for a DI that is not converged (in `error`)
/// but still serves, which must check tokens all the same.
pub fn endpoint_auth_manifests(di_id: Uuid, images: &Images) -> Vec<Value> {
    let mut input = ManifestInput::new(
        di_id,
        Vec::new(),
        false,
        TlsPair {
            cert_pem: String::new(),
            key_pem: String::new(),
        },
    );
    input.images = images.clone();
    manifests(&input)
        .into_iter()
        .filter(|o| o.pointer("/metadata/name") == Some(&json!(names::ENDPOINT_AUTH)))
        .collect()
}

/// The service that decides, for Envoy, whether a request carries one of the DI's tokens
/// (`services/endpoint-auth`): it watches the access-token Secret of its namespace (its Role
/// reads that Secret and nothing else) and answers Envoy's HTTP authorization checks. Two
/// replicas spread over nodes, and a PodDisruptionBudget, so that neither a node drain nor a
/// rollout leaves the endpoint refusing everyone (Envoy fails closed when no replica answers).
pub(super) fn endpoint_auth_objects(input: &ManifestInput) -> Vec<Value> {
    let di = &input.di_id;
    let name = names::ENDPOINT_AUTH;
    let selector = json!({names::ENDPOINT_AUTH_LABEL: "true"});
    let mut pod_labels = labels_of(di, &[]);
    pod_labels[names::ENDPOINT_AUTH_LABEL] = json!("true");
    let http_probe = |path: &str, period: u32| json!({"httpGet": {"path": path, "port": ENDPOINT_AUTH_PORT}, "periodSeconds": period});
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta(di, name, &[]),
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(di, name, &[]),
            "rules": [{
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [names::ACCESS_TOKENS_SECRET],
                "verbs": ["get", "list", "watch"],
            }],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(di, name, &[]),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": names::namespace(di)}],
        }),
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(di, name, &[]),
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [{"name": "http", "port": ENDPOINT_AUTH_PORT,
                           "targetPort": ENDPOINT_AUTH_PORT, "protocol": "TCP"}],
            },
        }),
        // A node drain (a DOKS upgrade, a pool's scale-down) takes one replica at a time.
        json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(di, name, &[]),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": selector}},
        }),
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(di, name, &[]),
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": {
                    "metadata": {"labels": pod_labels},
                    "spec": {
                        "serviceAccountName": name,
                        "terminationGracePeriodSeconds": 15,
                        "topologySpreadConstraints": [{
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": selector},
                        }],
                        "securityContext": {"runAsNonRoot": true,
                                            "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [{
                            "name": name,
                            "image": input.images.endpoint_auth,
                            "args": [
                                "--listen", format!("0.0.0.0:{ENDPOINT_AUTH_PORT}"),
                                "--secret", names::ACCESS_TOKENS_SECRET,
                            ],
                            "env": [{"name": "POD_NAMESPACE",
                                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
                            "ports": [{"name": "http", "containerPort": ENDPOINT_AUTH_PORT,
                                       "protocol": "TCP"}],
                            "livenessProbe": http_probe("/healthz", 10),
                            "readinessProbe": http_probe("/readyz", 2),
                            // Terminating, the pod leaves the Service's endpoints; Envoy stops
                            // sending it checks before it stops answering them.
                            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                            "resources": {
                                "requests": {"cpu": "10m", "memory": "32Mi"},
                                "limits": {"memory": "128Mi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": false,
                                "readOnlyRootFilesystem": true,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }],
                    },
                },
            },
        }),
    ]
}

/// Envoy Gateway's SecurityPolicy on the DI's Gateway: every request is first sent (its
/// method, path and Authorization header) to endpoint-auth, and only an answer of 200 lets it
/// through; endpoint-auth's 401 goes back to the client as it is. When no replica answers,
/// the request fails closed with 503, which clients retry, rather than Envoy's default 403,
/// which would tell them their token is bad.
pub(super) fn security_policy(input: &ManifestInput) -> Value {
    json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "SecurityPolicy",
        "metadata": meta(&input.di_id, names::ENDPOINT_AUTH, &[]),
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": names::GATEWAY}],
            "extAuth": {
                "http": {
                    "backendRefs": [{"group": "", "kind": "Service", "name": names::ENDPOINT_AUTH,
                                     "port": ENDPOINT_AUTH_PORT}],
                    "path": ENDPOINT_AUTH_PATH,
                },
                "headersToExtAuth": ["authorization"],
                "failOpen": false,
                "statusOnError": 503,
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::tests::{find, two};

    /// What a real gateway enforces: Envoy Gateway's SecurityPolicy on the DI's Gateway asks
    /// endpoint-auth, failing closed; endpoint-auth reads the token hashes and nothing else.
    #[test]
    fn endpoint_auth_is_a_policy_on_the_gateway_asking_a_service_that_reads_only_the_hashes() {
        let objs = manifests(&two());
        let sp = find(&objs, "SecurityPolicy", "endpoint-auth");
        assert_eq!(
            sp["spec"]["targetRefs"],
            json!([{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}])
        );
        let ext = &sp["spec"]["extAuth"];
        assert_eq!(ext["failOpen"], false);
        assert_eq!(ext["http"]["backendRefs"][0]["name"], "endpoint-auth");
        assert_eq!(ext["http"]["backendRefs"][0]["port"], 8080);
        let svc = find(&objs, "Service", "endpoint-auth");
        let dep = find(&objs, "Deployment", "endpoint-auth");
        let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
        for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
            assert_eq!(&pod_labels[k], v, "the Service selects the pods");
        }
        let args = &dep["spec"]["template"]["spec"]["containers"][0]["args"];
        assert_eq!(args[2], "--secret");
        assert_eq!(args[3], "inference-access-tokens");
        let role = find(&objs, "Role", "endpoint-auth");
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": [""], "resources": ["secrets"],
                    "resourceNames": ["inference-access-tokens"], "verbs": ["get", "list", "watch"]}])
        );
    }
}
