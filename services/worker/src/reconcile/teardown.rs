//! Tearing a DI down from its ledger.

use std::sync::atomic::Ordering;

use api_types::lifecycle::Status;
use api_types::regional::Record;
use cloud_clients::digitalocean::{Cluster, ClusterState, NodePool};
use cloud_clients::Deleted;
use region_store::{ClusterRelease, LedgerEntry, StoreError};
use uuid::Uuid;

use super::{Pass, Reconciler, Result, LEDGER_CLUSTER, LEDGER_NAMESPACE, LEDGER_NODE_POOL};
use crate::plan::{names, ClusterWait, Waiting};

impl Reconciler {
    /// Deletes what the ledger records, newest first; every step treats "already gone" as done.
    /// The cluster goes only when no other DI uses it. Then the DI is gone.
    pub(super) async fn teardown(&self, rec: &Record) -> Result<Pass> {
        let id = rec.id;
        let s = &self.settings;
        let clusters = self.cloud.cluster_list().await?;
        let entries = self.store.ledger_entries(id).await?;
        for e in entries.iter().rev() {
            let waiting = match e.kind.as_str() {
                LEDGER_NAMESPACE => self.delete_namespace(id, e, &clusters).await?,
                LEDGER_NODE_POOL => self.delete_node_pool(id, e, &clusters).await?,
                LEDGER_CLUSTER => self.release_cluster(id, e, &clusters).await?,
                other => {
                    tracing::warn!(di = %id, kind = other, "unknown ledger entry; forgetting it");
                    self.store.ledger_remove(id, &e.kind, &e.name).await?;
                    None
                }
            };
            if let Some(waiting) = waiting {
                return Ok(Pass::new(Status::Deleting, s.poll).wait(waiting, s.poll));
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

    /// The DI's namespace, in the cluster its entry names: what the teardown waits for, if
    /// anything, before the entry is done.
    async fn delete_namespace(
        &self,
        id: Uuid,
        e: &LedgerEntry,
        clusters: &[Cluster],
    ) -> Result<Option<Waiting>> {
        let cluster = recorded_cluster(clusters, &e.scope);
        let Some(c) = cluster.filter(|c| c.status.state == ClusterState::Running) else {
            if cluster.is_some_and(|c| c.status.state == ClusterState::Provisioning) {
                return Ok(Some(Waiting::ClusterUnreachable));
            }
            // The cluster is gone or going: so is the namespace.
            self.store.ledger_remove(id, &e.kind, &e.name).await?;
            return Ok(None);
        };
        let kube = self.kube_for(&c.id).await?;
        let deleted = kube.delete("v1", "Namespace", None, &e.name).await?;
        if deleted != Deleted::AlreadyGone {
            self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
        }
        if deleted == Deleted::Deleting {
            let name = e.name.clone();
            return Ok(Some(Waiting::NamespaceTerminating { name }));
        }
        self.store.ledger_remove(id, &e.kind, &e.name).await?;
        Ok(None)
    }

    /// A node pool of the DI, by the name its entry records.
    async fn delete_node_pool(
        &self,
        id: Uuid,
        e: &LedgerEntry,
        clusters: &[Cluster],
    ) -> Result<Option<Waiting>> {
        if let Some(c) = recorded_cluster(clusters, &e.scope) {
            let pools = self.pools_of(&c.id).await?;
            if let Some(p) = pools.iter().find(|p| p.name == e.name) {
                self.delete_pool(&c.id, &p.id).await?;
            }
        }
        self.store.ledger_remove(id, &e.kind, &e.name).await?;
        Ok(None)
    }

    /// The cluster the DI used: released, and deleted when the DI was its last user (the
    /// entry stays until it is really gone).
    async fn release_cluster(
        &self,
        id: Uuid,
        e: &LedgerEntry,
        clusters: &[Cluster],
    ) -> Result<Option<Waiting>> {
        // By id once known. A cluster of the same name made later (by another DI, after this
        // one was deleted) is not it.
        let found = match &e.external_id {
            Some(cluster_id) => clusters.iter().find(|c| c.id == *cluster_id),
            None => clusters.iter().find(|c| c.name == e.name && !is_going(c)),
        };
        let Some(c) = found else {
            self.store.ledger_remove(id, &e.kind, &e.name).await?;
            return Ok(None);
        };
        if !e.retiring {
            // Sweep pools of this DI the ledger missed (e.g. recorded by a newer spec and
            // removed out of order).
            let di = id.to_string();
            let pools = self.pools_of(&c.id).await?;
            let mine = pools
                .iter()
                .filter(|p| p.labels.get(names::DI_ID_LABEL) == Some(&di));
            for p in mine {
                self.delete_pool(&c.id, &p.id).await?;
            }
            let release = self
                .store
                .ledger_cluster_release(id, &e.name, &c.id)
                .await?;
            if release == ClusterRelease::Shared {
                return Ok(None);
            }
        }
        if !is_going(c) {
            match self.cloud.cluster_delete(&c.id).await {
                Err(err) if err.is_not_found() => {}
                r => r?,
            }
            self.forget_kube(&c.id);
            tracing::info!(di = %id, cluster = %c.name, "cluster deleting");
        }
        let state = ClusterWait::Deleting;
        Ok(Some(Waiting::Cluster {
            name: c.name.clone(),
            state,
        }))
    }

    /// The cluster's node pools; none once the cluster is gone.
    async fn pools_of(&self, cluster_id: &str) -> Result<Vec<NodePool>> {
        match self.cloud.node_pool_list(cluster_id).await {
            Err(err) if err.is_not_found() => Ok(Vec::new()),
            r => Ok(r?),
        }
    }

    async fn delete_pool(&self, cluster_id: &str, pool_id: &str) -> Result<()> {
        match self.cloud.node_pool_delete(cluster_id, pool_id).await {
            Err(err) if err.is_not_found() => Ok(()),
            r => Ok(r?),
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
