//! The lifecycle of a dedicated inference: one enum of statuses and one transition table.
//!
//! ```text
//!  new ──▶ provisioning ──▶ active ◀──▶ updating
//!   │           │             │            │
//!   └───────────┴──────┬──────┴────────────┘
//!                      ▼
//!                  deleting ──▶ (gone)          any but deleting ──▶ error ──▶ a new spec
//! ```
//!
//! The regional store moves a DI only through [`Status::after`]; the worker decides what a pass
//! does by matching on [`Status`]; the soak's checker (`tests/soak`) reads the same table from
//! `openapi/lifecycle.json`, which [`table_json`] generates and a test keeps in step.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Where a dedicated inference is in its life, as the public API's `status` spells it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Accepted; no worker has started on it.
    New,
    /// A worker is bringing up its first spec.
    Provisioning,
    /// Its spec is rolled out and its endpoints answer.
    Active,
    /// A newer spec is rolling out; the previous one keeps serving meanwhile.
    Updating,
    /// Being torn down; readable until every cloud resource is gone.
    Deleting,
    /// A permanent failure (with a reason); what was serving keeps serving. A new spec or a
    /// delete moves it on.
    Error,
}

/// What moves a dedicated inference from one status to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A worker starts on a new DI's first spec.
    ProvisioningStarted,
    /// A worker starts rolling out the pending spec of an active DI.
    RolloutStarted,
    /// A customer's new spec is accepted. `rolled_out`: an earlier spec was fully rolled out, so
    /// something serves while the new one rolls out.
    SpecAccepted { rolled_out: bool },
    /// The pending spec is rolled out and its endpoint answers.
    RolloutComplete,
    /// A permanent failure of the spec being rolled out (or of the whole DI: a stall).
    Failed,
    /// A customer deletes the DI.
    DeleteRequested,
    /// Every cloud resource of a deleting DI is gone: the DI exists no more (its status stays
    /// `deleting`; the record is marked gone).
    Gone,
}

impl Status {
    pub const ALL: [Status; 6] = [
        Status::New,
        Status::Provisioning,
        Status::Active,
        Status::Updating,
        Status::Deleting,
        Status::Error,
    ];

    /// The transition table: the status after `event`, or `None` when `event` cannot happen in
    /// this status (the caller refuses it, or ignores it where that is its rule).
    pub fn after(self, event: Event) -> Option<Status> {
        use Event::*;
        use Status::*;
        match (self, event) {
            (_, DeleteRequested) => Some(Deleting),
            (Deleting, Gone) => Some(Deleting),
            (Deleting, _) | (_, Gone) => None,
            (New, ProvisioningStarted) => Some(Provisioning),
            (_, ProvisioningStarted) => None,
            (Active, RolloutStarted) => Some(Updating),
            (_, RolloutStarted) => None,
            (New | Provisioning, SpecAccepted { .. }) => Some(self),
            (Active | Updating, SpecAccepted { .. }) => Some(Updating),
            (Error, SpecAccepted { rolled_out: true }) => Some(Updating),
            (Error, SpecAccepted { rolled_out: false }) => Some(New),
            (Provisioning | Active | Updating, RolloutComplete) => Some(Active),
            (New | Error, RolloutComplete) => None,
            (_, Failed) => Some(Error),
        }
    }

    /// Whether customers may still change the DI (its spec, its tokens): not once it is being
    /// deleted.
    pub fn accepts_changes(self) -> bool {
        self != Status::Deleting
    }

    /// Whether workers look at the DI on their own schedule (to move it on, or to resync it).
    /// An `error` DI waits for a customer's change.
    pub fn is_worked_on_schedule(self) -> bool {
        self != Status::Error
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::New => "new",
            Status::Provisioning => "provisioning",
            Status::Active => "active",
            Status::Updating => "updating",
            Status::Deleting => "deleting",
            Status::Error => "error",
        }
    }

    /// Every status reachable from this one through any number of events (itself included):
    /// what an observer that polls, and so may miss steps, can see next. Precise about one bit
    /// of history the status alone does not carry: a DI that has rolled a spec out (active or
    /// updating) never goes back to `new` or `provisioning`.
    pub fn reachable(self) -> Vec<Status> {
        let rolled_out: &[bool] = match self {
            Status::New | Status::Provisioning => &[false],
            Status::Active | Status::Updating => &[true],
            Status::Error | Status::Deleting => &[false, true],
        };
        let mut seen: Vec<(Status, bool)> = rolled_out.iter().map(|r| (self, *r)).collect();
        let mut i = 0;
        while i < seen.len() {
            let (status, rolled_out) = seen[i];
            for event in EVENTS {
                if matches!(event, Event::SpecAccepted { rolled_out: r } if r != rolled_out) {
                    continue;
                }
                if let Some(next) = status.after(event) {
                    let state = (next, rolled_out || event == Event::RolloutComplete);
                    if !seen.contains(&state) {
                        seen.push(state);
                    }
                }
            }
            i += 1;
        }
        let mut out: Vec<Status> = seen.into_iter().map(|(s, _)| s).collect();
        out.sort();
        out.dedup();
        out
    }

    /// The statuses one event away.
    pub fn successors(self) -> Vec<Status> {
        let mut out: Vec<Status> = EVENTS.iter().filter_map(|e| self.after(*e)).collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Every event, for walking the table.
pub const EVENTS: [Event; 8] = [
    Event::ProvisioningStarted,
    Event::RolloutStarted,
    Event::SpecAccepted { rolled_out: false },
    Event::SpecAccepted { rolled_out: true },
    Event::RolloutComplete,
    Event::Failed,
    Event::DeleteRequested,
    Event::Gone,
];

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status name that is not one of [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status {0:?}")]
pub struct UnknownStatus(pub String);

impl std::str::FromStr for Status {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Status, UnknownStatus> {
        Status::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_string()))
    }
}

/// The table as JSON, for checkers outside Rust: for each status, the statuses one event away
/// (`next`) and those any number of events away (`reachable`).
pub fn table_json() -> String {
    let mut out = serde_json::Map::new();
    for status in Status::ALL {
        out.insert(
            status.as_str().to_string(),
            serde_json::json!({"next": status.successors(), "reachable": status.reachable()}),
        );
    }
    let mut text =
        serde_json::to_string_pretty(&serde_json::Value::Object(out)).expect("serialises");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;
    use Status::*;

    #[test]
    fn deletion_wins_and_is_final() {
        for s in Status::ALL {
            assert_eq!(s.after(DeleteRequested), Some(Deleting));
        }
        assert_eq!(Deleting.reachable(), [Deleting]);
        assert_eq!(Deleting.after(SpecAccepted { rolled_out: true }), None);
        assert_eq!(
            Deleting.after(Failed),
            None,
            "a refusal while deleting is retried"
        );
        assert_eq!(Active.after(Gone), None, "only a deleting DI can be gone");
    }

    #[test]
    fn a_new_spec_moves_a_failed_di_on() {
        assert_eq!(
            Error.after(SpecAccepted { rolled_out: true }),
            Some(Updating)
        );
        assert_eq!(Error.after(SpecAccepted { rolled_out: false }), Some(New));
        assert_eq!(Error.after(RolloutComplete), None);
        assert_eq!(
            Provisioning.after(SpecAccepted { rolled_out: false }),
            Some(Provisioning)
        );
        assert_eq!(
            Active.after(SpecAccepted { rolled_out: true }),
            Some(Updating)
        );
    }

    #[test]
    fn workers_start_only_from_where_they_may() {
        assert_eq!(New.after(ProvisioningStarted), Some(Provisioning));
        assert_eq!(Active.after(ProvisioningStarted), None);
        assert_eq!(Active.after(RolloutStarted), Some(Updating));
        assert_eq!(Updating.after(RolloutStarted), None);
        assert_eq!(Updating.after(RolloutComplete), Some(Active));
    }

    #[test]
    fn every_status_can_reach_deleting_and_names_round_trip() {
        for s in Status::ALL {
            assert!(s.reachable().contains(&Deleting), "{s}");
            assert_eq!(s.as_str().parse::<Status>(), Ok(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert!("running".parse::<Status>().is_err());
        assert_eq!(
            New.reachable(),
            Status::ALL
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
        );
        // Only a failure or a delete leads out of serving; a new spec goes back to updating.
        assert_eq!(Active.successors(), [Active, Updating, Deleting, Error]);
        // A DI that served never looks new again, whatever an observer misses in between.
        assert_eq!(Active.reachable(), [Active, Updating, Deleting, Error]);
        assert!(
            Error.reachable().contains(&New),
            "a DI that failed before serving"
        );
    }
}
