//! Converging a DI on its spec.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use api_types::lifecycle::Status;
use api_types::regional::{Record, StoredSpec};
use base64::Engine;
use cloud_clients::digitalocean::{ClusterState, NodePoolCreateRequest, NodePoolUpdateRequest};
use cloud_clients::{Deleted, KubeClient, KubeError};
use region_store::{DeploymentReplicas, Endpoints, NewCa, ObservedAccelerator, StoreError};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::ledger::Ledger;
use super::{
    access_tokens, label_selector, listed, Pass, ReconcileError, Reconciler, Result,
    LEDGER_NAMESPACE, LEDGER_NODE_POOL, POOLS_HELD_RECHECK, RENDERED_KINDS,
};
use crate::plan::{
    self, names, AccessTokenHash, ClusterWait, ManifestInput, PoolAction, TlsPair, Waiting,
};
use crate::scaling;

/// The entry of DI `di_id`'s probe token `value` among its access-token hashes.
///
/// Why a token of the DI's own rather than an unauthenticated health path: the probe must show
/// that a customer's request would succeed, through the load balancer, TLS, the token check,
/// the route and the endpoint picker to a model server, and a path that skips the token check
/// is a hole in every endpoint. Why not a key derived from the DI id with a region-wide secret
/// (as before): whoever holds that secret can mint the probe token of every DI, and no DI's can
/// be revoked without changing all of them. So each DI gets a random token, sealed in the
/// regional store (`Store::probe_token`), whose hash only that DI's gateway accepts; it is
/// rotated with `Store::probe_token_rotate` and deleted with the DI.
///
/// Its key in the Secret is fixed per DI (derived from the DI id), so a rotation replaces the
/// value in place and the customer's token ids never collide with it.
pub fn probe_token_hash(di_id: Uuid, value: &str) -> AccessTokenHash {
    let digest = Sha256::new()
        .chain_update(b"probe-token-id:")
        .chain_update(di_id.as_bytes())
        .finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    AccessTokenHash::from_value(uuid::Builder::from_random_bytes(b).into_uuid(), value)
}

fn b64_decode(v: &Value) -> Option<String> {
    let s = v.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
    String::from_utf8(bytes).ok()
}

/// The endpoint certificate: the one in the cluster unless it must be reissued, from the CA
/// [`plan::signing_ca`] picks among the DI's.
fn tls(cas: &[NewCa], observed: &[Value]) -> Result<TlsPair> {
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

impl Reconciler {
    // -----------------------------------------------------------------------------------------
    // Converge

    pub(super) async fn converge(&self, rec: &Record) -> Result<Pass> {
        let id = rec.id;
        let s = &self.settings;
        let Some(spec) = rec.pending_spec.as_ref().or(rec.spec.as_ref()) else {
            return Ok(Pass::new(rec.status, s.resync));
        };
        let pending = rec.pending_spec.as_ref().map(|p| p.version);
        let mut status = rec.status;
        if status == Status::New {
            status = self.store.provisioning_begin(id).await?.status;
        } else if status == Status::Active && pending.is_some() {
            status = self.store.updating_begin(id).await?.status;
        }
        let pass = Pass::new(status, s.poll);
        let mut models = plan::models(&spec.model_deployments)?;
        // A converged DI that autoscales is looked at every autoscale interval, not every resync.
        let autoscaled = spec
            .model_deployments
            .iter()
            .any(|md| plan::autoscale::Policy::of(md).is_some());
        let converged_check = if autoscaled {
            s.autoscale_interval.min(s.resync)
        } else {
            s.resync
        };
        let inputs = self.store.pass_inputs(id).await?;
        let mut ledger = Ledger {
            store: &self.store,
            id,
            known: inputs.ledger,
        };

        // The VPC's cluster: create it (recorded first), then wait for it to run.
        let cluster_name = names::cluster(&rec.vpc_uuid);
        // A resync of a converged DI reaches the cluster it reached last time without asking
        // DigitalOcean: at 1,000 DIs, two reads per resync would exceed the API's hourly budget
        // several times over. When the cluster does not answer, the next pass asks again.
        let resync = status == Status::Active && pending.is_none();
        let trusted = if resync {
            self.trusted_cluster(&cluster_name)
        } else {
            None
        };
        let trusting = trusted.is_some();
        let probe_value = inputs.probe_token;
        let tokens = access_tokens(id, inputs.token_hashes, &probe_value)?;
        if !resync {
            // A token created or revoked reaches the gateway before anything in this pass that
            // may wait on DigitalOcean (a slow or failing API must not delay a revocation).
            if let Some((_, kube)) = self.trusted_cluster(&cluster_name) {
                if let Err(e) = self.apply_tokens(&kube, id, &tokens).await {
                    tracing::debug!(di = %id, error = %e, "early token sync failed; the pass retries it");
                }
            }
        }
        let (cluster_id, kube) = match trusted {
            Some((cluster_id, kube)) => {
                if !ledger.use_cluster(&cluster_name, &cluster_id).await? {
                    self.distrust_cluster(&cluster_name, &cluster_id);
                    let wait = Waiting::Cluster {
                        name: cluster_name,
                        state: ClusterWait::BeingDeleted,
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                (cluster_id, kube)
            }
            None => match self
                .running_cluster(&cluster_name, rec, &pass, &mut ledger)
                .await?
            {
                Ok(ready) => ready,
                Err(wait) => return Ok(wait),
            },
        };

        // Observe.
        let ns = names::namespace(&id);
        let observed = match self.observe(&kube, id, &ns).await {
            Err(e) if trusting => {
                self.distrust_cluster(&cluster_name, &cluster_id);
                return Err(e);
            }
            r => r?,
        };
        let rendered: Vec<Value> = observed
            .iter()
            .filter(|o| o["kind"] != "Pod" && o["kind"] != "Node")
            .cloned()
            .collect();

        // The database's clock, not this machine's: the autoscaler's memory is shared by every
        // worker that takes the DI, and their clocks may disagree.
        let now_ms = inputs.now_ms;
        // Replicas: the spec's scale, or the autoscaler's count. Its decision is recorded
        // before anything applies it, so that a pass failing halfway does not forget it.
        let scaled = scaling::decide_all(
            &kube,
            &ns,
            spec,
            resync,
            &observed,
            &inputs.replicas,
            now_ms,
            s.scale_down_window,
        )
        .await;
        for m in &mut models {
            if let Some(x) = scaled.iter().find(|x| x.model_id == m.model_id) {
                m.scale = x.wanted;
            }
        }
        self.record_replicas(id, &scaled, &observed, &inputs.replicas)
            .await?;

        // Desired objects.
        let tls = tls(&inputs.cas, &observed)?;
        let input = ManifestInput {
            di_id: id,
            models: models.clone(),
            enable_public_endpoint: rec.enable_public_endpoint,
            hugging_face_token: inputs.hugging_face_token,
            tls,
            access_tokens: tokens,
            gateway_class: s.gateway_class.clone(),
            images: s.images.clone(),
            hub_endpoint: s.hub_endpoint.clone(),
        };
        let desired = plan::manifests(&input);

        // Node pools: read from DigitalOcean unless a resync finds the Nodes as planned.
        let rolling = plan::readiness::rollouts(&desired, &observed);
        let mut writes = 0u64;
        // Pool shrinks and deletions held back for pods to be placed or to leave: the pools
        // are not done, so the DI is looked at again soon even once it serves.
        let mut pools_held = Vec::new();
        if !(resync && rolling.is_empty() && plan::nodes_match(&id, &models, &observed)) {
            let awaited = plan::readiness::awaited_pools(&desired, &observed);
            match self
                .apply_node_pools(
                    id,
                    &cluster_id,
                    &models,
                    &rolling,
                    &awaited,
                    &observed,
                    &mut ledger,
                )
                .await
            {
                Ok((n, held)) => {
                    writes += n;
                    pools_held = held;
                }
                // The autoscaler asked for GPUs the cloud does not have: an active DI keeps
                // serving with what it runs, rather than turning to `error`.
                Err(e @ ReconcileError::Permanent { .. }) if resync => {
                    let ReconcileError::Permanent { message, .. } = &e else {
                        unreachable!("matched above")
                    };
                    let Some(back) =
                        scaling::after_refusal(spec, &scaled, &observed, message, now_ms)
                    else {
                        return Err(e);
                    };
                    self.record_replicas(id, &back, &observed, &[]).await?;
                    let wait = Waiting::ScaleUpRefused {
                        message: message.clone(),
                    };
                    return Ok(pass.wait(wait, s.poll));
                }
                Err(e) => return Err(e),
            }
        }

        // Kubernetes objects: the namespace is recorded before it is created.
        ledger
            .record(LEDGER_NAMESPACE, &ns, &cluster_id, None)
            .await?;
        // Namespaces first (everything else lives in them), then the rest at once, then the
        // namespace's default-deny NetworkPolicy: a namespace that gains its policies while it
        // serves is never isolated before the allows exist. Objects the last list shows up to
        // date cost no request.
        let (namespaces, namespaced): (Vec<&Value>, Vec<&Value>) =
            desired.iter().partition(|o| o["kind"] == "Namespace");
        let (isolation, namespaced): (Vec<&Value>, Vec<&Value>) = namespaced
            .into_iter()
            .partition(|o| plan::manifests::is_default_deny(o));
        let mut changed = Vec::new();
        for obj in namespaces {
            changed.push(kube.apply(obj).await?.changed);
        }
        let applies = namespaced
            .into_iter()
            .map(|obj| kube.apply_observed(obj, listed(&rendered, obj)));
        for applied in futures::future::try_join_all(applies).await? {
            changed.push(applied.changed);
        }
        for obj in isolation {
            changed.push(
                kube.apply_observed(obj, listed(&rendered, obj))
                    .await?
                    .changed,
            );
        }
        for _ in changed.into_iter().filter(|c| *c) {
            writes += 1;
            self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
        }
        for key in plan::prune(&id, &desired, &rendered) {
            let d = kube
                .delete(
                    &key.api_version,
                    &key.kind,
                    key.namespace.as_deref(),
                    &key.name,
                )
                .await?;
            if d != Deleted::AlreadyGone {
                writes += 1;
                self.kube_writes_total.fetch_add(1, Ordering::SeqCst);
            }
        }

        // Progress.
        let assessment = plan::assess(&id, &desired, &observed);
        self.record_accelerators(id, spec, &assessment.accelerators, &inputs.accelerators)
            .await?;
        // A model server that cannot load its model since the rollout began does not load by
        // waiting: the rollout fails in its words. (On a resync the DI keeps serving with its
        // other replicas; the wait names the failing pod.)
        if pending.is_some() {
            let began = SystemTime::from(spec.created_at);
            if let Some(failure) = plan::load_failure(&desired, &observed, began) {
                return Err(ReconcileError::permanent(
                    plan::MODEL_LOAD_FAILED,
                    failure.to_string(),
                ));
            }
        }
        if writes > 0 {
            return Ok(pass.wait(Waiting::Applied { changes: writes }, s.poll));
        }
        if !assessment.progress.ready {
            let waiting_for = assessment.progress.waiting_for;
            return Ok(pass.wait(Waiting::Rollout { waiting_for }, s.poll));
        }
        let endpoints = Endpoints {
            public_fqdn: assessment.public_endpoint.clone(),
            private_fqdn: assessment.private_endpoint.clone(),
        };
        // Serving as declared, with pools still to shrink or go once pods have left (which on a
        // real cluster takes up to their grace period): looked at again soon, not at the next
        // resync, though nothing customers asked for is waiting.
        let settled = |status: Status| {
            if pools_held.is_empty() {
                return Pass::new(status, converged_check);
            }
            tracing::debug!(di = %id, held = %pools_held.join("; "), "node pools held back");
            Pass::new(status, converged_check.min(POOLS_HELD_RECHECK))
        };
        let Some(version) = pending else {
            // Converged and nothing to roll out: a resync. Endpoints that moved since the rollout
            // (a load balancer replaced, the cluster rebuilt) are recorded.
            if status == Status::Active
                && (rec.public_endpoint_fqdn != endpoints.public_fqdn
                    || rec.private_endpoint_fqdn != endpoints.private_fqdn)
            {
                self.store.endpoints_update(id, &endpoints).await?;
                tracing::info!(di = %id, ?endpoints, "endpoints moved");
            }
            return Ok(settled(status));
        };
        let Some(url) = assessment
            .public_endpoint
            .clone()
            .or_else(|| assessment.private_endpoint.clone())
        else {
            return Ok(pass.wait(Waiting::EndpointAddress, s.poll));
        };
        if let Err(why) = self.probe(&url, &inputs.cas, &probe_value).await {
            return Ok(pass.wait(Waiting::Probe { url, why }, s.poll));
        }
        match self.store.rollout_complete(id, version, &endpoints).await {
            // The pass leaves the DI active (its span says so): no later pass is needed to see it.
            Ok(done) => {
                tracing::info!(di = %id, version, "rollout complete");
                Ok(settled(done.status))
            }
            // Superseded by a newer spec (or deleted) meanwhile: the next pass converges on it.
            Err(StoreError::Conflict(why)) => {
                Ok(pass.wait(Waiting::Superseded { why }, Duration::ZERO))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A DI in `error` keeps serving with what its last good spec left in the cluster, and is
    /// not converged until its spec changes. What a customer changes meanwhile that is not the
    /// spec — its access tokens — must still reach the gateway: a revoked token is refused
    /// within seconds whatever the status.
    pub(super) async fn refresh_credentials(&self, rec: &Record) -> Result<Pass> {
        let done = Pass::new(rec.status, self.settings.resync);
        let name = names::cluster(&rec.vpc_uuid);
        let (cluster_id, kube) = match self.trusted_cluster(&name) {
            Some(reached) => reached,
            None => match self.find_cluster(&name, false).await? {
                Some(c) if c.status.state == ClusterState::Running => {
                    (c.id.clone(), self.kube_for(&c.id).await?)
                }
                // No cluster: nothing serves.
                _ => return Ok(done),
            },
        };
        let hashes = self.store.token_hashes(rec.id).await?;
        let probe = self.store.probe_token(rec.id).await?;
        if let Err(e) = self
            .apply_tokens(&kube, rec.id, &access_tokens(rec.id, hashes, &probe)?)
            .await
        {
            self.distrust_cluster(&name, &cluster_id);
            return Err(e.into());
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

    /// Compares the DI's node pools in DigitalOcean with the plan and applies the difference;
    /// returns how many changes it made.
    pub(super) async fn apply_node_pools(
        &self,
        id: Uuid,
        cluster_id: &str,
        models: &[plan::Model],
        rolling: &plan::readiness::Rollouts,
        awaited: &BTreeSet<String>,
        observed: &[Value],
        ledger: &mut Ledger<'_>,
    ) -> Result<(u64, Vec<String>)> {
        let pools = self.cloud.node_pool_list(cluster_id).await?;
        let busy = plan::readiness::busy_nodes(observed, SystemTime::now());
        let observed_pools: Vec<plan::ObservedPool> = pools
            .iter()
            .map(|p| plan::ObservedPool {
                id: p.id.clone(),
                name: p.name.clone(),
                size: p.size.clone(),
                count: p.count,
                labels: p.labels.clone(),
                nodes: p
                    .nodes
                    .iter()
                    .map(|n| plan::ObservedNode {
                        id: n.id.clone(),
                        name: n.name.clone(),
                        busy: busy.contains(&n.name),
                    })
                    .collect(),
            })
            .collect();
        let plan = plan::node_pools(&id, models, rolling, &observed_pools, awaited);
        let changes = plan.actions.len() as u64;
        for action in plan.actions {
            match action {
                PoolAction::Create(d) => {
                    ledger
                        .record(LEDGER_NODE_POOL, &d.name, cluster_id, None)
                        .await?;
                    let mut req = NodePoolCreateRequest::new(&d.name, &d.size, d.count);
                    req.labels = d.labels.clone();
                    req.tags = d.tags.clone();
                    let created = self.cloud.node_pool_create(cluster_id, &req).await?;
                    ledger
                        .record(LEDGER_NODE_POOL, &d.name, cluster_id, Some(&created.id))
                        .await?;
                    tracing::info!(di = %id, pool = %d.name, "node pool created");
                }
                PoolAction::Resize {
                    pool_id,
                    name,
                    count,
                } => {
                    self.cloud
                        .node_pool_update(
                            cluster_id,
                            &pool_id,
                            &NodePoolUpdateRequest::new(&name, count),
                        )
                        .await?;
                    tracing::info!(di = %id, pool = %name, count, "node pool resized");
                }
                PoolAction::DeleteNode { pool_id, node_id } => {
                    match self
                        .cloud
                        .node_delete(cluster_id, &pool_id, &node_id, false)
                        .await
                    {
                        Err(e) if e.is_not_found() => {}
                        r => r?,
                    }
                }
                PoolAction::Delete { pool_id, name } => {
                    match self.cloud.node_pool_delete(cluster_id, &pool_id).await {
                        Err(e) if e.is_not_found() => {}
                        r => r?,
                    }
                    ledger.remove(LEDGER_NODE_POOL, &name).await?;
                    tracing::info!(di = %id, pool = %name, "node pool deleted");
                }
            }
        }
        Ok((changes, plan.held))
    }

    /// The DI's rendered objects, its pods and its nodes.
    pub(super) async fn observe(
        &self,
        kube: &KubeClient,
        id: Uuid,
        ns: &str,
    ) -> Result<Vec<Value>> {
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

    pub(super) async fn record_accelerators(
        &self,
        id: Uuid,
        spec: &StoredSpec,
        seen: &[plan::ObservedAccelerator],
        recorded: &[ObservedAccelerator],
    ) -> Result<()> {
        let role = |model: Option<Uuid>| {
            spec.model_deployments
                .iter()
                .find(|m| m.model_id.is_some() && m.model_id == model)
                .and_then(|m| m.accelerators.first())
                .map(|g| g.role.clone())
                .unwrap_or_else(|| "prefill_decode".to_string())
        };
        let observed: Vec<ObservedAccelerator> = seen
            .iter()
            .map(|a| ObservedAccelerator {
                name: a.name.clone(),
                slug: a.slug.clone(),
                role: role(a.model_id),
                status: a.status.clone(),
            })
            .collect();
        let mut by_name: Vec<&ObservedAccelerator> = observed.iter().collect();
        by_name.sort_by(|a, b| a.name.cmp(&b.name));
        // `recorded` is sorted by name too: write only what changed.
        if !by_name.iter().copied().eq(recorded.iter()) {
            self.store.accelerators_replace(id, &observed).await?;
        }
        Ok(())
    }

    /// Records each deployment's ready model servers, wanted replicas and autoscaler memory,
    /// with an event per scaling decision; nothing when nothing changed.
    pub(super) async fn record_replicas(
        &self,
        id: Uuid,
        scaled: &[scaling::Scaled],
        observed: &[Value],
        recorded: &[DeploymentReplicas],
    ) -> Result<()> {
        let mut rows: Vec<DeploymentReplicas> = scaled
            .iter()
            .map(|x| DeploymentReplicas {
                model_id: x.model_id,
                ready: scaling::ready_servers(observed, &x.model_id).len() as u32,
                wanted: x.wanted,
                autoscaler: x
                    .memory
                    .as_ref()
                    .map(|m| serde_json::to_value(m).expect("memory serialises")),
            })
            .collect();
        rows.sort_by_key(|r| r.model_id);
        let events: Vec<(&str, String)> = scaled
            .iter()
            .filter_map(|x| {
                let d = x.decision.as_ref()?;
                tracing::info!(di = %id, model = %x.model_id, reason = d.reason, message = %d.message, "autoscaler");
                Some((d.reason, format!("model {}: {}", x.model_id, d.message)))
            })
            .collect();
        if rows.as_slice() != recorded || !events.is_empty() {
            self.store.replicas_record(id, &rows, &events).await?;
        }
        Ok(())
    }

    /// `GET {url}/v1/models` with the probe token, trusting only the DI's CAs (as customers do
    /// with `GET …/ca`): 200 or why not.
    pub(super) async fn probe(
        &self,
        url: &str,
        cas: &[NewCa],
        token: &str,
    ) -> std::result::Result<(), String> {
        let mut client = reqwest::Client::builder().tls_built_in_root_certs(false);
        for ca in cas {
            client = client.add_root_certificate(
                reqwest::Certificate::from_pem(ca.cert_pem.as_bytes())
                    .map_err(|e| e.to_string())?,
            );
        }
        let client = client
            .timeout(self.settings.probe_timeout)
            .build()
            .map_err(|e| e.to_string())?;
        let resp = client
            .get(format!("{}/v1/models", url.trim_end_matches('/')))
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| format!("not answering ({e})"))?;
        if resp.status() == reqwest::StatusCode::OK {
            Ok(())
        } else {
            Err(format!("answered {}", resp.status()))
        }
    }
}
