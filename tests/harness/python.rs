//! Python virtual environments for the tests that drive the system with official Python clients
//! (pydo, openai). Each venv lives under the target directory, is built from a pinned
//! requirements file on first use (PyPI must be reachable then) and is reused afterwards. A
//! missing Python or a failed install fails the test; nothing is skipped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `tests/` directory.
pub fn tests_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Cargo's target directory (honouring `CARGO_TARGET_DIR`, relative to the workspace).
pub fn target_dir() -> PathBuf {
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

/// A process's exit status and output, for failure messages.
pub fn describe(output: &Output) -> String {
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

/// The Python of venv `target/<name>`, with `requirements` (a path under `tests/`) installed.
/// Blocking: call it from `spawn_blocking` in async tests.
///
/// Idempotent and safe when test processes race: an exclusive lock on a file beside the venv
/// serialises them, and a marker holding the installed requirements (written last) says whether
/// the venv is complete and current. A venv without the marker, half-built by a process that
/// died, or built from other requirements, is removed and built again.
pub fn venv(name: &str, requirements: &str) -> PathBuf {
    let requirements = tests_dir().join(requirements);
    let wanted = fs::read_to_string(&requirements)
        .unwrap_or_else(|e| panic!("read {}: {e}", requirements.display()));
    let target = target_dir();
    fs::create_dir_all(&target).unwrap_or_else(|e| panic!("create {}: {e}", target.display()));
    let venv = target.join(name);
    let lock_path = target.join(format!("{name}.lock"));
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
        &format!("creating the {name} venv (needs Python 3 with the venv module)"),
        Command::new(&system_python).args(["-m", "venv"]).arg(&venv),
    );
    run_checked(
        &format!("installing {} (needs PyPI)", requirements.display()),
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
