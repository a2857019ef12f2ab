//! The executor of [`plan::fleet`]: a resync whose rendering would restart a DI's pods asks the
//! region's rollout for a slot (the store counts the budget) and keeps the running templates
//! until it has one; a rolling slot ends done once the DI serves and answers the probe, or
//! failed (which halts the rollout, and the DI goes back to what it ran).

use std::time::{Duration, SystemTime};

use region_store::{FleetSlot, SlotState, Take};
use serde_json::Value;

use super::converge::Converging;
use super::{Pass, Reconciler, Result};
use crate::metrics;
use crate::plan::fleet::{self, Slot, SlotEnd, Step};
use crate::plan::step::Verdict;
use crate::plan::{self, Assessment, Waiting};

impl Reconciler {
    /// This worker's rendering, as the region's rollouts name it ([`plan::fleet::rendering_id`]).
    pub fn rendering(&self) -> &str {
        &self.rendering
    }

    /// Registers this worker's rendering with the region: the newest, unless seen before. Done
    /// once at start, before any pass, so that a worker of an older version that is still running
    /// never becomes the newest by registering late.
    pub async fn register_rendering(&self) -> Result<()> {
        Ok(self.store.fleet_register(&self.rendering).await?)
    }

    /// The DI's slot in this worker's rollout.
    fn slot(&self, c: &Converging<'_>) -> Slot {
        match &c.inputs.fleet_slot {
            Some(s) if s.rendering == self.rendering => match s.state {
                SlotState::Rolling => Slot::Rolling,
                SlotState::Done => Slot::Done,
                SlotState::Failed => Slot::Failed,
            },
            _ => Slot::None,
        }
    }

    /// The DI's pods are restarting under a slot of this worker's rollout, or going back from
    /// a failed one.
    pub(super) fn fleet_moving(&self, c: &Converging<'_>) -> bool {
        matches!(self.slot(c), Slot::Rolling | Slot::Failed)
    }

    /// Holds back, in `desired`, the restarts this pass may not make: on a resync without a slot
    /// (and none to be had), each restarting Deployment keeps the template it runs; with a failed
    /// slot, the one it ran before. A customer's own change applies as rendered. Returns whether
    /// the pass works under a rolling slot.
    pub(super) async fn fleet_hold(
        &self,
        c: &Converging<'_>,
        desired: &mut [Value],
        observed: &[Value],
    ) -> Result<bool> {
        let restarts = fleet::restarts(desired, observed);
        let running = || fleet::running(observed, &restarts);
        let slot = self.slot(c);
        match fleet::step(c.resync, &restarts, slot) {
            Step::Apply => return Ok(c.resync && slot == Slot::Rolling),
            Step::Release => {
                self.store.fleet_release(c.rec.id).await?;
                tracing::info!(di = %c.rec.id, "fleet rollout: a customer's change takes the DI out of the rollout");
            }
            Step::GoBack => {
                fleet::keep(desired, &running());
                if let Some(slot) = &c.inputs.fleet_slot {
                    fleet::keep(desired, &slot.previous);
                }
                return Ok(true);
            }
            Step::Ask => {
                // A DI that does not serve as it is (a replica crash-looping, a pod that cannot be
                // placed) is no test of the new rendering: its restart would fail for its own
                // reasons and halt the region's rollout. It waits, as it runs, until it serves.
                let mut held = desired.to_vec();
                fleet::keep(&mut held, &running());
                let healthy = plan::assess(&c.rec.id, &held, observed).progress.ready
                    && plan::load_failure(&held, observed, SystemTime::UNIX_EPOCH).is_none()
                    && fleet::start_failure(observed).is_none();
                if !healthy {
                    tracing::debug!(di = %c.rec.id, "fleet rollout: not serving as it runs; no slot asked");
                    fleet::keep(desired, &running());
                    return Ok(false);
                }
                let budget = self.settings.fleet_budget;
                let taken = self
                    .store
                    .fleet_take(c.rec.id, &self.rendering, budget, &running())
                    .await?;
                match taken {
                    Take::Granted { canary } => {
                        metrics::fleet_slot("granted");
                        tracing::info!(di = %c.rec.id, canary, rendering = %self.rendering,
                            restarts = %restarts.join(","), "fleet rollout: restarting the DI's pods");
                        return Ok(true);
                    }
                    Take::Held(why) => {
                        metrics::fleet_slot("held");
                        tracing::debug!(di = %c.rec.id, ?why, "fleet rollout: keeping the running templates");
                        fleet::keep(desired, &running());
                    }
                }
            }
        }
        Ok(false)
    }

    /// Ends a rolling slot where [`fleet::slot_end`] says: the DI settled and answers the probe
    /// (done), or cannot serve (failed: the rollout halts, and the next pass, at once, goes
    /// back). `Some(pass)` ends this pass there; `None` lets it conclude as it would.
    pub(super) async fn fleet_settle(
        &self,
        c: &Converging<'_>,
        desired: &[Value],
        observed: &[Value],
        verdict: &Verdict,
        assessment: &Assessment,
        pass: &Pass,
    ) -> Result<Option<Pass>> {
        let Some(slot) = c.inputs.fleet_slot.as_ref() else {
            return Ok(None);
        };
        // Only a resync ends a slot: a customer's pass gave it up (see `fleet_hold`), and its
        // failures are the customer's, not the rollout's.
        if !c.resync || self.slot(c) != Slot::Rolling {
            return Ok(None);
        }
        let id = c.rec.id;
        match self.fleet_slot_end(c, slot, desired, observed, verdict) {
            SlotEnd::Rolling => Ok(None),
            SlotEnd::Failed(why) => {
                tracing::warn!(di = %id, rendering = %self.rendering, %why, "fleet rollout: the DI cannot serve the new rendering; halting the rollout");
                self.store.fleet_failed(id, &self.rendering, &why).await?;
                metrics::fleet_slot("failed");
                Ok(Some(Pass::new(c.status, Duration::ZERO)))
            }
            SlotEnd::Done => {
                self.store.fleet_done(id, &self.rendering).await?;
                metrics::fleet_slot("done");
                Ok(None)
            }
            SlotEnd::Probe => self.fleet_probe(c, assessment, pass).await,
        }
    }

    /// Where the rolling `slot` stands this pass ([`fleet::slot_end`]): from whether the DI
    /// settled, still restarts, serves or fails, and how long the slot has run.
    fn fleet_slot_end(
        &self,
        c: &Converging<'_>,
        slot: &FleetSlot,
        desired: &[Value],
        observed: &[Value],
        verdict: &Verdict,
    ) -> SlotEnd {
        let since = SystemTime::UNIX_EPOCH
            + Duration::from_millis(u64::try_from(slot.started_ms).unwrap_or(0));
        let failure = plan::load_failure(desired, observed, since)
            .map(|f| f.to_string())
            .or_else(|| fleet::start_failure(observed));
        let settled = matches!(verdict, Verdict::Settled { .. });
        let timeout =
            i64::try_from(self.settings.fleet_slot_timeout.as_millis()).unwrap_or(i64::MAX);
        fleet::slot_end(
            settled,
            !fleet::restarts(desired, observed).is_empty(),
            fleet::serves(desired),
            failure.as_deref(),
            c.inputs.now_ms - slot.started_ms,
            timeout,
        )
    }

    /// Ends the settled DI's slot done once it answers the probe at its endpoint; until then the
    /// pass waits for it.
    async fn fleet_probe(
        &self,
        c: &Converging<'_>,
        assessment: &Assessment,
        pass: &Pass,
    ) -> Result<Option<Pass>> {
        let id = c.rec.id;
        let url = assessment
            .public_endpoint
            .as_ref()
            .or(assessment.private_endpoint.as_ref());
        let Some(url) = url else {
            return Ok(Some(
                pass.clone()
                    .wait(Waiting::EndpointAddress, self.settings.poll),
            ));
        };
        let retired = c.inputs.retired_probe_token.as_deref();
        let probed = self.probe(url, &c.inputs.cas, &c.inputs.probe_token, retired);
        if let Err(why) = probed.await {
            let wait = Waiting::Probe {
                url: url.clone(),
                why,
            };
            return Ok(Some(pass.clone().wait(wait, self.settings.poll)));
        }
        self.store.fleet_done(id, &self.rendering).await?;
        metrics::fleet_slot("done");
        tracing::info!(di = %id, rendering = %self.rendering, "fleet rollout: the DI serves the new rendering");
        Ok(None)
    }
}
