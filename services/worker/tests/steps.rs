//! Every step twice, a fault at every step: a DI's whole life (create, a scale change, a GPU
//! change, a token revoked, delete) driven pass by pass, with faults armed mechanically in the
//! region simulator rather than at hand-picked steps:
//!
//! - walked lives: every pass is first run with a fault at its first call, then at its second,
//!   and so on until a pass ends before reaching the armed call; once per API (DigitalOcean,
//!   Kubernetes) and fault kind (refused, or served with its answer lost);
//! - one life per DigitalOcean write of a clean life, in which that write is served and its
//!   answer lost, the client sends it again and the passes carry on as they will.
//!
//! Each life must end every step where a clean life ends, create nothing twice, never turn a
//! transient fault into a permanent error, write nothing once converged, and leave nothing
//! behind.
//!
//! Needs DATABASE_URL (a Postgres the tests may create databases in).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use api_types::regional::Record;
use cloud_clients::RetryConfig;
use region_sim::{Api, ArmedKind, Delays, Inventory, RegionSim};
use serde_json::Value;
use support::*;
use uuid::Uuid;
use worker::plan::names;
use worker::reconcile::{Pass, ReconcileError, Reconciler};

/// The accelerator the GPU change moves to.
const OTHER_GPU: &str = "gpu-h200x1-141gb";
/// A bound on any one step, far above what a step takes.
const STEP_DEADLINE: Duration = Duration::from_secs(60);
/// A bound on the calls of one pass, against a walk that never ends.
const MAX_CALLS_PER_PASS: u64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Create,
    Scale,
    Gpu,
    Revoke,
    Delete,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Create => "create",
            Step::Scale => "scale change",
            Step::Gpu => "GPU change",
            Step::Revoke => "token revoke",
            Step::Delete => "delete",
        })
    }
}

fn api_name(api: Api) -> &'static str {
    match api {
        Api::Do => "do",
        Api::Kube => "kube",
        Api::DataPlane => "data-plane",
    }
}

/// A fault kind on an API.
#[derive(Debug, Clone, Copy)]
struct Fault {
    api: Api,
    kind: ArmedKind,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ArmedKind::Refuse => "refuse",
            ArmedKind::LoseResponse => "lose_response",
            ArmedKind::Outage => "outage",
        };
        write!(f, "{}/{kind}", api_name(self.api))
    }
}

/// How a life meets its faults.
#[derive(Debug, Clone, Copy)]
enum Faulting {
    /// Not at all: the life the others are compared with.
    Clean,
    /// Every pass walked at every call with this fault.
    EveryCall(Fault),
    /// The `nth` write of the life to `api` loses its answer; nothing else is faulted.
    LostWrite { api: Api, nth: u64 },
}

impl fmt::Display for Faulting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Faulting::Clean => f.write_str("clean"),
            Faulting::EveryCall(fault) => write!(f, "{fault}"),
            Faulting::LostWrite { api, nth } => {
                write!(f, "{}/lose_response at write {nth}", api_name(*api))
            }
        }
    }
}

impl Faulting {
    /// How the life's DigitalOcean and Kubernetes clients retry.
    fn retries(self) -> RetryConfig {
        // A call whose answer was lost is sent again at once, as production clients do (with
        // a longer backoff): that is how a create lands twice.
        let resend = RetryConfig {
            min_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
            max_attempts: 2,
            max_elapsed: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(1),
            jitter: false,
        };
        match self {
            Faulting::EveryCall(Fault {
                kind: ArmedKind::LoseResponse,
                ..
            })
            | Faulting::LostWrite { .. } => resend,
            // A refused call fails its pass: the next pass must pick up where it stopped.
            _ => RetryConfig::none(),
        }
    }
}

fn is_write(request: &str) -> bool {
    ["POST ", "PUT ", "PATCH ", "DELETE "]
        .iter()
        .any(|m| request.starts_with(m))
}

/// Replaces the ids of one life in names, so that two lives' resources compare.
struct Placeholders(Vec<(String, &'static str)>);

impl Placeholders {
    fn new(rec: &Record) -> Self {
        let spec = rec.pending_spec.as_ref().or(rec.spec.as_ref()).unwrap();
        let mut ids = vec![(rec.id.to_string(), "{di}")];
        ids.push((names::short(&rec.id), "{di8}"));
        for m in &spec.model_deployments {
            let id = m.model_id.expect("the store gives deployments their ids");
            ids.push((id.to_string(), "{model}"));
            ids.push((names::short(&id), "{model8}"));
        }
        Placeholders(ids)
    }

    fn apply(&self, s: &str) -> String {
        self.0
            .iter()
            .fold(s.to_string(), |s, (id, p)| s.replace(id.as_str(), p))
    }
}

fn text<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The Kubernetes objects the worker wrote (Nodes carry the labels of their node pool, Pods
/// those of their Deployment's template).
fn managed_objects(inv: &Inventory) -> impl Iterator<Item = &Value> {
    let managed_by = format!(
        "/metadata/labels/{}",
        names::MANAGED_BY_LABEL.replace('/', "~1")
    );
    inv.kubernetes.values().flatten().filter(move |o| {
        o["kind"] != "Node" && o["kind"] != "Pod" && text(o, &managed_by) == names::MANAGED_BY
    })
}

/// Every resource of the region as `kind: name` (ids placeholdered), with its id: clusters,
/// node pools (not deleting), load balancers and the worker's Kubernetes objects.
fn resources(inv: &Inventory, ph: &Placeholders) -> Vec<(String, String)> {
    let cloud = &inv.cloud;
    let named = |kind: &str, v: &Value| {
        let name = format!("{kind}: {}", ph.apply(text(v, "/name")));
        (name, text(v, "/id").to_string())
    };
    let mut out = Vec::new();
    out.extend(cloud.clusters.iter().map(|c| named("cluster", c)));
    out.extend(
        cloud
            .node_pools
            .iter()
            .filter(|p| p["deleting"] != true)
            .map(|p| named("node pool", p)),
    );
    out.extend(
        cloud
            .load_balancers
            .iter()
            .map(|l| named("load balancer", l)),
    );
    out.extend(managed_objects(inv).map(|o| {
        let name = format!(
            "{}: {}/{}",
            text(o, "/kind"),
            text(o, "/metadata/namespace"),
            text(o, "/metadata/name")
        );
        (ph.apply(&name), text(o, "/metadata/uid").to_string())
    }));
    out
}

/// What a converged step leaves: the DI's status and version, and every resource with what
/// matters of it (a node pool's size and count), sorted, duplicates kept.
fn end_state(rec: &Record, inv: &Inventory, ph: &Placeholders) -> Vec<String> {
    let version = rec.spec.as_ref().map(|s| s.version);
    let mut out = vec![format!("status {} v{version:?}", rec.status)];
    out.extend(resources(inv, ph).into_iter().map(|(name, _)| name));
    for p in inv
        .cloud
        .node_pools
        .iter()
        .filter(|p| p["deleting"] != true)
    {
        out.push(ph.apply(&format!(
            "node pool: {} is {} x{}",
            text(p, "/name"),
            text(p, "/size"),
            p["count"]
        )));
    }
    out.sort();
    out
}

/// Every id each resource name has had over a life: two ids under one name mean the resource
/// was created twice (or deleted and made again).
#[derive(Default)]
struct Created(BTreeMap<String, BTreeSet<String>>);

impl Created {
    fn sample(&mut self, inv: &Inventory, ph: &Placeholders) {
        for (name, id) in resources(inv, ph) {
            self.0.entry(name).or_default().insert(id);
        }
    }

    /// Resources made, by kind of resource (`cluster`, `node pool`, `Deployment`, ...).
    fn by_kind(&self) -> BTreeMap<&str, usize> {
        let mut out = BTreeMap::new();
        for (name, ids) in &self.0 {
            let kind = name
                .split_once(": ")
                .map_or(name.as_str(), |(kind, _)| kind);
            *out.entry(kind).or_default() += ids.len();
        }
        out
    }

    /// Names made more often than in `clean`, with how often.
    fn beyond(&self, clean: &Created) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|(name, ids)| {
                let clean = clean.0.get(name).map_or(0, BTreeSet::len);
                (ids.len() > clean).then(|| format!("{name}: {} times, clean {clean}", ids.len()))
            })
            .collect()
    }
}

#[derive(Debug, Default)]
struct Tally {
    /// Passes walked at every call (or, without a walk, plain passes run to make progress).
    walked: u64,
    passes: u64,
    faults: u64,
    /// Faults that hit a write (a create, an apply, a delete).
    faults_on_writes: u64,
    failed_passes: u64,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.walked += other.walked;
        self.passes += other.passes;
        self.faults += other.faults;
        self.faults_on_writes += other.faults_on_writes;
        self.failed_passes += other.failed_passes;
    }
}

/// One DI's life, driven pass by pass by one reconciler.
struct Life<'a> {
    env: &'a Env,
    reconciler: Reconciler,
    faulting: Faulting,
    id: Uuid,
    placeholders: Placeholders,
    created: Created,
    end_states: Vec<(Step, Vec<String>)>,
    /// The calls the faults hit, by request kind.
    hit: BTreeMap<String, u64>,
    /// Writes the life sent, by API.
    writes: BTreeMap<Api, u64>,
    tally: Tally,
}

impl<'a> Life<'a> {
    async fn live(env: &'a Env, faulting: Faulting) -> Life<'a> {
        let sim = &env.sim;
        let writes_before = [Api::Do, Api::Kube].map(|api| (api, sim.writes(api)));
        let (rec, _token) = env.create(1).await;
        let mut life = Life {
            env,
            reconciler: env.reconciler_with(faulting.retries(), listing_only(env)),
            faulting,
            id: rec.id,
            placeholders: Placeholders::new(&rec),
            created: Created::default(),
            end_states: Vec::new(),
            hit: BTreeMap::new(),
            writes: BTreeMap::new(),
            tally: Tally::default(),
        };
        let lost_write = match faulting {
            Faulting::LostWrite { api, nth } => Some(
                sim.arm_fault_on_write(api, nth, ArmedKind::LoseResponse)
                    .unwrap(),
            ),
            _ => None,
        };
        let id = rec.id;
        life.converge(Step::Create, |r, _| active_at(r, 1)).await;

        let model_id = rec
            .pending_spec
            .as_ref()
            .or(rec.spec.as_ref())
            .unwrap()
            .model_deployments[0]
            .model_id;
        let mut spec = env.spec(2, model_id);
        spec.version = 1;
        env.patch(id, &spec).await;
        life.converge(Step::Scale, |r, _| active_at(r, 2)).await;

        spec.version = 2;
        spec.model_deployments[0].accelerators[0].accelerator_slug = OTHER_GPU.into();
        env.patch(id, &spec).await;
        life.converge(Step::Gpu, |r, _| active_at(r, 3)).await;

        let tokens = env.store.tokens_list(id, env.team, 1, 20).await.unwrap();
        let managed = tokens.items.iter().find(|t| t.is_managed).unwrap().id;
        assert!(accepts(&sim.inventory(), id, managed));
        env.store.token_revoke(id, env.team, managed).await.unwrap();
        life.converge(Step::Revoke, |r, inv| {
            active_at(r, 3) && !accepts(inv, id, managed)
        })
        .await;

        env.store
            .dedicated_inference_delete(id, env.team)
            .await
            .unwrap();
        life.converge(Step::Delete, |r, _| r.gone).await;
        // Teardown waits for the cluster to go; what hangs off it goes on the simulator's
        // next tick.
        test_support::within(Duration::from_secs(5), async || {
            sim.inventory().leftovers().is_empty().then_some(())
        })
        .await;
        assert_eq!(
            sim.inventory().leftovers(),
            Vec::<String>::new(),
            "{faulting}: leftovers after delete"
        );

        life.writes = writes_before
            .into_iter()
            .map(|(api, before)| (api, sim.writes(api) - before))
            .collect();
        if let (Some(armed), Faulting::LostWrite { api, nth }) = (lost_write, faulting) {
            sim.disarm_faults();
            match sim.fired_faults().into_iter().find(|f| f.fault == armed) {
                Some(fired) => {
                    life.tally.faults += 1;
                    life.tally.faults_on_writes += 1;
                    *life.hit.entry(fired.request).or_default() += 1;
                }
                // How often something being deleted is asked again to go (a terminating
                // namespace, a deleting node pool) depends on how long it takes: a life may
                // send fewer writes than the clean one did.
                None => assert!(
                    life.writes[&api] <= nth,
                    "{faulting}: the armed write was not hit"
                ),
            }
        }
        life
    }

    /// Passes until `done` holds for a pass that waits for nothing. Unless the step deleted
    /// the DI, the converged DI's resync is walked too, and then a pass must write nothing.
    async fn converge(&mut self, step: Step, done: impl Fn(&Record, &Inventory) -> bool) {
        // The simulated cloud moves on its own clock: passes are run until one finds it there.
        let mut last = None;
        let converged = test_support::within(STEP_DEADLINE, async || {
            let pass = self.walk(step).await;
            let converged = matches!(&pass, Ok(p) if p.waiting.is_none())
                && done(&self.record().await, &self.env.sim.inventory());
            last = Some(pass);
            converged.then_some(())
        })
        .await;
        assert!(
            converged.is_some(),
            "{}: {step} did not converge; last pass {last:?}\n{:#?}",
            self.faulting,
            self.record().await
        );
        if step != Step::Delete {
            let resync = self.walk(step).await;
            assert!(
                matches!(&resync, Ok(p) if p.waiting.is_none()),
                "{}: {step}: a resync after faults is not converged: {resync:?}",
                self.faulting
            );
            let quiet = self.pass(step, false).await;
            assert!(
                matches!(
                    &quiet,
                    Ok(Pass {
                        waiting: None,
                        do_writes: 0,
                        kube_writes: 0,
                        ..
                    })
                ),
                "{}: {step}: a pass over the converged DI wrote or waited: {quiet:?}",
                self.faulting
            );
        }
        let rec = self.record().await;
        let inv = self.env.sim.inventory();
        self.end_states
            .push((step, end_state(&rec, &inv, &self.placeholders)));
    }

    /// One pass, walked at every call when the life walks: run with a fault armed at its first
    /// call, then at its second, and so on; returns the first pass that ends before reaching
    /// the armed call.
    async fn walk(&mut self, step: Step) -> std::result::Result<Pass, ReconcileError> {
        self.tally.walked += 1;
        let Faulting::EveryCall(fault) = self.faulting else {
            let faulted = matches!(self.faulting, Faulting::LostWrite { .. });
            return self.pass(step, faulted).await;
        };
        let env = self.env;
        let sim = &env.sim;
        for nth in 0..MAX_CALLS_PER_PASS {
            // The pass ends at the fault: the API is down from the call after it (after the
            // client's one retry of a lost call, which is served), so that the world moves on
            // by what the pass did before the fault, and calls sent alongside it do not carry
            // the pass further.
            let down_from = match fault.kind {
                ArmedKind::LoseResponse => nth + 2,
                _ => nth + 1,
            };
            let armed = sim.arm_fault(fault.api, nth, fault.kind).unwrap();
            sim.arm_fault(fault.api, down_from, ArmedKind::Outage)
                .unwrap();
            let result = self.reconciler.reconcile(self.id).await;
            self.tally.passes += 1;
            let fired = sim.fired_faults().into_iter().find(|f| f.fault == armed);
            if fired.is_some() {
                settle(sim, fault.api).await;
            }
            sim.disarm_faults();
            self.created.sample(&sim.inventory(), &self.placeholders);
            let Some(fired) = fired else {
                return self.checked(step, result, None);
            };
            self.tally.faults += 1;
            self.tally.faults_on_writes += u64::from(is_write(&fired.request));
            *self.hit.entry(fired.request.clone()).or_default() += 1;
            let why = format!("{fault} at call {nth} of a pass ({})", fired.request);
            // A failed pass is what the walk expects; a permanent error would have panicked.
            let _ = self.checked(step, result, Some(why));
        }
        panic!(
            "{}: {step}: a pass made more than {MAX_CALLS_PER_PASS} calls",
            self.faulting
        );
    }

    /// One plain pass; `faulted` when a fault may have hit it.
    async fn pass(
        &mut self,
        step: Step,
        faulted: bool,
    ) -> std::result::Result<Pass, ReconcileError> {
        let result = self.reconciler.reconcile(self.id).await;
        self.tally.passes += 1;
        self.created
            .sample(&self.env.sim.inventory(), &self.placeholders);
        let why = faulted.then(|| self.faulting.to_string());
        self.checked(step, result, why)
    }

    /// A failed pass must have met a fault (`why`), and fail as a transient error: a permanent
    /// one would put the DI in error.
    fn checked(
        &mut self,
        step: Step,
        result: std::result::Result<Pass, ReconcileError>,
        why: Option<String>,
    ) -> std::result::Result<Pass, ReconcileError> {
        match (&result, why) {
            (Ok(_), _) => {}
            (Err(e @ ReconcileError::Permanent { .. }), why) => panic!(
                "{}: {step}: a pass failed with a permanent error after {}: {e}",
                self.faulting,
                why.as_deref().unwrap_or("no fault")
            ),
            (Err(e), None) => panic!(
                "{}: {step}: a pass without a fault failed: {e}",
                self.faulting
            ),
            (Err(_), Some(_)) => self.tally.failed_passes += 1,
        }
        result
    }

    async fn record(&self) -> Record {
        self.env
            .store
            .dedicated_inference_any(self.id)
            .await
            .unwrap()
    }

    /// Asserts that this life ended every step as `clean` did and made nothing more often.
    fn assert_like(&self, clean: &Life<'_>) {
        assert_eq!(self.end_states.len(), clean.end_states.len());
        for ((step, clean_end), (_, end)) in clean.end_states.iter().zip(&self.end_states) {
            assert_eq!(
                end, clean_end,
                "{}: after the {step} the region differs from a clean life's",
                self.faulting
            );
        }
        let duplicates = self.created.beyond(&clean.created);
        assert!(
            duplicates.is_empty(),
            "{}: created more often than in a clean life: {duplicates:#?}",
            self.faulting
        );
    }
}

/// Waits until calls to `api` have stopped arriving: a pass that failed may leave requests it
/// sent alongside the failed one on their way, and a call they reach later would take the
/// number the next fault is armed for.
async fn settle(sim: &RegionSim, api: Api) {
    let mut calls = sim.calls(api);
    let mut quiet = 0;
    // Three quiet looks in a row, not one: on a loaded machine the simulator's accept loop may
    // itself wait longer than one look.
    while quiet < 3 {
        // Real time: a request still on its way (in a socket, in the simulator's accept queue)
        // shows nowhere until it arrives, so only a quiet spell says none is left.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = sim.calls(api);
        quiet = if now == calls { quiet + 1 } else { 0 };
        calls = now;
    }
}

/// The worker's settings without cluster watches: each pass's own calls are walked one by one,
/// and a watch's requests (a LIST at start, a WATCH resumed after a refusal) would take the
/// faults meant for them.
fn listing_only(env: &Env) -> worker::reconcile::Settings {
    let mut settings = env.config().settings;
    settings.watch_caches = false;
    settings
}

fn active_at(rec: &Record, version: i32) -> bool {
    rec.status == Status::Active
        && rec.pending_spec.is_none()
        && rec.spec.as_ref().map(|s| s.version) == Some(version)
}

/// Whether the gateway of DI `id` accepts access token `token` (its id is a key of the
/// access-token Secret).
fn accepts(inv: &Inventory, id: Uuid, token: Uuid) -> bool {
    let ns = names::namespace(&id);
    inv.kube_objects("Secret").iter().any(|s| {
        text(s, "/metadata/namespace") == ns
            && text(s, "/metadata/name") == names::ACCESS_TOKENS_SECRET
            && s["data"].get(token.to_string()).is_some()
    })
}

fn created_summary(clean: &Created, faulted: &[&Created]) -> String {
    let mut made: BTreeMap<&str, usize> = BTreeMap::new();
    for c in faulted {
        for (kind, n) in c.by_kind() {
            let most = made.entry(kind).or_default();
            *most = (*most).max(n);
        }
    }
    clean
        .by_kind()
        .iter()
        .map(|(kind, n)| format!("{kind} {n}→{}", made.get(kind).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn summary(what: &str, t: &Tally, hit: &BTreeMap<String, u64>, created: String, started: Instant) {
    let writes: Vec<String> = hit
        .iter()
        .filter(|(request, _)| is_write(request))
        .map(|(request, n)| format!("{request} ×{n}"))
        .collect();
    println!(
        "steps {what}: {} passes walked, {} passes run, {} faults injected ({} on writes), {} \
         passes failed transiently, 0 permanent errors, duplicates found: 0; writes faulted: \
         [{}]; created, clean → most in a faulted life: {created}; {:.1}s",
        t.walked,
        t.passes,
        t.faults,
        t.faults_on_writes,
        t.failed_passes,
        writes.join(", "),
        started.elapsed().as_secs_f64()
    );
}

async fn instant_region() -> Env {
    // Every injected fault is a failed call that the Kubernetes client would log as an error.
    init_logs_with("warn,kube_client=off");
    env_with_delays(None, Delays::instant()).await
}

/// A clean life, then a life with `fault` at every call of every pass, in one region; the
/// walked life must match the clean one step by step.
async fn walk_every_call(fault: Fault) {
    let env = instant_region().await;
    let started = Instant::now();
    let clean = Life::live(&env, Faulting::Clean).await;
    let walked = Life::live(&env, Faulting::EveryCall(fault)).await;
    walked.assert_like(&clean);
    let t = &walked.tally;
    summary(
        &fault.to_string(),
        t,
        &walked.hit,
        created_summary(&clean.created, &[&walked.created]),
        started,
    );
    assert!(
        t.faults > t.walked,
        "{fault}: the walk must fault passes beyond their first call: {t:?}"
    );
    assert!(t.faults_on_writes > 0, "{fault}: no write was hit: {t:?}");
    if fault.kind == ArmedKind::Refuse {
        // Without retries, nothing may take a refused call for an answer.
        assert_eq!(
            t.failed_passes, t.faults,
            "{fault}: a pass ended well although a call of it was refused"
        );
    }
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_digitalocean_call_refused_in_turn() {
    walk_every_call(Fault {
        api: Api::Do,
        kind: ArmedKind::Refuse,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_digitalocean_call_with_its_response_lost_in_turn() {
    walk_every_call(Fault {
        api: Api::Do,
        kind: ArmedKind::LoseResponse,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kubernetes_call_refused_in_turn() {
    walk_every_call(Fault {
        api: Api::Kube,
        kind: ArmedKind::Refuse,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kubernetes_call_with_its_response_lost_in_turn() {
    walk_every_call(Fault {
        api: Api::Kube,
        kind: ArmedKind::LoseResponse,
    })
    .await;
}

/// A clean life, then one life per write that the clean life sent to `api`, in which that
/// write alone is served and its answer lost, and the passes carry on: a walked pass ends at
/// its fault, so only here is what a worker does after the answer to a re-sent write seen.
async fn lose_every_write_once(api: Api) {
    let env = instant_region().await;
    let started = Instant::now();
    let clean = Life::live(&env, Faulting::Clean).await;
    let writes = clean.writes[&api];
    assert!(writes > 0);
    let mut lives = Vec::new();
    for nth in 0..writes {
        let life = Life::live(&env, Faulting::LostWrite { api, nth }).await;
        life.assert_like(&clean);
        lives.push(life);
    }
    let mut total = Tally::default();
    let mut hit = BTreeMap::new();
    for life in &lives {
        total.add(&life.tally);
        for (request, n) in &life.hit {
            *hit.entry(request.clone()).or_default() += n;
        }
    }
    let created: Vec<&Created> = lives.iter().map(|l| &l.created).collect();
    summary(
        &format!(
            "{}/lose_response once per life ({writes} lives)",
            api_name(api)
        ),
        &total,
        &hit,
        created_summary(&clean.created, &created),
        started,
    );
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_digitalocean_write_with_its_response_lost_once_per_life() {
    lose_every_write_once(Api::Do).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kubernetes_write_with_its_response_lost_once_per_life() {
    lose_every_write_once(Api::Kube).await;
}
