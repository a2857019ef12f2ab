//! Routing benchmark of the simulated data plane: the seeds' multi-turn workload (a shared
//! ~3.5k-token context, 3–5 turns, growing history) at rising concurrency, with the endpoint
//! picker configuration the worker writes against round robin. Prints the prefix-cache hit
//! rate, TTFT p50/p90, TPOT p50, SLO attainment and tokens/s per level, after a warm-up of one
//! single-turn conversation per shared context.
//!
//! ```sh
//! cargo run --release -p dataplane-sim --example serving_bench -- --help
//! ```
//!
//! It drives one in-process data-plane endpoint (real HTTPS, streaming) per routing mode, in
//! front of `--replicas` simulated vLLM replicas of `--gpu` serving `--model`. Times are
//! simulated seconds: measured on the client, divided by `--time-scale`. Details and results:
//! `bench/README.md`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dataplane_sim::data_plane::{
    token_hash, Backend, Endpoint, EndpointConfig, ModelTiming, Route,
};
use dataplane_sim::picker::{PickerConfig, PoolSpec, LLM_D_DEFAULT_CONFIG};
use dataplane_sim::serving::{BackendServing, Counters, ReplicaSpec, ServingConfig};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use region_sim_base::faults::Faults;
use region_sim_base::front::Front;
use serde_json::{json, Value};

const TOKEN: &str = "di_bench_token";
const SERVED: &str = "bench-model";

const ROUND_ROBIN: &str = "kind: EndpointPickerConfig
plugins: [{type: random-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]
";

struct Args {
    replicas: usize,
    gpu: String,
    model: String,
    time_scale: f64,
    levels: Vec<usize>,
    conversations_per_worker: usize,
    contexts: usize,
    context_tokens: usize,
    question_tokens: usize,
    output_tokens: u32,
    ttft_slo: f64,
    tpot_slo: f64,
}

const USAGE: &str =
    "serving_bench [--replicas 2] [--gpu h200] [--model nvidia/Llama-3.3-70B-Instruct-FP8]
  [--time-scale 0.25] [--concurrency 4,8,16,32,64] [--conversations-per-worker 2]
  [--contexts 8] [--context-tokens 3500] [--question-tokens 100] [--output-tokens 200]
  [--ttft-slo-ms 600] [--tpot-slo-ms 60]";

fn args() -> Args {
    let mut a = Args {
        replicas: 2,
        gpu: "h200".into(),
        model: "nvidia/Llama-3.3-70B-Instruct-FP8".into(),
        time_scale: 0.25,
        levels: vec![4, 8, 16, 32, 64],
        conversations_per_worker: 2,
        contexts: 8,
        context_tokens: 3500,
        question_tokens: 100,
        output_tokens: 200,
        ttft_slo: 0.6,
        tpot_slo: 0.06,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = it
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value\n{USAGE}"));
        let num = |v: &str| -> f64 {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag}: not a number: {v}"))
        };
        match flag.as_str() {
            "--replicas" => a.replicas = num(&v) as usize,
            "--gpu" => a.gpu = v,
            "--model" => a.model = v,
            "--time-scale" => a.time_scale = num(&v),
            "--concurrency" => a.levels = v.split(',').map(|x| num(x) as usize).collect(),
            "--conversations-per-worker" => a.conversations_per_worker = num(&v) as usize,
            "--contexts" => a.contexts = num(&v) as usize,
            "--context-tokens" => a.context_tokens = num(&v) as usize,
            "--question-tokens" => a.question_tokens = num(&v) as usize,
            "--output-tokens" => a.output_tokens = num(&v) as u32,
            "--ttft-slo-ms" => a.ttft_slo = num(&v) / 1000.0,
            "--tpot-slo-ms" => a.tpot_slo = num(&v) / 1000.0,
            _ => panic!("unknown flag {flag}\n{USAGE}"),
        }
    }
    assert!(a.time_scale > 0.0, "--time-scale must be positive");
    a
}

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One request's view from the client (simulated seconds).
struct Sample {
    ttft: f64,
    tpot: Option<f64>,
    tokens: usize,
}

struct Plane {
    ep: Endpoint,
    http: reqwest::Client,
    pods: Vec<String>,
}

impl Plane {
    async fn start(a: &Args, picker: &str) -> Plane {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let timing = Arc::new(RwLock::new(ModelTiming {
            serving: ServingConfig {
                time_scale: a.time_scale,
                ..Default::default()
            },
            ..Default::default()
        }));
        let front = Front::start(0).await.unwrap();
        let ep = Endpoint::start(
            &front,
            front.addresses().allocate(),
            timing,
            Arc::new(Faults::default()),
        );
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![ep.ip().to_string()])
            .unwrap()
            .signed_by(&key, &ca_cert, &ca_key)
            .unwrap();
        let pool = Arc::new(PoolSpec {
            key: String::new(),
            picker: Some(PickerConfig::parse(picker).unwrap()),
        });
        let pods: Vec<String> = (0..a.replicas).map(|i| format!("vllm-{i}")).collect();
        let spec = ReplicaSpec {
            gpu_model: Some(a.gpu.clone()),
            gpus: 1,
            model_repo: Some(a.model.clone()),
            ..Default::default()
        };
        ep.update(EndpointConfig {
            overrides: Vec::new(),
            tls: Some((cert.pem(), key.serialize_pem())),
            auth: dataplane_sim::auth::Authentication::external(
                endpoint_auth::TokenHashes::from_hex([token_hash(TOKEN)]),
            ),
            route: Route::Pool {
                paths: vec!["/".into()],
                endpoints: pods
                    .iter()
                    .map(|p| {
                        let mut b = Backend::new(p.as_str(), Some(SERVED));
                        b.serving = BackendServing::new(spec.clone(), Some(pool.clone()));
                        b
                    })
                    .collect(),
                pools: vec![],
            },
        })
        .unwrap();
        let http = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(ca_cert.pem().as_bytes()).unwrap())
            .pool_max_idle_per_host(256)
            .build()
            .unwrap();
        Plane { ep, http, pods }
    }

    /// Each replica's counters.
    fn counters(&self) -> Vec<Counters> {
        match self.ep.config().route {
            Route::Pool { endpoints, .. } => endpoints
                .iter()
                .filter(|b| self.pods.contains(&b.pod))
                .map(|b| b.serving.replica().expect("replica").counters())
                .collect(),
            Route::None => Vec::new(),
        }
    }

    /// A streamed chat completion: its timings and its answer.
    async fn chat(&self, messages: &[Value], tokens: u32, scale: f64) -> (Sample, String) {
        let started = Instant::now();
        let mut r = self
            .http
            .post(format!("{}/v1/chat/completions", self.ep.url()))
            .bearer_auth(TOKEN)
            .json(
                &json!({"model": SERVED, "messages": messages, "max_tokens": tokens,
                          "ignore_eos": true, "stream": true}),
            )
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        let (mut first, mut last, mut n) = (None, Duration::ZERO, 0usize);
        let mut answer = String::new();
        let mut buf = String::new();
        while let Some(chunk) = r.chunk().await.expect("stream") {
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                let Some(data) = event.trim().strip_prefix("data: ") else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                let text = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if !text.is_empty() {
                    let at = started.elapsed();
                    first.get_or_insert(at);
                    last = at;
                    n += 1;
                    answer.push_str(text);
                }
            }
        }
        let first = first.expect("a token").as_secs_f64() / scale;
        let tpot = (n > 1).then(|| (last.as_secs_f64() / scale - first) / (n - 1) as f64);
        (
            Sample {
                ttft: first,
                tpot,
                tokens: n,
            },
            answer,
        )
    }
}

fn percentile(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

struct Level {
    hit_rate: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    tpot_p50: f64,
    slo: f64,
    tokens_per_s: f64,
    requests: usize,
    evicted: u64,
    /// Requests each replica finished.
    split: Vec<u64>,
}

/// `workers` conversations at a time, each worker running `a.conversations_per_worker` of them.
async fn level(a: &Args, p: &Plane, workers: usize, next: &AtomicUsize) -> Level {
    let before = p.counters();
    let started = Instant::now();
    let contexts: Vec<String> = (0..a.contexts)
        .map(|d| words(&format!("ctx{d}w"), a.context_tokens))
        .collect();
    let runs = (0..workers).map(|_| async {
        let mut samples = Vec::new();
        for _ in 0..a.conversations_per_worker {
            let c = next.fetch_add(1, Ordering::Relaxed);
            let turns = 3 + c % 3;
            let mut messages = vec![
                json!({"role": "system", "content": contexts[c % contexts.len()]}),
                json!({"role": "user", "content": words(&format!("c{c}q0w"), a.question_tokens)}),
            ];
            for t in 0..turns {
                let (s, answer) = p.chat(&messages, a.output_tokens, a.time_scale).await;
                samples.push(s);
                messages.push(json!({"role": "assistant", "content": answer}));
                messages.push(json!({"role": "user", "content": words(&format!("c{c}q{}w", t + 1), a.question_tokens)}));
            }
        }
        samples
    });
    let samples: Vec<Sample> = futures::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect();
    let wall = started.elapsed().as_secs_f64() / a.time_scale;
    let after = p.counters();
    let delta = |f: fn(&Counters) -> u64| -> u64 {
        after.iter().map(f).sum::<u64>() - before.iter().map(f).sum::<u64>()
    };
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    let mut tpot: Vec<f64> = samples.iter().filter_map(|s| s.tpot).collect();
    let met = samples
        .iter()
        .filter(|s| s.ttft <= a.ttft_slo && s.tpot.is_none_or(|t| t <= a.tpot_slo))
        .count();
    Level {
        hit_rate: delta(|c| c.prefix_hits) as f64 / delta(|c| c.prefix_queries).max(1) as f64,
        ttft_p50: percentile(&mut ttft, 0.5),
        ttft_p90: percentile(&mut ttft, 0.9),
        tpot_p50: percentile(&mut tpot, 0.5),
        slo: met as f64 / samples.len().max(1) as f64,
        tokens_per_s: samples.iter().map(|s| s.tokens).sum::<usize>() as f64 / wall,
        requests: samples.len(),
        evicted: delta(|c| c.evicted_blocks),
        split: after
            .iter()
            .zip(&before)
            .map(|(a, b)| a.finished - b.finished)
            .collect(),
    }
}

async fn warm_up(a: &Args, p: &Plane) {
    let runs = (0..a.contexts).map(|d| async move {
        let messages = [
            json!({"role": "system", "content": words(&format!("ctx{d}w"), a.context_tokens)}),
            json!({"role": "user", "content": words(&format!("warm{d}w"), a.question_tokens)}),
        ];
        p.chat(&messages, a.output_tokens, a.time_scale).await;
    });
    futures::future::join_all(runs).await;
}

#[tokio::main]
async fn main() {
    let a = args();
    let shape = dataplane_sim::serving::Shape::of(
        &ReplicaSpec {
            gpu_model: Some(a.gpu.clone()),
            gpus: 1,
            model_repo: Some(a.model.clone()),
            ..Default::default()
        },
        None,
        &ServingConfig::default(),
    );
    println!(
        "{} replicas of {} on 1 {} each ({} KV blocks of {} tokens, {} batch slots); time scale {}",
        a.replicas,
        a.model,
        a.gpu,
        shape.num_blocks,
        shape.block_size,
        shape.max_num_seqs,
        a.time_scale
    );
    println!(
        "workload: {} shared contexts of {} tokens, 3-5 turns, {}-token questions, {}-token answers, {} conversations per worker",
        a.contexts, a.context_tokens, a.question_tokens, a.output_tokens, a.conversations_per_worker
    );
    println!(
        "times in simulated seconds; SLO: TTFT <= {:.0} ms and TPOT <= {:.0} ms\n",
        a.ttft_slo * 1000.0,
        a.tpot_slo * 1000.0
    );
    println!(
        "{:<14} {:>5} {:>5} {:>8} {:>9} {:>9} {:>9} {:>6} {:>9} {:>8}  per replica",
        "routing",
        "conc",
        "reqs",
        "hit %",
        "TTFT p50",
        "TTFT p90",
        "TPOT p50",
        "SLO %",
        "tokens/s",
        "evicted"
    );
    let mut results = Vec::new();
    for (name, config) in [
        ("endpoint-picker", LLM_D_DEFAULT_CONFIG),
        ("round-robin", ROUND_ROBIN),
    ] {
        let p = Plane::start(&a, config).await;
        let next = AtomicUsize::new(0);
        // Warm-up, not counted: one single-turn conversation per context, as a service that
        // has been running has its shared contexts cached somewhere.
        warm_up(&a, &p).await;
        for &c in &a.levels {
            let l = level(&a, &p, c, &next).await;
            println!(
                "{:<14} {:>5} {:>5} {:>8.1} {:>7.0}ms {:>7.0}ms {:>7.1}ms {:>6.1} {:>9.0} {:>8}  {}",
                name,
                c,
                l.requests,
                l.hit_rate * 100.0,
                l.ttft_p50 * 1000.0,
                l.ttft_p90 * 1000.0,
                l.tpot_p50 * 1000.0,
                l.slo * 100.0,
                l.tokens_per_s,
                l.evicted,
                l.split.iter().map(u64::to_string).collect::<Vec<_>>().join("/")
            );
            results.push((name, c, l));
        }
    }
    println!();
    for &c in &a.levels {
        let get = |n: &str| {
            results
                .iter()
                .find(|(m, k, _)| *m == n && *k == c)
                .map(|(_, _, l)| l)
        };
        if let (Some(e), Some(r)) = (get("endpoint-picker"), get("round-robin")) {
            println!(
                "concurrency {c:>3}: hit rate {:.1} % vs {:.1} %, TTFT p90 {:.0} vs {:.0} ms, tokens/s {:+.1} %",
                e.hit_rate * 100.0,
                r.hit_rate * 100.0,
                e.ttft_p90 * 1000.0,
                r.ttft_p90 * 1000.0,
                (e.tokens_per_s / r.tokens_per_s - 1.0) * 100.0
            );
        }
    }
}
