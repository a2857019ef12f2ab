//! The endpoint picker (EPP) of an InferencePool, as the simulated gateway consults it: which
//! ready pod a request goes to, by the scorers and weights of the `EndpointPickerConfig` the
//! control plane wrote.
//!
//! The configuration is found the way the EPP finds it: the pool's `spec.endpointPickerRef`
//! names a Service; the Deployment whose pod template that Service selects runs the picker with
//! `--config-file <path>` (or `--config-text <yaml>`); the path lies under a `volumeMounts` entry
//! whose volume is a ConfigMap, and the ConfigMap's key (the file name, or the `items` mapping)
//! holds the YAML ([`epp_config_text`]). No reference, no Service, no Deployment or no ConfigMap:
//! no picker, and the gateway falls back to round robin (what `failureMode: FailOpen` amounts
//! to). A configuration that does not parse is reported as a wiring problem, and routing is round
//! robin too.
//!
//! What the simulated picker understands of the configuration ([`PickerConfig::parse`]):
//!
//! - `plugins[]` (`type`, `name` defaulting to the type, `parameters`) and the profile named
//!   `default` (else the first) of `schedulingProfiles[]`, whose `pluginRef`s with a `weight`
//!   (default 1) are summed as `Σ weight · score`.
//! - Scorers: `prefix-cache-scorer` (the fraction of the request's prefix blocks that the
//!   picker's own index says the pod holds, as the approximate prefix-cache producer computes
//!   it: the picker remembers which blocks it sent where, in an LRU per pod, and knows nothing of
//!   the pod's evictions), `kv-cache-utilization-scorer` (1 − `vllm:kv_cache_usage_perc`),
//!   `queue-scorer` (min-max normalised `vllm:num_requests_waiting`, fewer is better),
//!   `running-requests-size-scorer` (the same over `vllm:num_requests_running`) and
//!   `load-aware-scorer` (0.5 · (1 − waiting / `threshold`), floored at 0; `threshold` 128).
//! - Prefix parameters, from `prefix-cache-scorer` or `approx-prefix-cache-producer`:
//!   `autoTune` (default true: block size and per-pod index capacity from the pod's vLLM,
//!   `vllm:cache_config_info`), else `blockSizeTokens` (16), `lruCapacityPerServer` (31250
//!   blocks); `maxPrefixBlocksToMatch` (256).
//! - Pickers: `max-score-picker` (the default; ties go round robin where the real one draws at
//!   random), `random-picker` (round robin: deterministic for tests), `weighted-random-picker`
//!   (a draw proportional to the scores, from a deterministic sequence).
//! - A profile with no scorer routes round robin. Filters (`decode-filter`, ...), data sources,
//!   producers and handlers are accepted and have no effect: every pod of the pool is a
//!   candidate. Metrics are read from the replicas as a scrape every 50 ms (simulated) would
//!   have seen them ([`crate::serving::SCRAPE_INTERVAL`]).
//!
//! - `featureGates` (a top-level list of names): `flowControl` makes the gateway hold requests
//!   while the pool has no ready endpoint (scale from zero), see [`crate::data_plane`]; other
//!   gates are ignored.
//!
//! The real EPP reads its configuration at start; the simulated one applies a changed ConfigMap
//! on the cloud controller's next look at the cluster (within its idle interval).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use serde_json::Value;

use crate::objects;
use crate::serving::{block_hashes, Lru, Replica};

/// The llm-d router chart's default configuration ("approximate" prefix-cache aware), which is
/// what the worker writes (`services/worker-plan/src/manifests/endpoint_picker.rs`): queue and KV-utilisation
/// scorers with weight 2, the prefix-cache scorer with weight 3.
pub const LLM_D_DEFAULT_CONFIG: &str = "\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
";

/// A scorer the simulated picker computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scorer {
    PrefixCache,
    KvCacheUtilization,
    Queue,
    RunningRequests,
    LoadAware { threshold: u32 },
}

/// How the picker chooses among the scored pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PickerKind {
    #[default]
    MaxScore,
    /// `random-picker`: simulated as round robin.
    Random,
    WeightedRandom,
}

/// The approximate prefix index's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixParams {
    /// Block size and capacity from the pod's vLLM instead of the two fields below.
    pub auto_tune: bool,
    pub block_size_tokens: u32,
    pub lru_capacity_per_server: u32,
    pub max_prefix_blocks_to_match: u32,
}

impl Default for PrefixParams {
    fn default() -> Self {
        PrefixParams {
            auto_tune: true,
            block_size_tokens: 16,
            lru_capacity_per_server: 31_250,
            max_prefix_blocks_to_match: 256,
        }
    }
}

/// What an `EndpointPickerConfig` asks of the picker.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PickerConfig {
    /// Scorers of the scheduling profile with their weights; empty: round robin.
    pub scorers: Vec<(Scorer, f64)>,
    pub picker: PickerKind,
    pub prefix: PrefixParams,
    /// `featureGates` lists `flowControl`: the EPP holds requests it cannot place yet (no ready
    /// endpoint) instead of failing them; the gateway then waits with them (see
    /// [`crate::data_plane::PoolRoute`]).
    pub flow_control: bool,
    /// `flowControl.defaultRequestTTL`: how long the picker keeps a request it cannot place
    /// before it answers 503 (`None`: the picker's default, [`DEFAULT_QUEUE_TTL`]).
    pub queue_ttl: Option<std::time::Duration>,
}

/// llm-d-router v0.10's `flowControl.defaultRequestTTL` when the configuration sets none
/// (`pkg/epp/flowcontrol/controller/config.go`).
pub const DEFAULT_QUEUE_TTL: std::time::Duration = std::time::Duration::from_secs(60);

// Weights are finite (parse refuses the others), so equality is reflexive.
impl Eq for PickerConfig {}

fn u32_param(params: &Value, key: &str) -> Result<Option<u32>, String> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1 && *n <= u32::MAX as u64)
            .map(|n| Some(n as u32))
            .ok_or_else(|| format!("parameter {key} must be a positive integer, got {v}")),
    }
}

impl PickerConfig {
    /// A picker that only routes round robin.
    pub fn round_robin() -> Self {
        PickerConfig::default()
    }

    /// Parses an `EndpointPickerConfig` (YAML or JSON).
    pub fn parse(text: &str) -> Result<PickerConfig, String> {
        let v: Value = serde_saphyr::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
        let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind != "EndpointPickerConfig" {
            return Err(format!("kind is {kind:?}, not EndpointPickerConfig"));
        }
        let mut plugins: HashMap<String, (String, Value)> = HashMap::new();
        for p in v
            .get("plugins")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let ty = p
                .get("type")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("plugin without a type: {p}"))?;
            let name = p.get("name").and_then(Value::as_str).unwrap_or(ty);
            let params = p.get("parameters").cloned().unwrap_or(Value::Null);
            plugins.insert(name.to_string(), (ty.to_string(), params));
        }
        // Feature gates are a top-level list of names; the ones the simulator does not know
        // change nothing, as gates of another EPP version would not.
        let mut cfg = PickerConfig {
            flow_control: v
                .get("featureGates")
                .and_then(Value::as_array)
                .is_some_and(|gates| gates.iter().any(|g| g.as_str() == Some("flowControl"))),
            ..PickerConfig::default()
        };
        // The queue's time to live, as the picker reads it: a Go duration ("900s", "15m").
        if let Some(ttl) = v.pointer("/flowControl/defaultRequestTTL") {
            let text = ttl.as_str().unwrap_or_default();
            cfg.queue_ttl =
                Some(crate::routing::gateway_duration(text).ok_or_else(|| {
                    format!("flowControl.defaultRequestTTL {ttl} is no duration")
                })?);
        }
        // Prefix parameters: the producer's, else the scorer's (older configurations put them
        // on the scorer).
        let prefix_params = plugins
            .values()
            .find(|(t, _)| t == "approx-prefix-cache-producer")
            .or_else(|| plugins.values().find(|(t, _)| t == "prefix-cache-scorer"))
            .map(|(_, p)| p.clone())
            .unwrap_or(Value::Null);
        if let Some(a) = prefix_params.get("autoTune").and_then(Value::as_bool) {
            cfg.prefix.auto_tune = a;
        }
        if let Some(n) = u32_param(&prefix_params, "blockSizeTokens")? {
            cfg.prefix.block_size_tokens = n;
        }
        if let Some(n) = u32_param(&prefix_params, "lruCapacityPerServer")? {
            cfg.prefix.lru_capacity_per_server = n;
        }
        if let Some(n) = u32_param(&prefix_params, "maxPrefixBlocksToMatch")? {
            cfg.prefix.max_prefix_blocks_to_match = n;
        }
        let profiles = v
            .get("schedulingProfiles")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let profile = profiles
            .iter()
            .find(|p| p.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| profiles.first());
        let refs = profile
            .and_then(|p| p.get("plugins"))
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for r in refs {
            let name = r
                .get("pluginRef")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("profile plugin without a pluginRef: {r}"))?;
            let (ty, params) = plugins
                .get(name)
                .cloned()
                // The EPP instantiates a referenced plugin type with its defaults.
                .unwrap_or_else(|| (name.to_string(), Value::Null));
            let weight = match r.get("weight") {
                None | Some(Value::Null) => 1.0,
                Some(w) => w
                    .as_f64()
                    .filter(|w| w.is_finite() && *w >= 0.0)
                    .ok_or_else(|| format!("weight of {name} must be a non-negative number"))?,
            };
            let scorer = match ty.as_str() {
                "prefix-cache-scorer" => Some(Scorer::PrefixCache),
                "kv-cache-utilization-scorer" => Some(Scorer::KvCacheUtilization),
                "queue-scorer" => Some(Scorer::Queue),
                "running-requests-size-scorer" => Some(Scorer::RunningRequests),
                "load-aware-scorer" => Some(Scorer::LoadAware {
                    threshold: u32_param(&params, "threshold")?.unwrap_or(128),
                }),
                "max-score-picker" => {
                    cfg.picker = PickerKind::MaxScore;
                    None
                }
                "random-picker" => {
                    cfg.picker = PickerKind::Random;
                    None
                }
                "weighted-random-picker" => {
                    cfg.picker = PickerKind::WeightedRandom;
                    None
                }
                _ => None,
            };
            if let Some(s) = scorer {
                cfg.scorers.push((s, weight));
            }
        }
        Ok(cfg)
    }

    /// Whether any scoring happens (else: round robin).
    pub fn scores(&self) -> bool {
        self.picker != PickerKind::Random && self.scorers.iter().any(|(_, w)| *w > 0.0)
    }
}

/// An InferencePool as the data plane sees it: a stable key (its UID) and its picker's
/// configuration, `None` without a reachable picker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolSpec {
    pub key: String,
    pub picker: Option<PickerConfig>,
}

/// The text of the `EndpointPickerConfig` the pool's endpoint picker runs with: `Ok(None)`
/// when the pool has no reachable picker, `Err` when the chain breaks where the real picker's
/// pod could not start (its ConfigMap or key missing).
pub fn epp_config_text(
    objs: &objects::Objects,
    ns: &str,
    pool: &Value,
) -> Result<Option<String>, String> {
    let Some(r) = pool.pointer("/spec/endpointPickerRef") else {
        return Ok(None);
    };
    if r.get("kind").and_then(Value::as_str).unwrap_or("Service") != "Service" {
        return Ok(None);
    }
    let Some(svc_name) = r.get("name").and_then(Value::as_str) else {
        return Ok(None);
    };
    let Some(svc) = objects::find(objs, "Service", "", ns, svc_name) else {
        return Ok(None);
    };
    let Some(selector) = svc.pointer("/spec/selector").and_then(Value::as_object) else {
        return Ok(None);
    };
    let deployment = objs
        .in_namespace(ns, "Deployment")
        .iter()
        .copied()
        .find(|o| {
            !objects::deleting(o)
                && objects::labels_match(selector, o.pointer("/spec/template/metadata/labels"))
        });
    let Some(spec) = deployment.and_then(|d| d.pointer("/spec/template/spec")) else {
        return Ok(None);
    };
    let containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for c in containers {
        let args = objects::command_line(c);
        if let Some(text) = objects::flag_value(&args, "--config-text") {
            return Ok(Some(text));
        }
        let Some(path) = objects::flag_value(&args, "--config-file") else {
            continue;
        };
        let mount = c
            .get("volumeMounts")
            .and_then(Value::as_array)
            .and_then(|ms| {
                ms.iter().find_map(|m| {
                    let at = m.get("mountPath")?.as_str()?.trim_end_matches('/');
                    let rel = path.strip_prefix(at)?.strip_prefix('/')?;
                    Some((m.get("name")?.as_str()?, rel.to_string()))
                })
            });
        let Some((volume, rel)) = mount else {
            return Err(format!(
                "endpoint picker config file {path} is on no mounted volume"
            ));
        };
        let cm = spec
            .get("volumes")
            .and_then(Value::as_array)
            .and_then(|vs| vs.iter().find(|v| v["name"] == volume))
            .and_then(|v| v.get("configMap"));
        let Some(cm) = cm else {
            return Err(format!(
                "volume {volume} of the endpoint picker is not a ConfigMap"
            ));
        };
        let cm_name = cm.get("name").and_then(Value::as_str).unwrap_or("");
        // `items` maps keys to paths; without it every key is a file of its own name.
        let key = match cm.get("items").and_then(Value::as_array) {
            Some(items) => items
                .iter()
                .find(|i| i["path"] == rel.as_str())
                .and_then(|i| i["key"].as_str())
                .map(str::to_string),
            None => Some(rel.clone()),
        };
        let text = key.and_then(|k| {
            objects::find(objs, "ConfigMap", "", ns, cm_name)
                .and_then(|o| o.pointer("/data"))
                .and_then(|d| d.get(&k))
                .and_then(Value::as_str)
                .map(str::to_string)
        });
        return text.map(Some).ok_or_else(|| {
            format!("ConfigMap {ns}/{cm_name} holds no {rel} for the endpoint picker")
        });
    }
    Ok(None)
}

/// [`PickerConfig::parse`], remembered: the cloud controller derives every endpoint's wiring
/// again after each burst of changes and every idle interval.
fn parse_cached(text: &str) -> Result<PickerConfig, String> {
    static SEEN: OnceLock<Mutex<HashMap<String, Result<PickerConfig, String>>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .expect("parse cache lock");
    if let Some(r) = seen.get(text) {
        return r.clone();
    }
    if seen.len() >= 256 {
        seen.clear();
    }
    let r = PickerConfig::parse(text);
    seen.insert(text.to_string(), r.clone());
    r
}

/// The [`PoolSpec`] of InferencePool `pool` (a missing picker is round robin; a broken or
/// unparsable configuration is also reported in `problems`).
pub fn pool_spec(
    objs: &objects::Objects,
    ns: &str,
    pool: Option<&Value>,
    name: &str,
    problems: &mut Vec<String>,
) -> PoolSpec {
    let key = pool
        .and_then(|p| objects::s(p, "/metadata/uid"))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{ns}/{name}"));
    let picker = match pool.map(|p| epp_config_text(objs, ns, p)) {
        None | Some(Ok(None)) => None,
        Some(Ok(Some(text))) => match parse_cached(&text) {
            Ok(c) => Some(c),
            Err(e) => {
                problems.push(format!(
                    "endpoint picker config of InferencePool {ns}/{name} is invalid ({e}): round robin"
                ));
                None
            }
        },
        Some(Err(e)) => {
            problems.push(format!("{e}: InferencePool {ns}/{name} routes round robin"));
            None
        }
    };
    PoolSpec { key, picker }
}

/// A candidate pod as the picker sees it.
pub struct Candidate<'a> {
    pub pod: &'a str,
    pub replica: &'a Replica,
}

/// The picker's state for one pool: its configuration and, per pod, the blocks it sent there.
#[derive(Default)]
pub struct PoolPicker {
    state: Mutex<PickerState>,
}

#[derive(Default)]
struct PickerState {
    config: PickerConfig,
    /// Per pod, the prefix blocks of the requests the picker sent there (block size of the
    /// index: `index_block`).
    index: HashMap<String, Lru>,
}

impl std::fmt::Debug for PoolPicker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolPicker").finish_non_exhaustive()
    }
}

impl PoolPicker {
    pub(crate) fn configure(&self, config: &PickerConfig, pods: &[&str]) {
        let mut st = self.state.lock().expect("picker lock");
        if st.config != *config {
            // Another block size makes the old index meaningless.
            if st.config.prefix != config.prefix {
                st.index.clear();
            }
            st.config = config.clone();
        }
        st.index.retain(|p, _| pods.contains(&p.as_str()));
    }

    /// Chooses among `cands` for a request with prompt tokens `tokens`; `turn` is the
    /// request's turn in the endpoint's round robin. Records the choice in the prefix index.
    pub fn pick(&self, cands: &[Candidate], tokens: &[u64], turn: usize) -> usize {
        let mut st = self.state.lock().expect("picker lock");
        let cfg = st.config.clone();
        if cands.len() <= 1 || !cfg.scores() {
            return if cands.is_empty() {
                0
            } else {
                turn % cands.len()
            };
        }
        let loads: Vec<_> = cands.iter().map(|c| c.replica.scraped_load()).collect();
        let mut totals = vec![0.0f64; cands.len()];
        let minmax = |xs: &[f64]| {
            let lo = xs.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            xs.iter()
                .map(|x| if hi > lo { (hi - x) / (hi - lo) } else { 1.0 })
                .collect::<Vec<_>>()
        };
        for (scorer, weight) in &cfg.scorers {
            let scores: Vec<f64> = match scorer {
                Scorer::PrefixCache => cands
                    .iter()
                    .map(|c| {
                        let (block, _) = index_shape(&cfg, c.replica);
                        let hashes = block_hashes(tokens, block);
                        let n = hashes
                            .len()
                            .min(cfg.prefix.max_prefix_blocks_to_match as usize);
                        if n == 0 {
                            return 0.0;
                        }
                        let held = st.index.get(c.pod);
                        let matched = hashes[..n]
                            .iter()
                            .take_while(|h| held.is_some_and(|l| l.contains(**h)))
                            .count();
                        matched as f64 / n as f64
                    })
                    .collect(),
                Scorer::KvCacheUtilization => loads.iter().map(|l| 1.0 - l.kv_usage).collect(),
                Scorer::Queue => {
                    minmax(&loads.iter().map(|l| l.waiting as f64).collect::<Vec<_>>())
                }
                Scorer::RunningRequests => {
                    minmax(&loads.iter().map(|l| l.running as f64).collect::<Vec<_>>())
                }
                Scorer::LoadAware { threshold } => loads
                    .iter()
                    .map(|l| (0.5 * (1.0 - l.waiting as f64 / *threshold as f64)).max(0.0))
                    .collect(),
            };
            for (t, s) in totals.iter_mut().zip(scores) {
                *t += weight * s;
            }
        }
        let chosen = match cfg.picker {
            PickerKind::WeightedRandom => {
                let sum: f64 = totals.iter().sum();
                if sum <= 0.0 {
                    turn % cands.len()
                } else {
                    let mut x = crate::serving::unit_draw(turn as u64) * sum;
                    totals
                        .iter()
                        .position(|t| {
                            x -= t;
                            x < 0.0
                        })
                        .unwrap_or(cands.len() - 1)
                }
            }
            _ => {
                let best = totals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let tied: Vec<usize> = (0..cands.len())
                    .filter(|i| best - totals[*i] < 1e-9)
                    .collect();
                tied[turn % tied.len()]
            }
        };
        if cfg.scorers.iter().any(|(s, _)| *s == Scorer::PrefixCache) {
            let c = &cands[chosen];
            let (block, capacity) = index_shape(&cfg, c.replica);
            let hashes = block_hashes(tokens, block);
            let lru = st
                .index
                .entry(c.pod.to_string())
                .or_insert_with(|| Lru::new(capacity));
            lru.set_capacity(capacity);
            let n = hashes
                .len()
                .min(cfg.prefix.max_prefix_blocks_to_match as usize);
            for h in &hashes[..n] {
                lru.touch(*h);
            }
        }
        chosen
    }
}

/// Block size and per-pod capacity of the prefix index for a pod.
fn index_shape(cfg: &PickerConfig, replica: &Replica) -> (usize, usize) {
    if cfg.prefix.auto_tune {
        let (block, blocks) = replica.cache_config();
        // The EPP floors an auto-tuned block size at 16.
        (block.max(16), blocks.max(1))
    } else {
        (
            cfg.prefix.block_size_tokens.max(1) as usize,
            cfg.prefix.lru_capacity_per_server.max(1) as usize,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_worker_config() {
        let c = PickerConfig::parse(LLM_D_DEFAULT_CONFIG).unwrap();
        assert_eq!(
            c.scorers,
            vec![
                (Scorer::Queue, 2.0),
                (Scorer::KvCacheUtilization, 2.0),
                (Scorer::PrefixCache, 3.0)
            ]
        );
        assert_eq!(c.picker, PickerKind::MaxScore);
        assert!(c.prefix.auto_tune);
        assert!(c.scores());
        assert!(!c.flow_control);
    }

    #[test]
    fn the_queue_ttl_is_read_as_the_picker_reads_it() {
        let with = format!("{LLM_D_DEFAULT_CONFIG}featureGates:\n- flowControl\nflowControl:\n  defaultRequestTTL: 15m\n");
        let c = PickerConfig::parse(&with).unwrap();
        assert_eq!(c.queue_ttl, Some(std::time::Duration::from_secs(900)));
        assert_eq!(
            PickerConfig::parse(LLM_D_DEFAULT_CONFIG).unwrap().queue_ttl,
            None
        );
        let bad = format!("{LLM_D_DEFAULT_CONFIG}flowControl:\n  defaultRequestTTL: soon\n");
        assert!(PickerConfig::parse(&bad).is_err());
    }

    #[test]
    fn the_flow_control_gate_is_read_and_other_gates_ignored() {
        let with = format!("{LLM_D_DEFAULT_CONFIG}featureGates: [someFutureGate, flowControl]\n");
        assert!(PickerConfig::parse(&with).unwrap().flow_control);
        let other = format!("{LLM_D_DEFAULT_CONFIG}featureGates:\n- someFutureGate\n");
        assert!(!PickerConfig::parse(&other).unwrap().flow_control);
    }

    #[test]
    fn parses_parameters_pickers_and_refuses_nonsense() {
        let c = PickerConfig::parse(
            "kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {autoTune: false, blockSizeTokens: 64, lruCapacityPerServer: 1000}
- {type: prefix-cache-scorer, name: p}
- {type: load-aware-scorer, parameters: {threshold: 10}}
- type: decode-filter
- type: random-picker
schedulingProfiles:
- name: other
  plugins: [{pluginRef: p}]
- name: default
  plugins: [{pluginRef: decode-filter}, {pluginRef: p, weight: 1.5}, {pluginRef: load-aware-scorer}, {pluginRef: random-picker}]
",
        )
        .unwrap();
        assert_eq!(
            c.scorers,
            vec![
                (Scorer::PrefixCache, 1.5),
                (Scorer::LoadAware { threshold: 10 }, 1.0)
            ]
        );
        assert_eq!(c.picker, PickerKind::Random);
        assert!(!c.scores(), "a random picker ignores scores");
        assert_eq!(
            c.prefix,
            PrefixParams {
                auto_tune: false,
                block_size_tokens: 64,
                lru_capacity_per_server: 1000,
                max_prefix_blocks_to_match: 256
            }
        );
        let none = PickerConfig::parse("kind: EndpointPickerConfig\nplugins: []\n").unwrap();
        assert!(!none.scores());
        assert!(PickerConfig::parse("kind: ConfigMap").is_err());
        assert!(PickerConfig::parse(": : :").is_err());
        assert!(PickerConfig::parse(
            "kind: EndpointPickerConfig\nschedulingProfiles: [{name: d, plugins: [{pluginRef: queue-scorer, weight: -1}]}]"
        )
        .is_err());
    }
}
