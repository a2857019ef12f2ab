//! `scripts/supervise`, which `scripts/run` runs every service under: a service that exits or is
//! killed is started again and the restart is reported; SIGTERM stops the service and the
//! supervisor; a supervisor whose parent is gone does not bring its service back.

use std::future::ready;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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

/// Whether `pid` runs: not gone, and not a zombie no one reaped (as an orphan may stay where
/// nothing reaps them).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(')')?.1.split_whitespace().next()? != "Z"))
        .unwrap_or(false)
}

/// The parent of `pid`, from /proc.
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process runs");
    let (_, rest) = stat.rsplit_once(')').expect("a stat line");
    rest.split_whitespace()
        .nth(1)
        .and_then(|ppid| ppid.parse().ok())
        .expect("a parent pid")
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The pids the supervisor recorded, oldest first.
fn started(pidfile: &Path) -> Vec<u32> {
    std::fs::read_to_string(pidfile)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Stops what a test started even when it fails: the supervisor, then every service it started
/// (each in a session of its own), so that no process outlives the test.
struct Cleanup {
    supervisor: u32,
    pids: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        signal(self.supervisor, "-TERM");
        // It stops its service itself (giving it up to 15 s), then exits: gone, or a zombie, as
        // our child is until reaped. Whatever is left after that, or after 20 s, is killed.
        within(Duration::from_secs(20), || !running(self.supervisor));
        for pid in started(&self.pids) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = Command::new("kill")
            .args(["-KILL", &self.supervisor.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// Waits until `check` holds, failing the test at `timeout`. The tests are synchronous (they
/// supervise processes, not tasks): the wait runs on a runtime of its own.
fn until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
        .block_on(test_support::until(timeout, what, || ready(check())));
}

/// Whether `check` holds within `timeout`, looked at as [`until`] looks; never fails the test
/// (for a cleanup, which may run while the test is failing).
fn within(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
        .block_on(test_support::within(timeout, || {
            ready(check().then_some(()))
        }))
        .is_some()
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
    let _cleanup = Cleanup {
        supervisor: sup.id(),
        pids: pids.clone(),
    };
    until("the service to start", Duration::from_secs(10), || {
        started(&pids).len() == 1
    });
    let first = started(&pids)[0];
    signal(first, "-KILL");
    until("a restart", Duration::from_secs(10), || {
        started(&pids).len() == 2
    });
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
    until("the service to stop", Duration::from_secs(10), || {
        !alive(second)
    });
    assert_eq!(
        started(&pids).len(),
        2,
        "nothing was started after the stop"
    );
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
    let _cleanup = Cleanup {
        supervisor: sup.id(),
        pids: dir.join("pids"),
    };
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
    let _cleanup = Cleanup {
        supervisor: parent.id(),
        pids: pids.clone(),
    };
    until("the service to start", Duration::from_secs(10), || {
        started(&pids).len() == 1
    });
    let service = started(&pids)[0];
    let supervisor = parent_of(service);
    // The parent is killed (as a SIGKILLed scripts/run), then its service: the supervisor
    // exits instead of starting it again.
    parent.kill().unwrap();
    parent.wait().unwrap();
    signal(service, "-KILL");
    until("the supervisor to exit", Duration::from_secs(10), || {
        !running(supervisor)
    });
    assert_eq!(started(&pids).len(), 1, "the service was brought back");
}

/// A Ctrl-C at the terminal reaches the whole process group. The supervisor, started in the
/// background as scripts/run starts it (SIGINT ignored), must not see its service exit on that
/// SIGINT and restart it: scripts/run stops services through their supervisors.
#[test]
fn a_ctrl_c_at_the_terminal_does_not_make_the_supervisor_restart_its_service() {
    use std::os::unix::process::CommandExt;
    let dir = scratch();
    let pids = dir.join("pids");
    // A service that exits with code 0 on SIGINT, as the real ones do (at once: nothing of it
    // runs after that), says when it would, and answers SIGUSR1 in its log.
    let service = "import os, signal, time\n\
                   signal.signal(signal.SIGINT, lambda *_: os._exit(0))\n\
                   signal.signal(signal.SIGUSR1, lambda *_: print('answered SIGUSR1', flush=True))\n\
                   print('handling SIGINT', flush=True)\n\
                   time.sleep(1000)";
    let mut sup = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "trap '' INT; exec bash {} svc {} {} python3 -c \"$0\"",
            script().display(),
            dir.join("svc.log").display(),
            pids.display()
        ))
        .arg(service)
        .process_group(0)
        .spawn()
        .unwrap();
    let _cleanup = Cleanup {
        supervisor: sup.id(),
        pids: pids.clone(),
    };
    until("the service to start", Duration::from_secs(10), || {
        started(&pids).len() == 1
    });
    // Until the service handles SIGINT: one that reached it now would stop it, as it must for the
    // test to see a restart.
    until(
        "the service to handle SIGINT",
        Duration::from_secs(10),
        || {
            std::fs::read_to_string(dir.join("svc.log"))
                .is_ok_and(|log| log.contains("handling SIGINT"))
        },
    );
    Command::new("kill")
        .args(["-INT", "--", &format!("-{}", sup.id())])
        .status()
        .unwrap();
    // The service answers a signal sent after the Ctrl-C, so the Ctrl-C did not reach it: it
    // would have exited first (pending signals are delivered lowest number first, and Python
    // runs their handlers in that order).
    let first = started(&pids)[0];
    signal(first, "-USR1");
    let log = || std::fs::read_to_string(dir.join("svc.log")).unwrap_or_default();
    until(
        "the service to answer SIGUSR1 after the Ctrl-C",
        Duration::from_secs(10),
        || log().contains("answered SIGUSR1"),
    );
    assert_eq!(
        started(&pids).len(),
        1,
        "the service was restarted after a Ctrl-C"
    );
    // Nor did the supervisor act on it: it still watches its service and has reported no exit,
    // so the service's death now is the first and only one it reports, and it restarts it.
    signal(first, "-KILL");
    until("a restart", Duration::from_secs(10), || {
        started(&pids).len() == 2
    });
    let log = log();
    let reports: Vec<&str> = log.lines().filter(|l| l.contains(" exited (")).collect();
    assert!(
        reports.len() == 1 && reports[0].contains("(killed by signal 9)"),
        "{log}"
    );
    signal(sup.id(), "-TERM");
    sup.wait().unwrap();
    until("the service to stop", Duration::from_secs(10), || {
        !alive(started(&pids)[1])
    });
}
