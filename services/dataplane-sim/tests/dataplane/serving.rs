//! The serving model behind the data plane: replicas with a batch, a queue and a prefix cache,
//! routed by the endpoint picker's configuration; over real HTTPS, on a data-plane endpoint
//! alone (in a simulated cluster whose ConfigMap holds the picker's configuration: `region-sim`'s
//! tests).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dataplane_sim::auth::Authentication;
use dataplane_sim::data_plane::{
    token_hash, Backend, Endpoint, EndpointConfig, ModelTiming, Route,
};
use dataplane_sim::picker::{PickerConfig, PoolSpec, LLM_D_DEFAULT_CONFIG};
use dataplane_sim::serving::{BackendServing, Counters, Replica, ReplicaSpec, ServingConfig};
use endpoint_auth::TokenHashes;
use region_sim_base::faults::Faults;
use region_sim_base::front::Front;
use serde_json::{json, Value};

use crate::data_plane::{client, pki};

const TOKEN: &str = "di_0123456789abcdefghijklmnopqrstuvwxyzABCD";
const MODEL: &str = "llama-3.1-8b";

/// Prefix-cache scoring alone.
const PREFIX_ONLY: &str = "kind: EndpointPickerConfig
plugins: [{type: prefix-cache-scorer}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: prefix-cache-scorer, weight: 1}]}]
";

/// No scorer at all: round robin.
const ROUND_ROBIN: &str = "kind: EndpointPickerConfig
plugins: [{type: random-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]
";

fn serving(time_scale: f64) -> ServingConfig {
    ServingConfig {
        time_scale,
        ..Default::default()
    }
}

/// A data-plane endpoint in front of H100 pods `pods` of one pool whose picker runs `picker`.
struct Plane {
    ep: Endpoint,
    http: reqwest::Client,
    pods: Vec<String>,
}

impl Plane {
    async fn start(cfg: ServingConfig, picker: Option<&str>, pods: &[&str]) -> Plane {
        let timing = Arc::new(RwLock::new(ModelTiming {
            ttft_ms: 5,
            per_token_ms: 1,
            serving: cfg,
        }));
        let front = Front::start(0).await.unwrap();
        let ep = Endpoint::start(
            &front,
            front.addresses().allocate(),
            timing,
            Arc::new(Faults::default()),
        );
        let (ca, cert, key) = pki("serving-ca", &ep);
        let plane = Plane {
            ep,
            http: client(&ca),
            pods: pods.iter().map(|p| p.to_string()).collect(),
        };
        plane.ep.update(plane.config(&cert, &key, picker)).unwrap();
        plane
    }

    fn config(&self, cert: &str, key: &str, picker: Option<&str>) -> EndpointConfig {
        let pool = Arc::new(PoolSpec {
            key: String::new(),
            picker: picker.map(|t| PickerConfig::parse(t).unwrap()),
        });
        let spec = ReplicaSpec {
            gpu_model: Some("h100".into()),
            gpus: 1,
            ..Default::default()
        };
        EndpointConfig {
            overrides: Vec::new(),
            tls: Some((cert.into(), key.into())),
            auth: Authentication::external(TokenHashes::from_hex([token_hash(TOKEN)])),
            route: Route::Pool {
                paths: vec!["/".into()],
                endpoints: self
                    .pods
                    .iter()
                    .map(|p| {
                        let mut b = Backend::new(p.as_str(), Some(MODEL));
                        b.serving = BackendServing::new(spec.clone(), Some(pool.clone()));
                        b
                    })
                    .collect(),
                pools: vec![],
            },
        }
    }

    /// Another picker configuration, as a changed ConfigMap brings it.
    fn repick(&self, picker: Option<&str>) {
        let mut cfg = self.ep.config();
        if let Route::Pool { endpoints, .. } = &mut cfg.route {
            let pool = Arc::new(PoolSpec {
                key: String::new(),
                picker: picker.map(|t| PickerConfig::parse(t).unwrap()),
            });
            for b in endpoints {
                b.serving.pool = Some(pool.clone());
            }
        }
        self.ep.update(cfg).unwrap();
    }

    fn replica(&self, pod: &str) -> Arc<Replica> {
        match self.ep.config().route {
            Route::Pool { endpoints, .. } => endpoints
                .iter()
                .find(|b| b.pod == pod)
                .and_then(|b| b.serving.replica().cloned())
                .expect("the pod has a replica"),
            Route::None => panic!("no route"),
        }
    }

    fn counters(&self) -> Counters {
        let mut sum = Counters::default();
        for p in &self.pods {
            let c = self.replica(p).counters();
            sum.prefix_queries += c.prefix_queries;
            sum.prefix_hits += c.prefix_hits;
            sum.generation_tokens += c.generation_tokens;
            sum.finished += c.finished;
            sum.evicted_blocks += c.evicted_blocks;
            sum.ttft_count += c.ttft_count;
            sum.ttft_sum += c.ttft_sum;
        }
        sum
    }

    fn hit_rate(&self) -> f64 {
        let c = self.counters();
        c.prefix_hits as f64 / c.prefix_queries.max(1) as f64
    }

    /// A chat completion of exactly `tokens` tokens: (pod, answer).
    async fn chat(&self, messages: &[Value], tokens: u32) -> (String, String) {
        chat_at(&self.http, &self.ep.url(), messages, tokens).await
    }

    /// `chat` as a task of its own, answered after `admitted` once the engine has taken it in:
    /// requests started one after another reach the picker in that order, whatever the timing.
    async fn start_chat(
        &self,
        messages: Vec<Value>,
        tokens: u32,
    ) -> tokio::task::JoinHandle<(String, String)> {
        let (http, url) = (self.http.clone(), self.ep.url());
        let admitted = self.counters().prefix_queries;
        let task = tokio::spawn(async move { chat_at(&http, &url, &messages, tokens).await });
        eventually("the engine takes the request in", async || {
            (self.counters().prefix_queries > admitted).then_some(())
        })
        .await;
        task
    }
}

async fn chat_at(
    http: &reqwest::Client,
    url: &str,
    messages: &[Value],
    tokens: u32,
) -> (String, String) {
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": tokens, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let pod = r.headers()["x-sim-backend"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], tokens);
    (
        pod,
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

async fn eventually<T>(what: &str, f: impl AsyncFnMut() -> Option<T>) -> T {
    test_support::eventually(Duration::from_millis(7500), what, f).await
}

/// `n` distinct words: a document of `n` tokens.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Multi-turn conversations, `parallel` at a time: a system prompt every conversation shares
/// (`shared_system`), a document of its own, then `turns` questions, each with the history so
/// far. The conversations of a batch take their turns together, each turn's requests reaching
/// the picker in conversation order, so what a picker decides does not depend on the machine's
/// speed. The pods each conversation's turns went to, in conversation order.
async fn workload(
    p: &Plane,
    conversations: usize,
    parallel: usize,
    turns: usize,
    shared_system: bool,
) -> Vec<Vec<String>> {
    let system = words("sys", 200);
    let mut out = Vec::new();
    for batch in (0..conversations).collect::<Vec<_>>().chunks(parallel) {
        let mut histories: Vec<Vec<Value>> = batch
            .iter()
            .map(|c| {
                let own = json!({"role": "user", "content": format!("{} {}", words(&format!("doc{c}w"), 300), words(&format!("q{c}t0w"), 20))});
                match shared_system {
                    true => vec![json!({"role": "system", "content": system}), own],
                    false => vec![own],
                }
            })
            .collect();
        let mut pods = vec![Vec::new(); batch.len()];
        for t in 0..turns {
            let mut running = Vec::new();
            for messages in &histories {
                running.push(p.start_chat(messages.clone(), 40).await);
            }
            for (((c, messages), task), pods) in
                batch.iter().zip(&mut histories).zip(running).zip(&mut pods)
            {
                let (pod, answer) = task.await.unwrap();
                pods.push(pod);
                messages.push(json!({"role": "assistant", "content": answer}));
                messages.push(
                    json!({"role": "user", "content": words(&format!("q{c}t{}w", t + 1), 20)}),
                );
            }
        }
        out.extend(pods);
    }
    out
}

/// How many requests each pod served.
fn per_pod(conversations: &[Vec<String>]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for pod in conversations.iter().flatten() {
        *out.entry(pod.clone()).or_insert(0) += 1;
    }
    out
}

/// Two replicas, the same conversations: routed by the prefix-cache scorer, a conversation's
/// turns find its history cached; round robin, they often land where it is not.
#[tokio::test]
async fn prefix_aware_routing_hits_the_cache_more_than_round_robin() {
    let pods = ["vllm-a", "vllm-b"];
    let aware = Plane::start(serving(0.02), Some(LLM_D_DEFAULT_CONFIG), &pods).await;
    let spread = per_pod(&workload(&aware, 9, 3, 4, true).await);
    let rr = Plane::start(serving(0.02), Some(ROUND_ROBIN), &pods).await;
    let rr_spread = per_pod(&workload(&rr, 9, 3, 4, true).await);
    let (a, r) = (aware.hit_rate(), rr.hit_rate());
    eprintln!(
        "prefix-cache hit rate: picker {a:.3} ({spread:?}), round robin {r:.3} ({rr_spread:?})"
    );
    assert!(a > 0.6, "{a}");
    assert!(a > r + 0.1, "picker {a} vs round robin {r}");
    // Where the replicas went is not asserted here: at this light load the prefix scorer
    // rightly keeps every conversation where the shared system prompt is cached (below, without
    // one, it spreads them).
    assert_eq!(
        rr_spread.values().copied().collect::<Vec<_>>(),
        vec![18, 18]
    );
    assert_eq!(aware.counters().finished, 36);
}

/// Conversations that share nothing: each new one ties between the replicas (ties go round
/// robin) and every later turn follows its own history. A picker that kept to one replica, or
/// matched only a shared head, would fail one or the other.
#[tokio::test]
async fn the_prefix_scorer_keeps_each_conversation_where_its_history_is() {
    let pods = ["vllm-a", "vllm-b"];
    let p = Plane::start(serving(0.02), Some(PREFIX_ONLY), &pods).await;
    let conversations = workload(&p, 4, 2, 4, false).await;
    for turns in &conversations {
        assert!(
            turns.iter().all(|pod| *pod == turns[0]),
            "{conversations:?}"
        );
    }
    assert_eq!(per_pod(&conversations).len(), 2, "{conversations:?}");
}

/// `messages` six times, 20 ms apart (longer than the picker's metrics refresh interval at
/// this time scale) without waiting for the answers: how many requests each replica got.
async fn burst(p: &Plane, messages: &[Value]) -> BTreeMap<String, usize> {
    let runs = (0..6).map(|i| async move {
        // A pace, not a wait for a condition: the workload's shape. The serving model and the
        // picker's scrapes run on real time, scaled.
        tokio::time::sleep(Duration::from_millis(20 * i)).await;
        p.chat(messages, 30).await
    });
    let mut used = BTreeMap::new();
    for (pod, _) in futures::future::join_all(runs).await {
        *used.entry(pod).or_insert(0) += 1;
    }
    used
}

/// The same prompt again and again: the prefix-cache scorer alone sends it where it went; with
/// the queue scorer (weighted higher), a replica whose queue grows stops being chosen; with the
/// KV-utilisation scorer, a request goes to the replica whose cache is less used.
#[tokio::test]
async fn queue_and_kv_scorers_spread_the_load() {
    let cfg = ServingConfig {
        max_num_seqs: Some(1),
        ..serving(0.2)
    };
    let pods = ["vllm-a", "vllm-b"];
    let p = Plane::start(cfg, Some(PREFIX_ONLY), &pods).await;
    let messages = [json!({"role": "user", "content": words("same", 100)})];
    let used = burst(&p, &messages).await;
    assert_eq!(used.len(), 1, "prefix only: one replica, {used:?}");

    p.repick(Some(
        "kind: EndpointPickerConfig
plugins: [{type: prefix-cache-scorer}, {type: queue-scorer}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: prefix-cache-scorer, weight: 1}, {pluginRef: queue-scorer, weight: 2}]}]
",
    ));
    let used = burst(&p, &messages).await;
    assert_eq!(used.len(), 2, "prefix and queue: both replicas, {used:?}");

    p.repick(Some(
        "kind: EndpointPickerConfig
schedulingProfiles: [{name: default, plugins: [{pluginRef: kv-cache-utilization-scorer}]}]
",
    ));
    let long = p.chat(&messages, 200);
    let second = async {
        // Once the first request holds KV blocks on its replica, the next goes to the other.
        let first = eventually("a replica runs the first request", async || {
            pods.iter()
                .find(|pod| p.replica(pod).load().running == 1)
                .map(|pod| pod.to_string())
        })
        .await;
        let (pod, _) = p.chat(&messages, 5).await;
        (first, pod)
    };
    let ((long_pod, _), (first, second)) = futures::join!(long, second);
    assert_eq!(long_pod, first);
    assert_ne!(first, second, "the less used cache wins");
}

/// One replica with one batch slot: requests queue, and the time to their first token grows
/// with the queue; `vllm:num_requests_waiting` shows it meanwhile.
#[tokio::test]
async fn time_to_first_token_grows_with_the_queue() {
    // A scale at which a request takes about 70 ms: the queue stays three deep or more for a
    // good part of a second, many looks of the watch below.
    let cfg = ServingConfig {
        max_num_seqs: Some(1),
        ..serving(0.5)
    };
    let p = Plane::start(cfg, Some(LLM_D_DEFAULT_CONFIG), &["vllm-a"]).await;
    let r = p.replica("vllm-a");
    let plane = &p;
    let ask = |i: usize| {
        let m = [json!({"role": "user", "content": words(&format!("r{i}w"), 200)})];
        async move { plane.chat(&m, 20).await }
    };
    ask(0).await;
    let solo = r.counters();
    let solo_ttft = solo.ttft_sum / solo.ttft_count as f64;
    let mut waiting = 0;
    let burst = futures::future::join_all((1..=8).map(ask));
    let watch = async {
        let text = test_support::within(Duration::from_secs(10), async || {
            waiting = waiting.max(r.load().waiting);
            (waiting >= 3).then(|| r.metrics_text())
        })
        .await;
        if let Some(text) = text {
            let line = text
                .lines()
                .find(|l| l.starts_with("vllm:num_requests_waiting{"))
                .unwrap();
            let shown: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(shown >= 1.0, "{line}");
        }
    };
    futures::join!(burst, watch);
    let all = r.counters();
    let burst_ttft = (all.ttft_sum - solo.ttft_sum) / (all.ttft_count - solo.ttft_count) as f64;
    eprintln!("TTFT alone {solo_ttft:.3} s, in a queue of 8: {burst_ttft:.3} s (simulated); waiting up to {waiting}");
    assert!(waiting >= 3, "{waiting}");
    assert!(burst_ttft > 3.0 * solo_ttft, "{solo_ttft} {burst_ttft}");
}

/// A cache of 48 blocks (768 tokens): three different 300-token prompts later, the first one's
/// blocks are gone; in a cache with room they would still be there.
#[tokio::test]
async fn a_full_cache_evicts_the_least_recently_used_blocks() {
    for (blocks, evicts) in [(48, true), (10_000, false)] {
        let cfg = ServingConfig {
            kv_cache_blocks: Some(blocks),
            ..serving(0.01)
        };
        let p = Plane::start(cfg, None, &["vllm-a"]).await;
        let prompt = |i: usize| [json!({"role": "user", "content": words(&format!("p{i}w"), 300)})];
        for i in [0, 1, 2, 3] {
            p.chat(&prompt(i), 10).await;
        }
        let before = p.counters();
        p.chat(&prompt(0), 10).await;
        let after = p.counters();
        let hit = after.prefix_hits - before.prefix_hits;
        assert_eq!(
            after.evicted_blocks > 0,
            evicts,
            "{blocks} blocks: {after:?}"
        );
        if evicts {
            assert_eq!(hit, 0, "evicted");
        } else {
            assert!(hit >= 288, "{hit}");
        }
    }
}

/// Streaming sends each token when the engine makes it; a non-streaming answer comes after the
/// whole generation. `vllm:time_per_output_token_seconds` counts every gap.
#[tokio::test]
async fn streams_at_the_decode_pace() {
    let p = Plane::start(serving(0.5), None, &["vllm-a"]).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 40, "ignore_eos": true, "stream": true});
    let started = Instant::now();
    let mut r = p
        .http
        .post(format!("{}/v1/chat/completions", p.ep.url()))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        let s = String::from_utf8_lossy(&chunk).to_string();
        for _ in s.matches("\"content\":\"").filter(|_| true) {
            arrivals.push(started.elapsed());
        }
        text.push_str(&s);
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""));
    // The role announcement (empty content) and 40 tokens.
    assert_eq!(arrivals.len(), 41, "{text}");
    let r = p.replica("vllm-a");
    let tpot = r.shape().step_seconds(1, 50, &[]);
    let spread = arrivals[40] - arrivals[1];
    let expected = Duration::from_secs_f64(39.0 * tpot * 0.5);
    assert!(
        spread >= expected.mul_f64(0.8),
        "{spread:?} < {expected:?}: {arrivals:?}"
    );
    let metrics = r.metrics_text();
    assert!(
        metrics.contains(
            "vllm:time_per_output_token_seconds_count{engine=\"0\",model_name=\"llama-3.1-8b\"} 39"
        ),
        "{metrics}"
    );

    let started = Instant::now();
    p.chat(&[json!({"role": "user", "content": "hello again"})], 40)
        .await;
    assert!(
        started.elapsed() >= expected.mul_f64(0.8),
        "{:?}",
        started.elapsed()
    );
}

/// Time scale 0 (the default): answers as before the serving model, round robin whatever the
/// picker's configuration, and the replicas see nothing.
#[tokio::test]
async fn time_scale_zero_keeps_instant_round_robin_answers() {
    assert_eq!(ModelTiming::default().serving.time_scale, 0.0);
    let p = Plane::start(serving(0.0), Some(PREFIX_ONLY), &["vllm-a", "vllm-b"]).await;
    let messages = [json!({"role": "user", "content": words("same", 500)})];
    let started = Instant::now();
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(p.chat(&messages, 3).await.0);
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(seen, ["vllm-a", "vllm-b", "vllm-a", "vllm-b"]);
    assert_eq!(p.counters(), Counters::default());
}
