//! Every Kubernetes object of one dedicated inference for one spec version, as JSON ready for
//! server-side apply, in apply order.

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::model::{GpuVendor, Model, PlanError};
use super::names;

/// The gatewayClassName used unless configured otherwise.
pub const DEFAULT_GATEWAY_CLASS: &str = "inference-gateway";
/// The vLLM OpenAI server's port (also the InferencePool target port).
pub const VLLM_PORT: u16 = 8000;
/// EPP ports: ext-proc gRPC (h2c), gRPC health, Prometheus metrics.
pub const EPP_GRPC_PORT: u16 = 9002;
pub const EPP_HEALTH_PORT: u16 = 9003;
pub const EPP_METRICS_PORT: u16 = 9090;
/// The port endpoint-auth answers Envoy's authorization checks (and its probes) on.
pub const ENDPOINT_AUTH_PORT: u16 = 8080;
/// The path prefix of those checks: Envoy appends the client's path.
pub const ENDPOINT_AUTH_PATH: &str = "/check";
/// The port both load balancers and the Gateway listener serve HTTPS on.
pub const HTTPS_PORT: u16 = 443;
/// File name of the EndpointPickerConfig inside the EPP ConfigMap (mounted at `/config`).
pub const EPP_CONFIG_FILE: &str = "config.yaml";

/// Container images, pinned. Configurable so that an upgrade is a configuration change (and a
/// rollout), never an accident of `latest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    pub vllm_nvidia: String,
    pub vllm_amd: String,
    pub epp: String,
    /// `services/endpoint-auth`, released with this control plane.
    pub endpoint_auth: String,
}

impl Default for Images {
    fn default() -> Self {
        Images {
            vllm_nvidia: "vllm/vllm-openai:v0.19.1".into(),
            vllm_amd: "vllm/vllm-openai-rocm:v0.19.1".into(),
            epp: "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0".into(),
            endpoint_auth: concat!(
                "registry.digitalocean.com/dedicated-inference/endpoint-auth:",
                env!("CARGO_PKG_VERSION")
            )
            .into(),
        }
    }
}

/// The endpoint's certificate chain and private key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TlsPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPair")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// An access token as the data plane checks it: its id and the lowercase hex SHA-256 of its
/// value. The region only ever stores the hash.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AccessTokenHash {
    id: Uuid,
    sha256_hex: String,
}

impl AccessTokenHash {
    /// From a stored hash; any case is accepted, lowercase is written.
    pub fn new(id: Uuid, sha256_hex: &str) -> Result<Self, PlanError> {
        let hex = sha256_hex.trim().to_ascii_lowercase();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(PlanError::BadTokenHash(id));
        }
        Ok(AccessTokenHash {
            id,
            sha256_hex: hex,
        })
    }

    /// From a token value (tests, tools): hashes it.
    pub fn from_value(id: Uuid, value: &str) -> Self {
        AccessTokenHash {
            id,
            sha256_hex: hex::encode(Sha256::digest(value.as_bytes())),
        }
    }

    pub fn id(&self) -> Uuid {
        self.id
    }

    pub fn sha256_hex(&self) -> &str {
        &self.sha256_hex
    }
}

/// Everything [`manifests`] needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestInput {
    pub di_id: Uuid,
    /// In spec order: the first model is the default route.
    pub models: Vec<Model>,
    pub enable_public_endpoint: bool,
    pub hugging_face_token: Option<String>,
    pub tls: TlsPair,
    pub access_tokens: Vec<AccessTokenHash>,
    pub gateway_class: String,
    pub images: Images,
    /// The Hugging Face Hub the model servers download from (`HF_ENDPOINT`); `None`: the public
    /// Hub.
    pub hub_endpoint: Option<String>,
    /// How long a request to a deployment scaled to zero is held while a replica starts (a GPU
    /// node and a model load): the picker's queue TTL ([`epp_config`]).
    pub cold_start_hold: Duration,
}

/// [`ManifestInput::cold_start_hold`] unless configured: a GPU node (minutes) and the download
/// and load of a large model (up to ten more).
pub const DEFAULT_COLD_START_HOLD: Duration = Duration::from_secs(900);

/// What each GPU of a node beyond the first adds to the hold: a node with more GPUs serves a
/// model with more weights (up to 80 GB more per GPU), which take about this long to download
/// from the Hub and load.
pub const COLD_START_HOLD_PER_EXTRA_GPU: Duration = Duration::from_secs(90);

/// How long a request to model deployment `m`, scaled to zero, is held for a replica to start:
/// `hold` (a one-GPU node and its model) and the download and load of the larger weights that
/// a node with more GPUs serves. An eight-GPU size waits 25.5 minutes by default.
pub fn cold_start_hold(m: &Model, hold: Duration) -> Duration {
    hold + COLD_START_HOLD_PER_EXTRA_GPU * m.gpus_per_node.saturating_sub(1)
}

/// The `Retry-After` (seconds) a client gets with the 503 when the hold runs out: the replica
/// may be minutes from serving, but a client should not wait in silence for them.
pub const COLD_START_RETRY_AFTER: u32 = 30;

/// The header in which the endpoint picker (llm-d-router) says why it dropped a request, and
/// the prefix of every such reason: `rejected-no-endpoints` when a request's queue TTL ran out
/// with no endpoint to send it to (v0.10; some versions say `rejected-ttl-expired`).
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";
pub const DROPPED_REASON_PREFIX: &str = "rejected-";

/// How long a response may take once the model server has the request (HTTPRoute
/// `timeouts.request`, Envoy's route timeout): long generations stream for many minutes, and
/// without it Envoy cuts every response at 15 s. Envoy Gateway also raises the route's idle
/// timeout to at least an hour with it, so a request held through a cold start is not ended
/// by Envoy's 5-minute stream idle timeout.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(3600);

impl ManifestInput {
    /// An input with the default gateway class and images, no HF token and no access tokens.
    pub fn new(
        di_id: Uuid,
        models: Vec<Model>,
        enable_public_endpoint: bool,
        tls: TlsPair,
    ) -> Self {
        ManifestInput {
            di_id,
            models,
            enable_public_endpoint,
            hugging_face_token: None,
            tls,
            access_tokens: Vec::new(),
            gateway_class: DEFAULT_GATEWAY_CLASS.into(),
            images: Images::default(),
            hub_endpoint: None,
            cold_start_hold: DEFAULT_COLD_START_HOLD,
        }
    }
}

/// Identifies one object: enough to get or delete it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub api_version: String,
    pub kind: String,
    /// `None` for cluster-scoped objects (the Namespace).
    pub namespace: Option<String>,
    pub name: String,
}

impl ObjectKey {
    /// The key of a JSON object; `None` when it lacks apiVersion, kind or name.
    pub fn of(obj: &Value) -> Option<Self> {
        Some(ObjectKey {
            api_version: obj.get("apiVersion")?.as_str()?.to_string(),
            kind: obj.get("kind")?.as_str()?.to_string(),
            namespace: obj
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .map(str::to_string),
            name: obj.pointer("/metadata/name")?.as_str()?.to_string(),
        })
    }
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
}

fn labels_of(di_id: &Uuid, extra: &[(&str, String)]) -> Value {
    let mut m = Map::new();
    m.insert(names::MANAGED_BY_LABEL.into(), json!(names::MANAGED_BY));
    m.insert(names::DI_ID_LABEL.into(), json!(di_id.to_string()));
    for (k, v) in extra {
        m.insert((*k).into(), json!(v));
    }
    Value::Object(m)
}

fn meta(di_id: &Uuid, name: &str, extra: &[(&str, String)]) -> Value {
    json!({
        "name": name,
        "namespace": names::namespace(di_id),
        "labels": labels_of(di_id, extra),
    })
}

/// The InferencePool selector of a model deployment, also its vLLM pods' labels.
pub fn pool_selector(model_id: &Uuid) -> Value {
    json!({
        names::SERVING_LABEL: "true",
        names::MODEL_LABEL: names::model_label(model_id),
    })
}

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
/// Beyond it the picker answers 503 ([`traffic_policy`] adds `Retry-After`).
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

/// A short, stable hash of a JSON value (its serialisation is deterministic).
fn json_hash(v: &Value) -> String {
    let digest = Sha256::digest(serde_json::to_vec(v).expect("a JSON value serialises"));
    hex::encode(&digest[..8])
}

fn vllm_deployment(input: &ManifestInput, m: &Model) -> Value {
    let di = &input.di_id;
    let name = names::vllm_deployment(&m.model_id);
    let pool = names::node_pool(di, &m.model_id, &m.accelerator_slug);
    let gpu = m.vendor.resource_name();
    let image = match m.vendor {
        GpuVendor::Nvidia => &input.images.vllm_nvidia,
        GpuVendor::Amd => &input.images.vllm_amd,
    };
    let model_extra = [(names::MODEL_ID_LABEL, m.model_id.to_string())];
    let mut pod_labels = labels_of(di, &model_extra);
    for (k, v) in pool_selector(&m.model_id).as_object().expect("object") {
        pod_labels[k] = v.clone();
    }
    pod_labels["llm-d.ai/role"] = json!("decode");
    pod_labels["llm-d.ai/engine-type"] = json!("vllm");
    let mut env = Vec::new();
    if let Some(hub) = &input.hub_endpoint {
        env.push(json!({"name": "HF_ENDPOINT", "value": hub}));
    }
    if input.hugging_face_token.is_some() {
        env.push(json!({
            "name": names::HF_TOKEN_KEY,
            "valueFrom": {"secretKeyRef": {"name": names::HF_TOKEN_SECRET, "key": names::HF_TOKEN_KEY}},
        }));
    }
    let probe = |period: u32, failures: u32| {
        json!({
            "httpGet": {"path": "/health", "port": VLLM_PORT},
            "periodSeconds": period,
            "failureThreshold": failures,
        })
    };
    let gpus = m.gpus_per_node.to_string();
    let mut args = vec![json!("--model"), json!(m.repository)];
    if let Some(revision) = &m.revision {
        args.extend([json!("--revision"), json!(revision)]);
    }
    args.extend([
        json!("--served-model-name"),
        json!(m.model_slug),
        json!("--port"),
        json!(VLLM_PORT.to_string()),
        json!("--enable-prefix-caching"),
        // One model server per node, its GPUs sharing the model.
        json!("--tensor-parallel-size"),
        json!(gpus),
    ]);
    let mut container = json!({
        "name": "vllm",
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}],
        "resources": {"limits": {gpu: gpus}, "requests": {gpu: gpus}},
        // vLLM writes no termination log: a failed model load (a repository gone, a token
        // revoked) reaches the pod's status, and so the DI's error, through the log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        // Model download and load can take many minutes: the startup probe allows 30.
        "startupProbe": probe(10, 180),
        "readinessProbe": probe(5, 3),
        "livenessProbe": probe(10, 6),
        // Let the endpoint picker stop choosing this pod before vLLM stops.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "30"]}}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    });
    if !env.is_empty() {
        container["env"] = Value::Array(env);
    }
    let mut template = json!({
        "metadata": {"labels": pod_labels},
        "spec": {
            "nodeSelector": {names::NODE_POOL_LABEL: pool},
            "tolerations": [{"key": gpu, "operator": "Exists", "effect": "NoSchedule"}],
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 130,
            "containers": [container],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    });
    let hash = json_hash(&template);
    template["metadata"]["annotations"] = json!({names::TEMPLATE_HASH_ANNOTATION: hash});
    let mut metadata = meta(di, &name, &model_extra);
    metadata["annotations"] = json!({names::TEMPLATE_HASH_ANNOTATION: hash});
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": m.scale,
            "selector": {"matchLabels": pool_selector(&m.model_id)},
            // Zero downtime on whole-node pods: a new pod must be ready before an old one goes
            // (maxUnavailable 0), one at a time (maxSurge 1). The node pool planner adds the
            // one spare node the surge pod needs while the rollout lasts.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": 3600,
            "template": template,
        },
    })
}

fn epp_objects(input: &ManifestInput, m: &Model) -> Vec<Value> {
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
fn endpoint_auth_objects(input: &ManifestInput) -> Vec<Value> {
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
fn security_policy(input: &ManifestInput) -> Value {
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
fn traffic_policy(input: &ManifestInput) -> Value {
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

fn inference_pool(input: &ManifestInput, m: &Model) -> Value {
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

fn http_route(input: &ManifestInput) -> Value {
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

fn load_balancer(input: &ManifestInput, name: &str, which: &str, network: &str) -> Value {
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
fn network_policies(input: &ManifestInput) -> Vec<Value> {
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

/// The Secret the gateway checks bearer tokens against: one key per token id, the value the hex
/// SHA-256 of the token. Deterministic (sorted by id), so an unchanged set writes nothing.
pub fn access_tokens_secret(di: &Uuid, tokens: &[AccessTokenHash]) -> Value {
    let mut tokens = tokens.to_vec();
    tokens.sort();
    tokens.dedup_by_key(|t| t.id);
    let data: Map<String, Value> = tokens
        .iter()
        .map(|t| (t.id.to_string(), json!(b64(&t.sha256_hex))))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(di, names::ACCESS_TOKENS_SECRET, &[]),
        "type": "Opaque",
        "data": data,
    })
}

/// Every object of one DI, in apply order: Namespace, Secrets, NetworkPolicies (the default
/// deny last), endpoint-auth (ServiceAccount, Role, RoleBinding, Service, Deployment), per
/// model (EPP ConfigMap, ServiceAccount, Role, RoleBinding, Service, Deployment; vLLM
/// Deployment; InferencePool), Gateway, HTTPRoute, SecurityPolicy, BackendTrafficPolicy,
/// LoadBalancer Services. Deterministic: the same input gives the same bytes (access tokens
/// are sorted by id).
pub fn manifests(input: &ManifestInput) -> Vec<Value> {
    let di = &input.di_id;
    let mut out = vec![json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": names::namespace(di), "labels": labels_of(di, &[])},
    })];
    if let Some(token) = &input.hugging_face_token {
        out.push(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta(di, names::HF_TOKEN_SECRET, &[]),
            "type": "Opaque",
            "data": {names::HF_TOKEN_KEY: b64(token)},
        }));
    }
    out.push(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(di, names::TLS_SECRET, &[]),
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64(&input.tls.cert_pem), "tls.key": b64(&input.tls.key_pem)},
    }));
    out.push(access_tokens_secret(di, &input.access_tokens));
    out.extend(network_policies(input));
    out.extend(endpoint_auth_objects(input));
    for m in &input.models {
        out.extend(epp_objects(input, m));
        out.push(vllm_deployment(input, m));
        out.push(inference_pool(input, m));
    }
    out.push(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": meta(di, names::GATEWAY, &[]),
        "spec": {
            "gatewayClassName": input.gateway_class,
            "listeners": [{
                "name": "https",
                "port": HTTPS_PORT,
                "protocol": "HTTPS",
                "tls": {
                    "mode": "Terminate",
                    "certificateRefs": [{"group": "", "kind": "Secret", "name": names::TLS_SECRET}],
                },
                "allowedRoutes": {"namespaces": {"from": "Same"}},
            }],
        },
    }));
    out.push(http_route(input));
    out.push(security_policy(input));
    out.push(traffic_policy(input));
    out.push(load_balancer(
        input,
        names::PRIVATE_SERVICE,
        "private",
        "INTERNAL",
    ));
    if input.enable_public_endpoint {
        out.push(load_balancer(
            input,
            names::PUBLIC_SERVICE,
            "public",
            "EXTERNAL",
        ));
    }
    for d in out.iter_mut().filter(|o| o["kind"] == "Deployment") {
        stamp_template(d);
    }
    out
}

/// Annotates a Deployment with the hash of its pod template (unless its rendering did), so that
/// a pass can tell a new template, which restarts pods, from any other change (see
/// [`crate::fleet`]). On the Deployment only: the pods' template stays as rendered.
fn stamp_template(d: &mut Value) {
    if d.pointer("/metadata/annotations")
        .and_then(|a| a.get(names::TEMPLATE_HASH_ANNOTATION))
        .is_some()
    {
        return;
    }
    let hash = json_hash(&d["spec"]["template"]);
    let meta = &mut d["metadata"];
    if !meta["annotations"].is_object() {
        meta["annotations"] = json!({});
    }
    meta["annotations"][names::TEMPLATE_HASH_ANNOTATION] = json!(hash);
}

/// The order to delete objects in: the reverse of apply order (load balancers first, the
/// Namespace last). Objects without a key are skipped.
pub fn teardown_order(manifests: &[Value]) -> Vec<ObjectKey> {
    manifests.iter().rev().filter_map(ObjectKey::of).collect()
}

/// Observed objects this DI's worker created (by the managed-by and DI id labels) that the
/// desired manifests no longer contain, e.g. a removed model deployment's objects, in deletion
/// order (reverse of the order kinds are applied in).
pub fn prune(di_id: &Uuid, desired: &[Value], observed: &[Value]) -> Vec<ObjectKey> {
    let want: std::collections::BTreeSet<ObjectKey> =
        desired.iter().filter_map(ObjectKey::of).collect();
    let ours = |o: &Value| {
        let l = o.pointer("/metadata/labels");
        l.and_then(|l| l.get(names::MANAGED_BY_LABEL)) == Some(&json!(names::MANAGED_BY))
            && l.and_then(|l| l.get(names::DI_ID_LABEL)) == Some(&json!(di_id.to_string()))
    };
    // Apply order by kind (see `manifests`); deletion goes the other way.
    let rank = |o: &Value| match o["kind"].as_str().unwrap_or("") {
        "Namespace" => 0,
        "Secret" | "NetworkPolicy" => 1,
        "ConfigMap" | "ServiceAccount" | "Role" | "RoleBinding" => 2,
        "Service" if o.pointer("/spec/type") != Some(&json!("LoadBalancer")) => 3,
        "Deployment" => 4,
        "InferencePool" => 5,
        "Gateway" | "HTTPRoute" => 6,
        _ => 7,
    };
    let mut gone: Vec<(i32, ObjectKey)> = observed
        .iter()
        .filter(|o| ours(o))
        .filter_map(|o| Some((rank(o), ObjectKey::of(o)?)))
        .filter(|(_, k)| !want.contains(k))
        .collect();
    gone.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let mut gone: Vec<ObjectKey> = gone.into_iter().map(|(_, k)| k).collect();
    gone.dedup();
    gone
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{models, tests::deployment};

    const DI: &str = "0d1e2f3a-0000-4000-8000-00000000d1d1";
    const M1: &str = "aaaaaaaa-0000-4000-8000-000000000001";
    const M2: &str = "bbbbbbbb-0000-4000-8000-000000000002";

    fn di() -> Uuid {
        DI.parse().unwrap()
    }

    fn tls() -> TlsPair {
        TlsPair {
            cert_pem: "CERT".into(),
            key_pem: "KEY".into(),
        }
    }

    fn input(mds: &[api_types::spec::ModelDeployment], public: bool) -> ManifestInput {
        let mut i = ManifestInput::new(di(), models(mds).unwrap(), public, tls());
        i.access_tokens = vec![
            AccessTokenHash::from_value(
                "00000000-0000-4000-8000-0000000000a2".parse().unwrap(),
                "t2",
            ),
            AccessTokenHash::from_value(
                "00000000-0000-4000-8000-0000000000a1".parse().unwrap(),
                "t1",
            ),
        ];
        i
    }

    fn one() -> ManifestInput {
        input(
            &[deployment(
                M1,
                "meta-llama/Llama-3.1-8B-Instruct",
                "gpu-h100x8-640gb",
                2,
            )],
            true,
        )
    }

    fn two() -> ManifestInput {
        input(
            &[
                deployment(M1, "org/first", "gpu-h100x1-80gb", 1),
                deployment(M2, "org/second", "gpu-mi300x1-192gb", 3),
            ],
            false,
        )
    }

    fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    }

    fn decode(v: &Value) -> String {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap())
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn same_input_gives_identical_bytes() {
        let a = serde_json::to_vec(&manifests(&two())).unwrap();
        let b = serde_json::to_vec(&manifests(&two())).unwrap();
        assert_eq!(a, b);
        let mut shuffled = two();
        shuffled.access_tokens.reverse();
        assert_eq!(a, serde_json::to_vec(&manifests(&shuffled)).unwrap());
    }

    #[test]
    fn every_object_is_labelled_and_namespaced() {
        let objs = manifests(&two());
        assert_eq!(objs[0]["kind"], "Namespace");
        assert_eq!(objs[0]["metadata"]["name"], format!("di-{DI}"));
        for o in &objs {
            assert!(o["apiVersion"].is_string() && o["kind"].is_string(), "{o}");
            assert!(o["metadata"]["name"].is_string(), "{o}");
            let l = &o["metadata"]["labels"];
            assert_eq!(l[names::MANAGED_BY_LABEL], "dedicated-inference-worker");
            assert_eq!(l[names::DI_ID_LABEL], DI);
            if o["kind"] != "Namespace" {
                assert_eq!(o["metadata"]["namespace"], format!("di-{DI}"), "{o}");
            }
        }
        let keys: std::collections::BTreeSet<_> = objs.iter().map(ObjectKey::of).collect();
        assert_eq!(keys.len(), objs.len(), "object keys are unique");
    }

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
    fn vllm_deployment_shape() {
        let objs = manifests(&one());
        let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert!(c["image"]
            .as_str()
            .unwrap()
            .starts_with("vllm/vllm-openai:v"));
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let m = "meta-llama/Llama-3.1-8B-Instruct";
        assert_eq!(
            args,
            [
                "--model",
                m,
                "--served-model-name",
                m,
                "--port",
                "8000",
                "--enable-prefix-caching",
                "--tensor-parallel-size",
                "8"
            ]
        );
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
        assert_eq!(c["terminationMessagePolicy"], "FallbackToLogsOnError");
        assert_eq!(c["ports"][0]["containerPort"], 8000);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
        assert_eq!(c["volumeMounts"][0]["mountPath"], "/dev/shm");
        assert_eq!(pod["volumes"][0]["emptyDir"]["medium"], "Memory");
        assert_eq!(
            pod["nodeSelector"][names::NODE_POOL_LABEL],
            names::node_pool(&di(), &M1.parse().unwrap(), "gpu-h100x8-640gb")
        );
        assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
        assert_eq!(d["spec"]["replicas"], 2);
        assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 1);
        assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
        let sel = &d["spec"]["selector"]["matchLabels"];
        assert_eq!(sel, &pool_selector(&M1.parse().unwrap()));
        for (k, v) in sel.as_object().unwrap() {
            assert_eq!(&d["spec"]["template"]["metadata"]["labels"][k], v);
        }
        assert!(c.get("env").is_none(), "no HF token, no env");
    }

    #[test]
    fn a_customers_repository_is_loaded_and_served_under_its_name() {
        let mut d = deployment(M1, "support-bot", "gpu-h100x8-640gb", 1);
        d.source = api_types::spec::ModelSource {
            repository: "my-org/my-finetune".into(),
            revision: Some("v2".into()),
            custom: true,
            // Stored before commits were pinned: the revision as named.
            commit: None,
        };
        // Workload hints are typical lengths, not limits: no --max-model-len from them.
        d.workload_config = json!({"input_tokens": 3500, "output_tokens": 500});
        let mut i = input(&[d], true);
        i.hub_endpoint = Some("http://hub.test".into());
        let objs = manifests(&i);
        let c = &find(&objs, "Deployment", "vllm-aaaaaaaa")["spec"]["template"]["spec"]
            ["containers"][0];
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--model",
                "my-org/my-finetune",
                "--revision",
                "v2",
                "--served-model-name",
                "support-bot",
                "--port",
                "8000",
                "--enable-prefix-caching",
                "--tensor-parallel-size",
                "8"
            ]
        );
        assert_eq!(
            c["env"],
            json!([{"name": "HF_ENDPOINT", "value": "http://hub.test"}])
        );
    }

    /// A pinned commit is what vLLM loads, not the branch it was read from: a replica that
    /// starts after the branch moved loads what its siblings do. Without one (a spec stored
    /// before commits were pinned) the revision as named, exactly as before.
    #[test]
    fn a_pinned_commit_is_the_revision_loaded() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let vllm_args = |source: api_types::spec::ModelSource| {
            let mut d = deployment(M1, "support-bot", "gpu-h100x1-80gb", 1);
            d.source = source;
            let objs = manifests(&input(&[d], true));
            let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
            let args: Vec<String> = d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect();
            (
                args,
                d["spec"]["template"]["metadata"]["annotations"].clone(),
            )
        };
        let branch = api_types::spec::ModelSource {
            repository: "my-org/my-finetune".into(),
            revision: Some("main".into()),
            custom: true,
            commit: None,
        };
        let pinned = api_types::spec::ModelSource {
            commit: Some(commit.into()),
            ..branch.clone()
        };
        let (args, unpinned_hash) = vllm_args(branch.clone());
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", "main"]
        );
        let (args, pinned_hash) = vllm_args(pinned.clone());
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", commit]
        );
        assert_eq!(args.iter().filter(|a| *a == "--revision").count(), 1);
        // The default branch, pinned: the commit too.
        let (args, _) = vllm_args(api_types::spec::ModelSource {
            revision: None,
            ..pinned
        });
        assert_eq!(
            args[..4],
            ["--model", "my-org/my-finetune", "--revision", commit]
        );
        // Pinning changes the pod template (a rollout); an unpinned spec renders as before.
        assert_ne!(unpinned_hash, pinned_hash);
        assert_eq!(vllm_args(branch).1, unpinned_hash);
    }

    #[test]
    fn gated_model_gets_hf_token_env_and_secret() {
        let mut i = one();
        i.hugging_face_token = Some("hf_secret".into());
        let objs = manifests(&i);
        let s = find(&objs, "Secret", "hf-token");
        assert_eq!(decode(&s["data"]["HF_TOKEN"]), "hf_secret");
        let d = find(&objs, "Deployment", "vllm-aaaaaaaa");
        let env = &d["spec"]["template"]["spec"]["containers"][0]["env"][0];
        assert_eq!(env["name"], "HF_TOKEN");
        assert_eq!(env["valueFrom"]["secretKeyRef"]["name"], "hf-token");
        assert_eq!(env["valueFrom"]["secretKeyRef"]["key"], "HF_TOKEN");
        assert!(!manifests(&one())
            .iter()
            .any(|o| o["metadata"]["name"] == "hf-token"));
        // Adding the token changes the pod template: the template hash follows.
        let hash = |objs: &[Value]| {
            find(objs, "Deployment", "vllm-aaaaaaaa")["metadata"]["annotations"]
                [names::TEMPLATE_HASH_ANNOTATION]
                .clone()
        };
        assert_ne!(hash(&objs), hash(&manifests(&one())));
    }

    #[test]
    fn scale_change_keeps_template_hash() {
        let a = manifests(&one());
        let mut i = one();
        i.models[0].scale = 5;
        let b = manifests(&i);
        let get = |objs: &[Value]| find(objs, "Deployment", "vllm-aaaaaaaa").clone();
        assert_eq!(get(&b)["spec"]["replicas"], 5);
        assert_eq!(
            get(&a)["metadata"]["annotations"],
            get(&b)["metadata"]["annotations"]
        );
    }

    #[test]
    fn amd_model_uses_amd_resource_toleration_and_image() {
        let objs = manifests(&two());
        let d = find(&objs, "Deployment", "vllm-bbbbbbbb");
        let pod = &d["spec"]["template"]["spec"];
        assert_eq!(
            pod["containers"][0]["resources"]["limits"]["amd.com/gpu"],
            "1"
        );
        assert!(pod["containers"][0]["resources"]["limits"]
            .get("nvidia.com/gpu")
            .is_none());
        assert_eq!(pod["tolerations"][0]["key"], "amd.com/gpu");
        assert!(pod["containers"][0]["image"]
            .as_str()
            .unwrap()
            .contains("rocm"));
    }

    #[test]
    fn tls_and_token_secrets() {
        let objs = manifests(&one());
        let tls = find(&objs, "Secret", "inference-tls");
        assert_eq!(tls["type"], "kubernetes.io/tls");
        assert_eq!(decode(&tls["data"]["tls.crt"]), "CERT");
        assert_eq!(decode(&tls["data"]["tls.key"]), "KEY");
        let t = find(&objs, "Secret", "inference-access-tokens");
        let data = t["data"].as_object().unwrap();
        assert_eq!(data.len(), 2);
        let v = decode(&data["00000000-0000-4000-8000-0000000000a1"]);
        assert_eq!(v, hex::encode(Sha256::digest(b"t1")));
        assert_eq!(v, v.to_ascii_lowercase());
        assert_eq!(v.len(), 64);
    }

    #[test]
    fn token_hashes_are_validated_and_lowercased() {
        let id = Uuid::nil();
        let upper = "A".repeat(64);
        assert_eq!(
            AccessTokenHash::new(id, &upper).unwrap().sha256_hex(),
            "a".repeat(64)
        );
        assert!(AccessTokenHash::new(id, "abc").is_err());
        assert!(AccessTokenHash::new(id, &"g".repeat(64)).is_err());
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

    #[test]
    fn teardown_is_reverse_of_apply() {
        let objs = manifests(&two());
        let down = teardown_order(&objs);
        assert_eq!(down.len(), objs.len());
        assert_eq!(down.last().unwrap().kind, "Namespace");
        assert_eq!(down[0].name, "inference-private");
        let up: Vec<_> = objs.iter().filter_map(ObjectKey::of).collect();
        assert_eq!(down.into_iter().rev().collect::<Vec<_>>(), up);
    }

    #[test]
    fn prune_finds_removed_model_objects_only() {
        let before = manifests(&two());
        let after = manifests(&one());
        let mut foreign = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "x", "namespace": format!("di-{DI}"), "labels": {}}});
        let mut observed = before.clone();
        observed.push(foreign.take());
        let gone = prune(&di(), &after, &observed);
        assert!(gone.iter().all(|k| k.name.contains("bbbbbbbb")), "{gone:?}");
        assert_eq!(
            gone.len(),
            10,
            "6 EPP objects, vLLM Deployment, InferencePool, 2 NetworkPolicies"
        );
        assert_eq!(gone[0].kind, "InferencePool");
        assert!(prune(&di(), &after, &after).is_empty());
    }

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
