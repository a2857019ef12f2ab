//! What a failed call to a dependency (DigitalOcean, a Kubernetes API server, the Hugging Face
//! Hub, Postgres, a region) means for whoever made it. Each dependency's client decides its
//! error's class once, where it reads the answer (status, body, transport failure), and nobody
//! overrides it later: each service turns classes into its own behaviour (retry, answer, metric
//! label) in one place, but it never re-decides whether a failure passes.

use std::time::Duration;

/// The class of a dependency's failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The same request may succeed later: a timeout, a cut connection, a rate limit, a server
    /// error, a database restarting. `retry_after` is the wait the dependency asked for, when it
    /// said.
    Transient { retry_after: Option<Duration> },
    /// The request conflicts with the current state of what it names (it exists already, it is
    /// being torn down): whoever sent it looks again before deciding anything.
    Conflict,
    /// What the request names does not exist (or is not there for the credentials used).
    NotFound,
    /// The dependency refused our own credentials (expired, revoked, rotated on one side only):
    /// nothing in the request is wrong, and the same request works once the credentials are.
    Unauthorized,
    /// The dependency refused what the request carries (a failed validation): the same request
    /// is refused again; a different one may not be.
    Refused,
    /// Anything else that the same request would meet again: an answer we cannot read, a
    /// request we could not even make.
    Permanent,
}

impl ErrorClass {
    /// A transient failure with no wait asked for.
    pub const TRANSIENT: ErrorClass = ErrorClass::Transient { retry_after: None };

    /// Whether the same request may succeed later.
    pub fn is_transient(self) -> bool {
        matches!(self, ErrorClass::Transient { .. })
    }

    /// The wait a transient failure asked for.
    pub fn retry_after(self) -> Option<Duration> {
        match self {
            ErrorClass::Transient { retry_after } => retry_after,
            _ => None,
        }
    }
}

/// An error at the edge of a dependency, which knows its class.
pub trait Classify {
    fn class(&self) -> ErrorClass;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_failures_pass_and_carry_a_wait() {
        let after = Duration::from_secs(3);
        let waits = ErrorClass::Transient {
            retry_after: Some(after),
        };
        assert!(waits.is_transient() && ErrorClass::TRANSIENT.is_transient());
        assert_eq!(waits.retry_after(), Some(after));
        assert_eq!(ErrorClass::TRANSIENT.retry_after(), None);
        for class in [
            ErrorClass::Conflict,
            ErrorClass::NotFound,
            ErrorClass::Unauthorized,
            ErrorClass::Refused,
            ErrorClass::Permanent,
        ] {
            assert!(!class.is_transient(), "{class:?}");
            assert_eq!(class.retry_after(), None, "{class:?}");
        }
    }
}
