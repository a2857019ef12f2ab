//! What the project's tests share for waiting: a condition looked at until it holds, with a
//! limit that fails the test loudly. Tests wait for what they expect to happen (a status, an
//! event, a count), never for a length of time that is supposed to be enough; this crate is
//! the one place such a wait meets the clock.

use std::fmt::Display;
use std::time::Duration;

use tokio::time::Instant;

/// How soon a condition is looked at again: the one wait such tests need. On tokio's clock, so
/// a test on a paused clock waits in virtual time; otherwise real time, because what the
/// condition looks at moves in Postgres, in another task's sockets or in another process.
pub const POLL: Duration = Duration::from_millis(25);

/// `check`'s first `Some`, looked at every [`POLL`]; `None` once `limit` has passed without
/// one (for callers that explain a timeout in their own words).
pub async fn within<T>(limit: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = check().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `check`'s first `Some`; the test fails, naming `what`, when `limit` passes without one.
pub async fn eventually<T>(
    limit: Duration,
    what: impl Display,
    check: impl AsyncFnMut() -> Option<T>,
) -> T {
    match within(limit, check).await {
        Some(found) => found,
        None => panic!("not within {limit:?}: {what}"),
    }
}

/// Waits until `holds` turns true, then returns; the test fails, naming `what`, at `limit`.
pub async fn until(limit: Duration, what: impl Display, mut holds: impl AsyncFnMut() -> bool) {
    eventually(limit, what, async || holds().await.then_some(())).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn a_condition_is_looked_at_until_it_holds() {
        let looks = AtomicU32::new(0);
        let found = eventually(Duration::from_secs(5), "the third look", || {
            let n = looks.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (n == 3).then_some(n) }
        })
        .await;
        assert_eq!(found, 3);
    }

    #[tokio::test]
    async fn a_condition_that_never_holds_gives_up_at_its_limit() {
        let started = Instant::now();
        let found: Option<()> = within(Duration::from_millis(100), || async { None }).await;
        assert!(found.is_none());
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    #[should_panic(expected = "not within")]
    async fn eventually_fails_the_test_at_its_limit() {
        until(Duration::from_millis(50), "never", || async { false }).await;
    }
}
