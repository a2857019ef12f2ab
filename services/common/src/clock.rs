//! The clock that time-dependent code reads, taken from outside rather than from the system
//! directly: in production it is the system's clock; a test that shares one clock between the
//! components it starts in one process moves them all forward at once with
//! [`Clock::advance`], so that a credential lifetime of minutes passes in no time. Only what
//! an in-process test needs to move reads it (credential lifetimes in the region simulator and
//! in the worker's cluster clients); what Postgres decides by its own `now()` does not.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// A clock: the system's, plus however far it was advanced (never, outside tests). Copies
/// share their advance.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    /// Nanoseconds this clock runs ahead of the system's.
    ahead: Arc<AtomicU64>,
}

impl Clock {
    /// The system's clock.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// Wall-clock time.
    pub fn now(&self) -> SystemTime {
        SystemTime::now() + self.ahead()
    }

    /// Monotonic time, for deadlines.
    pub fn instant(&self) -> Instant {
        Instant::now() + self.ahead()
    }

    /// Moves this clock and every copy of it forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.ahead.fetch_add(nanos, Ordering::SeqCst);
    }

    fn ahead(&self) -> Duration {
        Duration::from_nanos(self.ahead.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_advance_together_and_the_system_clock_does_not_move() {
        let clock = Clock::system();
        let copy = clock.clone();
        let before = copy.instant();
        clock.advance(Duration::from_secs(3600));
        assert!(copy.instant() >= before + Duration::from_secs(3600));
        assert!(copy.now() >= SystemTime::now() + Duration::from_secs(3599));
        let other = Clock::system();
        assert!(other.instant() < before + Duration::from_secs(60));
    }
}
