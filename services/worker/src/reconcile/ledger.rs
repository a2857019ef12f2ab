//! The teardown ledger as a pass sees it.

use region_store::{LedgerEntry, Store};
use uuid::Uuid;

use super::{Result, LEDGER_CLUSTER};

/// A DI's teardown ledger as read at the start of a pass (the pass's lease makes it the only
/// writer): an entry already recorded is not written again, so a pass over a converged DI
/// writes nothing to the ledger.
pub(super) struct Ledger<'a> {
    pub(super) store: &'a Store,
    pub(super) id: Uuid,
    pub(super) known: Vec<LedgerEntry>,
}

impl Ledger<'_> {
    /// As [`Store::ledger_record`]: recorded before (or as) the resource is created.
    pub(super) async fn record(
        &mut self,
        kind: &str,
        name: &str,
        scope: &str,
        external_id: Option<&str>,
    ) -> Result<()> {
        let known = self
            .known
            .iter()
            .position(|e| e.kind == kind && e.name == name);
        if let Some(i) = known {
            let e = &self.known[i];
            if e.scope == scope
                && (external_id.is_none() || e.external_id.as_deref() == external_id)
            {
                return Ok(());
            }
        }
        self.store
            .ledger_record(self.id, kind, name, scope, external_id)
            .await?;
        let external_id = external_id.map(str::to_string);
        match known {
            Some(i) => {
                let e = &mut self.known[i];
                e.scope = scope.to_string();
                if external_id.is_some() {
                    e.external_id = external_id;
                }
            }
            None => self.known.push(LedgerEntry {
                seq: 0,
                kind: kind.to_string(),
                name: name.to_string(),
                scope: scope.to_string(),
                external_id,
                retiring: false,
            }),
        }
        Ok(())
    }

    /// Records that the DI uses cluster `cluster_id` (the VPC's cluster `name`); `false` when
    /// its last user's teardown is deleting it (see [`Store::ledger_cluster_use`]).
    pub(super) async fn use_cluster(&mut self, name: &str, cluster_id: &str) -> Result<bool> {
        let known = self.known.iter().any(|e| {
            e.kind == LEDGER_CLUSTER
                && e.name == name
                && e.external_id.as_deref() == Some(cluster_id)
        });
        if known {
            // Recorded by an earlier pass: no teardown can have retired it since, because
            // this DI's entry counts as a user.
            return Ok(true);
        }
        if !self
            .store
            .ledger_cluster_use(self.id, name, cluster_id)
            .await?
        {
            return Ok(false);
        }
        self.known
            .retain(|e| !(e.kind == LEDGER_CLUSTER && e.name == name));
        self.known.push(LedgerEntry {
            seq: 0,
            kind: LEDGER_CLUSTER.to_string(),
            name: name.to_string(),
            scope: String::new(),
            external_id: Some(cluster_id.to_string()),
            retiring: false,
        });
        Ok(true)
    }

    pub(super) async fn remove(&mut self, kind: &str, name: &str) -> Result<()> {
        self.store.ledger_remove(self.id, kind, name).await?;
        self.known.retain(|e| !(e.kind == kind && e.name == name));
        Ok(())
    }
}
