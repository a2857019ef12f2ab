//! Bring your own model through the clients customers use: a private fine-tune of theirs,
//! published to the (simulated) Hugging Face Hub under their own token, is served, switched to
//! another repository under the same name, and deleted with
//! - pydo and the OpenAI Python client (`tests/byom/clients.py`, in a venv built under the target
//!   directory from the pinned `tests/byom/requirements.txt`; PyPI must be reachable on first
//!   use, nothing is skipped),
//! - the exact requests godo (doctl, Terraform) sends, reading back what godo reads,
//! - dictl, the project's CLI, with its exit codes and output.
//!
//! Every journey runs on the real system with a simulated cloud and quick delays; every switch
//! happens under continuous calls that must all be answered.

use std::future::ready;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use hub_sim::Repo;
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::python::{self, describe, tests_dir};
use system_tests::{CloudOptions, System};
use test_support::within;
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
    let serving = within(Duration::from_secs(10), || {
        let servers = model_servers(sys, id);
        ready((!servers.is_empty() && servers.iter().all(|s| *s == want)).then_some(()))
    })
    .await;
    if serving.is_none() {
        panic!(
            "{id}'s model servers should all load {repo} as {NAME}: {:?}",
            model_servers(sys, id)
        );
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

/// Calls `endpoint` by [`NAME`] back to back from now on (see [`Caller`]); returns once it has
/// answered a few times.
async fn call_continuously(client: &reqwest::Client, endpoint: &str, token: &str) -> Caller {
    let caller = Caller::start(
        client.clone(),
        vec![endpoint.to_string()],
        token.to_string(),
        vec![NAME.to_string()],
    );
    caller.until_ok(2).await;
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
    // And after the switch: four rounds, about half a second at the caller's pace.
    caller.more_rounds(4).await;
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

// ---------------------------------------------------------------------------------------------
// dictl

/// Whether `bin` exists and is newer than dictl's sources.
fn is_fresh(bin: &Path) -> bool {
    fn newest(path: &Path) -> SystemTime {
        let meta = std::fs::metadata(path).expect("dictl's sources");
        let own = meta.modified().expect("an mtime");
        if !meta.is_dir() {
            return own;
        }
        std::fs::read_dir(path)
            .expect("dictl's sources")
            .map(|e| newest(&e.expect("an entry").path()))
            .fold(own, SystemTime::max)
    }
    let cli = tests_dir()
        .parent()
        .expect("the workspace")
        .join("services/cli");
    let sources = newest(&cli.join("src")).max(newest(&cli.join("Cargo.toml")));
    std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .is_ok_and(|built| built >= sources)
}

/// The dictl binary beside this test binary (`cargo test --workspace` builds it there), built
/// with cargo first when it is missing or older than its sources. Blocking.
fn dictl_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test binary>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary is in target/<profile>/deps");
    let bin = profile_dir.join(format!("dictl{}", std::env::consts::EXE_SUFFIX));
    if !is_fresh(&bin) {
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = std::process::Command::new(cargo)
            .args([
                "build",
                "--quiet",
                "--locked",
                "-p",
                "dictl",
                "--bin",
                "dictl",
                "--profile",
                profile,
            ])
            .current_dir(tests_dir())
            .env(
                "CARGO_TARGET_DIR",
                profile_dir.parent().expect("the target directory"),
            )
            .output()
            .expect("run cargo build -p dictl");
        assert!(
            output.status.success(),
            "cargo build -p dictl\n{}",
            describe(&output)
        );
        assert!(
            is_fresh(&bin),
            "cargo build -p dictl made no fresh {}",
            bin.display()
        );
    }
    bin
}

/// What one dictl run did.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Run {
            code,
            stdout,
            stderr,
        } = self;
        write!(f, "exit {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    }
}

impl Run {
    /// Exit code `code`, with every one of `says` on stdout (0) or stderr (otherwise).
    fn assert(&self, code: i32, says: &[&str]) -> &Self {
        assert_eq!(self.code, code, "{self:?}");
        let out = if code == 0 {
            &self.stdout
        } else {
            &self.stderr
        };
        for s in says {
            assert!(out.contains(s), "says {s:?}: {self:?}");
        }
        self
    }
}

/// dictl pointed at the system, with a folder for its spec files.
struct Dictl<'a> {
    bin: PathBuf,
    sys: &'a System,
    api: &'a str,
    dir: PathBuf,
}

impl Dictl<'_> {
    /// Runs dictl (no terminal); neither the API token nor the customer's Hugging Face token
    /// may appear in its output.
    async fn run(&self, args: &[&str]) -> Run {
        let output = tokio::process::Command::new(&self.bin)
            .args(args)
            .env("DI_API_URL", &self.sys.base)
            .env("DI_TOKEN", self.api)
            .env_remove("COLUMNS")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("no_proxy", "127.0.0.1,localhost")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(150), output)
            .await
            .unwrap_or_else(|_| panic!("dictl {args:?} did not finish within 150s"))
            .expect("dictl runs");
        let run = Run {
            code: output.status.code().expect("dictl exited normally"),
            stdout: String::from_utf8_lossy(&output.stdout).into(),
            stderr: String::from_utf8_lossy(&output.stderr).into(),
        };
        for secret in [self.api, OWNER] {
            assert!(
                !run.stdout.contains(secret) && !run.stderr.contains(secret),
                "a token leaked in dictl {args:?}: {run:?}"
            );
        }
        run
    }

    /// `dictl <command> -f <file holding value> --wait --timeout 90s`.
    async fn wait_with_file(&self, command: &[&str], value: &Value) -> Run {
        let file = self.dir.join(format!("{}.json", Uuid::new_v4()));
        std::fs::write(&file, serde_json::to_vec_pretty(value).unwrap()).expect("a spec file");
        let file = file.display().to_string();
        let mut args = command.to_vec();
        args.extend(["-f", &file, "--wait", "--timeout", "90s"]);
        self.run(&args).await
    }
}

/// The deployment of the DI as GET shows it.
async fn deployment(sys: &System, api: &str, id: &str) -> Value {
    let reply = sys.call(Method::GET, &di_path(id, ""), api, None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.body["dedicated_inference"]["spec"]["model_deployments"][0].clone()
}

/// dictl's journey with a custom repository: a create the Hub check refuses (exit 1, the
/// message says what to send), `create -f --wait` (exit 0), `update -f --wait` with a partial
/// file that switches the repository under continuous calls, a rename that must keep the
/// repository dictl fills in from the latest spec, and `delete --force --wait`; `get` then
/// exits 1 with not_found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dictl_creates_switches_renames_and_deletes_a_custom_repository() {
    let bin = tokio::task::spawn_blocking(dictl_binary);
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    publish_fine_tunes(&sys);
    let dir = python::target_dir().join("byom-clients");
    std::fs::create_dir_all(&dir).expect("create the spec directory");
    let dictl = Dictl {
        bin: bin.await.expect("dictl build"),
        sys: &sys,
        api: &api,
        dir,
    };

    let accelerators = json!([{"scale": 1, "type": "prefill_decode", "accelerator_slug": GPU}]);
    let spec = json!({
        "name": "support-cli", "region": REGION, "enable_public_endpoint": true,
        "model_deployments": [{
            "model_slug": NAME, "model_provider": "hugging_face", "provider_model_id": REPO,
            "accelerators": accelerators
        }]
    });

    // Without the token the private repository is refused before anything is stored.
    dictl.wait_with_file(&["create"], &spec).await.assert(
        1,
        &[
            "spec.model_deployments[0].provider_model_id",
            "hugging_face_token",
            "unprocessable_entity",
        ],
    );

    // With it: created, waited for until active.
    let body = json!({"spec": spec, "access_tokens": {"hugging_face_token": OWNER}});
    let began = Instant::now();
    let created = dictl.wait_with_file(&["create"], &body).await;
    let create_took = began.elapsed();
    let id = created
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("Created dedicated inference "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the id: {created:?}"))
        .to_string();
    Uuid::parse_str(&id).unwrap_or_else(|_| panic!("{id} is a UUID: {created:?}"));
    let token = created
        .stdout
        .lines()
        .skip_while(|l| !l.contains("store it now"))
        .nth(1)
        .map(str::trim)
        .unwrap_or_else(|| panic!("the endpoint token: {created:?}"))
        .to_string();
    created.assert(
        0,
        &[
            &format!("Dedicated inference {id} is active."),
            &format!("{NAME} ({REPO})"),
        ],
    );
    let first = deployment(&sys, &api, &id).await;
    assert_eq!(first["provider_model_id"], REPO, "{first}");
    assert_eq!(first["model_slug"], NAME, "{first}");
    assert_eq!(first["model_provider"], "hugging_face", "{first}");

    // The CA from dictl, and the endpoint answers the token dictl showed.
    let ca = dictl.run(&["ca", &id]).await;
    ca.assert(0, &["-----BEGIN CERTIFICATE-----"]);
    let client = ca_client(&ca.stdout);
    let got = sys.call(Method::GET, &di_path(&id, ""), &api, None).await;
    let endpoint = got.body["dedicated_inference"]["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .expect("a public endpoint")
        .to_string();
    assert_chat_ok(&client, &endpoint, &token, NAME).await;

    // A partial file switches the repository; dictl fills in the rest from the latest spec.
    let caller = call_continuously(&client, &endpoint, &token).await;
    let switch = json!({"model_deployments": [{
        "model_slug": NAME, "model_provider": "hugging_face", "provider_model_id": NEXT_REPO,
        "accelerators": accelerators
    }]});
    let began = Instant::now();
    let switched = dictl.wait_with_file(&["update", &id], &switch).await;
    let switch_took = began.elapsed();
    let calls = not_one_failed(caller).await;
    switched.assert(
        0,
        &[
            "version 2 is rolling out",
            &format!("Dedicated inference {id} is active."),
            &format!("{NAME} ({NEXT_REPO})"),
        ],
    );
    let second = deployment(&sys, &api, &id).await;
    assert_eq!(second["provider_model_id"], NEXT_REPO, "{second}");
    assert_eq!(second["model_slug"], NAME, "{second}");
    assert_eq!(
        second["model_id"], first["model_id"],
        "the same deployment: {second}"
    );
    assert_serving(&sys, &id, NEXT_REPO).await;

    // A rename: the file has no deployments, so dictl sends the latest ones, which must keep
    // naming the repository (without it the deployment would read as a catalog model).
    let rename = json!({"name": "support-cli-v2"});
    dictl
        .wait_with_file(&["update", &id], &rename)
        .await
        .assert(
            0,
            &["version 3 is rolling out", &format!("{NAME} ({NEXT_REPO})")],
        );
    let got = dictl.run(&["get", &id, "-o", "json"]).await;
    got.assert(0, &[]);
    let got: Value = serde_json::from_str(&got.stdout).expect("JSON on stdout");
    let di = &got["dedicated_inference"];
    assert_eq!(di["name"], "support-cli-v2", "{di}");
    assert_eq!(di["spec"]["version"], 3, "{di}");
    let third = &di["spec"]["model_deployments"][0];
    assert_eq!(third["provider_model_id"], NEXT_REPO, "{third}");
    assert_eq!(third["model_slug"], NAME, "{third}");
    assert_eq!(third["model_id"], first["model_id"], "{third}");
    assert_serving(&sys, &id, NEXT_REPO).await;
    assert_chat_ok(&client, &endpoint, &token, NAME).await;

    // Delete, waited for until the API answers 404.
    let deleted = dictl
        .run(&["delete", &id, "--force", "--wait", "--timeout", "90s"])
        .await;
    deleted.assert(
        0,
        &[
            &format!("Deletion of {id} accepted."),
            &format!("Dedicated inference {id} is deleted."),
        ],
    );
    wait_gone(&sys, &api, REGION, &id).await;
    dictl.run(&["get", &id]).await.assert(1, &["not_found"]);
    println!(
        "dictl: create --wait {create_took:?}, switch --wait {switch_took:?} with {calls} calls answered"
    );
}
