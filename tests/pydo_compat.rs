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
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use system_tests::python::{self, describe, tests_dir};
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

/// The venv's Python, with the pinned `tests/pydo/requirements.txt` installed.
fn pydo_python() -> PathBuf {
    python::venv("pydo-venv", "pydo/requirements.txt")
}

/// Runs one phase of compat.py and returns its `RESULT` object and full stdout.
async fn run_phase(
    python: &Path,
    sys: &System,
    token: &str,
    vpcs: &str,
    env: &[(&str, String)],
) -> (Value, String) {
    let mut command = tokio::process::Command::new(python);
    command
        .arg(tests_dir().join("pydo/compat.py"))
        .env("PYDO_BASE_URL", &sys.base)
        .env("PYDO_TOKEN", token)
        .env("PYDO_VPCS", vpcs)
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
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    let mut vpcs = serde_json::Map::new();
    for region in system_tests::REGIONS {
        let vpc = sys.cloud(region).create_vpc(team, "pydo").await;
        vpcs.insert(region.to_string(), vpc.to_string().into());
    }
    let vpcs = Value::Object(vpcs).to_string();

    // Phase 1: catalog reads, create, get, list and the error paths.
    let (first, _) = run_phase(&python, &sys, &token, &vpcs, &[("PYDO_PHASE", "1".into())]).await;
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
    sys.wait_status(&token, &id, "active", Duration::from_secs(10))
        .await;

    // Phase 2: everything else.
    let phase1_operations = serde_json::to_string(&first["operations"]).unwrap();
    let (second, stdout) = run_phase(
        &python,
        &sys,
        &token,
        &vpcs,
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
