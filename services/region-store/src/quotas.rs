//! Quotas: what one team may hold in this region — dedicated inferences, GPUs of each size, GPUs
//! in all — and the check that keeps every create and patch within them.
//!
//! What a team holds: its DIs from their create until they are being deleted (a delete frees
//! the quota at once, though teardown takes minutes), and for each, per size, the more of what
//! its current and its pending spec ask (the old replicas serve until the new ones do). A
//! deployment holds `scale` replicas, or `autoscaling.max_replicas` when it autoscales (the most
//! the autoscaler may start, the rule of the worker's autoscale policy), of its size's GPUs per
//! node. Postgres keeps the team's figures as its DIs change (migration 0017's `di_holdings`
//! and its trigger), so a check costs the same for a team of one DI or of ten thousand.
//!
//! A create or patch reads what the team holds before its change and what its DI holds after
//! it, in its own transaction, under a per-team advisory lock that every create and patch of the
//! team takes first: two concurrent creates cannot both fit in the last free slot. A figure that
//! the change takes above its limit *and* raises refuses it (`Unprocessable`); so a limit lowered
//! below what a team holds leaves everything running and lets any change that does not grow that
//! figure through.

use std::collections::BTreeMap;

use api_types::public::{QuotaUse, RegionQuotas, SizeQuotaUse};
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::{Result, Store, StoreError};

/// The service's quota settings: the limits of every team without its own, and what a GPU
/// count needs from the catalog.
#[derive(Debug, Clone)]
pub struct Quotas {
    /// The region the store serves, for messages.
    pub region: String,
    pub dedicated_inferences: u32,
    pub gpus: u32,
    /// GPUs of each size, unless the team has a limit for that size.
    pub gpus_per_size: u32,
    /// GPUs on one node of each size (the catalog's `gpu.count`). A size not listed (no longer
    /// in the catalog) counts one per node.
    pub gpus_per_node: BTreeMap<String, u32>,
}

/// A team's own limits, where they differ from the service's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaOverrides {
    pub dedicated_inferences: Option<u32>,
    pub gpus: Option<u32>,
    /// Size slug → GPUs of that size.
    pub gpus_per_size: BTreeMap<String, u32>,
}

/// One limited figure.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Quota {
    DedicatedInferences,
    Gpus,
    SizeGpus(String),
}

/// What a team (or one DI of it) holds: its counting DIs, and replicas per size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Held {
    dedicated_inferences: u32,
    replicas: BTreeMap<String, i64>,
}

impl Held {
    /// From (size, replicas) rows, the DIs counted under the empty size.
    fn from_rows(rows: Vec<(String, i64)>) -> Held {
        let mut held = Held::default();
        for (size, n) in rows {
            if size.is_empty() {
                // Below zero only if the kept figures drifted: refuse rather than admit.
                held.dedicated_inferences = u32::try_from(n).unwrap_or(u32::MAX);
            } else if n != 0 {
                held.replicas.insert(size, n);
            }
        }
        held
    }

    /// This, with `old` (a part of it) replaced by `new`.
    fn replacing(&self, old: &Held, new: &Held) -> Held {
        let mut out = self.clone();
        out.dedicated_inferences =
            (out.dedicated_inferences + new.dedicated_inferences) - old.dedicated_inferences;
        for (size, n) in &old.replicas {
            *out.replicas.entry(size.clone()).or_default() -= n;
        }
        for (size, n) in &new.replicas {
            *out.replicas.entry(size.clone()).or_default() += n;
        }
        out.replicas.retain(|_, n| *n != 0);
        out
    }
}

impl Quotas {
    fn gpus_per_node(&self, size: &str) -> i64 {
        self.gpus_per_node.get(size).copied().unwrap_or(1).into()
    }

    fn limit(&self, overrides: &QuotaOverrides, quota: &Quota) -> u32 {
        match quota {
            Quota::DedicatedInferences => overrides
                .dedicated_inferences
                .unwrap_or(self.dedicated_inferences),
            Quota::Gpus => overrides.gpus.unwrap_or(self.gpus),
            Quota::SizeGpus(size) => overrides
                .gpus_per_size
                .get(size)
                .copied()
                .unwrap_or(self.gpus_per_size),
        }
    }

    fn used(&self, held: &Held, quota: &Quota) -> i64 {
        match quota {
            Quota::DedicatedInferences => held.dedicated_inferences.into(),
            Quota::Gpus => held
                .replicas
                .iter()
                .map(|(size, n)| n * self.gpus_per_node(size))
                .sum(),
            Quota::SizeGpus(size) => {
                held.replicas.get(size).copied().unwrap_or(0) * self.gpus_per_node(size)
            }
        }
    }

    /// Every figure of a team: DIs, GPUs in all, and GPUs of each size listed in
    /// `gpus_per_node` or held.
    fn report(&self, overrides: &QuotaOverrides, held: &Held) -> RegionQuotas {
        let figure = |quota: &Quota| QuotaUse {
            limit: self.limit(overrides, quota),
            used: u32::try_from(self.used(held, quota)).unwrap_or(u32::MAX),
        };
        let mut sizes: Vec<&String> = self.gpus_per_node.keys().collect();
        sizes.extend(held.replicas.keys());
        sizes.sort();
        sizes.dedup();
        RegionQuotas {
            region: self.region.clone(),
            dedicated_inferences: figure(&Quota::DedicatedInferences),
            gpus: figure(&Quota::Gpus),
            gpus_per_size: sizes
                .into_iter()
                .map(|size| {
                    let QuotaUse { limit, used } = figure(&Quota::SizeGpus(size.clone()));
                    SizeQuotaUse {
                        accelerator_slug: size.clone(),
                        limit,
                        used,
                    }
                })
                .collect(),
        }
    }

    /// Refuses a change that took the team from `before` to `after` when it raised a figure
    /// above its limit; the message names the limit, the use before and what would fit.
    pub(crate) fn check(
        &self,
        overrides: &QuotaOverrides,
        before: &Held,
        after: &Held,
    ) -> Result<()> {
        let sizes = after.replicas.keys().cloned().map(Quota::SizeGpus);
        for quota in [Quota::DedicatedInferences, Quota::Gpus]
            .into_iter()
            .chain(sizes)
        {
            let limit = i64::from(self.limit(overrides, &quota));
            let (was, would) = (self.used(before, &quota), self.used(after, &quota));
            if would > limit && would > was {
                return Err(StoreError::Unprocessable(self.refusal(
                    &quota,
                    limit,
                    was,
                    would - was,
                )));
            }
        }
        Ok(())
    }

    fn refusal(&self, quota: &Quota, limit: i64, held: i64, asked: i64) -> String {
        let region = &self.region;
        let fit = (limit - held).max(0);
        let counted =
            "a deployment counts scale, or workload_config.autoscaling.max_replicas when \
                       it autoscales, times its size's GPUs per node";
        match quota {
            Quota::DedicatedInferences => format!(
                "Quota exceeded for dedicated inferences in {region}: your team's limit is {limit} \
                 and it has {held} (those being deleted do not count), so {fit} more fit. Delete \
                 one, or ask for a higher limit."
            ),
            Quota::Gpus => format!(
                "Quota exceeded for GPUs in {region}, every size together: \
                 spec.model_deployments needs {asked} more, your team's limit is {limit} and it \
                 holds {held}, so {fit} more fit ({counted})."
            ),
            Quota::SizeGpus(size) => format!(
                "Quota exceeded for GPUs of size {size} in {region}: spec.model_deployments needs \
                 {asked} more, your team's limit is {limit} and it holds {held}, so {fit} more fit \
                 ({counted})."
            ),
        }
    }
}

impl Store {
    /// `team_id`'s limits here and what it holds against each: DIs, GPUs in all, and GPUs of
    /// each size in the settings' `gpus_per_node` or held.
    pub async fn quota_use(&self, team_id: Uuid) -> Result<RegionQuotas> {
        let quotas = self.quotas()?;
        let mut tx = self.pool.begin().await?;
        let overrides = overrides(&mut tx, team_id).await?;
        let held = team_held(&mut tx, team_id).await?;
        tx.commit().await?;
        Ok(quotas.report(&overrides, &held))
    }

    /// `team_id`'s own limits (for an operator; customers see [`Store::quota_use`]).
    pub async fn quota_overrides(&self, team_id: Uuid) -> Result<QuotaOverrides> {
        let mut tx = self.pool.begin().await?;
        let found = overrides(&mut tx, team_id).await?;
        tx.commit().await?;
        Ok(found)
    }

    /// Sets the limits `set` names for `team_id`, keeping its others. Nothing the team holds
    /// changes: a limit below its use only refuses what would raise that use.
    pub async fn quota_overrides_set(&self, team_id: Uuid, set: &QuotaOverrides) -> Result<()> {
        let count = |n: Option<u32>| n.map(|n| i32::try_from(n).unwrap_or(i32::MAX));
        sqlx::query(
            "INSERT INTO team_quotas (team_id, dedicated_inferences, gpus, gpus_per_size) VALUES ($1, $2, $3, $4)
             ON CONFLICT (team_id) DO UPDATE SET
                 dedicated_inferences = coalesce(excluded.dedicated_inferences, team_quotas.dedicated_inferences),
                 gpus = coalesce(excluded.gpus, team_quotas.gpus),
                 gpus_per_size = team_quotas.gpus_per_size || excluded.gpus_per_size,
                 updated_at = now()",
        )
        .bind(team_id)
        .bind(count(set.dedicated_inferences))
        .bind(count(set.gpus))
        .bind(sqlx::types::Json(&set.gpus_per_size))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Gives `team_id` the service's limits again.
    pub async fn quota_overrides_clear(&self, team_id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM team_quotas WHERE team_id = $1")
            .bind(team_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    fn quotas(&self) -> Result<&Quotas> {
        self.quotas.as_deref().ok_or_else(|| {
            StoreError::Unprocessable("this store was opened without quota settings".into())
        })
    }

    /// In the transaction of a create or patch of DI `id`, before its change: what DI `id`
    /// holds (`None` without quota settings: nothing is limited). No other transaction changes
    /// that figure meanwhile: a create's DI is its own until commit, a patch holds the DI's row.
    pub(crate) async fn quota_before(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        team_id: Uuid,
        id: Uuid,
    ) -> Result<Option<Held>> {
        if self.quotas.is_none() {
            return Ok(None);
        }
        Ok(Some(di_held(tx, team_id, id).await?))
    }

    /// After the change, as the transaction's last step before its outbox entry: takes the
    /// team's lock, which it holds until commit, so that the team's creates and patches are
    /// checked one at a time, each against what the others committed; counts what the team holds
    /// and refuses the change if it raised a figure above its limit. Taken this late, the lock
    /// covers a handful of statements rather than the whole create, so one team's concurrent
    /// creates queue for less. Only DI `id` changed under it (its holdings reach
    /// `team_holding_changes` at commit), so only it is counted again.
    pub(crate) async fn quota_check(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        team_id: Uuid,
        id: Uuid,
        before: Option<Held>,
    ) -> Result<()> {
        let (Some(quotas), Some(di)) = (&self.quotas, before) else {
            return Ok(());
        };
        lock_team(tx, team_id).await?;
        fold_changes(tx, team_id).await?;
        let team = team_held(tx, team_id).await?;
        let after = team.replacing(&di, &di_held(tx, team_id, id).await?);
        quotas.check(&overrides(tx, team_id).await?, &team, &after)
    }
}

/// Serialises the quota checks of `team_id`'s creates and patches until `tx` ends.
async fn lock_team(tx: &mut Transaction<'_, Postgres>, team_id: Uuid) -> Result<()> {
    // The two-key form keeps these locks apart from the outbox's single-key one.
    sqlx::query("SELECT pg_advisory_xact_lock(7416, hashtext($1::text))")
        .bind(team_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// What `team_id` holds, as `tx` sees it: its folded holdings and the changes since.
async fn team_held(tx: &mut Transaction<'_, Postgres>, team_id: Uuid) -> Result<Held> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT accelerator_slug, sum(held)::bigint FROM (
             SELECT accelerator_slug, held FROM team_holdings WHERE team_id = $1
             UNION ALL
             SELECT accelerator_slug, change FROM team_holding_changes WHERE team_id = $1) h
         GROUP BY accelerator_slug",
    )
    .bind(team_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(Held::from_rows(rows))
}

/// Folds `team_id`'s holding changes into its holdings, so that they stay a handful of rows.
async fn fold_changes(tx: &mut Transaction<'_, Postgres>, team_id: Uuid) -> Result<()> {
    sqlx::query(
        "WITH folded AS (
             DELETE FROM team_holding_changes WHERE team_id = $1
             RETURNING accelerator_slug, change)
         INSERT INTO team_holdings (team_id, accelerator_slug, held)
         SELECT $1, accelerator_slug, sum(change) FROM folded GROUP BY accelerator_slug
         ON CONFLICT (team_id, accelerator_slug) DO UPDATE SET held = team_holdings.held + excluded.held",
    )
    .bind(team_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What DI `id` of `team_id` holds, as `tx` sees it (nothing before its create).
async fn di_held(tx: &mut Transaction<'_, Postgres>, team_id: Uuid, id: Uuid) -> Result<Held> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT h.accelerator_slug, h.held FROM dedicated_inferences d,
             di_holdings(d.id, d.gone_at IS NULL AND d.status <> 'deleting',
                         d.current_version, d.pending_version) h
         WHERE d.id = $1 AND d.team_id = $2",
    )
    .bind(id)
    .bind(team_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(Held::from_rows(rows))
}

/// `team_id`'s own limits, as `tx` sees them.
async fn overrides(tx: &mut Transaction<'_, Postgres>, team_id: Uuid) -> Result<QuotaOverrides> {
    let row: Option<sqlx::types::Json<QuotaOverrides>> = sqlx::query_scalar(
        "SELECT json_build_object('dedicated_inferences', dedicated_inferences, 'gpus', gpus,
                                  'gpus_per_size', gpus_per_size)
         FROM team_quotas WHERE team_id = $1",
    )
    .bind(team_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(|r| r.0).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas() -> Quotas {
        Quotas {
            region: "atl1".into(),
            dedicated_inferences: 3,
            gpus: 16,
            gpus_per_size: 8,
            gpus_per_node: [("h1".to_string(), 1), ("h8".to_string(), 8)].into(),
        }
    }

    fn held(dis: u32, replicas: &[(&str, i64)]) -> Held {
        Held {
            dedicated_inferences: dis,
            replicas: replicas.iter().map(|(s, n)| (s.to_string(), *n)).collect(),
        }
    }

    #[test]
    fn a_change_is_refused_only_when_it_raises_a_figure_above_its_limit() {
        let q = quotas();
        let none = QuotaOverrides::default();
        // Within every limit.
        assert!(q
            .check(&none, &held(2, &[("h1", 4)]), &held(3, &[("h1", 8)]))
            .is_ok());
        // A fourth DI.
        let refused = q.check(&none, &held(3, &[]), &held(4, &[("h1", 1)]));
        assert!(matches!(&refused, Err(StoreError::Unprocessable(m))
            if m.contains("dedicated inferences in atl1: your team's limit is 3 and it has 3") && m.contains("0 more fit")));
        // GPUs in all, counted per node (one h8 node is eight GPUs).
        let before = held(1, &[("h1", 7), ("h8", 1)]);
        let refused = q.check(&none, &before, &held(1, &[("h1", 7), ("h8", 2)]));
        assert!(
            matches!(&refused, Err(StoreError::Unprocessable(m))
            if m.contains("GPUs in atl1, every size together: spec.model_deployments needs 8 more") && m.contains("limit is 16 and it holds 15, so 1 more fit")),
            "{refused:?}"
        );
        let refused = q.check(&none, &held(1, &[("h1", 7)]), &held(1, &[("h1", 9)]));
        assert!(matches!(&refused, Err(StoreError::Unprocessable(m))
            if m.contains("GPUs of size h1 in atl1: spec.model_deployments needs 2 more") && m.contains("limit is 8 and it holds 7, so 1 more fit")));
        // Over a lowered limit: what does not grow passes, what grows does not.
        let lowered = QuotaOverrides {
            dedicated_inferences: Some(1),
            gpus: None,
            gpus_per_size: [("h1".to_string(), 2)].into(),
        };
        let now = held(3, &[("h1", 6)]);
        assert!(q.check(&lowered, &now, &now).is_ok());
        assert!(q.check(&lowered, &now, &held(3, &[("h1", 4)])).is_ok());
        assert!(q.check(&lowered, &now, &held(3, &[("h1", 7)])).is_err());
        assert!(q.check(&lowered, &now, &held(4, &[("h1", 6)])).is_err());
    }

    #[test]
    fn a_report_lists_every_size_known_or_held() {
        let q = quotas();
        let overrides = QuotaOverrides {
            gpus: Some(40),
            ..QuotaOverrides::default()
        };
        let report = q.report(&overrides, &held(2, &[("h8", 2), ("old", 3)]));
        let figure = |limit, used| QuotaUse { limit, used };
        let size = |slug: &str, limit, used| SizeQuotaUse {
            accelerator_slug: slug.into(),
            limit,
            used,
        };
        assert_eq!(
            report,
            RegionQuotas {
                region: "atl1".into(),
                dedicated_inferences: figure(3, 2),
                gpus: figure(40, 19),
                gpus_per_size: vec![size("h1", 8, 0), size("h8", 8, 16), size("old", 8, 3)],
            }
        );
    }
}
