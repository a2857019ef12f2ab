//! Discovery documents: the legacy per-group-version lists that
//! `kube::Discovery::run` and older kubectl read, and the aggregated v2 form
//! (`Accept: application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList`).

use serde_json::{json, Value};

use crate::resources::{groups, ResourceType, TYPES};

pub const AGGREGATED_CONTENT_TYPE: &str =
    "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList";

const VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];
const STATUS_VERBS: &[&str] = &["get", "patch", "update"];

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "34",
        "gitVersion": "v1.34.1-sim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

pub fn api_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1:443"}]
    })
}

pub fn api_group_list() -> Value {
    let groups: Vec<Value> = groups()
        .into_iter()
        .map(|(g, v)| {
            let gv = json!({"groupVersion": format!("{g}/{v}"), "version": v});
            json!({"name": g, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn types_in<'a>(
    group: &'a str,
    version: &'a str,
) -> impl Iterator<Item = &'static ResourceType> + use<'a> {
    TYPES
        .iter()
        .filter(move |t| t.group == group && t.version == version)
}

/// `/api/v1` or `/apis/{group}/{version}`; None for an unknown group version.
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for t in types_in(group, version) {
        let mut r = json!({
            "name": t.plural,
            "singularName": t.singular,
            "namespaced": t.namespaced,
            "kind": t.kind,
            "verbs": VERBS,
        });
        if !t.short_names.is_empty() {
            r["shortNames"] = json!(t.short_names);
        }
        resources.push(r);
        if t.status {
            resources.push(json!({
                "name": format!("{}/status", t.plural),
                "singularName": "",
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": STATUS_VERBS,
            }));
        }
        if t.kind == "Deployment" {
            resources.push(json!({
                "name": format!("{}/scale", t.plural),
                "singularName": "",
                "namespaced": true,
                "group": "autoscaling",
                "version": "v1",
                "kind": "Scale",
                "verbs": STATUS_VERBS,
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}

fn aggregated_group(group: &str, version: &str) -> Value {
    let resources: Vec<Value> = types_in(group, version)
        .map(|t| {
            let gvk = json!({"group": t.group, "version": t.version, "kind": t.kind});
            let mut r = json!({
                "resource": t.plural,
                "responseKind": gvk,
                "scope": if t.namespaced { "Namespaced" } else { "Cluster" },
                "singularResource": t.singular,
                "verbs": VERBS,
            });
            if !t.short_names.is_empty() {
                r["shortNames"] = json!(t.short_names);
            }
            let mut subs = Vec::new();
            if t.status {
                subs.push(
                    json!({"subresource": "status", "responseKind": gvk, "verbs": STATUS_VERBS}),
                );
            }
            if t.kind == "Deployment" {
                let scale = json!({"group": "autoscaling", "version": "v1", "kind": "Scale"});
                subs.push(
                    json!({"subresource": "scale", "responseKind": scale, "verbs": STATUS_VERBS}),
                );
            }
            if !subs.is_empty() {
                r["subresources"] = json!(subs);
            }
            r
        })
        .collect();
    let mut g =
        json!({"versions": [{"version": version, "resources": resources, "freshness": "Current"}]});
    g["metadata"] = if group.is_empty() {
        json!({})
    } else {
        json!({"name": group})
    };
    g
}

/// Aggregated discovery for `/api` (core = true) or `/apis`.
pub fn aggregated(core: bool) -> Value {
    let items: Vec<Value> = if core {
        vec![aggregated_group("", "v1")]
    } else {
        groups()
            .into_iter()
            .map(|(g, v)| aggregated_group(g, v))
            .collect()
    };
    json!({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items})
}
