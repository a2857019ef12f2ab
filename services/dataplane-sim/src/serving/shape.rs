//! What a replica can do: the GPUs DigitalOcean offers ([`GPUS`]), the model's size
//! ([`ModelShape`]), what the cluster's objects say about a model-server pod ([`ReplicaSpec`])
//! and the effective [`Shape`] they give, with the cost of one engine step. Static facts and
//! arithmetic, apart from the engine that uses them.

use serde_json::Value;

use super::ServingConfig;
use crate::objects;

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
}
