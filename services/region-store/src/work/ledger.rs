//! The teardown ledger: every external resource a DI's worker creates, recorded before it is,
//! so that deletion finds it; and a VPC's cluster shared by its DIs, deleted by the last.

use sqlx::postgres::PgConnection;
use uuid::Uuid;

use crate::{Result, Store};

/// One external resource recorded for a DI.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LedgerEntry {
    pub seq: i64,
    pub kind: String,
    pub name: String,
    /// For namespaces and node pools, the id of the cluster they live in (the cluster's name
    /// in entries recorded before ids were used).
    pub scope: String,
    pub external_id: Option<String>,
    /// A cluster entry of a DI whose teardown is deleting that cluster as its last user.
    pub retiring: bool,
}

/// Where a DI that stops using its VPC's cluster leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterRelease {
    /// Other live DIs use the cluster: it stays, and this DI's entry is gone.
    Shared,
    /// This DI was its last user: its entry is now retiring and the caller deletes the cluster.
    Last,
}

impl Store {
    /// Records an external resource before (or as) it is created. Idempotent; a known entry
    /// keeps its position, takes the new `scope` and gains `external_id` when one is given.
    pub async fn ledger_record(
        &self,
        di_id: Uuid,
        kind: &str,
        name: &str,
        scope: &str,
        external_id: Option<&str>,
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        self.fence(&mut tx, di_id).await?;
        sqlx::query(
            "INSERT INTO teardown_ledger (di_id, kind, name, scope, external_id) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (di_id, kind, name) DO UPDATE
                 SET external_id = coalesce(excluded.external_id, teardown_ledger.external_id), scope = excluded.scope
                 WHERE (teardown_ledger.external_id, teardown_ledger.scope)
                     IS DISTINCT FROM (coalesce(excluded.external_id, teardown_ledger.external_id), excluded.scope)",
        )
        .bind(di_id)
        .bind(kind)
        .bind(name)
        .bind(scope)
        .bind(external_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Whether any DI's ledger records a cluster named `name`. Every cluster is recorded before
    /// it is created, and its last record goes only once its deletion began: without one, no
    /// cluster of that name is running or being created.
    pub async fn ledger_cluster_recorded(&self, name: &str) -> Result<bool> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM teardown_ledger WHERE kind = 'cluster' AND name = $1)",
        )
        .bind(name)
        .fetch_one(&self.pool)
        .await?)
    }

    /// The DI's recorded resources, oldest first (delete walks them in reverse).
    pub async fn ledger_entries(&self, di_id: Uuid) -> Result<Vec<LedgerEntry>> {
        let mut conn = self.pool.acquire().await?;
        ledger_entries_on(&mut conn, di_id).await
    }

    /// Forgets a resource that is gone.
    pub async fn ledger_remove(&self, di_id: Uuid, kind: &str, name: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        self.fence(&mut tx, di_id).await?;
        sqlx::query("DELETE FROM teardown_ledger WHERE di_id = $1 AND kind = $2 AND name = $3")
            .bind(di_id)
            .bind(kind)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records that DI `di_id` uses cluster `cluster_id` (the VPC's cluster `name`), unless the
    /// teardown of its last user is deleting it: then `false`, and the DI must wait for a
    /// cluster of its own. Serialised with [`Store::ledger_cluster_release`] per cluster name,
    /// so that a cluster is never deleted under a DI that started using it.
    pub async fn ledger_cluster_use(
        &self,
        di_id: Uuid,
        name: &str,
        cluster_id: &str,
    ) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        lock_cluster(&mut tx, name).await?;
        self.fence(&mut tx, di_id).await?;
        let retiring: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM teardown_ledger WHERE kind = 'cluster' AND name = $1 AND external_id = $2 AND retiring LIMIT 1",
        )
        .bind(name)
        .bind(cluster_id)
        .fetch_optional(&mut *tx)
        .await?;
        if retiring.is_some() {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO teardown_ledger (di_id, kind, name, external_id) VALUES ($1, 'cluster', $2, $3)
             ON CONFLICT (di_id, kind, name) DO UPDATE SET external_id = excluded.external_id, retiring = false
                 WHERE (teardown_ledger.external_id, teardown_ledger.retiring) IS DISTINCT FROM (excluded.external_id, false)",
        )
        .bind(di_id)
        .bind(name)
        .bind(cluster_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// DI `di_id`, being deleted, stops using cluster `cluster_id` (the VPC's cluster `name`).
    /// Another live DI that uses it, or may be about to (its entry has no id yet), keeps it:
    /// [`ClusterRelease::Shared`], and this DI's entry is gone. Otherwise this DI was the last
    /// user: its entry turns retiring and the caller deletes the cluster. One transaction under
    /// a lock per cluster name, so that two DIs deleted at once cannot each leave the cluster to
    /// the other.
    pub async fn ledger_cluster_release(
        &self,
        di_id: Uuid,
        name: &str,
        cluster_id: &str,
    ) -> Result<ClusterRelease> {
        let mut tx = self.pool.begin().await?;
        lock_cluster(&mut tx, name).await?;
        self.fence(&mut tx, di_id).await?;
        let other: Option<Uuid> = sqlx::query_scalar(
            "SELECT l.di_id FROM teardown_ledger l JOIN dedicated_inferences d ON d.id = l.di_id
             WHERE l.kind = 'cluster' AND l.name = $1 AND l.di_id <> $2 AND d.gone_at IS NULL
               AND NOT l.retiring AND (l.external_id IS NULL OR l.external_id = $3)
             LIMIT 1",
        )
        .bind(name)
        .bind(di_id)
        .bind(cluster_id)
        .fetch_optional(&mut *tx)
        .await?;
        let release = if other.is_some() {
            sqlx::query(
                "DELETE FROM teardown_ledger WHERE di_id = $1 AND kind = 'cluster' AND name = $2",
            )
            .bind(di_id)
            .bind(name)
            .execute(&mut *tx)
            .await?;
            ClusterRelease::Shared
        } else {
            sqlx::query(
                "UPDATE teardown_ledger SET retiring = true, external_id = $3 WHERE di_id = $1 AND kind = 'cluster' AND name = $2",
            )
            .bind(di_id)
            .bind(name)
            .bind(cluster_id)
            .execute(&mut *tx)
            .await?;
            ClusterRelease::Last
        };
        tx.commit().await?;
        Ok(release)
    }
}

/// Serialises the users of one cluster name until commit. The two-key form keeps it apart from
/// the outbox's one-key lock; it shares class 7416 with the teams' quota locks (see
/// `quotas::lock_team`), so a cluster name and a team id whose hashes collide (about one in
/// 2^32) serialise each other too. Their transactions take them in opposite orders around a
/// DI's row, so such a pair can deadlock; Postgres then fails one of them, which its caller
/// retries. A class of its own would leave, during a rolling upgrade, replicas of two versions
/// taking different locks for one team.
async fn lock_cluster(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, name: &str) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock(7416, hashtext($1))")
        .bind(name)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn ledger_entries_on(conn: &mut PgConnection, di_id: Uuid) -> Result<Vec<LedgerEntry>> {
    let rows: Vec<(i64, String, String, String, Option<String>, bool)> = sqlx::query_as(
        "SELECT seq, kind, name, scope, external_id, retiring FROM teardown_ledger WHERE di_id = $1 ORDER BY seq",
    )
    .bind(di_id)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(seq, kind, name, scope, external_id, retiring)| LedgerEntry {
                seq,
                kind,
                name,
                scope,
                external_id,
                retiring,
            },
        )
        .collect())
}
