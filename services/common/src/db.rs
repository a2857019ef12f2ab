//! What the stores and services share about Postgres: which errors mean "the database is
//! unavailable for now" (decided here once, so that every store classes them alike and every
//! service answers them with `503` and `Retry-After`), how a service's connection pool is set
//! up so that it recovers by itself from a restart or failover, and how migrations are applied
//! so that two versions can run on one database.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

/// Whether `e` says the database is unavailable for now rather than that the statement is wrong:
/// the connection is gone or cannot be made (a restart, a failover, a network cut), the pool
/// waited in vain for one, the server is out of resources, or it asked for the transaction to be
/// retried (serialization failure, deadlock). The same request may succeed later.
pub fn unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| retryable_sqlstate(&code)),
        _ => false,
    }
}

/// `e` as the caller's error: `unavailable` when [`unavailable`] says so, else `other`. The
/// stores' one place to class a driver error.
pub fn classify<E>(
    e: sqlx::Error,
    unavailable: impl FnOnce(sqlx::Error) -> E,
    other: impl FnOnce(sqlx::Error) -> E,
) -> E {
    if self::unavailable(&e) {
        unavailable(e)
    } else {
        other(e)
    }
}

/// SQLSTATEs (Postgres appendix A) after which the same statement may succeed later.
fn retryable_sqlstate(code: &str) -> bool {
    // 08: connection exception; 53: insufficient resources (too many connections, disk full,
    // out of memory); 57P01/57P02/57P03: admin shutdown, crash shutdown, cannot connect now
    // (starting up or shutting down); 40001/40P01: serialization failure, deadlock detected;
    // 25006: read-only transaction (a connection that reached a standby, as during a failover,
    // before the pool reaches the new primary).
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "40001" | "40P01" | "25006"
        )
}

/// A connection idle for longer than this is pinged before it is handed out.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(1);

/// Pool options for a service: up to `max_connections`, waiting up to `acquire_timeout` for one
/// (then `PoolTimedOut`). Connections are not pinged before every checkout (that doubles the
/// round trips of a one-query request), except those idle for more than a second. A server
/// restart kills every pooled connection; the busy ones fail their next statement at once (the
/// pool drops them on release), and the idle ones would otherwise fail whenever they are next
/// used, long after the restart: pinging them first means a dead connection is replaced, not
/// answered with a `503`.
pub fn pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for < IDLE_CHECK_AFTER {
                    return Ok(true);
                }
                use sqlx::Connection;
                Ok(conn.ping().await.is_ok())
            })
        })
}

/// Applies the migrations `migrator` knows. A database that a newer version migrated further is
/// accepted, where sqlx refuses by default: every migration keeps the previous version working
/// (they add, and drop only what no released version reads), and a replica of the previous
/// version that restarts during a rolling upgrade, or a rollback, must start on it. The
/// migrations this version knows are still checked against their checksums.
pub async fn migrate(
    migrator: &'static sqlx::migrate::Migrator,
    pool: &sqlx::PgPool,
) -> Result<(), sqlx::migrate::MigrateError> {
    let tolerant = sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Borrowed(&migrator.migrations),
        ignore_missing: true,
        ..sqlx::migrate::Migrator::DEFAULT
    };
    tolerant.run(pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_unavailable_mistakes_are_not() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(unavailable(&io));
        assert!(unavailable(&sqlx::Error::PoolTimedOut));
        assert!(unavailable(&sqlx::Error::PoolClosed));
        assert!(!unavailable(&sqlx::Error::RowNotFound));
        assert!(!unavailable(&sqlx::Error::ColumnNotFound("x".into())));
        for code in [
            "08006", "08001", "57P01", "57P02", "57P03", "53300", "40001", "40P01", "25006",
        ] {
            assert!(retryable_sqlstate(code), "{code}");
        }
        // Unique violation, syntax error, undefined table, query canceled: the request's own.
        for code in ["23505", "42601", "42P01", "57014"] {
            assert!(!retryable_sqlstate(code), "{code}");
        }
    }
}
