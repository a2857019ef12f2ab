//! Watch streams: newline-delimited `{type, object}` events, resumable from a
//! resourceVersion while it is in the store's history, 410 Gone (as an ERROR
//! event, which is what `kube::runtime::watcher` re-lists on) once it is not.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use crate::error::ApiError;
use crate::resources::TYPES;
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{meta_str, Change, EventType, Store, Stored};

/// How often an idle watch gets a BOOKMARK (keeps resume points fresh): about once a minute,
/// as kube-apiserver's watch cache sends them. Clients may not count on more: a worker watching
/// 16 kinds in each of 2,000 clusters would otherwise read thousands of bookmarks a second.
const BOOKMARK_EVERY: Duration = Duration::from_secs(60);

pub struct WatchRequest {
    pub rt: usize,
    pub ns: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub resource_version: Option<String>,
    pub send_initial_events: bool,
    pub bookmarks: bool,
    pub timeout: Duration,
}

impl WatchRequest {
    fn matches(&self, obj: &Value) -> bool {
        self.ns
            .as_deref()
            .is_none_or(|ns| meta_str(obj, "namespace") == ns)
            && self.labels.matches(obj)
            && self.fields.matches(obj)
    }

    /// The event line a subscriber sees for a change, after selector filtering.
    fn translate(&self, c: &Change) -> Option<Bytes> {
        if c.rt != self.rt {
            return None;
        }
        let now = self.matches(&c.object.value());
        let kind = match c.kind {
            EventType::Added | EventType::Deleted => now.then(|| c.kind.as_str()),
            EventType::Modified => {
                let before = c.old.as_ref().is_some_and(|o| self.matches(&o.value()));
                match (before, now) {
                    (true, true) => Some("MODIFIED"),
                    (false, true) => Some("ADDED"),
                    (true, false) => Some("DELETED"),
                    (false, false) => None,
                }
            }
        }?;
        Some(stored_line(kind, &c.object))
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let t = &TYPES[self.rt];
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        line(
            "BOOKMARK",
            &json!({"kind": t.kind, "apiVersion": t.api_version(), "metadata": meta}),
        )
    }
}

/// An event line for a stored object, from its JSON as stored.
fn stored_line(kind: &str, obj: &Stored) -> Bytes {
    event_line(kind, obj.text())
}

/// `{"type":…,"object":…}` and a newline; the type first, as the API server writes it.
fn event_line(kind: &str, object: &str) -> Bytes {
    Bytes::from(format!("{{\"type\":\"{kind}\",\"object\":{object}}}\n"))
}

fn line(kind: &str, obj: &Value) -> Bytes {
    event_line(kind, &serde_json::to_string(obj).expect("json"))
}

fn gone(msg: &str) -> Bytes {
    line("ERROR", &ApiError::gone(msg).to_status())
}

pub fn serve(
    store: Arc<Store>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    req: WatchRequest,
) -> Result<Response, ApiError> {
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let mut first: Vec<Bytes> = Vec::new();
    let mut changes;
    let mut last_rv;
    {
        let inner = store.lock();
        changes = store.subscribe_changes();
        last_rv = inner.rv;
        let rv = req.resource_version.as_deref().unwrap_or("");
        if rv.is_empty() || rv == "0" || req.send_initial_events {
            for obj in inner.list(req.rt, req.ns.as_deref()) {
                if req.matches(&obj) {
                    first.push(line("ADDED", &obj));
                }
            }
            if req.send_initial_events {
                first.push(req.bookmark(inner.rv, true));
            }
        } else {
            let from: u64 = rv
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?;
            match inner.changes_since(from) {
                Some(past) => {
                    first.extend(past.iter().filter_map(|c| req.translate(c)));
                }
                None => first.push(gone(&format!(
                    "too old resource version: {from} ({})",
                    inner.rv
                ))),
            }
        }
    }
    let expired = first
        .last()
        .is_some_and(|b| b.starts_with(b"{\"type\":\"ERROR\""));
    tokio::spawn(async move {
        for b in first {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        if expired {
            return;
        }
        let deadline = tokio::time::sleep(req.timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval(BOOKMARK_EVERY);
        ticker.tick().await;
        loop {
            let out = tokio::select! {
                _ = &mut deadline => return,
                _ = shutdown.changed() => return,
                _ = tx.closed() => return,
                _ = ticker.tick() => {
                    if !req.bookmarks { continue; }
                    req.bookmark(last_rv, false)
                }
                c = changes.recv() => match c {
                    Ok(c) => {
                        last_rv = last_rv.max(c.rv);
                        match req.translate(&c) {
                            Some(line) => line,
                            None => continue,
                        }
                    }
                    // This watcher fell too far behind: the client must re-list.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(gone("watch fell behind; re-list required")).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            };
            if tx.send(out).await.is_err() {
                return;
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    Ok(Response::builder()
        .header("content-type", "application/json")
        .header("cache-control", "no-cache, private")
        .body(Body::from_stream(stream))
        .expect("response"))
}
