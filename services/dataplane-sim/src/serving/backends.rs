//! Replicas and pickers shared by every endpoint in front of the same pods: the registries
//! keyed by pod UID and pool, a backend's serving facts ([`BackendServing`]), [`attach`] that
//! gives an endpoint's backends their replica and picker, [`start`] that sends a request to the
//! one its picker chooses ([`Session`]), and a pod's `/metrics` ([`pod_metrics_text`]). The
//! seam between the data plane and the engine.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc;

use super::engine::{Replica, Step};
use super::shape::ReplicaSpec;
use super::tokens::tokenize;
use super::ServingConfig;
use crate::data_plane::{Backend, EndpointConfig, Generation, Route};
use crate::objects;
use crate::picker::{Candidate, PoolPicker, PoolSpec};

type Registry<T> = Mutex<HashMap<String, Weak<T>>>;

fn registry<T: Default>(map: &Registry<T>, key: &str) -> Arc<T> {
    let mut m = map.lock().expect("registry lock");
    if let Some(a) = m.get(key).and_then(Weak::upgrade) {
        return a;
    }
    m.retain(|_, w| w.strong_count() > 0);
    let a = Arc::new(T::default());
    m.insert(key.to_string(), Arc::downgrade(&a));
    a
}

impl Default for Replica {
    fn default() -> Self {
        Replica::new(ReplicaSpec::default(), None)
    }
}

fn replicas() -> &'static Registry<Replica> {
    static R: OnceLock<Registry<Replica>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn pickers() -> &'static Registry<PoolPicker> {
    static P: OnceLock<Registry<PoolPicker>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// The replica of the pod with this UID, while an endpoint routes to it.
pub fn replica_by_uid(uid: &str) -> Option<Arc<Replica>> {
    replicas()
        .lock()
        .expect("registry lock")
        .get(uid)
        .and_then(Weak::upgrade)
}

/// A backend's serving facts (from the cluster's objects) and, once an endpoint serves it, its
/// replica and its pool's picker.
#[derive(Debug, Clone, Default)]
pub struct BackendServing {
    pub replica: ReplicaSpec,
    pub pool: Option<Arc<PoolSpec>>,
    attached: Option<Attached>,
}

#[derive(Clone)]
struct Attached {
    replica: Arc<Replica>,
    picker: Option<Arc<PoolPicker>>,
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attached")
    }
}

/// The facts only: which replica object serves them is not part of a configuration's identity.
impl PartialEq for BackendServing {
    fn eq(&self, other: &Self) -> bool {
        self.replica == other.replica && self.pool == other.pool
    }
}

impl Eq for BackendServing {}

impl BackendServing {
    pub fn new(replica: ReplicaSpec, pool: Option<Arc<PoolSpec>>) -> BackendServing {
        BackendServing {
            replica,
            pool,
            attached: None,
        }
    }

    /// The replica serving this backend, once an endpoint was configured with it.
    pub fn replica(&self) -> Option<&Arc<Replica>> {
        self.attached.as_ref().map(|a| &a.replica)
    }
}

/// Gives every backend of an endpoint's configuration its replica and its pool's picker
/// (shared with the other endpoints routing to the same pods; `scope` tells apart the pods of
/// configurations without UIDs, built by hand in tests).
pub(crate) fn attach(cfg: &mut EndpointConfig, scope: usize) {
    let Route::Pool { endpoints, .. } = &mut cfg.route else {
        return;
    };
    // Per pool key: its picker, the configuration it gets and its pods.
    type Pool = (
        Arc<PoolPicker>,
        Option<crate::picker::PickerConfig>,
        Vec<String>,
    );
    let mut pools: HashMap<String, Pool> = HashMap::new();
    for b in endpoints.iter_mut() {
        let key = b
            .serving
            .replica
            .uid
            .clone()
            .unwrap_or_else(|| format!("{scope:x}/{}", b.pod));
        let replica = registry(replicas(), &key);
        replica.describe(&b.serving.replica, b.model.as_deref());
        let picker = b.serving.pool.as_ref().map(|p| {
            let key = if p.key.is_empty() {
                format!("{scope:x}/pool")
            } else {
                p.key.clone()
            };
            let entry = pools
                .entry(key.clone())
                .or_insert_with(|| (registry(pickers(), &key), p.picker.clone(), Vec::new()));
            entry.2.push(b.pod.clone());
            entry.0.clone()
        });
        b.serving.attached = Some(Attached { replica, picker });
    }
    for (picker, config, pods) in pools.values() {
        let pods: Vec<&str> = pods.iter().map(String::as_str).collect();
        picker.configure(&config.clone().unwrap_or_default(), &pods);
    }
}

/// A request on its way through a replica.
pub struct Session {
    pod: String,
    rx: mpsc::UnboundedReceiver<Step>,
}

impl Session {
    /// The pod serving it.
    pub fn pod(&self) -> &str {
        &self.pod
    }

    /// Waits for the whole generation.
    pub async fn finish(mut self) {
        while let Some(s) = self.rx.recv().await {
            if s == Step::Done {
                return;
            }
        }
    }

    /// Server-sent events paced by the engine: the first `preamble` events at once, one event
    /// per generated token, the rest (finish, usage) after the last token, then `[DONE]`.
    pub fn sse(self, events: Vec<Value>, preamble: usize) -> Response {
        let stream = futures::stream::unfold(
            (events.into_iter(), 0usize, self.rx, false),
            move |(mut it, i, mut rx, done)| async move {
                if done {
                    return None;
                }
                if i >= preamble {
                    // Token events wait for their token; after the last, the rest flows.
                    let mut flowing = false;
                    while !flowing {
                        match rx.recv().await {
                            Some(Step::Token) => break,
                            Some(Step::Done) | None => flowing = true,
                        }
                    }
                    if flowing {
                        rx.close();
                    }
                }
                match it.next() {
                    Some(ev) => Some((
                        Ok::<_, Infallible>(Event::default().data(ev.to_string())),
                        (it, i + 1, rx, false),
                    )),
                    None => Some((Ok(Event::default().data("[DONE]")), (it, i + 1, rx, true))),
                }
            },
        );
        Sse::new(stream).into_response()
    }
}

/// Sends a request to a replica when the serving model is on and the backends have replicas:
/// the pool's picker (else round robin on `turn`) chooses among the backends serving `model`.
/// `None`: serve as without the serving model. `Err`: the request cannot be served (400).
pub fn start(
    cfg: &ServingConfig,
    backends: &[Backend],
    model: &str,
    turn: usize,
    prompt: Vec<u64>,
    generation: &Generation,
) -> Option<Result<Session, String>> {
    if !cfg.enabled() {
        return None;
    }
    let serving: Vec<(&Backend, &Attached)> = backends
        .iter()
        .filter(|b| b.model.as_deref().is_none_or(|m| m == model))
        .filter_map(|b| b.serving.attached.as_ref().map(|a| (b, a)))
        .collect();
    if serving.is_empty() {
        return None;
    }
    let picker = serving[0].1.picker.clone();
    let chosen = match &picker {
        Some(p)
            if serving
                .iter()
                .all(|(_, a)| a.picker.as_ref().is_some_and(|q| Arc::ptr_eq(p, q))) =>
        {
            let cands: Vec<Candidate> = serving
                .iter()
                .map(|(b, a)| Candidate {
                    pod: &b.pod,
                    replica: &a.replica,
                })
                .collect();
            p.pick(&cands, &prompt, turn)
        }
        _ => turn % serving.len(),
    };
    let (b, a) = serving[chosen];
    let output = tokenize(&generation.tokens.concat());
    Some(a.replica.submit(cfg, prompt, output).map(|rx| Session {
        pod: b.pod.clone(),
        rx,
    }))
}

/// The pod's vLLM `/metrics` text, as a scrape of its serving port would read it: its
/// replica's, or, while no endpoint routes to it (or the serving model is off and it has none),
/// a freshly started vLLM's (zero counters, for the model it serves). `objs` are the cluster's
/// objects (the pod's Deployment and node describe the replica).
pub fn pod_metrics_text(objs: &objects::Objects, pod: &Value) -> String {
    let spec = ReplicaSpec::of_pod(objs, pod);
    match spec.uid.as_deref().and_then(replica_by_uid) {
        Some(r) => r.metrics_text(),
        None => {
            let served = objects::pod_model(objs, pod);
            Replica::new(spec, served.as_deref()).metrics_text()
        }
    }
}

/// The Prometheus text exposition content type.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
