//! Stall tracking: each DI's progress fingerprint, how long it has been unchanged, and whether
//! that stall was reported.

use std::time::Duration;

use uuid::Uuid;

use crate::{Result, Store};

/// The progress fingerprint of a DI with nothing moving (see [`Store::work_progress`]).
pub const PROGRESS_IDLE: &str = "idle";

/// How long a DI's progress fingerprint has been unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub unchanged_for: Duration,
    /// Whether a stall event was already appended for this fingerprint.
    pub reported: bool,
    /// The fingerprint recorded before this one (None when there was none, or when idle was
    /// recorded over idle and nothing was written).
    pub previous: Option<String>,
}

impl Store {
    /// Records the DI's current progress fingerprint (under a lease, only while it is held: the
    /// statement carries its token) (what it waits for, in which phase) and
    /// says how long it has been unchanged. [`PROGRESS_IDLE`] (nothing moving) is not timed:
    /// writing it again is skipped, so a resync of a converged DI does not rewrite the row.
    pub async fn work_progress(&self, di_id: Uuid, key: &str) -> Result<Stall> {
        let (ms, reported, previous): (f64, bool, Option<String>) = sqlx::query_as(
            "WITH old AS (SELECT progress_key FROM work_items WHERE di_id = $1 FOR UPDATE)
             UPDATE work_items w SET
                 progress_since = CASE WHEN w.progress_key IS DISTINCT FROM $2 OR w.progress_since IS NULL
                                       THEN now() ELSE w.progress_since END,
                 stall_reported = CASE WHEN w.progress_key IS DISTINCT FROM $2 THEN false ELSE w.stall_reported END,
                 progress_key = $2
             FROM old
             WHERE w.di_id = $1 AND (w.progress_key IS DISTINCT FROM $2 OR $2 <> $3)
               AND ($4::uuid IS NULL OR w.lease_token = $4)
             RETURNING (extract(epoch FROM now() - w.progress_since) * 1000)::float8, w.stall_reported,
                       old.progress_key",
        )
        .bind(di_id)
        .bind(key)
        .bind(PROGRESS_IDLE)
        .bind(self.lease_token())
        .fetch_optional(&self.pool)
        .await?
        .unwrap_or((0.0, false, None));
        Ok(Stall {
            unchanged_for: Duration::from_millis(ms.max(0.0) as u64),
            reported,
            previous,
        })
    }

    /// Notes that the stall of the current fingerprint has been reported as an event.
    pub async fn work_stall_reported(&self, di_id: Uuid) -> Result<()> {
        sqlx::query(
            "UPDATE work_items SET stall_reported = true WHERE di_id = $1 AND ($2::uuid IS NULL OR lease_token = $2)",
        )
        .bind(di_id)
        .bind(self.lease_token())
        .execute(&self.pool)
            .await?;
        Ok(())
    }
}
