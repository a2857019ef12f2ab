//! Bring your own model through the clients customers use: a private fine-tune of theirs,
//! published to the (simulated) Hugging Face Hub under their own token, is served, switched to
//! another repository under the same name, and deleted with
//! - pydo and the OpenAI Python client (`tests/byom/clients.py`, in a venv built under the target
//!   directory from the pinned `tests/byom/requirements.txt`; PyPI must be reachable on first
//!   use, nothing is skipped),
//! - the exact requests godo (doctl, Terraform) sends, reading back what godo reads.
//!
//! Every journey runs on the real system with a simulated cloud and quick delays; every switch
//! happens under continuous calls that must all be answered.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use hub_sim::Repo;
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::python::{self, describe, tests_dir};
use system_tests::{CloudOptions, System};
use uuid::Uuid;

use crate::lifecycle::{
    assert_chat_ok, ca_client, di_path, fetch_ca, objects, start, wait_active, wait_gone, Caller,
};

const REGION: &str = "atl1";
const GPU: &str = "gpu-h100x1-80gb";
/// The customer's Hugging Face token: it owns both private repositories.
const OWNER: &str = "hf_customer_owns_support_models";
/// The name the customer's clients call the model by (`model_slug`).
const NAME: &str = "support-bot";
const REPO: &str = "acme/support-llama-8b";
const NEXT_REPO: &str = "acme/support-llama-8b-v2";

/// The customer's two private fine-tunes (Llama 3.1 8B's numbers) and their token.
fn publish_fine_tunes(sys: &System) {
    sys.hub.add_token(OWNER, "acme").unwrap();
    for id in [REPO, NEXT_REPO] {
        let repo = Repo::model(
            id,
            "LlamaForCausalLM",
            8_030_261_248,
            32,
            4096,
            32,
            8,
            131_072,
        );
        sys.hub.publish(repo.private().owned_by(OWNER)).unwrap();
    }
}

fn id_of(di: &Value) -> String {
    di["id"].as_str().expect("an id").to_string()
}

/// The DI's model servers as `(--model, --served-model-name)`, from the simulated cluster.
fn model_servers(sys: &System, id: &str) -> Vec<(String, String)> {
    let inv = sys.cloud(REGION).sim.inventory();
    objects(&inv, "Deployment", id)
        .into_iter()
        .filter(|d| {
            d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("vllm-"))
        })
        .map(|d| {
            let args: Vec<&str> = d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let flag = |name: &str| {
                args.windows(2)
                    .find(|w| w[0] == name)
                    .map_or_else(String::new, |w| w[1].to_string())
            };
            (flag("--model"), flag("--served-model-name"))
        })
        .collect()
}

/// Waits (10 s at most) until every model server of the DI loads `repo` under [`NAME`].
async fn assert_serving(sys: &System, id: &str, repo: &str) {
    let want = (repo.to_string(), NAME.to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let servers = model_servers(sys, id);
        if !servers.is_empty() && servers.iter().all(|s| *s == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{id}'s model servers should all load {repo} as {NAME}: {servers:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Hugging Face token that reached the DI's namespace.
fn hf_token_in_cluster(sys: &System, id: &str) -> Option<Vec<u8>> {
    let inv = sys.cloud(REGION).sim.inventory();
    objects(&inv, "Secret", id)
        .into_iter()
        .find(|s| s["metadata"]["name"] == "hf-token")
        .and_then(|s| s["data"]["HF_TOKEN"].as_str())
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
}

/// Calls `endpoint` by [`NAME`] back to back from now on (see [`Caller`]), for half a second
/// before this returns.
async fn call_continuously(client: &reqwest::Client, endpoint: &str, token: &str) -> Caller {
    let caller = Caller::start(
        client.clone(),
        vec![endpoint.to_string()],
        token.to_string(),
        vec![NAME.to_string()],
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    caller
}

/// Stops `caller`: not one of its calls may have failed, and it must have been calling.
/// Returns how many calls were answered.
async fn not_one_failed(caller: Caller) -> u64 {
    let log = caller.finish().await;
    assert!(log.failures.is_empty(), "{:#?}", log.failures);
    assert!(log.ok >= 10, "the client must have been calling: {log:?}");
    log.ok
}

// ---------------------------------------------------------------------------------------------
// pydo and the OpenAI client

/// Runs one phase of tests/byom/clients.py; its `RESULT` object.
async fn clients_phase(python: &Path, env: &[(&str, String)]) -> Value {
    let mut command = tokio::process::Command::new(python);
    command
        .arg(tests_dir().join("byom/clients.py"))
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // Everything is on loopback: never send the test's traffic through a configured proxy.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let phase = env
        .iter()
        .find(|(k, _)| *k == "PHASE")
        .map_or("?", |(_, v)| v.as_str());
    let output = tokio::time::timeout(Duration::from_secs(240), command.output())
        .await
        .unwrap_or_else(|_| panic!("clients.py phase {phase} did not finish within 240s"))
        .expect("run clients.py");
    assert!(
        output.status.success(),
        "clients.py phase {phase} failed\n{}",
        describe(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("clients.py printed no RESULT\n{}", describe(&output)));
    let result: Value = serde_json::from_str(line).expect("RESULT is JSON");
    assert_eq!(result["phase"], phase, "{result}");
    result
}

/// pydo creates a DI serving the customer's private repository under their name, waits for it,
/// and the OpenAI client lists and calls it by that name; pydo's patch switches to another
/// repository under the same name while the endpoint is called continuously (not one failed
/// call); pydo deletes it until 404. Between the phases, the simulated cluster shows what the
/// model servers load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pydo_and_the_openai_client_serve_switch_and_delete_a_custom_repository() {
    let venv =
        tokio::task::spawn_blocking(|| python::venv("byom-clients-venv", "byom/requirements.txt"));
    let sys = start(CloudOptions::default()).await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    publish_fine_tunes(&sys);
    // Named explicitly (pydo's `vpc.uuid`): the team's default VPC, which outlives the DI.
    let vpc = sys.cloud(REGION).default_vpc(team).await;
    let work = python::target_dir().join("byom-clients");
    std::fs::create_dir_all(&work).expect("create the work directory");
    let python = venv.await.expect("venv set-up");

    let env = |phase: &str| -> Vec<(&'static str, String)> {
        vec![
            ("DI_API_URL", sys.base.clone()),
            ("DI_API_TOKEN", api.clone()),
            ("HF_TOKEN", OWNER.to_string()),
            ("DI_REGION", REGION.to_string()),
            ("DI_VPC", vpc.to_string()),
            ("DI_NAME", "support".to_string()),
            ("MODEL_NAME", NAME.to_string()),
            ("REPO", REPO.to_string()),
            ("NEXT_REPO", NEXT_REPO.to_string()),
            ("GPU", GPU.to_string()),
            ("WORK_DIR", work.display().to_string()),
            ("PHASE", phase.to_string()),
        ]
    };
    let began = Instant::now();
    let served = clients_phase(&python, &env("serve")).await;
    let id = id_of(&served);
    assert_eq!(served["models"], json!([NAME]), "{served}");
    assert!(served["calls_ok"].as_u64().unwrap_or(0) >= 10, "{served}");
    assert!(
        served["calls_during_switch"].as_u64().unwrap_or(0) >= 3,
        "{served}"
    );
    // The statuses pydo saw: a rollout (updating) before active again.
    assert_eq!(
        served["statuses"][1].as_array().and_then(|s| s.last()),
        Some(&json!("active"))
    );
    assert!(
        served["statuses"][1]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s == "updating")),
        "{served}"
    );

    // What the cluster runs now: the second repository, under the customer's name, with the
    // token pydo sent at create.
    assert_serving(&sys, &id, NEXT_REPO).await;
    assert!(
        hf_token_in_cluster(&sys, &id).as_deref() == Some(OWNER.as_bytes()),
        "the hf-token Secret of {id} must hold the customer's token"
    );

    let mut delete_env = env("delete");
    delete_env.push(("DI_ID", id.clone()));
    let deleted = clients_phase(&python, &delete_env).await;
    assert_eq!(deleted["id"], id.as_str(), "{deleted}");
    wait_gone(&sys, &api, REGION, &id).await;
    println!(
        "pydo + openai {} (openai {}): {} calls, {} during a {}s switch; statuses {} then {}; {:?} in all",
        id,
        served["openai_version"],
        served["calls_ok"],
        served["calls_during_switch"],
        served["switch_seconds"],
        served["statuses"],
        deleted["statuses"],
        began.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// godo

/// A request exactly as godo sends it: its headers, and the body as given (godo's field order).
async fn godo(
    sys: &System,
    api: &str,
    method: Method,
    path: &str,
    body: Option<String>,
) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .request(method, sys.url(path))
        .header("Content-Type", "application/json")
        .header("Accept", "application/json")
        .header("User-Agent", "godo/1.201.0")
        .bearer_auth(api);
    if let Some(body) = body {
        request = request.body(body);
    }
    let response = request.send().await.expect("central answers");
    let status = response.status().as_u16();
    let text = response.text().await.expect("a body");
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    };
    (status, body)
}

/// godo's request for one deployment of `repo` under [`NAME`]: `provider_model_id` always
/// present, `model_id` only when known, `vpc` given or `null`, the token under `secrets`.
fn godo_body(
    version: u64,
    name: &str,
    vpc: Option<&str>,
    model_id: Option<&str>,
    repo: &str,
) -> String {
    let vpc = vpc.map_or_else(|| "null".to_string(), |v| format!(r#"{{"uuid":"{v}"}}"#));
    let model_id = model_id.map_or_else(String::new, |m| format!(r#""model_id":"{m}","#));
    format!(
        r#"{{"spec":{{"version":{version},"name":"{name}","region":"{REGION}","enable_public_endpoint":true,"vpc":{vpc},"model_deployments":[{{{model_id}"model_slug":"{NAME}","model_provider":"hugging_face","provider_model_id":"{repo}","accelerators":[{{"accelerator_slug":"{GPU}","scale":1,"type":"prefill_decode"}}]}}]}},"secrets":{{"hugging_face_token":"{OWNER}"}}}}"#
    )
}

/// Checks a spec as godo decodes it (`DedicatedInferenceSpec`): a JSON type godo cannot decode
/// into its field fails the whole response there. Returns `(vpc_config.vpc_uuid, model_id)`.
fn godo_reads_spec(spec: &Value, repo: &str) -> (String, String) {
    assert!(spec["version"].is_u64(), "version is a uint64: {spec}");
    assert!(spec["enable_public_endpoint"].is_boolean(), "{spec}");
    let vpc = spec["vpc_config"]["vpc_uuid"]
        .as_str()
        .unwrap_or_else(|| panic!("vpc_config.vpc_uuid is a string: {spec}"));
    let deployments = spec["model_deployments"]
        .as_array()
        .expect("model_deployments");
    assert_eq!(deployments.len(), 1, "{spec}");
    let d = &deployments[0];
    for field in [
        "model_id",
        "model_slug",
        "model_provider",
        "provider_model_id",
    ] {
        assert!(d[field].is_string(), "{field} is a string: {d}");
    }
    assert_eq!(d["provider_model_id"], repo, "{d}");
    assert_eq!(d["model_slug"], NAME, "{d}");
    assert_eq!(d["model_provider"], "hugging_face", "{d}");
    let accelerators = d["accelerators"].as_array().expect("accelerators");
    assert_eq!(accelerators.len(), 1, "{d}");
    let a = &accelerators[0];
    assert_eq!(a["accelerator_slug"], GPU, "{a}");
    assert_eq!(a["type"], "prefill_decode", "{a}");
    assert_eq!(a["scale"].as_u64(), Some(1), "scale is a uint64: {a}");
    (vpc.to_string(), d["model_id"].as_str().unwrap().to_string())
}

/// Checks a `DedicatedInference` as godo decodes it; returns its spec's `(vpc, model_id)`.
fn godo_reads(di: &Value, repo: &str) -> (String, String) {
    for field in [
        "id",
        "name",
        "region",
        "status",
        "vpc_uuid",
        "created_at",
        "updated_at",
    ] {
        assert!(
            di[field].as_str().is_some_and(|s| !s.is_empty()),
            "{field}: {di}"
        );
    }
    for field in ["created_at", "updated_at"] {
        // RFC 3339, as Go's time.Time decodes it.
        let t = di[field].as_str().unwrap();
        assert!(
            t.len() >= 20 && t.as_bytes()[10] == b'T',
            "{field} is RFC 3339: {t}"
        );
    }
    assert!(di["endpoints"].is_object(), "{di}");
    let (vpc, model_id) = godo_reads_spec(&di["spec"], repo);
    assert_eq!(
        vpc,
        di["vpc_uuid"].as_str().unwrap(),
        "spec.vpc_config is the DI's VPC: {di}"
    );
    (vpc, model_id)
}

/// godo's calls end to end, as Terraform makes them: a create with the request godo builds
/// (no VPC, the token under `secrets`), a wait for ready, a list, an update that switches the
/// repository (the current version, every deployment, the token again), a delete and a wait
/// for 404; every answer read as godo reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn godos_requests_create_update_and_delete_a_custom_repository() {
    let sys = start(CloudOptions::default()).await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    publish_fine_tunes(&sys);

    let (status, created) = godo(
        &sys,
        &api,
        Method::POST,
        "/v2/dedicated-inferences",
        Some(godo_body(1, "godo-support", None, None, REPO)),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let di = &created["dedicated_inference"];
    let id = id_of(di);
    godo_reads(di, REPO);
    let token = created["token"]["value"]
        .as_str()
        .expect("the token godo reads")
        .to_string();
    assert!(
        !created.to_string().contains(OWNER),
        "the Hugging Face token is never shown"
    );

    // Terraform's wait: active with nothing pending.
    let (active, _) = wait_active(&sys, &api, REGION, &id, 1).await;
    let (vpc, model_id) = godo_reads(&active, REPO);
    // No VPC sent: the team's default one, in spec.vpc_config where Terraform reads it.
    assert_eq!(
        vpc,
        sys.cloud(REGION).default_vpc(team).await.to_string(),
        "{active}"
    );
    assert_eq!(active["name"], "godo-support");
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .expect("a public endpoint")
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &id).await);
    assert_chat_ok(&client, &endpoint, &token, NAME).await;
    assert_serving(&sys, &id, REPO).await;

    // A list item: godo reads `provider_model_id` there as a list of strings.
    let (status, list) = godo(
        &sys,
        &api,
        Method::GET,
        "/v2/dedicated-inferences?page=1&per_page=200",
        None,
    )
    .await;
    assert_eq!(status, 200, "{list}");
    let item = list["dedicated_inferences"]
        .as_array()
        .and_then(|items| items.iter().find(|d| d["id"] == id.as_str()))
        .unwrap_or_else(|| panic!("{id} is listed: {list}"));
    assert_eq!(item["name"], "godo-support", "{item}");
    assert_eq!(item["vpc_uuid"], vpc.as_str(), "{item}");
    match &item["provider_model_id"] {
        Value::Null => {}
        Value::Array(ids) => assert!(ids.iter().all(Value::is_string), "{item}"),
        other => panic!("godo cannot decode provider_model_id {other} into []string: {item}"),
    }

    // Terraform's update: the current version (not +1), region, VPC and public endpoint as
    // they are, the whole desired deployment list, and the token again.
    let caller = call_continuously(&client, &endpoint, &token).await;
    let (status, patched) = godo(
        &sys,
        &api,
        Method::PATCH,
        &di_path(&id, ""),
        Some(godo_body(
            1,
            "godo-support",
            Some(&vpc),
            Some(&model_id),
            NEXT_REPO,
        )),
    )
    .await;
    assert_eq!(status, 202, "{patched}");
    let pending = &patched["dedicated_inference"]["pending_deployment_spec"];
    assert_eq!(pending["version"], 2, "{patched}");
    godo_reads_spec(pending, NEXT_REPO);
    let (switched, _) = wait_active(&sys, &api, REGION, &id, 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = not_one_failed(caller).await;
    let (_, same_model_id) = godo_reads(&switched, NEXT_REPO);
    assert_eq!(same_model_id, model_id, "the same deployment: {switched}");
    assert_serving(&sys, &id, NEXT_REPO).await;
    assert_chat_ok(&client, &endpoint, &token, NAME).await;

    // Delete (godo ignores the body), then Terraform's wait for 404.
    let (status, body) = godo(&sys, &api, Method::DELETE, &di_path(&id, ""), None).await;
    assert_eq!(status, 202, "{body}");
    wait_gone(&sys, &api, REGION, &id).await;
    let (status, body) = godo(&sys, &api, Method::GET, &di_path(&id, ""), None).await;
    assert_eq!(status, 404, "{body}");
    // godo's error: message and request_id.
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(
        body["request_id"].as_str().is_some_and(|r| !r.is_empty()),
        "{body}"
    );
    println!("godo: {calls} calls answered around the switch");
}
