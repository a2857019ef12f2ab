//! The workers' registrations: each worker's database session, which stands for it while it
//! lives (leases taken in its name are free once it ends), and its heartbeat, which says it
//! still works; the queue shares the clusters among the workers that live.

use std::time::Duration;

use sqlx::postgres::PgConnection;

use crate::Result;

/// The database session a worker keeps open for as long as it lives: leases taken in its name
/// are free as soon as it ends (see [`Store::work_claim_in_session`]).
///
/// [`Store::work_claim_in_session`]: crate::Store::work_claim_in_session
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderSession {
    pub pid: i32,
    pub started: chrono::DateTime<chrono::Utc>,
}

impl HolderSession {
    /// The session of `conn`, which its owner keeps open (and idle) to stand for it.
    pub async fn of(conn: &mut PgConnection) -> Result<HolderSession> {
        let (pid, started): (i32, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await?;
        Ok(HolderSession { pid, started })
    }
}

/// Registers worker `worker_id` as living while `session` does, over that session's own
/// connection `conn` (see [`Store::work_claim`]: a worker claims only the DIs of its share of
/// the clusters), and forgets the workers that are gone.
///
/// [`Store::work_claim`]: crate::Store::work_claim
pub async fn worker_register(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<()> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    sqlx::query(&format!("DELETE FROM workers k WHERE NOT {WORKER_LIVES}"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO workers (worker_id, pid, session_start) VALUES ($1, $2, $3)
         ON CONFLICT (worker_id) DO UPDATE SET pid = $2, session_start = $3, seen_at = now()",
    )
    .bind(worker_id)
    .bind(session.pid)
    .bind(session.started)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Says over `conn` (the session's own connection: a pool busy with passes must not make a
/// working worker look silent) that worker `worker_id`, registered with `session`, still works
/// (see [`WORKER_SILENT`]). False when its registration is gone or another session's (a worker
/// of the same name registered since): it must register again.
pub async fn worker_heartbeat(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE workers SET seen_at = now()
         WHERE worker_id = $1 AND pid = $2 AND session_start = $3",
    )
    .bind(worker_id)
    .bind(session.pid)
    .bind(session.started)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Withdraws worker `worker_id`'s registration under `session` as it begins to stop: the others
/// take its share at their next claim, while its session (and with it the leases of the passes
/// it lets finish) lives on.
pub async fn worker_deregister(
    conn: &mut PgConnection,
    worker_id: &str,
    session: HolderSession,
) -> Result<()> {
    sqlx::query("DELETE FROM workers WHERE worker_id = $1 AND pid = $2 AND session_start = $3")
        .bind(worker_id)
        .bind(session.pid)
        .bind(session.started)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A registered worker that has not said it works for this long counts as gone: its share of
/// the clusters goes to the others, though its session lives (a process that hangs keeps its
/// connections open). Several of its heartbeats (every 3 s), and well under a lease.
pub const WORKER_SILENT: Duration = Duration::from_secs(20);

/// Whether registered worker `k` lives: its session is open and it said it works within
/// [`WORKER_SILENT`] (20 s).
pub(super) const WORKER_LIVES: &str = "(k.seen_at > now() - interval '20 seconds' AND EXISTS (
        SELECT 1 FROM pg_stat_get_activity(k.pid) a
        WHERE a.backend_start IS NULL OR a.backend_start = k.session_start))";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_counts_as_gone_after_the_silence_its_constant_says() {
        let said = format!("interval '{} seconds'", WORKER_SILENT.as_secs());
        assert!(WORKER_LIVES.contains(&said), "{WORKER_LIVES}");
    }
}
