//! The object store: every object of every kind, a global resourceVersion
//! counter, and a bounded history of changes so watches can resume.
//!
//! Everything happens under one mutex. Operations are short and in-memory, and a
//! single lock makes "read, decide, write" atomic for both HTTP requests and the
//! built-in controllers, so neither can lose the other's update.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use serde_json::Value;
use tokio::sync::{broadcast, Notify};

/// How many changes are kept for watch resumption; older resourceVersions get 410 Gone.
const HISTORY: usize = 20_000;
/// How long a change is kept for watch resumption at most, as etcd keeps history until its
/// periodic compaction (every 5 minutes by default): a cluster where nothing happens holds its
/// objects and nothing more. Each kept change holds a version of an object, so without an age
/// limit a busy cluster's history, not its objects, made up most of its memory.
const HISTORY_AGE: Duration = Duration::from_secs(300);

/// How many changes a watcher may fall behind before it must re-list (410 Gone). The buffer is
/// allocated when the store is made, a slot per change, so it is a cost of every cluster.
const WATCH_BUFFER: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub rt: usize,
    /// Empty for cluster-scoped objects.
    pub ns: String,
    pub name: String,
}

impl Key {
    pub fn new(rt: usize, ns: &str, name: &str) -> Key {
        Key {
            rt,
            ns: ns.to_string(),
            name: name.to_string(),
        }
    }

    /// The key of a stored object.
    pub fn of(rt: usize, obj: &Value) -> Key {
        Key::new(rt, meta_str(obj, "namespace"), meta_str(obj, "name"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

#[derive(Debug)]
pub struct Change {
    pub rv: u64,
    pub rt: usize,
    pub kind: EventType,
    pub object: Arc<Value>,
    /// The previous state, so watches with selectors can turn a MODIFIED that
    /// leaves the selection into a DELETED (as the real server does).
    pub old: Option<Arc<Value>>,
}

pub struct Inner {
    /// Shared, immutable objects in a copy-on-write map: a write replaces an object's `Arc`
    /// (copying the map only while a controller's snapshot still holds it), so a snapshot of
    /// the whole store costs one reference count.
    pub objects: Arc<BTreeMap<Key, Arc<Value>>>,
    pub rv: u64,
    /// Recent changes, oldest first, with when they were made.
    history: VecDeque<(Instant, Arc<Change>)>,
    /// Highest resourceVersion no longer in `history`.
    compacted: u64,
}

impl Inner {
    pub fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key).map(Arc::as_ref)
    }

    /// Objects of one type, optionally in one namespace, in (namespace, name) order.
    pub fn list(&self, rt: usize, ns: Option<&str>) -> impl Iterator<Item = &Value> + '_ {
        let lo = Key::new(rt, ns.unwrap_or(""), "");
        let ns_owned = ns.map(String::from);
        self.objects
            .range(lo..)
            .take_while(move |(k, _)| k.rt == rt && ns_owned.as_ref().is_none_or(|n| &k.ns == n))
            .map(|(_, v)| v.as_ref())
    }

    /// Changes after `rv`, or None when some of them are no longer kept.
    pub fn changes_since(&self, rv: u64) -> Option<Vec<Arc<Change>>> {
        if rv < self.compacted {
            return None;
        }
        Some(
            self.history
                .iter()
                .filter(|(_, c)| c.rv > rv)
                .map(|(_, c)| c.clone())
                .collect(),
        )
    }

    /// Drops changes beyond [`HISTORY`] or older than [`HISTORY_AGE`].
    fn prune(&mut self, now: Instant) {
        while let Some((at, c)) = self.history.front() {
            if self.history.len() <= HISTORY && now.duration_since(*at) < HISTORY_AGE {
                break;
            }
            self.compacted = c.rv;
            self.history.pop_front();
        }
    }
}

pub struct Store {
    inner: Mutex<Inner>,
    changes: broadcast::Sender<Arc<Change>>,
    versions: broadcast::Sender<u64>,
    /// Wakes the controller loop after any change.
    pub notify: Notify,
    writes: AtomicU64,
    seq: AtomicU64,
}

pub fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj.get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or_default()
}

pub fn now_rfc3339() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

impl Store {
    pub fn new() -> Store {
        let (changes, _) = broadcast::channel(WATCH_BUFFER);
        let (versions, _) = broadcast::channel(1024);
        Store {
            inner: Mutex::new(Inner {
                objects: Arc::default(),
                rv: 1,
                history: VecDeque::new(),
                compacted: 0,
            }),
            changes,
            versions,
            notify: Notify::new(),
            writes: AtomicU64::new(0),
            seq: AtomicU64::new(1),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the map half-written (every
        // mutation is a single insert/remove), so a poisoned lock is safe to reuse.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn subscribe_changes(&self) -> broadcast::Receiver<Arc<Change>> {
        self.changes.subscribe()
    }

    pub fn subscribe_versions(&self) -> broadcast::Receiver<u64> {
        self.versions.subscribe()
    }

    pub fn count_write(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// A per-cluster sequence for allocating addresses.
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    pub fn write_count(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Drops the watch history so any resume from an older resourceVersion gets
    /// 410 Gone (lets tests exercise re-list paths).
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.history.clear();
        inner.compacted = inner.rv;
    }

    /// Forgets changes older than the history keeps (see [`HISTORY_AGE`]); a cluster's
    /// controller loop calls it as time passes, so a quiet cluster lets go of its history.
    pub fn prune_history(&self) {
        self.lock().prune(Instant::now());
    }

    fn record(&self, inner: &mut Inner, change: Change) {
        let change = Arc::new(change);
        let now = Instant::now();
        inner.history.push_back((now, change.clone()));
        inner.prune(now);
        let rv = change.rv;
        let _ = self.changes.send(change);
        let _ = self.versions.send(rv);
        self.notify.notify_one();
    }

    /// Stores `obj` under a fresh resourceVersion and emits ADDED or MODIFIED.
    pub fn commit(&self, inner: &mut Inner, rt: usize, mut obj: Value) -> Value {
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        let key = Key::of(rt, &obj);
        let obj = Arc::new(obj);
        let old = Arc::make_mut(&mut inner.objects).insert(key, obj.clone());
        let kind = if old.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(
            inner,
            Change {
                rv,
                rt,
                kind,
                object: obj.clone(),
                old,
            },
        );
        Arc::unwrap_or_clone(obj)
    }

    /// Removes an object for good and emits DELETED carrying a fresh resourceVersion.
    pub fn remove(&self, inner: &mut Inner, key: &Key) -> Option<Value> {
        let mut obj = Arc::unwrap_or_clone(Arc::make_mut(&mut inner.objects).remove(key)?);
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.record(
            inner,
            Change {
                rv,
                rt: key.rt,
                kind: EventType::Deleted,
                object: Arc::new(obj.clone()),
                old: None,
            },
        );
        Some(obj)
    }

    /// Every stored object (the inventory used by leak checks).
    pub fn all(&self) -> Vec<Value> {
        self.lock()
            .objects
            .values()
            .map(|v| v.as_ref().clone())
            .collect()
    }
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn history_older_than_its_age_is_forgotten() {
        let store = Store::new();
        let rt = crate::resources::index_of("ConfigMap");
        let mut rvs = Vec::new();
        for name in ["a", "b", "c"] {
            let mut inner = store.lock();
            let obj = store.commit(
                &mut inner,
                rt,
                json!({"metadata": {"name": name, "namespace": "default"}}),
            );
            rvs.push(meta_str(&obj, "resourceVersion").parse::<u64>().unwrap());
        }
        let mut inner = store.lock();
        assert_eq!(inner.changes_since(rvs[0]).unwrap().len(), 2);
        // Just before the age limit everything is kept; past it, nothing is.
        let now = Instant::now();
        inner.prune(now + HISTORY_AGE - Duration::from_secs(1));
        assert_eq!(inner.changes_since(rvs[0]).unwrap().len(), 2);
        inner.prune(now + HISTORY_AGE + Duration::from_secs(1));
        assert!(inner.history.is_empty());
        assert!(
            inner.changes_since(rvs[0]).is_none(),
            "resuming from before the pruned changes: 410"
        );
        assert_eq!(
            inner.changes_since(rvs[2]).map(|c| c.len()),
            Some(0),
            "resuming from the newest version still works"
        );
        assert_eq!(inner.objects.len(), 3, "objects stay");
    }
}
