//! The regional store: every SQL statement of a regional service and its workers, in
//! resource-first methods (`dedicated_inference_create`, `token_revoke`, `rollout_complete`…).
//!
//! It owns the rules that must hold under concurrency — versions, immutable fields, which status
//! may follow which, each team's quotas ([`Quotas`]), a worker's lease on the DI it works on
//! ([`Store::under_lease`]) — and makes every state change one transaction that also appends an
//! event and an outbox entry. It seals secrets before they reach a table and erases a DI's when
//! the DI is gone. It knows nothing about HTTP, the catalog (the GPUs per node a quota counts are
//! given to it), or the cloud.

mod authorities;
mod fleet;
mod passes;
mod quotas;
mod records;
mod requests;
mod reseal;
mod work;

pub use authorities::NewCa;
pub use fleet::{FleetBudget, FleetSlot, Held, RolloutProgress, RolloutState, SlotState, Take};
pub use reseal::ResealReport;

pub use quotas::{QuotaOverrides, Quotas};
pub use work::{worker_deregister, worker_heartbeat, worker_register};
pub use work::{
    Claim, ClaimOptions, ClusterRelease, DeploymentReplicas, HolderSession, LedgerEntry,
    PassInputs, Stall, PROGRESS_IDLE, WORKER_SILENT,
};

use api_types::lifecycle::{Event as Transition, Status};
use api_types::regional::{
    Accelerator, Changes, CreateRequest, Event, NewToken, Page, Record, Token,
};
use api_types::spec::{ModelDeployment, Spec};
use std::sync::Arc;

use common::errors::{Classify, ErrorClass};
use common::seal::Sealer;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

pub use sqlx;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/region");

/// What can go wrong, in terms a caller can act on. Database failures carry the driver's error
/// for the log; callers never show it to a customer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unprocessable(String),
    /// The database is unavailable for now (restarting, failing over, out of connections) or
    /// asked for a retry: the same request may succeed later ([`common::db::unavailable`]).
    #[error("database unavailable: {0}")]
    Unavailable(sqlx::Error),
    #[error("database: {0}")]
    Database(sqlx::Error),
    #[error("a sealed secret could not be opened")]
    Seal,
    /// A worker's write under a lease it no longer holds (see [`Store::under_lease`]): another
    /// worker may have the DI now, and the write was not made.
    #[error("the lease on this dedicated inference is no longer held")]
    LeaseLost,
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        common::db::classify(e, StoreError::Unavailable, StoreError::Database)
    }
}

impl Classify for StoreError {
    fn class(&self) -> ErrorClass {
        match self {
            StoreError::NotFound => ErrorClass::NotFound,
            StoreError::Conflict(_) => ErrorClass::Conflict,
            StoreError::Unprocessable(_) => ErrorClass::Refused,
            // The driver's error, classed once by `common::db::classify`.
            StoreError::Unavailable(_) => ErrorClass::TRANSIENT,
            StoreError::Database(_) | StoreError::Seal => ErrorClass::Permanent,
            // The writer's lease is gone for good: that write, sent again under it, is refused
            // again. The lease's new holder carries on; the worker stops its pass (it reads the
            // variant, which says more than any class).
            StoreError::LeaseLost => ErrorClass::Permanent,
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// An accelerator as a worker observed it on a real node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct ObservedAccelerator {
    pub name: String,
    pub slug: String,
    pub role: String,
    pub status: String,
}

/// Where the endpoints of a rolled-out spec answer.
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    pub public_fqdn: Option<String>,
    pub private_fqdn: Option<String>,
}

/// Which DIs changed after an outbox position, and the position the batch ends at.
#[derive(Debug, Clone)]
pub struct ChangedBatch {
    pub ids: Vec<Uuid>,
    pub last_seq: i64,
}

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    sealer: Sealer,
    /// Central's operation id for the lifecycle writes made through this store (see
    /// [`Store::for_operation`]).
    operation: Option<Uuid>,
    /// The worker's lease every write about its DI is fenced by (see [`Store::under_lease`]).
    lease: Option<Lease>,
    /// Limits every create and patch is checked against ([`Store::with_quotas`]).
    quotas: Option<Arc<Quotas>>,
}

/// A worker's lease on one DI: the fencing token of its writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    di_id: Uuid,
    token: Uuid,
}

const HF_TOKEN: &str = "hugging_face_token";
/// The worker's endpoint probe credential of one DI (see [`Store::probe_token`]).
const PROBE_TOKEN: &str = "probe_token";
pub(crate) const RETIRED_PROBE_TOKEN: &str = "retired_probe_token";

impl Store {
    pub fn new(pool: PgPool, sealer: Sealer) -> Store {
        Store {
            pool,
            sealer,
            operation: None,
            lease: None,
            quotas: None,
        }
    }

    /// This store, with every create and patch checked against `quotas` (the regional service's
    /// store). Without, nothing is limited: the workers, which never create a DI or grow one.
    pub fn with_quotas(self, quotas: Quotas) -> Store {
        Store {
            quotas: Some(Arc::new(quotas)),
            ..self
        }
    }

    /// This store, for a worker's pass over DI `di_id` under the lease `lease_token` (see
    /// [`Claim`]): every write it makes about a DI first checks, in the write's own
    /// transaction, that this lease is still the DI's and has not run out, and otherwise fails
    /// with [`StoreError::LeaseLost`] and writes nothing. The check share-locks the lease's row
    /// until commit, so the lease cannot be taken over while such a write commits. A worker that
    /// stalled past its lease (a paused process, a slow network, a database failover) therefore
    /// cannot overwrite what the DI's next worker does.
    pub fn under_lease(&self, di_id: Uuid, lease_token: Uuid) -> Store {
        Store {
            lease: Some(Lease {
                di_id,
                token: lease_token,
            }),
            ..self.clone()
        }
    }

    /// The token of the lease this store writes under, if any.
    pub(crate) fn lease_token(&self) -> Option<Uuid> {
        self.lease.map(|l| l.token)
    }

    /// The lease check of a write about DI `id` (see [`Store::under_lease`]); nothing without a
    /// lease. It locks the DI's row (at least against key changes, which every write about the
    /// DI needs anyway: a foreign key check takes that lock) before the lease's row: the regional
    /// service's writes lock the DI's row and then update the lease's, and one order everywhere
    /// is what keeps them from deadlocking. A lease taken in a session that has ended is lost
    /// too: other workers may take it.
    pub(crate) async fn fence(&self, conn: &mut PgConnection, id: Uuid) -> Result<()> {
        let Some(lease) = self.lease else {
            return Ok(());
        };
        sqlx::query("SELECT 1 FROM dedicated_inferences WHERE id = $1 FOR KEY SHARE")
            .bind(id)
            .execute(&mut *conn)
            .await?;
        let held: Option<i32> = sqlx::query_scalar(&format!(
            "SELECT 1 FROM work_items w WHERE di_id = $1 AND lease_token = $2 AND expires_at > now()
               AND NOT {} FOR SHARE",
            work::HOLDER_GONE
        ))
        .bind(lease.di_id)
        .bind(lease.token)
        .fetch_optional(&mut *conn)
        .await?;
        if held.is_none() || lease.di_id != id {
            return Err(StoreError::LeaseLost);
        }
        Ok(())
    }

    /// This store, with the lifecycle writes central may send again (patch, delete, token create
    /// and revoke) applied at most once for `operation`: a repeat answers with the current state.
    pub fn for_operation(&self, operation: Option<Uuid>) -> Store {
        Store {
            operation,
            ..self.clone()
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn migrate(&self) -> std::result::Result<(), sqlx::migrate::MigrateError> {
        common::db::migrate(&MIGRATOR, &self.pool).await
    }

    /// The provider secret `kind` of DI `id`, unsealed.
    async fn secret_on(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        kind: &str,
    ) -> Result<Option<String>> {
        let sealed: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT sealed FROM provider_secrets WHERE di_id = $1 AND kind = $2",
        )
        .bind(id)
        .bind(kind)
        .fetch_optional(&mut *conn)
        .await?;
        sealed.map(|s| self.open_secret(id, kind, &s)).transpose()
    }

    /// DI `id`'s secret of `kind`, unsealed.
    pub(crate) fn open_secret(&self, id: Uuid, kind: &str, sealed: &[u8]) -> Result<String> {
        let plain = self
            .sealer
            .open(sealed, secret_aad(id, kind).as_bytes())
            .map_err(|_| StoreError::Seal)?;
        String::from_utf8(plain).map_err(|_| StoreError::Seal)
    }

    pub(crate) async fn hugging_face_token_on(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
    ) -> Result<Option<String>> {
        self.secret_on(conn, id, HF_TOKEN).await
    }

    /// Any DI, including gone ones, for internal consumers (central's recovery, workers).
    pub async fn dedicated_inference_any(&self, id: Uuid) -> Result<Record> {
        self.record(id, None, true).await
    }

    /// Applies `event` when the table allows it from the DI's status (a no-op otherwise).
    async fn transition(
        &self,
        id: Uuid,
        event: Transition,
        reason: &str,
        message: &str,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        if let Some(to) = row.status.after(event).filter(|to| *to != row.status) {
            sqlx::query(
                "UPDATE dedicated_inferences SET status = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(to.as_str())
            .execute(&mut *tx)
            .await?;
            change(&mut tx, id, to, reason, message, false).await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    pub(crate) async fn ensure_visible(&self, id: Uuid, team_id: Uuid) -> Result<()> {
        let found: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM dedicated_inferences WHERE id = $1 AND team_id = $2 AND gone_at IS NULL",
        )
        .bind(id)
        .bind(team_id)
        .fetch_optional(&self.pool)
        .await?;
        found.map(|_| ()).ok_or(StoreError::NotFound)
    }

    async fn put_secret(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
        kind: &str,
        value: &str,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO provider_secrets (di_id, kind, sealed) VALUES ($1, $2, $3)
             ON CONFLICT (di_id, kind) DO UPDATE SET sealed = excluded.sealed, updated_at = now()",
        )
        .bind(id)
        .bind(kind)
        .bind(
            self.sealer
                .seal(value.as_bytes(), secret_aad(id, kind).as_bytes()),
        )
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn record(&self, id: Uuid, team_id: Option<Uuid>, include_gone: bool) -> Result<Record> {
        records::load(&self.pool, id, team_id, include_gone).await
    }
}

pub(crate) async fn token_hashes_on(
    conn: &mut PgConnection,
    id: Uuid,
) -> Result<Vec<(Uuid, String)>> {
    let rows: Vec<(Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT id, token_hash FROM access_tokens WHERE di_id = $1 AND revoked_at IS NULL ORDER BY id",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, hash)| (id, hex::encode(hash)))
        .collect())
}

pub(crate) fn secret_aad(id: Uuid, kind: &str) -> String {
    format!("provider_secret:{id}:{kind}")
}

pub(crate) fn ca_aad(id: Uuid) -> String {
    format!("ca_key:{id}")
}

fn token_hash(token: &NewToken) -> Result<Vec<u8>> {
    let bytes = hex::decode(&token.sha256_hex)
        .map_err(|_| StoreError::Unprocessable("token hash is not hex".into()))?;
    if bytes.len() != 32 {
        return Err(StoreError::Unprocessable(
            "token hash must be a SHA-256".into(),
        ));
    }
    Ok(bytes)
}

struct LockedRow {
    status: Status,
    status_reason: Option<String>,
    region: String,
    vpc_uuid: Uuid,
    enable_public_endpoint: bool,
    current_version: Option<i32>,
    pending_version: Option<i32>,
}

/// A DI row's columns as [`lock_live`] reads them: status, status reason, region, VPC, public
/// endpoint, current version, pending version.
type DiColumns = (
    String,
    Option<String>,
    String,
    Uuid,
    bool,
    Option<i32>,
    Option<i32>,
);

/// Locks a live (not gone) DI row for the rest of the transaction.
pub(crate) async fn lock_live(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    team_id: Option<Uuid>,
) -> Result<LockedRow> {
    let row: Option<DiColumns> = sqlx::query_as(
        "SELECT status, status_reason, region, vpc_uuid, enable_public_endpoint, current_version, pending_version
         FROM dedicated_inferences WHERE id = $1 AND ($2::uuid IS NULL OR team_id = $2) AND gone_at IS NULL FOR UPDATE",
    )
    .bind(id)
    .bind(team_id)
    .fetch_optional(&mut **tx)
    .await?;
    let (
        status,
        status_reason,
        region,
        vpc_uuid,
        enable_public_endpoint,
        current_version,
        pending_version,
    ) = row.ok_or(StoreError::NotFound)?;
    Ok(LockedRow {
        status: records::parse_status(&status)?,
        status_reason,
        region,
        vpc_uuid,
        enable_public_endpoint,
        current_version,
        pending_version,
    })
}

/// A model deployment of the version a new spec replaces, for [`deployment_ids`].
#[derive(sqlx::FromRow)]
struct KnownDeployment {
    model_id: Uuid,
    model_slug: String,
    source_repository: String,
    source_revision: Option<String>,
    accelerator_slug: Option<String>,
    scale: Option<i32>,
}

/// Inserts one immutable spec version, its deployments identified by [`deployment_ids`].
async fn insert_spec_version(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    spec: &Spec,
    known: &[KnownDeployment],
) -> Result<()> {
    sqlx::query(
        "INSERT INTO spec_versions (di_id, version, id, name, enable_public_endpoint, vpc_uuid) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(spec.version)
    .bind(Uuid::new_v4())
    .bind(&spec.name)
    .bind(spec.enable_public_endpoint)
    .bind(spec.vpc_uuid)
    .execute(&mut **tx)
    .await?;
    let ids = deployment_ids(&spec.model_deployments, known)?;
    for (position, (deployment, model_id)) in spec.model_deployments.iter().zip(ids).enumerate() {
        sqlx::query(
            "INSERT INTO model_deployments (di_id, version, position, model_id, model_slug, model_provider, workload_config,
                 provider_model_id, source_repository, source_revision, source_custom, source_commit)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        )
        .bind(id)
        .bind(spec.version)
        .bind(position as i32)
        .bind(model_id)
        .bind(&deployment.model_slug)
        .bind(&deployment.model_provider)
        .bind(&deployment.workload_config)
        .bind(&deployment.provider_model_id)
        .bind(&deployment.source.repository)
        .bind(&deployment.source.revision)
        .bind(deployment.source.custom)
        .bind(&deployment.source.commit)
        .execute(&mut **tx)
        .await?;
        for (group_position, group) in deployment.accelerators.iter().enumerate() {
            sqlx::query(
                "INSERT INTO accelerator_groups (di_id, version, deployment_position, position, accelerator_slug, role, scale)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(id)
            .bind(spec.version)
            .bind(position as i32)
            .bind(group_position as i32)
            .bind(&group.accelerator_slug)
            .bind(&group.role)
            .bind(group.scale)
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}

/// The `model_id` of each deployment of a new spec. One that names an id keeps it (it must be a
/// deployment of the version replaced, named once). Those without — what curl users, doctl spec
/// files and a first Terraform apply send — are matched to the unnamed deployments of the version
/// replaced so that as little as possible changes: the assignment of least cost, where a kept
/// deployment costs what differs (model — its name or what it loads — 2, GPU 1, position ½, ¼ a replica of scale up to ¾) and
/// a deployment added or removed costs 2½ each. So a scale, GPU or model change updates a deployment in place (its serving
/// replicas stay until new ones are ready), a reorder or a removal keeps the others as they are,
/// and only what no longer corresponds to anything is new.
fn deployment_ids(deployments: &[ModelDeployment], known: &[KnownDeployment]) -> Result<Vec<Uuid>> {
    let mut ids: Vec<Option<Uuid>> = vec![None; deployments.len()];
    for (position, deployment) in deployments.iter().enumerate() {
        let Some(id) = deployment.model_id else {
            continue;
        };
        if ids.contains(&Some(id)) {
            return Err(StoreError::Unprocessable(format!(
                "spec.model_deployments[{position}].model_id {id} appears twice"
            )));
        }
        if !known.iter().any(|k| k.model_id == id) {
            return Err(StoreError::Unprocessable(format!(
                "spec.model_deployments[{position}].model_id {id} is not a deployment of this dedicated inference"
            )));
        }
        ids[position] = Some(id);
    }
    let unnamed: Vec<usize> = (0..deployments.len())
        .filter(|i| ids[*i].is_none())
        .collect();
    let free: Vec<usize> = (0..known.len())
        .filter(|q| !ids.contains(&Some(known[*q].model_id)))
        .collect();
    // Costs in quarters, to stay in integers.
    let keep = |p: usize, q: usize| {
        let (d, k) = (&deployments[p], &known[q]);
        let first = d.accelerators.first();
        let gpu = first.map(|g| g.accelerator_slug.as_str());
        let scale = first.map_or(0, |g| g.scale);
        let same_model = k.model_slug == d.model_slug
            && k.source_repository == d.source.repository
            && k.source_revision == d.source.revision;
        8 * u32::from(!same_model)
            + 4 * u32::from(k.accelerator_slug.as_deref() != gpu)
            + 2 * u32::from(p != q)
            + scale.abs_diff(k.scale.unwrap_or(0)).min(3)
    };
    const ADDED_OR_REMOVED: u32 = 10;
    let assignment = least_cost_assignment(&unnamed, &free, &keep, ADDED_OR_REMOVED);
    for (p, q) in unnamed.iter().zip(assignment) {
        ids[*p] = Some(q.map_or_else(Uuid::new_v4, |q| known[q].model_id));
    }
    Ok(ids
        .into_iter()
        .map(|id| id.expect("every deployment has an id"))
        .collect())
}

/// For each of `new`, one of `old` (each used at most once) or none, minimising the sum of
/// `keep(new, old)` over the pairs plus `unmatched` for each of either side left alone. An
/// exhaustive search: specs hold a handful of deployments. Beyond eight on a side, each new one
/// simply takes the cheapest old one still free.
fn least_cost_assignment(
    new: &[usize],
    old: &[usize],
    keep: &dyn Fn(usize, usize) -> u32,
    unmatched: u32,
) -> Vec<Option<usize>> {
    if new.len() > 8 || old.len() > 8 {
        let mut used = vec![false; old.len()];
        return new
            .iter()
            .map(|p| {
                let (j, q) = old
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| !used[*j])
                    .min_by_key(|(_, q)| keep(*p, **q))?;
                (keep(*p, *q) < 2 * unmatched).then(|| {
                    used[j] = true;
                    *q
                })
            })
            .collect();
    }
    struct Search<'a> {
        new: &'a [usize],
        old: &'a [usize],
        keep: &'a dyn Fn(usize, usize) -> u32,
        unmatched: u32,
        used: Vec<bool>,
        current: Vec<Option<usize>>,
        best: (u32, Vec<Option<usize>>),
    }
    impl Search<'_> {
        fn from(&mut self, i: usize, cost: u32) {
            if cost >= self.best.0 {
                return;
            }
            if i == self.new.len() {
                let removed = self.used.iter().filter(|u| !**u).count() as u32 * self.unmatched;
                if cost + removed < self.best.0 {
                    self.best = (cost + removed, self.current.clone());
                }
                return;
            }
            for j in 0..self.old.len() {
                if !self.used[j] {
                    self.used[j] = true;
                    self.current.push(Some(self.old[j]));
                    self.from(i + 1, cost + (self.keep)(self.new[i], self.old[j]));
                    self.current.pop();
                    self.used[j] = false;
                }
            }
            self.current.push(None);
            self.from(i + 1, cost + self.unmatched);
            self.current.pop();
        }
    }
    let mut search = Search {
        new,
        old,
        keep,
        unmatched,
        used: vec![false; old.len()],
        current: Vec::new(),
        best: (u32::MAX, Vec::new()),
    };
    search.from(0, 0);
    search.best.1
}

/// A change a customer asked for: as [`change`], and the work it creates for the workers carries
/// the request's trace context, so that their passes join the request's trace.
async fn requested_change(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    phase: Status,
    reason: &str,
    message: &str,
) -> Result<()> {
    // The trace first: `change` takes the outbox lock, held until commit, so it goes last.
    work_trace(tx, id, common::telemetry::traceparent().as_deref()).await?;
    change(tx, id, phase, reason, message, true).await
}

/// A change that completes what was asked (active, error, gone): later passes, such as periodic
/// resyncs, start traces of their own.
async fn final_change(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    phase: Status,
    reason: &str,
    message: &str,
) -> Result<()> {
    work_trace(tx, id, None).await?;
    change(tx, id, phase, reason, message, false).await
}

async fn work_trace(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    traceparent: Option<&str>,
) -> Result<()> {
    sqlx::query("UPDATE work_items SET traceparent = $2 WHERE di_id = $1")
        .bind(id)
        .bind(traceparent)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Appends the event and the outbox entry for a change, in the caller's transaction. The advisory
/// lock serialises outbox writers until commit, so `seq` order is commit order and a consumer
/// resuming after `seq` never skips a change that committed late. Every writer waits for it, so
/// callers make this the last statement before their commit. `requested` marks changes a
/// customer asked for: only those make the DI due for a worker at once (a worker's own progress
/// does not send it straight back to the queue).
pub(crate) async fn change(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    phase: Status,
    reason: &str,
    message: &str,
    requested: bool,
) -> Result<()> {
    sqlx::query("INSERT INTO events (di_id, phase, reason, message) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(phase.as_str())
        .bind(reason)
        .bind(message)
        .execute(&mut **tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7415)")
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO outbox (di_id, kind, requested) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(reason)
        .bind(requested)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// An outbox entry without an event: a change customers see (in GET) that is not worth one.
pub(crate) async fn outbox_only(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    kind: &str,
) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock(7415)")
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO outbox (di_id, kind, requested) VALUES ($1, $2, false)")
        .bind(id)
        .bind(kind)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::spec::AcceleratorGroup;

    #[test]
    fn every_error_has_its_class() {
        let down = StoreError::from(sqlx::Error::PoolTimedOut);
        assert!(matches!(down, StoreError::Unavailable(_)));
        assert_eq!(down.class(), ErrorClass::TRANSIENT);
        let wrong = StoreError::from(sqlx::Error::ColumnNotFound("x".into()));
        assert_eq!(wrong.class(), ErrorClass::Permanent);
        assert_eq!(StoreError::NotFound.class(), ErrorClass::NotFound);
        assert_eq!(
            StoreError::Conflict("current version is 2".into()).class(),
            ErrorClass::Conflict
        );
        assert_eq!(
            StoreError::Unprocessable("quota".into()).class(),
            ErrorClass::Refused
        );
        assert_eq!(StoreError::Seal.class(), ErrorClass::Permanent);
        assert_eq!(StoreError::LeaseLost.class(), ErrorClass::Permanent);
    }

    fn deployment(model: &str, gpu: &str, id: Option<Uuid>) -> ModelDeployment {
        ModelDeployment {
            model_id: id,
            model_slug: model.into(),
            model_provider: "hugging_face".into(),
            provider_model_id: String::new(),
            source: api_types::spec::ModelSource::default(),
            workload_config: serde_json::json!({}),
            accelerators: vec![AcceleratorGroup {
                accelerator_slug: gpu.into(),
                role: "prefill_decode".into(),
                scale: 1,
            }],
        }
    }

    fn known(model: &str, gpu: &str) -> KnownDeployment {
        KnownDeployment {
            model_id: Uuid::new_v4(),
            model_slug: model.into(),
            source_repository: String::new(),
            source_revision: None,
            accelerator_slug: Some(gpu.into()),
            scale: Some(1),
        }
    }

    #[test]
    fn a_deployment_without_an_id_is_the_one_it_updates() {
        let old = [known("a", "h100"), known("b", "l40s")];
        let (a, b) = (old[0].model_id, old[1].model_id);
        // Reordered, with another GPU for one: each keeps its id.
        let ids = deployment_ids(
            &[deployment("b", "l40s", None), deployment("a", "h200", None)],
            &old,
        )
        .unwrap();
        assert_eq!(ids, [b, a]);
        // Another model in the first place, and one added: changed in place, the added one new.
        let ids = deployment_ids(
            &[
                deployment("c", "h100", None),
                deployment("b", "l40s", None),
                deployment("d", "h100", None),
            ],
            &old,
        )
        .unwrap();
        assert_eq!(&ids[..2], [a, b]);
        assert!(![a, b].contains(&ids[2]));
        // The first removed: the other keeps its id (and keeps serving as it was).
        assert_eq!(
            deployment_ids(&[deployment("b", "l40s", None)], &old).unwrap(),
            [b]
        );
        // The first turned into a copy of the second: changed in place, the second kept, rather
        // than the second's id taken by the first and the first replaced from zero.
        let ids = deployment_ids(
            &[deployment("b", "l40s", None), deployment("b", "l40s", None)],
            &old,
        )
        .unwrap();
        assert_eq!(ids, [a, b]);
        // [a, b] → [b, c]: b keeps its id, a becomes c in place.
        let ids = deployment_ids(
            &[deployment("b", "l40s", None), deployment("c", "h100", None)],
            &old,
        )
        .unwrap();
        assert_eq!(ids, [b, a]);
    }

    #[test]
    fn of_two_alike_the_one_of_the_same_scale_stays() {
        // [a ×1, a ×4] → [a ×4]: the four replicas stay, the one goes.
        let old = [
            known("a", "h100"),
            KnownDeployment {
                scale: Some(4),
                ..known("a", "h100")
            },
        ];
        let mut four = deployment("a", "h100", None);
        four.accelerators[0].scale = 4;
        assert_eq!(deployment_ids(&[four], &old).unwrap(), [old[1].model_id]);
    }

    #[test]
    fn one_model_on_two_gpus_is_matched_by_gpu_first() {
        let old = [known("a", "h100"), known("a", "l40s")];
        let ids = deployment_ids(
            &[deployment("a", "l40s", None), deployment("a", "h100", None)],
            &old,
        )
        .unwrap();
        assert_eq!(ids, [old[1].model_id, old[0].model_id]);
    }

    #[test]
    fn named_ids_win_and_are_checked() {
        let old = [known("a", "h100"), known("b", "h100")];
        let (a, b) = (old[0].model_id, old[1].model_id);
        // The named one takes its id; the unnamed one cannot take it again.
        let ids = deployment_ids(
            &[
                deployment("b", "h100", None),
                deployment("a", "h100", Some(b)),
            ],
            &old,
        )
        .unwrap();
        assert_eq!(ids, [a, b]);
        assert!(deployment_ids(&[deployment("a", "h100", Some(Uuid::new_v4()))], &old).is_err());
        assert!(deployment_ids(
            &[
                deployment("a", "h100", Some(a)),
                deployment("b", "h100", Some(a))
            ],
            &old
        )
        .is_err());
    }
}
