//! Garbage collection: namespace termination, ownerReference cascades
//! (background, foreground, orphan) and pods left on deleted nodes.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::{is_deleting, uid, Snapshot};
use crate::managed::Scope;
use crate::ops::{self, DeleteOptions};
use crate::resources::{NAMESPACE, TYPES};
use crate::store::{Key, Store};

const MANAGER: &str = "kube-controller-manager";

fn has_finalizer(obj: &Value, f: &str) -> bool {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|x| x == f))
}

fn remove_finalizer(store: &Store, key: &Key, f: &str) {
    ops::mutate(store, key, Scope::for_main(&TYPES[key.rt]), MANAGER, |o| {
        if let Some(a) = o
            .pointer_mut("/metadata/finalizers")
            .and_then(Value::as_array_mut)
        {
            a.retain(|x| x != f);
        }
    });
}

fn delete(store: &Store, key: &Key) {
    let ns = (!key.ns.is_empty()).then_some(key.ns.as_str());
    let _ = ops::delete(store, key.rt, ns, &key.name, &DeleteOptions::default());
}

pub fn run(store: &Store, snap: &Snapshot) {
    // Namespaces being deleted: empty them, then release the namespace.
    for (nskey, nsobj) in snap.of_kind("Namespace") {
        if !is_deleting(nsobj) {
            continue;
        }
        let mut remaining = 0;
        let namespaced = (0..TYPES.len()).filter(|&rt| TYPES[rt].namespaced);
        for (k, o) in namespaced.flat_map(|rt| snap.of_type_in(rt, &nskey.name)) {
            remaining += 1;
            if !is_deleting(o) {
                delete(store, k);
            }
        }
        if remaining == 0 {
            ops::mutate(
                store,
                &Key::new(NAMESPACE, "", &nskey.name),
                Scope::Status,
                MANAGER,
                |n| {
                    n["status"]["phase"] = json!("Terminating");
                },
            );
            ops::mutate(
                store,
                &Key::new(NAMESPACE, "", &nskey.name),
                Scope::for_main(&TYPES[NAMESPACE]),
                MANAGER,
                |n| {
                    n["spec"]["finalizers"] = json!([]);
                },
            );
        }
    }

    // Owner references, by uid.
    let by_uid: HashMap<String, (&Key, &Value)> =
        snap.all().map(|(k, o)| (uid(o), (k, o))).collect();
    let mut dependents: HashMap<String, usize> = HashMap::new();
    for (k, o) in snap.all() {
        let Some(refs) = o
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
        else {
            continue;
        };
        if refs.is_empty() {
            continue;
        }
        for r in refs {
            let ouid = r["uid"].as_str().unwrap_or_default();
            let Some((_, owner)) = by_uid.get(ouid) else {
                continue;
            };
            *dependents.entry(ouid.to_string()).or_default() += 1;
            if !is_deleting(owner) {
                continue;
            }
            if has_finalizer(owner, "orphan") {
                let ouid = ouid.to_string();
                ops::mutate(store, k, Scope::for_main(&TYPES[k.rt]), MANAGER, |d| {
                    if let Some(a) = d
                        .pointer_mut("/metadata/ownerReferences")
                        .and_then(Value::as_array_mut)
                    {
                        a.retain(|r| r["uid"] != ouid.as_str());
                    }
                });
            } else if has_finalizer(owner, "foregroundDeletion") && !is_deleting(o) {
                let opts = DeleteOptions {
                    propagation: Some("Foreground".into()),
                    ..Default::default()
                };
                let _ = ops::delete(
                    store,
                    k.rt,
                    (!k.ns.is_empty()).then_some(k.ns.as_str()),
                    &k.name,
                    &opts,
                );
            }
        }
        // Background: the dependent goes once every owner is gone.
        let all_gone = refs
            .iter()
            .all(|r| !by_uid.contains_key(r["uid"].as_str().unwrap_or_default()));
        if all_gone && !is_deleting(o) {
            delete(store, k);
        }
    }
    // Owners waiting on dependents.
    for (k, o) in snap.all() {
        if !is_deleting(o) || dependents.contains_key(&uid(o)) {
            continue;
        }
        for f in ["orphan", "foregroundDeletion"] {
            if has_finalizer(o, f) {
                remove_finalizer(store, k, f);
            }
        }
    }

    // Pods bound to nodes that no longer exist.
    for (k, pod) in snap.of_kind("Pod") {
        let node = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !node.is_empty() && snap.get("Node", "", node).is_none() && !is_deleting(pod) {
            delete(store, k);
        }
    }
}
