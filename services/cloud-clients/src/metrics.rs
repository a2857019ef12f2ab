//! The API calls both clients make, counted in the process-wide registry of `common::metrics`:
//! one count per HTTP request sent (each retry attempt is its own request), by verb and outcome.
//! Labels are bounded sets; resource names, ids and URLs never become labels.

use common::errors::{Classify, ErrorClass};

/// `digitalocean_api_requests_total{method, outcome}`.
pub const DO_REQUESTS: &str = "digitalocean_api_requests_total";
/// `kubernetes_api_requests_total{verb, outcome}`.
pub const KUBE_REQUESTS: &str = "kubernetes_api_requests_total";

/// How a request ended, as the retry policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A success status.
    Ok,
    /// 404: often expected (a delete of something already gone), so kept apart from failures.
    NotFound,
    /// Retried: 429, 5xx, (for Kubernetes) 409, or the request did not complete.
    Transient,
    /// Any other failure: the same request would fail again.
    Permanent,
}

impl Outcome {
    /// The outcome of a request that failed with an error of `class`: the one place the clients
    /// turn classes into labels. Conflicts, refused credentials and refusals all count as
    /// `permanent`, as they did before errors had classes, so the series stay the same.
    pub fn of(class: ErrorClass) -> Outcome {
        match class {
            ErrorClass::Transient { .. } => Outcome::Transient,
            ErrorClass::NotFound => Outcome::NotFound,
            ErrorClass::Conflict
            | ErrorClass::Unauthorized
            | ErrorClass::Refused
            | ErrorClass::Permanent => Outcome::Permanent,
        }
    }

    /// The outcome of a request that returned `result`.
    pub(crate) fn of_result<T, E: Classify>(result: &Result<T, E>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(e) => Outcome::of(e.class()),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::NotFound => "not_found",
            Outcome::Transient => "transient",
            Outcome::Permanent => "permanent",
        }
    }
}

/// Counts one DigitalOcean API request; `method` is the HTTP method (`GET`, `POST`, ...).
pub(crate) fn digitalocean(method: &str, outcome: Outcome) {
    common::metrics::counter_add(
        DO_REQUESTS,
        "DigitalOcean API requests sent (retries included) by HTTP method and outcome",
        vec![
            ("method", method.to_string()),
            ("outcome", outcome.as_str().to_string()),
        ],
        1.0,
    );
}

/// Counts one Kubernetes API request; `verb` is what it does: `get`, `list`, `apply`, `delete`.
pub(crate) fn kubernetes(verb: &'static str, outcome: Outcome) {
    common::metrics::counter_add(
        KUBE_REQUESTS,
        "Kubernetes API requests sent (retries included) by verb and outcome",
        vec![
            ("verb", verb.to_string()),
            ("outcome", outcome.as_str().to_string()),
        ],
        1.0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_class_has_the_label_it_had() {
        let transient = ErrorClass::Transient {
            retry_after: Some(Duration::from_secs(3)),
        };
        assert_eq!(Outcome::of(transient), Outcome::Transient);
        assert_eq!(Outcome::of(ErrorClass::TRANSIENT), Outcome::Transient);
        assert_eq!(Outcome::of(ErrorClass::NotFound), Outcome::NotFound);
        for class in [
            ErrorClass::Conflict,
            ErrorClass::Unauthorized,
            ErrorClass::Refused,
            ErrorClass::Permanent,
        ] {
            assert_eq!(Outcome::of(class), Outcome::Permanent, "{class:?}");
        }
    }
}
