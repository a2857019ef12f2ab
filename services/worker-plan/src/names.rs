//! Every name the worker gives a cloud resource or Kubernetes object, derived only from our ids
//! so that a crash between "create" and "remember" finds the same name on the next pass.

use uuid::Uuid;

/// Label (and value) on everything the worker creates.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "dedicated-inference-worker";
/// Label carrying the dedicated inference id (full UUID).
pub const DI_ID_LABEL: &str = "dedicated-inference.dev/id";
/// Label carrying the model deployment id (full UUID) on per-model objects and node pools.
pub const MODEL_ID_LABEL: &str = "dedicated-inference.dev/model-id";
/// Annotation on the vLLM Deployment and its pod template: a hash of the desired template, so
/// the planner can tell a rollout from a scale change.
pub const TEMPLATE_HASH_ANNOTATION: &str = "dedicated-inference.dev/template-hash";
/// On the endpoint picker's pod template: a hash of its configuration, so that a change starts
/// a new picker (it reads the file once).
pub const CONFIG_HASH_ANNOTATION: &str = "dedicated-inference.dev/config-hash";

/// InferencePool selector labels (also the vLLM pod labels).
pub const SERVING_LABEL: &str = "llm-d.ai/inference-serving";
pub const MODEL_LABEL: &str = "llm-d.ai/model";
/// Selector label of an EPP Deployment's pods.
pub const EPP_LABEL: &str = "dedicated-inference.dev/epp";

/// The label DOKS puts on every node with its node pool's name.
pub const NODE_POOL_LABEL: &str = "doks.digitalocean.com/node-pool";
/// The label holding a node's Droplet size slug.
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";
/// The selector label gateway implementations put on the pods of Gateway `<name>`.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

pub const HF_TOKEN_SECRET: &str = "hf-token";
pub const HF_TOKEN_KEY: &str = "HF_TOKEN";
pub const TLS_SECRET: &str = "inference-tls";
pub const ACCESS_TOKENS_SECRET: &str = "inference-access-tokens";
pub const GATEWAY: &str = "inference-gateway";
pub const HTTP_ROUTE: &str = "inference-route";
pub const PRIVATE_SERVICE: &str = "inference-private";
pub const PUBLIC_SERVICE: &str = "inference-public";
/// NetworkPolicies of the namespace as a whole (per-model ones take the model's object names).
pub const DEFAULT_DENY_POLICY: &str = "default-deny-ingress";
pub const GATEWAY_POLICY: &str = "inference-gateway-https";
/// The DI's endpoint authentication: Envoy Gateway's SecurityPolicy on the Gateway, and the
/// service of ours it asks (`services/endpoint-auth`): its Deployment, Service, ServiceAccount,
/// Role, RoleBinding and NetworkPolicy all take this name.
pub const ENDPOINT_AUTH: &str = "endpoint-auth";
/// The Gateway's BackendTrafficPolicy (Envoy Gateway): how it answers for a cold start that ran
/// out of time.
pub const TRAFFIC_POLICY: &str = "inference-traffic";
/// Selector label of the endpoint-auth pods.
pub const ENDPOINT_AUTH_LABEL: &str = "dedicated-inference.dev/endpoint-auth";
/// Request header that selects a model when a DI serves several.
pub const MODEL_HEADER: &str = "X-Gateway-Model-Name";

/// DigitalOcean node pool names: at most this many characters.
pub const MAX_POOL_NAME: usize = 63;

/// The first 8 hex digits of an id: short enough for names with length limits.
pub fn short(id: &Uuid) -> String {
    id.simple().to_string()[..8].to_string()
}

/// The DI's namespace: `di-<di uuid>`.
pub fn namespace(di_id: &Uuid) -> String {
    format!("di-{di_id}")
}

/// The DI whose namespace `ns` is (see [`namespace`]).
pub fn di_of_namespace(ns: &str) -> Option<Uuid> {
    ns.strip_prefix("di-")?.parse().ok()
}

/// The DOKS cluster shared by the DIs of one VPC: `di-<vpc uuid>`.
pub fn cluster(vpc_uuid: &Uuid) -> String {
    format!("di-{vpc_uuid}")
}

/// The GPU node pool of one model deployment on one accelerator size:
/// `di-<di8>-<model8>-<slug without "gpu-">`, e.g. `di-1a2b3c4d-5e6f7a8b-h100x8-640gb`.
/// The size is part of the name because a pool's size cannot change: a new size is a new pool,
/// created beside the old one so the rollout between them is seamless.
pub fn node_pool(di_id: &Uuid, model_id: &Uuid, accelerator_slug: &str) -> String {
    let size: String = accelerator_slug
        .strip_prefix("gpu-")
        .unwrap_or(accelerator_slug)
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() {
                c
            } else {
                '-'
            }
        })
        .collect();
    let mut name = format!("di-{}-{}-{size}", short(di_id), short(model_id));
    name.truncate(MAX_POOL_NAME);
    name.trim_end_matches('-').to_string()
}

/// DigitalOcean tags on a model deployment's node pool (its nodes' Droplets carry them too).
pub fn node_pool_tags(di_id: &Uuid, model_id: &Uuid) -> Vec<String> {
    vec![
        "dedicated-inference".to_string(),
        format!("dedicated-inference:{di_id}"),
        format!("dedicated-inference-model:{model_id}"),
    ]
}

/// DigitalOcean load balancer name requested for a DI's Service (`private` or `public`).
pub fn load_balancer(di_id: &Uuid, which: &str) -> String {
    format!("di-{di_id}-{which}")
}

/// The vLLM Deployment of a model deployment.
pub fn vllm_deployment(model_id: &Uuid) -> String {
    format!("vllm-{}", short(model_id))
}

/// The InferencePool of a model deployment.
pub fn inference_pool(model_id: &Uuid) -> String {
    format!("pool-{}", short(model_id))
}

/// The EPP of a model deployment: ConfigMap, ServiceAccount, Role, RoleBinding, Deployment and
/// Service all share this name.
pub fn epp(model_id: &Uuid) -> String {
    format!("{}-epp", inference_pool(model_id))
}

/// The `llm-d.ai/model` label value of a model deployment's pods.
pub fn model_label(model_id: &Uuid) -> String {
    short(model_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_names_its_di() {
        let di = Uuid::new_v4();
        assert_eq!(di_of_namespace(&namespace(&di)), Some(di));
        assert_eq!(di_of_namespace("kube-system"), None);
        assert_eq!(di_of_namespace("di-not-a-uuid"), None);
    }

    fn id(s: &str) -> Uuid {
        s.parse().unwrap()
    }

    #[test]
    fn names_derive_from_ids_only() {
        let di = id("1a2b3c4d-0000-4000-8000-000000000001");
        let m = id("5e6f7a8b-0000-4000-8000-000000000002");
        assert_eq!(namespace(&di), "di-1a2b3c4d-0000-4000-8000-000000000001");
        assert_eq!(cluster(&m), "di-5e6f7a8b-0000-4000-8000-000000000002");
        assert_eq!(
            node_pool(&di, &m, "gpu-h100x8-640gb"),
            "di-1a2b3c4d-5e6f7a8b-h100x8-640gb"
        );
        assert_eq!(vllm_deployment(&m), "vllm-5e6f7a8b");
        assert_eq!(inference_pool(&m), "pool-5e6f7a8b");
        assert_eq!(epp(&m), "pool-5e6f7a8b-epp");
        assert_eq!(model_label(&m), "5e6f7a8b");
    }

    #[test]
    fn node_pool_names_are_valid_do_names() {
        let di = Uuid::new_v4();
        let m = Uuid::new_v4();
        for slug in [
            "gpu-h100x8-640gb",
            "GPU-Weird_Slug.x1",
            "gpu-an-extremely-long-accelerator-slug-that-goes-on-and-on-and-on-x8-9999gb",
        ] {
            let n = node_pool(&di, &m, slug);
            assert!(n.len() <= MAX_POOL_NAME, "{n}");
            assert!(n
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
            assert!(!n.ends_with('-'));
            assert!(n.starts_with(&format!("di-{}-{}-", short(&di), short(&m))));
        }
    }

    #[test]
    fn a_new_size_is_a_new_pool() {
        let di = Uuid::new_v4();
        let m = Uuid::new_v4();
        assert_ne!(
            node_pool(&di, &m, "gpu-h100x1-80gb"),
            node_pool(&di, &m, "gpu-h100x8-640gb")
        );
        assert_eq!(
            node_pool(&di, &m, "gpu-h100x1-80gb"),
            node_pool(&di, &m, "gpu-h100x1-80gb")
        );
    }
}
