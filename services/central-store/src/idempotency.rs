//! Idempotency keys and the keyed operations behind them: a key claimed for a request's
//! fingerprint, the response it replays, and an unfinished operation's sealed request that
//! recovery re-drives (one driver at a time, under a lease) until it is answered.

use uuid::Uuid;

use crate::{CentralStore, Result};

/// What an `Idempotency-Key` already stands for.
#[derive(Debug, Clone)]
pub enum IdempotencyState {
    /// First use: the caller may proceed (and must complete or release the key).
    Fresh,
    /// Same key, different request: refuse.
    Mismatch,
    /// A request with this key was accepted but has no stored response yet (it crashed or is in
    /// flight); `di_id` says which create it belongs to, when it is one, and `sealed_operation`
    /// what to send to the region, when it is a keyed operation.
    Unfinished {
        di_id: Option<Uuid>,
        sealed_operation: Option<Vec<u8>>,
    },
    /// Replay this.
    Done {
        status_code: u16,
        sealed_body: Vec<u8>,
    },
    /// Answered once, but the DI it was about is gone and its response with it (it could hold
    /// the DI's secrets); `di_id` when the request was the DI's create.
    Erased { di_id: Option<Uuid> },
}

/// A write to an existing DI under an Idempotency-Key, as the caller sealed it.
#[derive(Debug, Clone, Copy)]
pub struct KeyedOperation<'a> {
    pub di_id: Uuid,
    pub sealed: &'a [u8],
}

/// An unfinished keyed operation that recovery may try again now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueOperation {
    pub team_id: Uuid,
    pub key: String,
    pub sealed_operation: Vec<u8>,
    /// Failed attempts so far.
    pub attempts: i32,
}

impl CentralStore {
    /// Claims `key` for a request with `fingerprint` and the operation it will run (if any), or
    /// says what the key already stands for.
    pub async fn idempotency_begin(
        &self,
        team_id: Uuid,
        key: &str,
        fingerprint: &[u8],
        operation: Option<KeyedOperation<'_>>,
    ) -> Result<IdempotencyState> {
        let claimed = sqlx::query(
            "INSERT INTO idempotency_keys (team_id, key, fingerprint, sealed_operation, target_di_id) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT DO NOTHING",
        )
        .bind(team_id)
        .bind(key)
        .bind(fingerprint)
        .bind(operation.map(|o| o.sealed))
        .bind(operation.map(|o| o.di_id))
        .execute(&self.pool)
        .await?;
        if claimed.rows_affected() == 1 {
            return Ok(IdempotencyState::Fresh);
        }
        self.idempotency_state(team_id, key, fingerprint).await
    }

    /// What `key` stands for, without claiming it; `Fresh` when nothing.
    pub async fn idempotency_state(
        &self,
        team_id: Uuid,
        key: &str,
        fingerprint: &[u8],
    ) -> Result<IdempotencyState> {
        type Row = (
            Vec<u8>,
            Option<Uuid>,
            Option<i32>,
            Option<Vec<u8>>,
            Option<Vec<u8>>,
        );
        let row: Option<Row> = sqlx::query_as(
            "SELECT fingerprint, di_id, status_code, sealed_body, sealed_operation FROM idempotency_keys WHERE team_id = $1 AND key = $2",
        )
        .bind(team_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            None => IdempotencyState::Fresh,
            Some((stored, ..)) if stored != fingerprint => IdempotencyState::Mismatch,
            Some((_, _, Some(code), Some(body), _)) => IdempotencyState::Done {
                status_code: code as u16,
                sealed_body: body,
            },
            Some((_, di_id, Some(_), None, _)) => IdempotencyState::Erased { di_id },
            Some((_, di_id, _, _, sealed_operation)) => IdempotencyState::Unfinished {
                di_id,
                sealed_operation,
            },
        })
    }

    /// Unfinished keyed operations older than `age` whose next attempt is due: what recovery
    /// re-drives.
    pub async fn unfinished_operations_due(
        &self,
        age: std::time::Duration,
    ) -> Result<Vec<DueOperation>> {
        let rows: Vec<(Uuid, String, Vec<u8>, i32)> = sqlx::query_as(
            "SELECT team_id, key, sealed_operation, attempts FROM idempotency_keys
             WHERE sealed_operation IS NOT NULL AND status_code IS NULL
               AND created_at < now() - make_interval(secs => $1) AND (retry_at IS NULL OR retry_at <= now())
               AND (driven_until IS NULL OR driven_until <= now())
             ORDER BY created_at LIMIT 100",
        )
        .bind(age.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(team_id, key, sealed_operation, attempts)| DueOperation {
                team_id,
                key,
                sealed_operation,
                attempts,
            })
            .collect())
    }

    /// Counts a failed attempt at a keyed operation and puts the next one off by `delay`.
    pub async fn operation_retry_later(
        &self,
        team_id: Uuid,
        key: &str,
        delay: std::time::Duration,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE idempotency_keys SET attempts = attempts + 1, retry_at = now() + make_interval(secs => $3)
             WHERE team_id = $1 AND key = $2 AND status_code IS NULL",
        )
        .bind(team_id)
        .bind(key)
        .bind(delay.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// As [`CentralStore::create_drive_begin`] for the keyed operation of `key`, while it has no
    /// answer yet.
    pub async fn operation_drive_begin(
        &self,
        team_id: Uuid,
        key: &str,
        lease: std::time::Duration,
    ) -> Result<bool> {
        let taken = sqlx::query(
            "UPDATE idempotency_keys SET driven_until = now() + make_interval(secs => $3)
             WHERE team_id = $1 AND key = $2 AND status_code IS NULL
               AND (driven_until IS NULL OR driven_until <= now())",
        )
        .bind(team_id)
        .bind(key)
        .bind(lease.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(taken.rows_affected() == 1)
    }

    /// As [`CentralStore::create_drive_end`] for the keyed operation of `key`.
    pub async fn operation_drive_end(&self, team_id: Uuid, key: &str) -> Result<()> {
        sqlx::query(
            "UPDATE idempotency_keys SET driven_until = NULL WHERE team_id = $1 AND key = $2",
        )
        .bind(team_id)
        .bind(key)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Stores the response for `key`; a response stored first (by a concurrent retry) stays. The
    /// operation is dropped: only a key without a response needs it, and it may hold a secret.
    pub async fn idempotency_complete(
        &self,
        team_id: Uuid,
        key: &str,
        status_code: u16,
        sealed_body: &[u8],
    ) -> Result<()> {
        sqlx::query("UPDATE idempotency_keys SET status_code = $3, sealed_body = $4, sealed_operation = NULL
                     WHERE team_id = $1 AND key = $2 AND status_code IS NULL")
            .bind(team_id)
            .bind(key)
            .bind(status_code as i32)
            .bind(sealed_body)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Forgets a key whose request had no lasting effect, so that a retry runs it again.
    pub async fn idempotency_release(&self, team_id: Uuid, key: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency_keys WHERE team_id = $1 AND key = $2 AND status_code IS NULL AND di_id IS NULL")
            .bind(team_id)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drops keys, and the responses kept for identical creates, older than `age` (replays are
    /// promised for 24 hours); returns how many.
    pub async fn idempotency_purge(&self, age: std::time::Duration) -> Result<u64> {
        let keys = sqlx::query(
            "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)
               AND (di_id IS NULL OR di_id NOT IN (SELECT di_id FROM pending_creates))",
        )
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await?;
        let creates = sqlx::query(
            "UPDATE dedicated_inferences SET create_fingerprint = NULL, create_status_code = NULL, create_response = NULL
             WHERE create_response IS NOT NULL AND created_at < now() - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(keys.rows_affected() + creates.rows_affected())
    }
}
