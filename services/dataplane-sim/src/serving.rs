//! A serving model for the simulated data plane: each ready model-server pod behind an
//! InferencePool is a [`Replica`] that schedules requests the way vLLM's engine does, in
//! simulated time paced by real tokio sleeps.
//!
//! Off by default: with [`ServingConfig::time_scale`] 0 (the default, also of the region
//! simulator's `SimConfig`) the data plane answers as it always did (round robin, the fixed
//! [`crate::data_plane::ModelTiming`] delays).
//! With a positive scale, one simulated second lasts `time_scale` real seconds (1: real time;
//! 0.05: twenty times faster), and:
//!
//! - **Capacity** comes from the pod's GPUs ([`GPUS`]: memory, memory bandwidth, dense
//!   16-bit TFLOPs per GPU model, from the node's `doks.digitalocean.com/gpu-model` label; the
//!   count from the pod's `nvidia.com/gpu`/`amd.com/gpu` request, tensor parallel at 90 %
//!   efficiency per GPU) and the model's size ([`ModelShape`]: the parameter count read from the
//!   model name, `…-8B-…`, else 8 B; FP8 weights when the name says `fp8`).
//! - **KV cache**: `(GPU memory × --gpu-memory-utilization (0.9) − weights − 1 GiB per GPU) /
//!   (KV bytes per token × --block-size (16))` blocks. Full blocks are identified by a hash
//!   chained over the block's tokens and its prefix (vLLM's automatic prefix caching): a request
//!   reuses the longest cached run of its prompt's blocks and computes the rest. Blocks nobody
//!   uses stay cached and are evicted least recently used first (a finished request's tail
//!   blocks before its head) when new blocks need room.
//! - **Scheduling** (continuous batching): a request waits in a FIFO queue until a batch slot
//!   (`--max-num-seqs`, 256) and KV blocks for its prompt and output are free, then runs. Each
//!   engine step takes one token from every decoding request and prompt chunks from prefilling
//!   ones, within `--max-num-batched-tokens` (8192). A step lasts
//!   `0.5 ms + bytes / (bandwidth × 0.75) + FLOPs / (TFLOPs × 0.4)`: bytes are the weights plus
//!   the KV of every context read, FLOPs `2 × parameters` per computed token plus attention over
//!   the context. So prefill time grows with the uncached prompt tokens (and mildly with the
//!   context), and decode time per token grows mildly with the batch.
//! - **Tokens**: whitespace-separated words (as the fake model's usage counts them); a chat
//!   prompt is `role: content` per message followed by the generation prompt `assistant:`, so a
//!   conversation's next turn starts with the blocks its previous turn (prompt and answer) left.
//! - **Metrics** ([`Replica::metrics_text`]): vLLM's names, in simulated seconds.
//!
//! Replicas are shared by every load balancer in front of the same pods (keyed by the pod's
//! UID) and live as long as an endpoint routes to their pod.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::data_plane::{Backend, EndpointConfig, Generation, Route};
use crate::objects;
use crate::picker::{Candidate, PoolPicker, PoolSpec};

/// The serving model's knobs (part of [`crate::data_plane::ModelTiming`]: `PUT /_sim/model`,
/// `--serving-time-scale`). The overrides apply to every replica and win over the pods' vLLM
/// flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServingConfig {
    /// Real seconds per simulated second; 0 turns the serving model off.
    pub time_scale: f64,
    /// Batch slots per replica (vLLM `--max-num-seqs`).
    pub max_num_seqs: Option<u32>,
    /// Tokens per engine step (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: Option<u32>,
    /// Tokens per KV block (vLLM `--block-size`).
    pub block_size: Option<u32>,
    /// KV cache size in blocks, instead of what the GPU memory leaves.
    pub kv_cache_blocks: Option<u64>,
    /// Model size in billions of parameters, instead of the one read from the model name.
    pub model_params_billion: Option<f64>,
}

impl Default for ServingConfig {
    fn default() -> Self {
        ServingConfig {
            time_scale: 0.0,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            block_size: None,
            kv_cache_blocks: None,
            model_params_billion: None,
        }
    }
}

impl ServingConfig {
    pub fn enabled(&self) -> bool {
        self.time_scale.is_finite() && self.time_scale > 0.0
    }
}

/// One GPU model's serving capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuProfile {
    /// As DOKS labels nodes (`doks.digitalocean.com/gpu-model`).
    pub model: &'static str,
    pub memory_gib: f64,
    /// Memory bandwidth, TB/s.
    pub hbm_tb_s: f64,
    /// Dense BF16/FP16 tensor TFLOPs (FP8 models get twice as much).
    pub tflops: f64,
}

/// The GPUs DigitalOcean offers, fastest first. An unknown or missing GPU model counts as an H100.
pub const GPUS: &[GpuProfile] = &[
    GpuProfile {
        model: "mi350x",
        memory_gib: 288.0,
        hbm_tb_s: 8.0,
        tflops: 2300.0,
    },
    GpuProfile {
        model: "h200",
        memory_gib: 141.0,
        hbm_tb_s: 4.8,
        tflops: 989.0,
    },
    GpuProfile {
        model: "mi325x",
        memory_gib: 256.0,
        hbm_tb_s: 6.0,
        tflops: 1307.0,
    },
    GpuProfile {
        model: "mi300x",
        memory_gib: 192.0,
        hbm_tb_s: 5.3,
        tflops: 1307.0,
    },
    GpuProfile {
        model: "h100",
        memory_gib: 80.0,
        hbm_tb_s: 3.35,
        tflops: 989.0,
    },
    GpuProfile {
        model: "6000ada",
        memory_gib: 48.0,
        hbm_tb_s: 0.96,
        tflops: 364.0,
    },
    GpuProfile {
        model: "l40s",
        memory_gib: 48.0,
        hbm_tb_s: 0.864,
        tflops: 362.0,
    },
    GpuProfile {
        model: "4000ada",
        memory_gib: 20.0,
        hbm_tb_s: 0.36,
        tflops: 107.0,
    },
];

pub fn gpu_profile(model: Option<&str>) -> GpuProfile {
    let h100 = GPUS
        .iter()
        .find(|g| g.model == "h100")
        .copied()
        .expect("h100");
    model
        .and_then(|m| GPUS.iter().find(|g| g.model.eq_ignore_ascii_case(m)))
        .copied()
        .unwrap_or(h100)
}

/// Share of peak memory bandwidth a decode step reaches.
const MBU: f64 = 0.75;
/// Share of peak FLOPs a prefill reaches.
const MFU: f64 = 0.4;
/// Fixed cost of an engine step (scheduling, kernel launches), seconds.
const STEP_OVERHEAD: f64 = 0.0005;
/// Efficiency of tensor parallelism per GPU beyond the first.
const TP_EFFICIENCY: f64 = 0.9;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// The smallest KV cache a replica gets from its memory, in tokens (`max_model_len` 8192, as
/// `/v1/models` says).
const MIN_CACHE_TOKENS: usize = 8192;

/// The model's size as serving sees it, scaled from Llama-3.1-8B (32 layers, 8 KV heads of 128:
/// 128 KiB of BF16 KV per token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    pub params_billion: f64,
    pub fp8: bool,
    pub weight_bytes: f64,
    pub kv_bytes_per_token: f64,
    /// Attention FLOPs per computed token per context token (4 × layers × hidden).
    pub attention_flops: f64,
}

/// The parameter count in a model name: the first number followed by `b` as a word of its own
/// (`Llama-3.1-8B-Instruct`, `qwen2.5-0.5b`, `gpt-oss-120b`).
pub fn params_in_name(name: &str) -> Option<f64> {
    let lower = name.to_ascii_lowercase();
    let b = lower.as_bytes();
    for (i, c) in b.iter().enumerate() {
        if *c != b'b' || b.get(i + 1).is_some_and(|n| n.is_ascii_alphanumeric()) {
            continue;
        }
        let start = lower[..i]
            .rfind(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
            .map_or(0, |p| p + 1);
        if let Ok(v) = lower[start..i].parse::<f64>() {
            if v > 0.0 {
                return Some(v);
            }
        }
    }
    None
}

impl ModelShape {
    pub fn of(name: Option<&str>, params_override: Option<f64>) -> ModelShape {
        let params = params_override
            .or_else(|| name.and_then(params_in_name))
            .filter(|p| p.is_finite() && *p > 0.0)
            .unwrap_or(8.0);
        let fp8 = name.is_some_and(|n| n.to_ascii_lowercase().contains("fp8"));
        let ratio = params / 8.0;
        ModelShape {
            params_billion: params,
            fp8,
            weight_bytes: params * 1e9 * if fp8 { 1.0 } else { 2.0 },
            kv_bytes_per_token: 131_072.0 * ratio.powf(0.4),
            attention_flops: 524_288.0 * ratio.powf(0.7),
        }
    }
}

/// What the cluster's objects say about one model-server pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReplicaSpec {
    /// The pod's UID: replicas are shared by every endpoint routing to the pod.
    pub uid: Option<String>,
    /// Its node's GPU model (`doks.digitalocean.com/gpu-model`).
    pub gpu_model: Option<String>,
    /// GPUs its containers request (0: unknown, counted as 1).
    pub gpus: u32,
    /// `--model` of its vLLM command line.
    pub model_repo: Option<String>,
    pub max_num_seqs: Option<u32>,
    pub max_num_batched_tokens: Option<u32>,
    pub block_size: Option<u32>,
    /// `--gpu-memory-utilization`, in percent.
    pub gpu_memory_utilization_pct: Option<u32>,
}

fn quantity(v: &Value) -> Option<u32> {
    match v {
        Value::String(s) => s.trim().parse().ok(),
        Value::Number(n) => n.as_u64().map(|n| n as u32),
        _ => None,
    }
}

impl ReplicaSpec {
    /// Derives a pod's serving facts from it and its node.
    pub fn of_pod(objs: &objects::Objects, pod: &Value) -> ReplicaSpec {
        let containers = pod
            .pointer("/spec/containers")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let gpus: u32 = containers
            .iter()
            .filter_map(|c| {
                let r = c
                    .pointer("/resources/limits")
                    .or_else(|| c.pointer("/resources/requests"))?;
                ["nvidia.com/gpu", "amd.com/gpu"]
                    .iter()
                    .find_map(|k| r.get(*k).and_then(quantity))
            })
            .sum();
        let node = objects::s(pod, "/spec/nodeName")
            .and_then(|n| objects::find(objs, "Node", "", "default", n));
        let label = |k: &str| {
            node.and_then(|n| n.pointer("/metadata/labels"))
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let size = label("node.kubernetes.io/instance-type")
            .and_then(|s| region_sim_base::sizes::parse(&s));
        let gpu_model = label("doks.digitalocean.com/gpu-model")
            .or_else(|| size.as_ref().and_then(|s| s.gpu_model.clone()));
        let args: Vec<String> = containers
            .iter()
            .map(objects::command_line)
            .find(|a| a.iter().any(|x| x.starts_with("--model") || x == "serve"))
            .unwrap_or_default();
        let num = |flag: &str| objects::flag_value(&args, flag).and_then(|v| v.parse::<u32>().ok());
        ReplicaSpec {
            uid: objects::s(pod, "/metadata/uid").map(str::to_string),
            gpu_model,
            gpus: if gpus > 0 {
                gpus
            } else {
                size.map_or(0, |s| s.gpus)
            },
            model_repo: objects::flag_value(&args, "--model").or_else(|| {
                args.iter()
                    .position(|a| a == "serve")
                    .and_then(|i| args.get(i + 1))
                    .filter(|a| !a.starts_with('-'))
                    .cloned()
            }),
            max_num_seqs: num("--max-num-seqs"),
            max_num_batched_tokens: num("--max-num-batched-tokens"),
            block_size: num("--block-size"),
            gpu_memory_utilization_pct: objects::flag_value(&args, "--gpu-memory-utilization")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|u| *u > 0.0 && *u <= 1.0)
                .map(|u| (u * 100.0).round() as u32),
        }
    }
}

/// A replica's effective capacity: its spec and the simulator's overrides combined.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub gpu: GpuProfile,
    pub gpus: u32,
    pub model: ModelShape,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

impl Shape {
    pub fn of(spec: &ReplicaSpec, model_name: Option<&str>, cfg: &ServingConfig) -> Shape {
        let gpu = gpu_profile(spec.gpu_model.as_deref());
        let gpus = spec.gpus.max(1);
        let model = ModelShape::of(
            spec.model_repo.as_deref().or(model_name),
            cfg.model_params_billion,
        );
        let block_size = cfg.block_size.or(spec.block_size).unwrap_or(16).max(1) as usize;
        let util = spec.gpu_memory_utilization_pct.unwrap_or(90) as f64 / 100.0;
        let kv_bytes =
            gpu.memory_gib * GIB * gpus as f64 * util - model.weight_bytes - GIB * gpus as f64;
        let from_memory =
            (kv_bytes / (model.kv_bytes_per_token * block_size as f64)).max(0.0) as usize;
        let num_blocks = cfg
            .kv_cache_blocks
            .map(|b| b as usize)
            // Weights that (nearly) fill the GPUs would keep a real vLLM from starting; the
            // simulated one keeps a cache of 8192 tokens, the longest context it advertises.
            .unwrap_or(from_memory.max(MIN_CACHE_TOKENS / block_size))
            .max(1);
        Shape {
            gpu,
            gpus,
            model,
            block_size,
            num_blocks,
            max_num_seqs: cfg.max_num_seqs.or(spec.max_num_seqs).unwrap_or(256).max(1) as usize,
            max_num_batched_tokens: cfg
                .max_num_batched_tokens
                .or(spec.max_num_batched_tokens)
                .unwrap_or(8192)
                .max(1) as usize,
        }
    }

    /// Simulated seconds of one engine step: `decoding` requests with `decode_context` tokens
    /// of context between them, and prompt chunks of (tokens, tokens already computed).
    pub fn step_seconds(
        &self,
        decoding: usize,
        decode_context: u64,
        chunks: &[(usize, usize)],
    ) -> f64 {
        let tp = if self.gpus > 1 {
            self.gpus as f64 * TP_EFFICIENCY
        } else {
            1.0
        };
        let bandwidth = self.gpu.hbm_tb_s * 1e12 * MBU * tp;
        let flops_rate = self.gpu.tflops * 1e12 * if self.model.fp8 { 2.0 } else { 1.0 } * MFU * tp;
        let params = self.model.params_billion * 1e9;
        let mut bytes =
            self.model.weight_bytes + self.model.kv_bytes_per_token * decode_context as f64;
        let mut flops = 2.0 * params * decoding as f64;
        for &(tokens, before) in chunks {
            let (c, ctx) = (tokens as f64, before as f64);
            flops += 2.0 * params * c + self.model.attention_flops * c * (ctx + c / 2.0);
            bytes += self.model.kv_bytes_per_token * (ctx + c);
        }
        STEP_OVERHEAD + bytes / bandwidth + flops / flops_rate
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens and blocks

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Token ids of a text: one per whitespace-separated word.
pub fn tokenize(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|w| fnv(FNV_OFFSET, w.as_bytes()))
        .collect()
}

/// The tokens of a rendered chat prompt (`role: content` lines) with the generation prompt.
pub fn chat_tokens(rendered: &str) -> Vec<u64> {
    let mut t = tokenize(rendered);
    t.extend(tokenize("assistant:"));
    t
}

/// Hashes of the full `block`-token blocks of `tokens`, each chained over its prefix.
pub fn block_hashes(tokens: &[u64], block: usize) -> Vec<u64> {
    let block = block.max(1);
    let mut prev = FNV_OFFSET;
    tokens
        .chunks_exact(block)
        .map(|c| {
            let mut h = fnv(FNV_OFFSET, &prev.to_le_bytes());
            for t in c {
                h = fnv(h, &t.to_le_bytes());
            }
            prev = h;
            h
        })
        .collect()
}

/// A number in [0, 1) from `seed` (splitmix64): stable draws for the simulation.
pub fn unit_draw(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// A set of block hashes in least-recently-used order, bounded by a capacity.
#[derive(Debug, Default)]
pub struct Lru {
    capacity: usize,
    clock: u64,
    by_hash: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    evicted: u64,
}

impl Lru {
    pub fn new(capacity: usize) -> Lru {
        Lru {
            capacity: capacity.max(1),
            ..Default::default()
        }
    }

    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.by_hash.len() > self.capacity {
            self.pop_oldest();
        }
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub fn contains(&self, h: u64) -> bool {
        self.by_hash.contains_key(&h)
    }

    /// Inserts `h` or makes it the most recent; the oldest goes when the set is full.
    pub fn touch(&mut self, h: u64) {
        self.clock += 1;
        if let Some(old) = self.by_hash.insert(h, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, h);
        while self.by_hash.len() > self.capacity {
            self.pop_oldest();
        }
    }

    pub fn remove(&mut self, h: u64) -> bool {
        match self.by_hash.remove(&h) {
            Some(age) => {
                self.by_age.remove(&age);
                true
            }
            None => false,
        }
    }

    pub fn pop_oldest(&mut self) -> Option<u64> {
        let (_, h) = self.by_age.pop_first()?;
        self.by_hash.remove(&h);
        self.evicted += 1;
        Some(h)
    }
}

/// KV blocks held by one request: the cached blocks it references and the blocks of its own
/// not (yet) in the cache.
#[derive(Debug, Default)]
struct Alloc {
    pinned: Vec<u64>,
    private: usize,
}

/// A replica's paged KV cache with automatic prefix caching.
#[derive(Debug)]
struct KvCache {
    capacity: usize,
    /// Blocks requests hold that are not cached blocks.
    held: usize,
    /// Cached full blocks and how many running requests use each.
    refs: HashMap<u64, u32>,
    /// Cached blocks no request uses: reusable, evicted oldest first.
    free: Lru,
    evictions: u64,
}

impl KvCache {
    fn new(capacity: usize) -> KvCache {
        KvCache {
            capacity,
            held: 0,
            refs: HashMap::new(),
            free: Lru::new(usize::MAX),
            evictions: 0,
        }
    }

    /// Blocks in use by running requests.
    fn used(&self) -> usize {
        self.held + self.refs.len() - self.free.len()
    }

    fn usage(&self) -> f64 {
        (self.used() as f64 / self.capacity as f64).min(1.0)
    }

    fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.refs.contains_key(h))
            .count()
    }

    /// Reserves `total` blocks for a request whose first full blocks are `hashes`, reusing the
    /// cached run at their head (at most `max_match` blocks). `None`: not enough room now.
    fn allocate(&mut self, hashes: &[u64], max_match: usize, total: usize) -> Option<Alloc> {
        let m = self.matched(hashes).min(max_match).min(total);
        let reused_free = hashes[..m]
            .iter()
            .filter(|h| self.free.contains(**h))
            .count();
        let new = total - m;
        let never_used = self.capacity.saturating_sub(self.held + self.refs.len());
        if never_used + self.free.len() - reused_free < new {
            return None;
        }
        for h in &hashes[..m] {
            *self.refs.get_mut(h).expect("matched") += 1;
            self.free.remove(*h);
        }
        for _ in 0..new.saturating_sub(never_used) {
            let h = self.free.pop_oldest().expect("room was counted");
            self.refs.remove(&h);
            self.evictions += 1;
        }
        self.held += new;
        Some(Alloc {
            pinned: hashes[..m].to_vec(),
            private: new,
        })
    }

    /// Turns a request's computed full blocks (`hashes`, its whole chain so far) into cached ones.
    fn commit(&mut self, a: &mut Alloc, hashes: &[u64]) {
        for h in hashes.iter().skip(a.pinned.len()) {
            if a.private == 0 {
                break;
            }
            match self.refs.get_mut(h) {
                Some(r) => {
                    *r += 1;
                    self.free.remove(*h);
                }
                None => {
                    self.refs.insert(*h, 1);
                }
            }
            self.held -= 1;
            a.private -= 1;
            a.pinned.push(*h);
        }
    }

    /// Gives a finished request's blocks back: its cached ones stay reusable, the tail first
    /// in line for eviction.
    fn release(&mut self, a: Alloc) {
        for h in a.pinned.iter().rev() {
            let r = self.refs.get_mut(h).expect("pinned");
            *r -= 1;
            if *r == 0 {
                self.free.touch(*h);
            }
        }
        self.held -= a.private;
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics

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
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
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

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
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
struct Metrics {
    prefix_queries: u64,
    prefix_hits: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    finished: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
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

// ---------------------------------------------------------------------------------------------
// The engine

/// What a request hears from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// One more output token.
    Token,
    /// The last token was sent.
    Done,
}

struct Seq {
    prompt: Vec<u64>,
    output: Vec<u64>,
    /// Full-block hashes of the prompt.
    prompt_blocks: Vec<u64>,
    alloc: Option<Alloc>,
    /// Prompt tokens computed (cached ones included).
    computed: usize,
    generated: usize,
    arrival: f64,
    last_token: f64,
    tx: mpsc::UnboundedSender<Step>,
}

impl Seq {
    fn total_blocks(&self, block: usize) -> usize {
        (self.prompt.len() + self.output.len()).div_ceil(block)
    }
}

/// Simulated time: `virt0` simulated seconds at `real0`, `scale` real seconds per simulated one.
#[derive(Debug, Clone, Copy)]
struct Clock {
    real0: Instant,
    virt0: f64,
    scale: f64,
}

impl Clock {
    fn now(&self) -> f64 {
        self.at(Instant::now())
    }
    fn at(&self, t: Instant) -> f64 {
        self.virt0 + t.saturating_duration_since(self.real0).as_secs_f64() / self.scale
    }
    fn real(&self, v: f64) -> Instant {
        self.real0 + Duration::from_secs_f64(((v - self.virt0) * self.scale).max(0.0))
    }
}

struct Engine {
    spec: ReplicaSpec,
    model_name: Option<String>,
    cfg: ServingConfig,
    shape: Shape,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    clock: Clock,
    /// The engine loop runs (and the current step ends at `step_end`).
    busy: bool,
    step_end: f64,
    metrics: Metrics,
    /// The load as the endpoint picker last scraped it, and when (simulated seconds).
    scraped: Option<(f64, Load)>,
}

impl Engine {
    fn load(&self) -> Load {
        Load {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_usage: self.kv.usage(),
        }
    }

    fn reshape(&mut self) {
        let shape = Shape::of(&self.spec, self.model_name.as_deref(), &self.cfg);
        if shape.num_blocks != self.shape.num_blocks || shape.block_size != self.shape.block_size {
            // A replica with another cache shape is a restarted vLLM: its cache starts empty.
            if self.running.is_empty() && self.waiting.is_empty() {
                self.kv = KvCache::new(shape.num_blocks);
                self.shape = shape;
            }
        } else {
            self.shape = shape;
        }
    }

    /// Moves waiting requests into the batch while slots and KV blocks allow (FIFO: the first
    /// that does not fit blocks the rest, as vLLM's scheduler does).
    fn admit(&mut self) {
        let block = self.shape.block_size;
        while self.running.len() < self.shape.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let total = seq.total_blocks(block);
            // At least the last prompt token is computed, even when the whole prompt is cached.
            let max_match = seq.prompt.len().saturating_sub(1) / block;
            let Some(alloc) = self.kv.allocate(&seq.prompt_blocks, max_match, total) else {
                break;
            };
            let mut seq = self.waiting.pop_front().expect("front");
            let hit = alloc.pinned.len() * block;
            self.metrics.prefix_queries += seq.prompt.len() as u64;
            self.metrics.prefix_hits += hit as u64;
            self.metrics.prompt_tokens += seq.prompt.len() as u64;
            seq.computed = hit;
            seq.alloc = Some(alloc);
            self.running.push(seq);
        }
    }

    /// The next step: (decoding request indices, prompt chunks as (index, tokens)).
    fn plan(&self) -> (Vec<usize>, Vec<(usize, usize)>) {
        let decoding: Vec<usize> = (0..self.running.len())
            .filter(|i| self.running[*i].computed >= self.running[*i].prompt.len())
            .collect();
        let mut budget = self
            .shape
            .max_num_batched_tokens
            .saturating_sub(decoding.len());
        let mut chunks = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.computed < s.prompt.len() && budget > 0 {
                let c = (s.prompt.len() - s.computed).min(budget);
                budget -= c;
                chunks.push((i, c));
            }
        }
        (decoding, chunks)
    }

    /// Applies a step that ended at `now`: computed prompt chunks, one token per decoding
    /// request, finished requests out.
    fn apply(&mut self, decoding: &[usize], chunks: &[(usize, usize)], now: f64) {
        let block = self.shape.block_size;
        let mut emit = Vec::new();
        for &(i, c) in chunks {
            let s = &mut self.running[i];
            s.computed += c;
            if s.computed >= s.prompt.len() {
                // Prefill done: its blocks are cached, and its first token is out.
                let hashes = s.prompt_blocks.clone();
                if let Some(a) = s.alloc.as_mut() {
                    self.kv.commit(a, &hashes);
                }
                self.metrics.ttft.observe(now - s.arrival);
                emit.push(i);
            }
        }
        for &i in decoding {
            let s = &mut self.running[i];
            self.metrics.tpot.observe(now - s.last_token);
            emit.push(i);
        }
        let mut gone = Vec::new();
        for i in emit {
            let s = &mut self.running[i];
            s.generated += 1;
            s.last_token = now;
            self.metrics.generation_tokens += 1;
            let done = s.generated >= s.output.len();
            // A request whose client left is aborted, as vLLM aborts on disconnect.
            if s.tx.send(Step::Token).is_err() {
                gone.push((i, "abort"));
            } else if done {
                let _ = s.tx.send(Step::Done);
                gone.push((i, "length"));
            }
        }
        gone.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, reason) in gone {
            let mut s = self.running.remove(i);
            if let Some(mut a) = s.alloc.take() {
                if reason != "abort" {
                    let all: Vec<u64> = s.prompt.iter().chain(&s.output).copied().collect();
                    self.kv.commit(&mut a, &block_hashes(&all, block));
                    self.metrics.e2e.observe(now - s.arrival);
                }
                self.kv.release(a);
            }
            *self.metrics.finished.entry(reason).or_insert(0) += 1;
        }
    }
}

/// One model-server pod's engine.
pub struct Replica {
    engine: Mutex<Engine>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").finish_non_exhaustive()
    }
}

impl Replica {
    pub fn new(spec: ReplicaSpec, model_name: Option<&str>) -> Replica {
        let cfg = ServingConfig::default();
        let shape = Shape::of(&spec, model_name, &cfg);
        Replica {
            engine: Mutex::new(Engine {
                kv: KvCache::new(shape.num_blocks),
                spec,
                model_name: model_name.map(str::to_string),
                cfg,
                shape,
                waiting: VecDeque::new(),
                running: Vec::new(),
                clock: Clock {
                    real0: Instant::now(),
                    virt0: 0.0,
                    scale: 1.0,
                },
                busy: false,
                step_end: 0.0,
                metrics: Metrics::default(),
                scraped: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Engine> {
        self.engine.lock().expect("engine lock")
    }

    fn configure(&self, cfg: &ServingConfig) {
        let mut e = self.lock();
        if e.cfg != *cfg {
            if cfg.enabled() && cfg.time_scale != e.clock.scale {
                // Keep simulated time continuous across a change of scale.
                let now = Instant::now();
                e.clock = Clock {
                    virt0: e.clock.at(now),
                    real0: now,
                    scale: cfg.time_scale,
                };
            }
            e.cfg = cfg.clone();
            e.reshape();
        }
    }

    fn describe(&self, spec: &ReplicaSpec, model_name: Option<&str>) {
        let mut e = self.lock();
        if e.spec != *spec || e.model_name.as_deref() != model_name {
            e.spec = spec.clone();
            e.model_name = model_name.map(str::to_string);
            e.reshape();
        }
    }

    /// The load now.
    pub fn load(&self) -> Load {
        self.lock().load()
    }

    /// The load as the endpoint picker sees it: scraped from `/metrics` at most every
    /// [`SCRAPE_INTERVAL`] simulated seconds, as the EPP refreshes its metrics.
    pub fn scraped_load(&self) -> Load {
        let mut e = self.lock();
        if !e.cfg.enabled() {
            return e.load();
        }
        let now = e.clock.now();
        match e.scraped {
            Some((at, load)) if now - at < SCRAPE_INTERVAL => load,
            _ => {
                let load = e.load();
                e.scraped = Some((now, load));
                load
            }
        }
    }

    /// (block size, KV blocks): what `vllm:cache_config_info` tells the picker.
    pub fn cache_config(&self) -> (usize, usize) {
        let e = self.lock();
        (e.shape.block_size, e.shape.num_blocks)
    }

    pub fn shape(&self) -> Shape {
        self.lock().shape.clone()
    }

    pub fn counters(&self) -> Counters {
        let e = self.lock();
        Counters {
            prefix_queries: e.metrics.prefix_queries,
            prefix_hits: e.metrics.prefix_hits,
            prompt_tokens: e.metrics.prompt_tokens,
            generation_tokens: e.metrics.generation_tokens,
            finished: e.metrics.finished.values().sum(),
            evicted_blocks: e.kv.evictions,
            ttft_count: e.metrics.ttft.count,
            ttft_sum: e.metrics.ttft.sum,
        }
    }

    /// Queues a request of `prompt` tokens that generates `output` tokens; the receiver hears
    /// each token as the engine produces it. Refused when it could never fit the KV cache.
    pub fn submit(
        self: &Arc<Self>,
        cfg: &ServingConfig,
        prompt: Vec<u64>,
        output: Vec<u64>,
    ) -> Result<mpsc::UnboundedReceiver<Step>, String> {
        self.configure(cfg);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut e = self.lock();
        let block = e.shape.block_size;
        let seq = Seq {
            prompt_blocks: block_hashes(&prompt, block),
            prompt,
            output,
            alloc: None,
            computed: 0,
            generated: 0,
            arrival: 0.0,
            last_token: 0.0,
            tx,
        };
        let need = seq.total_blocks(block);
        if need > e.kv.capacity {
            return Err(format!(
                "This request needs {} tokens of KV cache ({} prompt, {} output), more than the \
                 replica's {} ({} blocks of {}). Please reduce the length of the messages or \
                 completion.",
                need * block,
                seq.prompt.len(),
                seq.output.len(),
                e.kv.capacity * block,
                e.kv.capacity,
                block
            ));
        }
        let now = e.clock.now();
        // While the engine loop lags behind real time, a request counts as arriving when the
        // step under way ends, so that no latency is negative.
        let arrival = if e.busy { now.min(e.step_end) } else { now };
        let mut seq = seq;
        seq.arrival = arrival;
        e.waiting.push_back(seq);
        if !e.busy {
            e.busy = true;
            e.step_end = arrival;
            tokio::spawn(run(self.clone()));
        }
        Ok(rx)
    }

    /// The replica's `/metrics` in Prometheus text format, with vLLM's metric names.
    pub fn metrics_text(&self) -> String {
        let e = self.lock();
        let model = e.model_name.clone().unwrap_or_default().replace('"', "");
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            e.running.len() as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            e.waiting.len() as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            e.kv.usage(),
        );
        gauge(
            &mut out,
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            e.kv.usage(),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            e.metrics.prefix_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            e.metrics.prefix_hits,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            e.metrics.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            e.metrics.generation_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        for reason in ["length", "stop", "abort"] {
            let n = e.metrics.finished.get(reason).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"{}\",num_gpu_blocks=\"{}\"}} 1.0",
            e.shape.block_size,
            e.spec.gpu_memory_utilization_pct.unwrap_or(90) as f64 / 100.0,
            e.shape.num_blocks
        );
        e.metrics.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        e.metrics.tpot.render(
            &mut out,
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &labels,
        );
        e.metrics.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        out
    }
}

/// The engine loop: runs while the replica has requests, one step at a time.
async fn run(rep: Arc<Replica>) {
    loop {
        let (decoding, chunks, deadline, end) = {
            let mut e = rep.lock();
            e.admit();
            if e.running.is_empty() {
                // Everything waiting fits an empty cache (submit refuses the rest), so an empty
                // batch means an empty queue.
                e.busy = false;
                return;
            }
            let (decoding, chunks) = e.plan();
            let context: u64 = decoding
                .iter()
                .map(|i| (e.running[*i].prompt.len() + e.running[*i].generated) as u64)
                .sum();
            let sized: Vec<(usize, usize)> = chunks
                .iter()
                .map(|(i, c)| (*c, e.running[*i].computed))
                .collect();
            let end = e.step_end + e.shape.step_seconds(decoding.len(), context, &sized);
            e.step_end = end;
            (decoding, chunks, e.clock.real(end), end)
        };
        tokio::time::sleep_until(deadline.into()).await;
        rep.lock().apply(&decoding, &chunks, end);
    }
}

// ---------------------------------------------------------------------------------------------
// Replicas and pickers shared by every endpoint in front of the same pods

type Registry<T> = Mutex<HashMap<String, Weak<T>>>;

fn registry<T: Default>(map: &Registry<T>, key: &str) -> Arc<T> {
    let mut m = map.lock().expect("registry lock");
    if let Some(a) = m.get(key).and_then(Weak::upgrade) {
        return a;
    }
    m.retain(|_, w| w.strong_count() > 0);
    let a = Arc::new(T::default());
    m.insert(key.to_string(), Arc::downgrade(&a));
    a
}

impl Default for Replica {
    fn default() -> Self {
        Replica::new(ReplicaSpec::default(), None)
    }
}

fn replicas() -> &'static Registry<Replica> {
    static R: OnceLock<Registry<Replica>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn pickers() -> &'static Registry<PoolPicker> {
    static P: OnceLock<Registry<PoolPicker>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// The replica of the pod with this UID, while an endpoint routes to it.
pub fn replica_by_uid(uid: &str) -> Option<Arc<Replica>> {
    replicas()
        .lock()
        .expect("registry lock")
        .get(uid)
        .and_then(Weak::upgrade)
}

/// A backend's serving facts (from the cluster's objects) and, once an endpoint serves it, its
/// replica and its pool's picker.
#[derive(Debug, Clone, Default)]
pub struct BackendServing {
    pub replica: ReplicaSpec,
    pub pool: Option<Arc<PoolSpec>>,
    attached: Option<Attached>,
}

#[derive(Clone)]
struct Attached {
    replica: Arc<Replica>,
    picker: Option<Arc<PoolPicker>>,
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attached")
    }
}

/// The facts only: which replica object serves them is not part of a configuration's identity.
impl PartialEq for BackendServing {
    fn eq(&self, other: &Self) -> bool {
        self.replica == other.replica && self.pool == other.pool
    }
}

impl Eq for BackendServing {}

impl BackendServing {
    pub fn new(replica: ReplicaSpec, pool: Option<Arc<PoolSpec>>) -> BackendServing {
        BackendServing {
            replica,
            pool,
            attached: None,
        }
    }

    /// The replica serving this backend, once an endpoint was configured with it.
    pub fn replica(&self) -> Option<&Arc<Replica>> {
        self.attached.as_ref().map(|a| &a.replica)
    }
}

/// Gives every backend of an endpoint's configuration its replica and its pool's picker
/// (shared with the other endpoints routing to the same pods; `scope` tells apart the pods of
/// configurations without UIDs, built by hand in tests).
pub(crate) fn attach(cfg: &mut EndpointConfig, scope: usize) {
    let Route::Pool { endpoints, .. } = &mut cfg.route else {
        return;
    };
    // Per pool key: its picker, the configuration it gets and its pods.
    type Pool = (
        Arc<PoolPicker>,
        Option<crate::picker::PickerConfig>,
        Vec<String>,
    );
    let mut pools: HashMap<String, Pool> = HashMap::new();
    for b in endpoints.iter_mut() {
        let key = b
            .serving
            .replica
            .uid
            .clone()
            .unwrap_or_else(|| format!("{scope:x}/{}", b.pod));
        let replica = registry(replicas(), &key);
        replica.describe(&b.serving.replica, b.model.as_deref());
        let picker = b.serving.pool.as_ref().map(|p| {
            let key = if p.key.is_empty() {
                format!("{scope:x}/pool")
            } else {
                p.key.clone()
            };
            let entry = pools
                .entry(key.clone())
                .or_insert_with(|| (registry(pickers(), &key), p.picker.clone(), Vec::new()));
            entry.2.push(b.pod.clone());
            entry.0.clone()
        });
        b.serving.attached = Some(Attached { replica, picker });
    }
    for (picker, config, pods) in pools.values() {
        let pods: Vec<&str> = pods.iter().map(String::as_str).collect();
        picker.configure(&config.clone().unwrap_or_default(), &pods);
    }
}

/// A request on its way through a replica.
pub struct Session {
    pod: String,
    rx: mpsc::UnboundedReceiver<Step>,
}

impl Session {
    /// The pod serving it.
    pub fn pod(&self) -> &str {
        &self.pod
    }

    /// Waits for the whole generation.
    pub async fn finish(mut self) {
        while let Some(s) = self.rx.recv().await {
            if s == Step::Done {
                return;
            }
        }
    }

    /// Server-sent events paced by the engine: the first `preamble` events at once, one event
    /// per generated token, the rest (finish, usage) after the last token, then `[DONE]`.
    pub fn sse(self, events: Vec<Value>, preamble: usize) -> Response {
        let stream = futures::stream::unfold(
            (events.into_iter(), 0usize, self.rx, false),
            move |(mut it, i, mut rx, done)| async move {
                if done {
                    return None;
                }
                if i >= preamble {
                    // Token events wait for their token; after the last, the rest flows.
                    let mut flowing = false;
                    while !flowing {
                        match rx.recv().await {
                            Some(Step::Token) => break,
                            Some(Step::Done) | None => flowing = true,
                        }
                    }
                    if flowing {
                        rx.close();
                    }
                }
                match it.next() {
                    Some(ev) => Some((
                        Ok::<_, Infallible>(Event::default().data(ev.to_string())),
                        (it, i + 1, rx, false),
                    )),
                    None => Some((Ok(Event::default().data("[DONE]")), (it, i + 1, rx, true))),
                }
            },
        );
        Sse::new(stream).into_response()
    }
}

/// Sends a request to a replica when the serving model is on and the backends have replicas:
/// the pool's picker (else round robin on `turn`) chooses among the backends serving `model`.
/// `None`: serve as without the serving model. `Err`: the request cannot be served (400).
pub fn start(
    cfg: &ServingConfig,
    backends: &[Backend],
    model: &str,
    turn: usize,
    prompt: Vec<u64>,
    generation: &Generation,
) -> Option<Result<Session, String>> {
    if !cfg.enabled() {
        return None;
    }
    let serving: Vec<(&Backend, &Attached)> = backends
        .iter()
        .filter(|b| b.model.as_deref().is_none_or(|m| m == model))
        .filter_map(|b| b.serving.attached.as_ref().map(|a| (b, a)))
        .collect();
    if serving.is_empty() {
        return None;
    }
    let picker = serving[0].1.picker.clone();
    let chosen = match &picker {
        Some(p)
            if serving
                .iter()
                .all(|(_, a)| a.picker.as_ref().is_some_and(|q| Arc::ptr_eq(p, q))) =>
        {
            let cands: Vec<Candidate> = serving
                .iter()
                .map(|(b, a)| Candidate {
                    pod: &b.pod,
                    replica: &a.replica,
                })
                .collect();
            p.pick(&cands, &prompt, turn)
        }
        _ => turn % serving.len(),
    };
    let (b, a) = serving[chosen];
    let output = tokenize(&generation.tokens.concat());
    Some(a.replica.submit(cfg, prompt, output).map(|rx| Session {
        pod: b.pod.clone(),
        rx,
    }))
}

/// The pod's vLLM `/metrics` text, as a scrape of its serving port would read it: its
/// replica's, or, while no endpoint routes to it (or the serving model is off and it has none),
/// a freshly started vLLM's (zero counters, for the model it serves). `objs` are the cluster's
/// objects (the pod's Deployment and node describe the replica).
pub fn pod_metrics_text(objs: &objects::Objects, pod: &Value) -> String {
    let spec = ReplicaSpec::of_pod(objs, pod);
    match spec.uid.as_deref().and_then(replica_by_uid) {
        Some(r) => r.metrics_text(),
        None => {
            let served = objects::pod_model(objs, pod);
            Replica::new(spec, served.as_deref()).metrics_text()
        }
    }
}

/// The Prometheus text exposition content type.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_from_names() {
        assert_eq!(
            params_in_name("meta-llama/Llama-3.1-8B-Instruct"),
            Some(8.0)
        );
        assert_eq!(
            params_in_name("nvidia/Llama-3.3-70B-Instruct-FP8"),
            Some(70.0)
        );
        assert_eq!(params_in_name("Qwen/Qwen2.5-0.5B-Instruct"), Some(0.5));
        assert_eq!(params_in_name("openai/gpt-oss-120b"), Some(120.0));
        assert_eq!(params_in_name("llama-3.1-8b"), Some(8.0));
        assert_eq!(params_in_name("tiny-llm"), None);
        assert_eq!(params_in_name("bert-base"), None);
    }

    #[test]
    fn faster_gpus_serve_faster() {
        let cfg = ServingConfig::default();
        let spec = |gpu: &str| ReplicaSpec {
            gpu_model: Some(gpu.into()),
            gpus: 1,
            ..Default::default()
        };
        let step = |gpu: &str, decoding, chunk| {
            let s = Shape::of(&spec(gpu), Some("llama-3.1-8b"), &cfg);
            s.step_seconds(decoding, decoding as u64 * 1000, &[(chunk, 0)])
        };
        for (d, c) in [(1, 0), (32, 0), (0, 3500)] {
            assert!(step("h200", d, c) < step("h100", d, c), "{d} {c}");
            assert!(step("h100", d, c) < step("l40s", d, c), "{d} {c}");
        }
        let h100 = Shape::of(&spec("h100"), Some("llama-3.1-8b"), &cfg);
        // Prefill of a 3.5k-token prompt: well under the 600 ms SLO; a token: a few ms, more
        // in a bigger batch, but mildly.
        let prefill = h100.step_seconds(0, 0, &[(3500, 0)]);
        assert!((0.08..0.3).contains(&prefill), "{prefill}");
        let one = h100.step_seconds(1, 4000, &[]);
        let many = h100.step_seconds(32, 32 * 4000, &[]);
        assert!((0.004..0.02).contains(&one), "{one}");
        assert!(many > one && many < 3.0 * one, "{one} {many}");
        // Cached prompts are cheap: 200 new tokens after 3.5k cached ones.
        assert!(h100.step_seconds(0, 0, &[(200, 3500)]) < prefill / 5.0);
        // KV cache from memory: an H200 holds more than an H100, an L40S less.
        let blocks = |g: &str| Shape::of(&spec(g), Some("llama-3.1-8b"), &cfg).num_blocks;
        assert!(blocks("h200") > blocks("h100") && blocks("h100") > blocks("l40s"));
        assert_eq!(Shape::of(&spec("h100"), None, &cfg).block_size, 16);
        assert_eq!(blocks("h100"), 28_722);
    }

    #[test]
    fn blocks_chain_over_their_prefix() {
        let a = tokenize("one two three four five six seven eight");
        let b = tokenize("one two three four nine six seven eight");
        let ha = block_hashes(&a, 4);
        let hb = block_hashes(&b, 4);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "same block, other prefix");
        assert_eq!(block_hashes(&a[..7], 4).len(), 1, "only full blocks");
    }

    #[test]
    fn kv_cache_reuses_prefixes_and_evicts_least_recently_used() {
        let mut kv = KvCache::new(10);
        let a = [1, 2, 3, 4];
        let mut x = kv.allocate(&a, 4, 5).unwrap();
        assert_eq!((x.pinned.len(), x.private), (0, 5));
        kv.commit(&mut x, &a);
        assert_eq!(kv.used(), 5);
        kv.release(x);
        assert_eq!(kv.used(), 0);
        assert_eq!(kv.free.len(), 4, "the 4 full blocks stay cached");
        // Same prefix: 3 of its blocks reused (at most max_match).
        let y = kv.allocate(&a, 3, 5).unwrap();
        assert_eq!((y.pinned.len(), y.private), (3, 2));
        // Not enough room for 9 more blocks while y runs: wait.
        assert!(kv.allocate(&[9], 0, 9).is_none());
        kv.release(y);
        // Another request needing 8 blocks: 6 never used plus 2 evicted, tail (4, 3) first.
        let z = kv.allocate(&[7], 0, 8).unwrap();
        assert_eq!(kv.evictions, 2);
        assert!(kv.refs.contains_key(&1) && kv.refs.contains_key(&2));
        assert!(!kv.refs.contains_key(&4) && !kv.refs.contains_key(&3));
        kv.release(z);
        assert_eq!(kv.used(), 0);
    }

    #[test]
    fn lru_is_bounded() {
        let mut l = Lru::new(2);
        l.touch(1);
        l.touch(2);
        l.touch(1);
        l.touch(3);
        assert!(l.contains(1) && l.contains(3) && !l.contains(2));
        l.set_capacity(1);
        assert!(l.contains(3) && !l.contains(1));
    }

    fn fast() -> ServingConfig {
        ServingConfig {
            time_scale: 0.01,
            ..Default::default()
        }
    }

    async fn drain(mut rx: mpsc::UnboundedReceiver<Step>) -> usize {
        let mut n = 0;
        while let Some(s) = rx.recv().await {
            match s {
                Step::Token => n += 1,
                Step::Done => break,
            }
        }
        n
    }

    #[tokio::test]
    async fn a_replica_generates_every_token_and_caches_the_conversation() {
        let r = Arc::new(Replica::new(
            ReplicaSpec {
                gpu_model: Some("h100".into()),
                gpus: 1,
                ..Default::default()
            },
            Some("llama-3.1-8b"),
        ));
        let doc = "lorem ipsum dolor sit amet ".repeat(200);
        let first = chat_tokens(&format!("user: {doc}\n"));
        let out = tokenize(&"answer ".repeat(20));
        let rx = r.submit(&fast(), first.clone(), out.clone()).unwrap();
        assert_eq!(drain(rx).await, 20);
        let c = r.counters();
        assert_eq!(c.prefix_hits, 0);
        assert_eq!(c.prefix_queries, first.len() as u64);
        assert_eq!(c.generation_tokens, 20);
        // The next turn starts with the first turn and its answer: cached.
        let mut second = first.clone();
        second.extend(&out);
        second.extend(chat_tokens("user: and then?\n"));
        let rx = r.submit(&fast(), second.clone(), out.clone()).unwrap();
        assert_eq!(drain(rx).await, 20);
        let c2 = r.counters();
        let hits = c2.prefix_hits;
        assert!(
            hits as usize >= (first.len() + out.len()) / 16 * 16 - 16,
            "{hits}"
        );
        assert_eq!(r.load().running, 0);
        assert_eq!(r.load().kv_usage, 0.0);
        let text = r.metrics_text();
        for name in [
            "vllm:num_requests_running{",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
            "vllm:gpu_cache_usage_perc{",
            "vllm:prefix_cache_hits_total{",
            "vllm:prefix_cache_queries_total{",
            "vllm:time_to_first_token_seconds_bucket{",
            "vllm:time_per_output_token_seconds_count{",
        ] {
            assert!(text.contains(name), "{name} in\n{text}");
        }
        assert!(
            text.contains(&format!(
                "vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"llama-3.1-8b\"}} {hits}"
            )),
            "{text}"
        );
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"llama-3.1-8b\"} 2"
        ));
    }

    #[tokio::test]
    async fn too_long_for_the_cache_is_refused() {
        let r = Arc::new(Replica::default());
        let cfg = ServingConfig {
            kv_cache_blocks: Some(4),
            ..fast()
        };
        let err = r
            .submit(&cfg, tokenize(&"x ".repeat(100)), vec![1])
            .unwrap_err();
        assert!(err.contains("KV cache"), "{err}");
    }
}
