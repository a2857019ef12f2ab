//! The autoscaler under a load step, and a scale from zero, through the public API on the whole
//! system (central, a region, its worker, the simulated cloud with the serving model in real
//! time). Two DIs of one model take the same load at once: one autoscaled (`min_replicas` 0,
//! `max_replicas` N, the seeds' SLO: TTFT ≤ 600 ms and TPOT ≤ 60 ms at p90), one fixed at N
//! replicas. The load: the seeds' multi-turn workload (shared 3,500-token contexts, 3–5 turns of
//! a 100-token question and a 200-token answer), low, then a step up, then low again. Printed:
//! SLO attainment, TTFT p50/p90, time to scale up and back down, GPU-hours of each DI; then,
//! after the autoscaled DI reached zero, the time to the first token of the first request.
//!
//! `bench/autoscale --help` for the flags; bench/README.md for results.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use region_sim::Delays;
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{CloudOptions, Options, System};
use uuid::Uuid;

// An 8B model on the smallest GPU that serves it: one replica runs out of KV cache and batch
// under the step's load, as a 70B model on an H100 would at a larger scale.
const MODEL: &str = "meta-llama/llama-3.1-8b-instruct";
const GPU: &str = "gpu-l40sx1-48gb";
const REGION: &str = "atl1";

struct Args {
    low: usize,
    high: usize,
    warm_secs: u64,
    step_secs: u64,
    after_secs: u64,
    max: u32,
    node_ms: u64,
    load_ms: u64,
    interval_ms: u64,
    window_secs: u64,
}

fn args() -> Args {
    let mut a = Args {
        low: 1,
        high: 48,
        warm_secs: 30,
        step_secs: 120,
        after_secs: 120,
        max: 3,
        node_ms: 10_000,
        load_ms: 10_000,
        interval_ms: 2_000,
        window_secs: 30,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].as_str();
        if flag == "--help" || flag == "-h" {
            println!(
                "autoscale_bench [--low N] [--high N] [--warm-secs S] [--step-secs S] [--after-secs S]\n\
                 \x20               [--max N] [--node-ms MS] [--load-ms MS] [--interval-ms MS] [--window-secs S]\n\
                 defaults: low 1, high 48 concurrent conversations; 30 s low, 120 s high, 120 s low;\n\
                 max_replicas 3; GPU nodes and model loads take 10 s each; the autoscaler looks every\n\
                 2 s and removes a replica after 30 s of calm."
            );
            std::process::exit(0);
        }
        let value: u64 = argv
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a whole number"));
        match flag {
            "--low" => a.low = value as usize,
            "--high" => a.high = value as usize,
            "--warm-secs" => a.warm_secs = value,
            "--step-secs" => a.step_secs = value,
            "--after-secs" => a.after_secs = value,
            "--max" => a.max = value as u32,
            "--node-ms" => a.node_ms = value,
            "--load-ms" => a.load_ms = value,
            "--interval-ms" => a.interval_ms = value,
            "--window-secs" => a.window_secs = value,
            _ => panic!("unknown flag {flag}"),
        }
        i += 2;
    }
    a
}

/// One request as the client saw it.
#[derive(Clone, Copy)]
struct Sample {
    /// Seconds since the benchmark's load began.
    at: f64,
    ttft: f64,
    tpot: Option<f64>,
    ok: bool,
}

/// A DI under test, with what it takes to call it.
struct Target {
    name: &'static str,
    id: String,
    endpoint: String,
    token: String,
    http: reqwest::Client,
    samples: Mutex<Vec<Sample>>,
    trace: Mutex<Vec<TracePoint>>,
}

/// (seconds since the load began, GPU nodes, ready, wanted)
type TracePoint = (f64, usize, u64, u64);

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Target {
    /// A streamed chat completion's timings (wall-clock seconds).
    async fn chat(&self, messages: &[Value], tokens: u32, t0: Instant) -> (Sample, String) {
        let started = Instant::now();
        let at = started.duration_since(t0).as_secs_f64();
        let failed = Sample {
            at,
            ttft: f64::INFINITY,
            tpot: None,
            ok: false,
        };
        let r = self
            .http
            .post(format!("{}/v1/chat/completions", self.endpoint))
            .bearer_auth(&self.token)
            .json(
                &json!({"model": MODEL, "messages": messages, "max_tokens": tokens,
                          "ignore_eos": true, "stream": true}),
            )
            .send()
            .await;
        let Ok(mut r) = r else {
            return (failed, String::new());
        };
        if r.status() != 200 {
            return (failed, String::new());
        }
        let (mut first, mut last, mut n) = (None, 0.0, 0usize);
        let (mut answer, mut buf) = (String::new(), String::new());
        while let Ok(Some(chunk)) = r.chunk().await {
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
                    let t = started.elapsed().as_secs_f64();
                    first.get_or_insert(t);
                    last = t;
                    n += 1;
                    answer.push_str(text);
                }
            }
        }
        let Some(first) = first else {
            return (failed, answer);
        };
        let tpot = (n > 1).then(|| (last - first) / (n - 1) as f64);
        (
            Sample {
                at,
                ttft: first,
                tpot,
                ok: true,
            },
            answer,
        )
    }

    /// One conversation of the seeds' workload, on shared context `c mod 8`.
    async fn conversation(&self, c: usize, t0: Instant) {
        let mut messages =
            vec![json!({"role": "system", "content": words(&format!("ctx{}-", c % 8), 3500)})];
        for turn in 0..3 + c % 3 {
            messages.push(json!({"role": "user", "content": words(&format!("q{c}-{turn}-"), 100)}));
            let (sample, answer) = self.chat(&messages, 200, t0).await;
            self.samples.lock().unwrap().push(sample);
            if !sample.ok {
                return;
            }
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
}

/// `workers` closed-loop clients, each running conversations until `stop`.
fn drive(
    target: Arc<Target>,
    workers: usize,
    first: usize,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|w| {
            let (target, stop) = (target.clone(), stop.clone());
            tokio::spawn(async move {
                let mut c = first + w;
                while !stop.load(Ordering::Relaxed) {
                    target.conversation(c, t0).await;
                    c += 1000;
                }
            })
        })
        .collect()
}

fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() - 1) as f64 * p).round() as usize]
}

async fn get_di(sys: &System, api: &str, id: &str) -> Value {
    sys.call(
        Method::GET,
        &format!("/v2/dedicated-inferences/{id}"),
        api,
        None,
    )
    .await
    .body["dedicated_inference"]
        .clone()
}

fn counts(di: &Value) -> (u64, u64) {
    let r = &di["replicas"][0];
    (
        r["ready"].as_u64().unwrap_or(0),
        r["wanted"].as_u64().unwrap_or(0),
    )
}

async fn create(
    sys: &System,
    api: &str,
    name: &str,
    scale: u32,
    workload: Value,
) -> (String, String) {
    let body = json!({"access_tokens": {"hugging_face_token": system_tests::HF_TOKEN}, "spec": {
        "version": 1, "name": name, "region": REGION, "enable_public_endpoint": true,
        "model_deployments": [{
            "model_slug": MODEL, "model_provider": "hugging_face",
            "workload_config": workload,
            "accelerators": [{"accelerator_slug": GPU, "scale": scale, "type": "prefill_decode"}],
        }],
    }});
    let r = sys
        .call(Method::POST, "/v2/dedicated-inferences", api, Some(body))
        .await;
    assert_eq!(r.status, 202, "{}", r.body);
    (
        r.body["dedicated_inference"]["id"]
            .as_str()
            .unwrap()
            .to_string(),
        r.body["token"]["value"].as_str().unwrap().to_string(),
    )
}

async fn target(sys: &System, api: &str, name: &'static str, id: String, token: String) -> Target {
    let endpoint = loop {
        let di = get_di(sys, api, &id).await;
        if di["status"] == "active" {
            break di["endpoints"]["public_endpoint_fqdn"]
                .as_str()
                .unwrap()
                .to_string();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let ca = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/ca"),
            api,
            None,
        )
        .await;
    use base64::Engine;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(ca.body["cert"].as_str().unwrap())
        .unwrap();
    let http = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(256)
        .no_proxy()
        .build()
        .unwrap();
    Target {
        name,
        id,
        endpoint,
        token,
        http,
        samples: Mutex::new(Vec::new()),
        trace: Mutex::new(Vec::new()),
    }
}

/// GPU nodes billed for the DI now: every accelerator listed, ready or starting.
async fn gpu_nodes(sys: &System, api: &str, id: &str) -> usize {
    let r = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/accelerators?per_page=200"),
            api,
            None,
        )
        .await;
    r.body["accelerators"].as_array().map_or(0, |a| {
        a.iter().filter(|a| a["status"] != "deleting").count()
    })
}

fn report(t: &Target, a: &Args, step: (f64, f64)) {
    let samples = t.samples.lock().unwrap().clone();
    let met = |s: &Sample| s.ok && s.ttft <= 0.6 && s.tpot.is_none_or(|x| x <= 0.06);
    let share = |xs: &[&Sample]| {
        if xs.is_empty() {
            f64::NAN
        } else {
            100.0 * xs.iter().filter(|s| met(s)).count() as f64 / xs.len() as f64
        }
    };
    let all: Vec<&Sample> = samples.iter().collect();
    let in_step: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at >= step.0 && s.at < step.1)
        .collect();
    let ttfts: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.ttft * 1e3)
        .collect();
    let failed = samples.iter().filter(|s| !s.ok).count();
    let trace = t.trace.lock().unwrap().clone();
    let mut gpu_seconds = 0.0;
    for w in trace.windows(2) {
        gpu_seconds += (w[1].0 - w[0].0) * w[0].1 as f64;
    }
    // The counts when the step began and ended, and how long after each the first change came.
    let at = |t: f64| trace.iter().find(|p| p.0 >= t).copied().unwrap_or_default();
    let (up_from, down_from) = (at(step.0), at(step.1));
    let first = |cond: &dyn Fn(&TracePoint) -> bool, after: f64| {
        trace
            .iter()
            .find(|p| p.0 >= after && cond(p))
            .map_or("-".to_string(), |p| format!("{:.0} s", p.0 - after))
    };
    println!(
        "{:<10} {:>5} {:>6} {:>9.1} {:>9.1} {:>8.0} {:>8.0} {:>10} {:>10} {:>10} {:>9.3}",
        t.name,
        samples.len(),
        failed,
        share(&all),
        share(&in_step),
        percentile(ttfts.clone(), 0.5),
        percentile(ttfts, 0.9),
        first(&|p| p.3 > up_from.3, step.0),
        first(&|p| p.2 > up_from.2, step.0),
        first(&|p| p.3 < down_from.3, step.1),
        gpu_seconds / 3600.0,
    );
    let _ = a;
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = args();
    let sys = System::start_with(Options {
        cloud: Some(CloudOptions {
            delays: Delays {
                cluster_provision_ms: 2_000,
                node_provision_ms: a.node_ms,
                deletion_ms: 2_000,
                lb_provision_ms: 1_000,
                model_load_ms: a.load_ms,
                gateway_address_ms: 500,
            },
            serving_time_scale: 1.0,
            autoscale_interval: Some(Duration::from_millis(a.interval_ms)),
            scale_down_window: Some(Duration::from_secs(a.window_secs)),
            ..CloudOptions::default()
        }),
        ..Options::default()
    })
    .await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let slo = json!({"ttft_ms": 600, "tpot_ms": 60, "percentile": 90});
    let (auto_id, auto_token) = create(&sys, &api, "autoscaled", 1, json!({
        "input_tokens": 3500, "output_tokens": 200, "slo": slo,
        "autoscaling": {"min_replicas": 0, "max_replicas": a.max, "scale_to_zero_after_seconds": 60},
    }))
    .await;
    let (fixed_id, fixed_token) = create(&sys, &api, "fixed", a.max, json!({})).await;
    let auto = Arc::new(target(&sys, &api, "autoscaled", auto_id, auto_token).await);
    let fixed = Arc::new(target(&sys, &api, "fixed", fixed_id, fixed_token).await);
    eprintln!(
        "both DIs active; load: {} / {} / {} concurrent conversations for {} / {} / {} s",
        a.low, a.high, a.low, a.warm_secs, a.step_secs, a.after_secs
    );

    let t0 = Instant::now();
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (sys_api, sampling) = (api.clone(), sampling.clone());
        let targets = [auto.clone(), fixed.clone()];
        let sys = &sys;
        async move {
            while !sampling.load(Ordering::Relaxed) {
                for t in &targets {
                    let nodes = gpu_nodes(sys, &sys_api, &t.id).await;
                    let (ready, wanted) = counts(&get_di(sys, &sys_api, &t.id).await);
                    t.trace.lock().unwrap().push((
                        t0.elapsed().as_secs_f64(),
                        nodes,
                        ready,
                        wanted,
                    ));
                }
                tokio::time::sleep(Duration::from_millis(1000)).await;
            }
        }
    };
    let load = async {
        let phase = |workers: usize, first: usize, secs: u64| {
            let auto = auto.clone();
            let fixed = fixed.clone();
            async move {
                let stop = Arc::new(AtomicBool::new(false));
                let mut tasks = drive(auto, workers, first, t0, stop.clone());
                tasks.extend(drive(fixed, workers, first, t0, stop.clone()));
                tokio::time::sleep(Duration::from_secs(secs)).await;
                stop.store(true, Ordering::Relaxed);
                for t in tasks {
                    let _ = t.await;
                }
            }
        };
        phase(a.low, 0, a.warm_secs).await;
        let step_start = t0.elapsed().as_secs_f64();
        eprintln!("step up to {} at {step_start:.0} s", a.high);
        phase(a.high, 100, a.step_secs).await;
        let step_end = t0.elapsed().as_secs_f64();
        eprintln!("step down to {} at {step_end:.0} s", a.low);
        phase(a.low, 200, a.after_secs).await;
        (step_start, step_end)
    };
    let (step, ()) = tokio::join!(
        async {
            let step = load.await;
            // Idle until the autoscaled DI is at zero, then stop sampling.
            let idle_from = Instant::now();
            loop {
                let (ready, wanted) = counts(&get_di(&sys, &api, &auto.id).await);
                if ready == 0 && wanted == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            eprintln!(
                "autoscaled DI at zero {:.0} s after the load stopped",
                idle_from.elapsed().as_secs_f64()
            );
            sampling.store(true, Ordering::Relaxed);
            step
        },
        sampler
    );

    println!("\nload step under the autoscaler: {MODEL} on {GPU}, SLO TTFT <= 600 ms and TPOT <= 60 ms (p90)");
    println!(
        "load: {} / {} / {} concurrent conversations for {} / {} / {} s; autoscaled: 0..{} replicas, fixed: {}",
        a.low, a.high, a.low, a.warm_secs, a.step_secs, a.after_secs, a.max, a.max
    );
    println!(
        "{:<10} {:>5} {:>6} {:>9} {:>9} {:>8} {:>8} {:>10} {:>10} {:>10} {:>9}",
        "DI",
        "reqs",
        "failed",
        "SLO %",
        "SLO step",
        "TTFT p50",
        "TTFT p90",
        "wants more",
        "serves more",
        "wants less",
        "GPU-h"
    );
    report(&auto, &a, step);
    report(&fixed, &a, step);
    let trace = auto.trace.lock().unwrap().clone();
    let mut changes = Vec::new();
    for p in &trace {
        if changes
            .last()
            .is_none_or(|l: &(f64, usize, u64, u64)| (l.2, l.3) != (p.2, p.3))
        {
            changes.push(*p);
        }
    }
    println!(
        "autoscaled (ready, wanted) over time: {}",
        changes
            .iter()
            .map(|p| format!("{:.0}s ({},{})", p.0, p.2, p.3))
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Every decision, as the DI's events give them.
    let events = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{}/events?per_page=200", auto.id),
            &api,
            None,
        )
        .await;
    println!("autoscaler decisions:");
    for e in events.body["events"].as_array().into_iter().flatten() {
        if e["reason"].as_str().is_some_and(|r| r.starts_with("Scale")) {
            println!(
                "  {} {}: {}",
                e["time"].as_str().unwrap_or("?"),
                e["reason"].as_str().unwrap_or("?"),
                e["message"].as_str().unwrap_or("")
            );
        }
    }

    // Scale from zero: the first request after zero, as its client sees it.
    let started = Instant::now();
    let messages = [json!({"role": "user", "content": words("wake-", 100)})];
    let (first, _) = auto.chat(&messages, 20, started).await;
    println!(
        "\nscale from zero: first request {} with its first token after {:.1} s (a GPU node {:.0} s, a model load {:.0} s, the autoscaler's look every {:.1} s)",
        if first.ok { "answered" } else { "FAILED" },
        first.ttft,
        a.node_ms as f64 / 1e3,
        a.load_ms as f64 / 1e3,
        a.interval_ms as f64 / 1e3,
    );
}
