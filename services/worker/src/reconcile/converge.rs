//! Converging a DI on its spec: the executor of the decisions in [`plan::step`]. A pass begins
//! (status change), reaches the VPC's cluster, observes the DI's objects, scales, works out the
//! objects it wants, sizes the node pools, applies, and concludes; each step is a function
//! here, and every choice between outcomes is made by a pure function of the plan crate.

use std::time::{Duration, SystemTime};

use api_types::lifecycle::Status;
use api_types::regional::{Record, StoredSpec};
use cloud_clients::digitalocean::ClusterState;
use cloud_clients::KubeClient;
use region_store::{Endpoints, PassInputs, StoreError};
use serde_json::Value;

use super::endpoint::access_tokens;
use super::kube_objects::ObjectsWritten;
use super::ledger::Ledger;
use super::{Pass, ReconcileError, Reconciler, Result};
use crate::plan::step::{self, Begin, Verdict, Written};
use crate::plan::{self, names, AccessTokenHash, Assessment, ClusterWait, ManifestInput, Waiting};
use crate::{metrics, scaling};

/// What a converge pass has learned by the time it reaches the cloud, handed from step to step.
pub(super) struct Converging<'a> {
    pub(super) rec: &'a Record,
    /// The spec being rolled out (pending), else the current one.
    pub(super) spec: &'a StoredSpec,
    /// The status as the pass's first step left it.
    pub(super) status: Status,
    /// The version being rolled out, if any.
    pub(super) pending: Option<i32>,
    /// See [`step::is_resync`].
    pub(super) resync: bool,
    /// Whether a model deployment autoscales (the DI is then looked at every autoscale interval).
    pub(super) autoscaled: bool,
    pub(super) models: Vec<plan::Model>,
    pub(super) inputs: PassInputs,
    /// The tokens the gateway must accept.
    pub(super) tokens: Vec<AccessTokenHash>,
    pub(super) ledger: Ledger<'a>,
}

/// The VPC's cluster as the pass reached it.
pub(super) struct Reached {
    name: String,
    pub(super) cluster_id: String,
    pub(super) kube: KubeClient,
    /// Reached as the last pass left it, without asking DigitalOcean: if it does not answer,
    /// the next pass asks.
    trusted: bool,
}

impl Reconciler {
    pub(super) async fn converge(&self, rec: &Record) -> Result<Pass> {
        let mut platform_update = false;
        let mut pass = self.converge_pass(rec, &mut platform_update).await?;
        pass.platform_update = platform_update;
        Ok(pass)
    }

    /// [`Reconciler::converge`]; `platform_update` is set once the pass works under a fleet
    /// rollout slot.
    async fn converge_pass(&self, rec: &Record, platform_update: &mut bool) -> Result<Pass> {
        let s = &self.settings;
        let Some(spec) = rec.pending_spec.as_ref().or(rec.spec.as_ref()) else {
            return Ok(Pass::new(rec.status, s.resync));
        };
        let mut c = self.begin(rec, spec).await?;
        let pass = Pass::new(c.status, s.poll);
        let at = match self.reach(&mut c, &pass).await? {
            Ok(at) => at,
            Err(wait) => return Ok(wait),
        };
        let cached = self.reads_cache(&c, &at);
        let judged = self.judged(&c, &at, cached);
        if judged.is_some_and(|j| self.converged.on(rec.id, j)) {
            metrics::observed("unchanged");
            return Ok(Pass::new(c.status, s.resync));
        }
        let observed = self.observe_reached(&at, rec, cached).await?;
        let (models, scaled) = self.scale(&c, &at.kube, &observed).await?;
        let mut desired = self.desired(&c, &models, &observed)?;
        let restarts_held = !plan::fleet::restarts(&desired, &observed).is_empty();
        *platform_update = self.fleet_hold(&c, &mut desired, &observed).await?;
        let pools = self
            .node_pools(&mut c, &at, &models, &desired, &observed, &scaled)
            .await?;
        let (pool_writes, pools_held) = match pools {
            Ok(done) => done,
            Err(wait) => return Ok(pass.wait(wait, s.poll)),
        };
        let objects = self
            .apply_objects(&mut c.ledger, &at, &desired, &observed, !cached)
            .await?;
        let (verdict, assessment) = self
            .judge(&c, &desired, &observed, &objects, pool_writes)
            .await?;
        let clean = pool_writes + objects.changed + objects.deleted == 0
            && pools_held.is_empty()
            && !restarts_held
            && matches!(
                verdict,
                Verdict::Settled {
                    endpoints_moved: false
                }
            );
        self.converged.record(rec.id, judged.filter(|_| clean));
        let settled = self
            .fleet_settle(&c, &desired, &observed, &verdict, &assessment, &pass)
            .await?;
        if let Some(pass) = settled {
            return Ok(pass);
        }
        self.conclude(&c, verdict, &assessment, &pools_held, pass)
            .await
    }

    /// Whether this pass may read the DI's objects from the cluster's watch cache rather than
    /// list them (see [`step::reads_cache`]).
    fn reads_cache(&self, c: &Converging<'_>, at: &Reached) -> bool {
        let since_last_pass = c
            .inputs
            .since_last_pass_ms
            .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        step::reads_cache(
            c.resync,
            at.trusted,
            self.fleet_moving(c),
            since_last_pass,
            self.settings.cache_margin,
        )
    }

    /// The DI's objects in the cluster. A cluster reached without asking DigitalOcean that
    /// does not answer is asked about again by the next pass.
    async fn observe_reached(
        &self,
        at: &Reached,
        rec: &Record,
        cached: bool,
    ) -> Result<Vec<Value>> {
        match self
            .observe(at, rec.id, &names::namespace(&rec.id), cached)
            .await
        {
            Err(e) if at.trusted => {
                self.distrust_cluster(&at.name, &at.cluster_id);
                Err(e)
            }
            r => r,
        }
    }

    /// What the objects as applied say of the DI: the assessment (its accelerators recorded)
    /// and the step's verdict on it.
    async fn judge(
        &self,
        c: &Converging<'_>,
        desired: &[Value],
        observed: &[Value],
        objects: &ObjectsWritten,
        pool_writes: u64,
    ) -> Result<(Verdict, Assessment)> {
        let (rec, spec) = (c.rec, c.spec);
        let unseen = step::unseen_writes(
            c.pending.is_some(),
            objects.changed_judged,
            objects.changed - objects.changed_judged + pool_writes + objects.deleted,
        );
        let assessment = plan::assess(&rec.id, desired, &objects.over(observed));
        self.record_accelerators(
            rec.id,
            spec,
            &assessment.accelerators,
            &c.inputs.accelerators,
        )
        .await?;
        let load_failure = c
            .pending
            .and_then(|_| plan::load_failure(desired, observed, SystemTime::from(spec.created_at)));
        let verdict = step::verdict(Written {
            status: c.status,
            pending: c.pending,
            writes: unseen,
            assessment: &assessment,
            load_failure: load_failure.as_ref(),
            recorded: (
                rec.public_endpoint_fqdn.as_deref(),
                rec.private_endpoint_fqdn.as_deref(),
            ),
        });
        Ok((verdict, assessment))
    }

    /// The status change a pass starts with, and what it reads from the store.
    async fn begin<'a>(&'a self, rec: &'a Record, spec: &'a StoredSpec) -> Result<Converging<'a>> {
        let id = rec.id;
        let pending = rec.pending_spec.as_ref().map(|p| p.version);
        let status = match step::begin(rec.status, pending.is_some()) {
            Begin::Provision => self.store.provisioning_begin(id).await?.status,
            Begin::Update => self.store.updating_begin(id).await?.status,
            Begin::Continue => rec.status,
        };
        let models = plan::models(&spec.model_deployments)?;
        let autoscaled = spec
            .model_deployments
            .iter()
            .any(|md| plan::autoscale::Policy::of(md).is_some());
        let inputs = self.store.pass_inputs(id).await?;
        let tokens = access_tokens(id, inputs.token_hashes.clone(), &inputs.probe_token)?;
        let ledger = Ledger {
            store: &self.store,
            id,
            known: inputs.ledger.clone(),
        };
        Ok(Converging {
            rec,
            spec,
            status,
            pending,
            resync: step::is_resync(status, pending.is_some()),
            autoscaled,
            models,
            inputs,
            tokens,
            ledger,
        })
    }

    /// The VPC's cluster, or the pass to end with while it is not running. A resync reaches the
    /// cluster it reached last time without asking DigitalOcean: at 1,000 DIs, two reads per
    /// resync would exceed the API's hourly budget several times over.
    async fn reach(
        &self,
        c: &mut Converging<'_>,
        pass: &Pass,
    ) -> Result<std::result::Result<Reached, Pass>> {
        let name = names::cluster(&c.rec.vpc_uuid);
        if !c.resync {
            // A token created or revoked reaches the gateway before anything in this pass that
            // may wait on DigitalOcean (a slow or failing API must not delay a revocation).
            if let Some((_, kube)) = self.trusted_cluster(&name) {
                if let Err(e) = self.apply_tokens(&kube, c.rec.id, &c.tokens).await {
                    tracing::debug!(di = %c.rec.id, error = %e, "early token sync failed; the pass retries it");
                }
            }
        }
        let trusted = c.resync.then(|| self.trusted_cluster(&name)).flatten();
        let Some((cluster_id, kube)) = trusted else {
            let running = self
                .running_cluster(&name, c.rec, pass, &mut c.ledger)
                .await?;
            return Ok(running.map(|(cluster_id, kube)| Reached {
                name,
                cluster_id,
                kube,
                trusted: false,
            }));
        };
        if !c.ledger.use_cluster(&name, &cluster_id).await? {
            self.distrust_cluster(&name, &cluster_id);
            let wait = Waiting::Cluster {
                name,
                state: ClusterWait::BeingDeleted,
            };
            return Ok(Err(pass.clone().wait(wait, self.settings.poll)));
        }
        Ok(Ok(Reached {
            name,
            cluster_id,
            kube,
            trusted: true,
        }))
    }

    /// Replicas: the spec's scale, or the autoscaler's count. Its decision is recorded before
    /// anything applies it, so that a pass failing halfway does not forget it.
    async fn scale(
        &self,
        c: &Converging<'_>,
        kube: &KubeClient,
        observed: &[Value],
    ) -> Result<(Vec<plan::Model>, Vec<scaling::Scaled>)> {
        let id = c.rec.id;
        // The database's clock, not this machine's: the autoscaler's memory is shared by every
        // worker that takes the DI, and their clocks may disagree.
        let scaled = scaling::decide_all(
            kube,
            &names::namespace(&id),
            c.spec,
            c.resync,
            observed,
            &c.inputs.replicas,
            &self.recall,
            c.inputs.now_ms,
            self.settings.scale_down_window,
        )
        .await;
        let mut models = c.models.clone();
        for m in &mut models {
            if let Some(x) = scaled.iter().find(|x| x.model_id == m.model_id) {
                m.scale = x.wanted;
            }
        }
        self.record_replicas(id, &scaled, observed, &c.inputs.replicas)
            .await?;
        scaling::mark_least_busy(kube, &names::namespace(&id), observed, &scaled).await;
        Ok((models, scaled))
    }

    /// The objects the DI should have, given what was observed (the endpoint certificate is
    /// kept unless it must be reissued).
    fn desired(
        &self,
        c: &Converging<'_>,
        models: &[plan::Model],
        observed: &[Value],
    ) -> Result<Vec<Value>> {
        let s = &self.settings;
        Ok(plan::manifests(&ManifestInput {
            di_id: c.rec.id,
            models: models.to_vec(),
            enable_public_endpoint: c.rec.enable_public_endpoint,
            hugging_face_token: c.inputs.hugging_face_token.clone(),
            tls: super::kube_objects::tls(&c.inputs.cas, observed)?,
            access_tokens: c.tokens.clone(),
            gateway_class: s.gateway_class.clone(),
            images: s.images.clone(),
            hub_endpoint: s.hub_endpoint.clone(),
            cold_start_hold: s.cold_start_hold,
        }))
    }

    /// Node pools, read from DigitalOcean unless [`step::reads_pools`] says a resync need not:
    /// the changes made and the pools held back, or what the pass waits for when the cloud
    /// refused the autoscaler's scale-up.
    async fn node_pools(
        &self,
        c: &mut Converging<'_>,
        at: &Reached,
        models: &[plan::Model],
        desired: &[Value],
        observed: &[Value],
        scaled: &[scaling::Scaled],
    ) -> Result<std::result::Result<(u64, Vec<String>), Waiting>> {
        let id = c.rec.id;
        let rolling = plan::readiness::rollouts(desired, observed);
        let as_planned = plan::nodes_match(&id, models, observed);
        if !step::reads_pools(c.resync, !rolling.is_empty(), as_planned) {
            return Ok(Ok((0, Vec::new())));
        }
        let awaited = plan::readiness::awaited_pools(desired, observed);
        let applied = self
            .apply_node_pools(id, at, models, &rolling, &awaited, observed, &mut c.ledger)
            .await;
        match applied {
            // The autoscaler asked for GPUs the cloud does not have: an active DI keeps
            // serving with what it runs, rather than turning to `error`.
            Err(ReconcileError::Permanent {
                reason,
                message,
                version,
            }) if c.resync => {
                let now = c.inputs.now_ms;
                let Some(back) = scaling::after_refusal(c.spec, scaled, observed, &message, now)
                else {
                    return Err(ReconcileError::Permanent {
                        reason,
                        message,
                        version,
                    });
                };
                self.record_replicas(id, &back, observed, &[]).await?;
                Ok(Err(Waiting::ScaleUpRefused { message }))
            }
            r => r.map(Ok),
        }
    }

    /// Ends the pass as [`step::verdict`] decided: records what moved, probes the endpoint
    /// before a rollout completes, and says when to look again.
    async fn conclude(
        &self,
        c: &Converging<'_>,
        verdict: Verdict,
        assessment: &Assessment,
        pools_held: &[String],
        pass: Pass,
    ) -> Result<Pass> {
        let (s, id) = (&self.settings, c.rec.id);
        let endpoints = Endpoints {
            public_fqdn: assessment.public_endpoint.clone(),
            private_fqdn: assessment.private_endpoint.clone(),
        };
        if !pools_held.is_empty() {
            tracing::debug!(di = %id, held = %pools_held.join("; "), "node pools held back");
        }
        let next = step::next_look(
            c.autoscaled,
            s.resync,
            s.autoscale_interval,
            !pools_held.is_empty(),
        );
        match verdict {
            Verdict::Fail { reason, message } => Err(ReconcileError::permanent(reason, message)),
            Verdict::Wait(what) => Ok(pass.wait(what, s.poll)),
            Verdict::Settled { endpoints_moved } => {
                if endpoints_moved {
                    self.store.endpoints_update(id, &endpoints).await?;
                    tracing::info!(di = %id, ?endpoints, "endpoints moved");
                }
                Ok(Pass::new(c.status, next))
            }
            Verdict::Probe { url, version } => {
                let retired = c.inputs.retired_probe_token.as_deref();
                let probed = self.probe(&url, &c.inputs.cas, &c.inputs.probe_token, retired);
                if let Err(why) = probed.await {
                    return Ok(pass.wait(Waiting::Probe { url, why }, s.poll));
                }
                match self.store.rollout_complete(id, version, &endpoints).await {
                    // The pass leaves the DI active (its span says so): no later pass is
                    // needed to see it.
                    Ok(done) => {
                        tracing::info!(di = %id, version, "rollout complete");
                        Ok(Pass::new(done.status, next))
                    }
                    // Superseded by a newer spec (or deleted) meanwhile: the next pass
                    // converges on it.
                    Err(StoreError::Conflict(why)) => {
                        Ok(pass.wait(Waiting::Superseded { why }, Duration::ZERO))
                    }
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// A DI in `error` keeps serving with what its last good spec left in the cluster, and is
    /// not converged until its spec changes. What a customer changes meanwhile that is not the
    /// spec — its access tokens — must still reach the gateway: a revoked token is refused
    /// within seconds whatever the status. So must the token check itself: a DI that went to
    /// `error` before endpoint auth existed gets it here.
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
        let tokens = access_tokens(rec.id, hashes, &probe)?;
        let refreshed = async {
            self.apply_tokens(&kube, rec.id, &tokens).await?;
            self.apply_endpoint_auth(&kube, rec.id).await
        };
        if let Err(e) = refreshed.await {
            self.distrust_cluster(&name, &cluster_id);
            return Err(e);
        }
        Ok(done)
    }
}
