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
mod quotas;
mod records;
mod reseal;
mod work;

pub use authorities::NewCa;
pub use reseal::ResealReport;

pub use quotas::{QuotaOverrides, Quotas};
pub use work::{
    Claim, ClaimOptions, ClusterRelease, DeploymentReplicas, HolderSession, LedgerEntry,
    PassInputs, Stall, PROGRESS_IDLE,
};

use api_types::lifecycle::{Event as Transition, Status};
use api_types::regional::{
    Accelerator, Changes, CreateRequest, Event, NewToken, Page, Record, Token,
};
use api_types::spec::{ModelDeployment, Spec};
use std::sync::Arc;

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

pub type Result<T> = std::result::Result<T, StoreError>;

/// An accelerator as a worker observed it on a real node.
#[derive(Debug, Clone, PartialEq, Eq)]
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
        MIGRATOR.run(&self.pool).await
    }

    // -----------------------------------------------------------------------------------------
    // Lifecycle entry points (called by the regional service on behalf of central)

    /// Creates the DI with status `new` and pending spec version 1, its managed token, its sealed
    /// Hugging Face token and CA. Idempotent on `req.id`: a retry returns what the first call made.
    pub async fn dedicated_inference_create(
        &self,
        req: &CreateRequest,
        ca: &NewCa,
    ) -> Result<Record> {
        if let Some(existing) = self.dedicated_inference_created(req).await? {
            return Ok(existing);
        }
        let vpc_uuid = req.spec.vpc_uuid.ok_or_else(|| {
            StoreError::Unprocessable(
                "spec.vpc.uuid must be resolved before a create is stored".into(),
            )
        })?;
        let mut tx = self.pool.begin().await?;
        let held = self.quota_before(&mut tx, req.team_id, req.id).await?;
        let inserted = sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, vpc_uuid, enable_public_endpoint, status, pending_version)
             VALUES ($1, $2, $3, $4, $5, 'new', 1) ON CONFLICT (id) DO NOTHING",
        )
        .bind(req.id)
        .bind(req.team_id)
        .bind(&req.spec.region)
        .bind(vpc_uuid)
        .bind(req.spec.enable_public_endpoint)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            // A concurrent retry won the race; answer with its result.
            drop(tx);
            return self
                .dedicated_inference_created(req)
                .await?
                .ok_or(StoreError::NotFound);
        }
        let mut spec = req.spec.clone();
        spec.version = 1;
        insert_spec_version(&mut tx, req.id, &spec, &[]).await?;
        self.quota_check(&mut tx, req.team_id, req.id, held).await?;
        sqlx::query(
            "INSERT INTO access_tokens (id, di_id, name, token_hash, is_managed) VALUES ($1, $2, $3, $4, true)",
        )
        .bind(req.managed_token.id)
        .bind(req.id)
        .bind(&req.managed_token.name)
        .bind(token_hash(&req.managed_token)?)
        .execute(&mut *tx)
        .await?;
        if let Some(hf) = &req.hugging_face_token {
            self.put_secret(&mut tx, req.id, HF_TOKEN, hf).await?;
        }
        self.certificate_authority_insert(&mut tx, req.id, ca)
            .await?;
        requested_change(
            &mut tx,
            req.id,
            Status::New,
            "Created",
            "Dedicated inference accepted; provisioning will start shortly.",
        )
        .await?;
        tx.commit().await?;
        self.record(req.id, None, true).await
    }

    /// The DI an earlier attempt of this create made, if any (`Conflict` when its id is
    /// another team's).
    pub async fn dedicated_inference_created(&self, req: &CreateRequest) -> Result<Option<Record>> {
        match self.record(req.id, None, true).await {
            Ok(record) if record.team_id == req.team_id => Ok(Some(record)),
            Ok(_) => Err(StoreError::Conflict("id already in use".into())),
            Err(StoreError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The DI as its team sees it; `NotFound` once gone or for another team.
    pub async fn dedicated_inference_get(&self, id: Uuid, team_id: Uuid) -> Result<Record> {
        self.record(id, Some(team_id), false).await
    }

    /// Accepts a new desired spec (and/or a new Hugging Face token). The spec must carry the latest
    /// version the region has; it is stored as version + 1 and supersedes any pending spec.
    pub async fn dedicated_inference_patch(
        &self,
        id: Uuid,
        team_id: Uuid,
        spec: Option<&Spec>,
        hugging_face_token: Option<&str>,
        requires_hugging_face_token: bool,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        // The team's lock first, as a create takes it: before this DI's row lock.
        let held = match spec {
            Some(_) => self.quota_before(&mut tx, team_id, id).await?,
            None => None,
        };
        if !self.first_application(&mut tx, id).await? {
            return self.record(id, Some(team_id), true).await;
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        if requires_hugging_face_token && hugging_face_token.is_none() {
            let stored: Option<i32> =
                sqlx::query_scalar("SELECT 1 FROM provider_secrets WHERE di_id = $1 AND kind = $2")
                    .bind(id)
                    .bind(HF_TOKEN)
                    .fetch_optional(&mut *tx)
                    .await?;
            if stored.is_none() {
                return Err(StoreError::Unprocessable(
                    "access_tokens.hugging_face_token is required for a gated model".into(),
                ));
            }
        }
        if let Some(spec) = spec {
            let latest = row.pending_version.or(row.current_version).unwrap_or(0);
            if spec.version != latest {
                return Err(StoreError::Conflict(format!(
                    "spec version {} is stale: the current version is {latest}",
                    spec.version
                )));
            }
            if spec.region != row.region {
                return Err(StoreError::Unprocessable(
                    "spec.region cannot be changed".into(),
                ));
            }
            if spec.vpc_uuid.is_some_and(|v| v != row.vpc_uuid) {
                return Err(StoreError::Unprocessable(
                    "spec.vpc.uuid cannot be changed".into(),
                ));
            }
            if spec.enable_public_endpoint != row.enable_public_endpoint {
                return Err(StoreError::Unprocessable(
                    "spec.enable_public_endpoint cannot be changed".into(),
                ));
            }
            let known: Vec<KnownDeployment> = sqlx::query_as(
                "SELECT m.model_id, m.model_slug, m.source_repository, m.source_revision,
                        g.accelerator_slug, g.scale
                 FROM model_deployments m
                 LEFT JOIN LATERAL (SELECT accelerator_slug, scale FROM accelerator_groups g
                     WHERE g.di_id = m.di_id AND g.version = m.version AND g.deployment_position = m.position
                     ORDER BY g.position LIMIT 1) g ON true
                 WHERE m.di_id = $1 AND m.version = $2 ORDER BY m.position",
            )
            .bind(id)
            .bind(latest)
            .fetch_all(&mut *tx)
            .await?;
            let mut next = spec.clone();
            next.version = latest + 1;
            next.vpc_uuid = Some(row.vpc_uuid);
            insert_spec_version(&mut tx, id, &next, &known).await?;
            let status = row
                .status
                .after(Transition::SpecAccepted {
                    rolled_out: row.current_version.is_some(),
                })
                .expect("a DI that accepts changes accepts a spec");
            sqlx::query(
                "UPDATE dedicated_inferences SET pending_version = $2, status = $3, status_reason = NULL, updated_at = now()
                 WHERE id = $1",
            )
            .bind(id)
            .bind(next.version)
            .bind(status.as_str())
            .execute(&mut *tx)
            .await?;
            self.quota_check(&mut tx, team_id, id, held).await?;
            requested_change(
                &mut tx,
                id,
                status,
                "SpecAccepted",
                &format!("Spec version {} accepted.", next.version),
            )
            .await?;
        }
        if let Some(hf) = hugging_face_token {
            self.put_secret(&mut tx, id, HF_TOKEN, hf).await?;
            sqlx::query("UPDATE dedicated_inferences SET updated_at = now() WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            requested_change(
                &mut tx,
                id,
                row.status,
                "ProviderTokenUpdated",
                "Hugging Face token replaced.",
            )
            .await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Moves the DI to `deleting`. Idempotent: deleting a DI that is already deleting changes nothing.
    pub async fn dedicated_inference_delete(&self, id: Uuid, team_id: Uuid) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return self.record(id, Some(team_id), true).await;
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        let deleting = row.status.after(Transition::DeleteRequested);
        if deleting != Some(row.status) {
            let deleting = deleting.expect("a delete is always possible");
            sqlx::query(
                "UPDATE dedicated_inferences SET status = $2, status_reason = NULL, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(deleting.as_str())
            .execute(&mut *tx)
            .await?;
            requested_change(
                &mut tx,
                id,
                deleting,
                "DeleteRequested",
                "Deletion requested; tearing down.",
            )
            .await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// The latest state of every DI changed after outbox position `after`, oldest change first.
    pub async fn changes_since(&self, after: i64, limit: i64) -> Result<Changes> {
        let batch = self.changed_since(after, limit).await?;
        self.changes_load(batch).await
    }

    /// The first step of [`Store::changes_since`]: which DIs changed after `after`, up to which
    /// outbox position. Public so that a test can commit other changes before the second step.
    pub async fn changed_since(&self, after: i64, limit: i64) -> Result<ChangedBatch> {
        let changed: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT di_id, max(seq) AS seq FROM outbox WHERE seq > $1 GROUP BY di_id ORDER BY seq LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let last_seq = changed.iter().map(|(_, seq)| *seq).max().unwrap_or(after);
        Ok(ChangedBatch {
            ids: changed.into_iter().map(|(id, _)| id).collect(),
            last_seq: last_seq.max(after),
        })
    }

    /// The second step of [`Store::changes_since`]: each changed DI's record as it is now. The
    /// cursor stays where the batch ended even when a record is newer: a change of another DI
    /// committed between the two steps sits below such a record's `seq`, and moving the cursor
    /// past it would lose it. A record newer than the cursor only comes again next time.
    pub async fn changes_load(&self, batch: ChangedBatch) -> Result<Changes> {
        let mut records = Vec::with_capacity(batch.ids.len());
        for id in batch.ids {
            records.push(self.record(id, None, true).await?);
        }
        Ok(Changes {
            records,
            last_seq: batch.last_seq,
        })
    }

    /// The newest outbox position, for consumers that start from "now".
    pub async fn outbox_head(&self) -> Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT coalesce(max(seq), 0) FROM outbox")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    pub async fn accelerators_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        slug: Option<&str>,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Accelerator>> {
        self.ensure_visible(id, team_id).await?;
        let rows: Vec<records::AcceleratorRow> = sqlx::query_as(
            "SELECT id, name, slug, role, status, created_at, count(*) OVER () AS total FROM accelerators
             WHERE di_id = $1 AND ($2::text IS NULL OR slug = $2) ORDER BY created_at, name LIMIT $3 OFFSET $4",
        )
        .bind(id)
        .bind(slug)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?;
        let total = match rows.first() {
            Some(r) => r.total,
            None => sqlx::query_scalar(
                "SELECT count(*) FROM accelerators WHERE di_id = $1 AND ($2::text IS NULL OR slug = $2)",
            )
            .bind(id)
            .bind(slug)
            .fetch_one(&self.pool)
            .await?,
        };
        Ok(Page {
            items: rows.into_iter().map(Into::into).collect(),
            total,
        })
    }

    pub async fn accelerator_get(
        &self,
        id: Uuid,
        team_id: Uuid,
        accelerator_id: Uuid,
    ) -> Result<Accelerator> {
        self.ensure_visible(id, team_id).await?;
        let row: Option<records::AcceleratorRow> = sqlx::query_as(
            "SELECT id, name, slug, role, status, created_at, 1::bigint AS total FROM accelerators WHERE di_id = $1 AND id = $2",
        )
        .bind(id)
        .bind(accelerator_id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(Into::into).ok_or(StoreError::NotFound)
    }

    pub async fn tokens_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Token>> {
        self.ensure_visible(id, team_id).await?;
        let rows: Vec<(Uuid, String, bool, chrono::DateTime<chrono::Utc>, i64)> = sqlx::query_as(
            "SELECT id, name, is_managed, created_at, count(*) OVER () FROM access_tokens
             WHERE di_id = $1 AND revoked_at IS NULL ORDER BY created_at, id LIMIT $2 OFFSET $3",
        )
        .bind(id)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?;
        let total =
            match rows.first() {
                Some(r) => r.4,
                None => sqlx::query_scalar(
                    "SELECT count(*) FROM access_tokens WHERE di_id = $1 AND revoked_at IS NULL",
                )
                .bind(id)
                .fetch_one(&self.pool)
                .await?,
            };
        let items = rows
            .into_iter()
            .map(|(id, name, is_managed, created_at, _)| Token {
                id,
                name,
                is_managed,
                created_at,
            })
            .collect();
        Ok(Page { items, total })
    }

    /// Adds an access token (by hash). Idempotent on the token id.
    pub async fn token_create(&self, id: Uuid, team_id: Uuid, token: &NewToken) -> Result<Token> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return self.token(id, token.id).await;
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        let created: Option<(chrono::DateTime<chrono::Utc>,)> = sqlx::query_as(
            "INSERT INTO access_tokens (id, di_id, name, token_hash, is_managed) VALUES ($1, $2, $3, $4, false)
             ON CONFLICT (id) DO NOTHING RETURNING created_at",
        )
        .bind(token.id)
        .bind(id)
        .bind(&token.name)
        .bind(token_hash(token)?)
        .fetch_optional(&mut *tx)
        .await?;
        if created.is_some() {
            requested_change(
                &mut tx,
                id,
                row.status,
                "TokenCreated",
                &format!("Access token {} created.", token.name),
            )
            .await?;
        }
        tx.commit().await?;
        self.token(id, token.id).await
    }

    async fn token(&self, id: Uuid, token_id: Uuid) -> Result<Token> {
        let (name, is_managed, created_at): (String, bool, chrono::DateTime<chrono::Utc>) =
            sqlx::query_as("SELECT name, is_managed, created_at FROM access_tokens WHERE id = $1 AND di_id = $2")
                .bind(token_id)
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| StoreError::Conflict("token id already in use".into()))?;
        Ok(Token {
            id: token_id,
            name,
            is_managed,
            created_at,
        })
    }

    pub async fn token_revoke(&self, id: Uuid, team_id: Uuid, token_id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return Ok(());
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        let revoked = sqlx::query(
            "UPDATE access_tokens SET revoked_at = now() WHERE id = $1 AND di_id = $2 AND revoked_at IS NULL",
        )
        .bind(token_id)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if revoked.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        requested_change(
            &mut tx,
            id,
            row.status,
            "TokenRevoked",
            &format!("Access token {token_id} revoked."),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records this store's operation in `tx`, which applies it; false when the operation was
    /// already applied (a repeat, or a concurrent copy that committed first), and always true
    /// without an operation. A transaction that fails rolls the record back with the operation.
    async fn first_application(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
    ) -> Result<bool> {
        let Some(operation) = self.operation else {
            return Ok(true);
        };
        let recorded = sqlx::query(
            "INSERT INTO applied_operations (operation_id, di_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(operation)
        .bind(id)
        .execute(&mut **tx)
        .await?;
        Ok(recorded.rows_affected() == 1)
    }

    /// Whether this store's operation (see [`Store::for_operation`]) was applied already: its
    /// repetition is answered with the DI as it is, without asking anything again.
    pub async fn operation_applied(&self) -> Result<bool> {
        let Some(operation) = self.operation else {
            return Ok(false);
        };
        Ok(
            sqlx::query("SELECT 1 FROM applied_operations WHERE operation_id = $1")
                .bind(operation)
                .fetch_optional(&self.pool)
                .await?
                .is_some(),
        )
    }

    /// Forgets operations applied more than `age` ago; central repeats one for at most a day.
    pub async fn applied_operations_purge(&self, age: std::time::Duration) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM applied_operations WHERE created_at < now() - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    pub async fn events_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Event>> {
        self.ensure_visible(id, team_id).await?;
        let items: Vec<Event> = sqlx::query_as::<_, (i64, String, String, String, chrono::DateTime<chrono::Utc>)>(
            "SELECT id, phase, reason, message, created_at FROM events WHERE di_id = $1 ORDER BY id LIMIT $2 OFFSET $3",
        )
        .bind(id)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|(id, phase, reason, message, created_at)| Event { id, phase, reason, message, created_at })
        .collect();
        let total = sqlx::query_scalar("SELECT count(*) FROM events WHERE di_id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await?;
        Ok(Page { items, total })
    }

    // -----------------------------------------------------------------------------------------
    // Worker methods: each moves one DI forward in one transaction with its event and outbox entry.

    /// `new` → `provisioning`. A no-op in any other status.
    pub async fn provisioning_begin(&self, id: Uuid) -> Result<Record> {
        self.transition(
            id,
            Transition::ProvisioningStarted,
            "ProvisioningStarted",
            "Provisioning cloud resources.",
        )
        .await
    }

    /// `active` → `updating`, for a pending spec a worker starts rolling out. A no-op otherwise.
    pub async fn updating_begin(&self, id: Uuid) -> Result<Record> {
        self.transition(
            id,
            Transition::RolloutStarted,
            "RolloutStarted",
            "Rolling out a new spec.",
        )
        .await
    }

    /// The pending spec `version` is fully rolled out: it becomes current, the pending spec is
    /// cleared and the DI is `active`. If a newer spec superseded it meanwhile, nothing changes
    /// (the worker converges on the newer one next) and `Conflict` says so.
    pub async fn rollout_complete(
        &self,
        id: Uuid,
        version: i32,
        endpoints: &Endpoints,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let Some(active) = row.status.after(Transition::RolloutComplete) else {
            return Err(StoreError::Conflict(format!(
                "a dedicated inference in status {} is not rolling out",
                row.status
            )));
        };
        if row.pending_version != Some(version) {
            return Err(StoreError::Conflict(format!(
                "version {version} is not the pending spec"
            )));
        }
        sqlx::query(
            "UPDATE dedicated_inferences SET current_version = $2, pending_version = NULL, status = $5,
                 status_reason = NULL, public_endpoint_fqdn = $3, private_endpoint_fqdn = $4, updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .bind(version)
        .bind(&endpoints.public_fqdn)
        .bind(&endpoints.private_fqdn)
        .bind(active.as_str())
        .execute(&mut *tx)
        .await?;
        final_change(
            &mut tx,
            id,
            active,
            "RolloutComplete",
            &format!("Spec version {version} is serving."),
        )
        .await?;
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// The endpoints of an active DI moved (the cloud replaced a load balancer, or the cluster
    /// was rebuilt): the new addresses are recorded, with an event. A no-op when they are the
    /// ones recorded or the DI is not active (a rollout records them when it completes).
    pub async fn endpoints_update(&self, id: Uuid, endpoints: &Endpoints) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let moved = sqlx::query(
            "UPDATE dedicated_inferences SET public_endpoint_fqdn = $2, private_endpoint_fqdn = $3, updated_at = now()
             WHERE id = $1 AND status = 'active'
               AND (public_endpoint_fqdn, private_endpoint_fqdn) IS DISTINCT FROM ($2, $3)",
        )
        .bind(id)
        .bind(&endpoints.public_fqdn)
        .bind(&endpoints.private_fqdn)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if moved {
            let shown = |e: &Option<String>| e.clone().unwrap_or_else(|| "none".into());
            let message = format!(
                "The endpoints moved: public {}, private {}.",
                shown(&endpoints.public_fqdn),
                shown(&endpoints.private_fqdn)
            );
            change(
                &mut tx,
                id,
                Status::Active,
                "EndpointsChanged",
                &message,
                false,
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// A permanent failure: status `error` with a reason, until the spec changes. `version` is
    /// the spec the failing pass was rolling out: when a newer one was accepted meanwhile, the
    /// failure is about a spec nobody wants any more and nothing changes (the next pass tries
    /// the newer one). `None` fails the DI whatever its spec (a stall). Not applied to a DI
    /// being deleted (deletion wins), nor again for the same reason.
    pub async fn error_set(
        &self,
        id: Uuid,
        version: Option<i32>,
        reason: &str,
        message: &str,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let heading_for = row.pending_version.or(row.current_version);
        let superseded = version.is_some_and(|v| Some(v) != heading_for);
        let repeated = row.status == Status::Error && row.status_reason.as_deref() == Some(reason);
        if let Some(failed) = row
            .status
            .after(Transition::Failed)
            .filter(|_| !superseded && !repeated)
        {
            sqlx::query(
                "UPDATE dedicated_inferences SET status = $3, status_reason = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(reason)
            .bind(failed.as_str())
            .execute(&mut *tx)
            .await?;
            final_change(&mut tx, id, failed, reason, message).await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Every cloud resource is gone: the DI disappears for customers (404 from now on).
    pub async fn gone(&self, id: Uuid) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let Some(status) = row.status.after(Transition::Gone) else {
            return Err(StoreError::Conflict(
                "only a dedicated inference being deleted can be gone".into(),
            ));
        };
        sqlx::query(
            "UPDATE dedicated_inferences SET gone_at = now(), updated_at = now() WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE access_tokens SET revoked_at = now() WHERE di_id = $1 AND revoked_at IS NULL",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        // Its secrets go with it: the Hugging Face token, the probe credential, the CA keys
        // (teardown, now finished, was the last thing that could need them). The record stays.
        sqlx::query("DELETE FROM provider_secrets WHERE di_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM certificate_authorities WHERE di_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        final_change(
            &mut tx,
            id,
            status,
            "Deleted",
            "Every cloud resource is gone.",
        )
        .await?;
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Records a progress or warning event without changing status.
    pub async fn event_append(&self, id: Uuid, reason: &str, message: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        change(&mut tx, id, row.status, reason, message, false).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replaces the observed accelerators with what the worker saw; ids stay stable by name.
    pub async fn accelerators_replace(
        &self,
        id: Uuid,
        observed: &[ObservedAccelerator],
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let names: Vec<String> = observed.iter().map(|a| a.name.clone()).collect();
        sqlx::query("DELETE FROM accelerators WHERE di_id = $1 AND NOT (name = ANY($2))")
            .bind(id)
            .bind(&names)
            .execute(&mut *tx)
            .await?;
        for a in observed {
            sqlx::query(
                "INSERT INTO accelerators (id, di_id, name, slug, role, status) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (di_id, name) DO UPDATE SET slug = excluded.slug, role = excluded.role, status = excluded.status
                 WHERE (accelerators.slug, accelerators.role, accelerators.status) IS DISTINCT FROM (excluded.slug, excluded.role, excluded.status)",
            )
            .bind(Uuid::new_v4())
            .bind(id)
            .bind(&a.name)
            .bind(&a.slug)
            .bind(&a.role)
            .bind(&a.status)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The Hugging Face token, unsealed, for the worker that writes it into the cluster.
    pub async fn hugging_face_token(&self, id: Uuid) -> Result<Option<String>> {
        let mut conn = self.pool.acquire().await?;
        self.hugging_face_token_on(&mut conn, id).await
    }

    /// Hashes (hex) of the DI's live access tokens, keyed by token id: what the gateway checks.
    pub async fn token_hashes(&self, id: Uuid) -> Result<Vec<(Uuid, String)>> {
        let mut conn = self.pool.acquire().await?;
        token_hashes_on(&mut conn, id).await
    }

    /// The worker's probe token of DI `id`, unsealed: the credential with which workers check
    /// that the DI's endpoint answers before they declare it active. Made on first use (a random
    /// token, sealed like the other secrets; concurrent workers agree on the first one stored),
    /// valid for this DI only (its hash is written with this DI's access tokens), replaced by
    /// [`Store::probe_token_rotate`] and deleted when the DI is gone.
    pub async fn probe_token(&self, id: Uuid) -> Result<String> {
        let mut conn = self.pool.acquire().await?;
        self.probe_token_on(&mut conn, id).await
    }

    pub(crate) async fn probe_token_on(&self, conn: &mut PgConnection, id: Uuid) -> Result<String> {
        if let Some(token) = self.secret_on(conn, id, PROBE_TOKEN).await? {
            return Ok(token);
        }
        let minted = common::tokens::mint("di_");
        // Only for a live DI, and never behind the back of [`Store::gone`], which erases the
        // DI's secrets: the lock waits for a concurrent `gone` and then sees the DI gone.
        sqlx::query(
            "INSERT INTO provider_secrets (di_id, kind, sealed)
             SELECT id, $2, $3 FROM dedicated_inferences WHERE id = $1 AND gone_at IS NULL FOR KEY SHARE
             ON CONFLICT (di_id, kind) DO NOTHING",
        )
        .bind(id)
        .bind(PROBE_TOKEN)
        .bind(
            self.sealer
                .seal(minted.as_bytes(), secret_aad(id, PROBE_TOKEN).as_bytes()),
        )
        .execute(&mut *conn)
        .await?;
        self.secret_on(conn, id, PROBE_TOKEN)
            .await?
            .ok_or(StoreError::NotFound)
    }

    /// Replaces DI `id`'s probe token (e.g. when it may have leaked): the next pass writes the
    /// new one's hash in place of the old one's, so the old one stops working within seconds,
    /// in any status in which the endpoint serves.
    pub async fn probe_token_rotate(&self, id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        self.put_secret(&mut tx, id, PROBE_TOKEN, &common::tokens::mint("di_"))
            .await?;
        requested_change(
            &mut tx,
            id,
            row.status,
            "ProbeTokenRotated",
            "The control plane's endpoint probe credential was replaced.",
        )
        .await?;
        tx.commit().await?;
        Ok(())
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
        sealed
            .map(|s| {
                let plain = self
                    .sealer
                    .open(&s, secret_aad(id, kind).as_bytes())
                    .map_err(|_| StoreError::Seal)?;
                String::from_utf8(plain).map_err(|_| StoreError::Seal)
            })
            .transpose()
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

    // -----------------------------------------------------------------------------------------

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

/// Locks a live (not gone) DI row for the rest of the transaction.
pub(crate) async fn lock_live(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    team_id: Option<Uuid>,
) -> Result<LockedRow> {
    let row: Option<(String, Option<String>, String, Uuid, bool, Option<i32>, Option<i32>)> = sqlx::query_as(
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
                 provider_model_id, source_repository, source_revision, source_custom)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
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
