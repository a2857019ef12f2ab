//! The dedicated inference lifecycle end to end, through the public API only: central and three
//! regional services on real sockets and Postgres, and per region an in-process region simulator
//! (DigitalOcean API, DOKS clusters with a Kubernetes API, TLS data plane) with reconcile workers
//! wired to the region's database (`Options::cloud`). A client creates, polls, calls the endpoint
//! the API reports (with the official OpenAI Python client and with reqwest), manages tokens,
//! updates and deletes; the simulator's inventory then says whether anything leaked.
//!
//! The OpenAI client runs in a venv built under the target directory from the pinned
//! `tests/openai/requirements.txt` (PyPI must be reachable on first use; nothing is skipped).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::future::ready;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use region_sim::{Api, ApiFaults, ArmedKind, FaultConfig, Inventory, RegionSim};
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{create_body, python, CloudOptions, Options, System, HF_TOKEN};
use test_support::{eventually, within};
use tokio::sync::watch;
use uuid::Uuid;

/// Gated on Hugging Face: a create needs `access_tokens.hugging_face_token`.
const GATED_MODEL: &str = "mistral/mistral-7b-instruct-v3";
const MODEL: &str = "qwen/qwen2.5-7b-instruct";
const GPU: &str = "gpu-h100x1-80gb";

// ---------------------------------------------------------------------------------------------
// The public API

pub(crate) async fn start(cloud: CloudOptions) -> System {
    System::start_with(Options {
        cloud: Some(cloud),
        ..Options::default()
    })
    .await
}

pub(crate) fn di_path(id: &str, rest: &str) -> String {
    format!("/v2/dedicated-inferences/{id}{rest}")
}

/// A spec (pydo's dialect) for `model` at `scale`, in the team's default VPC.
pub(crate) fn spec(region: &str, name: &str, model: &str, scale: i64) -> Value {
    let mut spec = create_body(name, region)["spec"].clone();
    spec["model_deployments"][0]["model_slug"] = json!(model);
    spec["model_deployments"][0]["accelerators"][0]["accelerator_slug"] = json!(GPU);
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(scale);
    spec
}

pub(crate) struct Created {
    pub(crate) id: String,
    /// The managed access token's value, shown once by the create response.
    pub(crate) token: String,
    pub(crate) model_id: String,
}

/// Creates a DI through `POST /v2/dedicated-inferences`; with the gated model, with a Hugging
/// Face token.
pub(crate) async fn create(
    sys: &System,
    api_token: &str,
    region: &str,
    name: &str,
    model: &str,
    scale: i64,
) -> Created {
    let mut body = json!({"spec": spec(region, name, model, scale)});
    if model == GATED_MODEL {
        body["access_tokens"] = json!({"hugging_face_token": HF_TOKEN});
    }
    // As pydo does: a 503 (the region, or the cloud it asks about the VPC, failing for a
    // moment) is retried with the same body, which finds the first attempt's create if it made one.
    let mut reply = None;
    for _ in 0..10 {
        let attempt = sys
            .call(
                Method::POST,
                "/v2/dedicated-inferences",
                api_token,
                Some(body.clone()),
            )
            .await;
        if attempt.status != 503 {
            reply = Some(attempt);
            break;
        }
        // A client's retry pace (pydo's backoff), not a wait for a condition.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let reply = reply.unwrap_or_else(|| panic!("create {name}: 503 on every attempt"));
    assert_eq!(reply.status, 202, "create {name}: {}", reply.body);
    let di = &reply.body["dedicated_inference"];
    // Only the DI is printed on failure: the reply also holds the access token's value. The
    // reply is central's freshest view, so a worker quick off the mark may already show in it.
    assert!(
        di["status"] == "new" || di["status"] == "provisioning",
        "{di}"
    );
    let token = reply.body["token"]["value"]
        .as_str()
        .expect("the create response carries the managed token's value")
        .to_string();
    assert!(token.starts_with("di_"), "a DI access token");
    Created {
        id: di["id"].as_str().expect("an id").to_string(),
        token,
        model_id: di["spec"]["model_deployments"][0]["model_id"]
            .as_str()
            .expect("a model id")
            .to_string(),
    }
}

pub(crate) async fn get(sys: &System, api_token: &str, id: &str) -> system_tests::Reply {
    sys.call(Method::GET, &di_path(id, ""), api_token, None)
        .await
}

pub(crate) async fn status(sys: &System, api_token: &str, id: &str) -> String {
    let reply = get(sys, api_token, id).await;
    assert_eq!(reply.status, 200, "GET {id}: {}", reply.body);
    reply.body["dedicated_inference"]["status"]
        .as_str()
        .expect("a status")
        .to_string()
}

/// `(phase, reason)` of every event of the DI, oldest first, from `GET …/{id}/events`.
async fn events(sys: &System, api_token: &str, id: &str) -> Vec<(String, String)> {
    let reply = sys
        .call(
            Method::GET,
            &di_path(id, "/events?per_page=200"),
            api_token,
            None,
        )
        .await;
    assert_eq!(reply.status, 200, "events of {id}: {}", reply.body);
    reply.body["events"]
        .as_array()
        .expect("an events array")
        .iter()
        .map(|e| {
            (
                e["phase"].as_str().unwrap_or_default().to_string(),
                e["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// What a failed wait prints: the DI's events, the region's leftovers and its workers' counters.
pub(crate) async fn diagnose(sys: &System, api_token: &str, region: &str, id: &str) -> String {
    let events = sys
        .call(
            Method::GET,
            &di_path(id, "/events?per_page=200"),
            api_token,
            None,
        )
        .await;
    let lines: Vec<String> = events.body["events"]
        .as_array()
        .map(|es| {
            es.iter()
                .map(|e| format!("{} {}: {}", e["phase"], e["reason"], e["message"]))
                .collect()
        })
        .unwrap_or_else(|| vec![format!("(events: {} {})", events.status, events.body)]);
    let cloud = sys.cloud(region);
    let inventory = cloud.sim.inventory();
    let problems: Vec<String> = inventory
        .endpoints
        .iter()
        .map(|e| format!("{} {}: {:?}", e.service, e.url, e.problems))
        .collect();
    let ns = namespace(id);
    let workloads: Vec<String> = inventory
        .kubernetes
        .values()
        .flatten()
        .filter(|o| o["metadata"]["namespace"] == ns.as_str())
        .filter(|o| o["kind"] == "Pod" || o["kind"] == "Deployment")
        .map(|o| {
            format!(
                "{} {} node={} labels={} status={}",
                o["kind"],
                o["metadata"]["name"],
                o["spec"]["nodeName"],
                o["metadata"]["labels"],
                o["status"]
            )
        })
        .collect();
    format!(
        "events: {lines:#?}\nworkloads: {workloads:#?}\nleftovers: {:#?}\nendpoints: {problems:#?}\nworkers: {:?}\nfaults: {:?}",
        inventory.leftovers(),
        cloud.worker_stats(),
        cloud.sim.faults()
    )
}

/// Polls `GET /v2/dedicated-inferences/{id}` until `done` holds; returns the DI and every status
/// seen, in order. A DI in `error` fails at once: nothing these tests do may surface as `error`
/// (transient faults are retried, never parked).
pub(crate) async fn wait_for(
    sys: &System,
    api_token: &str,
    region: &str,
    id: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Value) -> bool,
) -> (Value, Vec<String>) {
    let seen: RefCell<Vec<String>> = RefCell::default();
    let last = RefCell::new(Value::Null);
    let found = within(timeout, || async {
        let reply = get(sys, api_token, id).await;
        assert_eq!(reply.status, 200, "GET {id}: {}", reply.body);
        let di = reply.body["dedicated_inference"].clone();
        let status = di["status"].as_str().unwrap_or_default().to_string();
        if seen.borrow().last() != Some(&status) {
            seen.borrow_mut().push(status.clone());
        }
        if status == "error" {
            panic!(
                "{id} went to error while waiting for {what}: {}\n{}",
                di,
                diagnose(sys, api_token, region, id).await
            );
        }
        if done(&di) {
            return Some(di);
        }
        *last.borrow_mut() = di;
        None
    })
    .await;
    let seen = seen.into_inner();
    match found {
        Some(di) => (di, seen),
        None => panic!(
            "timed out after {timeout:?} waiting for {what}; statuses seen {seen:?}; last {}\n{}",
            last.into_inner(),
            diagnose(sys, api_token, region, id).await
        ),
    }
}

/// Active on spec `version` with nothing rolling out, as automation waits for it.
pub(crate) async fn wait_active(
    sys: &System,
    api_token: &str,
    region: &str,
    id: &str,
    version: i64,
) -> (Value, Vec<String>) {
    wait_for(
        sys,
        api_token,
        region,
        id,
        &format!("active on version {version}"),
        Duration::from_secs(60),
        |di| {
            di["status"] == "active"
                && di["pending_deployment_spec"].is_null()
                && di["spec"]["version"] == version
        },
    )
    .await
}

/// After a DELETE: 404, out of the list, and nothing of it left in the simulated region.
pub(crate) async fn wait_gone(sys: &System, api_token: &str, region: &str, id: &str) {
    let gone = within(Duration::from_secs(60), || async {
        let reply = get(sys, api_token, id).await;
        if reply.status == 404 {
            reply.assert_error(404, "not_found");
            return Some(());
        }
        assert_eq!(reply.status, 200, "GET {id}: {}", reply.body);
        assert_eq!(
            reply.body["dedicated_inference"]["status"], "deleting",
            "a DI being deleted reads as deleting until it is gone"
        );
        None
    })
    .await;
    if gone.is_none() {
        panic!(
            "{id} not gone within 60s\n{}",
            diagnose(sys, api_token, region, id).await
        );
    }
    let list = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?per_page=200",
            api_token,
            None,
        )
        .await;
    assert_eq!(list.status, 200, "{}", list.body);
    let ids: Vec<&str> = list.body["dedicated_inferences"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    assert!(!ids.contains(&id), "{id} is gone but still listed: {ids:?}");
    let sim = &sys.cloud(region).sim;
    within(Duration::from_secs(15), || {
        ready(sim.inventory().leftovers().is_empty().then_some(()))
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "{id} is gone but the region still holds: {:#?}",
            sim.inventory().leftovers()
        )
    });
}

/// The DI a test follows: waits on the simulator that print the DI's story when they time out.
pub(crate) struct Follow<'a> {
    sys: &'a System,
    api: &'a str,
    region: &'a str,
    id: &'a str,
}

pub(crate) fn follow<'a>(
    sys: &'a System,
    api: &'a str,
    region: &'a str,
    id: &'a str,
) -> Follow<'a> {
    Follow {
        sys,
        api,
        region,
        id,
    }
}

impl Follow<'_> {
    /// `check` (of the simulator's state) until it gives `Some`, failing the test with `what` and
    /// the DI's diagnosis on timeout.
    pub(crate) async fn until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        match within(timeout, || ready(check())).await {
            Some(v) => v,
            None => panic!(
                "timed out after {timeout:?} waiting for {what}\n{}",
                diagnose(self.sys, self.api, self.region, self.id).await
            ),
        }
    }

    async fn status(&self) -> String {
        status(self.sys, self.api, self.id).await
    }

    /// Makes every DigitalOcean call fail with `fault` until `at_least` calls were answered
    /// `code`, checks that the DI is still `status` meanwhile, then lifts the fault.
    async fn through_do_fault(
        &self,
        sim: &RegionSim,
        fault: ApiFaults,
        code: u16,
        at_least: usize,
        what: &str,
        status: &str,
    ) {
        sim.reset_stats();
        sim.set_faults(faults(fault, none(), none()));
        self.until(what, Duration::from_secs(20), || {
            (do_calls_answered(sim, code) >= at_least).then_some(())
        })
        .await;
        assert_eq!(self.status().await, status);
        sim.set_faults(FaultConfig::default());
    }
}

/// Asserts that `expected` occurs in `events` in this order (other events may come between).
fn assert_in_order(events: &[(String, String)], expected: &[(&str, &str)]) {
    let mut rest = events.iter();
    for (phase, reason) in expected {
        assert!(
            rest.any(|(p, r)| p == phase && r == reason),
            "event ({phase}, {reason}) missing or out of order in {events:#?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The data plane

/// A client that trusts only the DI's CAs (every certificate of `GET …/ca`: two while a renewal
/// overlaps), as the docs tell customers to do.
pub(crate) fn ca_client(ca_pem: &str) -> reqwest::Client {
    let cas = reqwest::Certificate::from_pem_bundle(ca_pem.as_bytes())
        .expect("the CA bundle is PEM certificates");
    cas.into_iter()
        .fold(reqwest::Client::builder(), |b, ca| {
            b.add_root_certificate(ca)
        })
        .tls_built_in_root_certs(false)
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()
        .expect("a client")
}

/// One chat completion; the status and JSON body, or why no answer came.
pub(crate) async fn chat(
    client: &reqwest::Client,
    endpoint: &str,
    token: &str,
    model: &str,
) -> Result<(u16, Value), String> {
    let resp = client
        .post(format!("{endpoint}/v1/chat/completions"))
        .bearer_auth(token)
        .json(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
        }))
        .send()
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    Ok((status, body))
}

/// Asserts a successful chat completion by `model`.
pub(crate) async fn assert_chat_ok(
    client: &reqwest::Client,
    endpoint: &str,
    token: &str,
    model: &str,
) {
    match chat(client, endpoint, token, model).await {
        Ok((200, body)) => {
            assert_eq!(body["model"], model, "{body}");
            assert!(
                body["choices"][0]["message"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty()),
                "{body}"
            );
        }
        other => panic!("chat with {model} at {endpoint}: {other:?}"),
    }
}

/// What a [`Caller`] saw.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallLog {
    pub(crate) ok: u64,
    pub(crate) failures: Vec<String>,
    /// Per endpoint, when it moved on to the next model (see [`Caller::start`]).
    pub(crate) switches: Vec<String>,
    /// Rounds of calls made: one call to every endpoint each, answered or not.
    pub(crate) rounds: u64,
}

/// How long a test waits for the calls of a [`Caller`] it waits for: a round takes the 50 ms
/// pace and a call per endpoint, a call that is not answered up to 5 s.
const CALLS_WITHIN: Duration = Duration::from_secs(30);

/// Calls chat completions on every endpoint back to back, in the background, until stopped.
pub(crate) struct Caller {
    stop: Arc<AtomicBool>,
    /// What it saw so far: a test waits on it for calls made, instead of for a length of time.
    log: watch::Receiver<CallLog>,
    task: tokio::task::JoinHandle<()>,
}

impl Caller {
    /// `models` is what the DI serves now, then (during a model change) what it will serve.
    /// During the change an endpoint serves both names (each pod the model it was started
    /// with); once the last old pod is gone the old name is unknown (404 `model does not
    /// exist`, as vLLM answers) from one moment on. So a call naming the
    /// old model that gets exactly that answer moves this endpoint on to the new model, as a
    /// client following the change would, and the same call is repeated at once with the new
    /// name: it must succeed. Every other non-200 answer, and any call without an answer, is a
    /// failure; so is going back to the old model (a flapping endpoint).
    pub(crate) fn start(
        client: reqwest::Client,
        endpoints: Vec<String>,
        token: String,
        models: Vec<String>,
    ) -> Caller {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (record, log) = watch::channel(CallLog::default());
        let task = tokio::spawn(async move {
            let mut current = vec![0usize; endpoints.len()];
            while !flag.load(Ordering::SeqCst) {
                for (i, endpoint) in endpoints.iter().enumerate() {
                    let model = &models[current[i]];
                    let answer = chat(&client, endpoint, &token, model).await;
                    let unknown_model = matches!(&answer, Ok((404, body))
                        if body["error"]["message"].as_str().is_some_and(|m| m.contains("does not exist")));
                    if unknown_model && current[i] + 1 < models.len() {
                        current[i] += 1;
                        let next = &models[current[i]];
                        record.send_modify(|log| {
                            log.switches.push(format!("{endpoint}: {model} -> {next}"))
                        });
                        let again = chat(&client, endpoint, &token, next).await;
                        record.send_modify(|log| match again {
                            Ok((200, _)) => log.ok += 1,
                            other => log.failures.push(format!(
                                "{endpoint} right after the switch to {next}: {other:?}"
                            )),
                        });
                        continue;
                    }
                    record.send_modify(|log| match answer {
                        Ok((200, body)) if body["model"] == model.as_str() => log.ok += 1,
                        other => log
                            .failures
                            .push(format!("{endpoint} with {model}: {other:?}")),
                    });
                }
                record.send_modify(|log| log.rounds += 1);
                // A pace, not a wait for a condition: about 20 calls per second per endpoint.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Caller { stop, log, task }
    }

    /// Waits until `n` calls in all have succeeded since the caller started: it is under way.
    pub(crate) async fn until_ok(&self, n: u64) {
        self.until(&format!("{n} successful calls"), |log| log.ok >= n)
            .await;
    }

    /// Waits until the caller has made `n` more rounds of calls (answered or not) than so far:
    /// each the 50 ms pace and a call per endpoint, so 100 to 200 ms under load.
    pub(crate) async fn more_rounds(&self, n: u64) {
        let target = self.log.borrow().rounds + n;
        self.until(&format!("{n} more rounds of calls"), |log| {
            log.rounds >= target
        })
        .await;
    }

    async fn until(&self, what: &str, holds: impl Fn(&CallLog) -> bool) {
        let reached = within(CALLS_WITHIN, || {
            ready(holds(&self.log.borrow()).then_some(()))
        })
        .await;
        if reached.is_none() {
            panic!(
                "the caller did not make {what} within {CALLS_WITHIN:?}: {:?}",
                *self.log.borrow()
            );
        }
    }

    pub(crate) async fn finish(self) -> CallLog {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the caller task");
        let log = self.log.borrow().clone();
        log
    }
}

/// The CA of the DI from `GET …/{id}/ca`, as PEM.
pub(crate) async fn fetch_ca(sys: &System, api_token: &str, id: &str) -> String {
    let reply = sys
        .call(Method::GET, &di_path(id, "/ca"), api_token, None)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let pem = base64::engine::general_purpose::STANDARD
        .decode(reply.body["cert"].as_str().expect("a cert"))
        .expect("the cert is base64");
    let pem = String::from_utf8(pem).expect("PEM is text");
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
    pem
}

/// Writes the CA to a file under the target directory, for the Python client.
fn ca_file(id: &str, pem: &str) -> PathBuf {
    let dir = python::target_dir().join("lifecycle-test");
    std::fs::create_dir_all(&dir).expect("create the CA directory");
    let file = dir.join(format!("{id}-ca.pem"));
    std::fs::write(&file, pem).expect("write the CA file");
    file
}

/// Runs tests/openai/chat.py (the official OpenAI client) against `endpoint`; its RESULT object.
async fn openai_chat(
    python: &Path,
    endpoint: &str,
    ca_file: &Path,
    model: &str,
    tokens: &[&str],
) -> Value {
    let mut command = tokio::process::Command::new(python);
    command
        .arg(python::tests_dir().join("openai/chat.py"))
        .env("OPENAI_BASE_URL", format!("{endpoint}/v1"))
        .env("DI_CA_FILE", ca_file)
        .env("DI_MODEL", model)
        .env("DI_TOKENS", serde_json::to_string(tokens).unwrap())
        .env("DI_BAD_TOKEN", format!("di_{}", "0".repeat(64)))
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // The endpoint is on loopback: never send the test's traffic through a configured proxy.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("chat.py finishes within 120s")
        .expect("run chat.py");
    assert!(
        output.status.success(),
        "chat.py failed\n{}",
        python::describe(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line\n{}", python::describe(&output)));
    serde_json::from_str(line).expect("RESULT is JSON")
}

// ---------------------------------------------------------------------------------------------
// The simulator

pub(crate) fn namespace(id: &str) -> String {
    format!("di-{id}")
}

/// The DI's GPU node pools (named `di-<first 8 hex of the id>-…`).
pub(crate) fn gpu_pools<'a>(inv: &'a Inventory, id: &str) -> Vec<&'a Value> {
    let prefix = format!("di-{}-", &id[..8]);
    inv.cloud
        .node_pools
        .iter()
        .filter(|p| p["size"] == GPU && p["name"].as_str().is_some_and(|n| n.starts_with(&prefix)))
        .collect()
}

/// Kubernetes objects of `kind` in the DI's namespace.
pub(crate) fn objects<'a>(inv: &'a Inventory, kind: &str, id: &str) -> Vec<&'a Value> {
    let ns = namespace(id);
    inv.kube_objects(kind)
        .into_iter()
        .filter(|o| o["metadata"]["namespace"] == ns.as_str())
        .collect()
}

fn faults(do_api: ApiFaults, kube: ApiFaults, data_plane: ApiFaults) -> FaultConfig {
    FaultConfig {
        do_api,
        kube,
        data_plane,
    }
}

fn none() -> ApiFaults {
    ApiFaults::default()
}

/// Every request fails with a server error.
fn errors() -> ApiFaults {
    ApiFaults {
        error_rate: 1.0,
        ..ApiFaults::default()
    }
}

/// Every request is refused with 429 and `Retry-After: 1`.
fn rate_limited() -> ApiFaults {
    ApiFaults {
        rate_limit_rate: 1.0,
        retry_after_secs: 1,
        ..ApiFaults::default()
    }
}

/// DigitalOcean API calls answered `status` since the last stats reset.
fn do_calls_answered(sim: &RegionSim, status: u16) -> usize {
    let suffix = format!("-> {status}");
    sim.stats()
        .recent_calls
        .iter()
        .filter(|l| l.ends_with(&suffix))
        .count()
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Create → active → CA → the OpenAI client with the managed and a second token → revoke →
/// scale and model updates under continuous traffic → events → delete → gone, nothing leaked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_inference_lives_and_dies_through_the_public_api() {
    let venv =
        tokio::task::spawn_blocking(|| python::venv("openai-venv", "openai/requirements.txt"));
    let sys = start(CloudOptions::default()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;

    // Create, with the Hugging Face token the gated model needs, and wait for active.
    let di = create(&sys, &api, region, "lifecycle", GATED_MODEL, 1).await;
    let id = di.id.as_str();
    let f = follow(&sys, &api, region, id);
    let (active, seen) = wait_active(&sys, &api, region, id, 1).await;
    assert_eq!(seen.last().map(String::as_str), Some("active"), "{seen:?}");
    let public = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .expect("a public endpoint once active")
        .to_string();
    let private = active["endpoints"]["private_endpoint_fqdn"]
        .as_str()
        .expect("a private endpoint once active")
        .to_string();
    assert!(public.starts_with("https://"), "{public}");
    assert!(private.starts_with("https://"), "{private}");
    assert_ne!(public, private);
    let accelerators = sys
        .call(Method::GET, &di_path(id, "/accelerators"), &api, None)
        .await;
    assert_eq!(
        accelerators.body["meta"]["total"], 1,
        "{}",
        accelerators.body
    );
    assert_eq!(accelerators.body["accelerators"][0]["slug"], GPU);

    // The Hugging Face token reached the cluster (compared, never printed).
    let inv = sys.cloud(region).sim.inventory();
    let hf = objects(&inv, "Secret", id)
        .into_iter()
        .find(|s| s["metadata"]["name"] == "hf-token")
        .and_then(|s| s["data"]["HF_TOKEN"].as_str())
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok());
    assert!(
        hf.as_deref() == Some(HF_TOKEN.as_bytes()),
        "the hf-token Secret of {id} must hold the Hugging Face token given at create"
    );

    // The CA, and both endpoints answer the managed token over TLS trusting only that CA.
    let ca_pem = fetch_ca(&sys, &api, id).await;
    let ca_file = ca_file(id, &ca_pem);
    let client = ca_client(&ca_pem);
    assert_chat_ok(&client, &public, &di.token, GATED_MODEL).await;
    assert_chat_ok(&client, &private, &di.token, GATED_MODEL).await;

    // A second access token through the tokens endpoints: it works once the worker has
    // rolled it out to the gateway.
    let created = sys
        .call(
            Method::POST,
            &di_path(id, "/tokens"),
            &api,
            Some(json!({"name": "second"})),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let second = created.body["token"]["value"]
        .as_str()
        .expect("the new token's value")
        .to_string();
    let second_id = created.body["token"]["id"].as_str().unwrap().to_string();
    assert_eq!(created.body["token"]["is_managed"], false);
    let began = Instant::now();
    let accepted_after = within(Duration::from_secs(10), || async {
        let answer = chat(&client, &public, &second, GATED_MODEL).await;
        matches!(answer, Ok((200, _))).then(|| began.elapsed())
    })
    .await
    .unwrap_or_else(|| panic!("the second token was not accepted by the endpoint within 10s"));
    println!("second token accepted after {accepted_after:?}");

    // The official OpenAI client, both tokens, plain and streaming; an unknown token is a 401.
    let python = venv.await.expect("venv set-up");
    let result = openai_chat(
        &python,
        &public,
        &ca_file,
        GATED_MODEL,
        &[&di.token, &second],
    )
    .await;
    assert_eq!(result["chats"], 2, "{result}");
    assert_eq!(result["streams"], 2, "{result}");
    assert_eq!(result["rejected_status"], 401, "{result}");
    assert_eq!(result["models"], json!([GATED_MODEL]), "{result}");

    // Revoke the second token: the data plane refuses it within 5 s of the revoke returning.
    let revoked = sys
        .call(
            Method::DELETE,
            &di_path(id, &format!("/tokens/{second_id}")),
            &api,
            None,
        )
        .await;
    assert_eq!(revoked.status, 204, "{}", revoked.body);
    let revoked_at = Instant::now();
    let refused_after = within(Duration::from_secs(5), || async {
        match chat(&client, &public, &second, GATED_MODEL).await {
            Ok((401, _)) => Some(revoked_at.elapsed()),
            Ok((200, _)) => None,
            other => panic!("a revoked token must be accepted until refused with 401: {other:?}"),
        }
    })
    .await
    .unwrap_or_else(|| panic!("the revoked token still worked 5s after the revoke returned"));
    println!("revoked token refused after {refused_after:?}");
    assert_chat_ok(&client, &public, &di.token, GATED_MODEL).await;
    let tokens = sys
        .call(Method::GET, &di_path(id, "/tokens"), &api, None)
        .await;
    assert_eq!(tokens.body["meta"]["total"], 1, "{}", tokens.body);
    assert_eq!(tokens.body["tokens"][0]["is_managed"], true);

    // Scale 1 → 2 under continuous traffic on both endpoints: not one failed call.
    let caller = Caller::start(
        client.clone(),
        vec![public.clone(), private.clone()],
        di.token.clone(),
        vec![GATED_MODEL.to_string()],
    );
    let mut v2 = spec(region, "lifecycle", GATED_MODEL, 2);
    v2["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(id, ""),
            &api,
            Some(json!({"spec": v2})),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    assert_eq!(
        patched.body["dedicated_inference"]["pending_deployment_spec"]["version"], 2,
        "{}",
        patched.body
    );
    let (scaled, seen) = wait_active(&sys, &api, region, id, 2).await;
    let log = caller.finish().await;
    println!("scale rollout: {seen:?}, {} calls ok", log.ok);
    assert!(
        log.failures.is_empty(),
        "failed calls during the scale rollout: {:#?}",
        log.failures
    );
    assert!(log.switches.is_empty(), "{:?}", log.switches);
    assert!(
        log.ok >= 4,
        "the caller must have been calling throughout: {log:?}"
    );
    assert!(
        seen.iter().any(|s| s == "updating"),
        "the status went updating → active: {seen:?}"
    );
    assert_eq!(
        scaled["spec"]["model_deployments"][0]["accelerators"][0]["scale"],
        2
    );
    f.until("two accelerators", Duration::from_secs(20), || {
        let inv = sys.cloud(region).sim.inventory();
        (gpu_pools(&inv, id).len() == 1 && gpu_pools(&inv, id)[0]["count"] == 2).then_some(())
    })
    .await;
    let accelerators = sys
        .call(Method::GET, &di_path(id, "/accelerators"), &api, None)
        .await;
    assert_eq!(
        accelerators.body["meta"]["total"], 2,
        "{}",
        accelerators.body
    );

    // Change the model (same deployment, another model the catalog runs on this GPU) under
    // continuous traffic: every call is answered, by the old model and then the new one.
    let caller = Caller::start(
        client.clone(),
        vec![public.clone(), private.clone()],
        di.token.clone(),
        vec![GATED_MODEL.to_string(), MODEL.to_string()],
    );
    let mut v3 = spec(region, "lifecycle", MODEL, 2);
    v3["version"] = json!(2);
    v3["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(id, ""),
            &api,
            Some(json!({"spec": v3})),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    let (changed, seen) = wait_active(&sys, &api, region, id, 3).await;
    let log = caller.finish().await;
    println!(
        "model rollout: {seen:?}, {} calls ok, {:?}",
        log.ok, log.switches
    );
    assert!(
        log.failures.is_empty(),
        "failed calls during the model rollout: {:#?}",
        log.failures
    );
    assert!(
        log.ok >= 4,
        "the caller must have been calling throughout: {log:?}"
    );
    // A pod serves the model it was started with, so an endpoint answers to the old name until
    // the last old pod is gone, which can be the moment the DI turns active: each endpoint
    // moved at most once while the caller ran, and once the rollout is over every endpoint
    // knows only the new name.
    assert!(
        !log.switches.is_empty() && log.switches.len() <= 2,
        "each endpoint moved to the new model at most once: {log:?}"
    );
    for endpoint in [&public, &private] {
        eventually(
            Duration::from_secs(10),
            format!("{endpoint} to know only the new model's name"),
            || async {
                let old = chat(&client, endpoint, &di.token, GATED_MODEL).await;
                let new = chat(&client, endpoint, &di.token, MODEL).await;
                (matches!(old, Ok((404, _))) && matches!(new, Ok((200, _)))).then_some(())
            },
        )
        .await;
    }
    assert!(
        seen.iter().any(|s| s == "updating"),
        "the status went updating → active: {seen:?}"
    );
    assert_eq!(changed["spec"]["model_deployments"][0]["model_slug"], MODEL);
    assert_eq!(
        changed["spec"]["model_deployments"][0]["model_id"],
        di.model_id.as_str()
    );
    // The rollout's spare node (the surge pod's) goes once the rollout is over.
    f.until(
        "the pool back at two nodes",
        Duration::from_secs(20),
        || {
            let inv = sys.cloud(region).sim.inventory();
            let pools = gpu_pools(&inv, id);
            let pool = pools.first()?;
            let nodes = inv
                .cloud
                .nodes
                .iter()
                .filter(|n| n["node_pool_id"] == pool["id"])
                .count();
            (pools.len() == 1 && pool["count"] == 2 && nodes == 2).then_some(())
        },
    )
    .await;
    for endpoint in [&public, &private] {
        assert_chat_ok(&client, endpoint, &di.token, MODEL).await;
        let old = chat(&client, endpoint, &di.token, GATED_MODEL).await;
        assert!(
            matches!(old, Ok((404, _))),
            "the old model is no longer served: {old:?}"
        );
    }

    // The events tell the story through the public API.
    let story = events(&sys, &api, id).await;
    assert_in_order(
        &story,
        &[
            ("new", "Created"),
            ("provisioning", "ProvisioningStarted"),
            ("active", "RolloutComplete"),
            ("active", "TokenCreated"),
            ("active", "TokenRevoked"),
            ("updating", "SpecAccepted"),
            ("active", "RolloutComplete"),
            ("updating", "SpecAccepted"),
            ("active", "RolloutComplete"),
        ],
    );

    // Delete: readable as deleting (with its event) until everything is gone, then 404, out of
    // the list, nothing left in the region, and the endpoint no longer answers.
    let deleted = sys.call(Method::DELETE, &di_path(id, ""), &api, None).await;
    assert_eq!(deleted.status, 202, "{}", deleted.body);
    let story = events(&sys, &api, id).await;
    assert_in_order(
        &story,
        &[
            ("updating", "SpecAccepted"),
            ("active", "RolloutComplete"),
            ("deleting", "DeleteRequested"),
        ],
    );
    wait_gone(&sys, &api, region, id).await;
    let after = chat(&client, &public, &di.token, MODEL).await;
    assert!(
        after.is_err(),
        "a deleted DI's endpoint must not answer: {after:?}"
    );
    let events_after = sys
        .call(Method::GET, &di_path(id, "/events"), &api, None)
        .await;
    events_after.assert_error(404, "not_found");
    let _ = std::fs::remove_file(ca_file);
}

/// One fault at a time, each at a different step of a create and a delete: the DI waits (never
/// `error`) while the fault lasts and converges once it is lifted; nothing leaks.
///
/// Faults are per API, so each step is made a distinct, observable wait (a cluster that takes
/// two seconds to provision, nodes that take two seconds, model servers that load only when the
/// test lets them) and the fault is switched on while the DI is in it. Each fault stays on until
/// the worker has demonstrably run into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_step_survives_a_fault_in_the_api_it_uses() {
    let quick = CloudOptions::quick_delays();
    let gated = region_sim::Delays {
        cluster_provision_ms: 2000,
        node_provision_ms: 2000,
        deletion_ms: 2000,
        // Model servers load only when the test lowers this again.
        model_load_ms: 3_600_000,
        ..quick.clone()
    };
    let sys = start(CloudOptions {
        delays: gated.clone(),
        ..CloudOptions::default()
    })
    .await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let cloud = sys.cloud(region);
    let sim = &cloud.sim;

    // 1. Creating the cluster meets DigitalOcean 500s: the API goes down at the worker's first
    // write (the create's own VPC lookup, a read, still gets through).
    sim.reset_stats();
    sim.arm_fault_on_write(Api::Do, 0, ArmedKind::Outage)
        .expect("fault armed");
    let di = create(&sys, &api, region, "faults", MODEL, 1).await;
    let id = di.id.as_str();
    let f = follow(&sys, &api, region, id);
    f.until(
        "DO 500s while creating the cluster",
        Duration::from_secs(20),
        || (do_calls_answered(sim, 500) >= 3).then_some(()),
    )
    .await;
    assert!(
        sim.inventory().cloud.clusters.is_empty(),
        "no cluster while every DO call fails"
    );
    let s = f.status().await;
    assert!(s == "new" || s == "provisioning", "{s}");
    sim.disarm_faults();

    // 2. Waiting for the cluster to provision meets DigitalOcean 429s.
    let state = f
        .until("the cluster", Duration::from_secs(20), || {
            sim.inventory()
                .cloud
                .clusters
                .first()
                .map(|c| c["state"].clone())
        })
        .await;
    assert_eq!(
        state, "provisioning",
        "the step must still be under way when the fault starts"
    );
    f.through_do_fault(
        sim,
        rate_limited(),
        429,
        2,
        "DO 429s while the cluster provisions",
        "provisioning",
    )
    .await;

    // 3. Waiting for the GPU nodes meets DigitalOcean 500s.
    f.until("GPU nodes provisioning", Duration::from_secs(30), || {
        let inv = sim.inventory();
        let pool = gpu_pools(&inv, id)
            .first()
            .and_then(|p| p["id"].as_str().map(str::to_string))?;
        inv.cloud
            .nodes
            .iter()
            .any(|n| n["node_pool_id"] == pool.as_str() && n["state"] == "provisioning")
            .then_some(())
    })
    .await;
    f.through_do_fault(
        sim,
        errors(),
        500,
        2,
        "DO 500s while the nodes provision",
        "provisioning",
    )
    .await;

    // 4. Waiting for the model servers meets Kubernetes 500s. The Kubernetes client retries
    // internally, so the worker's own count of failed passes is the evidence it ran into them.
    f.until("model server pods", Duration::from_secs(30), || {
        let inv = sim.inventory();
        objects(&inv, "Pod", id)
            .iter()
            .any(|p| {
                p["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("vllm-"))
            })
            .then_some(())
    })
    .await;
    let before = cloud.worker_stats().transient_failures;
    sim.set_faults(faults(none(), errors(), none()));
    f.until(
        "a pass failed by Kubernetes 500s",
        Duration::from_secs(40),
        || (cloud.worker_stats().transient_failures > before).then_some(()),
    )
    .await;
    assert_eq!(f.status().await, "provisioning");

    // 5. The endpoint probe meets data-plane 503s: the Kubernetes fault is lifted and the model
    // servers load, but the endpoint does not answer, so the DI must not become active.
    sim.set_faults(faults(none(), none(), errors()));
    sim.set_delays(region_sim::Delays {
        model_load_ms: quick.model_load_ms,
        ..gated.clone()
    });
    f.until(
        "probes refused by the data plane",
        Duration::from_secs(30),
        || {
            let probes: u64 = sim
                .inventory()
                .endpoints
                .iter()
                .filter(|e| e.namespace == namespace(id))
                .map(|e| e.requests)
                .sum();
            (probes >= 2).then_some(())
        },
    )
    .await;
    assert_eq!(
        f.status().await,
        "provisioning",
        "active needs an endpoint that answers"
    );
    sim.set_faults(FaultConfig::default());
    let (active, _) = wait_active(&sys, &api, region, id, 1).await;
    let ca = fetch_ca(&sys, &api, id).await;
    let public = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap();
    assert_chat_ok(&ca_client(&ca), public, &di.token, MODEL).await;

    // 6. Tearing down the namespace meets Kubernetes 429s.
    let before = cloud.worker_stats().transient_failures;
    sim.set_faults(faults(none(), rate_limited(), none()));
    let deleted = sys.call(Method::DELETE, &di_path(id, ""), &api, None).await;
    assert_eq!(deleted.status, 202, "{}", deleted.body);
    f.until(
        "a pass failed by Kubernetes 429s",
        Duration::from_secs(40),
        || (cloud.worker_stats().transient_failures > before).then_some(()),
    )
    .await;
    assert_eq!(f.status().await, "deleting");
    assert!(
        !objects(&sim.inventory(), "Pod", id).is_empty(),
        "nothing can be torn down while every Kubernetes call is refused"
    );
    sim.set_faults(FaultConfig::default());

    // 7. Waiting for the cluster to be deleted meets DigitalOcean 500s.
    let state = f
        .until("the cluster deleting", Duration::from_secs(30), || {
            sim.inventory()
                .cloud
                .clusters
                .first()
                .map(|c| c["state"].clone())
                .filter(|s| *s == "deleting")
        })
        .await;
    assert_eq!(state, "deleting");
    f.through_do_fault(
        sim,
        errors(),
        500,
        2,
        "DO 500s while the cluster is deleted",
        "deleting",
    )
    .await;
    wait_gone(&sys, &api, region, id).await;
}

/// Transient faults throughout a whole lifecycle, one API per region (so one at a time per DI):
/// DigitalOcean 500s and 429s in atl1, Kubernetes 500s and 429s in nyc2, data-plane 503s in
/// tor1. Each DI still becomes active, answers, and is deleted without leaving anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifecycle_converges_despite_transient_faults() {
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    // Rates at which most calls still succeed at the first attempt: every pass makes dozens of
    // Kubernetes calls, each retried with backoff, so higher rates only make the test slow.
    sys.cloud("atl1").sim.set_faults(faults(
        ApiFaults {
            error_rate: 0.2,
            rate_limit_rate: 0.1,
            retry_after_secs: 1,
            latency_ms: 0,
            ..Default::default()
        },
        none(),
        none(),
    ));
    sys.cloud("nyc2").sim.set_faults(faults(
        none(),
        ApiFaults {
            error_rate: 0.1,
            rate_limit_rate: 0.05,
            retry_after_secs: 1,
            latency_ms: 0,
            ..Default::default()
        },
        none(),
    ));
    sys.cloud("tor1").sim.set_faults(faults(
        none(),
        none(),
        ApiFaults {
            error_rate: 0.5,
            ..ApiFaults::default()
        },
    ));

    let lifecycle = |region: &'static str| {
        let (sys, api) = (&sys, &api);
        async move {
            let began = Instant::now();
            let di = create(sys, api, region, &format!("flaky-{region}"), MODEL, 1).await;
            let id = di.id.as_str();
            let (active, _) = wait_active(sys, api, region, id, 1).await;
            println!("{region}: active after {:?}", began.elapsed());
            let public = active["endpoints"]["public_endpoint_fqdn"]
                .as_str()
                .unwrap()
                .to_string();
            let ca = fetch_ca(sys, api, id).await;
            let client = ca_client(&ca);
            if region == "tor1" {
                // The probe got through the 503s; the customer's single call below should not
                // have to.
                sys.cloud(region).sim.set_faults(FaultConfig::default());
            }
            assert_chat_ok(&client, &public, &di.token, MODEL).await;
            let deleted = sys.call(Method::DELETE, &di_path(id, ""), api, None).await;
            assert_eq!(deleted.status, 202, "{}", deleted.body);
            wait_gone(sys, api, region, id).await;
            println!("{region}: gone after {:?}", began.elapsed());
        }
    };
    tokio::join!(lifecycle("atl1"), lifecycle("nyc2"), lifecycle("tor1"));

    // The DigitalOcean faults really were served (the others have no call log to check).
    let atl1 = sys.cloud("atl1").sim.stats();
    assert!(
        atl1.recent_calls
            .iter()
            .any(|l| l.ends_with("-> 500") || l.ends_with("-> 429")),
        "no DO fault was injected in atl1"
    );
}

/// A worker killed mid-provisioning (twice: once the node pool exists, once the load balancers
/// exist), each time replaced by a fresh one after its lease expires: the DI still becomes
/// active, with exactly one cluster, one GPU node pool and one load balancer per endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_replaced_without_duplicating_anything() {
    let quick = CloudOptions::quick_delays();
    let gated = region_sim::Delays {
        node_provision_ms: 1500,
        model_load_ms: 3_600_000,
        ..quick.clone()
    };
    let mut sys = start(CloudOptions {
        workers: 1,
        delays: gated.clone(),
        lease: Duration::from_secs(1),
        ..CloudOptions::default()
    })
    .await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, region, "takeover", MODEL, 1).await;
    let id = di.id.clone();

    // Kill the first worker once it has created the GPU node pool.
    follow(&sys, &api, region, &id)
        .until("the GPU node pool", Duration::from_secs(30), || {
            let inv = sys.cloud(region).sim.inventory();
            (!gpu_pools(&inv, &id).is_empty()).then_some(())
        })
        .await;
    sys.region(region).kill_worker(0);
    let second = sys.region(region).start_worker().await;

    // Kill its successor once the load balancers exist (the model servers are held loading).
    follow(&sys, &api, region, &id)
        .until("both load balancers", Duration::from_secs(30), || {
            let inv = sys.cloud(region).sim.inventory();
            (inv.cloud.load_balancers.len() >= 2).then_some(())
        })
        .await;
    assert_eq!(status(&sys, &api, &id).await, "provisioning");
    follow(&sys, &api, region, &id)
        .until(
            "a pass by the second worker",
            Duration::from_secs(30),
            || {
                let w = sys.cloud(region).workers[second].as_ref().unwrap();
                (w.stats().passes > 0).then_some(())
            },
        )
        .await;
    sys.region(region).kill_worker(second);
    let third = sys.region(region).start_worker().await;
    sys.cloud(region).sim.set_delays(region_sim::Delays {
        model_load_ms: quick.model_load_ms,
        ..gated
    });

    let (active, _) = wait_active(&sys, &api, region, &id, 1).await;
    let cloud = sys.cloud(region);
    assert!(
        cloud.workers[third].as_ref().unwrap().stats().passes > 0,
        "the third worker finished the job"
    );
    let inv = cloud.sim.inventory();
    assert_eq!(
        inv.cloud.clusters.len(),
        1,
        "one cluster: {:#?}",
        inv.cloud.clusters
    );
    assert_eq!(
        gpu_pools(&inv, &id).len(),
        1,
        "one GPU node pool: {:#?}",
        inv.cloud.node_pools
    );
    assert_eq!(
        inv.cloud.node_pools.len(),
        2,
        "the system pool and the GPU pool: {:#?}",
        inv.cloud.node_pools
    );
    let lbs: BTreeSet<String> = inv
        .cloud
        .load_balancers
        .iter()
        .filter_map(|l| l["name"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        inv.cloud.load_balancers.len(),
        2,
        "one load balancer per endpoint: {:#?}",
        inv.cloud.load_balancers
    );
    assert_eq!(
        lbs,
        BTreeSet::from([format!("di-{id}-private"), format!("di-{id}-public")])
    );
    assert_eq!(
        objects(&inv, "Deployment", &id)
            .iter()
            .filter(|d| d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("vllm-")))
            .count(),
        1
    );

    let ca = fetch_ca(&sys, &api, &id).await;
    let public = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap();
    assert_chat_ok(&ca_client(&ca), public, &di.token, MODEL).await;

    let deleted = sys
        .call(Method::DELETE, &di_path(&id, ""), &api, None)
        .await;
    assert_eq!(deleted.status, 202, "{}", deleted.body);
    wait_gone(&sys, &api, region, &id).await;
}
