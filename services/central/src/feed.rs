//! Background work of every central replica:
//! - one change-feed consumer per region, long-polling the region's outbox and merging each DI's
//!   latest state into the read model (so reads and lists survive a region outage);
//! - recovery, which re-drives creates that central accepted into `pending_creates` but could not
//!   settle, and keyed operations whose key has no response yet (central crashed, or the region
//!   timed out): the region applies a create once per DI id and an operation once per operation
//!   id, so re-driving can only finish what was started, never duplicate it. A permanent failure
//!   settles the create or releases the key at once; transient ones are tried again with a
//!   backoff per create or operation;
//! - purging idempotency records and replayable create responses older than 24 hours.
//!
//! Several replicas may run these at once: every step is idempotent and ordered by outbox `seq`.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::app::REPLAY_WINDOW;
use crate::App;

pub const RECOVERY_AGE: Duration = Duration::from_secs(3);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

pub fn spawn(app: App) -> Vec<JoinHandle<()>> {
    let mut tasks: Vec<JoinHandle<()>> = app
        .regions
        .names()
        .into_iter()
        .map(|region| tokio::spawn(consume(app.clone(), region)))
        .collect();
    tasks.push(tokio::spawn(recover(app)));
    tasks
}

async fn consume(app: App, region: String) {
    let mut failures = 0u32;
    loop {
        match consume_once(&app, &region, Duration::from_secs(20)).await {
            Ok(()) => failures = 0,
            Err(error) => {
                failures = failures.saturating_add(1);
                if failures == 1 || failures.is_multiple_of(30) {
                    tracing::warn!(%region, %error, "change feed unavailable; reads keep serving the last known state");
                }
                let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

/// One long poll (up to `wait`) and its merge. Public for tests that want the read model caught up now.
pub async fn consume_once(app: &App, region: &str, wait: Duration) -> anyhow::Result<()> {
    let after = app.store.cursor(region).await?;
    let changes = app
        .regions
        .changes(region, after, wait)
        .await
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for record in &changes.records {
        app.apply(record)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    if changes.last_seq > after {
        app.store.cursor_set(region, changes.last_seq).await?;
    }
    Ok(())
}

async fn recover(app: App) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut purged_at = tokio::time::Instant::now() - Duration::from_secs(3600);
    loop {
        tick.tick().await;
        if let Err(error) = recover_once(&app).await {
            tracing::warn!(%error, "recovery pass failed");
        }
        if purged_at.elapsed() > Duration::from_secs(600) {
            purged_at = tokio::time::Instant::now();
            if let Err(error) = app.store.idempotency_purge(REPLAY_WINDOW).await {
                tracing::warn!(%error, "idempotency purge failed");
            }
        }
    }
}

/// Re-drives every pending create and unfinished keyed operation older than `RECOVERY_AGE` whose
/// next attempt is due; returns how many completed.
pub async fn recover_once(app: &App) -> anyhow::Result<usize> {
    let mut completed = 0;
    // A create that could not be settled for as long as its retries are answered (the region
    // down, or failing it, for a day) is settled as failed: no background loop retries for ever.
    // Should the region have it after all, its change feed brings it into the read model.
    for di_id in app.store.pending_creates_older_than(REPLAY_WINDOW).await? {
        tracing::warn!(%di_id, "giving up a create that could not be settled within the replay window");
        app.store.create_abort(di_id).await?;
    }
    for due in app.store.pending_creates_due(RECOVERY_AGE).await? {
        let busy = || crate::error::ApiError::ServiceUnavailable {
            retry_after_secs: 1,
        };
        // Recovery does not wait for a create a request is sending: it comes back to it.
        match app
            .drive_create(due.di_id, due.team_id, Duration::ZERO, busy)
            .await
        {
            Ok(_) => completed += 1,
            Err(error) => {
                // A permanent failure settled the create already; this only delays one still pending.
                tracing::info!(di_id = %due.di_id, %error, attempts = due.attempts, "pending create not settled yet");
                app.store
                    .create_retry_later(due.di_id, backoff(due.attempts))
                    .await?;
            }
        }
    }
    for due in app.store.unfinished_operations_due(RECOVERY_AGE).await? {
        match app
            .drive_operation(due.team_id, &due.key, &due.sealed_operation)
            .await
        {
            Ok(_) => completed += 1,
            Err(error) => {
                // A permanent failure released the key already; this only delays one still unfinished.
                tracing::info!(team_id = %due.team_id, %error, attempts = due.attempts, "keyed operation not finished yet");
                app.store
                    .operation_retry_later(due.team_id, &due.key, backoff(due.attempts))
                    .await?;
            }
        }
    }
    Ok(completed)
}

/// How long recovery waits after `attempts` failed tries before the next: one second, doubling
/// up to five minutes, so that a region down for long is asked rarely, not every second.
fn backoff(attempts: i32) -> Duration {
    Duration::from_secs(1 << attempts.clamp(0, 16)).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        let waits: Vec<u64> = [0, 1, 2, 8, 9, 1000].map(|n| backoff(n).as_secs()).to_vec();
        assert_eq!(waits, vec![1, 2, 4, 256, 300, 300]);
    }
}
