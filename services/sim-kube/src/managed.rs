//! Server-side apply and `metadata.managedFields`.
//!
//! Approximation of the real field manager: a manager owns a set of leaf paths
//! (maps are walked, lists and scalars are atomic leaves). Apply merges the
//! applied configuration into the live object, removes leaves the same manager
//! applied before and no longer applies (unless someone else owns them), and
//! reports conflicts with other managers whose fields it would change. Because the
//! result is computed deterministically, applying the same configuration twice
//! yields an identical object, which the store then refuses to rewrite.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::resources::ResourceType;

pub type Path = Vec<String>;
pub type FieldSet = BTreeSet<Path>;

/// Which part of an object a request may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The main resource; `status` is excluded when the kind has a status subresource.
    Main { exclude_status: bool },
    /// The `/status` subresource: only `status`.
    Status,
}

impl Scope {
    pub fn for_main(rt: &ResourceType) -> Scope {
        Scope::Main {
            exclude_status: rt.status,
        }
    }
    fn subresource(self) -> Option<&'static str> {
        match self {
            Scope::Main { .. } => None,
            Scope::Status => Some("status"),
        }
    }
}

/// Metadata keys a client owns; everything else in metadata is identity or server state.
const OWNED_METADATA: &[&str] = &["labels", "annotations", "ownerReferences", "finalizers"];

/// Leaf paths of `obj` that `scope` lets a manager own.
pub fn owned_paths(obj: &Value, scope: Scope) -> FieldSet {
    let mut out = FieldSet::new();
    let Some(m) = obj.as_object() else { return out };
    for (k, v) in m {
        let include = match (scope, k.as_str()) {
            (_, "apiVersion" | "kind") => false,
            (Scope::Status, key) => key == "status",
            (Scope::Main { exclude_status }, "status") => !exclude_status,
            (Scope::Main { .. }, "metadata") => {
                if let Some(meta) = v.as_object() {
                    for key in OWNED_METADATA {
                        if let Some(child) = meta.get(*key) {
                            let mut prefix = vec!["metadata".to_string(), key.to_string()];
                            leaves(child, &mut prefix, &mut out);
                        }
                    }
                }
                false
            }
            _ => true,
        };
        if include {
            let mut prefix = vec![k.clone()];
            leaves(v, &mut prefix, &mut out);
        }
    }
    out
}

fn leaves(v: &Value, prefix: &mut Path, out: &mut FieldSet) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, c) in m {
                prefix.push(k.clone());
                leaves(c, prefix, out);
                prefix.pop();
            }
        }
        Value::Null => {}
        _ => {
            out.insert(prefix.clone());
        }
    }
}

pub fn value_at<'a>(v: &'a Value, p: &[String]) -> Option<&'a Value> {
    p.iter().try_fold(v, |cur, k| cur.get(k.as_str()))
}

/// Removes the leaf at `p`, then drops maps left empty by the removal (below the
/// top level), the way the real server prunes a field nobody sets any more.
pub fn remove_at(v: &mut Value, p: &[String]) {
    if p.is_empty() {
        return;
    }
    fn rec(v: &mut Value, p: &[String]) {
        let Some(m) = v.as_object_mut() else { return };
        if p.len() == 1 {
            m.remove(&p[0]);
            return;
        }
        if let Some(child) = m.get_mut(&p[0]) {
            rec(child, &p[1..]);
            if child.as_object().is_some_and(Map::is_empty) {
                m.remove(&p[0]);
            }
        }
    }
    if p.len() == 1 {
        if let Some(m) = v.as_object_mut() {
            m.remove(&p[0]);
        }
        return;
    }
    // Keep top-level maps such as `spec` and `metadata` even if they become empty.
    if let Some(top) = v.get_mut(&p[0]) {
        rec(top, &p[1..]);
    }
}

fn overlaps(a: &[String], b: &[String]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

fn dotted(p: &[String]) -> String {
    p.iter().map(|k| format!(".{k}")).collect()
}

/// Strips `null` values: in an apply configuration they mean "not set".
pub fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, c| !c.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

fn deep_merge(target: &mut Value, src: &Value) {
    match (target, src) {
        (Value::Object(t), Value::Object(s)) => {
            for (k, v) in s {
                match t.get_mut(k) {
                    Some(existing) if existing.is_object() && v.is_object() => {
                        deep_merge(existing, v)
                    }
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, s) => *t = s.clone(),
    }
}

// ---------------------------------------------------------------------------
// managedFields entries

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub manager: String,
    pub operation: String,
    pub api_version: String,
    pub time: Option<String>,
    pub subresource: Option<String>,
    pub fields: FieldSet,
}

fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Value::Object(Map::new());
    for p in set {
        let mut cur = &mut root;
        for k in p {
            cur = cur
                .as_object_mut()
                .expect("fieldsV1 node is a map")
                .entry(format!("f:{k}"))
                .or_insert_with(|| Value::Object(Map::new()));
        }
    }
    // A path that is owned itself and also has owned children is marked with ".".
    fn mark(v: &mut Value, prefix: &mut Path, set: &FieldSet) {
        if let Some(m) = v.as_object_mut() {
            if !m.is_empty() && !prefix.is_empty() && set.contains(prefix) {
                m.insert(".".into(), Value::Object(Map::new()));
            }
            for (k, c) in m.iter_mut() {
                if let Some(name) = k.strip_prefix("f:") {
                    prefix.push(name.to_string());
                    mark(c, prefix, set);
                    prefix.pop();
                }
            }
        }
    }
    mark(&mut root, &mut Vec::new(), set);
    root
}

fn from_fields_v1(v: &Value) -> FieldSet {
    fn rec(v: &Value, prefix: &mut Path, out: &mut FieldSet) {
        let Some(m) = v.as_object() else { return };
        if (m.is_empty() || m.contains_key(".")) && !prefix.is_empty() {
            out.insert(prefix.clone());
        }
        for (k, c) in m {
            if let Some(name) = k.strip_prefix("f:") {
                prefix.push(name.to_string());
                rec(c, prefix, out);
                prefix.pop();
            }
        }
    }
    let mut out = FieldSet::new();
    rec(v, &mut Vec::new(), &mut out);
    out
}

pub fn read_entries(obj: &Value) -> Vec<Entry> {
    obj.pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| Entry {
                    manager: e["manager"].as_str().unwrap_or_default().to_string(),
                    operation: e["operation"].as_str().unwrap_or("Update").to_string(),
                    api_version: e["apiVersion"].as_str().unwrap_or_default().to_string(),
                    time: e["time"].as_str().map(String::from),
                    subresource: e["subresource"].as_str().map(String::from),
                    fields: from_fields_v1(&e["fieldsV1"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn write_entries(obj: &mut Value, entries: &[Entry]) {
    let list: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = serde_json::json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields_v1(&e.fields),
            });
            if let Some(t) = &e.time {
                v["time"] = Value::String(t.clone());
            }
            if let Some(s) = &e.subresource {
                v["subresource"] = Value::String(s.clone());
            }
            v
        })
        .collect();
    let meta = obj
        .as_object_mut()
        .expect("object")
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if list.is_empty() {
        meta.as_object_mut().map(|m| m.remove("managedFields"));
    } else {
        meta["managedFields"] = Value::Array(list);
    }
}

/// Stamps `time` on the entry of `manager`/`operation` after a write that changed something.
pub fn touch(obj: &mut Value, manager: &str, operation: &str, scope: Scope, now: &str) {
    let mut entries = read_entries(obj);
    let sub = scope.subresource().map(String::from);
    for e in entries.iter_mut() {
        if e.manager == manager && e.operation == operation && e.subresource == sub {
            e.time = Some(now.to_string());
        }
    }
    write_entries(obj, &entries);
}

fn in_scope(e: &Entry, scope: Scope) -> bool {
    e.subresource.as_deref() == scope.subresource()
}

/// Server-side apply: computes the object that results from `manager` applying
/// `cfg` over `live` (None: the object does not exist yet). Returns the object with
/// updated managedFields (times untouched; see [`touch`]).
pub fn apply(
    rt: &ResourceType,
    name: &str,
    live: Option<&Value>,
    cfg: &Value,
    manager: &str,
    force: bool,
    scope: Scope,
) -> ApiResult<Value> {
    let mut cfg = cfg.clone();
    strip_nulls(&mut cfg);
    let cfg_paths = owned_paths(&cfg, scope);
    let empty = Value::Object(Map::new());
    let base = live.unwrap_or(&empty);
    let mut entries = read_entries(base);
    let sub = scope.subresource().map(String::from);

    // Conflicts: another manager owns a field this apply would change.
    let mut conflicts = Vec::new();
    for e in entries
        .iter_mut()
        .filter(|e| e.manager != manager && in_scope(e, scope))
    {
        let mut taken = Vec::new();
        for p in &cfg_paths {
            for q in e.fields.iter().filter(|q| overlaps(p, q)) {
                if value_at(base, p) != value_at(&cfg, p) {
                    if force {
                        taken.push(q.clone());
                    } else {
                        conflicts.push((e.manager.clone(), dotted(p)));
                    }
                }
            }
        }
        for q in taken {
            e.fields.remove(&q);
        }
    }
    if !conflicts.is_empty() {
        conflicts.sort();
        conflicts.dedup();
        return Err(ApiError::apply_conflict(rt, name, &conflicts));
    }

    let mut new = base.clone();
    // Fields this manager applied last time but not now: remove them unless
    // someone else still owns them.
    let pos = entries
        .iter()
        .position(|e| e.manager == manager && e.operation == "Apply" && e.subresource == sub);
    if let Some(i) = pos {
        let previous = entries[i].fields.clone();
        for q in previous.difference(&cfg_paths) {
            let still_applied = cfg_paths.iter().any(|p| overlaps(p, q));
            let owned_by_other = entries.iter().enumerate().any(|(j, e)| {
                j != i && in_scope(e, scope) && e.fields.iter().any(|o| overlaps(o, q))
            });
            if !still_applied && !owned_by_other {
                remove_at(&mut new, q);
            }
        }
    }

    // Merge the applied configuration, limited to the scope.
    let mut patch = Map::new();
    if let Some(m) = cfg.as_object() {
        for (k, v) in m {
            match (scope, k.as_str()) {
                (_, "apiVersion" | "kind") => {
                    patch.insert(k.clone(), v.clone());
                }
                (Scope::Status, "status") => {
                    patch.insert(k.clone(), v.clone());
                }
                (Scope::Status, _) => {}
                (
                    Scope::Main {
                        exclude_status: true,
                    },
                    "status",
                ) => {}
                (Scope::Main { .. }, "metadata") => {
                    let mut meta = Map::new();
                    if let Some(mm) = v.as_object() {
                        for key in OWNED_METADATA
                            .iter()
                            .chain(["name", "namespace", "generateName"].iter())
                        {
                            if let Some(x) = mm.get(*key) {
                                meta.insert(key.to_string(), x.clone());
                            }
                        }
                    }
                    patch.insert(k.clone(), Value::Object(meta));
                }
                _ => {
                    patch.insert(k.clone(), v.clone());
                }
            }
        }
    }
    deep_merge(&mut new, &Value::Object(patch));

    let api_version = cfg["apiVersion"].as_str().unwrap_or_default().to_string();
    match pos {
        Some(i) => {
            entries[i].fields = cfg_paths;
            entries[i].api_version = api_version;
        }
        None => entries.push(Entry {
            manager: manager.to_string(),
            operation: "Apply".into(),
            api_version,
            time: None,
            subresource: sub,
            fields: cfg_paths,
        }),
    }
    write_entries(&mut new, &entries);
    Ok(new)
}

/// Records a non-apply write (create, replace, patch) by `manager`: it takes
/// ownership of every field it changed, and fields that disappeared are no longer
/// owned by anyone.
pub fn record_update(old: Option<&Value>, new: &mut Value, manager: &str, scope: Scope) {
    let empty = Value::Object(Map::new());
    let base = old.unwrap_or(&empty);
    let mut entries = read_entries(base);
    let sub = scope.subresource().map(String::from);
    let changed: FieldSet = owned_paths(new, scope)
        .into_iter()
        .filter(|p| value_at(base, p) != value_at(new, p))
        .collect();
    for e in entries.iter_mut() {
        if !in_scope(e, scope) {
            continue;
        }
        let is_self = e.manager == manager && e.operation == "Update";
        e.fields.retain(|q| {
            value_at(new, q).is_some() && (is_self || !changed.iter().any(|p| overlaps(p, q)))
        });
    }
    if !changed.is_empty() {
        let api_version = new["apiVersion"].as_str().unwrap_or_default().to_string();
        match entries
            .iter_mut()
            .find(|e| e.manager == manager && e.operation == "Update" && e.subresource == sub)
        {
            Some(e) => {
                e.fields.extend(changed);
                e.api_version = api_version;
            }
            None => entries.push(Entry {
                manager: manager.to_string(),
                operation: "Update".into(),
                api_version,
                time: None,
                subresource: sub,
                fields: changed,
            }),
        }
    }
    write_entries(new, &entries);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{index_of, TYPES};
    use serde_json::json;

    fn cm() -> &'static ResourceType {
        &TYPES[index_of("ConfigMap")]
    }

    #[test]
    fn fields_v1_round_trip() {
        let obj =
            json!({"metadata": {"labels": {"a": "1"}}, "spec": {"x": {"y": 1}, "l": [1], "e": {}}});
        let set = owned_paths(
            &obj,
            Scope::Main {
                exclude_status: true,
            },
        );
        assert_eq!(from_fields_v1(&to_fields_v1(&set)), set);
        let mut nested = set.clone();
        nested.insert(vec!["spec".into(), "x".into()]);
        assert_eq!(from_fields_v1(&to_fields_v1(&nested)), nested);
    }

    #[test]
    fn apply_is_deterministic_and_removes_dropped_fields() {
        let scope = Scope::Main {
            exclude_status: false,
        };
        let cfg = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"a": "1"}}, "data": {"k": "v", "k2": "v2"}});
        let first = apply(cm(), "c", None, &cfg, "m", false, scope).unwrap();
        let second = apply(cm(), "c", Some(&first), &cfg, "m", false, scope).unwrap();
        assert_eq!(first, second);
        let cfg2 = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}});
        let third = apply(cm(), "c", Some(&second), &cfg2, "m", false, scope).unwrap();
        assert_eq!(third["data"], json!({"k": "v"}));
        assert!(third.pointer("/metadata/labels").is_none());
    }

    #[test]
    fn apply_conflicts_with_other_manager_unless_forced() {
        let scope = Scope::Main {
            exclude_status: false,
        };
        let cfg = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}});
        let first = apply(cm(), "c", None, &cfg, "a", false, scope).unwrap();
        // Same value: shared ownership, no conflict.
        assert!(apply(cm(), "c", Some(&first), &cfg, "b", false, scope).is_ok());
        let other = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "w"}});
        let err = apply(cm(), "c", Some(&first), &other, "b", false, scope).unwrap_err();
        assert_eq!(err.code, 409);
        assert!(err.message.contains(".data.k"), "{}", err.message);
        let forced = apply(cm(), "c", Some(&first), &other, "b", true, scope).unwrap();
        assert_eq!(forced["data"]["k"], "w");
        let owners: Vec<String> = read_entries(&forced)
            .into_iter()
            .map(|e| e.manager)
            .collect();
        assert_eq!(owners, vec!["b".to_string()]);
    }

    #[test]
    fn update_takes_ownership_of_changed_fields() {
        let scope = Scope::Main {
            exclude_status: false,
        };
        let cfg = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v", "j": "1"}});
        let live = apply(cm(), "c", None, &cfg, "a", false, scope).unwrap();
        let mut new = live.clone();
        new["data"]["k"] = json!("changed");
        record_update(Some(&live), &mut new, "editor", scope);
        let entries = read_entries(&new);
        let a = entries.iter().find(|e| e.manager == "a").unwrap();
        assert!(!a
            .fields
            .contains(&vec!["data".to_string(), "k".to_string()]));
        let ed = entries.iter().find(|e| e.manager == "editor").unwrap();
        assert!(ed
            .fields
            .contains(&vec!["data".to_string(), "k".to_string()]));
    }
}
