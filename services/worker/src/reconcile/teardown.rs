//! Tearing a DI down from its ledger.

use std::sync::atomic::Ordering;

use api_types::lifecycle::Status;
use api_types::regional::Record;
use std::collections::HashMap;

use cloud_clients::digitalocean::{Cluster, ClusterState, NodePool};
use cloud_clients::{Deleted, DoClient};
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
        self.converged.record(id, None);
        let mut clusters = Clusters::new(&self.cloud);
        let entries = self.store.ledger_entries(id).await?;
        for e in entries.iter().rev() {
            let waiting = match e.kind.as_str() {
                LEDGER_NAMESPACE => self.delete_namespace(id, e, &mut clusters).await?,
                LEDGER_NODE_POOL => self.delete_node_pool(id, e, &mut clusters).await?,
                LEDGER_CLUSTER => self.release_cluster(id, e, &mut clusters).await?,
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
        clusters: &mut Clusters<'_>,
    ) -> Result<Option<Waiting>> {
        let cluster = clusters.recorded(&e.scope).await?;
        let c = match cluster.as_ref().map(|c| namespace_step(c.status.state)) {
            Some(NamespaceStep::Delete) => cluster.as_ref().expect("a cluster"),
            Some(NamespaceStep::Wait) => return Ok(Some(Waiting::ClusterUnreachable)),
            // The cluster is gone or going: so is the namespace.
            Some(NamespaceStep::Gone) | None => {
                self.store.ledger_remove(id, &e.kind, &e.name).await?;
                return Ok(None);
            }
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
        clusters: &mut Clusters<'_>,
    ) -> Result<Option<Waiting>> {
        if let Some(c) = clusters.recorded(&e.scope).await? {
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
        clusters: &mut Clusters<'_>,
    ) -> Result<Option<Waiting>> {
        // By id once known. A cluster of the same name made later (by another DI, after this
        // one was deleted) is not it.
        let found = match &e.external_id {
            Some(cluster_id) => clusters.by_id(cluster_id).await?,
            None => clusters
                .all()
                .await?
                .iter()
                .find(|c| c.name == e.name && !is_going(c)),
        };
        // A deleted cluster may still be shown (DigitalOcean documents the state): it is gone.
        let Some(c) = found.filter(|c| c.status.state != ClusterState::Deleted) else {
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

/// What a teardown does about a namespace in a cluster in `state`.
#[derive(Debug, PartialEq, Eq)]
enum NamespaceStep {
    /// Delete it through the cluster's API.
    Delete,
    /// Wait: the cluster's API is not up yet.
    Wait,
    /// Nothing: the cluster, and the namespace with it, is gone or going.
    Gone,
}

/// A namespace holds the DI's secrets (its Hugging Face token among them) and its load
/// balancers' Services: it is deleted in every state of a cluster that stays, degraded or
/// upgrading or failed included (their API servers answer in most cases; when not, the pass
/// fails and is retried), never dropped from the ledger while the cluster lives.
fn namespace_step(state: ClusterState) -> NamespaceStep {
    match state {
        ClusterState::Provisioning => NamespaceStep::Wait,
        ClusterState::Deleting | ClusterState::Deleted => NamespaceStep::Gone,
        ClusterState::Running
        | ClusterState::Degraded
        | ClusterState::Upgrading
        | ClusterState::Error
        | ClusterState::Unknown => NamespaceStep::Delete,
    }
}

fn is_going(c: &Cluster) -> bool {
    matches!(
        c.status.state,
        ClusterState::Deleting | ClusterState::Deleted
    )
}

/// The region's clusters as one teardown pass needs them: each read by id when first asked
/// for, the whole list only for entries recorded by name. A pass used to list every cluster
/// of the region, which made deleting the DIs of a full region quadratic.
struct Clusters<'a> {
    cloud: &'a DoClient,
    by_id: HashMap<String, Option<Cluster>>,
    listed: Option<Vec<Cluster>>,
}

impl<'a> Clusters<'a> {
    fn new(cloud: &'a DoClient) -> Self {
        Clusters {
            cloud,
            by_id: HashMap::new(),
            listed: None,
        }
    }

    /// The cluster with id `id`, if it still exists.
    async fn by_id(&mut self, id: &str) -> Result<Option<&Cluster>> {
        if !self.by_id.contains_key(id) {
            let found = match self.cloud.cluster_get(id).await {
                Ok(c) => Some(c),
                Err(err) if err.is_not_found() => None,
                Err(err) => return Err(err.into()),
            };
            self.by_id.insert(id.to_string(), found);
        }
        Ok(self.by_id[id].as_ref())
    }

    /// Every cluster of the region.
    async fn all(&mut self) -> Result<&[Cluster]> {
        if self.listed.is_none() {
            self.listed = Some(self.cloud.cluster_list().await?);
        }
        Ok(self.listed.as_deref().unwrap_or_default())
    }

    /// The cluster a namespace or node-pool entry names in its scope: by id (DigitalOcean's
    /// cluster ids are UUIDs, the project's cluster names are not), or, for entries recorded
    /// before ids were used, by name, preferring one that is not going (or by an id that is not
    /// a UUID, should a cloud use such ids).
    async fn recorded(&mut self, scope: &str) -> Result<Option<Cluster>> {
        if Uuid::parse_str(scope).is_ok() {
            return Ok(self.by_id(scope).await?.cloned());
        }
        let clusters = self.all().await?;
        let named = || clusters.iter().filter(|c| c.name == scope || c.id == scope);
        Ok(named()
            .find(|c| !is_going(c))
            .or_else(|| named().next())
            .cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_deleted_in_every_cluster_that_stays() {
        use ClusterState::*;
        let step = |s| namespace_step(s);
        for s in [Running, Degraded, Upgrading, Error, Unknown] {
            assert_eq!(step(s), NamespaceStep::Delete, "{s:?}");
        }
        assert_eq!(step(Provisioning), NamespaceStep::Wait);
        assert_eq!(
            (step(Deleting), step(Deleted)),
            (NamespaceStep::Gone, NamespaceStep::Gone)
        );
    }
}
