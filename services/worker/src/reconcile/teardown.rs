//! Tearing a DI down from its ledger.

use std::sync::atomic::Ordering;

use api_types::lifecycle::Status;
use api_types::regional::Record;
use cloud_clients::digitalocean::{Cluster, ClusterState};
use cloud_clients::Deleted;
use region_store::{ClusterRelease, StoreError};

use super::{Pass, Reconciler, Result, LEDGER_CLUSTER, LEDGER_NAMESPACE, LEDGER_NODE_POOL};
use crate::plan::{names, ClusterWait, Waiting};

impl Reconciler {
    // -----------------------------------------------------------------------------------------
    // Teardown

    /// Deletes what the ledger records, newest first; every step treats "already gone" as done.
    /// The cluster goes only when no other DI uses it. Then the DI is gone.
    pub(super) async fn teardown(&self, rec: &Record) -> Result<Pass> {
        let id = rec.id;
        let s = &self.settings;
        let pass = Pass::new(Status::Deleting, s.poll);
        let clusters = self.cloud.cluster_list().await?;
        let entries = self.store.ledger_entries(id).await?;
        for e in entries.iter().rev() {
            match e.kind.as_str() {
                LEDGER_NAMESPACE => {
                    let cluster = recorded_cluster(&clusters, &e.scope);
                    let Some(c) = cluster.filter(|c| c.status.state == ClusterState::Running)
                    else {
                        if cluster.is_some_and(|c| c.status.state == ClusterState::Provisioning) {
                            return Ok(pass.wait(Waiting::ClusterUnreachable, s.poll));
                        }
                        // The cluster is gone or going: so is the namespace.
                        self.store.ledger_remove(id, &e.kind, &e.name).await?;
                        continue;
                    };
                    let kube = self.kube_for(&c.id).await?;
                    let deleted = kube.delete("v1", "Namespace", None, &e.name).await?;
                    if deleted != Deleted::AlreadyGone {
                        self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
                    }
                    if deleted == Deleted::Deleting {
                        let name = e.name.clone();
                        return Ok(pass.wait(Waiting::NamespaceTerminating { name }, s.poll));
                    }
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
                LEDGER_NODE_POOL => {
                    if let Some(c) = recorded_cluster(&clusters, &e.scope) {
                        let pools = match self.cloud.node_pool_list(&c.id).await {
                            Err(err) if err.is_not_found() => Vec::new(),
                            r => r?,
                        };
                        if let Some(p) = pools.iter().find(|p| p.name == e.name) {
                            match self.cloud.node_pool_delete(&c.id, &p.id).await {
                                Err(err) if err.is_not_found() => {}
                                r => r?,
                            }
                        }
                    }
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
                LEDGER_CLUSTER => {
                    // The cluster this DI used: by id once known. A cluster of the same name
                    // made later (by another DI, after this one was deleted) is not it.
                    let found = match &e.external_id {
                        Some(cluster_id) => clusters.iter().find(|c| c.id == *cluster_id),
                        None => clusters.iter().find(|c| c.name == e.name && !is_going(c)),
                    };
                    let Some(c) = found else {
                        self.store.ledger_remove(id, &e.kind, &e.name).await?;
                        continue;
                    };
                    if !e.retiring {
                        // Sweep pools of this DI the ledger missed (e.g. recorded by a newer
                        // spec and removed out of order).
                        let di = id.to_string();
                        let pools = match self.cloud.node_pool_list(&c.id).await {
                            Err(err) if err.is_not_found() => Vec::new(),
                            r => r?,
                        };
                        for p in pools
                            .iter()
                            .filter(|p| p.labels.get(names::DI_ID_LABEL) == Some(&di))
                        {
                            match self.cloud.node_pool_delete(&c.id, &p.id).await {
                                Err(err) if err.is_not_found() => {}
                                r => r?,
                            }
                        }
                        let release = self
                            .store
                            .ledger_cluster_release(id, &e.name, &c.id)
                            .await?;
                        if release == ClusterRelease::Shared {
                            continue;
                        }
                    }
                    // The last user: delete it, and keep the entry until it is really gone.
                    if !is_going(c) {
                        match self.cloud.cluster_delete(&c.id).await {
                            Err(err) if err.is_not_found() => {}
                            r => r?,
                        }
                        self.forget_kube(&c.id);
                        tracing::info!(di = %id, cluster = %c.name, "cluster deleting");
                    }
                    let wait = Waiting::Cluster {
                        name: c.name.clone(),
                        state: ClusterWait::Deleting,
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                other => {
                    tracing::warn!(di = %id, kind = other, "unknown ledger entry; forgetting it");
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                }
            }
        }
        match self.store.gone(id).await {
            Ok(_) | Err(StoreError::NotFound) => {
                tracing::info!(di = %id, "gone");
                Ok(Pass::gone(s.resync))
            }
            Err(e) => Err(e.into()),
        }
    }
}

fn is_going(c: &Cluster) -> bool {
    matches!(
        c.status.state,
        ClusterState::Deleting | ClusterState::Deleted
    )
}

/// The cluster a namespace or node-pool entry names in its scope: by id, or (entries recorded
/// before ids were used) by name, preferring one that is not going.
fn recorded_cluster<'a>(clusters: &'a [Cluster], scope: &str) -> Option<&'a Cluster> {
    clusters.iter().find(|c| c.id == scope).or_else(|| {
        let named = || clusters.iter().filter(|c| c.name == scope);
        named().find(|c| !is_going(c)).or_else(|| named().next())
    })
}
