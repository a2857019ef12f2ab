//! Fault injection shared by the three simulated APIs (DigitalOcean, Kubernetes, data plane).
//!
//! Faults are probabilistic per request so that retry logic in the control plane is exercised the
//! way a flaky cloud exercises it; a rate of 1.0 makes them deterministic for tests.

use std::sync::RwLock;
use std::time::Duration;

use rand::Rng;
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Live, runtime-settable fault configuration.
#[derive(Debug, Default)]
pub struct Faults {
    config: RwLock<FaultConfig>,
}

impl Faults {
    pub fn new(config: FaultConfig) -> Self {
        Self {
            config: RwLock::new(config),
        }
    }

    pub fn get(&self) -> FaultConfig {
        self.config.read().expect("faults lock").clone()
    }

    pub fn set(&self, config: FaultConfig) {
        *self.config.write().expect("faults lock") = config;
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
        decide(&f, rand::thread_rng().gen::<f64>())
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
}
