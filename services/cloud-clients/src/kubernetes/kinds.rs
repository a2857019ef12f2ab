//! The kinds the control plane writes or reads, in a static table: resolving an `apiVersion`
//! and `kind` to the API resource to call needs no discovery round trip.

use kube::api::ApiResource;

/// (group, kind, plural, namespaced) of every kind the control plane writes or reads.
const KINDS: &[(&str, &str, &str, bool)] = &[
    ("", "Namespace", "namespaces", false),
    ("", "Node", "nodes", false),
    ("", "Secret", "secrets", true),
    ("", "ConfigMap", "configmaps", true),
    ("", "ServiceAccount", "serviceaccounts", true),
    ("", "Service", "services", true),
    ("", "Pod", "pods", true),
    ("", "Event", "events", true),
    ("events.k8s.io", "Event", "events", true),
    ("apps", "Deployment", "deployments", true),
    (
        "networking.k8s.io",
        "NetworkPolicy",
        "networkpolicies",
        true,
    ),
    (
        "policy",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        true,
    ),
    ("rbac.authorization.k8s.io", "Role", "roles", true),
    (
        "rbac.authorization.k8s.io",
        "RoleBinding",
        "rolebindings",
        true,
    ),
    (
        "gateway.networking.k8s.io",
        "GatewayClass",
        "gatewayclasses",
        false,
    ),
    ("gateway.networking.k8s.io", "Gateway", "gateways", true),
    ("gateway.networking.k8s.io", "HTTPRoute", "httproutes", true),
    (
        "gateway.envoyproxy.io",
        "SecurityPolicy",
        "securitypolicies",
        true,
    ),
    (
        "gateway.envoyproxy.io",
        "BackendTrafficPolicy",
        "backendtrafficpolicies",
        true,
    ),
    (
        "inference.networking.k8s.io",
        "InferencePool",
        "inferencepools",
        true,
    ),
];

/// A kind from the static table, at the version the caller asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownResource {
    pub api_resource: ApiResource,
    pub namespaced: bool,
}

/// Resolves `apiVersion` + `kind` without a discovery call. The version is taken as given (the
/// server answers 404 for one it does not serve); group and kind must be in the table.
pub fn known_resource(api_version: &str, kind: &str) -> Option<KnownResource> {
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    };
    if version.is_empty() {
        return None;
    }
    KINDS
        .iter()
        .find(|(g, k, _, _)| *g == group && *k == kind)
        .map(|(g, k, plural, namespaced)| KnownResource {
            api_resource: ApiResource {
                group: g.to_string(),
                version: version.to_string(),
                api_version: api_version.to_string(),
                kind: k.to_string(),
                plural: plural.to_string(),
            },
            namespaced: *namespaced,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_kinds_and_scopes() {
        let ns = known_resource("v1", "Namespace").unwrap();
        assert!(!ns.namespaced);
        assert_eq!(ns.api_resource.plural, "namespaces");
        assert_eq!(ns.api_resource.group, "");
        let d = known_resource("apps/v1", "Deployment").unwrap();
        assert!(d.namespaced);
        assert_eq!(
            (
                d.api_resource.group.as_str(),
                d.api_resource.version.as_str()
            ),
            ("apps", "v1")
        );
        let route = known_resource("gateway.networking.k8s.io/v1", "HTTPRoute").unwrap();
        assert_eq!(route.api_resource.plural, "httproutes");
        let pool = known_resource("inference.networking.k8s.io/v1", "InferencePool").unwrap();
        assert_eq!(pool.api_resource.plural, "inferencepools");
        let policy = known_resource("networking.k8s.io/v1", "NetworkPolicy").unwrap();
        assert_eq!(policy.api_resource.plural, "networkpolicies");
        assert!(policy.namespaced);
        assert!(known_resource("v1", "Deployment").is_none());
        assert!(known_resource("apps/v1", "StatefulSet").is_none());
        assert!(known_resource("apps/", "Deployment").is_none());
        for (_, kind, _, _) in KINDS {
            assert!(KINDS.iter().filter(|(_, k, _, _)| k == kind).count() <= 2);
        }
    }
}
