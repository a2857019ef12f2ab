//! Ownership map and read model: which team and region each DI belongs to, with the region's
//! last view of it (its public JSON), merged from the regions' change feeds under their cursors;
//! served from the in-process cache ([`read_cache`]) when it is.

use std::sync::Arc;

use uuid::Uuid;

use crate::sealed::erase_secrets;
use crate::{read_cache, CentralStore, Result, StoreError};

/// A dedicated inference as central knows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Owned {
    pub id: Uuid,
    pub team_id: Uuid,
    pub region: String,
    pub name: String,
    pub state: String,
    pub status: String,
    /// The public JSON of the DI as last reported by its region (absent while pending).
    pub body: Option<String>,
}

/// One region's view of a DI, to merge into the read model.
pub struct ReadModelUpdate<'a> {
    pub id: Uuid,
    pub team_id: Uuid,
    pub region: &'a str,
    pub name: &'a str,
    pub status: &'a str,
    pub body: Option<&'a serde_json::Value>,
    pub gone: bool,
    pub seq: i64,
}

impl CentralStore {
    /// The team's DI by id, whatever its state; `None` for unknown ids and other teams' DIs.
    pub async fn dedicated_inference(&self, id: Uuid, team_id: Uuid) -> Result<Option<Arc<Owned>>> {
        let row = match self.cache.get(id) {
            Some(row) => row,
            None => {
                let ticket = self.cache.ticket();
                let row: Option<Owned> = sqlx::query_as(
                    "SELECT id, team_id, region, name, state, status, body::text AS body
                     FROM dedicated_inferences WHERE id = $1",
                )
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
                let Some(row) = row else { return Ok(None) };
                let row = Arc::new(row);
                self.cache.fill(ticket, row.clone());
                row
            }
        };
        Ok((row.team_id == team_id).then_some(row))
    }

    /// One page of the team's live DIs (public JSON bodies), oldest first, with the total. From
    /// memory when the team's list is cached (see [`read_cache`]); otherwise one query reads
    /// the team's whole list to cache it, or, for a team above the cache's size per team (250
    /// live DIs), one query the page alone: its cost grows with the page's offset in the
    /// team's list index, not with the team's bodies.
    pub async fn dedicated_inference_list(
        &self,
        team_id: Uuid,
        region: Option<&str>,
        name: Option<&str>,
        page: i64,
        per_page: i64,
    ) -> Result<(Vec<String>, i64)> {
        // Pages count from 1; the handlers enforce it, the store holds to it whatever the caller.
        let (page, per_page) = (page.max(1), per_page.max(0));
        let list = match self.cache.list(team_id) {
            Some(list) => Some(list),
            None if self.cache.serving() => Some(self.team_list(team_id).await?),
            None => None,
        };
        if let Some(list) = list.filter(|l| !l.too_large) {
            let matching = list.entries.iter().filter(|e| {
                region.is_none_or(|r| e.region == r) && name.is_none_or(|n| e.name == n)
            });
            let total = matching.clone().count();
            let skip = usize::try_from((page - 1).saturating_mul(per_page)).unwrap_or(usize::MAX);
            let bodies = matching
                .skip(skip)
                .take(usize::try_from(per_page).unwrap_or(0))
                .map(|e| e.body.clone())
                .collect();
            return Ok((bodies, i64::try_from(total).unwrap_or(i64::MAX)));
        }
        // The total and the page's ids from `team_list_members` (migration 0007), whose index
        // holds the order and the filters; bodies are read for the page's rows alone. One
        // round trip, and a row with no body when the page is past the end.
        let rows: Vec<(i64, Option<String>)> = sqlx::query_as(
            "SELECT listed.total, page.body FROM
                 (SELECT count(*) AS total FROM team_list_members
                  WHERE team_id = $1 AND ($2::text IS NULL OR region = $2) AND ($3::text IS NULL OR name = $3)) listed
             LEFT JOIN LATERAL (
                 SELECT d.body::text AS body, m.created_at, m.id
                 FROM (SELECT id, created_at FROM team_list_members
                       WHERE team_id = $1 AND ($2::text IS NULL OR region = $2) AND ($3::text IS NULL OR name = $3)
                       ORDER BY created_at, id LIMIT $4 OFFSET $5) m
                 JOIN dedicated_inferences d ON d.id = m.id AND d.body IS NOT NULL) page ON true
             ORDER BY page.created_at, page.id",
        )
        .bind(team_id)
        .bind(region)
        .bind(name)
        .bind(per_page)
        .bind((page - 1).saturating_mul(per_page))
        .fetch_all(&self.pool)
        .await?;
        let total = rows.first().map_or(0, |(total, _)| *total);
        Ok((
            rows.into_iter().filter_map(|(_, body)| body).collect(),
            total,
        ))
    }

    /// The team's whole list, read to be cached; for a team too large, only that it is, found
    /// from the list's index without reading a body.
    async fn team_list(&self, team_id: Uuid) -> Result<Arc<read_cache::TeamList>> {
        let ticket = self.cache.ticket();
        let too_many = read_cache::MAX_CACHED_LIST as i64 + 1;
        #[derive(sqlx::FromRow)]
        struct Row {
            listed: i64,
            region: Option<String>,
            name: Option<String>,
            body: Option<String>,
        }
        let rows: Vec<Row> = sqlx::query_as(
            "WITH m AS (SELECT id, created_at FROM team_list_members WHERE team_id = $1
                        ORDER BY created_at, id LIMIT $2)
             SELECT n.listed, page.region, page.name, page.body
             FROM (SELECT count(*) AS listed FROM m) n
             LEFT JOIN LATERAL (
                 SELECT d.region, d.name, d.body::text AS body, m.created_at, m.id
                 FROM m JOIN dedicated_inferences d ON d.id = m.id AND d.body IS NOT NULL
                 WHERE n.listed < $2) page ON true
             ORDER BY page.created_at, page.id",
        )
        .bind(team_id)
        .bind(too_many)
        .fetch_all(&self.pool)
        .await?;
        let too_large = rows.first().is_some_and(|row| row.listed >= too_many);
        let entries = rows
            .into_iter()
            .filter_map(|row| {
                Some(read_cache::ListEntry {
                    region: row.region?,
                    name: row.name?,
                    body: row.body?,
                })
            })
            .collect();
        let list = Arc::new(read_cache::TeamList { entries, too_large });
        self.cache.fill_list(ticket, team_id, list.clone());
        Ok(list)
    }

    /// Merges a region's view of a DI; a view older than the one held is ignored.
    pub async fn read_model_apply(&self, update: &ReadModelUpdate<'_>) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        apply(&mut tx, update).await?;
        tx.commit().await?;
        self.cache.invalidate(update.id, update.team_id);
        Ok(())
    }

    /// Renames the team's DI ahead of forwarding a patch that changes its name.
    pub async fn rename(&self, id: Uuid, team_id: Uuid, name: &str) -> Result<()> {
        let renamed = sqlx::query("UPDATE dedicated_inferences SET name = $3, updated_at = now() WHERE id = $1 AND team_id = $2")
            .bind(id)
            .bind(team_id)
            .bind(name)
            .execute(&self.pool)
            .await;
        self.cache.invalidate(id, team_id);
        match renamed {
            Err(sqlx::Error::Database(e))
                if e.constraint() == Some("dedicated_inferences_team_name") =>
            {
                Err(StoreError::NameTaken)
            }
            Err(e) => Err(e.into()),
            Ok(_) => Ok(()),
        }
    }

    pub async fn cursor(&self, region: &str) -> Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT last_seq FROM region_cursors WHERE region = $1")
                .bind(region)
                .fetch_optional(&self.pool)
                .await?
                .unwrap_or(0),
        )
    }

    pub async fn cursor_set(&self, region: &str, last_seq: i64) -> Result<()> {
        sqlx::query(
            "INSERT INTO region_cursors (region, last_seq) VALUES ($1, $2)
             ON CONFLICT (region) DO UPDATE SET last_seq = greatest(region_cursors.last_seq, excluded.last_seq)",
        )
        .bind(region)
        .bind(last_seq)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

pub(super) async fn apply(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    u: &ReadModelUpdate<'_>,
) -> Result<()> {
    // Central takes a new name before the region applies it, so the feed can still carry a DI's
    // old name after another DI has taken that name here. The view is then applied under the
    // name central holds (the feed brings the new one next). The savepoint keeps the caller's
    // transaction usable after the unique index refuses the first attempt.
    sqlx::query("SAVEPOINT read_model_apply")
        .execute(&mut **tx)
        .await?;
    let mut applied = false;
    for keep_name in [false, true] {
        match upsert(tx, u, keep_name).await {
            Err(sqlx::Error::Database(e))
                if e.constraint() == Some("dedicated_inferences_team_name") =>
            {
                sqlx::query("ROLLBACK TO SAVEPOINT read_model_apply")
                    .execute(&mut **tx)
                    .await?;
            }
            Err(e) => return Err(e.into()),
            Ok(_) => {
                applied = true;
                break;
            }
        }
    }
    sqlx::query("RELEASE SAVEPOINT read_model_apply")
        .execute(&mut **tx)
        .await?;
    if u.gone {
        erase_secrets(tx, u.id).await?;
    }
    if !applied {
        // A DI central has never seen, under a name another of the team's DIs holds here: its
        // row waits for the feed's next view of either DI.
        tracing::warn!(id = %u.id, "read model name clash; view deferred");
    }
    Ok(())
}

async fn upsert(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    u: &ReadModelUpdate<'_>,
    keep_name: bool,
) -> std::result::Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
    let state = if u.gone { "gone" } else { "live" };
    // Insert covers a DI central has never seen (e.g. its create row was lost); the update is
    // guarded by `region_seq` so that a slow, older view never overwrites a newer one.
    sqlx::query(
        "INSERT INTO dedicated_inferences (id, team_id, region, name, state, status, body, region_seq)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (id) DO UPDATE SET
             name = CASE WHEN $9 THEN dedicated_inferences.name ELSE excluded.name END,
             status = excluded.status, body = excluded.body, region_seq = excluded.region_seq,
             state = CASE WHEN excluded.state = 'gone' THEN 'gone'
                          WHEN dedicated_inferences.state = 'gone' THEN 'gone' ELSE 'live' END,
             updated_at = now()
         WHERE dedicated_inferences.region_seq <= excluded.region_seq",
    )
    .bind(u.id)
    .bind(u.team_id)
    .bind(u.region)
    .bind(u.name)
    .bind(state)
    .bind(u.status)
    .bind(u.body)
    .bind(u.seq)
    .bind(keep_name)
    .execute(&mut **tx)
    .await
}
