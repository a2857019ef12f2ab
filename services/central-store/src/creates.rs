//! Creates: begin (ownership row + intent + key, one transaction), then confirm or abort. The
//! pending create is what makes a create exactly-once across central and region: its sealed
//! intent re-drives it (one driver at a time, under a lease) until the region confirms or
//! refuses it, and its first response is kept for identical retries.

use uuid::Uuid;

use crate::read_model::{apply, ReadModelUpdate};
use crate::{CentralStore, Result, StoreError};

/// Where a create stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateState {
    /// Not settled yet: the sealed intent re-drives it.
    Pending {
        team_id: Uuid,
        sealed_intent: Vec<u8>,
    },
    /// Confirmed by the region: its first response, sealed, for replays.
    Settled {
        team_id: Uuid,
        status_code: u16,
        sealed_response: Vec<u8>,
    },
}

/// A pending create that recovery may try again now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueCreate {
    pub di_id: Uuid,
    pub team_id: Uuid,
    /// Failed attempts so far.
    pub attempts: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateBegin {
    Started,
    KeyTaken,
}

pub struct NewCreate<'a> {
    pub di_id: Uuid,
    pub team_id: Uuid,
    pub region: &'a str,
    pub name: &'a str,
    pub fingerprint: &'a [u8],
    pub sealed_intent: &'a [u8],
    pub idempotency_key: Option<&'a str>,
}

impl CentralStore {
    /// Reserves the id and the name, records how to re-drive the create, and claims the
    /// idempotency key for it, all in one transaction. `NameTaken` when the team already has a DI
    /// of that name; `KeyTaken` when the key already stands for another request.
    pub async fn create_begin(&self, new: &NewCreate<'_>) -> Result<CreateBegin> {
        let mut tx = self.pool.begin().await?;
        if let Some(key) = new.idempotency_key {
            let claimed = sqlx::query(
                "INSERT INTO idempotency_keys (team_id, key, fingerprint, di_id) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            )
            .bind(new.team_id)
            .bind(key)
            .bind(new.fingerprint)
            .bind(new.di_id)
            .execute(&mut *tx)
            .await?;
            if claimed.rows_affected() == 0 {
                return Ok(CreateBegin::KeyTaken);
            }
        }
        let inserted = sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, name, state, status, create_fingerprint)
             VALUES ($1, $2, $3, $4, 'pending', 'new', $5)",
        )
        .bind(new.di_id)
        .bind(new.team_id)
        .bind(new.region)
        .bind(new.name)
        .bind(new.fingerprint)
        .execute(&mut *tx)
        .await;
        if let Err(sqlx::Error::Database(e)) = &inserted {
            if e.constraint() == Some("dedicated_inferences_team_name") {
                return Err(StoreError::NameTaken);
            }
        }
        inserted?;
        sqlx::query("INSERT INTO pending_creates (di_id, sealed) VALUES ($1, $2)")
            .bind(new.di_id)
            .bind(new.sealed_intent)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.cache.invalidate(new.di_id, new.team_id);
        Ok(CreateBegin::Started)
    }

    /// The team's DI that holds this name, if a request with this fingerprint created it within
    /// `window`: a client retrying a create whose answer it may never have got.
    pub async fn create_by_fingerprint(
        &self,
        team_id: Uuid,
        name: &str,
        fingerprint: &[u8],
        window: std::time::Duration,
    ) -> Result<Option<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT id FROM dedicated_inferences
             WHERE team_id = $1 AND name = $2 AND state <> 'gone' AND status <> 'deleting'
               AND create_fingerprint = $3 AND created_at > now() - make_interval(secs => $4)",
        )
        .bind(team_id)
        .bind(name)
        .bind(fingerprint)
        .bind(window.as_secs_f64())
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Where the create of `di_id` stands; `None` when it was aborted, or settled so long ago
    /// that its response is no longer kept.
    pub async fn create_state(&self, di_id: Uuid) -> Result<Option<CreateState>> {
        type Row = (Uuid, Option<Vec<u8>>, Option<i32>, Option<Vec<u8>>);
        let row: Option<Row> = sqlx::query_as(
            "SELECT d.team_id, p.sealed, d.create_status_code, d.create_response
             FROM dedicated_inferences d LEFT JOIN pending_creates p ON p.di_id = d.id WHERE d.id = $1",
        )
        .bind(di_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            Some((team_id, Some(sealed_intent), _, _)) => Some(CreateState::Pending {
                team_id,
                sealed_intent,
            }),
            Some((team_id, None, Some(code), Some(sealed_response))) => {
                Some(CreateState::Settled {
                    team_id,
                    status_code: code as u16,
                    sealed_response,
                })
            }
            _ => None,
        })
    }

    /// Pending creates older than `age` whose next attempt is due: what recovery re-drives.
    pub async fn pending_creates_due(&self, age: std::time::Duration) -> Result<Vec<DueCreate>> {
        let rows: Vec<(Uuid, Uuid, i32)> = sqlx::query_as(
            "SELECT p.di_id, d.team_id, p.attempts FROM pending_creates p JOIN dedicated_inferences d ON d.id = p.di_id
             WHERE p.created_at < now() - make_interval(secs => $1) AND (p.retry_at IS NULL OR p.retry_at <= now())
               AND (p.driven_until IS NULL OR p.driven_until <= now())
             ORDER BY p.created_at LIMIT 100",
        )
        .bind(age.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(di_id, team_id, attempts)| DueCreate {
                di_id,
                team_id,
                attempts,
            })
            .collect())
    }

    /// Pending creates older than `window` that never settled: recovery stops trying them.
    pub async fn pending_creates_older_than(
        &self,
        window: std::time::Duration,
    ) -> Result<Vec<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT di_id FROM pending_creates WHERE created_at < now() - make_interval(secs => $1)
             ORDER BY created_at LIMIT 100",
        )
        .bind(window.as_secs_f64())
        .fetch_all(&self.pool)
        .await?)
    }

    /// Counts a failed attempt at a pending create and puts the next one off by `delay`.
    pub async fn create_retry_later(&self, di_id: Uuid, delay: std::time::Duration) -> Result<()> {
        sqlx::query(
            "UPDATE pending_creates SET attempts = attempts + 1, retry_at = now() + make_interval(secs => $2) WHERE di_id = $1",
        )
        .bind(di_id)
        .bind(delay.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The region has the DI: the ownership row goes live with the region's view, the intent is
    /// dropped, and the response is stored for replays: of every idempotency key of this create,
    /// and of identical retries without one. A response stored first stays; none is stored for a
    /// DI gone meanwhile (its secrets, the managed token among them, were erased with it).
    pub async fn create_confirm(
        &self,
        update: &ReadModelUpdate<'_>,
        status_code: u16,
        sealed_response: &[u8],
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        apply(&mut tx, update).await?;
        sqlx::query(
            "UPDATE dedicated_inferences SET state = CASE WHEN state = 'pending' THEN 'live' ELSE state END,
                 create_status_code = coalesce(create_status_code, $2), create_response = coalesce(create_response, $3)
             WHERE id = $1 AND state <> 'gone'",
        )
        .bind(update.id)
        .bind(status_code as i32)
        .bind(sealed_response)
        .execute(&mut *tx)
        .await?;
        // The create's keys: its response, or, for a DI gone since (deleted before this confirm
        // arrived), only its status: they read as erased and keep no managed token.
        sqlx::query(
            "UPDATE idempotency_keys SET status_code = $2,
                 sealed_body = CASE WHEN EXISTS (SELECT 1 FROM dedicated_inferences WHERE id = $1 AND state = 'gone')
                                    THEN NULL ELSE $3 END
             WHERE di_id = $1 AND status_code IS NULL",
        )
        .bind(update.id)
        .bind(status_code as i32)
        .bind(sealed_response)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM pending_creates WHERE di_id = $1")
            .bind(update.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.cache.invalidate(update.id, update.team_id);
        Ok(())
    }

    /// Takes the right to send pending create `di_id` to its region for `lease`: `false` while
    /// another driver (a request, a retry, recovery, another replica) holds it. One attempt at a
    /// time is what lets a region's "changed nothing" settle the create.
    pub async fn create_drive_begin(
        &self,
        di_id: Uuid,
        lease: std::time::Duration,
    ) -> Result<bool> {
        let taken = sqlx::query(
            "UPDATE pending_creates SET driven_until = now() + make_interval(secs => $2)
             WHERE di_id = $1 AND (driven_until IS NULL OR driven_until <= now())",
        )
        .bind(di_id)
        .bind(lease.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(taken.rows_affected() == 1)
    }

    /// Gives the right taken by [`CentralStore::create_drive_begin`] back (a no-op once the
    /// create is settled).
    pub async fn create_drive_end(&self, di_id: Uuid) -> Result<()> {
        sqlx::query("UPDATE pending_creates SET driven_until = NULL WHERE di_id = $1")
            .bind(di_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The region refused the create: nothing exists there, so nothing may remain here.
    pub async fn create_abort(&self, di_id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM idempotency_keys WHERE di_id = $1")
            .bind(di_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM pending_creates WHERE di_id = $1")
            .bind(di_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM dedicated_inferences WHERE id = $1 AND state = 'pending'")
            .bind(di_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        // A pending row: no list shows it.
        self.cache.row_changed(di_id);
        Ok(())
    }
}
