//! Resyncs of converged DIs that nothing changed, skipped. Most of a resync's CPU went into
//! parsing the DI's objects from the watch cache, rendering its manifests and comparing them,
//! to find, as almost always, that nothing is to be done. A pass that converged cleanly (no
//! write, nothing held back or awaited) remembers what it judged from: a fingerprint of its
//! inputs (the DI's record, what the store gave the pass, this worker's rendering) and where
//! the DI's watched objects stood (see [`crate::watch_cache::ClusterCache::changes`]). A later
//! resync that finds both the same ends there: the full pass would have come to the same
//! conclusion. Any change to either, a watch that is not synced, a DI that autoscales (its
//! looks read metrics), a fleet rollout moving it, or an hour since the full pass (what time
//! alone changes: the endpoint certificate's renewal) makes the pass a full one again.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::converge::{Converging, Reached};
use super::Reconciler;

/// A full pass at least this often, whatever the fingerprints say.
const AT_MOST: Duration = Duration::from_secs(3600);

/// What a pass judged from: its inputs' fingerprint and where its DI's watched objects stood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Judged {
    inputs: u64,
    objects: (u64, u64),
}

/// The last clean convergence of each DI this worker passed over.
#[derive(Default)]
pub(super) struct Converged(Mutex<HashMap<Uuid, (Judged, Instant)>>);

impl Converged {
    /// Whether DI `id` converged cleanly on exactly `judged` less than [`AT_MOST`] ago.
    pub(super) fn on(&self, id: Uuid, judged: Judged) -> bool {
        let by_di = self.0.lock().expect("converged");
        by_di
            .get(&id)
            .is_some_and(|(j, at)| *j == judged && at.elapsed() < AT_MOST)
    }

    /// Records how DI `id`'s full pass ended: converged cleanly on `judged`, or not (`None`).
    pub(super) fn record(&self, id: Uuid, judged: Option<Judged>) {
        let mut by_di = self.0.lock().expect("converged");
        match judged {
            Some(j) => by_di.insert(id, (j, Instant::now())),
            None => by_di.remove(&id),
        };
        // DIs that moved to another worker (or went) are never recorded again: what is older
        // than AT_MOST is of no use, and goes now and then.
        if by_di.len().is_multiple_of(1024) {
            by_di.retain(|_, (_, at)| at.elapsed() < AT_MOST);
        }
    }
}

impl Reconciler {
    /// What this pass judges from, if it may be skipped on it: a resync reading the watch
    /// cache of a DI that neither autoscales nor takes part in a fleet rollout.
    pub(super) fn judged(&self, c: &Converging<'_>, at: &Reached, cached: bool) -> Option<Judged> {
        if !(cached && c.resync && c.pending.is_none() && !c.autoscaled) || self.fleet_moving(c) {
            return None;
        }
        let objects = self.cache_changes(at, c.rec.id)?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        serde_json::to_vec(c.rec).ok()?.hash(&mut h);
        let i = &c.inputs;
        format!("{:?}", (&i.ledger, &i.accelerators, &i.replicas)).hash(&mut h);
        for ca in &i.cas {
            (&ca.cert_pem, &ca.key_pem, ca.not_after).hash(&mut h);
        }
        (&i.token_hashes, &i.hugging_face_token).hash(&mut h);
        (&i.probe_token, &i.retired_probe_token).hash(&mut h);
        let slot = i.fleet_slot.as_ref();
        slot.map(|s| format!("{:?}", (&s.rendering, s.canary, s.state, &s.previous)))
            .hash(&mut h);
        self.rendering.hash(&mut h);
        Some(Judged {
            inputs: h.finish(),
            objects,
        })
    }
}
