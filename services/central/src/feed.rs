//! Background work of every central replica:
//! - one change-feed consumer per region, long-polling the region's outbox and merging each DI's
//!   latest state into the read model (so reads and lists survive a region outage);
//! - create recovery, which re-drives creates that central accepted into `pending_creates` but
//!   could not settle (central crashed, or the region timed out): the region's create is idempotent
//!   on the DI id, so re-driving can only finish what was started, never duplicate it;
//! - purging idempotency records older than 24 hours.
//!
//! Several replicas may run these at once: every step is idempotent and ordered by outbox `seq`.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::App;

pub const RECOVERY_AGE: Duration = Duration::from_secs(3);
const IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);

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
                if failures == 1 || failures % 30 == 0 {
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
            tracing::warn!(%error, "create recovery pass failed");
        }
        if purged_at.elapsed() > Duration::from_secs(600) {
            purged_at = tokio::time::Instant::now();
            if let Err(error) = app.store.idempotency_purge(IDEMPOTENCY_TTL).await {
                tracing::warn!(%error, "idempotency purge failed");
            }
        }
    }
}

/// Re-drives every pending create older than `RECOVERY_AGE`; returns how many settled.
pub async fn recover_once(app: &App) -> anyhow::Result<usize> {
    let mut settled = 0;
    for di_id in app.store.pending_creates_older_than(RECOVERY_AGE).await? {
        let Some(team_id) = app.store.pending_create_team(di_id).await? else {
            continue;
        };
        match app.drive_create(di_id, team_id).await {
            Ok(_) => settled += 1,
            Err(error) => tracing::info!(%di_id, %error, "pending create not settled yet"),
        }
    }
    Ok(settled)
}
