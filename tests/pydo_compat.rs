//! Wire compatibility with pydo, DigitalOcean's official Python client: every one of its 13
//! `dedicated_inferences` operations runs against the real system (central + three regions on
//! loopback) from `tests/pydo/compat.py`, which asserts on what pydo returns.
//!
//! The test builds a Python venv with the pinned `tests/pydo/requirements.txt` under the target
//! directory on first use (PyPI must be reachable then) and reuses it afterwards. A missing
//! Python or a failed install fails the test; nothing is skipped.
//!
//! The script runs in two phases. Phase 1 creates a dedicated inference; the test then plays the
//! regional worker (provisioning, observed accelerators, rollout of version 1) so that phase 2
//! finds an active DI with accelerators for the remaining operations.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use reqwest::Method;
use serde_json::Value;
use system_tests::System;
use uuid::Uuid;

const OPERATIONS: [&str; 13] = [
    "list",
    "create",
    "get",
    "patch",
    "delete",
    "list_accelerators",
    "get_accelerator",
    "get_ca",
    "list_tokens",
    "create_tokens",
    "delete_tokens",
    "list_sizes",
    "get_gpu_model_config",
];

const SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

fn tests_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn target_dir() -> PathBuf {
    let workspace = tests_dir().parent().expect("tests/ has a parent");
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace.join(dir)
            }
        }
        _ => workspace.join("target"),
    }
}

fn describe(output: &Output) -> String {
    format!(
        "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn run_checked(what: &str, command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({command:?})\n{}",
        describe(&output)
    );
}

/// The venv's Python, with the pinned requirements installed.
///
/// Idempotent and safe when test processes race: an exclusive lock on a file beside the venv
/// serialises them, and a marker holding the installed requirements (written last) says whether
/// the venv is complete and current. A venv without the marker, half-built by a process that
/// died, or built from other requirements, is removed and built again.
fn pydo_python() -> PathBuf {
    let requirements = tests_dir().join("pydo/requirements.txt");
    let wanted = fs::read_to_string(&requirements)
        .unwrap_or_else(|e| panic!("read {}: {e}", requirements.display()));
    let target = target_dir();
    fs::create_dir_all(&target).unwrap_or_else(|e| panic!("create {}: {e}", target.display()));
    let venv = target.join("pydo-venv");
    let lock_path = target.join("pydo-venv.lock");
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .unwrap_or_else(|e| panic!("open {}: {e}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", lock_path.display()));

    let python = venv.join("bin").join("python");
    let marker = venv.join(".installed-requirements");
    if python.exists() && fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return python;
    }
    if venv.exists() {
        fs::remove_dir_all(&venv).unwrap_or_else(|e| panic!("remove {}: {e}", venv.display()));
    }
    let system_python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run_checked(
        "creating the pydo venv (needs Python 3 with the venv module)",
        Command::new(&system_python).args(["-m", "venv"]).arg(&venv),
    );
    run_checked(
        "installing tests/pydo/requirements.txt (needs PyPI)",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--quiet",
                "-r",
            ])
            .arg(&requirements),
    );
    fs::write(&marker, &wanted).unwrap_or_else(|e| panic!("write {}: {e}", marker.display()));
    python
    // The lock is released when `lock` is dropped here.
}

/// Runs one phase of compat.py and returns its `RESULT` object and full stdout.
async fn run_phase(
    python: &Path,
    sys: &System,
    token: &str,
    env: &[(&str, String)],
) -> (Value, String) {
    let mut command = tokio::process::Command::new(python);
    command
        .arg(tests_dir().join("pydo/compat.py"))
        .env("PYDO_BASE_URL", &sys.base)
        .env("PYDO_TOKEN", token)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // The server is on loopback: never send the test's traffic through a configured proxy.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = tokio::time::timeout(SCRIPT_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("compat.py did not finish within {SCRIPT_TIMEOUT:?}"))
        .expect("run compat.py");
    let phase = env
        .iter()
        .find(|(k, _)| *k == "PYDO_PHASE")
        .map(|(_, v)| v.as_str())
        .unwrap_or("?");
    assert!(
        output.status.success(),
        "compat.py phase {phase} failed\n{}",
        describe(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let result = stdout
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("RESULT "))
        .unwrap_or_else(|| {
            panic!(
                "compat.py phase {phase} printed no RESULT line\n{}",
                describe(&output)
            )
        });
    let result: Value = serde_json::from_str(result).expect("RESULT is JSON");
    assert_eq!(result["phase"], phase.parse::<i64>().unwrap(), "{result}");
    (result, stdout)
}

fn operations(result: &Value) -> BTreeSet<String> {
    result["operations"]
        .as_array()
        .expect("RESULT lists operations")
        .iter()
        .map(|v| v.as_str().expect("operation names are strings").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pydo_drives_every_dedicated_inference_operation() {
    let python = tokio::task::spawn_blocking(pydo_python)
        .await
        .expect("venv setup");
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;

    // Phase 1: catalog reads, create, get, list and the error paths.
    let (first, _) = run_phase(&python, &sys, &token, &[("PYDO_PHASE", "1".into())]).await;
    let id = Uuid::parse_str(first["id"].as_str().expect("phase 1 prints the DI id"))
        .expect("the DI id is a UUID");
    let region = first["region"]
        .as_str()
        .expect("phase 1 prints the region")
        .to_string();

    // The worker's part: provision, observe two accelerators, roll out version 1.
    let store = sys
        .regions
        .iter()
        .find(|r| r.name == region)
        .expect("the DI's region is one of the system's")
        .store()
        .clone();
    store.provisioning_begin(id).await.expect("provisioning");
    store
        .accelerators_replace(
            id,
            &[
                region_store::ObservedAccelerator {
                    name: "pydo-gpu-a".into(),
                    slug: "gpu-h100x1-80gb".into(),
                    role: "prefill_decode".into(),
                    status: "active".into(),
                },
                region_store::ObservedAccelerator {
                    name: "pydo-gpu-b".into(),
                    slug: "gpu-h100x1-80gb".into(),
                    role: "prefill_decode".into(),
                    status: "active".into(),
                },
            ],
        )
        .await
        .expect("accelerators observed");
    store
        .rollout_complete(
            id,
            1,
            &region_store::Endpoints {
                public_fqdn: Some("pub.pydo.example".into()),
                private_fqdn: Some("priv.pydo.example".into()),
            },
        )
        .await
        .expect("rollout of version 1");
    sys.settle().await;
    system_tests::eventually(Duration::from_secs(10), || async {
        let got = sys
            .call(
                Method::GET,
                &format!("/v2/dedicated-inferences/{id}"),
                &token,
                None,
            )
            .await;
        (got.body["dedicated_inference"]["status"] == "active").then_some(())
    })
    .await;

    // Phase 2: everything else.
    let phase1_operations = serde_json::to_string(&first["operations"]).unwrap();
    let (second, stdout) = run_phase(
        &python,
        &sys,
        &token,
        &[
            ("PYDO_PHASE", "2".into()),
            ("PYDO_DI_ID", id.to_string()),
            ("PYDO_DI_REGION", region.clone()),
            ("PYDO_PHASE1_OPERATIONS", phase1_operations),
        ],
    )
    .await;

    let called: BTreeSet<String> = operations(&first)
        .union(&operations(&second))
        .cloned()
        .collect();
    let expected: BTreeSet<String> = OPERATIONS.iter().map(|s| s.to_string()).collect();
    assert_eq!(called, expected, "pydo operations exercised");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("pydo compat: "))
        .unwrap_or_else(|| panic!("no summary line in phase 2's output:\n{stdout}"));
    assert!(
        summary.starts_with("pydo compat: 13 operations passed: "),
        "{summary}"
    );
    for op in OPERATIONS {
        assert!(
            summary
                .trim_start_matches("pydo compat: 13 operations passed: ")
                .split(", ")
                .any(|s| s == op),
            "{op} missing from the summary: {summary}"
        );
    }
    println!("{summary}");
}
