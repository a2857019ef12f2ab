//! Fleet rollouts: how a new rendering of the workers reaches DIs nobody changed, a few at a time.
//! A worker registers the rendering it starts with ([`Store::fleet_register`]); only the newest
//! rolls. A pass that would restart a DI's model servers for it asks for a slot
//! ([`Store::fleet_take`]): canaries first, then at most the budget at once, none while the
//! rollout is paused or halted. The slot ends done, or failed, which halts the rollout. The
//! workers decide what needs a slot and when a slot ends; the store only counts and serialises.

use serde_json::Value;
use uuid::Uuid;

use crate::{change, lock_live, Result, Store, StoreError};

/// What a rollout may have rolling at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetBudget {
    /// DIs rolling at once (at least 1).
    pub max_rolling: u32,
    /// DIs that must roll and serve, one batch at once, before any other DI starts.
    pub canaries: u32,
}

/// The state of a rollout, as the operator sets it or a failure leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutState {
    Rolling,
    Paused,
    Halted,
}

impl RolloutState {
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutState::Rolling => "rolling",
            RolloutState::Paused => "paused",
            RolloutState::Halted => "halted",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "rolling" => RolloutState::Rolling,
            "paused" => RolloutState::Paused,
            "halted" => RolloutState::Halted,
            other => {
                return Err(StoreError::Unprocessable(format!(
                    "unknown rollout state {other:?}"
                )))
            }
        })
    }
}

/// A DI's slot in a rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSlot {
    pub rendering: String,
    pub canary: bool,
    pub state: SlotState,
    /// The DI's Deployments as they were before the slot (what a failed slot goes back to).
    pub previous: Value,
    /// When the slot was taken, in milliseconds since the epoch (the database's clock).
    pub started_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Rolling,
    Done,
    Failed,
}

impl SlotState {
    pub(crate) fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "rolling" => SlotState::Rolling,
            "done" => SlotState::Done,
            "failed" => SlotState::Failed,
            other => {
                return Err(StoreError::Unprocessable(format!(
                    "unknown slot state {other:?}"
                )))
            }
        })
    }
}

/// The answer to [`Store::fleet_take`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// The DI may roll now.
    Granted { canary: bool },
    /// Not now: the DI keeps what it runs.
    Held(Held),
}

/// Why a DI is not rolled now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A newer rendering is registered: this worker's version is on its way out.
    Superseded,
    Paused,
    Halted {
        reason: String,
    },
    /// The canaries are rolling; the rest waits until they serve.
    CanariesFirst,
    /// The budget is in use.
    Budget,
}

/// A rollout and how far it came, for the operator's command and the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutProgress {
    pub rendering: String,
    pub state: RolloutState,
    pub reason: Option<String>,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub rolling: i64,
    pub done: i64,
    pub failed: i64,
}

/// Slots that hold budget: rolling, of a DI that is still rolled by its resyncs (a DI deleted,
/// or in `error`, whose passes no longer settle its slot, gives its place back).
const ROLLING_SLOT: &str = "s.state = 'rolling' AND EXISTS (SELECT 1 FROM dedicated_inferences d
     WHERE d.id = s.di_id AND d.gone_at IS NULL AND d.status IN ('active', 'updating'))";

impl Store {
    /// Registers `rendering` as a rollout, the newest, unless it was registered before (a worker
    /// of a version seen before does not become the newest by restarting: an operator who goes
    /// back to an older version promotes it with `regional fleet resume --rendering`).
    pub async fn fleet_register(&self, rendering: &str) -> Result<()> {
        sqlx::query("INSERT INTO fleet_rollouts (rendering) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(rendering)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// DI `di_id`'s slot, if it has one.
    pub async fn fleet_slot(&self, di_id: Uuid) -> Result<Option<FleetSlot>> {
        let mut conn = self.pool.acquire().await?;
        fleet_slot_on(&mut conn, di_id).await
    }

    /// A slot for DI `di_id` in the rollout of `rendering`, if the rollout is the newest, rolling,
    /// and has room: while fewer than `budget.canaries` DIs are done, only canaries roll (as many
    /// at once); then up to `budget.max_rolling`. A granted slot keeps `previous` and appends an
    /// event telling the customer why their model servers restart. Slot takes of a region are
    /// serialised on the rollout's row.
    pub async fn fleet_take(
        &self,
        di_id: Uuid,
        rendering: &str,
        budget: FleetBudget,
        previous: &Value,
    ) -> Result<Take> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, di_id, None).await?;
        self.fence(&mut tx, di_id).await?;
        let newest: Option<(String, String, Option<String>)> = sqlx::query_as(
            "SELECT rendering, state, reason FROM fleet_rollouts ORDER BY seq DESC LIMIT 1 FOR UPDATE",
        )
        .fetch_optional(&mut *tx)
        .await?;
        let held = |h| Ok(Take::Held(h));
        let Some((newest, state, reason)) = newest else {
            return held(Held::Superseded);
        };
        if newest != rendering {
            return held(Held::Superseded);
        }
        match RolloutState::parse(&state)? {
            RolloutState::Rolling => {}
            RolloutState::Paused => return held(Held::Paused),
            RolloutState::Halted => {
                return held(Held::Halted {
                    reason: reason.unwrap_or_default(),
                })
            }
        }
        // Slots of an older rendering still rolling count against the budget too: what the
        // budget bounds is pods restarting, whatever they restart to.
        let (rolling, done): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*) FILTER (WHERE {ROLLING_SLOT}),
                    count(*) FILTER (WHERE s.state = 'done' AND s.rendering = $1)
             FROM fleet_slots s WHERE s.di_id <> $2"
        ))
        .bind(rendering)
        .bind(di_id)
        .fetch_one(&mut *tx)
        .await?;
        let canaries = i64::from(budget.canaries);
        let canary = done < canaries;
        if canary && rolling >= canaries - done {
            return held(Held::CanariesFirst);
        }
        if rolling >= i64::from(budget.max_rolling.max(1)) {
            return held(Held::Budget);
        }
        sqlx::query(
            "INSERT INTO fleet_slots (di_id, rendering, canary, state, previous, started_at)
             VALUES ($1, $2, $3, 'rolling', $4, clock_timestamp())
             ON CONFLICT (di_id) DO UPDATE SET rendering = $2, canary = $3, state = 'rolling',
                 previous = $4, started_at = clock_timestamp(), finished_at = NULL",
        )
        .bind(di_id)
        .bind(rendering)
        .bind(canary)
        .bind(sqlx::types::Json(previous))
        .execute(&mut *tx)
        .await?;
        let message = format!(
            "This endpoint's pods are being replaced for a platform update{}: each model \
             server's replacement is ready before it goes.",
            if canary { " (an early group)" } else { "" }
        );
        change(
            &mut tx,
            di_id,
            row.status,
            "PlatformUpdate",
            &message,
            false,
        )
        .await?;
        tx.commit().await?;
        Ok(Take::Granted { canary })
    }

    /// DI `di_id` leaves the rollout: a customer's change took over (what it runs is what the
    /// customer's rollout verifies). Its place goes to the next DI.
    pub async fn fleet_release(&self, di_id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_live(&mut tx, di_id, None).await?;
        self.fence(&mut tx, di_id).await?;
        sqlx::query("DELETE FROM fleet_slots WHERE di_id = $1")
            .bind(di_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// DI `di_id` serves the rendering of its slot: its place goes to the next DI.
    pub async fn fleet_done(&self, di_id: Uuid, rendering: &str) -> Result<()> {
        self.fleet_end(di_id, rendering, None).await
    }

    /// DI `di_id` could not serve the rendering of its slot: the slot fails (the DI goes back to
    /// what it ran) and the rollout halts with `why`, so that no other DI takes it.
    pub async fn fleet_failed(&self, di_id: Uuid, rendering: &str, why: &str) -> Result<()> {
        self.fleet_end(di_id, rendering, Some(why)).await
    }

    /// Ends DI `di_id`'s rolling slot, done or failed (`failure`), with an event for the
    /// customer; a slot already ended stays as it ended.
    async fn fleet_end(&self, di_id: Uuid, rendering: &str, failure: Option<&str>) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, di_id, None).await?;
        self.fence(&mut tx, di_id).await?;
        let ended = sqlx::query(
            "UPDATE fleet_slots SET state = $3, finished_at = clock_timestamp()
             WHERE di_id = $1 AND rendering = $2 AND state = 'rolling'",
        )
        .bind(di_id)
        .bind(rendering)
        .bind(if failure.is_some() { "failed" } else { "done" })
        .execute(&mut *tx)
        .await?;
        if ended.rows_affected() == 0 {
            return Ok(());
        }
        let (reason, message) = match failure {
            None => (
                "PlatformUpdated",
                "The platform update is done: every model server runs it and serves.",
            ),
            Some(why) => {
                sqlx::query(
                    "UPDATE fleet_rollouts SET state = 'halted', reason = $2, updated_at = now()
                     WHERE rendering = $1 AND state <> 'halted'",
                )
                .bind(rendering)
                .bind(format!("DI {di_id} could not serve it: {why}"))
                .execute(&mut *tx)
                .await?;
                (
                    "PlatformUpdateFailed",
                    "The platform update did not serve; the model servers go back to what they \
                     ran before it.",
                )
            }
        };
        change(&mut tx, di_id, row.status, reason, message, false).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every rollout with its progress, newest first.
    pub async fn fleet_progress(&self) -> Result<Vec<RolloutProgress>> {
        #[allow(clippy::type_complexity)]
        let rows: Vec<(
            String,
            String,
            Option<String>,
            chrono::DateTime<chrono::Utc>,
            i64,
            i64,
            i64,
        )> = sqlx::query_as(&format!(
            "SELECT r.rendering, r.state, r.reason, r.started_at,
                        count(s.di_id) FILTER (WHERE {ROLLING_SLOT}),
                        count(s.di_id) FILTER (WHERE s.state = 'done'),
                        count(s.di_id) FILTER (WHERE s.state = 'failed')
                 FROM fleet_rollouts r LEFT JOIN fleet_slots s ON s.rendering = r.rendering
                 GROUP BY r.rendering ORDER BY r.seq DESC"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(
                |(rendering, state, reason, started_at, rolling, done, failed)| {
                    Ok(RolloutProgress {
                        rendering,
                        state: RolloutState::parse(&state)?,
                        reason,
                        started_at,
                        rolling,
                        done,
                        failed,
                    })
                },
            )
            .collect()
    }

    /// The operator's command: pauses the newest rollout (slots rolling finish; no new one is
    /// given; a halted one stays halted, with its reason), or resumes it. Resuming a halted rollout clears its failed slots, so that their
    /// DIs try again. With `rendering`, resuming also makes that rollout the newest (going back
    /// to a version seen before). Returns the rollout changed.
    pub async fn fleet_set(
        &self,
        state: RolloutState,
        rendering: Option<&str>,
    ) -> Result<RolloutProgress> {
        let mut tx = self.pool.begin().await?;
        // Against `fleet_take`, which locks the newest row: none may grant a slot in a rollout
        // this makes older.
        sqlx::query("LOCK TABLE fleet_rollouts IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await?;
        let target: Option<String> = match rendering {
            Some(r) if state == RolloutState::Rolling => sqlx::query_scalar(
                "UPDATE fleet_rollouts SET seq = nextval(pg_get_serial_sequence('fleet_rollouts', 'seq'))
                 WHERE rendering = $1 RETURNING rendering",
            )
            .bind(r)
            .fetch_optional(&mut *tx)
            .await?,
            Some(r) => sqlx::query_scalar("SELECT rendering FROM fleet_rollouts WHERE rendering = $1")
                .bind(r)
                .fetch_optional(&mut *tx)
                .await?,
            None => sqlx::query_scalar(
                "SELECT rendering FROM fleet_rollouts ORDER BY seq DESC LIMIT 1",
            )
            .fetch_optional(&mut *tx)
            .await?,
        };
        let target = target.ok_or(StoreError::NotFound)?;
        sqlx::query(
            "UPDATE fleet_rollouts SET state = $2,
                 reason = CASE WHEN $2 = 'rolling' THEN NULL ELSE reason END, updated_at = now()
             WHERE rendering = $1 AND NOT ($2 = 'paused' AND state = 'halted')",
        )
        .bind(&target)
        .bind(state.as_str())
        .execute(&mut *tx)
        .await?;
        if state == RolloutState::Rolling {
            sqlx::query("DELETE FROM fleet_slots WHERE rendering = $1 AND state = 'failed'")
                .bind(&target)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        self.fleet_progress()
            .await?
            .into_iter()
            .find(|p| p.rendering == target)
            .ok_or(StoreError::NotFound)
    }
}

pub(crate) async fn fleet_slot_on(
    conn: &mut sqlx::PgConnection,
    di_id: Uuid,
) -> Result<Option<FleetSlot>> {
    let row: Option<(String, bool, String, sqlx::types::Json<Value>, i64)> = sqlx::query_as(
        "SELECT rendering, canary, state, previous,
                (extract(epoch FROM started_at) * 1000)::bigint
         FROM fleet_slots WHERE di_id = $1",
    )
    .bind(di_id)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|(rendering, canary, state, previous, started_ms)| {
        Ok(FleetSlot {
            rendering,
            canary,
            state: SlotState::parse(&state)?,
            previous: previous.0,
            started_ms,
        })
    })
    .transpose()
}
