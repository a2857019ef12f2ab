//! Central's store: every SQL statement of the central API. It owns API tokens, the ownership map
//! (dedicated inference id → team, region) together with the read model of each DI fed from the
//! regions' change feeds, the pending creates that make a create exactly-once across central and
//! region (and each create's first response, for identical retries), idempotency records with the
//! keyed operations behind them, and the feed cursors. Sealing and policy are the caller's: rows
//! hold what they are given, until the DI they are about is gone, when every sealed value about
//! it is erased. Ownership rows are also cached in process ([`read_cache`]), kept
//! coherent across replicas by Postgres notifications while [`CentralStore::watch_read_cache`] runs.
//!
//! This file holds the error type and the store's handle; each concern is a module of its own
//! adding to `impl CentralStore`: API tokens (`tokens`), creates in flight (`creates`), the
//! ownership map and read model with the feed cursors (`read_model`), idempotency keys and keyed
//! operations (`idempotency`), and sealed values (`sealed`).

mod creates;
mod idempotency;
mod read_cache;
mod read_model;
mod sealed;
mod tokens;

use std::sync::Arc;

use common::errors::{Classify, ErrorClass};
use sqlx::postgres::PgPool;

pub use creates::{CreateBegin, CreateState, DueCreate, NewCreate};
pub use idempotency::{DueOperation, IdempotencyState, KeyedOperation};
pub use read_model::{Owned, ReadModelUpdate};
pub use sealed::{SealedAt, SealedValue};
pub use tokens::{ApiToken, ApiTokenListing};

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
