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
//!
//! The model is split by concern: the GPUs, the model's size and a pod's replica spec
//! (`shape`); tokens and block hashes (`tokens`); the paged KV cache (`kv_cache`); the metrics
//! a replica keeps (`metrics`); the engine that schedules a replica's requests (`engine`); and
//! the registries that share replicas and pickers between endpoints, through which a request
//! reaches one (`backends`).

mod backends;
mod engine;
mod kv_cache;
mod metrics;
mod shape;
mod tokens;

use serde::{Deserialize, Serialize};

pub(crate) use backends::attach;
pub use backends::{
    pod_metrics_text, replica_by_uid, start, BackendServing, Session, METRICS_CONTENT_TYPE,
};
pub use engine::{Replica, Step};
pub use kv_cache::Lru;
pub use metrics::{Counters, Load, SCRAPE_INTERVAL};
pub use shape::{gpu_profile, params_in_name, GpuProfile, ModelShape, ReplicaSpec, Shape, GPUS};
pub use tokens::{block_hashes, chat_tokens, tokenize, unit_draw};

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
