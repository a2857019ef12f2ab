//! A client for one Kubernetes API server, working on manifests as JSON values (`apiVersion`,
//! `kind`, `metadata`, ...), as the worker's planner renders them.
//!
//! Writes are server-side apply under one field manager with `force`, so a second pass over an
//! unchanged manifest writes nothing. Kinds resolve through a static table ([`known_resource`]),
//! so no discovery round trip is needed. Transient failures (429, 409, 5xx, connection errors)
//! are retried per [`RetryConfig`]; kube's own retry layer is turned off so that this is the only
//! retry policy and its time bound holds. Every request sent is counted by verb and outcome
//! ([`crate::metrics`]).
//!
//! This module holds the client and its calls (apply, annotate, get, list, watch, delete, the
//! pod proxy). Making a client and its connection stack are in `connection`, errors and their
//! classes in `error`, the kinds table in `kinds`, and what tells whether an apply has anything
//! to write, or changed anything, in `applied`.

mod applied;
mod connection;
mod error;
mod kinds;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use either::Either;
use futures::StreamExt;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use serde_json::Value;

use common::errors::{Classify, ErrorClass};

use crate::metrics::{self, Outcome};
use crate::retry::{retry, RetryConfig};

use applied::{changed, up_to_date, with_applied_hash};
pub use connection::KubeClientOptions;
pub use error::KubeError;
pub use kinds::{known_resource, KnownResource};

pub use kube::runtime::watcher::Event as WatchEvent;

/// How long the server keeps a watch open before the watcher starts the next one from where
/// it left off (kube-runtime's default is 290 s).
const WATCH_TIMEOUT_SECS: u32 = 240;

/// The outcome of [`KubeClient::apply`].
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The object was created, or the apply changed it (its `resourceVersion` moved and more
    /// than its status did). False for a second apply of the same manifest.
    pub changed: bool,
    /// The object as the server returned it.
    pub object: Value,
}

/// What the caller of [`KubeClient::apply_observed`] saw of the object before applying it.
#[derive(Debug, Clone, Copy)]
pub enum Before<'a> {
    /// Nothing: it is read first.
    Unknown,
    /// A list that would have shown it did not (its kind, its labels, its namespace).
    Absent,
    /// This copy, just listed.
    Listed(&'a Value),
}

/// The outcome of [`KubeClient::delete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// Nothing to delete: it was already gone (404), which is success.
    AlreadyGone,
    /// Deletion started but the object still exists (finalizers, a Terminating Namespace still
    /// emptying, foreground dependents). Delete again or get it later to see it go.
    Deleting,
    /// The object is gone.
    Deleted,
}

#[derive(Debug, Default)]
struct Counters {
    mutating: AtomicU64,
    changes: AtomicU64,
    /// The server answered 401 to a request of this client (see [`KubeClient::credentials_rejected`]).
    rejected: AtomicBool,
}

/// A client for one cluster's API server, writing under one field manager. Cheap to clone;
/// clones share the connection pool and the counters.
#[derive(Clone)]
pub struct KubeClient {
    client: Client,
    field_manager: String,
    retry: RetryConfig,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClient")
            .field("field_manager", &self.field_manager)
            .finish_non_exhaustive()
    }
}

impl KubeClient {
    /// Wraps an existing kube client (its own retry layer should be off).
    pub fn from_client(client: Client, field_manager: &str, retry: RetryConfig) -> KubeClient {
        KubeClient {
            client,
            field_manager: field_manager.to_string(),
            retry,
            counters: Arc::new(Counters::default()),
        }
    }

    /// The same client with another retry policy (counters stay shared).
    pub fn with_retry(mut self, retry: RetryConfig) -> KubeClient {
        self.retry = retry;
        self
    }

    /// The underlying kube client, for typed APIs or watches.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// Write requests (apply PATCHes, DELETEs) sent, every attempt counted, no-op applies
    /// included.
    pub fn mutating_requests(&self) -> u64 {
        self.counters.mutating.load(Ordering::SeqCst)
    }

    /// Writes that changed something: applies with `changed == true` and deletes that found the
    /// object. A second reconcile pass over an unchanged spec leaves this unchanged.
    pub fn changes(&self) -> u64 {
        self.counters.changes.load(Ordering::SeqCst)
    }

    /// Whether the server has refused this client's credentials (401) since it was made: they
    /// expired or were revoked, and every later call will be refused too. A caller that caches
    /// clients makes a new one from fresh credentials.
    pub fn credentials_rejected(&self) -> bool {
        self.counters.rejected.load(Ordering::SeqCst)
    }

    /// Notes a 401 in `result` (see [`KubeClient::credentials_rejected`]).
    fn noted<T>(&self, result: Result<T, KubeError>) -> Result<T, KubeError> {
        if let Err(e) = &result {
            if e.class() == ErrorClass::Unauthorized {
                self.counters.rejected.store(true, Ordering::SeqCst);
            }
        }
        result
    }

    fn api(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        all_namespaces: bool,
    ) -> Result<(Api<DynamicObject>, ApiResource), KubeError> {
        let known = known_resource(api_version, kind).ok_or_else(|| KubeError::UnknownKind {
            api_version: api_version.to_string(),
            kind: kind.to_string(),
        })?;
        let ar = known.api_resource;
        let api = if !known.namespaced {
            Api::all_with(self.client.clone(), &ar)
        } else {
            match namespace.filter(|n| !n.is_empty()) {
                Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
                None if all_namespaces => Api::all_with(self.client.clone(), &ar),
                None => {
                    return Err(KubeError::InvalidObject(format!(
                        "{kind} is namespaced: a namespace is required"
                    )))
                }
            }
        };
        Ok((api, ar))
    }

    /// Server-side apply of `obj` under this client's field manager, with `force` (we own what
    /// we render). Fields this manager applied before and `obj` omits are removed.
    pub async fn apply(&self, obj: &Value) -> Result<Applied, KubeError> {
        self.apply_observed(obj, Before::Unknown).await
    }

    /// As [`KubeClient::apply`], given what the caller just saw of the object (`before`). When
    /// the listed copy is already up to date, nothing is sent at all (a steady-state pass then
    /// costs only its lists); when the list showed it absent, it is applied without reading it
    /// first; otherwise it is read afresh, so that an apply that changes nothing is known as
    /// such.
    pub async fn apply_observed(
        &self,
        obj: &Value,
        before: Before<'_>,
    ) -> Result<Applied, KubeError> {
        let field = |p: &str| {
            obj.pointer(p)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        let api_version =
            field("/apiVersion").ok_or_else(|| KubeError::InvalidObject("no apiVersion".into()))?;
        let kind = field("/kind").ok_or_else(|| KubeError::InvalidObject("no kind".into()))?;
        let name = field("/metadata/name")
            .ok_or_else(|| KubeError::InvalidObject(format!("{kind} without metadata.name")))?;
        let (api, _) = self.api(api_version, kind, field("/metadata/namespace"), false)?;
        let obj = &with_applied_hash(obj);
        let before = match before {
            Before::Listed(b) if up_to_date(b, obj) => {
                tracing::debug!(kind, name, "up to date (as listed)");
                return Ok(Applied {
                    changed: false,
                    object: b.clone(),
                });
            }
            // Not listed: created, or taken over from whoever made it without our labels;
            // either way the apply changes it.
            Before::Absent => None,
            Before::Listed(_) | Before::Unknown => self
                .noted(retry(&self.retry, "kubernetes get", || get_opt(&api, name)).await)?
                .map(|b| serde_json::to_value(&b))
                .transpose()
                .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?,
        };
        // Nothing to write when the object is what we applied last time and nobody has changed
        // any of it since: a steady-state resync then costs reads only.
        if let Some(b) = before.as_ref().filter(|b| up_to_date(b, obj)) {
            tracing::debug!(kind, name, "up to date");
            return Ok(Applied {
                changed: false,
                object: b.clone(),
            });
        }
        let params = PatchParams::apply(&self.field_manager).force();
        let after = retry(&self.retry, "kubernetes apply", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            counted("apply", api.patch(name, &params, &Patch::Apply(obj)).await)
        })
        .await;
        let after = self.noted(after)?;
        let after = serde_json::to_value(&after)
            .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?;
        let changed = match before {
            None => true,
            Some(b) => changed(&b, &after, &self.field_manager),
        };
        if changed {
            self.counters.changes.fetch_add(1, Ordering::SeqCst);
        }
        tracing::debug!(kind, name, changed, "applied");
        Ok(Applied {
            changed,
            object: after,
        })
    }

    /// Sets annotation `key` to `value` on one object with a JSON merge patch, leaving every
    /// other field (and its owner) alone: for marks on objects another controller owns, such as
    /// a pod's `controller.kubernetes.io/pod-deletion-cost`.
    pub async fn annotate(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<(), KubeError> {
        let (api, _) = self.api(api_version, kind, namespace, false)?;
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        let params = PatchParams::default();
        let done = retry(&self.retry, "kubernetes annotate", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            counted(
                "patch",
                api.patch(name, &params, &Patch::Merge(&patch)).await,
            )
        })
        .await;
        self.noted(done).map(|_| ())
    }

    /// The object, or `None` if it does not exist. `namespace` is ignored for cluster-scoped
    /// kinds and required for namespaced ones.
    pub async fn get(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Value>, KubeError> {
        let (api, ar) = self.api(api_version, kind, namespace, false)?;
        let got = self.noted(retry(&self.retry, "kubernetes get", || get_opt(&api, name)).await)?;
        got.map(|o| to_value(o, &ar)).transpose()
    }

    /// `GET path` on port `port` of pod `pod`, through the API server's pod proxy (how a
    /// control plane outside the cluster reads a pod's `/metrics`). Not retried: a reading is
    /// only worth its moment, and the caller looks again at its next pass.
    pub async fn pod_proxy_get(
        &self,
        namespace: &str,
        pod: &str,
        port: u16,
        path: &str,
    ) -> Result<String, KubeError> {
        let uri = format!(
            "/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/{}",
            path.trim_start_matches('/')
        );
        let req = http::Request::get(uri)
            .body(Vec::new())
            .map_err(|e| KubeError::InvalidObject(format!("pod proxy request: {e}")))?;
        self.noted(counted("proxy", self.client.request_text(req).await))
    }

    /// Objects matching `label_selector` (may be empty), in `namespace`, or in every namespace
    /// when `None`. Items carry `apiVersion` and `kind`.
    pub async fn list(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<Value>, KubeError> {
        let (api, ar) = self.api(api_version, kind, namespace, true)?;
        let mut params = ListParams::default();
        if !label_selector.is_empty() {
            params = params.labels(label_selector);
        }
        let list = retry(&self.retry, "kubernetes list", || async {
            counted("list", api.list(&params).await)
        })
        .await;
        let list = self.noted(list)?;
        list.items.into_iter().map(|o| to_value(o, &ar)).collect()
    }

    /// Every object of a kind in every namespace that matches `label_selector`, then every
    /// change to them: kube-runtime's watcher (a LIST, then a WATCH from its resourceVersion,
    /// re-listed when the server answers 410 Gone), objects as JSON with `apiVersion` and
    /// `kind`. Errors are yielded and the stream goes on, resuming after a backoff; a 401 marks
    /// the credentials rejected as any request's does.
    pub fn watch(
        &self,
        api_version: &str,
        kind: &str,
        label_selector: &str,
    ) -> Result<
        impl futures::Stream<Item = Result<WatchEvent<Value>, KubeError>> + Send + 'static,
        KubeError,
    > {
        let (_, ar) = self.api(api_version, kind, None, true)?;
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
        let mut config = watcher::Config::default().timeout(WATCH_TIMEOUT_SECS);
        if !label_selector.is_empty() {
            config = config.labels(label_selector);
        }
        let me = self.clone();
        // On a failure the watcher resumes from the last resourceVersion it saw (and lists
        // anew only when the server answers 410 Gone), after kube-runtime's backoff.
        Ok(watcher::watcher(api, config)
            .default_backoff()
            .map(move |event| {
                let event = match event {
                    Ok(e) => e,
                    Err(e) => {
                        let e = match e {
                            watcher::Error::InitialListFailed(e)
                            | watcher::Error::WatchStartFailed(e)
                            | watcher::Error::WatchFailed(e) => KubeError::from(e),
                            watcher::Error::WatchError(status) => {
                                KubeError::from(kube::Error::Api(status))
                            }
                            e @ watcher::Error::NoResourceVersion => {
                                KubeError::InvalidObject(e.to_string())
                            }
                        };
                        metrics::kubernetes("watch", Outcome::of(e.class()));
                        return me.noted(Err(e));
                    }
                };
                let value = |o| to_value(o, &ar);
                Ok(match event {
                    WatchEvent::Apply(o) => WatchEvent::Apply(value(o)?),
                    WatchEvent::Delete(o) => WatchEvent::Delete(value(o)?),
                    WatchEvent::Init => {
                        metrics::kubernetes("watch", Outcome::Ok);
                        WatchEvent::Init
                    }
                    WatchEvent::InitApply(o) => WatchEvent::InitApply(value(o)?),
                    WatchEvent::InitDone => WatchEvent::InitDone,
                })
            }))
    }

    /// Deletes with Background propagation. A missing object (or a missing namespace) is
    /// [`Deleted::AlreadyGone`], never an error, so a teardown is not blocked by a child that is
    /// already gone. A Namespace answers [`Deleted::Deleting`] while it is Terminating.
    pub async fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Deleted, KubeError> {
        let (api, _) = self.api(api_version, kind, namespace, false)?;
        let params = DeleteParams::background();
        let outcome = retry(&self.retry, "kubernetes delete", || async {
            self.counters.mutating.fetch_add(1, Ordering::SeqCst);
            match counted("delete", api.delete(name, &params).await) {
                Ok(Either::Left(_still_there)) => Ok(Deleted::Deleting),
                Ok(Either::Right(_status)) => Ok(Deleted::Deleted),
                Err(e) if e.is_not_found() => Ok(Deleted::AlreadyGone),
                Err(e) => Err(e),
            }
        })
        .await;
        let outcome = self.noted(outcome)?;
        if outcome != Deleted::AlreadyGone {
            self.counters.changes.fetch_add(1, Ordering::SeqCst);
        }
        tracing::debug!(kind, name, ?outcome, "deleted");
        Ok(outcome)
    }
}

/// Converts a request's error and counts the request in [`metrics::KUBE_REQUESTS`].
fn counted<T>(verb: &'static str, result: Result<T, kube::Error>) -> Result<T, KubeError> {
    let result = result.map_err(KubeError::from);
    metrics::kubernetes(verb, Outcome::of_result(&result));
    result
}

/// A counted GET that reads a 404 as `None` (kube's `get_opt`); on the wire it is a 404, so it
/// counts as `not_found`.
async fn get_opt(api: &Api<DynamicObject>, name: &str) -> Result<Option<DynamicObject>, KubeError> {
    let result = api.get_opt(name).await.map_err(KubeError::from);
    let outcome = match &result {
        Ok(Some(_)) => Outcome::Ok,
        Ok(None) => Outcome::NotFound,
        Err(e) => Outcome::of(e.class()),
    };
    metrics::kubernetes("get", outcome);
    result
}

fn to_value(obj: DynamicObject, ar: &ApiResource) -> Result<Value, KubeError> {
    let mut v = serde_json::to_value(&obj)
        .map_err(|e| KubeError::InvalidObject(format!("response: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.entry("apiVersion")
            .or_insert_with(|| Value::String(ar.api_version.clone()));
        m.entry("kind")
            .or_insert_with(|| Value::String(ar.kind.clone()));
    }
    Ok(v)
}
