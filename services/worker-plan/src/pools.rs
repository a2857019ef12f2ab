//! The DigitalOcean GPU node pools of one DI: one per model deployment, compared with what
//! exists.
//!
//! Sizing: `count = scale` in the steady state. While a model's vLLM Deployment rolls out to a
//! new pod template (see [`super::readiness::rollouts`]) its pool gets one spare node
//! (`scale + 1`) for the surge pod, because every pod takes a whole node and the Deployment
//! never removes an old pod before a new one is ready — unless every old pod runs on another
//! pool of the model (a GPU size change), which then holds them. Afterwards the pool shrinks by
//! deleting idle nodes by id, never a node that still runs a model server, and never while a
//! model server may still be placed on the pool (see [`super::readiness::awaited_pools`]): an
//! idle node can be the one the scheduler is about to give a waiting pod. A pool no longer
//! wanted goes once none of its nodes runs a pod and its model is not moving off it.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::model::Model;
use super::names;
use super::readiness::Rollouts;

/// A node pool this DI should have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredPool {
    pub name: String,
    pub model_id: Uuid,
    /// The Droplet size: the accelerator slug.
    pub size: String,
    pub count: u32,
    pub labels: BTreeMap<String, String>,
    pub tags: Vec<String>,
}

/// A node pool as the DO API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedPool {
    pub id: String,
    pub name: String,
    pub size: String,
    pub count: u32,
    pub labels: BTreeMap<String, String>,
    /// The pool's nodes. Empty means "not known": shrinking then falls back to a resize.
    pub nodes: Vec<ObservedNode>,
}

/// A node of a pool, joined with the cluster's pods by the worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedNode {
    /// The DO node id (what `DELETE …/nodes/{node_id}` takes).
    pub id: String,
    /// The Kubernetes Node name.
    pub name: String,
    /// Runs a pod that is not finished (see [`super::readiness::busy_nodes`]).
    pub busy: bool,
}

/// What to do to DigitalOcean. Execute in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolAction {
    /// `POST /v2/kubernetes/clusters/{id}/node_pools`.
    Create(DesiredPool),
    /// `PUT …/node_pools/{pool_id}` with `name` and the new `count`.
    Resize {
        pool_id: String,
        name: String,
        count: u32,
    },
    /// `DELETE …/node_pools/{pool_id}/nodes/{node_id}?replace=0`: remove one idle node (and
    /// decrement the pool's count).
    DeleteNode { pool_id: String, node_id: String },
    /// `DELETE …/node_pools/{pool_id}`.
    Delete { pool_id: String, name: String },
}

fn belongs_to(di_id: &Uuid, p: &ObservedPool) -> bool {
    p.labels.get(names::DI_ID_LABEL) == Some(&di_id.to_string())
}

/// The pools `models` need. `rolling_out` holds the model ids whose vLLM Deployment is
/// replacing pods, with the nodes of their old pods; such a model's pool gets one spare node
/// unless older pools of the same model (other sizes) hold every old pod. An older pool that
/// merely still exists is not enough: after a size change and back, the old pods can be on
/// this very pool, and without the spare node the rollout would wait forever.
pub fn desired_pools(
    di_id: &Uuid,
    models: &[Model],
    rolling_out: &Rollouts,
    existing: &[ObservedPool],
) -> Vec<DesiredPool> {
    models
        .iter()
        .map(|m| {
            let name = names::node_pool(di_id, &m.model_id, &m.accelerator_slug);
            let older_pools: Vec<&ObservedPool> = existing
                .iter()
                .filter(|p| {
                    belongs_to(di_id, p)
                        && p.name != name
                        && p.labels.get(names::MODEL_ID_LABEL) == Some(&m.model_id.to_string())
                })
                .collect();
            let held_elsewhere = |old_nodes: &BTreeSet<String>| {
                !older_pools.is_empty()
                    && old_nodes.iter().all(|n| {
                        older_pools
                            .iter()
                            .any(|p| p.nodes.iter().any(|node| &node.name == n))
                    })
            };
            let surge = m.scale > 0
                && rolling_out
                    .get(&m.model_id)
                    .is_some_and(|old_nodes| !held_elsewhere(old_nodes));
            let labels = BTreeMap::from([
                (names::DI_ID_LABEL.to_string(), di_id.to_string()),
                (names::MODEL_ID_LABEL.to_string(), m.model_id.to_string()),
                (
                    names::MANAGED_BY_LABEL.to_string(),
                    names::MANAGED_BY.to_string(),
                ),
            ]);
            DesiredPool {
                name,
                model_id: m.model_id,
                size: m.accelerator_slug.clone(),
                count: m.scale + u32::from(surge),
                labels,
                tags: names::node_pool_tags(di_id, &m.model_id),
            }
        })
        .collect()
}

/// What to do to the DI's node pools, and what is held back for now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolPlan {
    /// Execute in the order given.
    pub actions: Vec<PoolAction>,
    /// Shrinks and deletions that wait for pods (to be placed, or to leave), in words: a pass
    /// that holds one back is not done with the pools.
    pub held: Vec<String>,
}

/// Compares the desired pools with the cluster's pools (all of them: pools of other DIs are
/// recognised by their `dedicated-inference.dev/id` label and left alone) and returns the
/// actions: creates, grows, idle-node deletions, then pool deletions. `awaited` names the pools
/// a model server may still be placed on (see [`super::readiness::awaited_pools`]): they do
/// not shrink. An unchanged spec gives no actions.
pub fn node_pools(
    di_id: &Uuid,
    models: &[Model],
    rolling_out: &Rollouts,
    existing: &[ObservedPool],
    awaited: &BTreeSet<String>,
) -> PoolPlan {
    let desired = desired_pools(di_id, models, rolling_out, existing);
    let ours: Vec<&ObservedPool> = existing.iter().filter(|p| belongs_to(di_id, p)).collect();
    let (mut creates, mut resizes, mut node_deletes, mut deletes) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut held = Vec::new();
    for d in &desired {
        let Some(p) = ours.iter().find(|p| p.name == d.name) else {
            creates.push(PoolAction::Create(d.clone()));
            continue;
        };
        if d.count > p.count {
            resizes.push(PoolAction::Resize {
                pool_id: p.id.clone(),
                name: p.name.clone(),
                count: d.count,
            });
        } else if d.count < p.count && awaited.contains(&p.name) {
            held.push(format!(
                "node pool {}: {} of {} nodes to remove once its model servers are placed",
                p.name,
                p.count - d.count,
                p.count
            ));
        } else if d.count < p.count && p.nodes.is_empty() {
            resizes.push(PoolAction::Resize {
                pool_id: p.id.clone(),
                name: p.name.clone(),
                count: d.count,
            });
        } else if d.count < p.count {
            // Only idle nodes go; busy ones are waited for (their pods are being scaled away).
            let mut idle: Vec<&ObservedNode> = p.nodes.iter().filter(|n| !n.busy).collect();
            idle.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.id.cmp(&b.id)));
            let excess = (p.count - d.count) as usize;
            if idle.len() < excess {
                held.push(format!(
                    "node pool {}: {} of {} nodes to remove once their pods have left",
                    p.name,
                    excess - idle.len(),
                    p.count
                ));
            }
            node_deletes.extend(
                idle.into_iter()
                    .take(excess)
                    .map(|n| PoolAction::DeleteNode {
                        pool_id: p.id.clone(),
                        node_id: n.id.clone(),
                    }),
            );
        }
    }
    let wanted: BTreeSet<&str> = desired.iter().map(|d| d.name.as_str()).collect();
    let mut stale: Vec<&&ObservedPool> = ours
        .iter()
        .filter(|p| !wanted.contains(p.name.as_str()))
        .collect();
    stale.sort_by(|a, b| a.name.cmp(&b.name));
    for p in stale {
        // A pool of a model whose pods are moving to a pool of another size stays until the
        // rollout is over.
        let model = p.labels.get(names::MODEL_ID_LABEL);
        let moving = models.iter().any(|m| {
            Some(&m.model_id.to_string()) == model && rolling_out.contains_key(&m.model_id)
        });
        if moving {
            continue;
        }
        // Its pods leave first (a removed model's are being deleted with their Deployment):
        // a pool deleted under them would cut their requests short.
        if awaited.contains(&p.name) || p.nodes.iter().any(|n| n.busy) {
            held.push(format!(
                "node pool {}: no longer used, waiting for its pods to leave",
                p.name
            ));
            continue;
        }
        deletes.push(PoolAction::Delete {
            pool_id: p.id.clone(),
            name: p.name.clone(),
        });
    }
    PoolPlan {
        actions: creates
            .into_iter()
            .chain(resizes)
            .chain(node_deletes)
            .chain(deletes)
            .collect(),
        held,
    }
}

/// Whether the DI's Kubernetes Nodes (in `observed`) already show exactly the pools `models`
/// need at their steady-state size: `scale` Ready nodes of the planned pool name and size per
/// model, and no other node labelled with the DI. A resync of such a DI can skip reading the
/// pools from DigitalOcean, since a pool deleted, resized or replaced there changes the Nodes.
pub fn nodes_match(di_id: &Uuid, models: &[Model], observed: &[serde_json::Value]) -> bool {
    let nodes = super::readiness::accelerators(di_id, observed);
    let mut want: BTreeMap<(String, &str), u32> = BTreeMap::new();
    for m in models.iter().filter(|m| m.scale > 0) {
        let name = names::node_pool(di_id, &m.model_id, &m.accelerator_slug);
        *want.entry((name, m.accelerator_slug.as_str())).or_default() += m.scale;
    }
    let mut have: BTreeMap<(String, &str), u32> = BTreeMap::new();
    for n in &nodes {
        if n.status != "active" {
            return false;
        }
        *have.entry((n.pool.clone(), n.slug.as_str())).or_default() += 1;
    }
    want == have
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{models, tests::deployment};

    const DI: &str = "0d1e2f3a-0000-4000-8000-00000000d1d1";
    const M1: &str = "aaaaaaaa-0000-4000-8000-000000000001";
    const M2: &str = "bbbbbbbb-0000-4000-8000-000000000002";

    fn di() -> Uuid {
        DI.parse().unwrap()
    }

    fn id(s: &str) -> Uuid {
        s.parse().unwrap()
    }

    fn spec(scale1: i32, with_second: bool) -> Vec<Model> {
        let mut mds = vec![deployment(M1, "org/a", "gpu-h100x1-80gb", scale1)];
        if with_second {
            mds.push(deployment(M2, "org/b", "gpu-mi300x8-1536gb", 1));
        }
        models(&mds).unwrap()
    }

    /// What DO would report after creating the desired pools: `busy` nodes per pool.
    fn observe(desired: &[DesiredPool]) -> Vec<ObservedPool> {
        desired
            .iter()
            .enumerate()
            .map(|(i, d)| ObservedPool {
                id: format!("pool-{i}"),
                name: d.name.clone(),
                size: d.size.clone(),
                count: d.count,
                labels: d.labels.clone(),
                nodes: (0..d.count)
                    .map(|n| ObservedNode {
                        id: format!("node-{i}-{n}"),
                        name: format!("{}-{n}", d.name),
                        busy: true,
                    })
                    .collect(),
            })
            .collect()
    }

    fn none() -> Rollouts {
        Rollouts::new()
    }

    /// The actions for DI `di()` when no model server waits to be placed.
    fn plan(models: &[Model], rolling: &Rollouts, existing: &[ObservedPool]) -> Vec<PoolAction> {
        node_pools(&di(), models, rolling, existing, &BTreeSet::new()).actions
    }

    fn idle(pools: &mut [ObservedPool]) {
        for n in pools.iter_mut().flat_map(|p| p.nodes.iter_mut()) {
            n.busy = false;
        }
    }

    /// `M1` rolling out, its old pods on `pool`'s nodes.
    fn rolling_on(pool: &ObservedPool) -> Rollouts {
        let nodes = pool.nodes.iter().map(|n| n.name.clone()).collect();
        Rollouts::from([(id(M1), nodes)])
    }

    #[test]
    fn new_spec_creates_one_pool_per_model() {
        let actions = plan(&spec(2, true), &none(), &[]);
        assert_eq!(actions.len(), 2);
        let PoolAction::Create(p) = &actions[0] else {
            panic!("{actions:?}")
        };
        assert_eq!(p.name, names::node_pool(&di(), &id(M1), "gpu-h100x1-80gb"));
        assert_eq!(p.size, "gpu-h100x1-80gb");
        assert_eq!(p.count, 2);
        assert_eq!(p.labels[names::DI_ID_LABEL], DI);
        assert_eq!(p.labels[names::MODEL_ID_LABEL], M1);
        assert!(p.tags.contains(&format!("dedicated-inference:{DI}")));
    }

    #[test]
    fn unchanged_spec_gives_no_actions() {
        let models = spec(2, true);
        let existing = observe(&desired_pools(&di(), &models, &none(), &[]));
        assert_eq!(plan(&models, &none(), &existing), vec![]);
    }

    #[test]
    fn scale_up_resizes() {
        let existing = observe(&desired_pools(&di(), &spec(2, false), &none(), &[]));
        assert_eq!(
            plan(&spec(4, false), &none(), &existing),
            vec![PoolAction::Resize {
                pool_id: "pool-0".into(),
                name: existing[0].name.clone(),
                count: 4
            }]
        );
    }

    #[test]
    fn scale_down_deletes_idle_nodes_only() {
        let mut existing = observe(&desired_pools(&di(), &spec(3, false), &none(), &[]));
        // All busy: wait for the Deployment to let go of two nodes.
        assert_eq!(plan(&spec(1, false), &none(), &existing), vec![]);
        existing[0].nodes[0].busy = false;
        existing[0].nodes[2].busy = false;
        assert_eq!(
            plan(&spec(1, false), &none(), &existing),
            vec![
                PoolAction::DeleteNode {
                    pool_id: "pool-0".into(),
                    node_id: "node-0-0".into()
                },
                PoolAction::DeleteNode {
                    pool_id: "pool-0".into(),
                    node_id: "node-0-2".into()
                },
            ]
        );
        // Nodes unknown: a plain resize.
        existing[0].nodes.clear();
        assert!(matches!(
            plan(&spec(1, false), &none(), &existing)[..],
            [PoolAction::Resize { count: 1, .. }]
        ));
    }

    #[test]
    fn removed_model_deletes_its_pool_added_model_creates_one() {
        let mut existing = observe(&desired_pools(&di(), &spec(1, true), &none(), &[]));
        // While the removed model's pod runs there (its Deployment is being deleted), the pool
        // waits for it to leave.
        let held = node_pools(&di(), &spec(1, false), &none(), &existing, &BTreeSet::new());
        assert_eq!(held.actions, vec![]);
        assert_eq!(held.held.len(), 1, "{held:?}");
        idle(&mut existing[1..]);
        let actions = plan(&spec(1, false), &none(), &existing);
        assert_eq!(
            actions,
            vec![PoolAction::Delete {
                pool_id: "pool-1".into(),
                name: existing[1].name.clone()
            }]
        );
        let first_only = observe(&desired_pools(&di(), &spec(1, false), &none(), &[]));
        let actions = plan(&spec(1, true), &none(), &first_only);
        assert!(
            matches!(&actions[..], [PoolAction::Create(p)] if p.model_id == id(M2) && p.size == "gpu-mi300x8-1536gb")
        );
    }

    #[test]
    fn other_dis_pools_are_left_alone() {
        let other = Uuid::new_v4();
        let mut theirs = observe(&desired_pools(&other, &spec(1, false), &none(), &[]));
        theirs[0].id = "theirs".into();
        let actions = plan(&[], &none(), &theirs);
        assert_eq!(actions, vec![]);
        // Also unlabelled pools (e.g. the cluster's CPU pool).
        theirs[0].labels.clear();
        assert_eq!(plan(&[], &none(), &theirs), vec![]);
    }

    #[test]
    fn rollout_adds_one_surge_node_then_gives_it_back() {
        let models = spec(2, false);
        let existing = observe(&desired_pools(&di(), &models, &none(), &[]));
        let rolling = rolling_on(&existing[0]);
        assert!(matches!(
            plan(&models, &rolling, &existing)[..],
            [PoolAction::Resize { count: 3, .. }]
        ));
        // During the rollout at scale + 1: nothing more.
        let surged = observe(&desired_pools(&di(), &models, &rolling, &[]));
        assert_eq!(surged[0].count, 3);
        assert_eq!(plan(&models, &rolling, &surged), vec![]);
        // Done: the node the old pod left is idle and goes.
        let mut after = surged.clone();
        after[0].nodes[1].busy = false;
        assert_eq!(
            plan(&models, &none(), &after),
            vec![PoolAction::DeleteNode {
                pool_id: "pool-0".into(),
                node_id: "node-0-1".into()
            }]
        );
    }

    #[test]
    fn new_size_is_a_new_pool_and_the_old_one_waits_for_the_rollout() {
        let old = observe(&desired_pools(&di(), &spec(2, false), &none(), &[]));
        let bigger = models(&[deployment(M1, "org/a", "gpu-h100x8-640gb", 2)]).unwrap();
        let rolling = rolling_on(&old[0]);
        let actions = plan(&bigger, &rolling, &old);
        // No surge node: the old pool still holds the old pods.
        assert!(
            matches!(&actions[..], [PoolAction::Create(p)] if p.count == 2 && p.size == "gpu-h100x8-640gb"),
            "{actions:?}"
        );
        // Rollout over: the old pool goes once its old pods have left.
        let mut both = old.clone();
        let mut new = observe(&desired_pools(&di(), &bigger, &none(), &old));
        new[0].id = "pool-new".into();
        both.extend(new);
        assert_eq!(plan(&bigger, &none(), &both), vec![]);
        idle(&mut both[..1]);
        assert_eq!(
            plan(&bigger, &none(), &both),
            vec![PoolAction::Delete {
                pool_id: "pool-0".into(),
                name: old[0].name.clone()
            }]
        );
    }

    /// The soak's outage during a GPU move: a scale-down arrives while the new pool's pod
    /// waits for a node. Both nodes look idle, but the pod is about to be placed on one of
    /// them: nothing goes until it is placed, then the idle one does.
    #[test]
    fn a_pool_a_pod_waits_for_keeps_its_idle_nodes() {
        let mut existing = observe(&desired_pools(&di(), &spec(2, false), &none(), &[]));
        idle(&mut existing);
        let awaited = BTreeSet::from([existing[0].name.clone()]);
        let waiting = node_pools(&di(), &spec(1, false), &none(), &existing, &awaited);
        assert_eq!(waiting.actions, vec![]);
        assert_eq!(waiting.held.len(), 1, "{waiting:?}");
        // Placed on the first node: the other one goes.
        existing[0].nodes[0].busy = true;
        assert_eq!(
            plan(&spec(1, false), &none(), &existing),
            vec![PoolAction::DeleteNode {
                pool_id: "pool-0".into(),
                node_id: "node-0-1".into()
            }]
        );
        // A pool no longer wanted is not deleted while a pod may still be placed there.
        let awaited = BTreeSet::from([existing[0].name.clone()]);
        idle(&mut existing);
        let other_size = models(&[deployment(M1, "org/a", "gpu-h100x8-640gb", 1)]).unwrap();
        let plan = node_pools(&di(), &other_size, &none(), &existing, &awaited);
        assert!(
            !plan
                .actions
                .iter()
                .any(|a| matches!(a, PoolAction::Delete { .. })),
            "{plan:?}"
        );
    }

    /// A size change and back before the first rolled out: the older pool (the other size)
    /// still exists but sits idle, while the old pods run on this pool. Without a spare node
    /// the surge pod never fits and the rollout waits forever (found by the soak).
    #[test]
    fn an_older_pool_that_holds_no_old_pods_does_not_replace_the_surge_node() {
        let current = observe(&desired_pools(&di(), &spec(2, false), &none(), &[]));
        let other_size = models(&[deployment(M1, "org/a", "gpu-h100x8-640gb", 2)]).unwrap();
        let mut older = observe(&desired_pools(&di(), &other_size, &none(), &[]));
        older[0].id = "pool-older".into();
        for n in &mut older[0].nodes {
            n.busy = false;
        }
        let mut existing = current.clone();
        existing.extend(older.clone());
        // The old pods are on this pool's nodes: one spare node for the surge pod.
        let rolling = rolling_on(&current[0]);
        let d = desired_pools(&di(), &spec(2, false), &rolling, &existing);
        assert_eq!(d[0].count, 3);
        // Were they on the older pool's nodes, that pool would hold them: no spare node.
        let held = rolling_on(&older[0]);
        let d = desired_pools(&di(), &spec(2, false), &held, &existing);
        assert_eq!(d[0].count, 2);
    }

    #[test]
    fn scale_zero_has_no_surge() {
        let models = spec(0, false);
        let d = desired_pools(
            &di(),
            &models,
            &Rollouts::from([(id(M1), BTreeSet::new())]),
            &[],
        );
        assert_eq!(d[0].count, 0);
    }

    fn node(name: &str, pool: &str, slug: &str, ready: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            names::DI_ID_LABEL: DI, names::MODEL_ID_LABEL: M1,
            names::INSTANCE_TYPE_LABEL: slug, names::NODE_POOL_LABEL: pool}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}})
    }

    #[test]
    fn nodes_match_only_the_planned_pools_at_their_size() {
        let models = spec(2, false);
        let slug = "gpu-h100x1-80gb";
        let pool = names::node_pool(&di(), &id(M1), slug);
        let ready = |n: usize| -> Vec<serde_json::Value> {
            (0..n)
                .map(|i| node(&format!("n{i}"), &pool, slug, "True"))
                .collect()
        };
        assert!(nodes_match(&di(), &models, &ready(2)));
        // One node short, one too many, one not Ready, one of another pool or size.
        assert!(!nodes_match(&di(), &models, &ready(1)));
        assert!(!nodes_match(&di(), &models, &ready(3)));
        let mut not_ready = ready(1);
        not_ready.push(node("n1", &pool, slug, "False"));
        assert!(!nodes_match(&di(), &models, &not_ready));
        let mut stray = ready(2);
        stray.push(node("n9", "di-old-pool", slug, "True"));
        assert!(!nodes_match(&di(), &models, &stray));
        let mut other_size = ready(1);
        other_size.push(node("n1", &pool, "gpu-h200x1-141gb", "True"));
        assert!(!nodes_match(&di(), &models, &other_size));
        // Nodes of another DI do not count.
        let mut theirs = ready(2);
        let mut other = node("x", &pool, slug, "True");
        other["metadata"]["labels"][names::DI_ID_LABEL] = "someone-else".into();
        theirs.push(other);
        assert!(nodes_match(&di(), &models, &theirs));
    }
}
