//! A Postgres server of a test's own, which the test may stop, start and restart as an operator
//! (or a managed database's failover) does; the shared one (`DATABASE_URL`) keeps serving every
//! other test. Its binaries are found as `scripts/postgres.sh` finds them: on `PATH`, else in
//! the newest `/usr/lib/postgresql/<version>/bin` (Debian's PostgreSQL packages). As root, the
//! server runs as the `postgres` user, which Postgres requires.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct OwnPostgres {
    dir: PathBuf,
    port: u16,
}

/// Where the server binary `name` (`initdb`, `pg_ctl`) is.
fn binary(name: &str) -> PathBuf {
    if let Some(found) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
    {
        return found;
    }
    let versions = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten();
    versions
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let path = e.path().join("bin").join(name);
            path.is_file().then_some((version, path))
        })
        .max()
        .map(|(_, path)| path)
        .unwrap_or_else(|| {
            panic!("PostgreSQL server binaries ({name}) not found; install PostgreSQL 15")
        })
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// `program args…`, as the `postgres` user when this process is root.
fn as_owner(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `command` without blocking the runtime (the test's clients keep calling meanwhile).
async fn run(command: Command, what: &str) {
    let out = tokio::process::Command::from(command)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl OwnPostgres {
    /// Initialises a data directory and starts a server on a free loopback port.
    pub async fn start() -> OwnPostgres {
        let dir = std::env::temp_dir().join(format!("own-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory for the server");
        if is_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres").arg(&dir);
            run(chown, "chown").await;
        }
        let mut initdb = as_owner(&binary("initdb"));
        initdb.arg("-D").arg(dir.join("data")).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        ]);
        run(initdb, "initdb").await;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let pg = OwnPostgres { dir, port };
        pg.start_again().await;
        pg
    }

    /// The URL of the server's `postgres` database, to create test databases from.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_ctl(&self, action: &str) -> Command {
        let mut command = as_owner(&binary("pg_ctl"));
        command
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(["-w", "-t", "60", action]);
        command
    }

    /// Starts the server (again, after [`OwnPostgres::stop`]); returns once it accepts connections.
    pub async fn start_again(&self) {
        let mut start = self.pg_ctl("start");
        start.arg("-o").arg(format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off -c full_page_writes=off",
            self.port,
            self.dir.display()
        ));
        run(start, "pg_ctl start").await;
    }

    /// `pg_ctl stop -m fast`: every session is terminated, then the server is down.
    pub async fn stop(&self) {
        let mut stop = self.pg_ctl("stop");
        stop.args(["-m", "fast"]);
        run(stop, "pg_ctl stop").await;
    }

    /// `pg_ctl restart -m fast`: every session is terminated and the server starts again.
    pub async fn restart(&self) {
        let mut restart = self.pg_ctl("restart");
        restart.args(["-m", "fast"]);
        run(restart, "pg_ctl restart").await;
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let mut stop = self.pg_ctl("stop");
        let _ = stop.args(["-m", "immediate"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
