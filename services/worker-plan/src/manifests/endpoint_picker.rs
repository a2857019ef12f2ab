//! The endpoint picker of each model deployment (llm-d-router's EPP): its
//! EndpointPickerConfig and the objects that run it (ConfigMap, ServiceAccount, Role,
//! RoleBinding, Service, Deployment).

use std::time::Duration;

use serde_json::{json, Value};

use super::{
    cold_start_hold, json_hash, labels_of, meta, ManifestInput, EPP_CONFIG_FILE, EPP_GRPC_PORT,
    EPP_HEALTH_PORT, EPP_METRICS_PORT,
};
use crate::model::Model;
use crate::names;

/// The EndpointPickerConfig: approximate prefix-cache, KV-cache-utilisation and queue scorers,
/// metrics scraped from vLLM's `/metrics`.
pub const EPP_CONFIG: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
";

/// The EndpointPickerConfig of a model deployment: [`EPP_CONFIG`], with flow control for a
/// deployment that scales to zero, so that the picker holds its requests while no replica is
/// ready instead of refusing them, for up to [`cold_start_hold`] of `hold` (its queue TTL,
/// llm-d-router's `flowControl.defaultRequestTTL`; v0.10 decodes strictly, so no other field).
/// Beyond it the picker answers 503 ([`traffic_policy`](super::routing::traffic_policy) adds
/// `Retry-After`).
pub fn epp_config(m: &Model, hold: Duration) -> String {
    if m.scales_to_zero {
        EPP_CONFIG.replacen(
            "kind: EndpointPickerConfig\n",
            &format!(
                "kind: EndpointPickerConfig\nfeatureGates:\n- flowControl\nflowControl:\n  \
                 defaultRequestTTL: {}s\n",
                cold_start_hold(m, hold).as_secs()
            ),
            1,
        )
    } else {
        EPP_CONFIG.to_string()
    }
}

pub(super) fn epp_objects(input: &ManifestInput, m: &Model) -> Vec<Value> {
    let di = &input.di_id;
    let ns = names::namespace(di);
    let name = names::epp(&m.model_id);
    let pool = names::inference_pool(&m.model_id);
    let extra = [(names::MODEL_ID_LABEL, m.model_id.to_string())];
    let selector = json!({names::EPP_LABEL: pool});
    let mut pod_labels = labels_of(di, &extra);
    pod_labels[names::EPP_LABEL] = json!(pool);
    let read = json!(["get", "list", "watch"]);
    let config = epp_config(m, input.cold_start_hold);
    let grpc_probe = |period: u32, delay: u32| {
        json!({
            "grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"},
            "periodSeconds": period,
            "initialDelaySeconds": delay,
        })
    };
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(di, &name, &extra),
            "data": {EPP_CONFIG_FILE: config},
        }),
        json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta(di, &name, &extra),
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(di, &name, &extra),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": read},
                {"apiGroups": ["llm-d.ai", "inference.networking.x-k8s.io"],
                 "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": read},
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(di, &name, &extra),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        }),
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta(di, &name, &extra),
            "spec": {
                "type": "ClusterIP",
                "selector": selector,
                "ports": [
                    {"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": EPP_GRPC_PORT,
                     "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
                    {"name": "http-metrics", "port": EPP_METRICS_PORT, "targetPort": EPP_METRICS_PORT,
                     "protocol": "TCP"},
                ],
            },
        }),
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(di, &name, &extra),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "Recreate"},
                "template": {
                    // The picker reads its configuration once, at start: a changed one (flow
                    // control switched by `min_replicas`) must start a new pod.
                    "metadata": {"labels": pod_labels, "annotations": {
                        names::CONFIG_HASH_ANNOTATION: json_hash(&json!(config)),
                    }},
                    "spec": {
                        "serviceAccountName": name,
                        "terminationGracePeriodSeconds": 130,
                        "containers": [{
                            "name": "epp",
                            "image": input.images.epp,
                            "args": [
                                "--pool-name", pool,
                                "--pool-namespace", ns,
                                "--pool-group", "inference.networking.k8s.io",
                                "--config-file", format!("/config/{EPP_CONFIG_FILE}"),
                                "--grpc-health-port", EPP_HEALTH_PORT.to_string(),
                                // `/metrics` without its own token review: the autoscaler reads
                                // it through the API server's pod proxy, which authorised the
                                // worker already, and the picker's Role has no TokenReview.
                                "--metrics-endpoint-auth=false",
                                "--zap-encoder", "json",
                            ],
                            "env": [
                                {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                                {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                                {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
                            ],
                            "livenessProbe": grpc_probe(10, 5),
                            "readinessProbe": grpc_probe(2, 0),
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "512Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                            "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": true}],
                        }],
                        "volumes": [{"name": "config", "configMap": {"name": name}}],
                    },
                },
            },
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::tests::{find, one, M1};
    use crate::manifests::{manifests, pool_selector};

    #[test]
    fn a_deployment_scaled_to_zero_is_held_through_its_cold_start() {
        let mut input = one();
        input.models[0].scales_to_zero = true;
        input.models[0].gpus_per_node = 1;
        input.cold_start_hold = Duration::from_secs(600);
        let mut m = input.models[0].clone();
        let config = epp_config(&m, input.cold_start_hold);
        assert!(
            config.contains("- flowControl\nflowControl:\n  defaultRequestTTL: 600s\n"),
            "{config}"
        );
        let objects = manifests(&input);
        let route = objects.iter().find(|o| o["kind"] == "HTTPRoute").unwrap();
        assert_eq!(route["spec"]["rules"][0]["timeouts"]["request"], "4200s");
        // An eight-GPU node serves larger weights: its requests are held longer.
        let mut big = m.clone();
        big.gpus_per_node = 8;
        assert!(epp_config(&big, input.cold_start_hold).contains("defaultRequestTTL: 1230s\n"));
        m.scales_to_zero = false;
        assert!(!epp_config(&m, input.cold_start_hold).contains("flowControl"));
        let objects = manifests(&super::ManifestInput {
            models: vec![m],
            ..input
        });
        let route = objects.iter().find(|o| o["kind"] == "HTTPRoute").unwrap();
        assert_eq!(
            route["spec"]["rules"][0]["timeouts"]["request"], "3600s",
            "no Envoy 15 s cut"
        );
    }

    #[test]
    fn epp_and_pool_wiring() {
        let objs = manifests(&one());
        let pool = find(&objs, "InferencePool", "pool-aaaaaaaa");
        assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
        assert_eq!(pool["spec"]["targetPorts"], json!([{"number": 8000}]));
        assert_eq!(
            pool["spec"]["selector"]["matchLabels"],
            pool_selector(&M1.parse().unwrap())
        );
        let epp = &pool["spec"]["endpointPickerRef"];
        assert_eq!(epp["name"], "pool-aaaaaaaa-epp");
        assert_eq!(epp["port"]["number"], 9002);
        let svc = find(&objs, "Service", "pool-aaaaaaaa-epp");
        assert_eq!(svc["spec"]["ports"][0]["port"], 9002);
        assert_eq!(svc["spec"]["ports"][0]["appProtocol"], "kubernetes.io/h2c");
        assert_eq!(svc["spec"]["ports"][1]["port"], 9090);
        let d = find(&objs, "Deployment", "pool-aaaaaaaa-epp");
        for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
            assert_eq!(&d["spec"]["template"]["metadata"]["labels"][k], v);
        }
        let spec = &d["spec"]["template"]["spec"];
        assert_eq!(spec["serviceAccountName"], "pool-aaaaaaaa-epp");
        assert!(spec.get("tolerations").is_none(), "EPP runs on CPU nodes");
        let args = spec["containers"][0]["args"].to_string();
        assert!(args.contains("\"--pool-name\",\"pool-aaaaaaaa\""));
        let cm = find(&objs, "ConfigMap", "pool-aaaaaaaa-epp");
        let cfg = cm["data"]["config.yaml"].as_str().unwrap();
        for scorer in [
            "prefix-cache-scorer",
            "kv-cache-utilization-scorer",
            "queue-scorer",
        ] {
            assert!(cfg.contains(&format!("pluginRef: {scorer}")), "{scorer}");
        }
        let rb = find(&objs, "RoleBinding", "pool-aaaaaaaa-epp");
        assert_eq!(rb["roleRef"]["name"], "pool-aaaaaaaa-epp");
        find(&objs, "Role", "pool-aaaaaaaa-epp");
        find(&objs, "ServiceAccount", "pool-aaaaaaaa-epp");
    }
}
