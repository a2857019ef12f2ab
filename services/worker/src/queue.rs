//! The worker's view of the work queue in the regional store: claiming DIs under a lease,
//! keeping the lease alive while a pass runs, giving it back with the time of the next look,
//! and waking up when a customer changes a DI (`LISTEN di_work`).

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use region_store::{Claim, Store};
use sqlx::postgres::PgListener;
use tokio::sync::{watch, Notify};
use uuid::Uuid;

use crate::metrics;

/// The channel the outbox trigger notifies on every committed change a customer asked for.
pub const CHANNEL: &str = "di_work";

/// Claims, renews and releases leases for one worker.
#[derive(Clone)]
pub struct Queue {
    store: Store,
    worker_id: String,
    lease: Duration,
}

impl Queue {
    pub fn new(store: Store, worker_id: &str, lease: Duration) -> Self {
        Queue {
            store,
            worker_id: worker_id.to_string(),
            lease,
        }
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Claims up to `limit` due DIs; counts those taken over from an expired lease.
    pub async fn claim(&self, limit: usize) -> region_store::Result<Vec<Claim>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let claims = self
            .store
            .work_claim(&self.worker_id, self.lease, limit as i64)
            .await?;
        let expired = claims.iter().filter(|c| c.lease_expired).count();
        if expired > 0 {
            tracing::info!(count = expired, "took over DIs whose lease had expired");
            metrics::lease_expiries(expired);
        }
        Ok(claims)
    }

    pub async fn renew(&self, claim: &Claim) -> region_store::Result<bool> {
        self.store
            .work_renew(claim.di_id, claim.lease_token, self.lease)
            .await
    }

    pub async fn release(&self, claim: &Claim, next_check: Duration) -> region_store::Result<bool> {
        self.store
            .work_release(claim.di_id, claim.lease_token, claim.seq, next_check)
            .await
    }

    /// As [`Queue::release`] after a transient failure: tried again after `next_check`,
    /// whatever the DI's status.
    pub async fn release_to_retry(
        &self,
        claim: &Claim,
        next_check: Duration,
    ) -> region_store::Result<bool> {
        self.store
            .work_release_to_retry(claim.di_id, claim.lease_token, claim.seq, next_check)
            .await
    }

    /// Renews `claim` every third of the lease until the returned guard is dropped; `lost` is
    /// notified if the lease could not be renewed (another worker may now hold the DI, so the
    /// pass must stop).
    pub fn keep_alive(&self, claim: Claim, lost: Arc<Notify>) -> KeepAlive {
        let queue = self.clone();
        let every = (self.lease / 3).max(Duration::from_millis(50));
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match queue.renew(&claim).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(di = %claim.di_id, "lease lost");
                        lost.notify_one();
                        return;
                    }
                    // A database hiccup: try again at the next tick, the lease has slack.
                    Err(e) => tracing::warn!(di = %claim.di_id, error = %e, "lease renewal failed"),
                }
            }
        });
        KeepAlive { task }
    }
}

/// Stops renewing a lease when dropped.
pub struct KeepAlive {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Jittered exponential backoff for the `attempt`-th consecutive transient failure (1-based):
/// `base * 2^(attempt-1)`, capped at `max`, times a random factor in [0.5, 1.5).
pub fn backoff(attempt: u32, base: Duration, max: Duration) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let capped = exp.min(max);
    capped.mul_f64(rand::thread_rng().gen_range(0.5..1.5))
}

/// Listens on [`CHANNEL`] and notifies `wake` on every change, reconnecting after errors, until
/// `stop` turns true.
pub async fn listen(pool: sqlx::PgPool, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    loop {
        if *stop.borrow() {
            return;
        }
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        // Changes may have happened while we were not listening.
        wake.notify_one();
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => {
                        tracing::trace!(di = %n.payload().parse::<Uuid>().unwrap_or_default(), "change");
                        wake.notify_one();
                    }
                    // The connection dropped (sqlx reconnects on the next recv); catch up.
                    Ok(None) => wake.notify_one(),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                        break;
                    }
                },
                _ = stop.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(5);
        for _ in 0..50 {
            let d1 = backoff(1, base, max);
            assert!(d1 >= Duration::from_millis(50) && d1 < Duration::from_millis(150));
            let d4 = backoff(4, base, max);
            assert!(d4 >= Duration::from_millis(400) && d4 < Duration::from_millis(1200));
            let d30 = backoff(30, base, max);
            assert!(d30 < Duration::from_millis(7500));
        }
    }
}
