//! The simulated world behind the API: one loop that, after every change (and
//! on timers), runs the controllers a real cluster would have. Each controller
//! reads a snapshot, decides, and writes through [`ops::mutate`]/[`ops::create`]
//! only when the result differs, so the loop settles instead of spinning.

mod deployment;
mod gc;
mod network;
mod scheduler;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use serde_json::{json, Value};

use crate::resources::index_of;
use crate::store::Key;
use crate::Shared;

pub use scheduler::complete_node;

/// Objects as of the start of a pass, parsed (most are already: the objects of a cluster whose
/// controllers are busy are in use).
///
/// Ordered by type, then namespace, then name, so the objects of a kind, or of a kind in one
/// namespace, are a range: a controller looking at one object's kin reads those, not every
/// object of a cluster that may hold many DIs.
pub(crate) struct Snapshot {
    objects: BTreeMap<Key, Arc<Value>>,
}

impl Snapshot {
    pub fn of_kind(&self, kind: &str) -> impl Iterator<Item = (&Key, &Value)> + '_ {
        let rt = index_of(kind);
        self.objects
            .range(Key::new(rt, "", "")..)
            .take_while(move |(k, _)| k.rt == rt)
            .map(|(k, v)| (k, v.as_ref()))
    }
    /// The objects of type `rt` in namespace `ns`, in name order.
    pub fn of_type_in(&self, rt: usize, ns: &str) -> impl Iterator<Item = (&Key, &Value)> + '_ {
        let from = Key::new(rt, ns, "");
        let ns = from.ns.clone();
        self.objects
            .range(from..)
            .take_while(move |(k, _)| k.rt == rt && k.ns == ns)
            .map(|(k, v)| (k, v.as_ref()))
    }
    /// The objects of `kind` in namespace `ns`, in name order.
    pub fn in_namespace(&self, kind: &str, ns: &str) -> impl Iterator<Item = (&Key, &Value)> + '_ {
        self.of_type_in(index_of(kind), ns)
    }
    pub fn get(&self, kind: &str, ns: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(&Key::new(index_of(kind), ns, name))
            .map(Arc::as_ref)
    }
    pub fn all(&self) -> impl Iterator<Item = (&Key, &Value)> + '_ {
        self.objects.iter().map(|(k, v)| (k, v.as_ref()))
    }
}

/// Timers the controllers keep between passes, keyed by object uid.
#[derive(Default)]
pub(crate) struct Timers {
    /// When a pod's containers last started: when it was bound to a node, or when crashed
    /// containers restarted. Its load is settled `model_load_delay` later.
    pub pod_bound: HashMap<String, Instant>,
    /// When a pod's crashed containers restart (the end of their back-off).
    pub restart_at: HashMap<String, Instant>,
    /// When a LoadBalancer Service or Gateway was first seen without an address.
    pub first_seen: HashMap<String, Instant>,
    /// Earliest moment a timer expires; the loop sleeps until then.
    pub next_wake: Option<Instant>,
}

impl Timers {
    /// Whether `delay` has passed since `start`; if not, schedules a wake-up.
    pub fn elapsed(&mut self, start: Instant, delay: Duration) -> bool {
        let due = start + delay;
        if Instant::now() >= due {
            return true;
        }
        self.wake_at(due);
        false
    }

    /// Makes the loop run a pass at `due` at the latest.
    pub fn wake_at(&mut self, due: Instant) {
        self.next_wake = Some(self.next_wake.map_or(due, |w| w.min(due)));
    }
}

pub(crate) async fn run(shared: Arc<Shared>) {
    let mut timers = Timers::default();
    let mut stop = shared.shutdown_rx();
    // The resourceVersion the last pass left the store at, and whether this wake-up is the
    // once-a-second one rather than a change (or a config change, which notifies too).
    let mut settled_at: Option<u64> = None;
    let mut idle_wake = false;
    loop {
        // A pass is a function of the objects, the timers, the clock and the config: with no
        // change since the last one and no timer due, it would decide exactly what the last
        // one did and write nothing. Skipping it keeps thousands of settled clusters (the
        // region simulator's) from costing a pass over every object each second.
        shared.store.prune_history();
        let rv = shared.store.lock().rv;
        let timer_due = timers.next_wake.is_some_and(|w| w <= Instant::now());
        if !(idle_wake && settled_at == Some(rv) && !timer_due) {
            timers.next_wake = None;
            pass(&shared, &mut timers);
            settled_at = Some(shared.store.lock().rv);
        }
        let wait = timers
            .next_wake
            .map(|w| w.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1));
        idle_wake = false;
        tokio::select! {
            _ = shared.store.notify.notified() => {
                // Let a burst of writes land before the next pass.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            _ = tokio::time::sleep(wait) => idle_wake = true,
            _ = stop.changed() => return,
        }
    }
}

fn snapshot(shared: &Shared) -> Snapshot {
    let objects = shared.store.lock().objects.clone();
    Snapshot {
        objects: objects
            .iter()
            .map(|(k, v)| (k.clone(), v.value()))
            .collect(),
    }
}

fn pass(shared: &Shared, timers: &mut Timers) {
    shared
        .passes
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let config = shared.config();
    let store = &shared.store;
    // Each controller sees the writes of the ones before it.
    gc::run(store, &snapshot(shared));
    scheduler::run(store, &snapshot(shared), timers, &config);
    deployment::run(store, &snapshot(shared));
    network::run(store, &snapshot(shared), timers, &config);
    if timers.pod_bound.is_empty() && timers.first_seen.is_empty() && timers.restart_at.is_empty() {
        return;
    }
    let live: std::collections::HashSet<String> = shared
        .store
        .lock()
        .objects
        .values()
        .filter_map(|o| {
            o.value()
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .collect();
    timers.pod_bound.retain(|uid, _| live.contains(uid));
    timers.restart_at.retain(|uid, _| live.contains(uid));
    timers.first_seen.retain(|uid, _| live.contains(uid));
}

pub(crate) fn uid(obj: &Value) -> String {
    obj.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

pub(crate) fn is_deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some()
}

/// Sets one condition in a `conditions` array, keeping `lastTransitionTime`
/// when the status does not change (so re-running a controller writes nothing).
pub(crate) fn set_condition(
    conditions: &mut Value,
    ty: &str,
    status: &str,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    with_update_time: bool,
) {
    if !conditions.is_array() {
        *conditions = json!([]);
    }
    let list = conditions.as_array_mut().expect("array");
    let now = crate::store::now_rfc3339();
    let existing = list.iter().position(|c| c["type"] == ty);
    let mut c = existing
        .map(|i| list[i].clone())
        .unwrap_or_else(|| json!({"type": ty}));
    let transition = c["status"] != status;
    let changed = transition || c["reason"] != reason || c["message"] != message;
    c["status"] = json!(status);
    c["reason"] = json!(reason);
    c["message"] = json!(message);
    if transition || c.get("lastTransitionTime").is_none() {
        c["lastTransitionTime"] = json!(now);
    }
    if with_update_time && (changed || c.get("lastUpdateTime").is_none()) {
        c["lastUpdateTime"] = json!(now);
    }
    if let Some(g) = observed_generation {
        c["observedGeneration"] = json!(g);
    }
    match existing {
        Some(i) => list[i] = c,
        None => list.push(c),
    }
}

pub(crate) fn condition_true(obj: &Value, ty: &str) -> bool {
    obj.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| cs.iter().any(|c| c["type"] == ty && c["status"] == "True"))
}
