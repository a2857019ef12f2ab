//! The worker's Prometheus metrics and its small HTTP server (`GET /metrics`, `GET /healthz`).
//! Everything is recorded in the process-wide registry of `common::metrics`, which also holds
//! the DigitalOcean and Kubernetes API call counters of `cloud_clients`. Labels are small fixed
//! sets: never a DI id, a resource name or a token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use api_types::lifecycle::Status;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// `worker_reconcile_duration_seconds{phase, outcome}`: histogram of pass durations.
pub const PASS_DURATION: &str = "worker_reconcile_duration_seconds";
/// `worker_reconcile_passes_total{phase, outcome}`.
pub const PASSES: &str = "worker_reconcile_passes_total";
/// `worker_reconcile_waits_total{reason}`: passes that left a DI waiting, by what it waits for
/// (`plan::Waiting::kind`).
pub const WAITS: &str = "worker_reconcile_waits_total";
/// `worker_queue_depth{state}`: `ready` or `leased` DIs in the region's work queue.
pub const QUEUE_DEPTH: &str = "worker_queue_depth";
/// `worker_lease_expiries_total`: claims that took over an expired lease.
pub const LEASE_EXPIRIES: &str = "worker_lease_expiries_total";
/// `worker_leases_lost_total`: passes abandoned because their lease could not be renewed.
pub const LEASES_LOST: &str = "worker_leases_lost_total";
/// `worker_fleet_slots_total{outcome}`: what this worker's passes did with fleet rollout slots
/// (`granted`, `held`, `done`, `failed`).
pub const FLEET_SLOTS: &str = "worker_fleet_slots_total";
/// `worker_fleet_rollout_dis{state}`: DIs of the region's newest fleet rollout by slot state
/// (`rolling`, `done`, `failed`).
pub const FLEET_DIS: &str = "worker_fleet_rollout_dis";
/// `worker_fleet_rollout_state{state}`: 1 for the newest rollout's state (`rolling`, `paused`,
/// `halted`), 0 for the others.
pub const FLEET_STATE: &str = "worker_fleet_rollout_state";

/// `worker_observed_total{source}`: passes that read their DI's objects from the cluster's
/// watch cache (`cache`) or listed them (`list`).
pub const OBSERVED: &str = "worker_observed_total";
/// `worker_watch_wakes_total`: DIs made due because their cluster's watches saw their objects
/// change.
pub const WATCH_WAKES: &str = "worker_watch_wakes_total";

/// A pass runs from milliseconds (nothing to do) to about a minute (a cloud API retried until
/// the retry policy's time bound), beyond the default request-latency buckets.
const PASS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The phase a pass worked on, from the DI's status (and pending spec) when it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `new` or `provisioning`: first rollout.
    Provisioning,
    /// `updating`, or `active` with a pending spec: a rollout of a new spec.
    Updating,
    /// `deleting`: teardown.
    Deleting,
    /// `active` with nothing pending: the periodic resync of a converged DI.
    Resync,
    /// Nothing to do: the DI is in `error` (waiting for a new spec), gone, or unknown.
    Idle,
    /// The DI could not be read (a store error before the phase was known).
    Unknown,
}

impl Phase {
    pub fn of(status: Status, pending_spec: bool) -> Phase {
        match status {
            Status::New | Status::Provisioning => Phase::Provisioning,
            Status::Updating => Phase::Updating,
            Status::Active if pending_spec => Phase::Updating,
            Status::Active => Phase::Resync,
            Status::Deleting => Phase::Deleting,
            Status::Error => Phase::Idle,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Provisioning => "provisioning",
            Phase::Updating => "updating",
            Phase::Deleting => "deleting",
            Phase::Resync => "resync",
            Phase::Idle => "idle",
            Phase::Unknown => "unknown",
        }
    }
}

/// How a pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing left to wait for.
    Converged,
    /// Moved on and waits for the cloud (or applied changes): looks again soon.
    Progress,
    /// A transient failure: retried with backoff.
    Retry,
    /// A permanent failure: the DI goes to `error`.
    Error,
    /// The pass's lease ran out or was taken: it stopped without writing.
    LeaseLost,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Converged => "converged",
            Outcome::Progress => "progress",
            Outcome::Retry => "retry",
            Outcome::Error => "error",
            Outcome::LeaseLost => "lease_lost",
        }
    }
}

/// Records one reconcile pass.
pub fn pass(phase: Phase, outcome: Outcome, elapsed: Duration) {
    let labels = || {
        vec![
            ("phase", phase.as_str().to_string()),
            ("outcome", outcome.as_str().to_string()),
        ]
    };
    common::metrics::observe_in(
        PASS_DURATION,
        "Duration of reconcile passes by phase and outcome",
        labels(),
        elapsed.as_secs_f64(),
        PASS_BUCKETS,
    );
    common::metrics::counter_add(
        PASSES,
        "Reconcile passes by phase and outcome",
        labels(),
        1.0,
    );
}

/// Counts a pass that left its DI waiting, by the kind of what it waits for.
pub fn waiting(reason: &'static str) {
    common::metrics::counter_add(
        WAITS,
        "Reconcile passes that left their DI waiting, by what it waits for",
        vec![("reason", reason.to_string())],
        1.0,
    );
}

/// Sets the work queue's depth (region-wide: every worker of the region reports the same value).
pub fn queue_depth(ready: i64, leased: i64) {
    const HELP: &str = "DIs in the region's work queue: due and free to claim (ready) or under a live lease (leased)";
    common::metrics::gauge_set(
        QUEUE_DEPTH,
        HELP,
        vec![("state", "ready".into())],
        ready as f64,
    );
    common::metrics::gauge_set(
        QUEUE_DEPTH,
        HELP,
        vec![("state", "leased".into())],
        leased as f64,
    );
}

/// Counts claims that took over an expired lease.
pub fn lease_expiries(n: usize) {
    common::metrics::counter_add(
        LEASE_EXPIRIES,
        "Claims that took over a DI whose lease had expired (its worker died or stalled)",
        vec![],
        n as f64,
    );
}

/// Counts a pass abandoned because its lease was lost.
pub fn lease_lost(n: usize) {
    common::metrics::counter_add(
        LEASES_LOST,
        "Reconcile passes abandoned because their lease could not be renewed",
        vec![],
        n as f64,
    );
}

/// Counts what a pass did with a fleet rollout slot.
pub fn observed(source: &'static str) {
    common::metrics::counter_add(
        OBSERVED,
        "Passes by where they read their DI's objects: the cluster's watch cache, or a list",
        vec![("source", source.to_string())],
        1.0,
    );
}

pub fn watch_wakes(n: usize) {
    common::metrics::counter_add(
        WATCH_WAKES,
        "DIs made due because their cluster's watches saw their objects change",
        vec![],
        n as f64,
    );
}

pub fn fleet_slot(outcome: &'static str) {
    common::metrics::counter_add(
        FLEET_SLOTS,
        "Fleet rollout slots by what became of them: granted, held (the DI keeps what it runs), done, failed",
        vec![("outcome", outcome.to_string())],
        1.0,
    );
}

/// Sets the newest fleet rollout's gauges (region-wide, as the queue depth).
pub fn fleet_progress(p: &region_store::RolloutProgress) {
    for (state, n) in [
        ("rolling", p.rolling),
        ("done", p.done),
        ("failed", p.failed),
    ] {
        common::metrics::gauge_set(
            FLEET_DIS,
            "DIs of the newest fleet rollout by the state of their slot",
            vec![("state", state.into())],
            n as f64,
        );
    }
    for state in [
        region_store::RolloutState::Rolling,
        region_store::RolloutState::Paused,
        region_store::RolloutState::Halted,
    ] {
        common::metrics::gauge_set(
            FLEET_STATE,
            "1 for the state of the newest fleet rollout, 0 for the others",
            vec![("state", state.as_str().into())],
            f64::from(u8::from(p.state == state)),
        );
    }
}

/// Exports the lease counters at zero, so that "no expiries" reads as 0 rather than as a
/// missing series (which alerts cannot tell from a worker that is not scraped).
pub fn register() {
    lease_expiries(0);
    lease_lost(0);
}

/// Serves `/metrics` and `/healthz` on `listener` until `stop` fires (or its sender is dropped).
/// `/healthz` answers 200 while `running` is true (the claim loop runs) and 503 after.
pub async fn serve(listener: TcpListener, running: Arc<AtomicBool>, stop: oneshot::Receiver<()>) {
    let app = axum::Router::new()
        .route("/metrics", get(common::metrics::handler))
        .route(
            "/healthz",
            get(move || async move {
                if running.load(Ordering::SeqCst) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "stopped")
                }
            }),
        );
    let shutdown = async {
        let _ = stop.await;
    };
    if let Err(error) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(%error, "metrics server stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_follow_status_and_pending_spec() {
        assert_eq!(Phase::of(Status::New, true), Phase::Provisioning);
        assert_eq!(Phase::of(Status::Provisioning, true), Phase::Provisioning);
        assert_eq!(Phase::of(Status::Active, true), Phase::Updating);
        assert_eq!(Phase::of(Status::Updating, true), Phase::Updating);
        assert_eq!(Phase::of(Status::Active, false), Phase::Resync);
        assert_eq!(Phase::of(Status::Deleting, false), Phase::Deleting);
        assert_eq!(Phase::of(Status::Error, true), Phase::Idle);
    }
}
