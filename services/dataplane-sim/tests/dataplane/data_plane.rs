//! The simulated data plane on its own (no Kubernetes): TLS from PEM, token hashes, routing
//! outcomes, and the official `openai` Python client against it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dataplane_sim::auth::Authentication;
use dataplane_sim::data_plane::{
    held_requests, token_hash, Backend, Endpoint, EndpointConfig, ModelTiming, PoolRoute, Route,
    ROUTE_TIMEOUT,
};
use endpoint_auth::TokenHashes;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use region_sim_base::faults::{ApiFaults, FaultConfig, Faults};
use region_sim_base::front::Front;
use serde_json::{json, Value};

const TOKEN: &str = "di_0123456789abcdefghijklmnopqrstuvwxyzABCD";
const MODEL: &str = "tiny-llm";

/// A CA and a server certificate for the endpoint's address and `localhost`, as PEM: (ca, cert,
/// key).
pub(crate) fn pki(cn: &str, ep: &Endpoint) -> (String, String, String) {
    ca_and_cert(cn, vec![ep.ip().to_string(), "localhost".to_string()])
}

/// A CA named `cn` and a server certificate for `hosts` it signed, as PEM: (ca, cert, key).
pub(crate) fn ca_and_cert(cn: &str, hosts: Vec<String>) -> (String, String, String) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, cn);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf = CertificateParams::new(hosts).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &ca_cert, &ca_key).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

fn wired(cert: &str, key: &str, endpoints: &[&str]) -> EndpointConfig {
    EndpointConfig {
        overrides: Vec::new(),
        tls: Some((cert.to_string(), key.to_string())),
        auth: Authentication::external(TokenHashes::from_hex([token_hash(TOKEN)])),
        route: Route::Pool {
            paths: vec!["/".into()],
            endpoints: endpoints
                .iter()
                .map(|pod| Backend::new(*pod, Some(MODEL)))
                .collect(),
            pools: vec![],
        },
    }
}

/// An endpoint at an address of its own on a front of its own.
async fn endpoint(faults: Arc<Faults>) -> Endpoint {
    let timing = Arc::new(RwLock::new(ModelTiming {
        ttft_ms: 5,
        per_token_ms: 1,
        ..Default::default()
    }));
    let front = Front::start(0).await.unwrap();
    let ip = front.addresses().allocate();
    Endpoint::start(&front, ip, timing, faults)
}

pub(crate) fn client(ca: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .build()
        .unwrap()
}

/// A chat completion with the test's token, owning what it needs (to be spawned and held).
async fn chat_owned(c: reqwest::Client, url: String) -> reqwest::Response {
    c.post(format!("{url}/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap()
}

async fn chat(c: &reqwest::Client, ep: &Endpoint, token: &str) -> reqwest::Response {
    c.post(format!("{}/v1/chat/completions", ep.url()))
        .bearer_auth(token)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn fails_like_a_gateway_when_wiring_is_incomplete() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca, cert, key) = pki("ca-1", &ep);
    let c = client(&ca);

    // No certificate on the listener: the handshake fails.
    assert!(c
        .get(format!("{}/v1/models", ep.url()))
        .send()
        .await
        .is_err());

    // Certificate but no route: 404.
    ep.update(EndpointConfig {
        overrides: Vec::new(),
        tls: Some((cert.clone(), key.clone())),
        auth: Authentication::external(TokenHashes::from_hex([token_hash(TOKEN)])),
        route: Route::None,
    })
    .unwrap();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());

    // Route but no ready pod: 503 (after authentication).
    ep.update(wired(&cert, &key, &[])).unwrap();
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 503);
    assert_eq!(chat(&c, &ep, "nope").await.status(), 401);

    // Wired: 200, round-robin over the ready pods.
    ep.update(wired(&cert, &key, &["pod-a", "pod-b"])).unwrap();
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        let r = chat(&c, &ep, TOKEN).await;
        assert_eq!(r.status(), 200);
        seen.insert(r.headers()["x-sim-backend"].to_str().unwrap().to_string());
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    assert_eq!(
        seen,
        BTreeSet::from(["pod-a".to_string(), "pod-b".to_string()])
    );
    // Missing token, unknown token, token Secret missing: 401.
    let r = c
        .get(format!("{}/v1/models", ep.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_api_key"
    );
    // The authorization service unreachable: Envoy's statusOnError, whatever the token.
    let mut unreachable = wired(&cert, &key, &["pod-a"]);
    unreachable.auth = Authentication::External {
        hashes: None,
        status_on_error: 503,
        fail_open: false,
    };
    ep.update(unreachable).unwrap();
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 503);
    // A policy Envoy Gateway refused: 500. None at all: nothing is checked.
    let mut refused = wired(&cert, &key, &["pod-a"]);
    refused.auth = Authentication::Refused;
    ep.update(refused).unwrap();
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 500);
    let mut open = wired(&cert, &key, &["pod-a"]);
    open.auth = Authentication::Open;
    ep.update(open).unwrap();
    assert_eq!(chat(&c, &ep, "made-up").await.status(), 200);

    // A path the route does not match is 404.
    let mut narrow = wired(&cert, &key, &["pod-a"]);
    narrow.route = Route::Pool {
        paths: vec!["/v2".into()],
        endpoints: vec![Backend::new("pod-a", Some(MODEL))],
        pools: vec![],
    };
    ep.update(narrow).unwrap();
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 404);

    // An invalid key is reported and leaves the listener without a certificate.
    let mut broken = wired(&cert, "not a key", &["pod-a"]);
    assert!(ep.update(broken.clone()).is_err());
    assert!(client(&ca)
        .get(format!("{}/v1/models", ep.url()))
        .send()
        .await
        .is_err());
    broken.tls = Some((cert, key));
    ep.update(broken).unwrap();
    assert_eq!(chat(&client(&ca), &ep, TOKEN).await.status(), 200);
}

/// Pods serving different models behind one pool (a Deployment rolling from one model to
/// another): each request goes to a pod serving the model it names, `/v1/models` lists both, and
/// a model no pod serves is 404 as vLLM answers it.
#[tokio::test]
async fn requests_go_to_pods_serving_their_model() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca, cert, key) = pki("ca-1", &ep);
    let c = client(&ca);
    let mut cfg = wired(&cert, &key, &[]);
    cfg.route = Route::Pool {
        paths: vec!["/".into()],
        endpoints: vec![
            Backend::new("pod-old", Some("old/model")),
            Backend::new("pod-new", Some(MODEL)),
        ],
        pools: vec![],
    };
    ep.update(cfg).unwrap();
    let ask = |model: &'static str| {
        c.post(format!("{}/v1/chat/completions", ep.url()))
            .bearer_auth(TOKEN)
            .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
            .send()
    };
    for _ in 0..4 {
        for (model, pod) in [("old/model", "pod-old"), (MODEL, "pod-new")] {
            let r = ask(model).await.unwrap();
            assert_eq!(r.status(), 200, "{model}");
            assert_eq!(r.headers()["x-sim-backend"], pod, "{model}");
        }
    }
    let r = ask("other/model").await.unwrap();
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not exist"),
        "{body}"
    );
    let listed: serde_json::Value = c
        .get(format!("{}/v1/models", ep.url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        vec![MODEL, "old/model"]
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn certificate_changes_are_picked_up() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca1, cert1, key1) = pki("ca-1", &ep);
    let (ca2, cert2, key2) = pki("ca-2", &ep);
    ep.update(wired(&cert1, &key1, &["p"])).unwrap();
    assert_eq!(chat(&client(&ca1), &ep, TOKEN).await.status(), 200);
    ep.update(wired(&cert2, &key2, &["p"])).unwrap();
    // New connections see the new certificate: the old trust root no longer verifies.
    assert!(client(&ca1)
        .get(format!("{}/v1/models", ep.url()))
        .send()
        .await
        .is_err());
    assert_eq!(chat(&client(&ca2), &ep, TOKEN).await.status(), 200);
}

#[tokio::test]
async fn data_plane_faults_apply() {
    let faults = Arc::new(Faults::default());
    let ep = endpoint(faults.clone()).await;
    let (ca, cert, key) = pki("ca", &ep);
    ep.update(wired(&cert, &key, &["p"])).unwrap();
    let c = client(&ca);
    faults.set(FaultConfig {
        data_plane: ApiFaults {
            rate_limit_rate: 1.0,
            retry_after_secs: 2,
            ..Default::default()
        },
        ..Default::default()
    });
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "2");
    faults.set(FaultConfig {
        data_plane: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    assert!(chat(&c, &ep, TOKEN).await.status().is_server_error());
    faults.set(FaultConfig::default());
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 200);
}

/// A virtualenv with the `openai` package, created once under the target directory.
/// A route to one pool with no ready pod; `flow_control` as its picker's feature gate says.
fn empty_pool(
    cert: &str,
    key: &str,
    pool_key: &str,
    flow_control: bool,
    queue_ttl: Duration,
) -> EndpointConfig {
    let mut cfg = wired(cert, key, &[]);
    if let Route::Pool { pools, .. } = &mut cfg.route {
        pools.push(PoolRoute {
            name: "pool".into(),
            key: pool_key.into(),
            flow_control,
            queue_ttl,
            ..PoolRoute::default()
        });
    }
    cfg
}

/// Scale from zero, on the endpoint alone: with flow control a request waits for a ready pod
/// (counted as held for its pool) and is served once one appears; past the picker's queue TTL it
/// is the picker's 503, past the gateway's idle timeout Envoy's 408; a shutdown releases it;
/// without flow control the 503 is immediate.
#[tokio::test]
async fn a_flow_controlled_pool_holds_requests_until_a_pod_is_ready() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca, cert, key) = pki("ca-hold", &ep);
    let c = client(&ca);
    let pool_key = format!("hold-{}", ep.ip());

    // Without the gate: 503 at once, as before.
    ep.update(empty_pool(
        &cert,
        &key,
        &pool_key,
        false,
        Duration::from_secs(30),
    ))
    .unwrap();
    let started = Instant::now();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(r.headers().get("retry-after").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["message"], "no healthy upstream");

    // With it: held, counted, then served when a pod turns ready.
    ep.update(empty_pool(
        &cert,
        &key,
        &pool_key,
        true,
        Duration::from_secs(60),
    ))
    .unwrap();
    let held = tokio::spawn(chat_owned(c.clone(), ep.url()));
    wait_for("the request held", || held_requests(&pool_key) == 1).await;
    // An unauthenticated request is not held.
    assert_eq!(chat(&c, &ep, "di_wrong").await.status(), 401);
    assert!(!held.is_finished());
    let mut ready = empty_pool(&cert, &key, &pool_key, true, Duration::from_secs(60));
    if let Route::Pool { endpoints, .. } = &mut ready.route {
        endpoints.push(Backend::new("pod-a", Some(MODEL)));
    }
    ep.update(ready).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("served once a pod is ready")
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sim-backend"], "pod-a");
    assert_eq!(held_requests(&pool_key), 0);

    // Past the picker's queue TTL: its 503, with its reason, and the gauge back to 0.
    ep.update(empty_pool(
        &cert,
        &key,
        &pool_key,
        true,
        Duration::from_millis(300),
    ))
    .unwrap();
    let started = Instant::now();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        r.headers()["x-llm-d-request-dropped-reason"],
        "rejected-no-endpoints"
    );
    assert!(
        r.headers().get("retry-after").is_none(),
        "the picker says nothing of it"
    );
    assert_eq!(held_requests(&pool_key), 0);

    // The gateway's idle timeout, when it is the shorter: Envoy's 408.
    let mut idle = empty_pool(&cert, &key, &pool_key, true, Duration::from_secs(60));
    if let Route::Pool { pools, .. } = &mut idle.route {
        pools[0].stream_idle = Some(Duration::from_millis(300));
    }
    ep.update(idle).unwrap();
    assert_eq!(chat(&c, &ep, TOKEN).await.status(), 408);

    // A shutdown releases what is held.
    ep.update(empty_pool(
        &cert,
        &key,
        &pool_key,
        true,
        Duration::from_secs(60),
    ))
    .unwrap();
    let held = tokio::spawn({
        let (c, url) = (c.clone(), ep.url());
        async move {
            c.post(format!("{url}/v1/chat/completions"))
                .bearer_auth(TOKEN)
                .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
        }
    });
    wait_for("the request held", || held_requests(&pool_key) == 1).await;
    ep.shutdown();
    let r = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("released at shutdown")
        .unwrap();
    // Closed with the connection, or answered 503 first: either way not held any more.
    if let Ok(r) = r {
        assert_eq!(r.status(), 503);
    }
    wait_for("the gauge back to 0", || held_requests(&pool_key) == 0).await;
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    test_support::until(Duration::from_secs(10), what, async || f()).await
}

fn python_with_openai() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin").join("python");
    let has_openai = |p: &Path| {
        p.exists()
            && Command::new(p)
                .args(["-c", "import openai"])
                .status()
                .is_ok_and(|s| s.success())
    };
    if !has_openai(&python) {
        let st = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 -m venv");
        assert!(st.success(), "creating the virtualenv failed");
        let st = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "openai",
            ])
            .status()
            .expect("pip install openai");
        assert!(st.success(), "pip install openai failed");
    }
    python
}

const SCRIPT: &str = r#"
import json, os, ssl, sys
import openai

base, token, model = os.environ["BASE_URL"], os.environ["TOKEN"], os.environ["MODEL"]
ctx = ssl.create_default_context(cafile=os.environ["CA_FILE"])

# Newer openai releases ship their HTTP stack as httpx2; older ones use httpx.
http_factory = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient

def client(tok):
    return openai.OpenAI(base_url=base + "/v1", api_key=tok, max_retries=0,
                         http_client=http_factory(verify=ctx))

c = client(token)
out = {}
out["models"] = [m.id for m in c.models.list().data]

msgs = [{"role": "user", "content": "Tell me about GPUs in the cloud"}]
r = c.chat.completions.create(model=model, messages=msgs, max_tokens=6)
out["chat"] = r.choices[0].message.content
out["chat_finish"] = r.choices[0].finish_reason
out["chat_usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens]
again = c.chat.completions.create(model=model, messages=msgs, max_tokens=6)
out["chat_deterministic"] = again.choices[0].message.content == out["chat"]

pieces, usage, chunks = [], None, 0
for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}):
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens
    for ch in chunk.choices:
        if ch.delta.content:
            pieces.append(ch.delta.content)
out["stream"] = "".join(pieces)
out["stream_chunks"] = chunks
out["stream_usage"] = usage

comp = c.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
out["completion"] = comp.choices[0].text
out["completion_tokens"] = comp.usage.completion_tokens
streamed = "".join(ch.choices[0].text for ch in c.completions.create(
    model=model, prompt="Once upon a time", max_tokens=4, stream=True) if ch.choices)
out["completion_stream_matches"] = streamed == comp.choices[0].text

try:
    client("di_wrong").models.list()
    out["bad_token"] = "accepted"
except openai.AuthenticationError as e:
    out["bad_token"] = "AuthenticationError %d" % e.status_code

try:
    c.chat.completions.create(model="other-model", messages=msgs)
    out["wrong_model"] = "accepted"
except openai.NotFoundError:
    out["wrong_model"] = "NotFoundError"

print(json.dumps(out))
"#;

#[tokio::test]
async fn official_openai_python_client_works_against_the_endpoint() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca, cert, key) = pki("sim-ca", &ep);
    ep.update(wired(&cert, &key, &["vllm-0"])).unwrap();
    let dir = std::env::temp_dir().join(format!("region-sim-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let script = dir.join("client.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let url = ep.url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .env("BASE_URL", url)
            .env("TOKEN", TOKEN)
            .env("MODEL", MODEL)
            .env("CA_FILE", ca_file)
            .output()
            .expect("run python")
    })
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("python printed JSON");
    assert_eq!(v["models"], json!([MODEL]));
    assert_eq!(v["chat_finish"], "length");
    assert_eq!(v["chat_usage"][1], 6);
    assert_eq!(
        v["chat_usage"][2].as_u64().unwrap(),
        v["chat_usage"][0].as_u64().unwrap() + 6
    );
    assert_eq!(v["chat"].as_str().unwrap().split_whitespace().count(), 6);
    assert_eq!(v["chat_deterministic"], true);
    assert_eq!(
        v["stream"], v["chat"],
        "streamed text equals the non-streamed text"
    );
    assert!(v["stream_chunks"].as_u64().unwrap() >= 8, "{v}");
    assert_eq!(v["stream_usage"], 6);
    assert_eq!(v["completion_tokens"], 4);
    assert!(!v["completion"].as_str().unwrap().is_empty());
    assert_eq!(v["completion_stream_matches"], true);
    assert_eq!(v["bad_token"], "AuthenticationError 401");
    assert_eq!(v["wrong_model"], "NotFoundError");
}

/// A cold start of minutes, on tokio's paused clock: a request to a pool at zero, held by the
/// picker's 15-minute queue TTL, is answered when a replica turns ready three minutes later; one
/// that finds no replica within the TTL gets the picker's 503 at fifteen minutes.
#[tokio::test(start_paused = true)]
async fn a_request_waits_out_a_cold_start_of_minutes() {
    let ep = endpoint(Arc::new(Faults::default())).await;
    let (ca, cert, key) = pki("ca-cold", &ep);
    let c = client(&ca);
    let pool_key = format!("cold-{}", ep.ip());
    let hold = Duration::from_secs(900);
    // A route with a request timeout: the gateway's idle timeout is an hour, above the hold.
    let at_zero = || {
        let mut cfg = empty_pool(&cert, &key, &pool_key, true, hold);
        if let Route::Pool { pools, .. } = &mut cfg.route {
            pools[0].stream_idle = Some(Duration::from_secs(3600));
        }
        cfg
    };
    ep.update(at_zero()).unwrap();
    let started = tokio::time::Instant::now();
    let held = tokio::spawn(chat_owned(c.clone(), ep.url()));
    wait_for("the request held", || held_requests(&pool_key) == 1).await;
    // A GPU node and a model load: three minutes, on the paused clock.
    tokio::time::sleep(Duration::from_secs(180)).await;
    assert!(!held.is_finished(), "still held after three minutes");
    let mut ready = at_zero();
    if let Route::Pool { endpoints, .. } = &mut ready.route {
        endpoints.push(Backend::new("pod-a", Some(MODEL)));
    }
    ep.update(ready).unwrap();
    let r = held.await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() >= Duration::from_secs(180));

    // No replica within the hold: the picker's 503 once it has passed.
    ep.update(at_zero()).unwrap();
    let started = tokio::time::Instant::now();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() >= hold, "{:?}", started.elapsed());
    assert_eq!(
        r.headers()["x-llm-d-request-dropped-reason"],
        "rejected-no-endpoints"
    );
}

/// Envoy's route timeout, on tokio's paused clock: a rule without `timeouts.request` gets
/// Envoy's 15 s, so an answer that takes 20 s is cut (504 before its headers; a stream ends in an
/// error after them); a rule with an hour lets it through, another model's included.
#[tokio::test(start_paused = true)]
async fn a_route_timeout_cuts_a_response_that_takes_longer() {
    let timing = Arc::new(RwLock::new(ModelTiming {
        ttft_ms: 20_000,
        per_token_ms: 1,
        ..Default::default()
    }));
    let front = Front::start(0).await.unwrap();
    let ip = front.addresses().allocate();
    let ep = Endpoint::start(&front, ip, timing, Arc::new(Faults::default()));
    let (ca, cert, key) = pki("ca-route", &ep);
    let c = client(&ca);
    // Two models, each behind its own rule: the rule of the pod that answers decides.
    let route = |timeout: Option<Duration>| {
        let mut cfg = wired(&cert, &key, &[]);
        if let Route::Pool { endpoints, .. } = &mut cfg.route {
            let backend = |pod: &str, model: &str, route_timeout| Backend {
                route_timeout,
                ..Backend::new(pod, Some(model))
            };
            endpoints.push(backend("pod-a", MODEL, timeout));
            endpoints.push(backend(
                "pod-b",
                "other-model",
                Some(Duration::from_secs(3600)),
            ));
        }
        cfg
    };
    ep.update(route(Some(ROUTE_TIMEOUT))).unwrap();
    let started = tokio::time::Instant::now();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 504);
    assert_eq!(started.elapsed(), ROUTE_TIMEOUT);
    let r = c
        .post(format!("{}/v1/chat/completions", ep.url()))
        .bearer_auth(TOKEN)
        .json(
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the stream's headers go out at once");
    assert!(r.text().await.is_err(), "the stream is cut, not ended");

    // The other model's rule gives an hour: its answer is not cut.
    let r = c
        .post(format!("{}/v1/chat/completions", ep.url()))
        .bearer_auth(TOKEN)
        .json(&json!({"model": "other-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sim-backend"], "pod-b");

    ep.update(route(Some(Duration::from_secs(3600)))).unwrap();
    let r = chat(&c, &ep, TOKEN).await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("chat.completion"));
}
