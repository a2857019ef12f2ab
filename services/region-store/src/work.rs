//! The workers' side of the store: the work queue with leases, stall tracking, and the teardown
//! ledger of external resources.

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use crate::{
    NewCa, ObservedAccelerator, Result, Store, StoreError, HF_TOKEN, PROBE_TOKEN,
    RETIRED_PROBE_TOKEN,
};

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

/// The database session a worker keeps open for as long as it lives: leases taken in its name
/// are free as soon as it ends (see [`Store::work_claim_in_session`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderSession {
    pub pid: i32,
    pub started: chrono::DateTime<chrono::Utc>,
}

impl HolderSession {
    /// The session of `conn`, which its owner keeps open (and idle) to stand for it.
    pub async fn of(conn: &mut PgConnection) -> Result<HolderSession> {
        let (pid, started): (i32, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await?;
        Ok(HolderSession { pid, started })
    }
}

/// Registers worker `worker_id` as living while `session` does, over that session's own
/// connection `conn` (see [`Store::work_claim`]: a worker claims only the DIs of its share of
/// the clusters), and forgets the workers that are gone.
pub async fn worker_register(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<()> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    sqlx::query(&format!("DELETE FROM workers k WHERE NOT {WORKER_LIVES}"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO workers (worker_id, pid, session_start) VALUES ($1, $2, $3)
         ON CONFLICT (worker_id) DO UPDATE SET pid = $2, session_start = $3, seen_at = now()",
    )
    .bind(worker_id)
    .bind(session.pid)
    .bind(session.started)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Says over `conn` (the session's own connection: a pool busy with passes must not make a
/// working worker look silent) that worker `worker_id`, registered with `session`, still works
/// (see [`WORKER_SILENT`]). False when its registration is gone or another session's (a worker
/// of the same name registered since): it must register again.
pub async fn worker_heartbeat(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE workers SET seen_at = now()
         WHERE worker_id = $1 AND pid = $2 AND session_start = $3",
    )
    .bind(worker_id)
    .bind(session.pid)
    .bind(session.started)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Withdraws worker `worker_id`'s registration under `session` as it begins to stop: the others
/// take its share at their next claim, while its session (and with it the leases of the passes
/// it lets finish) lives on.
pub async fn worker_deregister(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<()> {
    sqlx::query("DELETE FROM workers WHERE worker_id = $1 AND pid = $2 AND session_start = $3")
        .bind(worker_id)
        .bind(session.pid)
        .bind(session.started)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Whether the session the lease of `work_items` row `w` was taken in has ended (its holder
/// died). A session of another role may hide its start from this one: then its pid alone says
/// it lives.
pub(crate) const HOLDER_GONE: &str = "(w.holder_pid IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_stat_get_activity(w.holder_pid) a
        WHERE a.backend_start IS NULL OR a.backend_start = w.holder_session_start))";

/// A registered worker that has not said it works for this long counts as gone: its share of
/// the clusters goes to the others, though its session lives (a process that hangs keeps its
/// connections open). Several of its heartbeats (every 3 s), and well under a lease.
pub const WORKER_SILENT: Duration = Duration::from_secs(20);

/// Whether registered worker `k` lives: its session is open and it said it works within
/// [`WORKER_SILENT`] (20 s).
const WORKER_LIVES: &str = "(k.seen_at > now() - interval '20 seconds' AND EXISTS (
        SELECT 1 FROM pg_stat_get_activity(k.pid) a
        WHERE a.backend_start IS NULL OR a.backend_start = k.session_start))";

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

/// The progress fingerprint of a DI with nothing moving (see [`Store::work_progress`]).
pub const PROGRESS_IDLE: &str = "idle";

/// What a worker's pass over a converging DI reads besides the DI itself, read at once.
pub struct PassInputs {
    /// The teardown ledger, oldest first.
    pub ledger: Vec<LedgerEntry>,
    /// The accelerators as last recorded, by name.
    pub accelerators: Vec<ObservedAccelerator>,
    /// The DI's CAs in use, the one that expires first first (one, or two while a renewal
    /// overlaps).
    pub cas: Vec<NewCa>,
    /// Live access-token hashes (hex) by token id.
    pub token_hashes: Vec<(Uuid, String)>,
    pub hugging_face_token: Option<String>,
    /// The worker's probe token for this DI (see [`Store::probe_token`]).
    pub probe_token: String,
    /// The one it replaced, which the endpoint must refuse (see [`Store::retired_probe_token`]).
    pub retired_probe_token: Option<String>,
    /// The replica counts and autoscaler memory as last recorded, by model id.
    pub replicas: Vec<DeploymentReplicas>,
    /// The database's clock (milliseconds since the epoch): one clock for every worker.
    pub now_ms: i64,
    /// How long ago the DI's previous pass ended, by any worker (none before its first).
    pub since_last_pass_ms: Option<i64>,
    /// The DI's slot in a fleet rollout, if it has one.
    pub fleet_slot: Option<crate::FleetSlot>,
}

/// A model deployment's replica counts as the worker records them, with the autoscaler's memory
/// between its looks (`None` for a fixed scale). The store keeps the memory as given.
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentReplicas {
    pub model_id: Uuid,
    pub ready: u32,
    pub wanted: u32,
    pub autoscaler: Option<serde_json::Value>,
}

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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A DI due within this is left alone by a wake ([`Store::work_wake`]): it is moving, and is
/// looked at soon anyway.
pub const WAKE_UNLESS_DUE_WITHIN: Duration = Duration::from_secs(3);

impl Store {
    // -----------------------------------------------------------------------------------------
    // Work queue

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

    // -----------------------------------------------------------------------------------------
    // Teardown ledger

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

    /// Everything a converging pass reads besides the DI, over one connection: each separate
    /// checkout would cost a round trip of its own for the pool's release ping.
    pub async fn pass_inputs(&self, di_id: Uuid) -> Result<PassInputs> {
        // One statement: a pass starts with this read, and every resync of a converged DI makes
        // it, so its round trips are a good part of what a resync costs Postgres.
        let row: PassInputsRow = sqlx::query_as(&format!(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
                (SELECT (extract(epoch FROM clock_timestamp() - checked_at) * 1000)::bigint
                 FROM work_items WHERE di_id = $1) AS since_last_pass_ms,
                (SELECT coalesce(json_agg(json_build_object('model_id', model_id, 'ready', ready,
                     'wanted', wanted, 'autoscaler', autoscaler) ORDER BY model_id), '[]')
                 FROM deployment_replicas WHERE di_id = $1) AS replicas,
                (SELECT coalesce(json_agg(json_build_object('seq', seq, 'kind', kind, 'name', name,
                     'scope', scope, 'external_id', external_id, 'retiring', retiring) ORDER BY seq), '[]')
                 FROM teardown_ledger WHERE di_id = $1) AS ledger,
                (SELECT coalesce(json_agg(json_build_object('name', name, 'slug', slug, 'role', role,
                     'status', status) ORDER BY name), '[]')
                 FROM accelerators WHERE di_id = $1) AS accelerators,
                (SELECT coalesce(json_agg(json_build_object('cert_pem', cert_pem,
                     'key_sealed', encode(key_sealed, 'hex'),
                     'not_after_us', (extract(epoch FROM not_after) * 1000000)::bigint) ORDER BY not_after), '[]')
                 FROM certificate_authorities WHERE {IN_USE}) AS cas,
                (SELECT coalesce(json_agg(json_build_array(id, encode(token_hash, 'hex')) ORDER BY id), '[]')
                 FROM access_tokens WHERE di_id = $1 AND revoked_at IS NULL) AS token_hashes,
                (SELECT coalesce(json_object_agg(kind, encode(sealed, 'hex')), '{{}}')
                 FROM provider_secrets WHERE di_id = $1 AND kind = ANY($2)) AS secrets,
                (SELECT json_build_object('rendering', rendering, 'canary', canary, 'state', state,
                     'previous', previous, 'started_ms', (extract(epoch FROM started_at) * 1000)::bigint)
                 FROM fleet_slots WHERE di_id = $1) AS fleet_slot",
            IN_USE = crate::authorities::IN_USE
        ))
        .bind(di_id)
        .bind([HF_TOKEN, PROBE_TOKEN, RETIRED_PROBE_TOKEN])
        .fetch_one(&self.pool)
        .await?;
        let secret = |kind: &str| -> Result<Option<String>> {
            let Some(sealed) = row.secrets.0.get(kind) else {
                return Ok(None);
            };
            let sealed = hex::decode(sealed).map_err(|_| StoreError::Seal)?;
            self.open_secret(di_id, kind, &sealed).map(Some)
        };
        let probe_token = match secret(PROBE_TOKEN)? {
            Some(token) => token,
            // The DI's first pass: minted (once, whoever asks first).
            None => self.probe_token(di_id).await?,
        };
        let cas = row
            .cas
            .0
            .into_iter()
            .map(|ca| {
                let key_sealed = hex::decode(&ca.key_sealed).map_err(|_| StoreError::Seal)?;
                let not_after = chrono::DateTime::from_timestamp_micros(ca.not_after_us)
                    .ok_or(StoreError::Seal)?;
                self.open_ca(di_id, ca.cert_pem, &key_sealed, not_after)
            })
            .collect::<Result<Vec<_>>>()?;
        let fleet_slot = row
            .fleet_slot
            .map(|slot| -> Result<crate::FleetSlot> {
                let slot = slot.0;
                Ok(crate::FleetSlot {
                    rendering: slot.rendering,
                    canary: slot.canary,
                    state: crate::fleet::SlotState::parse(&slot.state)?,
                    previous: slot.previous,
                    started_ms: slot.started_ms,
                })
            })
            .transpose()?;
        Ok(PassInputs {
            fleet_slot,
            replicas: row.replicas.0.into_iter().map(Into::into).collect(),
            now_ms: row.now_ms,
            since_last_pass_ms: row.since_last_pass_ms,
            ledger: row.ledger.0,
            accelerators: row.accelerators.0,
            cas,
            token_hashes: row.token_hashes.0,
            hugging_face_token: secret(HF_TOKEN)?,
            probe_token,
            retired_probe_token: secret(RETIRED_PROBE_TOKEN)?,
        })
    }

    /// Records DI `di_id`'s replica counts and autoscaler memory (rows of deployments not in
    /// `rows` go), with an event per scaling decision. A change customers can see (a count, an
    /// event) reaches the change feed; the autoscaler's memory alone does not.
    pub async fn replicas_record(
        &self,
        di_id: Uuid,
        rows: &[DeploymentReplicas],
        events: &[(&str, String)],
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = crate::lock_live(&mut tx, di_id, None).await?;
        self.fence(&mut tx, di_id).await?;
        let before = replicas_on(&mut tx, di_id).await?;
        let visible = |r: &[DeploymentReplicas]| {
            let mut v: Vec<(Uuid, u32, u32)> =
                r.iter().map(|r| (r.model_id, r.ready, r.wanted)).collect();
            v.sort();
            v
        };
        let seen_changed = visible(&before) != visible(rows);
        let ids: Vec<Uuid> = rows.iter().map(|r| r.model_id).collect();
        sqlx::query(
            "DELETE FROM deployment_replicas WHERE di_id = $1 AND NOT (model_id = ANY($2))",
        )
        .bind(di_id)
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        for r in rows {
            sqlx::query(
                "INSERT INTO deployment_replicas (di_id, model_id, ready, wanted, autoscaler) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (di_id, model_id) DO UPDATE SET ready = excluded.ready, wanted = excluded.wanted,
                     autoscaler = excluded.autoscaler, updated_at = now()",
            )
            .bind(di_id)
            .bind(r.model_id)
            .bind(i32::try_from(r.ready).unwrap_or(i32::MAX))
            .bind(i32::try_from(r.wanted).unwrap_or(i32::MAX))
            .bind(&r.autoscaler)
            .execute(&mut *tx)
            .await?;
        }
        for (reason, message) in events {
            crate::change(&mut tx, di_id, row.status, reason, message, false).await?;
        }
        if seen_changed && events.is_empty() {
            crate::outbox_only(&mut tx, di_id, "ReplicasChanged").await?;
        }
        tx.commit().await?;
        Ok(())
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

/// What [`Store::pass_inputs`] reads, in one row.
#[derive(sqlx::FromRow)]
struct PassInputsRow {
    now_ms: i64,
    since_last_pass_ms: Option<i64>,
    replicas: Json<Vec<ReplicasRow>>,
    ledger: Json<Vec<LedgerEntry>>,
    accelerators: Json<Vec<ObservedAccelerator>>,
    cas: Json<Vec<CaRow>>,
    token_hashes: Json<Vec<(Uuid, String)>>,
    /// Sealed secrets (hex) by kind.
    secrets: Json<std::collections::HashMap<String, String>>,
    fleet_slot: Option<Json<FleetSlotRow>>,
}

#[derive(serde::Deserialize)]
struct CaRow {
    cert_pem: String,
    key_sealed: String,
    not_after_us: i64,
}

#[derive(serde::Deserialize)]
struct FleetSlotRow {
    rendering: String,
    canary: bool,
    state: String,
    previous: serde_json::Value,
    started_ms: i64,
}

/// A `deployment_replicas` row as `pass_inputs` reads it (JSON).
#[derive(serde::Deserialize)]
struct ReplicasRow {
    model_id: Uuid,
    ready: i32,
    wanted: i32,
    autoscaler: Option<serde_json::Value>,
}

impl From<ReplicasRow> for DeploymentReplicas {
    fn from(r: ReplicasRow) -> Self {
        DeploymentReplicas {
            model_id: r.model_id,
            ready: r.ready.max(0) as u32,
            wanted: r.wanted.max(0) as u32,
            autoscaler: r.autoscaler,
        }
    }
}

async fn replicas_on(conn: &mut PgConnection, di_id: Uuid) -> Result<Vec<DeploymentReplicas>> {
    let rows: Vec<(Uuid, i32, i32, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT model_id, ready, wanted, autoscaler FROM deployment_replicas WHERE di_id = $1 ORDER BY model_id",
    )
    .bind(di_id)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(model_id, ready, wanted, autoscaler)| DeploymentReplicas {
            model_id,
            ready: ready.max(0) as u32,
            wanted: wanted.max(0) as u32,
            autoscaler,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_counts_as_gone_after_the_silence_its_constant_says() {
        let said = format!("interval '{} seconds'", WORKER_SILENT.as_secs());
        assert!(WORKER_LIVES.contains(&said), "{WORKER_LIVES}");
    }
}
