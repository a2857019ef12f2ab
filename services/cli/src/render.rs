//! Human output: aligned tables for lists, key/value blocks for single objects.

use serde_json::Value;

/// A string field, or `-` when missing or empty.
pub fn s(v: &Value) -> String {
    match v {
        Value::String(t) if !t.is_empty() => t.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => if *b { "yes" } else { "no" }.into(),
        _ => "-".into(),
    }
}

/// An RFC 3339 time as `YYYY-MM-DD HH:MM:SS UTC`; anything else unchanged.
pub fn time(v: &Value) -> String {
    match v.as_str() {
        Some(t) => match chrono::DateTime::parse_from_rfc3339(t) {
            Ok(parsed) => parsed
                .with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%S UTC")
                .to_string(),
            Err(_) => t.to_string(),
        },
        None => "-".into(),
    }
}

/// Columns separated by three spaces, padded to the widest cell; the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(cell);
                out.push_str(&" ".repeat(widths[i] - cell.chars().count() + 3));
            }
        }
        out.trim_end().to_string()
    };
    let mut out = line(headers.to_vec());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

/// `Key:  value` lines with the values aligned.
pub fn kv(pairs: &[(&str, String)]) -> String {
    let width = pairs
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (k, v) in pairs {
        let indent = format!("\n{}", " ".repeat(width + 3));
        let v = v.replace('\n', &indent);
        out.push_str(&format!("{:<w$}  {v}\n", format!("{k}:"), w = width + 1));
    }
    out
}

/// The version column: current, plus the pending version while one rolls out.
pub fn version(di: &Value) -> String {
    let current = s(&di["spec"]["version"]);
    match di["pending_deployment_spec"]["version"].as_i64() {
        Some(p) if Some(p) != di["spec"]["version"].as_i64() => format!("{current} (→{p})"),
        _ => current,
    }
}

pub fn di_row(di: &Value) -> Vec<String> {
    vec![
        s(&di["id"]),
        s(&di["name"]),
        s(&di["region"]),
        s(&di["status"]),
        version(di),
        time(&di["created_at"]),
    ]
}

pub const DI_HEADERS: &[&str] = &["ID", "NAME", "REGION", "STATUS", "VERSION", "CREATED"];

fn deployments(spec: &Value) -> String {
    let Some(list) = spec["model_deployments"].as_array() else {
        return "-".into();
    };
    let lines: Vec<String> = list
        .iter()
        .map(|d| {
            // The name clients call it by, and the repository it loads when the customer chose one.
            let name = d["model_slug"].as_str().unwrap_or("?");
            let slug = match d["provider_model_id"].as_str().filter(|p| !p.is_empty()) {
                Some(repo) if repo != name => format!("{name} ({repo})"),
                _ => name.to_string(),
            };
            let accs: Vec<String> = d["accelerators"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|a| {
                            format!(
                                "{}× {} ({}, {})",
                                s(&a["scale"]),
                                s(&a["accelerator_slug"]),
                                s(&a["type"]),
                                s(&a["status"])
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            format!(
                "{slug} [{}] on {}",
                s(&d["model_provider"]),
                if accs.is_empty() {
                    "-".into()
                } else {
                    accs.join(", ")
                }
            )
        })
        .collect();
    if lines.is_empty() {
        "-".into()
    } else {
        lines.join("\n")
    }
}

/// The autoscaling bounds a deployment declares, as `min–max`; `None` for a fixed scale.
pub fn bounds(deployment: &Value) -> Option<String> {
    let a = deployment["workload_config"].get("autoscaling")?;
    let min = a["min_replicas"].as_u64().unwrap_or(1);
    let max = match a["max_replicas"].as_u64() {
        Some(m) => m.to_string(),
        None => s(&deployment["accelerators"][0]["scale"]),
    };
    Some(format!("{min}–{max}"))
}

/// Per deployment, `model: R ready, W wanted (autoscaling min–max)`; `None` before the
/// control plane has counted any.
pub fn replicas(di: &Value) -> Option<String> {
    let counts = di["replicas"].as_array().filter(|r| !r.is_empty())?;
    let lines: Vec<String> = counts
        .iter()
        .map(|r| {
            let deployment = di["spec"]["model_deployments"]
                .as_array()
                .and_then(|ds| ds.iter().find(|d| d["model_id"] == r["model_id"]));
            let scaling = deployment
                .and_then(bounds)
                .map_or_else(|| " (fixed)".to_string(), |b| format!(" (autoscaling {b})"));
            format!(
                "{}: {} ready, {} wanted{scaling}",
                s(&r["model_slug"]),
                s(&r["ready"]),
                s(&r["wanted"])
            )
        })
        .collect();
    Some(lines.join("\n"))
}

/// The key/value view of one dedicated inference.
pub fn di(di: &Value) -> String {
    let pending = &di["pending_deployment_spec"];
    let mut pairs = vec![
        ("ID", s(&di["id"])),
        ("Name", s(&di["name"])),
        ("Region", s(&di["region"])),
        ("Status", s(&di["status"])),
        ("Version", s(&di["spec"]["version"])),
    ];
    if pending.is_object() {
        pairs.push((
            "Pending version",
            format!("{} ({})", s(&pending["version"]), s(&pending["status"])),
        ));
    }
    pairs.extend([
        ("VPC", s(&di["vpc_uuid"])),
        (
            "Public endpoint",
            if di["spec"]["enable_public_endpoint"] == Value::Bool(false) {
                "disabled".into()
            } else {
                s(&di["endpoints"]["public_endpoint_fqdn"])
            },
        ),
        (
            "Private endpoint",
            s(&di["endpoints"]["private_endpoint_fqdn"]),
        ),
        ("Models", deployments(&di["spec"])),
    ]);
    if let Some(r) = replicas(di) {
        pairs.push(("Replicas", r));
    }
    // A new DI shows its pending spec as the spec; say it once.
    if pending.is_object() && pending["version"] != di["spec"]["version"] {
        if pending["name"] != di["name"] {
            pairs.push(("Pending name", s(&pending["name"])));
        }
        pairs.push(("Pending models", deployments(pending)));
    }
    pairs.extend([
        ("Created", time(&di["created_at"])),
        ("Updated", time(&di["updated_at"])),
    ]);
    kv(&pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replicas_show_ready_wanted_and_bounds() {
        let di = json!({
            "spec": {"model_deployments": [
                {"model_id": "a", "model_slug": "m", "accelerators": [{"scale": 1}],
                 "workload_config": {"autoscaling": {"min_replicas": 0, "max_replicas": 4}}},
                {"model_id": "b", "model_slug": "n", "accelerators": [{"scale": 2}], "workload_config": {}},
            ]},
            "replicas": [
                {"model_id": "a", "model_slug": "m", "ready": 2, "wanted": 3},
                {"model_id": "b", "model_slug": "n", "ready": 2, "wanted": 2},
            ],
        });
        assert_eq!(
            replicas(&di).unwrap(),
            "m: 2 ready, 3 wanted (autoscaling 0–4)\nn: 2 ready, 2 wanted (fixed)"
        );
        assert_eq!(replicas(&json!({"replicas": []})), None);
    }

    #[test]
    fn tables_align_columns() {
        let out = table(
            &["ID", "NAME"],
            &[
                vec!["1".into(), "short".into()],
                vec!["12345".into(), "x".into()],
            ],
        );
        assert_eq!(out, "ID      NAME\n1       short\n12345   x\n");
    }

    #[test]
    fn version_shows_pending() {
        let di = json!({"spec": {"version": 1}, "pending_deployment_spec": {"version": 2}});
        assert_eq!(version(&di), "1 (→2)");
        let di = json!({"spec": {"version": 1}, "pending_deployment_spec": {"version": 1}});
        assert_eq!(version(&di), "1");
    }

    #[test]
    fn times_are_readable() {
        assert_eq!(
            time(&json!("2026-01-02T03:04:05.123456Z")),
            "2026-01-02 03:04:05 UTC"
        );
        assert_eq!(time(&Value::Null), "-");
    }
}
