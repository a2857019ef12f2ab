//! Whether an apply has anything to write, and whether it changed anything: the digest of the
//! configuration last applied, kept in an annotation, compared with what is live; and the
//! object before and after an apply, compared without what only the server or other managers
//! changed.

use serde_json::Value;

/// Annotation holding a digest of the configuration last applied, so that a field dropped from
/// the desired object (which a server-side apply would remove) still counts as a difference.
const APPLIED_HASH: &str = "inference.digitalocean.com/applied-hash";

/// `obj` with [`APPLIED_HASH`] set to the digest of `obj` itself.
pub(super) fn with_applied_hash(obj: &Value) -> Value {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(serde_json::to_vec(obj).expect("JSON values serialise"));
    let hash: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    let mut obj = obj.clone();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(a) = annotations.as_object_mut() {
            a.insert(APPLIED_HASH.into(), Value::String(hash));
        }
    }
    obj
}

/// Whether applying `desired` (with its [`APPLIED_HASH`]) to `live` would change nothing: the
/// same configuration was applied last, and every field of it still has its value in `live`
/// (which also holds server defaults, status and other managers' fields).
pub(super) fn up_to_date(live: &Value, desired: &Value) -> bool {
    let hash = |v: &Value| {
        v.pointer("/metadata/annotations")
            .and_then(|a| a.get(APPLIED_HASH))
            .cloned()
    };
    hash(live).is_some() && hash(live) == hash(desired) && contains(live, desired)
}

/// `live` says everything `desired` says: objects field by field, lists element by element.
fn contains(live: &Value, desired: &Value) -> bool {
    match (live, desired) {
        (Value::Object(l), Value::Object(d)) => d
            .iter()
            .all(|(k, dv)| l.get(k).is_some_and(|lv| contains(lv, dv))),
        (Value::Array(l), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| contains(lv, dv))
        }
        // The API server returns quantities and int-or-string values as strings.
        (Value::String(l), Value::Number(d)) => *l == d.to_string(),
        (l, d) => l == d,
    }
}

/// Whether an apply changed the object: its `resourceVersion` moved, and not only because a
/// controller wrote its status (or another manager's bookkeeping) between our get and our apply.
pub(super) fn changed(before: &Value, after: &Value, manager: &str) -> bool {
    let rv = |v: &Value| v.pointer("/metadata/resourceVersion").cloned();
    if rv(before) == rv(after) {
        return false;
    }
    fingerprint(before, manager) != fingerprint(after, manager)
}

fn fingerprint(obj: &Value, manager: &str) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("status");
        if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
            meta.remove("generation");
            if let Some(mf) = meta.get_mut("managedFields").and_then(Value::as_array_mut) {
                mf.retain(|e| {
                    e.get("manager").and_then(Value::as_str) == Some(manager)
                        && e.get("subresource").is_none()
                });
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_object_is_up_to_date_only_with_the_same_applied_config_and_no_drift() {
        let desired = with_applied_hash(&json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {"a": "1"}},
            "data": {"k": "v"},
            "spec": {"replicas": 2, "ports": [{"port": 80}]}
        }));
        let mut live = desired.clone();
        // Server-side additions: metadata, defaults inside list elements, status.
        live["metadata"]["resourceVersion"] = json!("7");
        live["spec"]["ports"][0]["protocol"] = json!("TCP");
        live["spec"]["replicas"] = json!("2");
        live["status"] = json!({"ready": true});
        assert!(up_to_date(&live, &desired));

        let mut drifted = live.clone();
        drifted["data"]["k"] = json!("edited by hand");
        assert!(!up_to_date(&drifted, &desired), "drift is rewritten");

        let mut extra = live.clone();
        extra["spec"]["ports"] = json!([{"port": 80}, {"port": 81}]);
        assert!(!up_to_date(&extra, &desired), "list lengths must match");

        // A field dropped from the desired config changes the digest, though the rest is a
        // subset of what is live.
        let mut smaller = desired.clone();
        smaller["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(APPLIED_HASH);
        smaller["data"].as_object_mut().unwrap().remove("k");
        let smaller = with_applied_hash(&smaller);
        assert!(contains(&live, &{
            let mut s = smaller.clone();
            s["metadata"]["annotations"][APPLIED_HASH] =
                live["metadata"]["annotations"][APPLIED_HASH].clone();
            s
        }));
        assert!(!up_to_date(&live, &smaller), "a removed field is applied");

        let mut unannotated = live.clone();
        unannotated["metadata"]["annotations"] = json!({});
        assert!(
            !up_to_date(&unannotated, &desired),
            "objects we never applied are applied"
        );
    }

    #[test]
    fn status_only_changes_are_not_changes() {
        let before = json!({
            "metadata": {"name": "a", "resourceVersion": "5", "managedFields": [
                {"manager": "me", "operation": "Apply", "time": "t1"}]},
            "spec": {"x": 1}, "status": {"ready": 0}
        });
        let mut status_moved = before.clone();
        status_moved["metadata"]["resourceVersion"] = json!("6");
        status_moved["status"]["ready"] = json!(1);
        status_moved["metadata"]["managedFields"]
            .as_array_mut()
            .unwrap()
            .push(json!({"manager": "ctrl", "operation": "Update", "subresource": "status"}));
        assert!(!changed(&before, &status_moved, "me"));
        let mut spec_moved = status_moved.clone();
        spec_moved["spec"]["x"] = json!(2);
        assert!(changed(&before, &spec_moved, "me"));
        // Same resourceVersion: nothing was written, whatever the rest says.
        assert!(!changed(&before, &before, "me"));
    }
}
