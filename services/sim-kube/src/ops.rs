//! Write operations shared by the HTTP handlers and the built-in controllers:
//! create, replace, patch (merge, JSON, apply) and delete, with the identity,
//! status-isolation, defaulting, validation and managed-field rules around them.

use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::managed::{self, Scope};
use crate::resources::{ResourceType, NAMESPACE, TYPES};
use crate::store::{meta_str, now_rfc3339, Inner, Key, Store};
use crate::validation;

/// The result of a write: the object as stored (or as it would be, for dry runs)
/// and whether anything changed.
#[derive(Debug)]
pub struct Outcome {
    pub object: Value,
    pub changed: bool,
    /// The object is gone (deleted immediately).
    pub removed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Json,
    Apply,
}

/// Who is writing: the field manager name and whether to skip persistence.
#[derive(Debug, Clone)]
pub struct Writer {
    pub manager: String,
    pub dry_run: bool,
}

impl Writer {
    pub fn new(manager: &str) -> Writer {
        Writer {
            manager: manager.to_string(),
            dry_run: false,
        }
    }
}

const SERVER_METADATA: &[&str] = &[
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "managedFields",
    "selfLink",
];

/// Checks that a request body is an object of the URL's kind in the URL's
/// namespace (and with the URL's name, when there is one), filling gaps.
fn check_body(
    rt: &ResourceType,
    ns: Option<&str>,
    name: Option<&str>,
    body: &mut Value,
) -> ApiResult<()> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    }
    let api_version = rt.api_version();
    match body.get("apiVersion").and_then(Value::as_str) {
        None | Some("") => body["apiVersion"] = json!(api_version),
        Some(v) if v != api_version => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({v}) does not match the expected API version ({api_version})"
            )))
        }
        _ => {}
    }
    match body.get("kind").and_then(Value::as_str) {
        None | Some("") => body["kind"] = json!(rt.kind),
        Some(k) if k != rt.kind => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                rt.kind
            )))
        }
        _ => {}
    }
    if !body.get("metadata").is_some_and(Value::is_object) {
        body["metadata"] = json!({});
    }
    let meta = &mut body["metadata"];
    if rt.namespaced {
        let url_ns = ns.unwrap_or_default();
        match meta.get("namespace").and_then(Value::as_str) {
            Some(b) if !b.is_empty() && b != url_ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ))
            }
            _ => meta["namespace"] = json!(url_ns),
        }
    } else if let Some(m) = meta.as_object_mut() {
        m.remove("namespace");
    }
    if let Some(url_name) = name {
        match meta.get("name").and_then(Value::as_str) {
            Some(b) if !b.is_empty() && b != url_name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({b}) does not match the name on the URL ({url_name})"
                )))
            }
            _ => meta["name"] = json!(url_name),
        }
    }
    Ok(())
}

fn namespace_check(inner: &Inner, rt: &ResourceType, ns: &str, name: &str) -> ApiResult<()> {
    if !rt.namespaced {
        return Ok(());
    }
    let Some(nsobj) = inner.get(&Key::new(NAMESPACE, "", ns)) else {
        return Err(ApiError::namespace_not_found(ns));
    };
    if nsobj.pointer("/metadata/deletionTimestamp").is_some() {
        return Err(ApiError::forbidden(format!(
            "{} \"{name}\" is forbidden: unable to create new content in namespace {ns} because it is being terminated",
            rt.qualified()
        )));
    }
    Ok(())
}

fn random_suffix(n: usize) -> String {
    use rand::Rng;
    // The alphabet the real server uses for generated names (no vowels, no
    // look-alike characters).
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::thread_rng();
    (0..n)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect()
}

pub fn create(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    mut body: Value,
    w: &Writer,
) -> ApiResult<Outcome> {
    let rt = &TYPES[rti];
    check_body(rt, ns, None, &mut body)?;
    let mut inner = store.lock();
    if meta_str(&body, "name").is_empty() {
        let generate = meta_str(&body, "generateName").to_string();
        if !generate.is_empty() {
            loop {
                let candidate = format!("{generate}{}", random_suffix(5));
                if inner
                    .get(&Key::new(rti, ns.unwrap_or(""), &candidate))
                    .is_none()
                {
                    body["metadata"]["name"] = json!(candidate);
                    break;
                }
            }
        }
    }
    let name = meta_str(&body, "name").to_string();
    if name.is_empty() {
        return Err(ApiError::invalid(
            rt,
            "",
            vec![crate::error::Cause::required("metadata.name")],
        ));
    }
    namespace_check(&inner, rt, ns.unwrap_or_default(), &name)?;
    let key = Key::of(rti, &body);
    if inner.get(&key).is_some() {
        return Err(ApiError::already_exists(rt, &name));
    }
    if let Some(m) = body["metadata"].as_object_mut() {
        for k in SERVER_METADATA {
            m.remove(*k);
        }
    }
    if rt.status && rt.kind != "Node" {
        body.as_object_mut().map(|m| m.remove("status"));
    }
    // kube-apiserver's pod strategy (`PrepareForCreate`) starts every Pod Pending, with its QoS
    // class; the scheduler and the kubelet write the rest.
    if rt.kind == "Pod" {
        body["status"] = json!({"phase": "Pending", "qosClass": qos_class(&body)});
    }
    body["metadata"]["uid"] = json!(uuid::Uuid::new_v4().to_string());
    body["metadata"]["creationTimestamp"] = json!(now_rfc3339());
    if body.get("spec").is_some() {
        body["metadata"]["generation"] = json!(1);
    }
    if rt.kind == "Service" {
        assign_cluster_ip(store, &mut body);
    }
    validation::default(rt, &mut body);
    let causes = validation::validate(rt, &body, None);
    if !causes.is_empty() {
        return Err(ApiError::invalid(rt, &name, causes));
    }
    managed::record_update(None, &mut body, &w.manager, Scope::for_main(rt));
    managed::touch(
        &mut body,
        &w.manager,
        "Update",
        Scope::for_main(rt),
        &now_rfc3339(),
    );
    let object = if w.dry_run {
        body
    } else {
        store.commit(&mut inner, rti, body)
    };
    Ok(Outcome {
        object,
        changed: true,
        removed: false,
    })
}

/// The QoS class kube-apiserver gives a Pod (`GetPodQOS`): BestEffort when no container
/// requests or limits CPU or memory, Guaranteed when every container limits both and requests
/// what it limits (a request left out defaults to the limit), Burstable otherwise. Quantities
/// are compared as written.
fn qos_class(pod: &Value) -> &'static str {
    let (mut any, mut guaranteed) = (false, true);
    for list in ["containers", "initContainers"] {
        for c in pod["spec"][list].as_array().into_iter().flatten() {
            for resource in ["cpu", "memory"] {
                let limit = c["resources"]["limits"].get(resource);
                let request = c["resources"]["requests"].get(resource).or(limit);
                any |= request.is_some();
                guaranteed &= limit.is_some() && request == limit;
            }
        }
    }
    match (any, guaranteed) {
        (false, _) => "BestEffort",
        (true, true) => "Guaranteed",
        (true, false) => "Burstable",
    }
}

fn assign_cluster_ip(store: &Store, svc: &mut Value) {
    if svc.pointer("/spec/type").and_then(Value::as_str) == Some("ExternalName") {
        return;
    }
    let current = svc
        .pointer("/spec/clusterIP")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if current.is_empty() {
        let n = store.next_seq();
        let ip = format!("10.96.{}.{}", (n / 250) % 250, n % 250 + 2);
        svc["spec"]["clusterIP"] = json!(ip);
        svc["spec"]["clusterIPs"] = json!([ip]);
    }
}

/// Whether a deleted object may disappear now (no finalizers left).
fn finalizers_done(obj: &Value) -> bool {
    let none = |p: &str| {
        obj.pointer(p)
            .and_then(Value::as_array)
            .is_none_or(|a| a.is_empty())
    };
    none("/metadata/finalizers") && (obj["kind"] != "Namespace" || none("/spec/finalizers"))
}

/// Common tail of every update: keeps identity and out-of-scope parts from
/// `old`, defaults, validates, tracks managed fields, and stores the object only
/// if something changed.
#[allow(clippy::too_many_arguments)]
fn finish_update(
    store: &Store,
    inner: &mut Inner,
    rti: usize,
    old: &Value,
    mut new: Value,
    scope: Scope,
    operation: &str,
    w: &Writer,
) -> ApiResult<Outcome> {
    let rt = &TYPES[rti];
    let name = meta_str(old, "name").to_string();
    if scope == Scope::Status {
        let status = new.get("status").cloned();
        let managed_fields = new.pointer("/metadata/managedFields").cloned();
        new = old.clone();
        match status {
            Some(s) => new["status"] = s,
            None => {
                new.as_object_mut().map(|m| m.remove("status"));
            }
        }
        if operation == "Apply" {
            match managed_fields {
                Some(mf) => new["metadata"]["managedFields"] = mf,
                None => {
                    new["metadata"]
                        .as_object_mut()
                        .map(|m| m.remove("managedFields"));
                }
            }
        }
    } else {
        for k in SERVER_METADATA
            .iter()
            .filter(|k| **k != "managedFields" || operation != "Apply")
        {
            match old["metadata"].get(*k) {
                Some(v) => new["metadata"][*k] = v.clone(),
                None => {
                    new["metadata"].as_object_mut().map(|m| m.remove(*k));
                }
            }
        }
        if rt.status {
            match old.get("status") {
                Some(s) => new["status"] = s.clone(),
                None => {
                    new.as_object_mut().map(|m| m.remove("status"));
                }
            }
        }
        if rt.kind == "Service" && new.pointer("/spec/clusterIP").is_none() {
            if let Some(ip) = old.pointer("/spec/clusterIP") {
                new["spec"]["clusterIP"] = ip.clone();
                new["spec"]["clusterIPs"] = old
                    .pointer("/spec/clusterIPs")
                    .cloned()
                    .unwrap_or(json!([ip]));
            }
        }
    }
    validation::default(rt, &mut new);
    let causes = validation::validate(rt, &new, Some(old));
    if !causes.is_empty() {
        return Err(ApiError::invalid(rt, &name, causes));
    }
    if operation != "Apply" {
        managed::record_update(Some(old), &mut new, &w.manager, scope);
    }
    if &new == old {
        return Ok(Outcome {
            object: old.clone(),
            changed: false,
            removed: false,
        });
    }
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(m) = v.as_object_mut() {
            m.remove("metadata");
            m.remove("status");
        }
        v
    };
    if strip(&new) != strip(old) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
        new["metadata"]["generation"] = json!(generation);
    }
    managed::touch(&mut new, &w.manager, operation, scope, &now_rfc3339());
    if w.dry_run {
        return Ok(Outcome {
            object: new,
            changed: true,
            removed: false,
        });
    }
    if new.pointer("/metadata/deletionTimestamp").is_some() && finalizers_done(&new) {
        let key = Key::of(rti, old);
        let object = store.remove(inner, &key).unwrap_or(new);
        return Ok(Outcome {
            object,
            changed: true,
            removed: true,
        });
    }
    Ok(Outcome {
        object: store.commit(inner, rti, new),
        changed: true,
        removed: false,
    })
}

fn get_live(inner: &Inner, rti: usize, ns: Option<&str>, name: &str) -> ApiResult<Value> {
    inner
        .get(&Key::new(rti, ns.unwrap_or(""), name))
        .map(std::sync::Arc::unwrap_or_clone)
        .ok_or_else(|| ApiError::not_found(&TYPES[rti], name))
}

/// PUT: replaces the object (or its status), with optimistic concurrency when the
/// body carries `metadata.resourceVersion`.
pub fn replace(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    name: &str,
    mut body: Value,
    scope: Scope,
    w: &Writer,
) -> ApiResult<Outcome> {
    let rt = &TYPES[rti];
    check_body(rt, ns, Some(name), &mut body)?;
    let mut inner = store.lock();
    let old = get_live(&inner, rti, ns, name)?;
    let sent_rv = meta_str(&body, "resourceVersion");
    if !sent_rv.is_empty() && sent_rv != meta_str(&old, "resourceVersion") {
        return Err(ApiError::stale(rt, name));
    }
    if let Some(uid) = body.pointer("/metadata/uid").and_then(Value::as_str) {
        if !uid.is_empty() && uid != meta_str(&old, "uid") {
            return Err(ApiError::conflict(
                rt,
                name,
                "Precondition failed: UID in precondition does not match UID in object",
            ));
        }
    }
    body["metadata"]["managedFields"] = old["metadata"]["managedFields"].clone();
    finish_update(store, &mut inner, rti, &old, body, scope, "Update", w)
}

/// PATCH in any of the supported flavours. Apply creates the object when missing.
#[allow(clippy::too_many_arguments)]
pub fn patch(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    name: &str,
    kind: PatchKind,
    body: Value,
    force: bool,
    scope: Scope,
    w: &Writer,
) -> ApiResult<Outcome> {
    let rt = &TYPES[rti];
    let mut inner = store.lock();
    let live = inner
        .get(&Key::new(rti, ns.unwrap_or(""), name))
        .map(std::sync::Arc::unwrap_or_clone);
    match kind {
        PatchKind::Apply => {
            let mut cfg = body;
            check_body(rt, ns, Some(name), &mut cfg)?;
            match live {
                None => {
                    if scope == Scope::Status {
                        return Err(ApiError::not_found(rt, name));
                    }
                    drop(inner);
                    let applied = managed::apply(rt, name, None, &cfg, &w.manager, force, scope)?;
                    create_applied(store, rti, ns, applied, w)
                }
                Some(old) => {
                    let new = managed::apply(rt, name, Some(&old), &cfg, &w.manager, force, scope)?;
                    finish_update(store, &mut inner, rti, &old, new, scope, "Apply", w)
                }
            }
        }
        PatchKind::Merge | PatchKind::Json => {
            let old = live.ok_or_else(|| ApiError::not_found(rt, name))?;
            let mut new = old.clone();
            if kind == PatchKind::Merge {
                if !body.is_object() {
                    return Err(ApiError::bad_request(
                        "merge patch body must be a JSON object",
                    ));
                }
                crate::patch::merge_patch(&mut new, &body);
            } else {
                crate::patch::json_patch(&mut new, &body)?;
            }
            let sent_rv = meta_str(&new, "resourceVersion");
            if !sent_rv.is_empty() && sent_rv != meta_str(&old, "resourceVersion") {
                return Err(ApiError::stale(rt, name));
            }
            check_body(rt, ns, Some(name), &mut new)?;
            new["metadata"]["managedFields"] = old["metadata"]["managedFields"].clone();
            finish_update(store, &mut inner, rti, &old, new, scope, "Update", w)
        }
    }
}

/// Create path for an apply of a missing object: managed fields come from the
/// apply, not from an Update entry.
fn create_applied(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    applied: Value,
    w: &Writer,
) -> ApiResult<Outcome> {
    let managed_fields = applied.pointer("/metadata/managedFields").cloned();
    let mut out = create(
        store,
        rti,
        ns,
        applied,
        &Writer {
            manager: String::new(),
            dry_run: true,
        },
    )?;
    let mut obj = out.object;
    match managed_fields {
        Some(mf) => obj["metadata"]["managedFields"] = mf,
        None => {
            obj["metadata"]
                .as_object_mut()
                .map(|m| m.remove("managedFields"));
        }
    }
    managed::touch(
        &mut obj,
        &w.manager,
        "Apply",
        Scope::for_main(&TYPES[rti]),
        &now_rfc3339(),
    );
    if w.dry_run {
        out.object = obj;
        return Ok(out);
    }
    let mut inner = store.lock();
    // Re-check under the lock: another writer may have created it meanwhile.
    if inner.get(&Key::of(rti, &obj)).is_some() {
        return Err(ApiError::already_exists(
            &TYPES[rti],
            meta_str(&obj, "name"),
        ));
    }
    out.object = store.commit(&mut inner, rti, obj);
    Ok(out)
}

#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub propagation: Option<String>,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub dry_run: bool,
}

/// DELETE: objects with finalizers (or a propagation policy that needs the
/// garbage collector) get a deletionTimestamp and stay; others go at once.
pub fn delete(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    name: &str,
    opts: &DeleteOptions,
) -> ApiResult<Outcome> {
    let rt = &TYPES[rti];
    let mut inner = store.lock();
    let old = get_live(&inner, rti, ns, name)?;
    if opts
        .uid
        .as_deref()
        .is_some_and(|u| u != meta_str(&old, "uid"))
    {
        return Err(ApiError::conflict(
            rt,
            name,
            "Precondition failed: UID in precondition does not match UID in object",
        ));
    }
    if opts
        .resource_version
        .as_deref()
        .is_some_and(|v| v != meta_str(&old, "resourceVersion"))
    {
        return Err(ApiError::conflict(rt, name, "Precondition failed: ResourceVersion in precondition does not match ResourceVersion in object"));
    }
    let mut new = old.clone();
    let finalizer = match opts.propagation.as_deref() {
        Some("Foreground") => Some("foregroundDeletion"),
        Some("Orphan") => Some("orphan"),
        Some("Background") | None => None,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "invalid propagationPolicy {other:?}: must be Orphan, Foreground or Background"
            )))
        }
    };
    if old.pointer("/metadata/deletionTimestamp").is_some() {
        if let Some(f) = finalizer {
            add_finalizer(&mut new, f);
        }
        if new == old || opts.dry_run {
            return Ok(Outcome {
                object: old,
                changed: false,
                removed: false,
            });
        }
        let object = store.commit(&mut inner, rti, new);
        return Ok(Outcome {
            object,
            changed: true,
            removed: false,
        });
    }
    if let Some(f) = finalizer {
        add_finalizer(&mut new, f);
    }
    if finalizers_done(&new) {
        if opts.dry_run {
            return Ok(Outcome {
                object: old,
                changed: true,
                removed: true,
            });
        }
        let object = store.remove(&mut inner, &Key::of(rti, &old)).unwrap_or(old);
        return Ok(Outcome {
            object,
            changed: true,
            removed: true,
        });
    }
    new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
    new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
    if rt.kind == "Namespace" {
        new["status"]["phase"] = json!("Terminating");
    }
    if opts.dry_run {
        return Ok(Outcome {
            object: new,
            changed: true,
            removed: false,
        });
    }
    let object = store.commit(&mut inner, rti, new);
    Ok(Outcome {
        object,
        changed: true,
        removed: false,
    })
}

fn add_finalizer(obj: &mut Value, f: &str) {
    let list = &mut obj["metadata"]["finalizers"];
    if !list.is_array() {
        *list = json!([]);
    }
    let arr = list.as_array_mut().expect("array");
    if !arr.iter().any(|x| x == f) {
        arr.push(json!(f));
    }
}

/// As [`mutate`] in the status scope, for edits that read and write nothing but `status` (`f`
/// gets the status itself, null when there is none). Only the status is copied and compared, so
/// the controllers' every-pass status refresh costs little when nothing changed.
pub fn mutate_status(
    store: &Store,
    key: &Key,
    manager: &str,
    f: impl FnOnce(&mut Value),
) -> Option<Value> {
    let mut inner = store.lock();
    let old = inner.get(key)?;
    let before = old.get("status").unwrap_or(&Value::Null);
    let mut status = before.clone();
    f(&mut status);
    if status == *before {
        return None;
    }
    let mut new = old.as_ref().clone();
    new["status"] = status;
    store_edit(store, &mut inner, key, &old, new, Scope::Status, manager)
}

/// Applies `f` to the current state of an object under the store lock and stores
/// the result if it differs (used by controllers, which must never clobber a
/// concurrent client write with a stale copy).
pub fn mutate(
    store: &Store,
    key: &Key,
    scope: Scope,
    manager: &str,
    f: impl FnOnce(&mut Value),
) -> Option<Value> {
    let mut inner = store.lock();
    // The stored object is shared: one copy to edit, none to compare against.
    let old = inner.get(key)?;
    let mut new = old.as_ref().clone();
    f(&mut new);
    if new == *old {
        return None;
    }
    store_edit(store, &mut inner, key, &old, new, scope, manager)
}

/// Stores a controller's edit of `old` as an update by `manager`; the stored object when it
/// changed.
fn store_edit(
    store: &Store,
    inner: &mut Inner,
    key: &Key,
    old: &Value,
    new: Value,
    scope: Scope,
    manager: &str,
) -> Option<Value> {
    finish_update(
        store,
        inner,
        key.rt,
        old,
        new,
        scope,
        "Update",
        &Writer::new(manager),
    )
    .ok()
    .filter(|o| o.changed)
    .map(|o| o.object)
}
