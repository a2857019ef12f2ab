//! `scripts/supervise`, which `scripts/run` runs every service under: a service that exits or is
//! killed is started again and the restart is reported; SIGTERM stops the service and the
//! supervisor; a supervisor whose parent is gone does not bring its service back.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/supervise")
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("supervise-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn alive(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

fn signal(pid: u32, sig: &str) {
    Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
}

/// The pids the supervisor recorded, oldest first.
fn started(pidfile: &Path) -> Vec<u32> {
    std::fs::read_to_string(pidfile)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

fn until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn supervise(dir: &Path, command: &[&str]) -> Child {
    Command::new("bash")
        .arg(script())
        .arg("svc")
        .arg(dir.join("svc.log"))
        .arg(dir.join("pids"))
        .args(command)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run scripts/supervise")
}

#[test]
fn a_killed_or_exiting_service_is_restarted_and_said_so() {
    let dir = scratch();
    let pids = dir.join("pids");
    let mut sup = supervise(&dir, &["sleep", "1000"]);
    until("the service to start", Duration::from_secs(10), || {
        started(&pids).len() == 1
    });
    let first = started(&pids)[0];
    signal(first, "-KILL");
    until("a restart", Duration::from_secs(10), || started(&pids).len() == 2);
    let second = started(&pids)[1];
    assert!(alive(second) && !alive(first));
    let log = std::fs::read_to_string(dir.join("svc.log")).unwrap();
    assert!(
        log.contains("svc exited (killed by signal 9); restarting it in 1s"),
        "{log}"
    );

    // SIGTERM stops the service and the supervisor, which says nothing more.
    signal(sup.id(), "-TERM");
    let status = sup.wait().unwrap();
    assert!(status.success(), "{status:?}");
    until("the service to stop", Duration::from_secs(10), || !alive(second));
    assert_eq!(started(&pids).len(), 2, "nothing was started after the stop");
    let mut stderr = String::new();
    std::io::Read::read_to_string(sup.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(
        stderr.lines().filter(|l| l.contains("restarting")).count(),
        1,
        "{stderr}"
    );
}

#[test]
fn a_service_that_keeps_failing_is_restarted_with_growing_pauses() {
    let dir = scratch();
    let mut sup = supervise(&dir, &["sh", "-c", "exit 3"]);
    until("three starts", Duration::from_secs(15), || {
        started(&dir.join("pids")).len() >= 3
    });
    signal(sup.id(), "-TERM");
    sup.wait().unwrap();
    let log = std::fs::read_to_string(dir.join("svc.log")).unwrap();
    assert!(log.contains("(exit code 3); restarting it in 1s"), "{log}");
    assert!(log.contains("(exit code 3); restarting it in 2s"), "{log}");
}

#[test]
fn a_supervisor_whose_parent_is_gone_restarts_nothing() {
    let dir = scratch();
    let pids = dir.join("pids");
    // A parent that starts the supervisor and then waits, as scripts/run does.
    let mut parent = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "bash {} svc {} {} sleep 1000 & exec sleep 1000",
            script().display(),
            dir.join("svc.log").display(),
            pids.display()
        ))
        .spawn()
        .unwrap();
    until("the service to start", Duration::from_secs(10), || {
        started(&pids).len() == 1
    });
    // The parent is killed (as a SIGKILLed scripts/run), then its service.
    parent.kill().unwrap();
    parent.wait().unwrap();
    signal(started(&pids)[0], "-KILL");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(started(&pids).len(), 1, "the service was brought back");
}
