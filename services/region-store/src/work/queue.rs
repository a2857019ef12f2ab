//! The work queue: which DIs are due, claiming them under a lease (per worker's share of the
//! clusters), renewing and releasing leases, and waking DIs whose objects changed.

use std::time::Duration;

use uuid::Uuid;

use super::workers::{HolderSession, WORKER_LIVES};
use crate::{Result, Store};

/// A lease on one DI: only the holder of `lease_token` may renew or release it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub di_id: Uuid,
    pub lease_token: Uuid,
    /// When the claim was sent: the database started the lease no earlier.
    pub claimed_at: std::time::Instant,
    /// The DI's newest outbox position when it was claimed: changes up to here are being handled.
    pub seq: i64,
    /// The DI was still leased by someone, but that lease had expired: it was taken over from a
    /// worker that died or stopped renewing (a released lease is not one).
    pub lease_expired: bool,
    /// The W3C trace context of the request whose change this work carries out, if any.
    pub traceparent: Option<String>,
}

/// Whether the session the lease of `work_items` row `w` was taken in has ended (its holder
/// died). A session of another role may hide its start from this one: then its pid alone says
/// it lives.
pub(crate) const HOLDER_GONE: &str = "(w.holder_pid IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_stat_get_activity(w.holder_pid) a
        WHERE a.backend_start IS NULL OR a.backend_start = w.holder_session_start))";

/// Whether the lease of `work_items` row `w` is free: never taken, released, run out, or its
/// holder's session is gone.
fn lease_free() -> String {
    format!("(w.expires_at IS NULL OR w.expires_at <= now() OR {HOLDER_GONE})")
}

/// How many DIs the work queue holds, by state (for a gauge). Returned by
/// [`Store::work_depth`]; not re-exported from the crate root yet, so callers use its fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkDepth {
    /// Due and free to claim now (what [`Store::work_claim`] would take, without a limit).
    pub ready: i64,
    /// Held by a live lease (a pass is running).
    pub leased: i64,
}

/// What to claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimOptions {
    pub lease: Duration,
    pub limit: i64,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A DI due within this is left alone by a wake ([`Store::work_wake`]): it is moving, and is
/// looked at soon anyway.
pub const WAKE_UNLESS_DUE_WITHIN: Duration = Duration::from_secs(3);

impl Store {
    /// Claims up to `limit` DIs that need work and that no live lease holds, for `lease`. A DI is
    /// due when a customer changed it since a worker last looked at it (the workers' own changes
    /// do not count: the pass that made them knows), or, unless it is in `error`, when its
    /// `next_check_after` has passed. An `error` DI is thus not retried on a timer, but a
    /// change such as a revoked token still reaches its cluster: when that pass fails
    /// transiently, [`Store::work_release_to_retry`] has it tried again.
    /// `SKIP LOCKED` keeps concurrent claimers apart; an expired lease is free to take. The
    /// leases are known by no session of their holder: they are free when they run out.
    ///
    /// Only the DIs of `worker_id`'s share of the clusters are claimed: those whose VPC hashes
    /// highest with `worker_id` among the registered workers whose sessions live
    /// ([`worker_register`]) and `worker_id` itself. A worker alone, or one that claims
    /// before it has registered, counts itself in; when a worker joins or dies, only its share
    /// moves, and a lease held meanwhile keeps any DI to one pass at a time. A DI overdue by a
    /// minute (its check; or a change a customer asked for over a minute ago, with no pass over
    /// the DI in the last minute) is anyone's: its owner is stuck or has more than it can do.
    ///
    /// [`worker_register`]: super::worker_register
    pub async fn work_claim(
        &self,
        worker_id: &str,
        lease: Duration,
        limit: i64,
    ) -> Result<Vec<Claim>> {
        self.work_claim_in_session(worker_id, None, lease, limit)
            .await
    }

    /// As [`Store::work_claim`], the leases held in the name of `session`: besides when they
    /// run out, they are free once that session has ended (its worker died), and a lease whose
    /// holder's session has ended is free to take too.
    pub async fn work_claim_in_session(
        &self,
        worker_id: &str,
        session: Option<HolderSession>,
        lease: Duration,
        limit: i64,
    ) -> Result<Vec<Claim>> {
        let free = lease_free();
        let claimed_at = std::time::Instant::now();
        let rows: Vec<(Uuid, Uuid, i64, bool, Option<String>)> = sqlx::query_as(&format!(
            "WITH live AS MATERIALIZED (
                 SELECT k.worker_id FROM workers k
                 WHERE k.worker_id <> $1 AND {WORKER_LIVES}
                 UNION ALL SELECT $1
             ), due AS (
                 SELECT w.di_id, coalesce((SELECT max(o.seq) FROM outbox o WHERE o.di_id = w.di_id), 0) AS seq,
                        w.expires_at IS NOT NULL AS lease_expired
                 FROM work_items w JOIN dedicated_inferences d ON d.id = w.di_id
                 WHERE d.gone_at IS NULL
                   AND {free}
                   AND (((d.status <> 'error' OR w.retrying) AND w.next_check_after <= now())
                        OR w.requested_seq > w.seen_seq)
                   AND ($1 = (SELECT l.worker_id FROM live l
                              ORDER BY hashtext(l.worker_id || '/' || d.vpc_uuid::text) DESC, l.worker_id
                              LIMIT 1)
                        OR ((d.status <> 'error' OR w.retrying)
                            AND isfinite(w.next_check_after)
                            AND w.next_check_after <= now() - interval '60 seconds')
                        OR (w.requested_seq > w.seen_seq
                            AND w.requested_since <= now() - interval '60 seconds'
                            AND (w.checked_at IS NULL OR w.checked_at <= now() - interval '60 seconds')))
                 ORDER BY w.next_check_after
                 LIMIT $3
                 FOR UPDATE OF w SKIP LOCKED
             )
             UPDATE work_items w
             SET holder = $1, lease_token = gen_random_uuid(),
                 expires_at = now() + $2 * interval '1 millisecond',
                 holder_pid = $4, holder_session_start = $5, woken = false
             FROM due WHERE w.di_id = due.di_id
             RETURNING w.di_id, w.lease_token, due.seq, due.lease_expired, w.traceparent"
        ))
        .bind(worker_id)
        .bind(millis(lease) as f64)
        .bind(limit)
        .bind(session.map(|s| s.pid))
        .bind(session.map(|s| s.started))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(di_id, lease_token, seq, lease_expired, traceparent)| Claim {
                    di_id,
                    lease_token,
                    claimed_at,
                    seq,
                    lease_expired,
                    traceparent,
                },
            )
            .collect())
    }

    /// The queue's depth: DIs due and free to claim, and DIs under a live lease. `ready` uses
    /// the same conditions as [`Store::work_claim`]. One pass over `work_items` (a row per live
    /// DI), cheap enough to sample every few seconds.
    pub async fn work_depth(&self) -> Result<WorkDepth> {
        let free = lease_free();
        let (ready, leased): (i64, i64) = sqlx::query_as(&format!(
            "SELECT
                 count(*) FILTER (
                     WHERE {free}
                       AND (((d.status <> 'error' OR w.retrying) AND w.next_check_after <= now())
                            OR w.requested_seq > w.seen_seq)),
                 count(*) FILTER (WHERE NOT {free})
             FROM work_items w JOIN dedicated_inferences d ON d.id = w.di_id
             WHERE d.gone_at IS NULL"
        ))
        .fetch_one(&self.pool)
        .await?;
        Ok(WorkDepth { ready, leased })
    }

    /// Extends a lease; false when it is no longer ours: expired and taken, released, or taken
    /// in a session that has ended (others may take it: its holder must stop).
    pub async fn work_renew(
        &self,
        di_id: Uuid,
        lease_token: Uuid,
        lease: Duration,
    ) -> Result<bool> {
        let done = sqlx::query(&format!(
            "UPDATE work_items w SET expires_at = now() + $3 * interval '1 millisecond'
             WHERE di_id = $1 AND lease_token = $2 AND NOT {HOLDER_GONE}"
        ))
        .bind(di_id)
        .bind(lease_token)
        .bind(millis(lease) as f64)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives a lease back: the DI is next due after `next_check_after` (or as soon as it changes
    /// past `seen_seq`, the outbox position the worker acted on). False when it was not ours.
    pub async fn work_release(
        &self,
        di_id: Uuid,
        lease_token: Uuid,
        seen_seq: i64,
        next_check_after: Duration,
    ) -> Result<bool> {
        self.release(di_id, lease_token, seen_seq, next_check_after, false)
            .await
    }

    /// As [`Store::work_release`] after a pass that failed transiently: the DI is tried again
    /// after `next_check_after` whatever its status, `error` included.
    pub async fn work_release_to_retry(
        &self,
        di_id: Uuid,
        lease_token: Uuid,
        seen_seq: i64,
        next_check_after: Duration,
    ) -> Result<bool> {
        self.release(di_id, lease_token, seen_seq, next_check_after, true)
            .await
    }

    async fn release(
        &self,
        di_id: Uuid,
        lease_token: Uuid,
        seen_seq: i64,
        next_check_after: Duration,
        retrying: bool,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE work_items SET holder = NULL, lease_token = NULL, expires_at = NULL,
                 holder_pid = NULL, holder_session_start = NULL,
                 next_check_after = CASE WHEN woken AND NOT $5 AND $4 > $6 THEN now()
                                         ELSE now() + $4 * interval '1 millisecond' END,
                 woken = false,
                 seen_seq = greatest(seen_seq, $3), checked_at = now(), retrying = $5
             WHERE di_id = $1 AND lease_token = $2",
        )
        .bind(di_id)
        .bind(lease_token)
        .bind(seen_seq)
        .bind(millis(next_check_after) as f64)
        .bind(retrying)
        .bind(millis(WAKE_UNLESS_DUE_WITHIN) as f64)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Makes DIs `ids` due now: their Kubernetes objects changed and their worker did not
    /// wait for it (a cluster watch saw it). Those already due within
    /// [`WAKE_UNLESS_DUE_WITHIN`] are left as they are, so the passes of a DI that is moving
    /// are not multiplied; a DI under a lease is marked, as its pass may have looked before the
    /// change: its release makes it due at once, unless it is due soon anyway or backs off from
    /// a failure (see [`Store::work_release`]). Returns how many were woken.
    pub async fn work_wake(&self, ids: &[Uuid]) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE work_items SET next_check_after = least(next_check_after, now()),
                 woken = holder IS NOT NULL
             WHERE di_id = ANY($1)
               AND (holder IS NOT NULL OR next_check_after > now() + $2 * interval '1 millisecond')",
        )
        .bind(ids)
        .bind(millis(WAKE_UNLESS_DUE_WITHIN) as f64)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
