//! Metrics: what a replica counts (vLLM's histograms and counters, [`Metrics`]), its load as
//! the endpoint picker scores it ([`Load`]) and the [`Counters`] tests and benchmarks read.
//! The data only; the engine updates it and renders it as `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// vLLM's bucket bounds.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug, Clone)]
pub(super) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    pub(super) sum: f64,
    pub(super) count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub(super) fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub(super) fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

#[derive(Debug, Clone)]
pub(super) struct Metrics {
    pub(super) prefix_queries: u64,
    pub(super) prefix_hits: u64,
    pub(super) prompt_tokens: u64,
    pub(super) generation_tokens: u64,
    pub(super) finished: BTreeMap<&'static str, u64>,
    pub(super) ttft: Histogram,
    pub(super) tpot: Histogram,
    pub(super) e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prefix_queries: 0,
            prefix_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            finished: BTreeMap::new(),
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// A replica's load, as its metrics show it (what the endpoint picker scores).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub waiting: usize,
    pub running: usize,
    pub kv_usage: f64,
}

/// How often the endpoint picker refreshes a replica's metrics, in simulated seconds (the EPP's
/// default `--refresh-metrics-interval` is 50 ms).
pub const SCRAPE_INTERVAL: f64 = 0.05;

/// Counters of a replica, for tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Counters {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub finished: u64,
    pub evicted_blocks: u64,
    pub ttft_count: u64,
    pub ttft_sum: f64,
}
