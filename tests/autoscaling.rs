//! Autoscaling through the public API, on a data plane whose model servers take time to
//! answer (the simulator's serving model in real time) and a cloud whose nodes and model loads
//! take seconds: a DI declared with an SLO and `min_replicas: 0` grows past one replica under
//! load without a failed request, shrinks back when the load stops, reaches zero when idle, and
//! answers the first request after zero (the gateway holds it while a replica starts). Every
//! decision is an event, and the DI says how many replicas it runs and wants.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use region_sim::Delays;
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{CloudOptions, System};
use test_support::{until, within};
use uuid::Uuid;

use crate::lifecycle::{di_path, fetch_ca, get, spec, start, wait_active};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";
/// Clients of the load, each calling without pause.
const CLIENTS: u64 = 24;

fn cloud() -> CloudOptions {
    CloudOptions {
        delays: Delays {
            cluster_provision_ms: 500,
            node_provision_ms: 1000,
            deletion_ms: 1000,
            lb_provision_ms: 300,
            model_load_ms: 1000,
            gateway_address_ms: 100,
        },
        serving_time_scale: 1.0,
        autoscale_interval: Some(Duration::from_millis(500)),
        scale_down_window: Some(Duration::from_secs(3)),
        ..CloudOptions::default()
    }
}

/// `(ready, wanted)` of the DI's one deployment, as GET shows them.
fn replicas(di: &Value) -> Option<(u64, u64)> {
    let r = di["replicas"].as_array()?.first()?;
    Some((r["ready"].as_u64()?, r["wanted"].as_u64()?))
}

/// A client for the DI's endpoint that waits as long as a held request may take.
fn patient_client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(60))
        .no_proxy()
        .build()
        .unwrap()
}

/// A prompt of about `words` tokens that no other prompt shares a prefix with: every request
/// pays its whole prefill.
fn unique_prompt(n: u64, words: usize) -> String {
    let mut p = format!("request {n}:");
    for i in 0..words {
        p.push_str(&format!(" w{}", (n * 7919 + i as u64) % 100_003));
    }
    p
}

async fn chat(
    client: &reqwest::Client,
    endpoint: &str,
    token: &str,
    prompt: String,
) -> Result<u16, String> {
    let r = client
        .post(format!("{endpoint}/v1/chat/completions"))
        .bearer_auth(token)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}))
        .send()
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    Ok(status)
}

/// `concurrency` clients calling without pause until stopped; counts answers and failures.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &reqwest::Client, endpoint: &str, token: &str, concurrency: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tasks = (0..concurrency)
            .map(|c| {
                let (client, endpoint, token) =
                    (client.clone(), endpoint.to_string(), token.to_string());
                let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
                tokio::spawn(async move {
                    let mut n = c * 1_000_000;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        match chat(&client, &endpoint, &token, unique_prompt(n, 1500)).await {
                            Ok(200) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            other => failures.lock().unwrap().push(format!("{other:?}")),
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failures,
            tasks,
        }
    }

    /// Requests made so far, answered or not.
    fn made(&self) -> u64 {
        self.ok.load(Ordering::Relaxed) + self.failures.lock().unwrap().len() as u64
    }

    /// Waits until `n` more requests than so far have been made, answered or not.
    async fn more(&self, n: u64, within: Duration) {
        let target = self.made() + n;
        until(within, format!("{n} more requests of the load"), || async {
            self.made() >= target
        })
        .await;
    }

    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), failures)
    }
}

/// Polls the DI until `cond` holds of its replica counts; returns the counts seen on the way.
async fn wait_replicas(
    sys: &System,
    api: &str,
    id: &str,
    what: &str,
    limit: Duration,
    cond: impl Fn(u64, u64) -> bool,
) -> Vec<(u64, u64)> {
    let seen: RefCell<Vec<(u64, u64)>> = RefCell::default();
    let status = RefCell::new(Value::Null);
    let reached = within(limit, || async {
        let di = get(sys, api, id).await.body["dedicated_inference"].clone();
        *status.borrow_mut() = di["status"].clone();
        let r = replicas(&di)?;
        if seen.borrow().last() != Some(&r) {
            seen.borrow_mut().push(r);
        }
        cond(r.0, r.1).then_some(())
    })
    .await;
    let seen = seen.into_inner();
    if reached.is_none() {
        panic!(
            "{what}: not within {limit:?}; (ready, wanted) seen: {seen:?}; status {}",
            status.into_inner()
        );
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_slo_scales_up_under_load_down_after_it_to_zero_when_idle_and_back() {
    let sys = start(cloud()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let mut body = spec(region, "autoscaled", MODEL, 1);
    body["model_deployments"][0]["workload_config"] = json!({
        "input_tokens": 1500, "output_tokens": 16,
        "slo": {"ttft_ms": 150, "percentile": 90},
        "autoscaling": {"min_replicas": 0, "max_replicas": 3, "scale_to_zero_after_seconds": 60},
    });
    let created = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &api,
            Some(json!({ "spec": body })),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["dedicated_inference"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let token = created.body["token"]["value"].as_str().unwrap().to_string();
    let (active, _) = wait_active(&sys, &api, region, &id, 1).await;
    assert_eq!(
        active["spec"]["model_deployments"][0]["workload_config"]["autoscaling"]["min_replicas"], 0,
        "the declaration is shown back: {active}"
    );
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = patient_client(&fetch_ca(&sys, &api, &id).await);
    wait_replicas(
        &sys,
        &api,
        &id,
        "one ready replica",
        Duration::from_secs(30),
        |r, w| r == 1 && w == 1,
    )
    .await;

    // Under load: prompts of 1,500 uncached tokens from 24 clients queue for prefill far past
    // the 150 ms TTFT objective on one replica. The DI grows, and not one request fails.
    let load = Load::start(&client, &endpoint, &token, CLIENTS);
    let grew = wait_replicas(
        &sys,
        &api,
        &id,
        "more than one ready replica under load",
        Duration::from_secs(90),
        |r, w| r >= 2 && w >= 2,
    )
    .await;
    // And on the grown DI: two more requests from every client, about two seconds at this load.
    load.more(2 * CLIENTS, Duration::from_secs(60)).await;
    let (ok, failures) = load.finish().await;
    println!("under load: {ok} answered, (ready, wanted) went {grew:?}");
    assert!(
        failures.is_empty(),
        "{} failed requests while scaling up: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(ok > 20, "the load ran: {ok} answered");

    // The load stops: one replica at a time back to one (the floor above zero) ...
    let shrank = wait_replicas(
        &sys,
        &api,
        &id,
        "back to one replica",
        Duration::from_secs(60),
        |r, w| r == 1 && w == 1,
    )
    .await;
    println!("after the load: {shrank:?}");
    // ... and, idle for a minute, to zero. The DI stays active: its endpoint takes requests.
    let zero = wait_replicas(
        &sys,
        &api,
        &id,
        "zero replicas when idle",
        Duration::from_secs(120),
        |r, w| r == 0 && w == 0,
    )
    .await;
    println!("idle: {zero:?}");
    let di = get(&sys, &api, &id).await.body["dedicated_inference"].clone();
    assert_eq!(di["status"], "active", "{di}");

    // The first request after zero waits at the gateway while a node and a replica start,
    // then is answered.
    let started = Instant::now();
    let first = chat(&client, &endpoint, &token, unique_prompt(1, 20)).await;
    let waited = started.elapsed();
    println!("first request after zero: {first:?} after {waited:?}");
    assert_eq!(first, Ok(200), "the first request after zero is answered");
    assert!(
        waited >= Duration::from_secs(1),
        "it waited for a replica to start ({waited:?})"
    );
    wait_replicas(
        &sys,
        &api,
        &id,
        "one replica again",
        Duration::from_secs(30),
        |r, w| r == 1 && w == 1,
    )
    .await;

    // Every decision is an event, with the signal behind it.
    let events = sys
        .call(
            Method::GET,
            &di_path(&id, "/events?per_page=200"),
            &api,
            None,
        )
        .await;
    assert_eq!(events.status, 200, "{}", events.body);
    let events = events.body["events"].as_array().unwrap().clone();
    let of = |reason: &str| -> Vec<String> {
        events
            .iter()
            .filter(|e| e["reason"] == reason)
            .map(|e| e["message"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let up = of("ScaledUp");
    assert!(
        up.iter().any(|m| m.contains("TTFT p90")),
        "scale-ups name the signal: {up:?}"
    );
    assert!(!of("ScaledDown").is_empty(), "{events:?}");
    assert!(
        of("ScaledToZero")
            .iter()
            .any(|m| m.contains("no request for")),
        "{events:?}"
    );
    assert!(
        of("ScaledFromZero")
            .iter()
            .any(|m| m.contains("held by the gateway")),
        "{events:?}"
    );
    // The accelerators are the GPU nodes that exist now: one, after the wake.
    let accelerators = sys
        .call(Method::GET, &di_path(&id, "/accelerators"), &api, None)
        .await;
    assert_eq!(accelerators.status, 200);
    let gpus: Vec<&Value> = accelerators.body["accelerators"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["status"] == "active")
        .collect();
    assert_eq!(gpus.len(), 1, "{}", accelerators.body);
}
