//! Central's store: every SQL statement of the central API. It owns API tokens, the ownership map
//! (dedicated inference id → team, region) together with the read model of each DI fed from the
//! regions' change feeds, the pending creates that make a create exactly-once across central and
//! region (and each create's first response, for identical retries), idempotency records with the
//! keyed operations behind them, and the feed cursors. Sealing and policy are the caller's: rows
//! hold what they are given, until the DI they are about is gone, when every sealed value about
//! it is erased. Ownership rows are also cached in process ([`read_cache`]), kept
//! coherent across replicas by Postgres notifications while [`CentralStore::watch_read_cache`] runs.

mod read_cache;

use std::sync::Arc;

use common::errors::{Classify, ErrorClass};
use sqlx::postgres::PgPool;
use uuid::Uuid;

pub use sqlx;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/central");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the name is already used by another dedicated inference of this team")]
    NameTaken,
    #[error("not found")]
    NotFound,
    /// The database is unavailable for now (restarting, failing over, out of connections) or
    /// asked for a retry: the same request may succeed later ([`common::db::unavailable`]).
    #[error("database unavailable: {0}")]
    Unavailable(sqlx::Error),
    #[error("database: {0}")]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        common::db::classify(e, StoreError::Unavailable, StoreError::Database)
    }
}

impl Classify for StoreError {
    fn class(&self) -> ErrorClass {
        match self {
            StoreError::NameTaken => ErrorClass::Conflict,
            StoreError::NotFound => ErrorClass::NotFound,
            // The driver's error, classed once by `common::db::classify`.
            StoreError::Unavailable(_) => ErrorClass::TRANSIENT,
            StoreError::Database(_) => ErrorClass::Permanent,
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApiToken {
    pub id: Uuid,
    pub team_id: Uuid,
    pub scopes: Vec<String>,
    pub rate_limit_per_hour: Option<i32>,
    pub revoked: bool,
}

/// An API token as operators list it: never its value or its hash.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ApiTokenListing {
    pub id: Uuid,
    pub name: String,
    pub scopes: Vec<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

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

/// An unfinished keyed operation that recovery may try again now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueOperation {
    pub team_id: Uuid,
    pub key: String,
    pub sealed_operation: Vec<u8>,
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

/// Where central keeps a sealed value; what it names is what the value was sealed for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SealedAt {
    /// A pending create's intent.
    CreateIntent { di_id: Uuid },
    /// A create's first response, kept for identical retries.
    CreateResponse { di_id: Uuid, team_id: Uuid },
    /// The response an idempotency key replays.
    KeyResponse { team_id: Uuid, key: String },
    /// The operation an unfinished idempotency key re-drives.
    KeyOperation { team_id: Uuid, key: String },
}

impl SealedAt {
    /// Where a walk over each kind of sealed value starts (before the first of its kind).
    pub fn starts() -> [SealedAt; 4] {
        let (nil, key) = (Uuid::nil(), String::new());
        [
            SealedAt::CreateIntent { di_id: nil },
            SealedAt::CreateResponse {
                di_id: nil,
                team_id: nil,
            },
            SealedAt::KeyResponse {
                team_id: nil,
                key: key.clone(),
            },
            SealedAt::KeyOperation { team_id: nil, key },
        ]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedValue {
    pub at: SealedAt,
    pub sealed: Vec<u8>,
}

#[derive(Clone)]
pub struct CentralStore {
    pool: PgPool,
    cache: Arc<read_cache::ReadCache>,
}

impl CentralStore {
    pub fn new(pool: PgPool) -> CentralStore {
        CentralStore {
            pool,
            cache: Arc::default(),
        }
    }

    /// Serves [`CentralStore::dedicated_inference`] from memory for as long as the returned
    /// future runs (spawn it once per process); without it every lookup reads the database.
    pub fn watch_read_cache(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        read_cache::watch(self.cache.clone(), self.pool.clone())
    }

    /// Whether lookups are being served from memory (the cache's listener is connected).
    pub fn read_cache_serving(&self) -> bool {
        self.cache.serving()
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn migrate(&self) -> std::result::Result<(), sqlx::migrate::MigrateError> {
        common::db::migrate(&MIGRATOR, &self.pool).await
    }

    // -----------------------------------------------------------------------------------------
    // API tokens

    pub async fn api_token_create(
        &self,
        team_id: Uuid,
        name: &str,
        token_hash: &[u8],
        scopes: &[String],
        rate_limit_per_hour: Option<i32>,
    ) -> Result<Uuid> {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO api_tokens (id, team_id, name, token_hash, scopes, rate_limit_per_hour) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(team_id)
        .bind(name)
        .bind(token_hash)
        .bind(scopes)
        .bind(rate_limit_per_hour)
        .execute(&self.pool)
        .await?;
        Ok(id)
    }

    pub async fn api_token_by_hash(&self, token_hash: &[u8]) -> Result<Option<ApiToken>> {
        Ok(sqlx::query_as(
            "SELECT id, team_id, scopes, rate_limit_per_hour, revoked_at IS NOT NULL AS revoked FROM api_tokens WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// A team's API tokens, revoked ones included, oldest first.
    pub async fn api_tokens_of_team(&self, team_id: Uuid) -> Result<Vec<ApiTokenListing>> {
        Ok(sqlx::query_as(
            "SELECT id, name, scopes, created_at, revoked_at FROM api_tokens WHERE team_id = $1 ORDER BY created_at, id",
        )
        .bind(team_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// `NotFound` when no token has this id or it is revoked already.
    pub async fn api_token_revoke(&self, id: Uuid) -> Result<()> {
        let done = sqlx::query(
            "UPDATE api_tokens SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Creates: begin (ownership row + intent + key, one transaction), then confirm or abort.

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

    // -----------------------------------------------------------------------------------------
    // Ownership map and read model

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

    // -----------------------------------------------------------------------------------------
    // Idempotency keys

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

    /// Up to `limit` sealed values of the kind of `after` that come after it (in a fixed order)
    /// and do not begin with `prefix`: those a key rotation still has to re-seal.
    pub async fn sealed_values_after(
        &self,
        after: &SealedAt,
        prefix: &[u8],
        limit: i64,
    ) -> Result<Vec<SealedValue>> {
        let len = prefix.len() as i32;
        Ok(match after {
            SealedAt::CreateIntent { di_id } | SealedAt::CreateResponse { di_id, .. } => {
                let intent = matches!(after, SealedAt::CreateIntent { .. });
                let (from, id, column) = if intent {
                    (
                        "pending_creates p JOIN dedicated_inferences d ON d.id = p.di_id",
                        "p.di_id",
                        "p.sealed",
                    )
                } else {
                    ("dedicated_inferences d", "d.id", "d.create_response")
                };
                sqlx::query_as::<_, (Uuid, Uuid, Vec<u8>)>(&format!(
                    "SELECT {id}, d.team_id, {column} FROM {from}
                     WHERE {column} IS NOT NULL AND {id} > $1 AND substring({column} from 1 for $2) <> $3
                     ORDER BY {id} LIMIT $4"
                ))
                .bind(di_id)
                .bind(len)
                .bind(prefix)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
                .into_iter()
                .map(|(di_id, team_id, sealed)| SealedValue {
                    at: if intent {
                        SealedAt::CreateIntent { di_id }
                    } else {
                        SealedAt::CreateResponse { di_id, team_id }
                    },
                    sealed,
                })
                .collect()
            }
            SealedAt::KeyResponse { team_id, key } | SealedAt::KeyOperation { team_id, key } => {
                let operation = matches!(after, SealedAt::KeyOperation { .. });
                let column = if operation {
                    "sealed_operation"
                } else {
                    "sealed_body"
                };
                sqlx::query_as::<_, (Uuid, String, Vec<u8>)>(&format!(
                    "SELECT team_id, key, {column} FROM idempotency_keys
                     WHERE {column} IS NOT NULL AND (team_id, key) > ($1, $2)
                       AND substring({column} from 1 for $3) <> $4
                     ORDER BY team_id, key LIMIT $5"
                ))
                .bind(team_id)
                .bind(key)
                .bind(len)
                .bind(prefix)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
                .into_iter()
                .map(|(team_id, key, sealed)| SealedValue {
                    at: if operation {
                        SealedAt::KeyOperation { team_id, key }
                    } else {
                        SealedAt::KeyResponse { team_id, key }
                    },
                    sealed,
                })
                .collect()
            }
        })
    }

    /// Puts `resealed` in place of `value`, unless the value changed meanwhile (false then).
    pub async fn sealed_value_replace(&self, value: &SealedValue, resealed: &[u8]) -> Result<bool> {
        let query = match &value.at {
            SealedAt::CreateIntent { di_id } => {
                sqlx::query("UPDATE pending_creates SET sealed = $3 WHERE di_id = $1 AND sealed = $2")
                    .bind(di_id)
            }
            SealedAt::CreateResponse { di_id, .. } => sqlx::query(
                "UPDATE dedicated_inferences SET create_response = $3 WHERE id = $1 AND create_response = $2",
            )
            .bind(di_id),
            SealedAt::KeyResponse { team_id, key } => sqlx::query(
                "UPDATE idempotency_keys SET sealed_body = $4 WHERE team_id = $1 AND key = $2 AND sealed_body = $3",
            )
            .bind(team_id)
            .bind(key),
            SealedAt::KeyOperation { team_id, key } => sqlx::query(
                "UPDATE idempotency_keys SET sealed_operation = $4 WHERE team_id = $1 AND key = $2 AND sealed_operation = $3",
            )
            .bind(team_id)
            .bind(key),
        };
        Ok(query
            .bind(&value.sealed)
            .bind(resealed)
            .execute(&self.pool)
            .await?
            .rows_affected()
            == 1)
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

async fn apply(
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

/// What central keeps sealed about a DI goes when the DI does: the create's intent and its
/// first response (both hold the managed token's value, the intent the Hugging Face token), and
/// the responses and operations of its idempotency keys (minted tokens, Hugging Face tokens).
/// The keys stay, answered, so that none of their requests runs again; a keyed operation
/// still in flight is over (the region would refuse it now) and its key goes.
async fn erase_secrets(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: Uuid) -> Result<()> {
    sqlx::query("DELETE FROM pending_creates WHERE di_id = $1")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE dedicated_inferences SET create_fingerprint = NULL, create_status_code = NULL, create_response = NULL
         WHERE id = $1 AND create_response IS NOT NULL",
    )
    .bind(id)
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM idempotency_keys WHERE target_di_id = $1 AND status_code IS NULL")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE idempotency_keys SET sealed_body = NULL, sealed_operation = NULL
         WHERE (di_id = $1 OR target_di_id = $1) AND (sealed_body IS NOT NULL OR sealed_operation IS NOT NULL)",
    )
    .bind(id)
    .execute(&mut **tx)
    .await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_its_class() {
        let classes = [
            (StoreError::NameTaken, ErrorClass::Conflict),
            (StoreError::NotFound, ErrorClass::NotFound),
            (
                StoreError::Unavailable(sqlx::Error::PoolClosed),
                ErrorClass::TRANSIENT,
            ),
            (
                StoreError::Database(sqlx::Error::RowNotFound),
                ErrorClass::Permanent,
            ),
        ];
        for (e, class) in classes {
            assert_eq!(e.class(), class, "{e}");
        }
    }
}
