//! The worker's view of the work queue in the regional store: claiming DIs under a lease,
//! keeping the lease alive while a pass runs, giving it back with the time of the next look,
//! and waking up when a customer changes a DI (`LISTEN di_work`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use region_store::{Claim, HolderSession, Store};
use sqlx::postgres::PgListener;
use sqlx::Connection;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use uuid::Uuid;

use crate::metrics;

/// How often a worker says it still works (see [`region_store::WORKER_SILENT`]).
const HEARTBEAT: Duration = Duration::from_secs(3);
const _: () = assert!(HEARTBEAT.as_secs() * 4 <= region_store::WORKER_SILENT.as_secs());

/// The channel the outbox trigger notifies on every committed change a customer asked for.
pub const CHANNEL: &str = "di_work";

/// Claims, renews and releases leases for one worker.
#[derive(Clone)]
pub struct Queue {
    store: Store,
    worker_id: String,
    lease: Duration,
    /// The database session that stands for this worker while it lives (see [`keep_session`]):
    /// leases claimed in its name are free as soon as it ends.
    session: Arc<Mutex<Option<HolderSession>>>,
}

impl Queue {
    pub fn new(store: Store, worker_id: &str, lease: Duration) -> Self {
        Queue {
            store,
            worker_id: worker_id.to_string(),
            lease,
            session: Arc::new(Mutex::new(None)),
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
        let session = *self.session.lock().expect("session");
        let claims = self
            .store
            .work_claim_in_session(&self.worker_id, session, self.lease, limit as i64)
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

    /// Renews `claim` every quarter of the lease until the returned guard is dropped; `lost`
    /// is notified, and the renewals stop, as soon as the lease may no longer be this
    /// worker's: a renewal that the database refuses (another worker holds the DI) or that
    /// fails, or one that has not succeeded by the time the lease could have run out. The pass
    /// must then stop: its store writes would be refused anyway (they are fenced by the lease),
    /// but its calls to the cloud would not.
    pub fn keep_alive(&self, claim: Claim, lost: Arc<Notify>) -> KeepAlive {
        let queue = self.clone();
        let lease = self.lease;
        let every = (lease / 4).max(Duration::from_millis(50));
        // The database starts a lease no earlier than the request that took or renewed it was
        // sent. A quarter of it is kept as a margin: the pass must also notice and stop.
        let valid_for = lease - lease / 4;
        let task = tokio::spawn(async move {
            let mut valid_until = Instant::from_std(claim.claimed_at) + valid_for;
            loop {
                tokio::time::sleep(every).await;
                let sent = Instant::now();
                let why = match tokio::time::timeout_at(valid_until, queue.renew(&claim)).await {
                    Ok(Ok(true)) => {
                        valid_until = sent + valid_for;
                        continue;
                    }
                    Ok(Ok(false)) => "another worker holds it".to_string(),
                    Ok(Err(e)) => format!("its renewal failed: {e}"),
                    Err(_) => "it could not be renewed before it ran out".to_string(),
                };
                tracing::warn!(di = %claim.di_id, reason = %why, "lease lost; the pass stops");
                lost.notify_one();
                return;
            }
        });
        KeepAlive { task }
    }

    /// Keeps a database session of this worker's own open until `stop` turns true, registers
    /// the worker under it and says every [`HEARTBEAT`] that it still works (the others then
    /// leave it its share of the clusters, see `Store::work_claim`), and claims in its name
    /// while it is open (see [`Queue::claim`]): when the worker dies, the session
    /// ends with its connections and other workers take its DIs at once, whatever time their
    /// leases have left. Checked every few seconds; a session that fails is opened again (the
    /// leases claimed in the old one's name are then free to others, and the passes holding
    /// them stop at their next renewal, which the database refuses). A check that merely takes
    /// long (a stalled database) keeps the session: closing it would free this worker's leases
    /// under passes that are still running. Needs a direct connection to Postgres (or session
    /// pooling): a transaction pooler shares server sessions between clients.
    pub async fn keep_session(
        &self,
        database_url: String,
        mut draining: watch::Receiver<bool>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            if *stop.borrow() {
                return;
            }
            let opened = async {
                let mut conn = sqlx::PgConnection::connect(&database_url).await?;
                let session = HolderSession::of(&mut conn).await?;
                // Known to the others from now on: they leave this worker its share of the
                // clusters (see `Store::work_claim`).
                let registered = !*draining.borrow();
                if registered {
                    region_store::worker_register(&mut conn, &self.worker_id, session).await?;
                }
                Ok::<_, region_store::StoreError>((conn, session, registered))
            }
            .await;
            match opened {
                Ok((mut conn, session, registered)) => {
                    *self.session.lock().expect("session") = Some(session);
                    tracing::debug!(pid = session.pid, "worker session open");
                    self.hold_session(&mut conn, session, registered, &mut draining, &mut stop)
                        .await;
                    if *stop.borrow() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "opening the worker's database session failed")
                }
            }
            *self.session.lock().expect("session") = None;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// Says every [`HEARTBEAT`] over `conn`, the session's own connection, that this worker
    /// still works, until `stop` or until the session is lost (returns then). Once `draining`
    /// (the worker stops claiming and lets its passes finish), the registration is withdrawn
    /// and the session only kept: the others take this worker's share at once, its leases
    /// stay its own. Only a session that no longer answers is given up: a statement that fails
    /// on a session that still answers (a database refusing writes) keeps it and its leases.
    async fn hold_session(
        &self,
        conn: &mut sqlx::PgConnection,
        session: HolderSession,
        mut registered: bool,
        draining: &mut watch::Receiver<bool>,
        stop: &mut watch::Receiver<bool>,
    ) {
        // `registered`: whether the others may count this worker in, from its registration as
        // the session opened until its withdrawal has gone through (retried until it has).
        let mut stopping = *draining.borrow();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(HEARTBEAT) => {}
                _ = stop.changed() => return,
                // A claim loop whose stop was dropped is stopping too.
                changed = draining.changed(), if !stopping => {
                    stopping = changed.is_err() || *draining.borrow();
                }
            }
            let said = if !stopping {
                region_store::worker_heartbeat(conn, &self.worker_id, session).await
            } else if registered {
                region_store::worker_deregister(conn, &self.worker_id, session)
                    .await
                    .map(|()| {
                        registered = false;
                        true
                    })
            } else {
                // Withdrawn: the session stays for the leases, as long as it answers.
                conn.ping().await.map(|()| true).map_err(Into::into)
            };
            match said {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!("the worker's registration was gone; registering again");
                    if let Err(e) =
                        region_store::worker_register(conn, &self.worker_id, session).await
                    {
                        tracing::warn!(error = %e, "registering the worker failed");
                    }
                }
                Err(e) => {
                    if let Err(lost) = conn.ping().await {
                        tracing::warn!(error = %lost, "the worker's database session was lost; opening another");
                        return;
                    }
                    tracing::warn!(error = %e, "the worker's heartbeat failed; trying again");
                }
            }
        }
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
