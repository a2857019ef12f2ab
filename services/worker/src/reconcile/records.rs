//! What a pass records of what it saw: the DI's accelerators and its replicas, written only
//! when they changed.

use api_types::regional::StoredSpec;
use region_store::{DeploymentReplicas, ObservedAccelerator};
use serde_json::Value;
use uuid::Uuid;

use super::{Reconciler, Result};
use crate::plan;
use crate::scaling;

impl Reconciler {
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
    /// with an event per scaling decision; nothing when nothing changed but memory without news
    /// (kept in the worker's [`scaling::Recall`] instead).
    pub(super) async fn record_replicas(
        &self,
        id: Uuid,
        scaled: &[scaling::Scaled],
        observed: &[Value],
        recorded: &[DeploymentReplicas],
    ) -> Result<()> {
        let recorded_memory = |model_id: Uuid| {
            recorded
                .iter()
                .find(|r| r.model_id == model_id)
                .and_then(|r| r.autoscaler.clone())
        };
        // `newest`: every memory as this pass leaves it; otherwise the recorded one where this
        // pass's has no news.
        let rows = |newest: bool| {
            let mut rows: Vec<DeploymentReplicas> = scaled
                .iter()
                .map(|x| DeploymentReplicas {
                    model_id: x.model_id,
                    ready: scaling::ready_servers(observed, &x.model_id).len() as u32,
                    wanted: x.wanted,
                    autoscaler: match &x.memory {
                        Some(m) if newest || x.memory_news => {
                            Some(serde_json::to_value(m).expect("memory serialises"))
                        }
                        Some(_) => recorded_memory(x.model_id),
                        None => None,
                    },
                })
                .collect();
            rows.sort_by_key(|r| r.model_id);
            rows
        };
        let events: Vec<(&str, String)> = scaled
            .iter()
            .filter_map(|x| {
                let d = x.decision.as_ref()?;
                tracing::info!(di = %id, model = %x.model_id, reason = d.reason, message = %d.message, "autoscaler");
                Some((d.reason, format!("model {}: {}", x.model_id, d.message)))
            })
            .collect();
        let kept = rows(false);
        let written = kept.as_slice() != recorded || !events.is_empty();
        let rows = if written { rows(true) } else { kept };
        if written {
            self.store.replicas_record(id, &rows, &events).await?;
        }
        for x in scaled {
            if let Some(memory) = &x.memory {
                let held = rows.iter().find(|r| r.model_id == x.model_id);
                let held = held.and_then(|r| r.autoscaler.clone());
                self.recall.keep(x.model_id, held, memory.clone());
            }
        }
        Ok(())
    }
}
