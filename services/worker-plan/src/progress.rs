//! Progress as the worker tracks it across passes: the fingerprint a pass leaves (the status it
//! left the DI in and what it waits for) and what a fingerprint that has not changed for a
//! while calls for.
//! - Stalls: a DI in a moving phase whose fingerprint has not changed for half the stall
//!   timeout gets an event; for the whole timeout, `error`.
//! - Repairs: an active DI that a resync found out of step with its spec (a Service deleted, a
//!   cluster rebuilt; not a transient API failure) gets a `Repairing` event when that starts
//!   and a `Repaired` event once it is back in step, so a customer can tell why an active
//!   endpoint did not answer meanwhile.

use std::time::Duration;

use api_types::lifecycle::Status;

use crate::waiting::Waiting;

/// Where a pass left a DI, as far as progress goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fingerprint {
    /// Nothing moving: converged, in `error`, gone, or only retrying while active.
    Idle,
    /// A moving phase (or an active DI being repaired) waiting for something.
    Waiting { status: Status, waiting: Waiting },
}

impl Fingerprint {
    pub fn of(status: Option<Status>, waiting: Option<&Waiting>) -> Fingerprint {
        match (status, waiting) {
            (Some(status), Some(waiting)) if moving(status) || repairing(status, waiting) => {
                Fingerprint::Waiting {
                    status,
                    waiting: waiting.clone(),
                }
            }
            _ => Fingerprint::Idle,
        }
    }

    /// The text the store keeps and compares, `None` for idle (the store has its own word for
    /// it). The same text as before fingerprints were typed, so that a fingerprint recorded
    /// before an upgrade compares equal after it.
    pub fn key(&self) -> Option<String> {
        match self {
            Fingerprint::Idle => None,
            Fingerprint::Waiting { status, waiting } => Some(format!("{status}|{waiting}")),
        }
    }

    /// The status a stored fingerprint was recorded in (`None` for idle or unreadable text).
    pub fn status_of_key(key: &str) -> Option<Status> {
        key.split_once('|')?.0.parse().ok()
    }
}

fn moving(status: Status) -> bool {
    matches!(
        status,
        Status::New | Status::Provisioning | Status::Updating | Status::Deleting
    )
}

fn repairing(status: Status, waiting: &Waiting) -> bool {
    status == Status::Active && !waiting.is_retrying()
}

/// What a fingerprint's history calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// An event on the DI: (reason, message).
    Event(&'static str, String),
    /// The DI goes to `error` with reason `Stalled` and this message.
    Stalled(String),
}

/// How long a fingerprint has been unchanged, as the store recorded it.
#[derive(Debug, Clone, Copy)]
pub struct History<'a> {
    /// The fingerprint recorded before this pass's.
    pub previous: Option<&'a str>,
    pub unchanged_for: Duration,
    /// Whether the slow event was already reported for this fingerprint.
    pub reported: bool,
}

/// What to report for a pass that left the DI in `status` waiting for `waiting`, given the
/// fingerprint's history. A `Slow` event is reported once per fingerprint (the caller records
/// that it was).
pub fn reports(
    status: Option<Status>,
    waiting: Option<&Waiting>,
    history: History<'_>,
    stall_timeout: Duration,
) -> Vec<Report> {
    let mut out = Vec::new();
    let was_repairing =
        history.previous.and_then(Fingerprint::status_of_key) == Some(Status::Active);
    let text = waiting.map(Waiting::to_string).unwrap_or_default();
    let now_repairing = matches!((status, waiting), (Some(s), Some(w)) if repairing(s, w));
    if now_repairing && !was_repairing {
        let msg = format!("Out of step with its spec; repairing: {text}");
        out.push(Report::Event("Repairing", msg));
    } else if was_repairing && status == Some(Status::Active) && waiting.is_none() {
        out.push(Report::Event(
            "Repaired",
            "Back in step with its spec.".into(),
        ));
    }
    if !status.is_some_and(moving) || waiting.is_none() {
        return out;
    }
    let secs = history.unchanged_for.as_secs();
    if history.unchanged_for >= stall_timeout {
        let phase = status.map_or("gone", Status::as_str);
        out.push(Report::Stalled(format!(
            "No progress for {secs}s while {phase}: {text}"
        )));
    } else if history.unchanged_for >= stall_timeout / 2 && !history.reported {
        out.push(Report::Event(
            "Slow",
            format!("No progress for {secs}s: {text}"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(previous: Option<&str>, secs: u64, reported: bool) -> History<'_> {
        History {
            previous,
            unchanged_for: Duration::from_secs(secs),
            reported,
        }
    }

    const STALL: Duration = Duration::from_secs(600);

    #[test]
    fn keys_read_back_their_status_and_keep_their_old_text() {
        let waiting = Waiting::EndpointAddress;
        let fp = Fingerprint::of(Some(Status::Updating), Some(&waiting));
        let key = fp.key().unwrap();
        assert_eq!(key, "updating|waiting for an endpoint address");
        assert_eq!(Fingerprint::status_of_key(&key), Some(Status::Updating));
        assert_eq!(Fingerprint::status_of_key("idle"), None);
        assert_eq!(Fingerprint::status_of_key("activeish|x"), None);
    }

    #[test]
    fn only_moving_or_repairing_dis_have_a_fingerprint() {
        let w = Waiting::EndpointAddress;
        assert_eq!(
            Fingerprint::of(Some(Status::Active), None),
            Fingerprint::Idle
        );
        assert_eq!(
            Fingerprint::of(Some(Status::Error), Some(&w)),
            Fingerprint::Idle
        );
        assert_eq!(
            Fingerprint::of(Some(Status::Active), Some(&Waiting::Retrying)),
            Fingerprint::Idle,
            "a retry while active is not a repair"
        );
        assert!(Fingerprint::of(Some(Status::Active), Some(&w))
            .key()
            .is_some());
        assert_eq!(Fingerprint::of(None, Some(&w)), Fingerprint::Idle);
    }

    #[test]
    fn a_repair_is_reported_when_it_starts_and_when_it_ends() {
        let w = Waiting::EndpointAddress;
        let start = reports(
            Some(Status::Active),
            Some(&w),
            history(Some("idle"), 0, false),
            STALL,
        );
        assert!(matches!(&start[..], [Report::Event("Repairing", _)]));
        let during = reports(
            Some(Status::Active),
            Some(&w),
            history(Some("active|x"), 5, false),
            STALL,
        );
        assert!(during.is_empty(), "{during:?}");
        let end = reports(
            Some(Status::Active),
            None,
            history(Some("active|x"), 0, false),
            STALL,
        );
        assert!(matches!(&end[..], [Report::Event("Repaired", _)]));
    }

    #[test]
    fn a_stall_warns_at_half_the_timeout_once_and_fails_at_all_of_it() {
        let w = Waiting::EndpointAddress;
        let s = Some(Status::Provisioning);
        assert!(reports(s, Some(&w), history(None, 299, false), STALL).is_empty());
        let slow = reports(s, Some(&w), history(None, 300, false), STALL);
        assert!(matches!(&slow[..], [Report::Event("Slow", m)] if m.contains("300s")));
        assert!(reports(s, Some(&w), history(None, 400, true), STALL).is_empty());
        let stalled = reports(s, Some(&w), history(None, 600, true), STALL);
        assert!(matches!(&stalled[..], [Report::Stalled(m)] if m.contains("while provisioning")));
    }
}
