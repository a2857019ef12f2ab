//! Fault injection shared by the three simulated APIs (DigitalOcean, Kubernetes, data plane).
//!
//! Rate-based faults are probabilistic per request so that retry logic in the control plane is
//! exercised the way a flaky cloud exercises it; a rate of 1.0 makes them deterministic for tests.
//! Armed faults hit exactly one DigitalOcean or Kubernetes call, "the Nth call from now", so that
//! a test can fault every call of a reconcile pass in turn: refused, served with its answer lost
//! (what makes a retried create create twice), or the API down from there on.
//!
//! Rates draw from a generator seeded by the caller when it gives a seed (the soak does, from its
//! own seed), so a seed replays the same verdicts at the same calls.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Faults for one API surface.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiFaults {
    /// Fraction (0.0..=1.0) of requests answered with a 5xx.
    pub error_rate: f64,
    /// Fraction (0.0..=1.0) of requests answered with 429 and `Retry-After`.
    pub rate_limit_rate: f64,
    /// Extra latency added to every request, in milliseconds.
    pub latency_ms: u64,
    /// Value of the `Retry-After` header on injected 429s, in seconds.
    pub retry_after_secs: u64,
    /// Seeds the draws that decide which requests the rates fail: from the moment these faults
    /// are set, the Nth request to the API gets the Nth draw, so one seed replays the same
    /// verdicts at the same calls. Without it, draws are unseeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

/// Faults for every API the simulator serves.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// The DigitalOcean API (`/v2/...`).
    #[serde(rename = "do")]
    pub do_api: ApiFaults,
    /// The simulated Kubernetes API servers (through the simulator's front proxy).
    pub kube: ApiFaults,
    /// The simulated OpenAI-compatible endpoints.
    pub data_plane: ApiFaults,
}

/// Which API a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    Do,
    Kube,
    DataPlane,
}

/// What to do with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    /// Answer with a server error.
    Error,
    /// Answer 429 with this `Retry-After` (seconds).
    RateLimited(u64),
}

/// What an armed fault does to the call it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArmedKind {
    /// Answered with a 500 before the call has any effect (as `error_rate` does).
    Refuse,
    /// The call takes effect (a cluster or pool is created, an object applied), then the client
    /// gets a 504 instead of the answer.
    LoseResponse,
    /// Refused, and so is every later call to the API until the fault is disarmed: the API
    /// goes down at a chosen call.
    Outage,
}

/// Which calls an armed fault's number counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Counting {
    /// Every call.
    #[default]
    Calls,
    /// Writes only (POST, PUT, PATCH, DELETE): a lost answer matters only for a call with an
    /// effect, and a pass's writes are fewer than its calls.
    Writes,
}

/// A fault armed for one call: the API, the call's number and what it does to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmedFault {
    pub api: Api,
    #[serde(default)]
    pub counting: Counting,
    /// The number of the call it hits among the API's calls (or writes) since the simulator
    /// started (the first is 0; see [`Faults::calls`]).
    pub call: u64,
    pub kind: ArmedKind,
}

/// An armed fault that hit its call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FiredFault {
    #[serde(flatten)]
    pub fault: ArmedFault,
    /// The call it hit, named as in the stats' `requests` (`POST
    /// /v2/kubernetes/clusters/{id}/node_pools`, `PATCH deployments (apply)`).
    pub request: String,
}

/// What to do with one DigitalOcean or Kubernetes call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallVerdict {
    /// As for any request (a refusing armed fault is a [`Verdict::Error`]).
    Now(Verdict),
    /// Serve the call, then answer with a server error instead of its response.
    LoseResponse,
}

/// How many fired faults [`Faults::fired`] remembers.
const FIRED_KEPT: usize = 1000;

/// Calls and writes to one API so far.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    calls: u64,
    writes: u64,
}

impl Counts {
    fn of(&self, counting: Counting) -> u64 {
        match counting {
            Counting::Calls => self.calls,
            Counting::Writes => self.writes,
        }
    }
}

#[derive(Debug, Default)]
struct Armed {
    do_api: Counts,
    kube: Counts,
    faults: Vec<ArmedFault>,
    fired: VecDeque<FiredFault>,
}

impl Armed {
    fn counts_mut(&mut self, api: Api) -> Option<&mut Counts> {
        match api {
            Api::Do => Some(&mut self.do_api),
            Api::Kube => Some(&mut self.kube),
            // Its requests do not pass the simulator's call accounting.
            Api::DataPlane => None,
        }
    }

    /// Counts a call and decides it by the faults armed for it, if any.
    fn take(&mut self, api: Api, is_write: bool, request: &str) -> Option<ArmedKind> {
        let counts = self.counts_mut(api)?;
        let this = *counts;
        counts.calls += 1;
        counts.writes += u64::from(is_write);
        // A fault counting writes does not see reads.
        let sees = |f: &ArmedFault| f.api == api && (is_write || f.counting == Counting::Calls);
        let down =
            |f: &ArmedFault| sees(f) && f.kind == ArmedKind::Outage && f.call < this.of(f.counting);
        if self.faults.iter().any(down) {
            return Some(ArmedKind::Outage);
        }
        let i = self
            .faults
            .iter()
            .position(|f| sees(f) && f.call == this.of(f.counting))?;
        let fault = match self.faults[i].kind {
            // An outage stays until disarmed.
            ArmedKind::Outage => self.faults[i].clone(),
            _ => self.faults.remove(i),
        };
        let kind = fault.kind;
        if self.fired.len() >= FIRED_KEPT {
            self.fired.pop_front();
        }
        self.fired.push_back(FiredFault {
            fault,
            request: request.to_string(),
        });
        Some(kind)
    }
}

/// Live, runtime-settable fault configuration.
#[derive(Debug, Default)]
pub struct Faults {
    config: RwLock<FaultConfig>,
    armed: Mutex<Armed>,
    /// The seeded generators of the APIs whose faults carry a seed.
    draws: Mutex<HashMap<Api, StdRng>>,
}

impl Faults {
    pub fn new(config: FaultConfig) -> Self {
        let faults = Self::default();
        faults.set(config);
        faults
    }

    pub fn get(&self) -> FaultConfig {
        self.config.read().expect("faults lock").clone()
    }

    pub fn set(&self, config: FaultConfig) {
        let mut config_now = self.config.write().expect("faults lock");
        // Seeded while the configuration lock is held: no request draws from the old generator
        // under the new rates.
        let mut draws = self.draws.lock().expect("draws lock");
        for (api, f) in [
            (Api::Do, &config.do_api),
            (Api::Kube, &config.kube),
            (Api::DataPlane, &config.data_plane),
        ] {
            match f.seed {
                Some(seed) => draws.insert(api, StdRng::seed_from_u64(seed)),
                None => draws.remove(&api),
            };
        }
        *config_now = config;
    }

    fn for_api(&self, api: Api) -> ApiFaults {
        let c = self.config.read().expect("faults lock");
        match api {
            Api::Do => c.do_api.clone(),
            Api::Kube => c.kube.clone(),
            Api::DataPlane => c.data_plane.clone(),
        }
    }

    /// Sleeps for the configured latency, then decides the request's fate.
    pub async fn apply(&self, api: Api) -> Verdict {
        let f = self.for_api(api);
        if f.latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(f.latency_ms)).await;
        }
        let seeded = self
            .draws
            .lock()
            .expect("draws lock")
            .get_mut(&api)
            .map(|rng| rng.gen::<f64>());
        decide(
            &f,
            seeded.unwrap_or_else(|| rand::thread_rng().gen::<f64>()),
        )
    }

    /// As [`Faults::apply`] for a DigitalOcean or Kubernetes call named `request` (a write or
    /// not), which is also counted; a fault armed for it wins over the rates.
    pub async fn apply_call(&self, api: Api, is_write: bool, request: &str) -> CallVerdict {
        let armed = self.lock().take(api, is_write, request);
        let rated = self.apply(api).await;
        match armed {
            Some(ArmedKind::Refuse | ArmedKind::Outage) => CallVerdict::Now(Verdict::Error),
            Some(ArmedKind::LoseResponse) => CallVerdict::LoseResponse,
            None => CallVerdict::Now(rated),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.armed.lock().expect("armed faults lock")
    }

    /// DigitalOcean or Kubernetes calls (or writes) counted so far, faulted ones included;
    /// `None` for the data plane, which armed faults do not reach.
    pub fn calls(&self, api: Api, counting: Counting) -> Option<u64> {
        self.lock().counts_mut(api).map(|c| c.of(counting))
    }

    /// Arms a fault for the `nth` call (or write) to `api` from now (0: the next one). Of two
    /// faults armed for one call, the first one hits it.
    pub fn arm(
        &self,
        api: Api,
        counting: Counting,
        nth: u64,
        kind: ArmedKind,
    ) -> Result<ArmedFault, String> {
        let mut armed = self.lock();
        let Some(counts) = armed.counts_mut(api) else {
            return Err("armed faults hit DigitalOcean or Kubernetes calls only".into());
        };
        let fault = ArmedFault {
            api,
            counting,
            call: counts.of(counting) + nth,
            kind,
        };
        armed.faults.push(fault.clone());
        Ok(fault)
    }

    /// The faults still waiting for their call, and outages.
    pub fn armed(&self) -> Vec<ArmedFault> {
        self.lock().faults.clone()
    }

    /// Removes every armed fault and ends every outage; returns them.
    pub fn disarm(&self) -> Vec<ArmedFault> {
        std::mem::take(&mut self.lock().faults)
    }

    /// The armed faults that hit their call, oldest first (the last thousand); an outage once,
    /// at its first call.
    pub fn fired(&self) -> Vec<FiredFault> {
        self.lock().fired.iter().cloned().collect()
    }
}

/// Pure decision from a uniform sample in [0, 1): errors take the low band, 429s the next one.
pub fn decide(f: &ApiFaults, sample: f64) -> Verdict {
    let err = f.error_rate.clamp(0.0, 1.0);
    let rl = f.rate_limit_rate.clamp(0.0, 1.0);
    if sample < err {
        Verdict::Error
    } else if sample < (err + rl).min(1.0) {
        Verdict::RateLimited(f.retry_after_secs.max(1))
    } else {
        Verdict::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_are_disjoint_and_clamped() {
        let f = ApiFaults {
            error_rate: 0.25,
            rate_limit_rate: 0.25,
            ..Default::default()
        };
        assert_eq!(decide(&f, 0.1), Verdict::Error);
        assert_eq!(decide(&f, 0.3), Verdict::RateLimited(1));
        assert_eq!(decide(&f, 0.6), Verdict::Pass);
        let all = ApiFaults {
            error_rate: 7.0,
            ..Default::default()
        };
        assert_eq!(decide(&all, 0.999), Verdict::Error);
        assert_eq!(decide(&ApiFaults::default(), 0.0), Verdict::Pass);
    }

    #[tokio::test]
    async fn a_seed_replays_the_same_verdicts_at_the_same_calls() {
        let seeded = |seed| FaultConfig {
            kube: ApiFaults {
                error_rate: 0.3,
                rate_limit_rate: 0.3,
                seed: Some(seed),
                ..Default::default()
            },
            ..Default::default()
        };
        let faults = Faults::new(seeded(7));
        let mut runs = Vec::new();
        for seed in [7, 7, 8] {
            faults.set(seeded(seed));
            let mut verdicts = Vec::new();
            for _ in 0..64 {
                verdicts.push(faults.apply(Api::Kube).await);
            }
            runs.push(verdicts);
        }
        assert_eq!(
            runs[0], runs[1],
            "setting the seed again starts its sequence again"
        );
        assert_ne!(runs[0], runs[2], "another seed, other calls");
        assert!(runs[0].contains(&Verdict::Error) && runs[0].contains(&Verdict::Pass));
        assert_eq!(
            faults.apply(Api::Do).await,
            Verdict::Pass,
            "an API without faults is not drawn for"
        );
    }

    #[tokio::test]
    async fn an_armed_fault_hits_the_nth_call_from_now_once() {
        let faults = Faults::default();
        assert_eq!(
            faults.apply_call(Api::Do, false, "GET /v2/vpcs").await,
            CallVerdict::Now(Verdict::Pass)
        );
        let armed = faults
            .arm(Api::Do, Counting::Calls, 1, ArmedKind::LoseResponse)
            .unwrap();
        assert_eq!(armed.call, 2, "counted from the simulator's start");
        faults
            .arm(Api::Kube, Counting::Calls, 0, ArmedKind::Refuse)
            .unwrap();
        let verdicts = [
            faults.apply_call(Api::Do, false, "GET /v2/vpcs").await,
            faults.apply_call(Api::Do, true, "POST /v2/vpcs").await,
            faults.apply_call(Api::Do, true, "POST /v2/vpcs").await,
        ];
        assert_eq!(
            verdicts,
            [
                CallVerdict::Now(Verdict::Pass),
                CallVerdict::LoseResponse,
                CallVerdict::Now(Verdict::Pass)
            ]
        );
        assert_eq!(faults.calls(Api::Do, Counting::Calls), Some(4));
        assert_eq!(faults.calls(Api::Do, Counting::Writes), Some(2));
        assert_eq!(
            faults.calls(Api::Kube, Counting::Calls),
            Some(0),
            "APIs are counted apart"
        );
        assert_eq!(faults.armed().len(), 1);
        let fired = faults.fired();
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].request, "POST /v2/vpcs");
        assert_eq!(fired[0].fault, armed);

        // A fault that never hit its call is given back when disarmed.
        let left = faults.disarm();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].api, Api::Kube);
        assert_eq!(
            faults.apply_call(Api::Kube, false, "LIST pods").await,
            CallVerdict::Now(Verdict::Pass)
        );
        assert!(faults
            .arm(Api::DataPlane, Counting::Calls, 0, ArmedKind::Refuse)
            .is_err());
    }

    #[tokio::test]
    async fn an_outage_refuses_from_its_call_until_disarmed() {
        let faults = Faults::default();
        faults
            .arm(Api::Kube, Counting::Calls, 1, ArmedKind::Outage)
            .unwrap();
        let mut verdicts = Vec::new();
        for _ in 0..4 {
            verdicts.push(faults.apply_call(Api::Kube, false, "LIST pods").await);
        }
        let refused = CallVerdict::Now(Verdict::Error);
        let served = CallVerdict::Now(Verdict::Pass);
        assert_eq!(verdicts, [served, refused, refused, refused]);
        assert_eq!(faults.fired().len(), 1, "an outage fires once");
        assert_eq!(
            faults.apply_call(Api::Do, false, "GET /v2/vpcs").await,
            served,
            "only its API is down"
        );
        assert_eq!(faults.disarm().len(), 1);
        assert_eq!(
            faults.apply_call(Api::Kube, false, "LIST pods").await,
            served
        );
    }

    #[tokio::test]
    async fn a_fault_counting_writes_lets_reads_by() {
        let faults = Faults::default();
        faults
            .arm(Api::Do, Counting::Writes, 1, ArmedKind::LoseResponse)
            .unwrap();
        faults
            .arm(Api::Do, Counting::Writes, 2, ArmedKind::Outage)
            .unwrap();
        let served = CallVerdict::Now(Verdict::Pass);
        let refused = CallVerdict::Now(Verdict::Error);
        let mut verdicts = Vec::new();
        for write in [true, false, true, false, true, false, true] {
            let request = if write {
                "POST /v2/vpcs"
            } else {
                "GET /v2/vpcs"
            };
            verdicts.push(faults.apply_call(Api::Do, write, request).await);
        }
        assert_eq!(
            verdicts,
            [
                served,
                served,
                CallVerdict::LoseResponse,
                served,
                refused,
                served,
                refused
            ]
        );
        assert_eq!(faults.calls(Api::Do, Counting::Writes), Some(4));
    }

    #[test]
    fn armed_faults_read_and_write_as_json() {
        let f: ArmedFault =
            serde_json::from_str(r#"{"api": "kube", "call": 3, "kind": "lose_response"}"#).unwrap();
        assert_eq!(
            f,
            ArmedFault {
                api: Api::Kube,
                counting: Counting::Calls,
                call: 3,
                kind: ArmedKind::LoseResponse
            }
        );
        let fired = serde_json::to_value(FiredFault {
            fault: f,
            request: "LIST pods".into(),
        })
        .unwrap();
        assert_eq!(
            fired,
            serde_json::json!({"api": "kube", "counting": "calls", "call": 3, "kind": "lose_response", "request": "LIST pods"})
        );
    }
}
