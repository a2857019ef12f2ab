//! An in-process cache of ownership rows, so that a GET (and the ownership check in front of every
//! per-DI operation) costs no database round trip, and of teams' lists, so that a list does not
//! either.
//!
//! Coherence comes from Postgres itself: a trigger on `dedicated_inferences` sends the id of every
//! changed row on [`CHANNEL`] and its team on [`TEAM_CHANNEL`] when its transaction commits, and
//! [`watch`] drops that row and that team's list from the cache. Every central replica therefore
//! sees another replica's write as soon as it commits, and a replica's own writes also invalidate
//! synchronously (the row and its team's list), so its client reads what it just wrote.
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

/// The channel on which the same trigger names the changed row's team (migration 0006).
pub const TEAM_CHANNEL: &str = "central_team_lists";

/// Beyond this many rows new fills are skipped; the rows already held keep serving. The same
/// bound holds for the entries of every cached list together.
const CAPACITY: usize = 200_000;

/// A team with more live DIs than this is listed from the database page by page: rebuilding its
/// whole list after each of its changes would cost more than the pages it serves (a fill of
/// 1,000 bodies of 1.5 KB took 10 ms, a page from the database 3.6 ms).
pub(crate) const MAX_CACHED_LIST: usize = 250;

#[derive(Default)]
pub(crate) struct ReadCache {
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    rows: HashMap<Uuid, Arc<Owned>>,
    lists: HashMap<Uuid, Arc<TeamList>>,
    list_entries: usize,
    /// The last invalidations of lists, `(generation, team)`, newest last (`None`: every team):
    /// a list filled from a read taken at an older generation is refused only if its own team
    /// changed since, so writes of other teams do not keep a list from being cached.
    list_changes: std::collections::VecDeque<(u64, Option<Uuid>)>,
    /// The generation of the newest invalidation the log let go of.
    list_changes_forgotten: u64,
    generation: u64,
    listening: bool,
}

/// How many list invalidations [`Inner::list_changes`] remembers.
const LIST_CHANGES: usize = 4096;

impl Inner {
    fn list_changed(&mut self, team: Option<Uuid>) {
        self.generation += 1;
        if self.list_changes.len() == LIST_CHANGES {
            if let Some((g, _)) = self.list_changes.pop_front() {
                self.list_changes_forgotten = g;
            }
        }
        self.list_changes.push_back((self.generation, team));
    }

    /// Whether `team`'s list may have changed after generation `since`.
    fn list_changed_since(&self, team: Uuid, since: u64) -> bool {
        // A change the log no longer holds may have been this team's.
        self.list_changes_forgotten > since
            || self
                .list_changes
                .iter()
                .rev()
                .take_while(|(g, _)| *g > since)
                .any(|(_, t)| t.is_none_or(|t| t == team))
    }
}

/// A team's live DIs that have a public body, oldest first (`created_at`, then id), as a list
/// reads them; or, for a team above [`MAX_CACHED_LIST`], only that it is (its pages are read
/// from the database, without first reading its whole list again).
#[derive(Debug, Default)]
pub(crate) struct TeamList {
    pub(crate) entries: Vec<ListEntry>,
    pub(crate) too_large: bool,
}

#[derive(Debug)]
pub(crate) struct ListEntry {
    pub(crate) region: String,
    pub(crate) name: String,
    pub(crate) body: String,
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

    pub(crate) fn list(&self, team: Uuid) -> Option<Arc<TeamList>> {
        let inner = self.inner.read().expect("cache lock");
        inner.lists.get(&team).cloned()
    }

    pub(crate) fn fill_list(&self, ticket: Ticket, team: Uuid, list: Arc<TeamList>) {
        let mut inner = self.inner.write().expect("cache lock");
        let n = list.entries.len();
        let Some(since) = ticket.0 else { return };
        if !inner.list_changed_since(team, since)
            && inner.listening
            && inner.list_entries + n <= CAPACITY
        {
            inner.list_entries += n;
            if let Some(old) = inner.lists.insert(team, list) {
                inner.list_entries -= old.entries.len();
            }
        }
    }

    /// A write of this process to row `id` of `team`: the row and the team's list go.
    pub(crate) fn invalidate(&self, id: Uuid, team: Uuid) {
        self.row_changed(id);
        self.team_changed(team);
    }

    /// A committed change of row `id`, by any replica (or a write of this process to a row no
    /// list shows: a pending create's).
    pub(crate) fn row_changed(&self, id: Uuid) {
        let mut inner = self.inner.write().expect("cache lock");
        inner.generation += 1;
        inner.rows.remove(&id);
    }

    /// A committed change of one of `team`'s rows, by any replica. A team known to be too
    /// large to cache stays so (its pages come from the database, right whatever it holds):
    /// it is not read whole again only to learn that.
    fn team_changed(&self, team: Uuid) {
        let mut inner = self.inner.write().expect("cache lock");
        inner.list_changed(Some(team));
        if inner.lists.get(&team).is_some_and(|l| !l.too_large) {
            if let Some(old) = inner.lists.remove(&team) {
                inner.list_entries -= old.entries.len();
            }
        }
    }

    pub(crate) fn serving(&self) -> bool {
        self.inner.read().expect("cache lock").listening
    }

    /// Empties the cache and says whether notifications are arriving from now on.
    fn reset(&self, listening: bool) {
        let mut inner = self.inner.write().expect("cache lock");
        inner.list_changed(None);
        inner.rows.clear();
        inner.lists.clear();
        inner.list_entries = 0;
        inner.listening = listening;
    }
}

/// Keeps the cache coherent for as long as the future runs: listens on [`CHANNEL`] and
/// [`TEAM_CHANNEL`], drops each notified row and team list, and reconnects (with an empty cache)
/// whenever the connection is lost.
pub(crate) async fn watch(cache: Arc<ReadCache>, pool: PgPool) {
    loop {
        match listen(&pool).await {
            Ok(mut listener) => {
                cache.reset(true);
                // `Ok(None)` is a dropped connection: sqlx would re-LISTEN silently, but whatever
                // was sent in between is lost, so start over.
                while let Ok(Some(n)) = listener.try_recv().await {
                    match (n.channel(), n.payload().parse::<Uuid>()) {
                        (TEAM_CHANNEL, Ok(team)) => cache.team_changed(team),
                        (_, Ok(id)) => cache.row_changed(id),
                        (_, Err(_)) => cache.reset(true),
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
    listener.listen_all([CHANNEL, TEAM_CHANNEL]).await?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listening() -> ReadCache {
        let cache = ReadCache::default();
        cache.reset(true);
        cache
    }

    /// A list read while another team changed is cached; one read while its own team changed,
    /// or while this process wrote, is not; nor one the change log no longer reaches back to.
    #[test]
    fn a_list_fill_is_refused_only_for_changes_of_its_own_team() {
        let (team, other) = (Uuid::new_v4(), Uuid::new_v4());
        let cache = listening();
        let fill = |cache: &ReadCache, between: &dyn Fn(&ReadCache)| {
            let ticket = cache.ticket();
            between(cache);
            cache.fill_list(ticket, team, Arc::default());
            cache.list(team).is_some()
        };
        assert!(fill(&cache, &|c| {
            c.row_changed(Uuid::new_v4());
            c.team_changed(other);
        }));
        cache.team_changed(team);
        assert!(!fill(&cache, &|c| c.team_changed(team)));
        assert!(!fill(&cache, &|c| c.invalidate(Uuid::new_v4(), team)));
        cache.team_changed(team);
        assert!(fill(&cache, &|c| c.invalidate(Uuid::new_v4(), other)));
        cache.team_changed(team);
        assert!(!fill(&cache, &|c| {
            for _ in 0..=LIST_CHANGES {
                c.team_changed(other);
            }
        }));
        assert!(fill(&cache, &|_| {}));
    }
}
