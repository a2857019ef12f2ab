//! What the worker's resyncs observe, kept per cluster by watches rather than listed per pass.
//!
//! A cluster's cache runs one watch per kind the worker reads (the kinds it renders, pods,
//! nodes), shared by every DI of the cluster, as client-go's informers and kube-runtime's
//! reflectors do: a LIST, then a WATCH resumed from its `resourceVersion`, and a fresh LIST
//! when the server says the watch is too old (410 Gone). Objects are indexed by the DI they
//! belong to, so a resync reads its DI's objects without a request, and a change that the
//! worker did not wait for (an object deleted or edited behind its back, a pod that crashed, a
//! node that went away) wakes the DI's pass at once instead of at its next resync.
//!
//! Only resyncs read the cache, and only some time after the DI's previous pass (see
//! `plan::step::reads_cache`): a watch lags the server, and a pass that judged from a copy older
//! than what an earlier pass (of this worker or another) saw could undo what that pass did
//! (record an old address again, ask a fleet slot for a DI already updated). Passes of a DI
//! that is moving list as before. As client-go's informers do, a failed watch resumes from the
//! last `resourceVersion` it saw (a LIST only after 410 Gone), so a dropped connection costs no
//! relist; but a kind whose watch failed is not trusted until [`TRUST_AFTER_FAILURE`] has
//! passed without another failure or until it delivers an event: until then resyncs list.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cloud_clients::{KubeClient, WatchEvent};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::plan::names;

/// Who a watched object belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The DI named by its [`names::DI_ID_LABEL`] label.
    Label,
    /// The DI whose namespace it is in (pods, which carry the labels of their template).
    Namespace,
}

/// One kind a cluster's cache watches.
#[derive(Debug, Clone)]
pub struct Watched {
    pub api_version: &'static str,
    pub kind: &'static str,
    /// The server-side label selector of the watch (empty: every object of the kind).
    pub selector: String,
    pub owner: Owner,
}

/// DIs whose objects changed under them, to be made due (see `runtime`): a set, so a burst of
/// events on one DI wakes it once.
#[derive(Default)]
pub struct Wakes {
    due: Mutex<HashSet<Uuid>>,
    notify: Notify,
}

impl Wakes {
    pub fn wake(&self, di: Uuid) {
        self.due.lock().expect("wakes").insert(di);
        self.notify.notify_one();
    }

    /// Waits until at least one DI is to be woken.
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// The DIs to wake, forgotten here.
    pub fn take(&self) -> Vec<Uuid> {
        self.due.lock().expect("wakes").drain().collect()
    }
}

/// How long after a failure of its watch a kind's cache is not read, unless the watch delivers
/// an event first: longer than the watcher's longest backoff (30 s) plus a request that times
/// out (30 s), so that a watch that keeps failing is never trusted between its attempts.
pub const TRUST_AFTER_FAILURE: Duration = Duration::from_secs(90);

/// An object's key: (namespace, name), the order a LIST returns objects in.
type Key = (String, String);
/// An object as kept: its compact JSON. As a `serde_json::Value` it took about ten times the
/// memory (0.44 MB per DI, where its JSON is some 45 kB); a resync parses its DI's objects.
type Kept = Box<str>;
/// Objects of one kind, by DI and then by key.
type ByDi = HashMap<Uuid, BTreeMap<Key, Kept>>;

#[derive(Default)]
struct KindState {
    /// A LIST has completed since the watcher last started one.
    listed: bool,
    /// Listed once: a later LIST's differences are changes and wake their DIs.
    listed_before: bool,
    /// The watch's last failure, if it has delivered nothing since.
    failed_at: Option<Instant>,
    by_di: ByDi,
    /// The DI each object is kept under: an object relabelled to another DI, or to none,
    /// leaves the one it was under.
    owners: HashMap<Key, Uuid>,
    /// What a LIST in progress has returned so far.
    listing: Option<ByDi>,
    /// Per DI, how many changes a pass would act on this kind has seen (those that wake it).
    changes: HashMap<Uuid, u64>,
}

impl KindState {
    fn trusted(&self) -> bool {
        self.listed
            && self
                .failed_at
                .is_none_or(|t| t.elapsed() >= TRUST_AFTER_FAILURE)
    }
}

struct KindCache {
    watched: Watched,
    state: Mutex<KindState>,
}

/// The watches of one cluster, for as long as its client is used: dropping the cache stops
/// them.
pub struct ClusterCache {
    /// Unique among the caches of this process: change counts of different caches (a cluster's
    /// client renewed, its watches started again) are never compared.
    id: u64,
    kinds: Vec<Arc<KindCache>>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for ClusterCache {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl ClusterCache {
    /// Starts watching `kinds` through `kube`; changes after the first LIST wake their DIs.
    pub fn start(kube: &KubeClient, kinds: Vec<Watched>, wakes: Arc<Wakes>) -> ClusterCache {
        let kinds: Vec<Arc<KindCache>> = kinds
            .into_iter()
            .map(|watched| {
                Arc::new(KindCache {
                    watched,
                    state: Mutex::new(KindState::default()),
                })
            })
            .collect();
        let tasks = kinds
            .iter()
            .map(|k| tokio::spawn(watch(k.clone(), kube.clone(), wakes.clone())).abort_handle())
            .collect();
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        ClusterCache { id, kinds, tasks }
    }

    /// Where DI `di`'s objects stand: this cache and how many changes a pass would act on it
    /// has seen of them; equal answers mean the objects are as they were, but for versions and
    /// heartbeats. `None` while any kind is not synced (then [`ClusterCache::objects`] is too).
    pub fn changes(&self, di: Uuid) -> Option<(u64, u64)> {
        let mut sum = 0;
        for k in &self.kinds {
            let state = k.state.lock().expect("watch cache");
            if !state.trusted() {
                return None;
            }
            sum += state.changes.get(&di).copied().unwrap_or(0);
        }
        Some((self.id, sum))
    }

    /// DI `di`'s objects in namespace `ns` (and its cluster-scoped ones, nodes), kind by kind in
    /// the order the cache was started with; `None` while any kind is not synced.
    pub fn objects(&self, di: Uuid, ns: &str) -> Option<Vec<Value>> {
        let mut out = Vec::new();
        for k in &self.kinds {
            let state = k.state.lock().expect("watch cache");
            if !state.trusted() {
                return None;
            }
            let Some(objects) = state.by_di.get(&di) else {
                continue;
            };
            out.extend(
                objects
                    .iter()
                    .filter(|((o_ns, _), _)| o_ns.is_empty() || o_ns == ns)
                    .filter_map(|(_, o)| serde_json::from_str(o).ok()),
            );
        }
        Some(out)
    }
}

/// Watches one kind until the cache is dropped. A failure (the server unreachable, refused
/// credentials) marks the kind untrusted for a while; the watcher resumes by itself.
async fn watch(kind: Arc<KindCache>, kube: KubeClient, wakes: Arc<Wakes>) {
    let w = &kind.watched;
    let stream = match kube.watch(w.api_version, w.kind, &w.selector) {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(kind = w.kind, error = %e, "cannot watch");
            return;
        }
    };
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => kind.handle(event, &wakes),
            Err(e) => {
                tracing::debug!(kind = w.kind, error = %e, "watch failed; resuming");
                kind.state.lock().expect("watch cache").failed_at = Some(Instant::now());
            }
        }
    }
}

impl KindCache {
    /// Applies one event.
    fn handle(&self, event: WatchEvent<Value>, wakes: &Wakes) {
        let mut state = self.state.lock().expect("watch cache");
        let state = &mut *state;
        match event {
            WatchEvent::Init => {
                state.listing = Some(ByDi::new());
                state.listed = false;
                return;
            }
            WatchEvent::InitApply(o) => {
                if let Some((key, Some(di), o)) = self.entry(o) {
                    if let Some(listing) = state.listing.as_mut() {
                        listing.entry(di).or_default().insert(key, o);
                    }
                }
                return;
            }
            WatchEvent::InitDone => {
                let listed = state.listing.take().unwrap_or_default();
                if state.listed_before {
                    for di in differing(&state.by_di, &listed) {
                        changed(&mut state.changes, di, wakes);
                    }
                }
                state.owners = listed
                    .iter()
                    .flat_map(|(di, objects)| objects.keys().map(|k| (k.clone(), *di)))
                    .collect();
                state.by_di = listed;
                state.listed = true;
                state.listed_before = true;
            }
            WatchEvent::Apply(o) => {
                if let Some((key, di, o)) = self.entry(o) {
                    if let Some(left) = state.owners.get(&key).copied().filter(|o| Some(*o) != di) {
                        remove(state, left, &key);
                        changed(&mut state.changes, left, wakes);
                    }
                    if let Some(di) = di {
                        state.owners.insert(key.clone(), di);
                        let objects = state.by_di.entry(di).or_default();
                        let old = objects.insert(key.clone(), o);
                        if old.is_none_or(|old| meaningful_change(&old, &objects[&key])) {
                            changed(&mut state.changes, di, wakes);
                        }
                    }
                }
            }
            WatchEvent::Delete(o) => {
                if let Some((key, _, _)) = self.entry(o) {
                    if let Some(di) = state.owners.get(&key).copied() {
                        remove(state, di, &key);
                        changed(&mut state.changes, di, wakes);
                    }
                }
            }
        }
        // It delivered: the watch works.
        state.failed_at = None;
    }

    /// An object's key, the DI it belongs to (none when its label or namespace names none), and
    /// the object as kept (without its `managedFields`, which no pass reads and which are a good
    /// part of its size).
    fn entry(&self, mut o: Value) -> Option<(Key, Option<Uuid>, Kept)> {
        let meta = o.get_mut("metadata")?.as_object_mut()?;
        meta.remove("managedFields");
        let ns = meta
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let name = meta.get("name")?.as_str()?.to_string();
        let di = match self.watched.owner {
            Owner::Label => meta
                .get("labels")
                .and_then(|l| l.get(names::DI_ID_LABEL))
                .and_then(Value::as_str)
                .and_then(|s| s.parse().ok()),
            Owner::Namespace => names::di_of_namespace(&ns),
        };
        Some(((ns, name), di, o.to_string().into()))
    }
}

/// Counts a change to DI `di`'s objects that a pass would act on, and wakes its pass.
fn changed(changes: &mut HashMap<Uuid, u64>, di: Uuid, wakes: &Wakes) {
    *changes.entry(di).or_default() += 1;
    wakes.wake(di);
}

/// Forgets the object `key` kept under DI `di`.
fn remove(state: &mut KindState, di: Uuid, key: &Key) {
    state.owners.remove(key);
    if let Some(objects) = state.by_di.get_mut(&di) {
        objects.remove(key);
        if objects.is_empty() {
            state.by_di.remove(&di);
        }
    }
}

/// DIs whose objects differ between two LISTs (added, removed, or changed in more than their
/// version and heartbeats: after an outage every node has a new heartbeat).
fn differing(before: &ByDi, after: &ByDi) -> Vec<Uuid> {
    let same = |a: &BTreeMap<Key, Kept>, b: &BTreeMap<Key, Kept>| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|((ka, va), (kb, vb))| ka == kb && !meaningful_change(va, vb))
    };
    let mut out: Vec<Uuid> = before
        .iter()
        .filter(|(di, objs)| after.get(di).is_none_or(|a| !same(objs, a)))
        .map(|(di, _)| *di)
        .collect();
    out.extend(after.keys().filter(|di| !before.contains_key(di)));
    out
}

/// Whether an update says something a pass would act on: more than a new `resourceVersion`
/// and the heartbeat times a kubelet refreshes in a node's or pod's conditions.
fn meaningful_change(old: &str, new: &str) -> bool {
    if old == new {
        return false;
    }
    fn stable(o: &str) -> Value {
        let mut o: Value = serde_json::from_str(o).unwrap_or_default();
        if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        if let Some(conditions) = o
            .pointer_mut("/status/conditions")
            .and_then(Value::as_array_mut)
        {
            for c in conditions.iter_mut().filter_map(Value::as_object_mut) {
                c.remove("lastHeartbeatTime");
                c.remove("lastProbeTime");
            }
        }
        o
    }
    stable(old) != stable(new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kind(owner: Owner) -> KindCache {
        KindCache {
            watched: Watched {
                api_version: "v1",
                kind: "Pod",
                selector: String::new(),
                owner,
            },
            state: Mutex::new(KindState::default()),
        }
    }

    fn pod(di: Uuid, name: &str, rv: &str, phase: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": names::namespace(&di), "resourceVersion": rv,
            "managedFields": [{"manager": "kubelet"}]},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True",
                "lastProbeTime": rv}]}})
    }

    #[test]
    fn a_cache_serves_each_di_its_own_objects_once_listed_and_wakes_on_changes() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let wakes = Wakes::default();
        let cache = ClusterCache {
            id: 7,
            kinds: vec![Arc::new(kind(Owner::Namespace))],
            tasks: Vec::new(),
        };
        let k = &cache.kinds[0];
        assert_eq!(
            cache.objects(a, &names::namespace(&a)),
            None,
            "not listed yet"
        );
        k.handle(WatchEvent::Init, &wakes);
        k.handle(WatchEvent::InitApply(pod(a, "p1", "1", "Running")), &wakes);
        k.handle(WatchEvent::InitApply(pod(b, "p2", "2", "Running")), &wakes);
        let other_ns = json!({"metadata": {"name": "dns", "namespace": "kube-system"}});
        k.handle(WatchEvent::InitApply(other_ns), &wakes);
        assert_eq!(cache.objects(a, &names::namespace(&a)), None, "listing");
        k.handle(WatchEvent::InitDone, &wakes);
        assert!(wakes.take().is_empty(), "the first LIST wakes nobody");
        assert_eq!(cache.changes(a), Some((7, 0)));
        let of_a = cache.objects(a, &names::namespace(&a)).unwrap();
        assert_eq!(of_a.len(), 1);
        assert_eq!(of_a[0]["metadata"]["name"], "p1");
        assert!(of_a[0]["metadata"].get("managedFields").is_none());

        // A heartbeat wakes nobody; a pod that stopped being ready wakes its DI only.
        // Each wake counts as a change of the DI's objects.
        k.handle(WatchEvent::Apply(pod(a, "p1", "3", "Running")), &wakes);
        assert!(wakes.take().is_empty());
        assert_eq!(cache.changes(a), Some((7, 0)));
        k.handle(WatchEvent::Apply(pod(a, "p1", "4", "Failed")), &wakes);
        assert_eq!(wakes.take(), vec![a]);
        assert_eq!(cache.changes(a), Some((7, 1)));
        k.handle(WatchEvent::Delete(pod(b, "p2", "5", "Running")), &wakes);
        assert_eq!(wakes.take(), vec![b]);
        assert_eq!(cache.objects(b, &names::namespace(&b)), Some(vec![]));

        // A LIST after 410 Gone: what changed meanwhile wakes its DIs, heartbeats do not.
        k.handle(WatchEvent::Init, &wakes);
        assert_eq!(
            cache.objects(a, &names::namespace(&a)),
            None,
            "listing again"
        );
        k.handle(WatchEvent::InitApply(pod(a, "p1", "9", "Failed")), &wakes);
        k.handle(WatchEvent::InitApply(pod(b, "p3", "6", "Running")), &wakes);
        k.handle(WatchEvent::InitDone, &wakes);
        assert_eq!(wakes.take(), vec![b]);
        assert_eq!(
            (cache.changes(a), cache.changes(b)),
            (Some((7, 1)), Some((7, 2)))
        );

        // A failed watch is not read until it delivers again (or a while has passed).
        k.state.lock().unwrap().failed_at = Some(Instant::now());
        assert_eq!(cache.objects(a, &names::namespace(&a)), None);
        assert_eq!(cache.changes(a), None);
        k.handle(WatchEvent::Apply(pod(a, "p1", "10", "Failed")), &wakes);
        assert!(cache.objects(a, &names::namespace(&a)).is_some());
    }

    #[test]
    fn an_object_relabelled_leaves_the_di_it_was_under() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let wakes = Wakes::default();
        let cache = ClusterCache {
            id: 7,
            kinds: vec![Arc::new(kind(Owner::Label))],
            tasks: Vec::new(),
        };
        let k = &cache.kinds[0];
        let node = |di: Option<Uuid>| {
            let labels = di.map_or(json!({}), |di| json!({names::DI_ID_LABEL: di.to_string()}));
            json!({"metadata": {"name": "gpu-1", "labels": labels}})
        };
        k.handle(WatchEvent::Init, &wakes);
        k.handle(WatchEvent::InitApply(node(Some(a))), &wakes);
        k.handle(WatchEvent::InitDone, &wakes);
        k.handle(WatchEvent::Apply(node(Some(b))), &wakes);
        let mut woken = wakes.take();
        woken.sort();
        let mut both = vec![a, b];
        both.sort();
        assert_eq!(woken, both);
        assert_eq!(cache.objects(a, "").unwrap().len(), 0);
        assert_eq!(cache.objects(b, "").unwrap().len(), 1);
        k.handle(WatchEvent::Apply(node(None)), &wakes);
        assert_eq!(wakes.take(), vec![b]);
        assert_eq!(cache.objects(b, "").unwrap().len(), 0);
    }

    #[test]
    fn objects_of_another_namespace_are_not_the_dis() {
        let di = Uuid::new_v4();
        let wakes = Wakes::default();
        let cache = ClusterCache {
            id: 7,
            kinds: vec![Arc::new(kind(Owner::Label))],
            tasks: Vec::new(),
        };
        let k = &cache.kinds[0];
        let labelled = |ns: &str, name: &str| {
            json!({"metadata": {"name": name, "namespace": ns,
                "labels": {names::DI_ID_LABEL: di.to_string()}}})
        };
        k.handle(WatchEvent::Init, &wakes);
        k.handle(
            WatchEvent::InitApply(labelled(&names::namespace(&di), "mine")),
            &wakes,
        );
        k.handle(
            WatchEvent::InitApply(labelled("elsewhere", "stray")),
            &wakes,
        );
        k.handle(WatchEvent::InitApply(labelled("", "node-1")), &wakes);
        k.handle(WatchEvent::InitDone, &wakes);
        let names: Vec<_> = cache
            .objects(di, &names::namespace(&di))
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["node-1", "mine"]);
    }
}
