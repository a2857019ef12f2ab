//! The autoscaler's decision: from a model deployment's declared bounds and SLO, what its
//! model servers and endpoint picker report (vLLM's and the EPP's Prometheus metrics, read as a
//! DOKS cluster exposes them: through the API server's pod proxy), and what it remembers from
//! its last look, how many replicas the deployment should have now, and why.
//!
//! The rule, per look (every `autoscale_interval`):
//! - **Pressure** is the largest of: the declared percentile of time to first token and of time
//!   per output token since the last look, each against [`HEADROOM`] of its SLO; the KV cache's
//!   use against 85 %; and requests waiting in vLLM's queue (a full batch). Aiming under the SLO
//!   is what absorbs the minutes a new replica takes (a GPU node, then the model's load): a
//!   deployment scales while it still meets its SLO, not after.
//! - **Up**, when pressure is above 1: to `ceil(ready × pressure)` replicas (at most twice as
//!   many, within `max_replicas`). Computed from the replicas that serve, never from those still
//!   starting, so a slow start does not pile up more replicas.
//! - **Down**, one replica at a time, when for a whole `scale_down_window` every look found the
//!   load would still fit in one replica fewer (pressure × ready / (ready − 1) under [`CALM`]) and
//!   nothing changed the count meanwhile: hysteresis against flapping, and each step is a scale
//!   change that the update path makes without dropping a request.
//! - **To zero**, with `min_replicas` 0, after `scale_to_zero_after_seconds` without a request.
//!   **From zero**, as soon as the gateway holds a request (the EPP's flow-control queue): the
//!   gateway keeps it until a replica is ready.
//!
//! Pure: no I/O, time comes in as an argument, and the memory it returns is all it keeps.

use std::collections::BTreeMap;
use std::time::Duration;

use api_types::spec::ModelDeployment;
use serde::{Deserialize, Serialize};

/// The share of an SLO the autoscaler aims under.
pub const HEADROOM: f64 = 0.8;
/// The KV-cache use past which a replica is short of memory for new sequences.
pub const KV_HIGH: f64 = 0.85;
/// A look is calm when the load would fit in one replica fewer at this share of the pressure
/// that scales up: the gap between the two is the hysteresis.
pub const CALM: f64 = 0.6;

/// A deployment's declared scaling bounds and objectives.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub min: u32,
    pub max: u32,
    pub scale_to_zero_after: Duration,
    /// Seconds.
    pub ttft_slo: Option<f64>,
    /// Seconds.
    pub tpot_slo: Option<f64>,
    /// 0–100.
    pub percentile: f64,
}

impl Policy {
    /// How stale the recorded time of the last request may grow before a look writes it (see
    /// [`Memory::news_since`]): a tenth of the idle time to zero, at most a minute, so that a
    /// takeover scales to zero at most that much early.
    pub fn memory_slack(&self) -> Duration {
        (self.scale_to_zero_after / 10).min(Duration::from_secs(60))
    }

    /// The policy of a deployment that declares `autoscaling`; `None` keeps its fixed scale.
    pub fn of(md: &ModelDeployment) -> Option<Policy> {
        let w = md.workload();
        let a = w.autoscaling?;
        let start = md
            .accelerators
            .first()
            .map_or(1, |g| u32::try_from(g.scale).unwrap_or(0));
        let slo = w.slo.unwrap_or_default();
        let min = a.min_replicas.unwrap_or(1);
        Some(Policy {
            min,
            max: a.max_replicas.unwrap_or(start).max(min),
            scale_to_zero_after: Duration::from_secs(
                a.scale_to_zero_after_seconds.unwrap_or(600).into(),
            ),
            ttft_slo: slo.ttft_ms.map(|ms| ms / 1000.0),
            tpot_slo: slo.tpot_ms.map(|ms| ms / 1000.0),
            percentile: slo.percentile.unwrap_or(90.0),
        })
    }
}

/// A cumulative histogram: `(upper bound, count ≤ bound)` in bound order, `+Inf` last.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    #[serde(with = "bounds")]
    pub buckets: Vec<(f64, f64)>,
}

/// JSON has no infinity (serde_json writes `null`, then cannot read it back as a number): the
/// `+Inf` bound is stored as `null`.
mod bounds {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(b: &[(f64, f64)], s: S) -> Result<S::Ok, S::Error> {
        b.iter()
            .map(|&(le, n)| (le.is_finite().then_some(le), n))
            .collect::<Vec<_>>()
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(f64, f64)>, D::Error> {
        let b = Vec::<(Option<f64>, f64)>::deserialize(d)?;
        Ok(b.into_iter()
            .map(|(le, n)| (le.unwrap_or(f64::INFINITY), n))
            .collect())
    }
}

impl Histogram {
    fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |b| b.1)
    }

    /// `self − earlier`, bucket by bucket; a reset counter (a restarted server) counts from 0.
    fn since(&self, earlier: Option<&Histogram>) -> Histogram {
        let Some(e) = earlier.filter(|e| e.buckets.len() == self.buckets.len()) else {
            return self.clone();
        };
        if self
            .buckets
            .iter()
            .zip(&e.buckets)
            .any(|(a, b)| a.0 != b.0 || a.1 < b.1)
        {
            // A counter went down (or the layout changed): the server restarted.
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&e.buckets)
                .map(|(a, b)| (a.0, (a.1 - b.1).max(0.0)))
                .collect(),
        }
    }

    /// Adds `other` bucket by bucket, matched by bound (a bound only one side has is kept as
    /// it is: both are cumulative, so the sum stays a valid, if coarser, histogram only where
    /// the bounds agree; servers of one deployment run one vLLM and share a layout).
    fn add(&mut self, other: &Histogram) {
        for &(le, count) in &other.buckets {
            match self.buckets.iter_mut().find(|b| b.0 == le) {
                Some(b) => b.1 += count,
                None => self.buckets.push((le, count)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    /// The `q`-quantile (0–1) as Prometheus's `histogram_quantile` estimates it: linear within
    /// the bucket it falls in. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let in_bucket = count - lower.1;
                let frac = if in_bucket > 0.0 {
                    (rank - lower.1) / in_bucket
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * frac);
            }
            lower = (le, count);
        }
        Some(lower.0)
    }
}

/// What one model server reports: gauges now, counters since it started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Scrape {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
    pub requests: f64,
    pub ttft: Histogram,
    pub tpot: Histogram,
}

/// One sample line of Prometheus's text format: name, labels, value.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        // `name{labels} value [timestamp]`; label values may hold spaces, so split after `}`.
        let (series, rest) = match line.rfind('}') {
            Some(i) => (&line[..=i], line[i + 1..].trim_start()),
            None => line.split_once(' ')?,
        };
        let value: f64 = match rest.split_whitespace().next()? {
            "+Inf" => f64::INFINITY,
            v => v.parse().ok()?,
        };
        if value.is_nan() {
            return None;
        }
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        Some((name, labels, value))
    })
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    // Label values here never contain `",`; a full parser is not needed for vLLM's output.
    labels.split("\",").find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim_start_matches(',').trim() == key).then(|| v.trim_matches('"'))
    })
}

fn bucket(h: &mut Histogram, labels: &str, value: f64) {
    let le = match label(labels, "le") {
        Some("+Inf") => f64::INFINITY,
        Some(v) => match v.parse() {
            Ok(v) => v,
            Err(_) => return,
        },
        None => return,
    };
    match h.buckets.iter_mut().find(|b| b.0 == le) {
        Some(b) => b.1 += value,
        None => h.buckets.push((le, value)),
    }
}

/// A vLLM server's `/metrics`. Series of every engine and finish reason add up.
pub fn parse_vllm(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for (name, labels, v) in samples(text) {
        match name {
            "vllm:num_requests_running" => s.running += v,
            "vllm:num_requests_waiting" => s.waiting += v,
            "vllm:kv_cache_usage_perc" => s.kv_usage = s.kv_usage.max(v),
            "vllm:request_success_total" => s.requests += v,
            "vllm:time_to_first_token_seconds_bucket" => bucket(&mut s.ttft, labels, v),
            // vLLM renamed TPOT to inter-token latency; servers may report either.
            "vllm:inter_token_latency_seconds_bucket"
            | "vllm:time_per_output_token_seconds_bucket" => bucket(&mut s.tpot, labels, v),
            _ => {}
        }
    }
    for h in [&mut s.ttft, &mut s.tpot] {
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    // A server reporting both TPOT names counted each observation twice.
    if text.contains("vllm:inter_token_latency_seconds_bucket")
        && text.contains("vllm:time_per_output_token_seconds_bucket")
    {
        for b in &mut s.tpot.buckets {
            b.1 /= 2.0;
        }
    }
    s
}

/// Requests the gateway holds for `pool` because no replica can take them: the EPP's
/// flow-control queue.
pub fn parse_epp_queue(text: &str, pool: &str) -> f64 {
    samples(text)
        .filter(|(name, labels, _)| {
            *name == "inference_extension_flow_control_queue_size"
                && label(labels, "inference_pool").is_none_or(|p| p == pool)
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// What the autoscaler remembers about a deployment between looks (stored with it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// The spec version the count derives from: a new version starts again from its `scale`.
    pub version: i32,
    pub wanted: u32,
    /// Milliseconds since the epoch, as every time here.
    pub changed_at: i64,
    pub last_request_at: i64,
    /// Since when every look has been calm; `None` when the last one was not.
    pub calm_since: Option<i64>,
    /// The last look's counters per model server.
    pub last: BTreeMap<String, Scrape>,
    /// No scale-up before this time: the cloud refused the last one (no GPU capacity).
    #[serde(default)]
    pub up_refused_until: Option<i64>,
    /// When the latency histograms' baseline in `last` was taken.
    #[serde(default)]
    pub window_since: i64,
}

impl Memory {
    /// Whether this memory (after a look) says something the `recorded` one does not that a
    /// worker taking the deployment over would need, so that it is worth a write. The count and
    /// its timers are. The servers' counters (`last`, `window_since`) are not: they move at
    /// every look under load, and a takeover from an older baseline judges a longer window (or,
    /// past [`MAX_WINDOW_MS`], starts a new one) and still counts every request since as use.
    /// The time of the last request is, once it moved `slack` past the recorded one: a
    /// takeover that finds the servers replaced cannot see their requests, and counts the idle
    /// time from the recorded time.
    pub fn news_since(&self, recorded: &Memory, slack: Duration) -> bool {
        let decided = |m: &Memory| {
            (
                m.version,
                m.wanted,
                m.changed_at,
                m.calm_since,
                m.up_refused_until,
            )
        };
        let slack_ms = i64::try_from(slack.as_millis()).unwrap_or(i64::MAX);
        decided(self) != decided(recorded)
            || self
                .last_request_at
                .saturating_sub(recorded.last_request_at)
                >= slack_ms
    }

    /// A deployment's memory as its spec `version` starts: `scale` replicas, as if just used.
    pub fn start(version: i32, scale: u32, now: i64) -> Memory {
        Memory {
            version,
            wanted: scale,
            changed_at: now,
            last_request_at: now,
            calm_since: None,
            last: BTreeMap::new(),
            up_refused_until: None,
            window_since: now,
        }
    }
}

/// What one look saw.
#[derive(Debug, Clone, Default)]
pub struct Look {
    /// The ready model servers and what each reported.
    pub ready: BTreeMap<String, Scrape>,
    /// Requests held by the gateway (the EPP's queue); `None` when the EPP could not be read.
    pub held: Option<f64>,
    /// Ready model servers whose metrics could not be read. A look that misses some never
    /// removes a replica (no reading is not the same as no load), and keeps their last counters.
    pub unread: Vec<String>,
}

/// A change of the wanted count, as its event says it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// `ScaledUp`, `ScaledDown`, `ScaledToZero` or `ScaledFromZero`.
    pub reason: &'static str,
    pub message: String,
}

/// The count to run now and the memory to keep; `decision` says why the count changed.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub memory: Memory,
    pub decision: Option<Decision>,
}

/// The signals behind a look, summed over the ready servers since the last look.
#[derive(Debug, Clone, Default)]
struct Signals {
    requests: f64,
    in_flight: f64,
    waiting: f64,
    kv_usage: f64,
    ttft: Option<f64>,
    tpot: Option<f64>,
    /// Whether the latency histograms held enough requests to judge: a percentile of three
    /// requests is the slowest of them (a cold prefill), not the deployment's latency.
    latency_judged: bool,
}

/// Requests a window must hold before its latency percentiles count; until then the window
/// grows (the histograms' baseline stays where it was), for at most [`MAX_WINDOW_MS`].
pub const MIN_SAMPLES: f64 = 20.0;
/// The oldest a latency window may reach: older requests (a load that has gone) are not the
/// deployment's latency now, so an unjudged window this old starts again.
pub const MAX_WINDOW_MS: i64 = 60_000;

fn signals(policy: &Policy, memory: &Memory, look: &Look, now: i64) -> Signals {
    let mut s = Signals::default();
    let (mut ttft, mut tpot) = (Histogram::default(), Histogram::default());
    for (pod, now) in &look.ready {
        s.in_flight += now.running + now.waiting;
        s.waiting += now.waiting;
        s.kv_usage = s.kv_usage.max(now.kv_usage);
        // A server not seen before is a baseline: its counters may hold hours of history.
        let Some(before) = memory.last.get(pod) else {
            continue;
        };
        s.requests += if now.requests >= before.requests {
            now.requests - before.requests
        } else {
            // Restarted: what it served since.
            now.requests
        };
        ttft.add(&now.ttft.since(Some(&before.ttft)));
        tpot.add(&now.tpot.since(Some(&before.tpot)));
    }
    let stale = now - memory.window_since >= MAX_WINDOW_MS;
    s.latency_judged = !stale && ttft.count() >= MIN_SAMPLES;
    if s.latency_judged {
        let q = (policy.percentile / 100.0).clamp(0.0, 1.0);
        s.ttft = ttft.quantile(q);
        s.tpot = tpot.quantile(q);
    }
    s
}

/// How far past its targets the deployment runs (1: at them), with the signal that says so.
fn pressure(policy: &Policy, s: &Signals, ready: usize) -> (f64, String) {
    let p = policy.percentile;
    let mut worst = (0.0, String::from("no load"));
    let mut consider = |value: f64, why: String| {
        if value > worst.0 {
            worst = (value, why);
        }
    };
    if let (Some(slo), Some(v)) = (policy.ttft_slo, s.ttft) {
        consider(
            v / (slo * HEADROOM),
            format!(
                "TTFT p{p} {:.0} ms against the {:.0} ms SLO",
                v * 1e3,
                slo * 1e3
            ),
        );
    }
    if let (Some(slo), Some(v)) = (policy.tpot_slo, s.tpot) {
        consider(
            v / (slo * HEADROOM),
            format!(
                "TPOT p{p} {:.1} ms against the {:.0} ms SLO",
                v * 1e3,
                slo * 1e3
            ),
        );
    }
    consider(
        s.kv_usage / KV_HIGH,
        format!("KV cache {:.0} % used", s.kv_usage * 100.0),
    );
    if s.waiting > 0.0 && ready > 0 {
        // Queued in vLLM means every batch slot is taken: one more replica per queued batch.
        consider(
            1.0 + s.waiting / s.in_flight.max(1.0),
            format!(
                "{} requests queued in the model servers ({} in flight)",
                s.waiting, s.in_flight
            ),
        );
    }
    worst
}

/// One look: the count the deployment should have and the memory to keep.
pub fn decide(
    policy: &Policy,
    memory: &Memory,
    look: &Look,
    now: i64,
    scale_down_window: Duration,
) -> Outcome {
    let mut m = memory.clone();
    let ready = look.ready.len();
    let s = signals(policy, memory, look, now);
    let held = look.held.unwrap_or(0.0);
    if s.requests > 0.0 || s.in_flight > 0.0 || held > 0.0 {
        m.last_request_at = now;
    }
    if ready == 0 && m.wanted > 0 {
        // Replicas on their way (a wake, a node being made) count as use: the idle time runs
        // from when one serves, not from the request that asked for it.
        m.last_request_at = now;
    }
    m.last = look.ready.clone();
    if !s.latency_judged && now - memory.window_since < MAX_WINDOW_MS {
        // (A stale window is not judged and starts again below.)
        // Too few requests since the baseline: keep it, so the next window is longer.
        for (pod, scrape) in m.last.iter_mut() {
            if let Some(before) = memory.last.get(pod) {
                scrape.ttft = before.ttft.clone();
                scrape.tpot = before.tpot.clone();
            }
        }
    } else {
        m.window_since = now;
    }
    for pod in &look.unread {
        if let Some(kept) = memory.last.get(pod) {
            m.last.insert(pod.clone(), kept.clone());
        }
    }
    let clamp = |n: u32| n.clamp(policy.min, policy.max.max(policy.min));
    let set = |m: &mut Memory, wanted: u32, reason: &'static str, message: String| {
        let from = m.wanted;
        m.wanted = wanted;
        m.changed_at = now;
        m.calm_since = None;
        Some(Decision {
            reason,
            message: format!("{message}: {from} → {wanted} replicas"),
        })
    };

    // From zero: a request waits at the gateway.
    if m.wanted == 0 {
        let decision = (held > 0.0 || s.requests > 0.0).then(|| {
            let to = clamp(1);
            set(
                &mut m,
                to.max(1),
                "ScaledFromZero",
                format!("{held} requests held by the gateway with no replica"),
            )
        });
        return Outcome {
            memory: m,
            decision: decision.flatten(),
        };
    }

    // Up.
    let (pressure, why) = pressure(policy, &s, ready);
    if ready > 0 && pressure > 1.0 {
        let target = (ready as f64 * pressure.min(2.0)).ceil() as u32;
        let target = clamp(target);
        m.calm_since = None;
        let refused = m.up_refused_until.is_some_and(|until| now < until);
        if target > m.wanted && !refused {
            let decision = set(
                &mut m,
                target,
                "ScaledUp",
                format!(
                    "{why} ({:.0} % of the target) with {ready} ready",
                    pressure * 100.0
                ),
            );
            return Outcome {
                memory: m,
                decision,
            };
        }
        return Outcome {
            memory: m,
            decision: None,
        };
    }

    if !look.unread.is_empty() {
        m.calm_since = None;
        return Outcome {
            memory: m,
            decision: None,
        };
    }

    // Zero, after the idle time.
    let idle_ms = now - m.last_request_at;
    // Zero needs the gateway's word that it holds nothing (an unread picker might).
    if policy.min == 0
        && look.held.is_some()
        && idle_ms >= policy.scale_to_zero_after.as_millis() as i64
    {
        let decision = set(
            &mut m,
            0,
            "ScaledToZero",
            format!("no request for {} s", idle_ms / 1000),
        );
        return Outcome {
            memory: m,
            decision,
        };
    }

    // Down, one at a time, after a calm window.
    let floor = policy.min.max(1);
    let calm = ready > 1 && ready as u32 >= m.wanted && {
        let fewer = ready as f64 - 1.0;
        pressure * ready as f64 / fewer < CALM
    };
    if !calm || m.wanted <= floor {
        m.calm_since = None;
        return Outcome {
            memory: m,
            decision: None,
        };
    }
    let since = *m.calm_since.get_or_insert(now);
    let window = scale_down_window.as_millis() as i64;
    if now - since >= window && now - m.changed_at >= window {
        let fewer = m.wanted - 1;
        let decision = set(
            &mut m,
            fewer,
            "ScaledDown",
            format!(
                "calm for {} s ({why}, {:.0} % of the target)",
                (now - since) / 1000,
                pressure * 100.0
            ),
        );
        return Outcome {
            memory: m,
            decision,
        };
    }
    Outcome {
        memory: m,
        decision: None,
    }
}

/// The annotation with which the ReplicaSet controller ranks a Deployment's pods for removal
/// (Kubernetes's `PodDeletionCost`, on by default since 1.22): the lowest goes first.
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// The deletion cost each ready model server should carry before its Deployment shrinks: its
/// requests in flight (running and waiting, as last read), so that Kubernetes removes the least
/// busy and the busiest keep their streams. Only pods whose mark would change are returned
/// (`marked`: each pod's current annotation).
pub fn deletion_costs(
    in_flight: &BTreeMap<String, f64>,
    marked: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    in_flight
        .iter()
        .map(|(pod, n)| {
            (
                pod,
                (n.max(0.0).round() as i64)
                    .min(i64::from(i32::MAX))
                    .to_string(),
            )
        })
        .filter(|(pod, cost)| marked.get(*pod) != Some(cost))
        .map(|(pod, cost)| (pod.clone(), cost))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1000;

    fn policy(min: u32, max: u32) -> Policy {
        Policy {
            min,
            max,
            scale_to_zero_after: Duration::from_secs(60),
            ttft_slo: Some(0.6),
            tpot_slo: Some(0.06),
            percentile: 90.0,
        }
    }

    /// A histogram with `n` observations all at `at` seconds, over vLLM's TTFT buckets.
    fn hist(at: f64, n: f64) -> Histogram {
        let les = [
            0.01,
            0.05,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            f64::INFINITY,
        ];
        Histogram {
            buckets: les
                .iter()
                .map(|&le| (le, if at <= le { n } else { 0.0 }))
                .collect(),
        }
    }

    fn server(requests: f64, ttft: f64, running: f64, waiting: f64) -> Scrape {
        Scrape {
            running,
            waiting,
            kv_usage: 0.1,
            requests,
            ttft: hist(ttft, requests),
            tpot: hist(0.005, requests),
        }
    }

    fn look(servers: &[(&str, Scrape)], held: f64) -> Look {
        Look {
            ready: servers
                .iter()
                .map(|(p, s)| (p.to_string(), s.clone()))
                .collect(),
            held: Some(held),
            unread: Vec::new(),
        }
    }

    /// Under steady load within the SLO, each look moves only the servers' counters and the time
    /// of the last request: nothing worth a write until that time has moved the policy's slack;
    /// a takeover from the recorded memory decides the same count; a new count is news at once.
    #[test]
    fn looks_under_steady_load_are_news_only_once_the_slack_passed() {
        let p = policy(1, 4);
        let slack = p.memory_slack();
        assert_eq!(slack, Duration::from_secs(6), "a tenth of a minute to zero");
        let mut m = Memory::start(1, 2, 0);
        let servers = |n: f64| {
            look(
                &[
                    ("a", server(n * 10.0, 0.2, 2.0, 0.0)),
                    ("b", server(n * 10.0, 0.2, 2.0, 0.0)),
                ],
                0.0,
            )
        };
        for second in 0..=1 {
            m = decide(
                &p,
                &m,
                &servers(second as f64),
                second * S,
                Duration::from_secs(600),
            )
            .memory;
        }
        let recorded = m.clone();
        let mut news_at = None;
        for second in 2..=10 {
            let now = second * S;
            let look_from = |m: &Memory| {
                decide(
                    &p,
                    m,
                    &servers(second as f64),
                    now,
                    Duration::from_secs(600),
                )
            };
            let o = look_from(&m);
            assert_eq!((o.decision.is_none(), o.memory.wanted), (true, 2));
            assert_ne!(o.memory.last, m.last, "the counters moved");
            let taken_over = look_from(&recorded);
            assert_eq!(taken_over.memory.wanted, o.memory.wanted);
            assert_eq!(
                taken_over.memory.last_request_at, now,
                "a takeover sees the use"
            );
            if news_at.is_none() && o.memory.news_since(&recorded, slack) {
                news_at = Some(second);
            }
            m = o.memory;
        }
        assert_eq!(news_at, Some(7), "six seconds after the recorded look");
        let scaled = Memory {
            wanted: 3,
            ..recorded.clone()
        };
        assert!(scaled.news_since(&recorded, slack));
        let calm = Memory {
            calm_since: Some(5 * S),
            ..recorded.clone()
        };
        assert!(calm.news_since(&recorded, slack));
    }

    #[test]
    fn parses_vllm_and_epp_metrics() {
        let text = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 7.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 3.0\n\
            vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.1\",model_name=\"m\"} 4.0\n\
            vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 10.0\n\
            vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"1.0\",model_name=\"m\"} 10.0\n\
            vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 10.0\n";
        let s = parse_vllm(text);
        assert_eq!((s.running, s.waiting, s.kv_usage), (3.0, 2.0, 0.5));
        assert_eq!(s.requests, 10.0);
        assert_eq!(
            s.ttft.buckets,
            vec![(0.1, 4.0), (1.0, 10.0), (f64::INFINITY, 10.0)]
        );
        // Half the observations fall in (0.1, 1.0]: p70 is a third of the way in.
        let p70 = s.ttft.quantile(0.7).unwrap();
        assert!((p70 - 0.55).abs() < 1e-9, "{p70}");
        let epp = "inference_extension_flow_control_queue_size{inference_pool=\"pool-a\"} 2\n\
                   inference_extension_flow_control_queue_size{inference_pool=\"pool-b\"} 5\n";
        assert_eq!(parse_epp_queue(epp, "pool-a"), 2.0);
        assert_eq!(parse_epp_queue("", "pool-a"), 0.0);
    }

    #[test]
    fn slow_first_tokens_scale_up_in_proportion_and_within_bounds() {
        let p = policy(1, 4);
        let mut m = Memory::start(1, 1, 0);
        m.last = [("a".to_string(), server(0.0, 0.0, 0.0, 0.0))].into();
        // TTFT p90 of 0.75 s against 0.8 × 600 ms: pressure 1.56 → 2 replicas.
        let o = decide(
            &p,
            &m,
            &look(&[("a", server(20.0, 0.7, 8.0, 0.0))], 0.0),
            10 * S,
            Duration::from_secs(60),
        );
        let d = o.decision.expect("scaled");
        assert_eq!((d.reason, o.memory.wanted), ("ScaledUp", 2));
        assert!(d.message.contains("TTFT p90"), "{}", d.message);
        // Never past max_replicas.
        let mut m = Memory::start(1, 3, 0);
        m.last = [
            ("a".into(), Scrape::default()),
            ("b".into(), Scrape::default()),
            ("c".into(), Scrape::default()),
        ]
        .into();
        let busy = server(20.0, 4.0, 8.0, 4.0);
        let o = decide(
            &p,
            &m,
            &look(
                &[("a", busy.clone()), ("b", busy.clone()), ("c", busy)],
                0.0,
            ),
            10 * S,
            Duration::from_secs(60),
        );
        assert_eq!(o.memory.wanted, 4);
    }

    #[test]
    fn replicas_still_starting_are_not_added_again() {
        let p = policy(1, 8);
        let mut m = Memory::start(1, 1, 0);
        m.last = [("a".to_string(), Scrape::default())].into();
        let slow = look(&[("a", server(20.0, 0.7, 8.0, 0.0))], 0.0);
        let first = decide(&p, &m, &slow, 10 * S, Duration::from_secs(60));
        assert_eq!(first.memory.wanted, 2);
        // The second replica loads; the same pressure on the one ready changes nothing.
        let mut again = first.memory.clone();
        again.last = [("a".to_string(), Scrape::default())].into();
        let second = decide(&p, &again, &slow, 20 * S, Duration::from_secs(60));
        assert_eq!(second.memory.wanted, 2);
        assert!(second.decision.is_none());
    }

    #[test]
    fn calm_load_scales_down_one_at_a_time_after_the_window() {
        let p = policy(1, 4);
        let window = Duration::from_secs(60);
        let mut m = Memory::start(1, 3, 0);
        let light = |n: f64| {
            look(
                &[
                    ("a", server(n, 0.05, 1.0, 0.0)),
                    ("b", server(n, 0.05, 1.0, 0.0)),
                    ("c", server(n, 0.05, 1.0, 0.0)),
                ],
                0.0,
            )
        };
        let mut t = 0;
        let mut downs = Vec::new();
        for i in 1..=20 {
            t = i * 10 * S;
            let o = decide(&p, &m, &light(i as f64), t, window);
            if let Some(d) = &o.decision {
                downs.push((t, d.reason, o.memory.wanted));
            }
            m = o.memory;
            if m.wanted == 2 {
                break;
            }
        }
        // Calm from the first look (10 s), down once a full window later (70 s).
        assert_eq!(downs, vec![(70 * S, "ScaledDown", 2)]);
        assert_eq!(t, 70 * S);
        // A look under pressure resets the calm window.
        let o = decide(
            &p,
            &m,
            &look(
                &[
                    ("a", server(40.0, 0.7, 8.0, 0.0)),
                    ("b", server(40.0, 0.7, 8.0, 0.0)),
                ],
                0.0,
            ),
            t + 10 * S,
            window,
        );
        assert_eq!(o.memory.calm_since, None);
    }

    #[test]
    fn load_that_would_not_fit_in_fewer_keeps_the_count() {
        let p = policy(1, 4);
        let mut m = Memory::start(1, 2, 0);
        // TTFT p90 about 475 ms against 480 ms (80 % of the SLO): at the target, not past it,
        // and on one replica it would be twice as far.
        for i in 1..=30 {
            let o = decide(
                &p,
                &m,
                &look(
                    &[
                        ("a", server(i as f64 * 5.0, 0.35, 4.0, 0.0)),
                        ("b", server(i as f64 * 5.0, 0.35, 4.0, 0.0)),
                    ],
                    0.0,
                ),
                i * 10 * S,
                Duration::from_secs(60),
            );
            assert!(o.decision.is_none(), "{:?}", o.decision);
            m = o.memory;
        }
        assert_eq!(m.wanted, 2);
    }

    #[test]
    fn idle_reaches_zero_and_a_held_request_wakes_it() {
        let p = policy(0, 2);
        let mut m = Memory::start(1, 1, 0);
        let idle = look(&[("a", Scrape::default())], 0.0);
        let o = decide(&p, &m, &idle, 59 * S, Duration::from_secs(60));
        assert!(o.decision.is_none());
        m = o.memory;
        let o = decide(&p, &m, &idle, 61 * S, Duration::from_secs(60));
        let d = o.decision.expect("to zero");
        assert_eq!((d.reason, o.memory.wanted), ("ScaledToZero", 0));
        m = o.memory;
        // Nothing held: it stays at zero.
        let o = decide(&p, &m, &look(&[], 0.0), 100 * S, Duration::from_secs(60));
        assert_eq!(o.memory.wanted, 0);
        // A request waits at the gateway: one replica, at once.
        let o = decide(
            &p,
            &o.memory,
            &look(&[], 1.0),
            110 * S,
            Duration::from_secs(60),
        );
        assert_eq!(o.decision.map(|d| d.reason), Some("ScaledFromZero"));
        assert_eq!(o.memory.wanted, 1);
        // ... and the wake counts as use: not back to zero at the next look.
        let o = decide(
            &p,
            &o.memory,
            &look(&[], 0.0),
            120 * S,
            Duration::from_secs(60),
        );
        assert_eq!(o.memory.wanted, 1);
    }

    #[test]
    fn unreadable_servers_never_count_as_idle() {
        let p = policy(0, 3);
        let mut m = Memory::start(1, 2, 0);
        let blind = Look {
            ready: [("a".to_string(), Scrape::default())].into(),
            held: None,
            unread: vec!["b".into()],
        };
        for i in 1..=100 {
            let o = decide(&p, &m, &blind, i * 10 * S, Duration::from_secs(60));
            assert!(o.decision.is_none(), "{:?}", o.decision);
            m = o.memory;
        }
        assert_eq!(m.wanted, 2);
    }

    #[test]
    fn without_min_zero_idle_stops_at_the_floor() {
        let p = policy(1, 3);
        let mut m = Memory::start(1, 1, 0);
        for i in 1..=100 {
            m = decide(
                &p,
                &m,
                &look(&[("a", Scrape::default())], 0.0),
                i * 10 * S,
                Duration::from_secs(60),
            )
            .memory;
        }
        assert_eq!(m.wanted, 1);
    }

    /// A server whose metrics read timed out for one look (so it is dropped from `last`) must
    /// not have its whole lifetime counted at the next look: two servers that served 1,000
    /// slow requests long ago and 10 fast ones since must not scale up.
    #[test]
    fn a_server_unread_for_one_look_is_not_counted_from_its_start() {
        let p = policy(1, 8);
        let old = |n: f64| Scrape {
            running: 1.0,
            waiting: 0.0,
            kv_usage: 0.1,
            requests: n,
            ttft: hist(2.0, n),
            tpot: hist(0.005, n),
        };
        let mut m = Memory::start(1, 2, 0);
        m.last = [
            ("a".to_string(), old(1000.0)),
            ("b".to_string(), old(1000.0)),
        ]
        .into();
        // Look 1: "a" times out (unread), "b" served 10 fast requests.
        let mut b1 = old(1000.0);
        b1.requests += 10.0;
        b1.ttft.add(&hist(0.05, 10.0));
        let blind = Look {
            ready: [("b".to_string(), b1.clone())].into(),
            held: Some(0.0),
            unread: vec!["a".into()],
        };
        let o = decide(&p, &m, &blind, 10 * S, Duration::from_secs(60));
        assert!(o.decision.is_none(), "{:?}", o.decision);
        // Look 2: both read; each served 10 more fast requests.
        let mut a2 = old(1000.0);
        a2.requests += 20.0;
        a2.ttft.add(&hist(0.05, 20.0));
        let mut b2 = b1;
        b2.requests += 10.0;
        b2.ttft.add(&hist(0.05, 10.0));
        let o = decide(
            &p,
            &o.memory,
            &look(&[("a", a2), ("b", b2)], 0.0),
            20 * S,
            Duration::from_secs(60),
        );
        assert!(
            o.decision.is_none(),
            "fast recent requests scaled up on stale history: {:?}",
            o.decision
        );
    }

    /// The first steady look after a spec change (`Memory::start`: `last` empty) counts every
    /// long-lived server's lifetime histograms: a PATCH that only changes the bounds scales up
    /// on load from hours ago.
    #[test]
    fn a_new_spec_version_does_not_count_lifetime_history() {
        let p = policy(1, 8);
        // Hours ago: 1,000 requests at 2 s TTFT; since the last look: nothing slow.
        let long_lived = Scrape {
            running: 1.0,
            waiting: 0.0,
            kv_usage: 0.1,
            requests: 1000.0,
            ttft: hist(2.0, 1000.0),
            tpot: hist(0.005, 1000.0),
        };
        let m = Memory::start(2, 2, 0);
        let o = decide(
            &p,
            &m,
            &look(&[("a", long_lived.clone()), ("b", long_lived)], 0.0),
            10 * S,
            Duration::from_secs(60),
        );
        assert!(o.decision.is_none(), "{:?}", o.decision);
    }

    /// Right after a wake from zero the replica is still getting a GPU node and loading its
    /// model (minutes); the held request gave up after 30 s. The idle clock must not send the
    /// deployment back to zero before a replica has ever served.
    #[test]
    fn a_wake_is_not_undone_before_a_replica_serves() {
        let p = policy(0, 2); // scale_to_zero_after 60 s, the smallest the API accepts
        let mut m = Memory::start(1, 0, 0);
        m.wanted = 0;
        let o = decide(&p, &m, &look(&[], 1.0), 100 * S, Duration::from_secs(60));
        assert_eq!(o.memory.wanted, 1);
        // 70 s later: no replica ready yet, nothing held any more.
        let o = decide(
            &p,
            &o.memory,
            &look(&[], 0.0),
            170 * S,
            Duration::from_secs(60),
        );
        assert_eq!(
            o.memory.wanted, 1,
            "scaled to zero before any replica was ready: {:?}",
            o.decision
        );
    }

    #[test]
    fn a_few_slow_requests_are_not_a_percentile() {
        let p = policy(1, 4);
        let mut m = Memory::start(1, 1, 0);
        m.last = [("a".to_string(), Scrape::default())].into();
        // Three cold prefills of 2 s each: too few to judge, nothing scales.
        let o = decide(
            &p,
            &m,
            &look(&[("a", server(3.0, 2.0, 1.0, 0.0))], 0.0),
            10 * S,
            Duration::from_secs(60),
        );
        assert!(o.decision.is_none(), "{:?}", o.decision);
        // The window grows: with 30 more slow ones since the same baseline, it scales.
        let o = decide(
            &p,
            &o.memory,
            &look(&[("a", server(33.0, 2.0, 1.0, 0.0))], 0.0),
            20 * S,
            Duration::from_secs(60),
        );
        assert_eq!(o.decision.map(|d| d.reason), Some("ScaledUp"));
    }

    #[test]
    fn a_window_never_reaches_back_past_its_limit() {
        let p = policy(1, 4);
        let mut m = Memory::start(1, 1, 0);
        m.last = [("a".to_string(), Scrape::default())].into();
        // 15 slow requests (a load that then went), too few to judge ...
        m = decide(
            &p,
            &m,
            &look(&[("a", server(15.0, 2.0, 0.0, 0.0))], 0.0),
            10 * S,
            Duration::from_secs(60),
        )
        .memory;
        // ... then, long after, 10 fast ones: the slow ones are out of the window.
        let mut later = server(15.0, 2.0, 0.0, 0.0);
        later.requests += 10.0;
        later.ttft.add(&hist(0.05, 10.0));
        let o = decide(
            &p,
            &m,
            &look(&[("a", later.clone())], 0.0),
            70 * S,
            Duration::from_secs(60),
        );
        assert!(
            o.decision.is_none(),
            "a stale window is not judged: {:?}",
            o.decision
        );
        m = o.memory;
        later.requests += 10.0;
        later.ttft.add(&hist(0.05, 10.0));
        let o = decide(
            &p,
            &m,
            &look(&[("a", later)], 0.0),
            80 * S,
            Duration::from_secs(60),
        );
        assert!(o.decision.is_none(), "{:?}", o.decision);
    }

    #[test]
    fn memory_survives_its_json_round_trip() {
        let mut m = Memory::start(3, 2, 1000);
        m.last = [("a".to_string(), server(5.0, 0.2, 1.0, 0.0))].into();
        m.calm_since = Some(500);
        let json = serde_json::to_value(&m).unwrap();
        let back: Memory = serde_json::from_value(json).expect("memory reads back");
        assert_eq!(back, m);
        assert!(back.last["a"].ttft.buckets.last().unwrap().0.is_infinite());
    }

    #[test]
    fn a_restarted_server_counts_from_zero() {
        let h = hist(0.2, 5.0);
        let later = hist(0.2, 2.0);
        assert_eq!(later.since(Some(&h)), later);
        assert_eq!(h.since(Some(&later)).count(), 3.0);
    }

    #[test]
    fn the_least_busy_server_gets_the_lowest_deletion_cost_and_unchanged_marks_are_not_rewritten() {
        let in_flight = BTreeMap::from([
            ("a".to_string(), 0.0),
            ("b".to_string(), 7.4),
            ("c".to_string(), 2.6),
        ]);
        let costs = deletion_costs(&in_flight, &BTreeMap::new());
        assert_eq!(
            costs,
            BTreeMap::from([
                ("a".into(), "0".into()),
                ("b".into(), "7".into()),
                ("c".into(), "3".into())
            ])
        );
        let marked = BTreeMap::from([("b".to_string(), "7".to_string())]);
        let again = deletion_costs(&in_flight, &marked);
        assert_eq!(again.keys().collect::<Vec<_>>(), ["a", "c"]);
        // Nonsense readings never make a cost the annotation cannot hold.
        let odd = BTreeMap::from([("x".to_string(), -3.0), ("y".to_string(), 1e20)]);
        let costs = deletion_costs(&odd, &BTreeMap::new());
        assert_eq!(costs["x"], "0");
        assert_eq!(costs["y"], i32::MAX.to_string());
    }
}
