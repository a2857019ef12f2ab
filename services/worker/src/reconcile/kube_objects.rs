//! The DI's Kubernetes objects: listed, applied in the order [`plan::step::object_writes`]
//! gives, pruned; the access-token Secret on its own; the endpoint certificate kept or
//! reissued.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use base64::Engine;
use cloud_clients::{Before, Deleted, KubeClient, KubeError};
use region_store::NewCa;
use serde_json::Value;
use uuid::Uuid;

use super::converge::Reached;
use super::ledger::Ledger;
use super::{ReconcileError, Reconciler, Result, LEDGER_NAMESPACE};
use crate::metrics;
use crate::plan::{self, names, AccessTokenHash, TlsPair};
use crate::watch_cache::{Owner, Watched};

/// The kinds the worker renders, observed for readiness and pruning: (apiVersion, kind).
const RENDERED_KINDS: &[(&str, &str)] = &[
    ("v1", "Secret"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "SecurityPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
];

/// What [`Reconciler::apply_objects`] did.
#[derive(Debug, Default)]
pub(super) struct ObjectsWritten {
    /// Applies that changed an object.
    pub(super) changed: u64,
    /// Of those, applies of objects the assessment judges by their status (see
    /// [`plan::readiness::judged_by_status`]).
    pub(super) changed_judged: u64,
    /// Objects deleted (pruned).
    pub(super) deleted: u64,
    /// Every object applied, as the server answered (or as listed, when up to date).
    pub(super) objects: Vec<Value>,
}

impl ObjectsWritten {
    /// `observed` with the applied objects in place of their listed copies: the DI's objects as
    /// they stand after the writes, pods and nodes as listed.
    pub(super) fn over(&self, observed: &[Value]) -> Vec<Value> {
        let same = |a: &Value, b: &Value| {
            a["kind"] == b["kind"]
                && a["apiVersion"] == b["apiVersion"]
                && a.pointer("/metadata/namespace") == b.pointer("/metadata/namespace")
                && a.pointer("/metadata/name") == b.pointer("/metadata/name")
        };
        let mut out: Vec<Value> = observed
            .iter()
            .filter(|o| !self.objects.iter().any(|a| same(a, o)))
            .cloned()
            .collect();
        out.extend(self.objects.iter().cloned());
        out
    }
}

/// Whether `o` is of a kind [`Reconciler::observe`] lists: absent from its list, it does not
/// exist with the DI's labels.
fn is_rendered_kind(o: &Value) -> bool {
    RENDERED_KINDS
        .iter()
        .any(|(api_version, kind)| o["apiVersion"] == *api_version && o["kind"] == *kind)
}

fn label_selector(di_id: Uuid) -> String {
    format!(
        "{}={},{}={}",
        names::MANAGED_BY_LABEL,
        names::MANAGED_BY,
        names::DI_ID_LABEL,
        di_id
    )
}

fn b64_decode(v: &Value) -> Option<String> {
    let s = v.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
    String::from_utf8(bytes).ok()
}

/// The endpoint certificate: the one in the cluster unless it must be reissued, from the CA
/// [`plan::signing_ca`] picks among the DI's.
pub(super) fn tls(cas: &[NewCa], observed: &[Value]) -> Result<TlsPair> {
    // The addresses the load balancers report: the names the certificate must cover.
    let mut hosts: Vec<String> = observed
        .iter()
        .filter(|o| o["kind"] == "Service" && o["spec"]["type"] == "LoadBalancer")
        .filter_map(|o| o.pointer("/status/loadBalancer/ingress/0"))
        .filter_map(|i| {
            i.get("ip")
                .and_then(Value::as_str)
                .or_else(|| i.get("hostname").and_then(Value::as_str))
        })
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    hosts.sort();
    hosts.dedup();
    let now = SystemTime::now();
    let ends: Vec<SystemTime> = cas.iter().map(|ca| ca.not_after.into()).collect();
    let ca = plan::signing_ca(&ends, now)
        .map(|i| &cas[i])
        .ok_or_else(|| ReconcileError::Transient("the DI has no certificate authority".into()))?;
    let existing = observed
        .iter()
        .find(|o| {
            o["kind"] == "Secret"
                && o.pointer("/metadata/name").and_then(Value::as_str) == Some(names::TLS_SECRET)
        })
        .and_then(|o| {
            Some(TlsPair {
                cert_pem: b64_decode(o.pointer("/data/tls.crt")?)?,
                key_pem: b64_decode(o.pointer("/data/tls.key")?)?,
            })
        });
    match existing {
        Some(pair) if !plan::needs_reissue(&pair.cert_pem, &ca.cert_pem, &hosts, now) => Ok(pair),
        _ => plan::issue(&ca.cert_pem, &ca.key_pem, &hosts, now).map_err(Into::into),
    }
}

/// What a cluster's watch cache keeps: the rendered kinds, the pods of DI namespaces and the
/// nodes of DI pools, as [`Reconciler::observe`] lists them.
fn watched() -> Vec<Watched> {
    let managed = format!("{}={}", names::MANAGED_BY_LABEL, names::MANAGED_BY);
    RENDERED_KINDS
        .iter()
        .map(|(api_version, kind)| Watched {
            api_version,
            kind,
            selector: managed.clone(),
            owner: Owner::Label,
        })
        .chain([
            Watched {
                api_version: "v1",
                kind: "Pod",
                selector: String::new(),
                owner: Owner::Namespace,
            },
            Watched {
                api_version: "v1",
                kind: "Node",
                selector: names::DI_ID_LABEL.to_string(),
                owner: Owner::Label,
            },
        ])
        .collect()
}

impl Reconciler {
    /// The DI's rendered objects, its pods and its nodes: from the cluster's watch cache when
    /// `cached` and the cache is synced (see [`crate::watch_cache`] for when a pass may), else
    /// listed. The first pass to reach a cluster starts its watches, so that changes behind the
    /// worker's back wake the DIs of the cluster from then on.
    /// Where DI `id`'s objects stand in its cluster's watch cache (see
    /// [`crate::watch_cache::ClusterCache::changes`]); `None` without a synced cache.
    pub(super) fn cache_changes(&self, at: &Reached, id: Uuid) -> Option<(u64, u64)> {
        if !self.settings.watch_caches {
            return None;
        }
        self.kube.cache(&at.cluster_id, watched)?.changes(id)
    }

    pub(super) async fn observe(
        &self,
        at: &Reached,
        id: Uuid,
        ns: &str,
        cached: bool,
    ) -> Result<Vec<Value>> {
        let cache = self
            .settings
            .watch_caches
            .then(|| self.kube.cache(&at.cluster_id, watched))
            .flatten();
        if let Some(objects) = cache.filter(|_| cached).and_then(|c| c.objects(id, ns)) {
            metrics::observed("cache");
            return Ok(objects);
        }
        metrics::observed("list");
        let kube = &at.kube;
        let sel = label_selector(id);
        let node_sel = format!("{}={}", names::DI_ID_LABEL, id);
        // The lists are independent: issue them at once (the pass waits for one round trip, not
        // a dozen).
        let lists = RENDERED_KINDS
            .iter()
            .map(|(api_version, kind)| kube.list(api_version, kind, Some(ns), &sel))
            .chain([
                kube.list("v1", "Pod", Some(ns), ""),
                kube.list("v1", "Node", None, &node_sel),
            ]);
        let found = futures::future::try_join_all(lists).await?;
        Ok(found.into_iter().flatten().collect())
    }

    /// Applies the DI's endpoint authentication alone ([`plan::endpoint_auth_manifests`]), in
    /// order and without prune: the DI's other objects stay as its last good spec left them.
    /// Unlike a full pass it does not hold the policy back until endpoint-auth can answer: a DI
    /// in `error` is looked at again only at its resync or when its tokens change, so a held
    /// policy would leave it open until then; a few seconds of 503 is the lesser harm.
    ///
    /// Nor does it restart endpoint-auth for a new rendering: a DI in `error` takes no slot of a
    /// fleet rollout, so its running template is kept (see [`plan::fleet`]).
    pub(super) async fn apply_endpoint_auth(&self, kube: &KubeClient, id: Uuid) -> Result<()> {
        let mut objects = plan::endpoint_auth_manifests(id, &self.settings.images);
        let ns = names::namespace(&id);
        let running = kube
            .list("apps/v1", "Deployment", Some(&ns), &label_selector(id))
            .await?;
        let restarts = plan::fleet::restarts(&objects, &running);
        plan::fleet::keep(&mut objects, &plan::fleet::running(&running, &restarts));
        let mut changed = 0;
        for object in objects {
            changed += u64::from(kube.apply(&object).await?.changed);
        }
        self.kube_writes_total.fetch_add(changed, Ordering::SeqCst);
        Ok(())
    }

    /// Applies the DI's objects wave by wave and prunes what the spec no longer asks for (the
    /// namespace is recorded in the ledger before it is created). Objects the last list shows
    /// up to date cost no request; when `observed` was listed by this pass (not read from the
    /// watch cache, which may lag), one it did not show is applied without reading it first.
    pub(super) async fn apply_objects(
        &self,
        ledger: &mut Ledger<'_>,
        at: &Reached,
        desired: &[Value],
        observed: &[Value],
        listed_now: bool,
    ) -> Result<ObjectsWritten> {
        let id = ledger.id;
        let ns = names::namespace(&id);
        ledger
            .record(LEDGER_NAMESPACE, &ns, &at.cluster_id, None)
            .await?;
        let rendered: Vec<Value> = observed
            .iter()
            .filter(|o| o["kind"] != "Pod" && o["kind"] != "Node")
            .cloned()
            .collect();
        let writes = plan::step::object_writes(&id, desired, &rendered);
        let mut done = ObjectsWritten::default();
        for wave in writes.waves {
            let applies = wave.iter().map(|a| {
                let before = match a.listed {
                    Some(listed) => Before::Listed(listed),
                    None if listed_now && is_rendered_kind(a.object) => Before::Absent,
                    None => Before::Unknown,
                };
                at.kube.apply_observed(a.object, before)
            });
            for applied in futures::future::try_join_all(applies).await? {
                if applied.changed {
                    done.changed += 1;
                    done.changed_judged +=
                        u64::from(plan::readiness::judged_by_status(&applied.object));
                }
                done.objects.push(applied.object);
            }
        }
        // Counted once every wave has gone through, as before the waves were planned apart: a
        // pass that fails halfway is run again and counts its writes then.
        self.kube_writes_total
            .fetch_add(done.changed, Ordering::SeqCst);
        for key in writes.prune {
            let (namespace, name) = (key.namespace.as_deref(), &key.name);
            let deleted = at
                .kube
                .delete(&key.api_version, &key.kind, namespace, name)
                .await?;
            if deleted != Deleted::AlreadyGone {
                self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
                done.deleted += 1;
            }
        }
        Ok(done)
    }

    /// Writes the DI's access-token Secret (what the gateway checks) on its own. A missing
    /// namespace means nothing serves yet: nothing to do.
    pub(super) async fn apply_tokens(
        &self,
        kube: &KubeClient,
        id: Uuid,
        tokens: &[AccessTokenHash],
    ) -> std::result::Result<(), KubeError> {
        let secret = plan::manifests::access_tokens_secret(&id, tokens);
        match kube.apply(&secret).await {
            Ok(applied) => {
                if applied.changed {
                    self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            }
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e),
        }
    }
}
