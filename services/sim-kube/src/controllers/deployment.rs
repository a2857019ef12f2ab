//! The Deployment controller, without ReplicaSets: a Deployment owns its Pods
//! directly, and the `pod-template-hash` label tells the current template's pods
//! from older ones during a rollout (maxSurge / maxUnavailable, or Recreate).

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{condition_true, is_deleting, set_condition, uid, Snapshot};
use crate::ops::{self, DeleteOptions, Writer};
use crate::resources::index_of;
use crate::store::{Key, Store};

const MANAGER: &str = "kube-controller-manager";

pub fn template_hash(template: &Value) -> String {
    let digest = Sha256::digest(serde_json::to_vec(template).expect("json"));
    // Same alphabet the real controller uses for the hash suffix.
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    digest
        .iter()
        .take(10)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

/// Resolves an int-or-percent against `total`.
fn resolve(v: &Value, total: i64, round_up: bool) -> i64 {
    match v {
        Value::Number(n) => n.as_i64().unwrap_or(0),
        Value::String(s) => match s.strip_suffix('%').and_then(|p| p.parse::<f64>().ok()) {
            Some(p) => {
                let x = p * total as f64 / 100.0;
                if round_up {
                    x.ceil() as i64
                } else {
                    x.floor() as i64
                }
            }
            None => s.parse().unwrap_or(0),
        },
        _ => 0,
    }
}

fn ready(pod: &Value) -> bool {
    condition_true(pod, "Ready")
}

fn delete_pod(store: &Store, pod: &Value) {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let _ = ops::delete(
        store,
        index_of("Pod"),
        Some(ns),
        name,
        &DeleteOptions::default(),
    );
}

/// The annotation with which a controller of the pods ranks them for removal (Kubernetes's
/// `PodDeletionCost`, on by default since 1.22): lower goes first; absent or not an int32, 0.
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

fn deletion_cost(pod: &Value) -> i32 {
    pod.pointer("/metadata/annotations")
        .and_then(|a| a.get(POD_DELETION_COST))
        .and_then(Value::as_str)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Order in which to remove pods, as the ReplicaSet controller ranks them
/// (`controller.ActivePodsWithRanks`): unscheduled, then not ready, then the lower
/// [`POD_DELETION_COST`], then newest.
fn deletion_order(pods: &mut [&Value]) {
    pods.sort_by_key(|p| {
        (
            p.pointer("/spec/nodeName").is_some(),
            ready(p),
            deletion_cost(p),
            std::cmp::Reverse(
                p.pointer("/metadata/creationTimestamp")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            ),
        )
    });
}

pub fn run(store: &Store, snap: &Snapshot) {
    for (key, d) in snap.of_kind("Deployment") {
        if is_deleting(d) {
            continue;
        }
        reconcile(store, snap, key, d);
    }
}

fn reconcile(store: &Store, snap: &Snapshot, key: &Key, d: &Value) {
    let duid = uid(d);
    let name = key.name.as_str();
    let spec = &d["spec"];
    let replicas = spec["replicas"].as_i64().unwrap_or(1).max(0);
    let template = &spec["template"];
    let hash = template_hash(template);
    let pods: Vec<&Value> = snap
        .in_namespace("Pod", &key.ns)
        .filter(|(_, p)| {
            !is_deleting(p)
                && p.pointer("/metadata/ownerReferences")
                    .and_then(Value::as_array)
                    .is_some_and(|refs| {
                        refs.iter()
                            .any(|r| r["uid"] == duid.as_str() && r["controller"] == true)
                    })
        })
        .map(|(_, p)| p)
        .collect();
    let (mut new, mut old): (Vec<&Value>, Vec<&Value>) = pods.iter().partition(|p| {
        p.pointer("/metadata/labels/pod-template-hash")
            .and_then(Value::as_str)
            == Some(hash.as_str())
    });
    let recreate = spec.pointer("/strategy/type").and_then(Value::as_str) == Some("Recreate");
    let (surge, unavailable) = if recreate {
        (0, replicas)
    } else {
        let ru = &spec["strategy"]["rollingUpdate"];
        let surge = resolve(ru.get("maxSurge").unwrap_or(&json!("25%")), replicas, true);
        let mut unavailable = resolve(
            ru.get("maxUnavailable").unwrap_or(&json!("25%")),
            replicas,
            false,
        );
        if surge == 0 && unavailable == 0 {
            unavailable = 1;
        }
        (surge, unavailable)
    };
    let min_available = if recreate {
        replicas
    } else {
        (replicas - unavailable).max(0)
    };

    let mut to_create = 0;
    if recreate {
        if !old.is_empty() {
            old.iter().for_each(|p| delete_pod(store, p));
            old.clear();
        } else if (new.len() as i64) < replicas {
            to_create = replicas - new.len() as i64;
        }
    } else {
        let total = (new.len() + old.len()) as i64;
        if (new.len() as i64) < replicas {
            to_create = (replicas + surge - total)
                .max(0)
                .min(replicas - new.len() as i64);
        }
        if !old.is_empty() {
            let new_unavailable = new.iter().filter(|p| !ready(p)).count() as i64;
            let max_scale_down = total - min_available - new_unavailable;
            if max_scale_down > 0 {
                deletion_order(&mut old);
                let mut budget = max_scale_down;
                // Unhealthy old pods first: removing them costs no availability.
                let unhealthy: Vec<&Value> = old.iter().filter(|p| !ready(p)).copied().collect();
                for p in unhealthy.iter().take(budget as usize) {
                    delete_pod(store, p);
                    budget -= 1;
                }
                let available = pods.iter().filter(|p| ready(p)).count() as i64;
                let can_remove = budget.min(available - min_available);
                let healthy: Vec<&Value> = old.iter().filter(|p| ready(p)).copied().collect();
                for p in healthy.iter().take(can_remove.max(0) as usize) {
                    delete_pod(store, p);
                }
            }
        }
    }
    if new.len() as i64 > replicas {
        deletion_order(&mut new);
        let extra = new.len() - replicas as usize;
        new.drain(..extra).for_each(|p| delete_pod(store, p));
    }
    for _ in 0..to_create {
        create_pod(store, key, d, &hash);
    }

    // Status, from the snapshot (the next pass sees this pass's writes).
    let ready_count = pods.iter().filter(|p| ready(p)).count() as i64;
    let updated = pods
        .iter()
        .filter(|p| {
            p.pointer("/metadata/labels/pod-template-hash")
                .and_then(Value::as_str)
                == Some(hash.as_str())
        })
        .count() as i64;
    let total = pods.len() as i64;
    let generation = d["metadata"]["generation"].as_i64().unwrap_or(1);
    let rs_name = format!("{name}-{hash}");
    let complete = updated == replicas && total == replicas && ready_count == replicas;
    ops::mutate_status(store, key, MANAGER, |st| {
        st["observedGeneration"] = json!(generation);
        st["replicas"] = json!(total);
        st["updatedReplicas"] = json!(updated);
        st["readyReplicas"] = json!(ready_count);
        st["availableReplicas"] = json!(ready_count);
        let unavailable_now = replicas.max(total) - ready_count;
        if unavailable_now > 0 {
            st["unavailableReplicas"] = json!(unavailable_now);
        } else if let Some(m) = st.as_object_mut() {
            m.remove("unavailableReplicas");
        }
        let conds = &mut st["conditions"];
        if ready_count >= min_available {
            set_condition(
                conds,
                "Available",
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
                None,
                true,
            );
        } else {
            set_condition(
                conds,
                "Available",
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
                None,
                true,
            );
        }
        if complete {
            set_condition(
                conds,
                "Progressing",
                "True",
                "NewReplicaSetAvailable",
                &format!("ReplicaSet \"{rs_name}\" has successfully progressed."),
                None,
                true,
            );
        } else {
            set_condition(
                conds,
                "Progressing",
                "True",
                "ReplicaSetUpdated",
                &format!("ReplicaSet \"{rs_name}\" is progressing."),
                None,
                true,
            );
        }
    });
}

fn create_pod(store: &Store, key: &Key, d: &Value, hash: &str) {
    let template = &d["spec"]["template"];
    let mut labels = template
        .pointer("/metadata/labels")
        .cloned()
        .unwrap_or(json!({}));
    labels["pod-template-hash"] = json!(hash);
    let mut meta = json!({
        "generateName": format!("{}-{hash}-", key.name),
        "namespace": key.ns,
        "labels": labels,
        "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "Deployment", "name": key.name,
            "uid": uid(d), "controller": true, "blockOwnerDeletion": true
        }],
    });
    if let Some(a) = template.pointer("/metadata/annotations") {
        meta["annotations"] = a.clone();
    }
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": template.get("spec").cloned().unwrap_or(json!({})),
    });
    if let Err(e) = ops::create(
        store,
        index_of("Pod"),
        Some(&key.ns),
        pod,
        &Writer::new(MANAGER),
    ) {
        tracing::warn!(deployment = %key.name, error = %e.message, "pod creation failed");
    }
}
