//! The fixed table of kinds this API server serves. Real clusters learn kinds from
//! CRDs; the simulator knows its handful up front so discovery and routing agree.

/// One served resource type.
#[derive(Debug)]
pub struct ResourceType {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    /// Has a `/status` subresource: the main resource then ignores `status`.
    pub status: bool,
    /// DNS label (63 chars, no dots) instead of DNS subdomain for `metadata.name`.
    pub name_rule: NameRule,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameRule {
    Subdomain,
    Label,
    /// Services: DNS-1035 label (must start with a letter).
    Label1035,
    /// RBAC objects: any path segment.
    PathSegment,
}

impl ResourceType {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `deployments.apps`-style name used in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

#[allow(clippy::too_many_arguments)]
const fn rt(
    group: &'static str,
    version: &'static str,
    kind: &'static str,
    plural: &'static str,
    singular: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
    status: bool,
    name_rule: NameRule,
) -> ResourceType {
    ResourceType {
        group,
        version,
        kind,
        plural,
        singular,
        namespaced,
        short_names,
        status,
        name_rule,
    }
}

pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
pub const INFERENCE_GROUP: &str = "inference.networking.k8s.io";
/// Envoy Gateway's policies: the SecurityPolicy that puts endpoint authentication on a Gateway,
/// the BackendTrafficPolicy that overrides the answer to a cold start that ran out.
pub const ENVOY_GATEWAY_GROUP: &str = "gateway.envoyproxy.io";

/// Index of Namespace in [`TYPES`]; namespaces are looked up on every namespaced write.
pub const NAMESPACE: usize = 0;

pub static TYPES: &[ResourceType] = &[
    rt(
        "",
        "v1",
        "Namespace",
        "namespaces",
        "namespace",
        false,
        &["ns"],
        true,
        NameRule::Label,
    ),
    rt(
        "",
        "v1",
        "Node",
        "nodes",
        "node",
        false,
        &["no"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        "",
        "v1",
        "Secret",
        "secrets",
        "secret",
        true,
        &[],
        false,
        NameRule::Subdomain,
    ),
    rt(
        "",
        "v1",
        "ConfigMap",
        "configmaps",
        "configmap",
        true,
        &["cm"],
        false,
        NameRule::Subdomain,
    ),
    rt(
        "",
        "v1",
        "ServiceAccount",
        "serviceaccounts",
        "serviceaccount",
        true,
        &["sa"],
        false,
        NameRule::Subdomain,
    ),
    rt(
        "",
        "v1",
        "Service",
        "services",
        "service",
        true,
        &["svc"],
        true,
        NameRule::Label1035,
    ),
    rt(
        "",
        "v1",
        "Pod",
        "pods",
        "pod",
        true,
        &["po"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        "",
        "v1",
        "Event",
        "events",
        "event",
        true,
        &["ev"],
        false,
        NameRule::Subdomain,
    ),
    rt(
        "apps",
        "v1",
        "Deployment",
        "deployments",
        "deployment",
        true,
        &["deploy"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        "rbac.authorization.k8s.io",
        "v1",
        "Role",
        "roles",
        "role",
        true,
        &[],
        false,
        NameRule::PathSegment,
    ),
    rt(
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
        "rolebinding",
        true,
        &[],
        false,
        NameRule::PathSegment,
    ),
    rt(
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        "poddisruptionbudget",
        true,
        &["pdb"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
        "networkpolicies",
        "networkpolicy",
        true,
        &["netpol"],
        false,
        NameRule::Subdomain,
    ),
    rt(
        GATEWAY_GROUP,
        "v1",
        "GatewayClass",
        "gatewayclasses",
        "gatewayclass",
        false,
        &["gc"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        GATEWAY_GROUP,
        "v1",
        "Gateway",
        "gateways",
        "gateway",
        true,
        &["gtw"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        GATEWAY_GROUP,
        "v1",
        "HTTPRoute",
        "httproutes",
        "httproute",
        true,
        &[],
        true,
        NameRule::Subdomain,
    ),
    rt(
        ENVOY_GATEWAY_GROUP,
        "v1alpha1",
        "SecurityPolicy",
        "securitypolicies",
        "securitypolicy",
        true,
        &[],
        true,
        NameRule::Subdomain,
    ),
    rt(
        ENVOY_GATEWAY_GROUP,
        "v1alpha1",
        "BackendTrafficPolicy",
        "backendtrafficpolicies",
        "backendtrafficpolicy",
        true,
        &["btp"],
        true,
        NameRule::Subdomain,
    ),
    rt(
        INFERENCE_GROUP,
        "v1",
        "InferencePool",
        "inferencepools",
        "inferencepool",
        true,
        &["infpool"],
        true,
        NameRule::Subdomain,
    ),
];

/// Index of a type by URL coordinates.
pub fn by_plural(group: &str, version: &str, plural: &str) -> Option<usize> {
    TYPES
        .iter()
        .position(|t| t.group == group && t.version == version && t.plural == plural)
}

/// Index of a type by `apiVersion` and `kind` as found in object bodies.
pub fn by_kind(api_version: &str, kind: &str) -> Option<usize> {
    TYPES
        .iter()
        .position(|t| t.kind == kind && t.api_version() == api_version)
}

pub fn index_of(kind: &str) -> usize {
    TYPES
        .iter()
        .position(|t| t.kind == kind)
        .expect("kind is in the table")
}

/// Distinct API groups (excluding core), in table order, with their versions.
pub fn groups() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for t in TYPES.iter().filter(|t| !t.group.is_empty()) {
        if !out.iter().any(|(g, v)| *g == t.group && *v == t.version) {
            out.push((t.group, t.version));
        }
    }
    out
}
