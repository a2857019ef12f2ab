//! The DI's node pools in DigitalOcean: read, compared with [`plan::node_pools`], and changed
//! action by action (a pool is recorded in the ledger before it is created).

use std::collections::BTreeSet;
use std::time::SystemTime;

use cloud_clients::digitalocean::{NodePool, NodePoolCreateRequest, NodePoolUpdateRequest};
use serde_json::Value;
use uuid::Uuid;

use super::converge::Reached;
use super::ledger::Ledger;
use super::{Reconciler, Result, LEDGER_NODE_POOL};
use crate::plan::{self, PoolAction};

/// The pools as the plan sees them: a node is busy while a pod of the DI runs on it.
fn observed_pools(pools: &[NodePool], observed: &[Value]) -> Vec<plan::ObservedPool> {
    let busy = plan::readiness::busy_nodes(observed, SystemTime::now());
    pools
        .iter()
        .map(|p| plan::ObservedPool {
            id: p.id.clone(),
            name: p.name.clone(),
            size: p.size.clone(),
            count: p.count,
            labels: p.labels.clone(),
            nodes: p
                .nodes
                .iter()
                .map(|n| plan::ObservedNode {
                    id: n.id.clone(),
                    name: n.name.clone(),
                    busy: busy.contains(&n.name),
                })
                .collect(),
        })
        .collect()
}

impl Reconciler {
    /// Compares the DI's node pools in DigitalOcean with the plan and applies the difference:
    /// how many changes it made, and the pools whose shrink or deletion is held back for pods
    /// to be placed or to leave.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn apply_node_pools(
        &self,
        id: Uuid,
        at: &Reached,
        models: &[plan::Model],
        rolling: &plan::readiness::Rollouts,
        awaited: &BTreeSet<String>,
        observed: &[Value],
        ledger: &mut Ledger<'_>,
    ) -> Result<(u64, Vec<String>)> {
        let pools = self.cloud.node_pool_list(&at.cluster_id).await?;
        let observed_pools = observed_pools(&pools, observed);
        let plan = plan::node_pools(&id, models, rolling, &observed_pools, awaited);
        let changes = plan.actions.len() as u64;
        for action in plan.actions {
            self.pool_action(id, &at.cluster_id, action, ledger).await?;
        }
        Ok((changes, plan.held))
    }

    async fn pool_action(
        &self,
        id: Uuid,
        cluster_id: &str,
        action: PoolAction,
        ledger: &mut Ledger<'_>,
    ) -> Result<()> {
        match action {
            PoolAction::Create(d) => {
                ledger
                    .record(LEDGER_NODE_POOL, &d.name, cluster_id, None)
                    .await?;
                let mut req = NodePoolCreateRequest::new(&d.name, &d.size, d.count);
                req.labels = d.labels.clone();
                req.tags = d.tags.clone();
                let created = self.cloud.node_pool_create(cluster_id, &req).await?;
                ledger
                    .record(LEDGER_NODE_POOL, &d.name, cluster_id, Some(&created.id))
                    .await?;
                tracing::info!(di = %id, pool = %d.name, "node pool created");
            }
            PoolAction::Resize {
                pool_id,
                name,
                count,
            } => {
                let req = NodePoolUpdateRequest::new(&name, count);
                self.cloud
                    .node_pool_update(cluster_id, &pool_id, &req)
                    .await?;
                tracing::info!(di = %id, pool = %name, count, "node pool resized");
            }
            PoolAction::DeleteNode { pool_id, node_id } => {
                let deleted = self
                    .cloud
                    .node_delete(cluster_id, &pool_id, &node_id, false)
                    .await;
                match deleted {
                    Err(e) if e.is_not_found() => {}
                    r => r?,
                }
            }
            PoolAction::Delete { pool_id, name } => {
                match self.cloud.node_pool_delete(cluster_id, &pool_id).await {
                    Err(e) if e.is_not_found() => {}
                    r => r?,
                }
                ledger.remove(LEDGER_NODE_POOL, &name).await?;
                tracing::info!(di = %id, pool = %name, "node pool deleted");
            }
        }
        Ok(())
    }
}
