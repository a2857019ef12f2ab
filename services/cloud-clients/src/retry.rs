//! The retry policy both clients share: jittered exponential backoff on transient errors only,
//! bounded in attempts and in total time, and never sooner than a server's `Retry-After`.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use common::errors::Classify;

/// How a client retries transient failures (429, 5xx, connection errors, timeouts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// First backoff delay.
    pub min_delay: Duration,
    /// Largest backoff delay (before jitter).
    pub max_delay: Duration,
    /// Attempts in all, the first one included; 1 disables retries.
    pub max_attempts: usize,
    /// No retry starts once this much time has passed since the first attempt (or would pass
    /// during the wait before it); the last error is returned instead.
    pub max_elapsed: Duration,
    /// A `Retry-After` longer than this is not waited for: the error is returned (it is still
    /// transient, so the caller's next pass tries again).
    pub max_retry_after: Duration,
    /// Randomise each delay (recommended; many workers retrying in step is how outages last).
    pub jitter: bool,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(10),
            max_attempts: 6,
            max_elapsed: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(30),
            jitter: true,
        }
    }
}

impl RetryConfig {
    /// One attempt, no retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    fn backoff(&self) -> ExponentialBuilder {
        let b = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_max_times(self.max_attempts.saturating_sub(1))
            .with_total_delay(Some(self.max_elapsed));
        if self.jitter {
            b.with_jitter()
        } else {
            b
        }
    }
}

/// Runs `op` until it succeeds, fails other than transiently (by the error's class), or the
/// policy is exhausted.
pub(crate) async fn retry<T, E, F, Fut>(cfg: &RetryConfig, what: &str, op: F) -> Result<T, E>
where
    E: Classify + Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    op.retry(cfg.backoff())
        .when(|e: &E| e.class().is_transient())
        .adjust(|e: &E, next: Option<Duration>| {
            // `next` is None once the backoff is exhausted: stop then, whatever the server says.
            let mut wait = next?;
            if let Some(after) = e.class().retry_after() {
                if after > cfg.max_retry_after {
                    return None;
                }
                wait = wait.max(after);
            }
            if start.elapsed() + wait > cfg.max_elapsed {
                return None;
            }
            Some(wait)
        })
        .notify(|e: &E, wait: Duration| {
            tracing::debug!(operation = what, error = %e, wait_ms = wait.as_millis() as u64, "transient failure, retrying");
        })
        .await
}
