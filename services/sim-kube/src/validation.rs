//! The checks and defaults a real API server applies before storing an object.
//! Only the rules a control plane is likely to trip over are implemented.

use serde_json::{json, Value};

use crate::error::Cause;
use crate::resources::{NameRule, ResourceType};
use crate::selector::LabelSelector;

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

pub fn is_dns_label(s: &str) -> bool {
    is_label(s)
}

pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_label)
}

fn is_dns1035_label(s: &str) -> bool {
    is_label(s) && s.starts_with(|c: char| c.is_ascii_lowercase())
}

pub fn name_errors(rule: NameRule, name: &str) -> Option<String> {
    let ok = match rule {
        NameRule::Subdomain => is_dns_subdomain(name),
        NameRule::Label => is_dns_label(name),
        NameRule::Label1035 => is_dns1035_label(name),
        NameRule::PathSegment => {
            !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '%'])
        }
    };
    if ok {
        return None;
    }
    Some(match rule {
        NameRule::Subdomain => "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character".into(),
        NameRule::Label => "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character".into(),
        NameRule::Label1035 => "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character".into(),
        NameRule::PathSegment => "may not contain '/' or '%' and may not be '.' or '..'".into(),
    })
}

/// Qualified name: optional DNS subdomain prefix + "/" + name of 1..63
/// alphanumerics, '-', '_' or '.', starting and ending alphanumeric.
fn is_qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if prefix.is_some_and(|p| p.is_empty() || !is_dns_subdomain(p)) {
        return false;
    }
    is_label_value(name) && !name.is_empty()
}

fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

fn check_labels(labels: Option<&Value>, field: &str, causes: &mut Vec<Cause>) {
    let Some(m) = labels.and_then(Value::as_object) else {
        return;
    };
    for (k, v) in m {
        if !is_qualified_name(k) {
            causes.push(Cause::invalid(field, k, "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"));
        }
        match v.as_str() {
            Some(s) if is_label_value(s) => {}
            _ => causes.push(Cause::invalid(
                &format!("{field}[{k}]"),
                &v.to_string(),
                "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            )),
        }
    }
}

/// Fills in the defaults a real API server would add, deterministically, so that
/// re-applying the same configuration yields the same object.
pub fn default(rt: &ResourceType, obj: &mut Value) {
    match rt.kind {
        "Namespace" => {
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            obj["metadata"]["labels"]["kubernetes.io/metadata.name"] = json!(name);
            if obj.pointer("/spec/finalizers").is_none() {
                obj["spec"]["finalizers"] = json!(["kubernetes"]);
            }
            if obj.pointer("/status/phase").is_none() {
                obj["status"]["phase"] = json!("Active");
            }
        }
        "Deployment" => {
            let spec = &mut obj["spec"];
            if spec.get("replicas").is_none() {
                spec["replicas"] = json!(1);
            }
            if spec.pointer("/strategy/type").is_none() {
                spec["strategy"]["type"] = json!("RollingUpdate");
            }
            if spec["strategy"]["type"] == "RollingUpdate" {
                let ru = &mut spec["strategy"]["rollingUpdate"];
                if ru.get("maxSurge").is_none() {
                    ru["maxSurge"] = json!("25%");
                }
                if ru.get("maxUnavailable").is_none() {
                    ru["maxUnavailable"] = json!("25%");
                }
            }
            for (k, v) in [
                ("revisionHistoryLimit", 10),
                ("progressDeadlineSeconds", 600),
            ] {
                if spec.get(k).is_none() {
                    spec[k] = json!(v);
                }
            }
        }
        "Service" => {
            let spec = &mut obj["spec"];
            if spec.get("type").is_none() {
                spec["type"] = json!("ClusterIP");
            }
            if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
                for p in ports {
                    if p.get("protocol").is_none() {
                        p["protocol"] = json!("TCP");
                    }
                    if p.get("targetPort").is_none() {
                        p["targetPort"] = p["port"].clone();
                    }
                }
            }
        }
        "Secret" => {
            if obj.get("type").is_none() {
                obj["type"] = json!("Opaque");
            }
            // stringData is write-only: folded into data (base64), never stored.
            if let Some(Value::Object(sd)) =
                obj.as_object_mut().and_then(|m| m.remove("stringData"))
            {
                use base64::Engine;
                for (k, v) in sd {
                    let text = v.as_str().unwrap_or_default();
                    obj["data"][k] = json!(base64::engine::general_purpose::STANDARD.encode(text));
                }
            }
        }
        _ => {}
    }
}

fn containers_errors(pod_spec: &Value, field: &str, causes: &mut Vec<Cause>) {
    match pod_spec.get("containers").and_then(Value::as_array) {
        Some(cs) if !cs.is_empty() => {
            for (i, c) in cs.iter().enumerate() {
                let name = c["name"].as_str().unwrap_or_default();
                if name.is_empty() {
                    causes.push(Cause::required(&format!("{field}.containers[{i}].name")));
                } else if !is_dns_label(name) {
                    causes.push(Cause::invalid(
                        &format!("{field}.containers[{i}].name"),
                        name,
                        "must be a DNS label",
                    ));
                }
                if c["image"].as_str().unwrap_or_default().is_empty() {
                    causes.push(Cause::required(&format!("{field}.containers[{i}].image")));
                }
            }
        }
        _ => causes.push(Cause::required(&format!("{field}.containers"))),
    }
}

/// Validation of a create (old = None) or update.
pub fn validate(rt: &ResourceType, obj: &Value, old: Option<&Value>) -> Vec<Cause> {
    let mut causes = Vec::new();
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        causes.push(Cause::required("metadata.name"));
    } else if let Some(msg) = name_errors(rt.name_rule, name) {
        causes.push(Cause::invalid("metadata.name", name, &msg));
    }
    check_labels(
        obj.pointer("/metadata/labels"),
        "metadata.labels",
        &mut causes,
    );
    if let Some(a) = obj
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
    {
        for k in a.keys().filter(|k| !is_qualified_name(k)) {
            causes.push(Cause::invalid(
                "metadata.annotations",
                k,
                "name part must consist of alphanumeric characters, '-', '_' or '.'",
            ));
        }
    }
    match rt.kind {
        "Deployment" => validate_deployment(obj, old, &mut causes),
        "Service" => validate_service(obj, old, &mut causes),
        "NetworkPolicy" => validate_network_policy(obj, &mut causes),
        "Pod" => containers_errors(&obj["spec"], "spec", &mut causes),
        "Secret" | "ConfigMap" => {
            for field in ["data", "stringData", "binaryData"] {
                if let Some(m) = obj.get(field).and_then(Value::as_object) {
                    for k in m.keys() {
                        let ok = !k.is_empty()
                            && k.len() <= 253
                            && k.bytes().all(|b| {
                                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
                            });
                        if !ok {
                            causes.push(Cause::invalid(&format!("{field}[{k}]"), k, "a valid config key must consist of alphanumeric characters, '-', '_' or '.'"));
                        }
                    }
                }
            }
        }
        "Gateway" => {
            if obj
                .pointer("/spec/gatewayClassName")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .is_empty()
            {
                causes.push(Cause::required("spec.gatewayClassName"));
            }
            match obj.pointer("/spec/listeners").and_then(Value::as_array) {
                Some(l) if !l.is_empty() => {
                    for (i, li) in l.iter().enumerate() {
                        for f in ["name", "protocol"] {
                            if li[f].as_str().unwrap_or_default().is_empty() {
                                causes.push(Cause::required(&format!("spec.listeners[{i}].{f}")));
                            }
                        }
                        if !li["port"].is_u64() {
                            causes.push(Cause::required(&format!("spec.listeners[{i}].port")));
                        }
                    }
                }
                _ => causes.push(Cause::required("spec.listeners")),
            }
        }
        "GatewayClass"
            if obj
                .pointer("/spec/controllerName")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .is_empty() =>
        {
            causes.push(Cause::required("spec.controllerName"));
        }
        "InferencePool" => {
            match obj
                .pointer("/spec/selector/matchLabels")
                .and_then(Value::as_object)
            {
                Some(m) if !m.is_empty() => {}
                _ => causes.push(Cause::required("spec.selector.matchLabels")),
            }
            match obj.pointer("/spec/targetPorts").and_then(Value::as_array) {
                Some(p) if !p.is_empty() && p.iter().all(|x| x["number"].is_u64()) => {}
                _ => causes.push(Cause::required("spec.targetPorts")),
            }
        }
        _ => {}
    }
    causes
}

fn validate_deployment(obj: &Value, old: Option<&Value>, causes: &mut Vec<Cause>) {
    let spec = &obj["spec"];
    let template_labels = spec.pointer("/template/metadata/labels");
    match spec.get("selector") {
        Some(sel) if sel.is_object() && !LabelSelector::from_object(sel).is_empty() => {
            if !LabelSelector::from_object(sel).matches_labels(template_labels) {
                causes.push(Cause::invalid(
                    "spec.template.metadata.labels",
                    &template_labels.map(|l| l.to_string()).unwrap_or_default(),
                    "`selector` does not match template `labels`",
                ));
            }
            if let Some(old_sel) = old.and_then(|o| o.pointer("/spec/selector")) {
                if old_sel != sel {
                    causes.push(Cause::invalid(
                        "spec.selector",
                        &sel.to_string(),
                        "field is immutable",
                    ));
                }
            }
        }
        _ => causes.push(Cause::required("spec.selector")),
    }
    if spec
        .get("replicas")
        .and_then(Value::as_i64)
        .is_some_and(|r| r < 0)
    {
        causes.push(Cause::invalid(
            "spec.replicas",
            &spec["replicas"].to_string(),
            "must be greater than or equal to 0",
        ));
    }
    containers_errors(&spec["template"]["spec"], "spec.template.spec", causes);
}

/// The API server's NetworkPolicy rules (`ValidateNetworkPolicySpec`): policy types, ports,
/// and peers that name exactly one kind of source.
fn validate_network_policy(obj: &Value, causes: &mut Vec<Cause>) {
    let spec = &obj["spec"];
    let types = spec.get("policyTypes").and_then(Value::as_array);
    for (i, t) in types.into_iter().flatten().enumerate() {
        if !matches!(t.as_str(), Some("Ingress" | "Egress")) {
            causes.push(Cause::invalid(
                &format!("spec.policyTypes[{i}]"),
                &t.to_string(),
                "supported values: \"Egress\", \"Ingress\"",
            ));
        }
    }
    if types.is_some_and(|t| t.len() > 2) {
        causes.push(Cause::invalid(
            "spec.policyTypes",
            &spec["policyTypes"].to_string(),
            "may not specify more than two policyTypes",
        ));
    }
    for (dir, peers) in [("ingress", "from"), ("egress", "to")] {
        let rules = spec.get(dir).and_then(Value::as_array);
        for (i, rule) in rules.into_iter().flatten().enumerate() {
            let at = format!("spec.{dir}[{i}]");
            for (j, p) in rule["ports"].as_array().into_iter().flatten().enumerate() {
                let field = format!("{at}.ports[{j}]");
                if !matches!(p["protocol"].as_str(), None | Some("TCP" | "UDP" | "SCTP")) {
                    causes.push(Cause::invalid(
                        &format!("{field}.protocol"),
                        &p["protocol"].to_string(),
                        "supported values: \"SCTP\", \"TCP\", \"UDP\"",
                    ));
                }
                let ok = match &p["port"] {
                    Value::Null => true,
                    Value::Number(n) => n.as_u64().is_some_and(|n| (1..=65535).contains(&n)),
                    Value::String(name) => is_dns1035_label(name) && name.len() <= 15,
                    _ => false,
                };
                if !ok {
                    causes.push(Cause::invalid(
                        &format!("{field}.port"),
                        &p["port"].to_string(),
                        "must be a port number between 1 and 65535 or an IANA service name",
                    ));
                }
            }
            for (j, peer) in rule[peers].as_array().into_iter().flatten().enumerate() {
                let field = format!("{at}.{peers}[{j}]");
                let has = |k: &str| peer.get(k).is_some_and(|v| !v.is_null());
                let selectors = has("podSelector") || has("namespaceSelector");
                if !selectors && !has("ipBlock") {
                    causes.push(Cause::required(&format!("{field}: must specify a peer")));
                } else if selectors && has("ipBlock") {
                    causes.push(Cause::invalid(
                        &field,
                        &peer.to_string(),
                        "may not specify more than 1 peer type",
                    ));
                } else if has("ipBlock") && !peer["ipBlock"]["cidr"].is_string() {
                    causes.push(Cause::required(&format!("{field}.ipBlock.cidr")));
                }
            }
        }
    }
}

fn validate_service(obj: &Value, old: Option<&Value>, causes: &mut Vec<Cause>) {
    let spec = &obj["spec"];
    let ty = spec["type"].as_str().unwrap_or("ClusterIP");
    if !["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"].contains(&ty) {
        causes.push(Cause::invalid(
            "spec.type",
            ty,
            "supported values: \"ClusterIP\", \"ExternalName\", \"LoadBalancer\", \"NodePort\"",
        ));
    }
    let headless = spec["clusterIP"] == "None";
    let ports = spec.get("ports").and_then(Value::as_array);
    match ports {
        Some(ps) if !ps.is_empty() => {
            let mut names = std::collections::HashSet::new();
            for (i, p) in ps.iter().enumerate() {
                let port = p["port"].as_u64().unwrap_or(0);
                if !(1..=65535).contains(&port) {
                    causes.push(Cause::invalid(
                        &format!("spec.ports[{i}].port"),
                        &p["port"].to_string(),
                        "must be between 1 and 65535, inclusive",
                    ));
                }
                let name = p["name"].as_str().unwrap_or_default();
                if ps.len() > 1 && name.is_empty() {
                    causes.push(Cause::required(&format!("spec.ports[{i}].name")));
                }
                if !name.is_empty() && !names.insert(name.to_string()) {
                    causes.push(Cause {
                        reason: "FieldValueDuplicate",
                        field: format!("spec.ports[{i}].name"),
                        message: format!("Duplicate value: {name:?}"),
                    });
                }
            }
        }
        _ if ty == "ExternalName" || headless => {}
        _ => causes.push(Cause::required("spec.ports")),
    }
    if let Some(old_ip) = old
        .and_then(|o| o.pointer("/spec/clusterIP"))
        .and_then(Value::as_str)
    {
        if let Some(ip) = spec["clusterIP"].as_str() {
            if ip != old_ip {
                causes.push(Cause::invalid("spec.clusterIP", ip, "field is immutable"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns_subdomain("a.b-c"));
        assert!(!is_dns_subdomain("A"));
        assert!(!is_dns_label("a.b"));
        assert!(is_qualified_name("doks.digitalocean.com/node-pool"));
        assert!(!is_qualified_name("bad key"));
        assert!(name_errors(NameRule::Label1035, "1svc").is_some());
    }
}
