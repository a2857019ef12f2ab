//! Runs the built `dictl` binary against a real central API (and regions) from the system-test
//! harness. Worker progress is simulated through the region stores, as a worker would make it.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{create_body, System};
use test_support::{eventually, until};
use tokio::io::AsyncReadExt;
use uuid::Uuid;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

fn command(base: &str, token: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_dictl"));
    cmd.args(args)
        .env("DI_API_URL", base)
        .env("DI_TOKEN", token)
        .env_remove("COLUMNS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn finish(cmd: tokio::process::Command, token: String) -> Run {
    Running::start(cmd, token).finish().await
}

/// dictl running, its output collected as it comes: a test can wait until dictl has shown
/// something (its progress while it waits) before it changes what dictl looks at.
struct Running {
    child: tokio::process::Child,
    args: Vec<String>,
    token: String,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<tokio::task::JoinHandle<()>>,
}

/// Appends what `from` gives to `into` until its end.
fn collect(
    mut from: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    into: Arc<Mutex<Vec<u8>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 {
                break;
            }
            into.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    })
}

impl Running {
    fn start(mut cmd: tokio::process::Command, token: String) -> Running {
        let args = cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let mut child = cmd.spawn().expect("dictl runs");
        let (stdout, stderr) = (Arc::default(), Arc::default());
        let readers = vec![
            collect(child.stdout.take().expect("piped"), Arc::clone(&stdout)),
            collect(child.stderr.take().expect("piped"), Arc::clone(&stderr)),
        ];
        Running {
            child,
            args,
            token,
            stdout,
            stderr,
            readers,
        }
    }

    /// Waits until dictl has written `what` to stderr, where `--wait` reports each status it
    /// sees: then it has seen that status, whatever its own polling pace.
    async fn shown(&self, what: &str) {
        let stderr = || String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned();
        until(
            Duration::from_secs(60),
            format!("dictl to show {what:?} on stderr"),
            async || {
                // Both streams at their end (looked at first, so that all it wrote is in):
                // dictl exited without showing it; say so at once, with what it wrote, rather
                // than after the whole wait.
                let exited = self.readers.iter().all(|r| r.is_finished());
                let shown = stderr().contains(what);
                assert!(
                    shown || !exited,
                    "dictl exited without showing {what:?}; stderr: {}; stdout: {}",
                    stderr(),
                    String::from_utf8_lossy(&self.stdout.lock().unwrap())
                );
                shown
            },
        )
        .await
    }

    async fn finish(mut self) -> Run {
        let status = tokio::time::timeout(Duration::from_secs(120), self.child.wait())
            .await
            .expect("dictl finishes within 2 minutes")
            .expect("dictl runs");
        for reader in self.readers {
            reader.await.unwrap();
        }
        let text = |out: &Mutex<Vec<u8>>| String::from_utf8_lossy(&out.lock().unwrap()).into();
        let run = Run {
            code: status.code().expect("dictl exited normally"),
            stdout: text(&self.stdout),
            stderr: text(&self.stderr),
        };
        if std::env::var_os("DICTL_TEST_SHOW").is_some() {
            eprintln!("dictl {:?}\n{run:?}", self.args);
        }
        assert!(
            !run.stdout.contains(&self.token) && !run.stderr.contains(&self.token),
            "the API token leaked: {run:?}"
        );
        run
    }
}

async fn dictl(sys: &System, token: &str, args: &[&str]) -> Run {
    finish(command(&sys.base, token, args), token.to_string()).await
}

/// Writes `value` to a fresh file and returns its path.
fn spec_file(value: &Value) -> String {
    let path = std::env::temp_dir().join(format!("dictl-test-{}.json", Uuid::new_v4()));
    std::fs::write(&path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

async fn create_via_api(sys: &System, token: &str, name: &str, region: &str) -> Uuid {
    let reply = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            token,
            Some(create_body(name, region)),
        )
        .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    Uuid::parse_str(reply.body["dedicated_inference"]["id"].as_str().unwrap()).unwrap()
}

/// The id of the DI named `name`, once the API lists it.
async fn id_by_name(sys: &System, token: &str, name: &str) -> Uuid {
    let listed = format!("{name} listed");
    eventually(Duration::from_secs(20), listed, async || {
        let list = sys
            .call(
                Method::GET,
                &format!("/v2/dedicated-inferences?name={name}"),
                token,
                None,
            )
            .await;
        list.body["dedicated_inferences"][0]["id"]
            .as_str()
            .map(|id| Uuid::parse_str(id).unwrap())
    })
    .await
}

async fn status_of(sys: &System, token: &str, id: Uuid) -> Value {
    sys.call(
        Method::GET,
        &format!("/v2/dedicated-inferences/{id}"),
        token,
        None,
    )
    .await
    .body["dedicated_inference"]["status"]
        .clone()
}

fn store<'a>(sys: &'a System, region: &str) -> &'a region_store::Store {
    sys.regions
        .iter()
        .find(|r| r.name == region)
        .expect("known region")
        .store()
}

fn endpoints() -> region_store::Endpoints {
    region_store::Endpoints {
        public_fqdn: Some("https://cli-test.example".into()),
        private_fqdn: Some("https://cli-test.internal.example".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_from_a_spec_file_prints_the_id_and_the_token_once() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    // Just the spec, without the version: dictl wraps it and starts at version 1.
    let mut spec = create_body("from-file", "atl1")["spec"].clone();
    spec.as_object_mut().unwrap().remove("version");
    let run = dictl(&sys, &token, &["create", "-f", &spec_file(&spec)]).await;
    assert_eq!(run.code, 0, "{run:?}");

    let id = id_by_name(&sys, &token, "from-file").await;
    assert!(run.stdout.contains(&id.to_string()), "{run:?}");
    let value = run
        .stdout
        .lines()
        .skip_while(|l| !l.contains("store it now"))
        .nth(1)
        .map(str::trim)
        .expect("the token value follows the notice");
    assert!(value.len() > 16, "{run:?}");
    assert_eq!(run.stdout.matches(value).count(), 1, "{run:?}");

    // The same in JSON: the API's create response as is, token included.
    let body = create_body("from-file-json", "nyc2");
    let run = dictl(
        &sys,
        &token,
        &["create", "-f", &spec_file(&body), "-o", "json"],
    )
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    let created: Value = serde_json::from_str(&run.stdout).expect("JSON on stdout");
    assert_eq!(created["dedicated_inference"]["name"], "from-file-json");
    assert!(created["token"]["value"]
        .as_str()
        .is_some_and(|v| !v.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_json_is_the_api_json() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let id = create_via_api(&sys, &token, "as-json", "tor1").await;
    let run = dictl(&sys, &token, &["get", &id.to_string(), "-o", "json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let got: Value = serde_json::from_str(&run.stdout).expect("valid JSON on stdout");
    assert_eq!(got["dedicated_inference"]["id"], id.to_string());
    assert_eq!(got["dedicated_inference"]["region"], "tor1");

    // The text view is key/value.
    let run = dictl(&sys, &token, &["get", &id.to_string()]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("ID:"), "{run:?}");
    assert!(run.stdout.contains("as-json"), "{run:?}");
    assert!(run.stdout.contains("qwen/qwen2.5-7b-instruct"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_prints_a_table_with_every_name() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    create_via_api(&sys, &token, "listed-one", "atl1").await;
    create_via_api(&sys, &token, "listed-two", "nyc2").await;
    let run = dictl(&sys, &token, &["list"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let mut lines = run.stdout.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["ID", "NAME", "REGION", "STATUS", "VERSION", "CREATED"]
    );
    assert!(run.stdout.contains("listed-one"), "{run:?}");
    assert!(run.stdout.contains("listed-two"), "{run:?}");
    // Columns line up: every row's NAME starts where the header's does.
    let column = run.stdout.lines().next().unwrap().find("NAME").unwrap();
    for line in lines {
        assert!(line[column..].starts_with("listed-"), "{run:?}");
    }

    let run = dictl(&sys, &token, &["list", "--region", "nyc2", "-o", "json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let listed: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(listed["meta"]["total"], 1, "{run:?}");
    assert_eq!(listed["dedicated_inferences"][0]["name"], "listed-two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_follows_pagination() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    for i in 0..5 {
        create_via_api(&sys, &token, &format!("paged-{i}"), "atl1").await;
    }
    // Pages of two: dictl must fetch three of them.
    let mut cmd = command(&sys.base, &token, &["list", "-o", "json"]);
    cmd.env("DICTL_PER_PAGE", "2");
    let run = finish(cmd, token.clone()).await;
    assert_eq!(run.code, 0, "{run:?}");
    let listed: Value = serde_json::from_str(&run.stdout).unwrap();
    let mut names: Vec<&str> = listed["dedicated_inferences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["paged-0", "paged-1", "paged-2", "paged-3", "paged-4"]
    );
    assert_eq!(listed["meta"]["total"], 5);

    // Events page the same way while waiting and when listed.
    let id = id_by_name(&sys, &token, "paged-0").await;
    let region = store(&sys, "atl1");
    for n in 0..4 {
        region
            .event_append(id, "Progress", &format!("step {n}"))
            .await
            .unwrap();
    }
    let mut cmd = command(&sys.base, &token, &["events", &id.to_string()]);
    cmd.env("DICTL_PER_PAGE", "2");
    let run = finish(cmd, token.clone()).await;
    assert_eq!(run.code, 0, "{run:?}");
    for n in 0..4 {
        assert!(run.stdout.contains(&format!("step {n}")), "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_wait_succeeds_once_a_worker_promotes_the_di() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let file = spec_file(&create_body("waited", "atl1"));
    let mut cmd = command(
        &sys.base,
        &token,
        &["create", "-f", &file, "--wait", "--timeout", "60s"],
    );
    // Small pages, so following the events crosses page boundaries.
    cmd.env("DICTL_PER_PAGE", "1");
    let cli = Running::start(cmd, token.clone());

    let id = id_by_name(&sys, &token, "waited").await;
    let region = store(&sys, "atl1");
    // dictl polls on its own clock (once a second): each change is made once dictl has shown
    // the status before it, as a worker's pace would let it see every one. Waiting has begun
    // once the first status shows: the events from here on are new to it.
    cli.shown("status new").await;
    region.provisioning_begin(id).await.unwrap();
    cli.shown("status provisioning").await;
    region.rollout_complete(id, 1, &endpoints()).await.unwrap();

    let run = cli.finish().await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("is active"), "{run:?}");
    assert!(
        run.stdout.contains("https://cli-test.example"),
        "the final view shows the endpoint: {run:?}"
    );
    // Progress went to stderr, a line per change (not a terminal), with the events.
    assert!(run.stderr.contains("status provisioning"), "{run:?}");
    assert!(run.stderr.contains("ProvisioningStarted"), "{run:?}");
    assert!(run.stderr.contains("RolloutComplete"), "{run:?}");
    assert_eq!(run.stderr.matches("RolloutComplete").count(), 1, "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_exits_3_when_the_di_ends_in_error() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let file = spec_file(&create_body("doomed", "nyc2"));
    let cli = Running::start(
        command(
            &sys.base,
            &token,
            &["create", "-f", &file, "--wait", "--timeout", "60s"],
        ),
        token.clone(),
    );
    let id = id_by_name(&sys, &token, "doomed").await;
    let region = store(&sys, "nyc2");
    // As above: once dictl shows a status it is waiting, and the error's event is new to it.
    cli.shown("status new").await;
    region.provisioning_begin(id).await.unwrap();
    region
        .error_set(
            id,
            Some(1),
            "CapacityExhausted",
            "No gpu-h100x1-80gb left in nyc2.",
        )
        .await
        .unwrap();

    let run = cli.finish().await;
    assert_eq!(run.code, 3, "{run:?}");
    assert!(run.stderr.contains("CapacityExhausted"), "{run:?}");
    assert!(run.stderr.contains("No gpu-h100x1-80gb left"), "{run:?}");
    // The one-time token was printed before waiting.
    assert!(run.stdout.contains("store it now"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_times_out_with_exit_4() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let id = create_via_api(&sys, &token, "slow", "tor1").await;
    let file = spec_file(&json!({"name": "slow-renamed"}));
    let run = dictl(
        &sys,
        &token,
        &[
            "update",
            &id.to_string(),
            "-f",
            &file,
            "--wait",
            "--timeout",
            "2s",
        ],
    )
    .await;
    assert_eq!(run.code, 4, "{run:?}");
    assert!(run.stderr.contains("timeout"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_sends_the_latest_version_and_keeps_missing_fields() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let id = create_via_api(&sys, &token, "before", "atl1").await;
    let region = store(&sys, "atl1");
    region.provisioning_begin(id).await.unwrap();
    region.rollout_complete(id, 1, &endpoints()).await.unwrap();
    eventually(Duration::from_secs(10), "active", async || {
        (status_of(&sys, &token, id).await == "active").then_some(())
    })
    .await;

    // Only the name changes; version, region, VPC and models come from the current spec.
    let file = spec_file(&json!({"name": "after"}));
    let run = dictl(&sys, &token, &["update", &id.to_string(), "-f", &file]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("version 2"), "{run:?}");
    // Again while version 2 is pending: the pending version is the latest.
    let file = spec_file(&json!({"spec": {"name": "after-again"}}));
    let run = dictl(
        &sys,
        &token,
        &["update", &id.to_string(), "-f", &file, "-o", "json"],
    )
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    let updated: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        updated["dedicated_inference"]["pending_deployment_spec"]["version"],
        3
    );
    assert_eq!(
        updated["dedicated_inference"]["pending_deployment_spec"]["name"],
        "after-again"
    );

    // A stale version set in the file is the API's 409.
    let file = spec_file(&json!({"version": 1, "name": "stale"}));
    let run = dictl(&sys, &token, &["update", &id.to_string(), "-f", &file]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("conflict"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_wait_force_succeeds_once_the_di_is_gone() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let id = create_via_api(&sys, &token, "short-lived", "atl1").await;
    let cli = Running::start(
        command(
            &sys.base,
            &token,
            &[
                "delete",
                &id.to_string(),
                "--wait",
                "--force",
                "--timeout",
                "60s",
            ],
        ),
        token.clone(),
    );
    // dictl waits through the deletion: it has seen the DI deleting before the DI is gone.
    cli.shown("status deleting").await;
    store(&sys, "atl1").gone(id).await.unwrap();

    let run = cli.finish().await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("is deleted"), "{run:?}");
    let after = dictl(&sys, &token, &["get", &id.to_string()]).await;
    assert_eq!(after.code, 1, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_exits_1_with_the_error_id() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let run = dictl(&sys, &token, &["get", &Uuid::new_v4().to_string()]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("not_found"), "{run:?}");
    assert!(run.stderr.contains("request_id"), "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_sizes_events_and_accelerators() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let id = create_via_api(&sys, &token, "with-tokens", "atl1").await;
    let id = id.to_string();

    let run = dictl(
        &sys,
        &token,
        &["tokens", "create", &id, "ci-token", "-o", "json"],
    )
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    let created: Value = serde_json::from_str(&run.stdout).unwrap();
    let token_id = created["token"]["id"].as_str().unwrap().to_string();
    let run = dictl(&sys, &token, &["tokens", "list", &id]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("ci-token"), "{run:?}");
    let run = dictl(&sys, &token, &["tokens", "delete", &id, &token_id]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let run = dictl(&sys, &token, &["tokens", "list", &id]).await;
    assert!(!run.stdout.contains("ci-token"), "{run:?}");

    let run = dictl(&sys, &token, &["sizes"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("gpu-h100x1-80gb"), "{run:?}");
    let run = dictl(&sys, &token, &["gpu-model-config"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("qwen/qwen2.5-7b-instruct"), "{run:?}");
    let run = dictl(&sys, &token, &["events", &id]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.starts_with("TIME"), "{run:?}");
    let run = dictl(&sys, &token, &["accelerators", &id, "-o", "json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    serde_json::from_str::<Value>(&run.stdout).unwrap();
    let run = dictl(&sys, &token, &["ca", &id]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.starts_with("-----BEGIN CERTIFICATE-----"),
        "{run:?}"
    );
}

#[tokio::test]
async fn an_unreachable_api_exits_5() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let run = finish(
        command(
            &base,
            "dia_v1_unused",
            &["get", &Uuid::new_v4().to_string()],
        ),
        "dia_v1_unused".to_string(),
    )
    .await;
    assert_eq!(run.code, 5, "{run:?}");
    assert!(run.stderr.contains("cannot reach the API"), "{run:?}");
}

#[tokio::test]
async fn usage_errors_exit_2() {
    let base = "http://127.0.0.1:9";
    let run = finish(command(base, "", &["get", "x"]), "dia_v1_unused".into()).await;
    assert_eq!(run.code, 2, "no token: {run:?}");
    assert!(run.stderr.contains("DI_TOKEN"), "{run:?}");
    let run = finish(
        command(base, "dia_v1_unused", &["list", "-o", "yaml"]),
        "dia_v1_unused".to_string(),
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    let run = finish(
        command(
            base,
            "dia_v1_unused",
            &["create", "-f", "/nonexistent/spec.json"],
        ),
        "dia_v1_unused".to_string(),
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
}
