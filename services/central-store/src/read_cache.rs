//! An in-process cache of ownership rows, so that a GET (and the ownership check in front of every
//! per-DI operation) costs no database round trip.
//!
//! Coherence comes from Postgres itself: a trigger on `dedicated_inferences` sends the id of every
//! changed row on [`CHANNEL`] when its transaction commits, and [`watch`] drops that id from the
//! cache. Every central replica therefore sees another replica's write as soon as it commits, and
//! a replica's own writes also invalidate synchronously, so its client reads what it just wrote.
//!
//! The cache only serves while the listener is connected: before the first `LISTEN`, and from a
//! lost connection until a new `LISTEN` is in place, it is empty and bypassed, because
//! notifications sent meanwhile are lost. A fill races with invalidations the usual way (read the
//! row, a write commits, the stale row gets cached); a generation counter bumped by every
//! invalidation, and checked under the same lock as the insert, rejects such fills.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use uuid::Uuid;

use crate::Owned;

/// The channel the `dedicated_inferences` trigger notifies (migration 0002).
pub const CHANNEL: &str = "central_dedicated_inferences";

/// Beyond this many rows new fills are skipped; the rows already held keep serving.
const CAPACITY: usize = 200_000;

#[derive(Default)]
pub(crate) struct ReadCache {
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    rows: HashMap<Uuid, Arc<Owned>>,
    generation: u64,
    listening: bool,
}

/// Proof of when a fill read the database: [`ReadCache::fill`] refuses it if anything was
/// invalidated since.
pub(crate) struct Ticket(Option<u64>);

impl ReadCache {
    pub(crate) fn get(&self, id: Uuid) -> Option<Arc<Owned>> {
        let inner = self.inner.read().expect("cache lock");
        inner.rows.get(&id).cloned()
    }

    /// Taken before reading a row from the database, to fill with it afterwards.
    pub(crate) fn ticket(&self) -> Ticket {
        let inner = self.inner.read().expect("cache lock");
        Ticket(inner.listening.then_some(inner.generation))
    }

    pub(crate) fn fill(&self, ticket: Ticket, row: Arc<Owned>) {
        let mut inner = self.inner.write().expect("cache lock");
        if ticket.0 == Some(inner.generation) && inner.listening && inner.rows.len() < CAPACITY {
            inner.rows.insert(row.id, row);
        }
    }

    pub(crate) fn invalidate(&self, id: Uuid) {
        let mut inner = self.inner.write().expect("cache lock");
        inner.generation += 1;
        inner.rows.remove(&id);
    }

    pub(crate) fn serving(&self) -> bool {
        self.inner.read().expect("cache lock").listening
    }

    /// Empties the cache and says whether notifications are arriving from now on.
    fn reset(&self, listening: bool) {
        let mut inner = self.inner.write().expect("cache lock");
        inner.generation += 1;
        inner.rows.clear();
        inner.listening = listening;
    }
}

/// Keeps the cache coherent for as long as the future runs: listens on [`CHANNEL`], drops each
/// notified id, and reconnects (with an empty cache) whenever the connection is lost.
pub(crate) async fn watch(cache: Arc<ReadCache>, pool: PgPool) {
    loop {
        match listen(&pool).await {
            Ok(mut listener) => {
                cache.reset(true);
                // `Ok(None)` is a dropped connection: sqlx would re-LISTEN silently, but whatever
                // was sent in between is lost, so start over.
                while let Ok(Some(n)) = listener.try_recv().await {
                    match n.payload().parse::<Uuid>() {
                        Ok(id) => cache.invalidate(id),
                        Err(_) => cache.reset(true),
                    }
                }
                cache.reset(false);
                tracing::warn!("read-cache listener lost its connection; reconnecting");
            }
            Err(error) => {
                tracing::warn!(%error, "read-cache listener could not connect; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}
