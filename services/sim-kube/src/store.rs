//! The object store: every object of every kind, a global resourceVersion
//! counter, and a bounded history of changes so watches can resume.
//!
//! Everything happens under one mutex. Operations are short and in-memory, and a
//! single lock makes "read, decide, write" atomic for both HTTP requests and the
//! built-in controllers, so neither can lose the other's update.
//!
//! Objects are kept as compact JSON, as etcd keeps them serialised, and parsed while they are in
//! use ([`Stored`]): a parsed object takes about eight times its JSON's size, which made the
//! objects of a region's thousands of settled clusters most of the simulator's memory.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// How often objects no one read or wrote since the last time drop their parsed form.
const COOL_EVERY: Duration = Duration::from_secs(10);

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

/// One version of an object: its compact JSON, and its parsed form while someone uses it. A
/// version is never changed; a write stores a new one.
#[derive(Debug)]
pub struct Stored {
    text: Box<str>,
    parsed: Mutex<Option<Arc<Value>>>,
    /// Read or written since the store last cooled its objects.
    used: AtomicBool,
    /// The last cooling that looked at it (a version is both an object and a kept change).
    cooled_by: AtomicU64,
}

impl Stored {
    pub fn new(object: Value) -> Stored {
        Stored {
            text: serde_json::to_string(&object)
                .expect("JSON values serialise")
                .into_boxed_str(),
            parsed: Mutex::new(Some(Arc::new(object))),
            used: AtomicBool::new(true),
            cooled_by: AtomicU64::new(0),
        }
    }

    /// The object, parsed again if it was cooled.
    pub fn value(&self) -> Arc<Value> {
        self.used.store(true, Ordering::Relaxed);
        let mut parsed = self.parsed.lock().unwrap_or_else(|e| e.into_inner());
        parsed
            .get_or_insert_with(|| {
                Arc::new(serde_json::from_str(&self.text).expect("stored JSON parses"))
            })
            .clone()
    }

    /// The object as compact JSON.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Drops the parsed form unless it was used since the last cooling before `cooling`.
    fn cool(&self, cooling: u64) {
        if self.cooled_by.swap(cooling, Ordering::Relaxed) == cooling {
            return;
        }
        if !self.used.swap(false, Ordering::Relaxed) {
            *self.parsed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

#[derive(Debug)]
pub struct Change {
    pub rv: u64,
    pub rt: usize,
    pub kind: EventType,
    pub object: Arc<Stored>,
    /// The previous state, so watches with selectors can turn a MODIFIED that
    /// leaves the selection into a DELETED (as the real server does).
    pub old: Option<Arc<Stored>>,
}

pub struct Inner {
    /// Shared, immutable objects in a copy-on-write map: a write replaces an object's `Arc`
    /// (copying the map only while a controller's snapshot still holds it), so a snapshot of
    /// the whole store costs one reference count.
    pub objects: Arc<BTreeMap<Key, Arc<Stored>>>,
    pub rv: u64,
    /// Recent changes, oldest first, with when they were made.
    history: VecDeque<(Instant, Arc<Change>)>,
    /// Highest resourceVersion no longer in `history`.
    compacted: u64,
    /// When objects last dropped the parsed forms no one used, and how many times they did.
    cooled_at: Instant,
    coolings: u64,
}

impl Inner {
    pub fn get(&self, key: &Key) -> Option<Arc<Value>> {
        self.objects.get(key).map(|s| s.value())
    }

    /// Objects of one type, optionally in one namespace, in (namespace, name) order.
    pub fn list(&self, rt: usize, ns: Option<&str>) -> impl Iterator<Item = Arc<Value>> + '_ {
        self.stored(rt, ns).map(|s| s.value())
    }

    /// The same objects as stored.
    pub fn stored(&self, rt: usize, ns: Option<&str>) -> impl Iterator<Item = &Stored> + '_ {
        let lo = Key::new(rt, ns.unwrap_or(""), "");
        let ns_owned = ns.map(String::from);
        self.objects
            .range(lo..)
            .take_while(move |(k, _)| k.rt == rt && ns_owned.as_ref().is_none_or(|n| &k.ns == n))
            .map(|(_, v)| v.as_ref())
    }

    /// Every [`COOL_EVERY`], drops the parsed forms of objects (and of kept changes) that no
    /// one used since the last time.
    fn cool(&mut self, now: Instant) {
        if now.duration_since(self.cooled_at) < COOL_EVERY {
            return;
        }
        self.cooled_at = now;
        self.coolings += 1;
        let cooling = self.coolings;
        self.objects.values().for_each(|s| s.cool(cooling));
        for (_, c) in &self.history {
            c.object.cool(cooling);
            if let Some(old) = &c.old {
                old.cool(cooling);
            }
        }
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
                cooled_at: Instant::now(),
                coolings: 0,
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

    /// Forgets changes older than the history keeps (see [`HISTORY_AGE`]) and parsed objects no
    /// one uses; a cluster's controller loop calls it as time passes, so a quiet cluster holds
    /// its objects as JSON and nothing more.
    pub fn prune_history(&self) {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.prune(now);
        inner.cool(now);
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
        let stored = Arc::new(Stored::new(obj));
        let obj = stored.value();
        let old = Arc::make_mut(&mut inner.objects).insert(key, stored.clone());
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
                object: stored,
                old,
            },
        );
        Arc::unwrap_or_clone(obj)
    }

    /// Removes an object for good and emits DELETED carrying a fresh resourceVersion.
    pub fn remove(&self, inner: &mut Inner, key: &Key) -> Option<Value> {
        let mut obj = Arc::make_mut(&mut inner.objects)
            .remove(key)?
            .value()
            .as_ref()
            .clone();
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        self.record(
            inner,
            Change {
                rv,
                rt: key.rt,
                kind: EventType::Deleted,
                object: Arc::new(Stored::new(obj.clone())),
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
            .map(|v| v.value().as_ref().clone())
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

    fn parsed(inner: &Inner) -> usize {
        inner
            .objects
            .values()
            .filter(|o| o.parsed.lock().unwrap().is_some())
            .count()
    }

    #[test]
    fn objects_no_one_uses_are_kept_as_json_only() {
        let store = Store::new();
        let rt = crate::resources::index_of("ConfigMap");
        let mut inner = store.lock();
        for name in ["a", "b"] {
            let obj =
                json!({"metadata": {"name": name, "namespace": "default"}, "data": {"k": name}});
            store.commit(&mut inner, rt, obj);
        }
        let t0 = Instant::now();
        inner.cool(t0 + COOL_EVERY);
        assert_eq!(
            parsed(&inner),
            2,
            "written since the last cooling: still parsed"
        );
        // "a" is read; "b" is not.
        let a = inner.get(&Key::new(rt, "default", "a")).unwrap();
        inner.cool(t0 + COOL_EVERY * 2);
        assert_eq!(parsed(&inner), 1);
        inner.cool(t0 + COOL_EVERY * 3);
        assert_eq!(parsed(&inner), 0);
        // Read again, each is the object it was.
        let b = inner.get(&Key::new(rt, "default", "b")).unwrap();
        assert_eq!(b["data"]["k"], "b");
        assert_eq!(*inner.get(&Key::new(rt, "default", "a")).unwrap(), *a);
        let stored = inner.objects.get(&Key::new(rt, "default", "b")).unwrap();
        assert_eq!(serde_json::from_str::<Value>(stored.text()).unwrap(), *b);
        // Changes kept for watches are cooled too.
        inner.cool(t0 + COOL_EVERY * 4);
        inner.cool(t0 + COOL_EVERY * 5);
        assert!(inner
            .history
            .iter()
            .all(|(_, c)| c.object.parsed.lock().unwrap().is_none()));
    }
}
