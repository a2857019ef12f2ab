//! Bring your own model through the clients customers use: a private fine-tune of theirs,
//! published to the (simulated) Hugging Face Hub under their own token, is served, switched to
//! another repository under the same name, and deleted with pydo and the OpenAI Python client
//! (`tests/byom/clients.py`, in a venv built under the target directory from the pinned
//! `tests/byom/requirements.txt`; PyPI must be reachable on first use, nothing is skipped).
//!
//! Every journey runs on the real system with a simulated cloud and quick delays; every switch
//! happens under continuous calls that must all be answered.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use hub_sim::Repo;
use serde_json::{json, Value};
use system_tests::python::{self, describe, tests_dir};
use system_tests::{CloudOptions, System};
use uuid::Uuid;

use crate::lifecycle::{objects, start, wait_gone};

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
