//! The engine: one model-server pod's [`Replica`], scheduling its requests as vLLM's engine
//! does (continuous batching in simulated time, paced by real tokio sleeps), and its
//! `/metrics` text. The core of the serving model, apart from the facts it is sized from
//! ([`super::shape`]) and the cache and metrics it keeps.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::kv_cache::{Alloc, KvCache};
use super::metrics::{Counters, Load, Metrics, SCRAPE_INTERVAL};
use super::shape::{ReplicaSpec, Shape};
use super::tokens::block_hashes;
use super::ServingConfig;

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

    pub(super) fn describe(&self, spec: &ReplicaSpec, model_name: Option<&str>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::{chat_tokens, tokenize};

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
