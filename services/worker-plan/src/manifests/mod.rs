//! Every Kubernetes object of one dedicated inference for one spec version, as JSON ready for
//! server-side apply, in apply order.
//!
//! Here: the input, the object keys, the apply and teardown order and the access-token Secret.
//! Beside it, one file per part: the model server (`model_server`), the endpoint picker
//! (`endpoint_picker`), endpoint-auth and its policy (`endpoint_auth`), the route and pool
//! (`routing`), and the load balancers and network policies (`networking`).

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::model::{Model, PlanError};
use super::names;

mod endpoint_auth;
mod endpoint_picker;
mod model_server;
mod networking;
mod routing;

pub use endpoint_auth::endpoint_auth_manifests;
use endpoint_auth::{endpoint_auth_objects, security_policy};
use endpoint_picker::epp_objects;
pub use endpoint_picker::{epp_config, EPP_CONFIG};
pub use model_server::pool_selector;
use model_server::vllm_deployment;
pub use networking::is_default_deny;
use networking::{load_balancer, network_policies};
use routing::{http_route, inference_pool, traffic_policy};

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

/// A short, stable hash of a JSON value (its serialisation is deterministic).
fn json_hash(v: &Value) -> String {
    let digest = Sha256::digest(serde_json::to_vec(v).expect("a JSON value serialises"));
    hex::encode(&digest[..8])
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

    pub(super) const DI: &str = "0d1e2f3a-0000-4000-8000-00000000d1d1";
    pub(super) const M1: &str = "aaaaaaaa-0000-4000-8000-000000000001";
    pub(super) const M2: &str = "bbbbbbbb-0000-4000-8000-000000000002";

    pub(super) fn di() -> Uuid {
        DI.parse().unwrap()
    }

    pub(super) fn tls() -> TlsPair {
        TlsPair {
            cert_pem: "CERT".into(),
            key_pem: "KEY".into(),
        }
    }

    pub(super) fn input(mds: &[api_types::spec::ModelDeployment], public: bool) -> ManifestInput {
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

    pub(super) fn one() -> ManifestInput {
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

    pub(super) fn two() -> ManifestInput {
        input(
            &[
                deployment(M1, "org/first", "gpu-h100x1-80gb", 1),
                deployment(M2, "org/second", "gpu-mi300x1-192gb", 3),
            ],
            false,
        )
    }

    pub(super) fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    }

    pub(super) fn decode(v: &Value) -> String {
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
}
