//! Hugging Face Hub simulator: a stand-in for `https://huggingface.co` that the control plane
//! cannot tell from the real thing for the questions it asks when a customer names a model. It
//! owns a set of model repositories (visibility, gating, access grants, branches and commits,
//! `config.json`, safetensors parameter counts, file lists) and user access tokens, and serves
//! them over the Hub's own HTTP API: `GET /api/whoami-v2`, `GET /api/models/{org}/{name}[/revision/{rev}]`
//! and `GET`/`HEAD /{org}/{name}/resolve/{rev}/{path}`, with the Hub's status codes, `X-Error-Code`
//! and `X-Error-Message` headers and bodies, which the official `huggingface_hub` client
//! classifies. It starts seeded with the catalog's models ([`seed_repos`]) and one reader token
//! ([`SEED_READER_TOKEN`]) granted to every gated one, and offers repository and token
//! administration, fault injection and request counts under `/_sim/` (JSON bodies) for tests and
//! scripts. It holds no control-plane logic, reaches no network beyond its listener, and
//! production code needs nothing from it but its base URL (what `HF_ENDPOINT` is to
//! `huggingface_hub`).

mod admin;
mod api;
pub mod repo;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use anyhow::{anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use repo::{
    fake_sha, is_sha, model_type_for, seed_repos, Gated, ModelSpec, Repo, SEED_READER_TOKEN,
    SEED_READER_USER,
};

/// Faults injected into the Hub API (not into `/_sim/`). `GET`/`PUT /_sim/faults`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HubFaults {
    /// Fraction (0.0..=1.0) of requests answered 500.
    pub error_rate: f64,
    /// Fraction (0.0..=1.0) of requests answered 429 with `Retry-After`.
    pub rate_limit_rate: f64,
    /// Extra latency before every answer, in milliseconds.
    pub latency_ms: u64,
    /// `Retry-After` of injected 429s, in seconds (at least 1).
    pub retry_after_secs: u64,
    /// The next this-many requests are answered 503, whatever the rates; counts down.
    pub fail_next: u64,
}

/// Requests the Hub API has answered since the start. `GET /_sim/stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HubStats {
    /// Every Hub API request, faulted ones included.
    pub requests: u64,
    /// Those answered with an injected fault.
    pub faults_injected: u64,
    /// `whoami`, `model_info`, `resolve`, `other`: requests per kind.
    pub by_kind: BTreeMap<String, u64>,
}

/// A user access token.
#[derive(Debug, Clone)]
pub(crate) struct TokenInfo {
    pub user: String,
    pub created_at: String,
}

/// Repositories (by lowercased id) and tokens.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    pub repos: BTreeMap<String, Repo>,
    pub tokens: BTreeMap<String, TokenInfo>,
}

impl Hub {
    pub fn repo(&self, id: &str) -> Option<&Repo> {
        self.repos.get(&id.to_ascii_lowercase())
    }

    fn repo_mut(&mut self, id: &str) -> anyhow::Result<&mut Repo> {
        self.repos
            .get_mut(&id.to_ascii_lowercase())
            .ok_or_else(|| anyhow!("no repository {id}"))
    }
}

pub(crate) struct Shared {
    pub hub: RwLock<Hub>,
    pub faults: Mutex<HubFaults>,
    pub requests: AtomicU64,
    pub faults_injected: AtomicU64,
    pub by_kind: Mutex<BTreeMap<String, u64>>,
    /// Distinguishes the shas of pushed revisions.
    pub pushes: AtomicU64,
}

impl Shared {
    fn new() -> Self {
        Shared {
            hub: RwLock::new(Hub::default()),
            faults: Mutex::new(HubFaults::default()),
            requests: AtomicU64::new(0),
            faults_injected: AtomicU64::new(0),
            by_kind: Mutex::new(BTreeMap::new()),
            pushes: AtomicU64::new(0),
        }
    }

    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Hub> {
        self.hub.read().expect("hub lock")
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Hub> {
        self.hub.write().expect("hub lock")
    }

    pub fn publish(&self, mut repo: Repo) -> anyhow::Result<Repo> {
        repo.normalize().map_err(|e| anyhow!(e))?;
        self.write()
            .repos
            .insert(repo.id.to_ascii_lowercase(), repo.clone());
        Ok(repo)
    }

    pub fn remove(&self, id: &str) -> bool {
        self.write()
            .repos
            .remove(&id.to_ascii_lowercase())
            .is_some()
    }

    pub fn update<T>(&self, id: &str, f: impl FnOnce(&mut Repo) -> T) -> anyhow::Result<T> {
        let mut hub = self.write();
        Ok(f(hub.repo_mut(id)?))
    }

    pub fn add_token(&self, token: &str, user: &str) -> anyhow::Result<()> {
        if token.trim().is_empty() || token.contains(char::is_whitespace) {
            bail!("a token is one non-empty word");
        }
        if user.trim().is_empty() {
            bail!("a token needs a user name");
        }
        self.write().tokens.insert(
            token.to_string(),
            TokenInfo {
                user: user.to_string(),
                created_at: repo::now(),
            },
        );
        Ok(())
    }

    pub fn revoke_token(&self, token: &str) -> bool {
        self.write().tokens.remove(token).is_some()
    }

    /// Adds (or moves) branch `name` to a new commit, with its own `config.json` when given;
    /// returns the commit's sha. Moving a branch keeps the commit it left readable by sha, with
    /// the config it had, as a git history does: what was pinned to it still loads.
    pub fn push_revision(
        &self,
        id: &str,
        name: &str,
        config: Option<Value>,
    ) -> anyhow::Result<String> {
        if name.is_empty() || is_sha(name) {
            bail!("a branch name is not empty and not a sha");
        }
        let n = self.pushes.fetch_add(1, Ordering::SeqCst);
        self.update(id, |r| {
            let sha = fake_sha(&format!("{}@{name}#{n}", r.id));
            if name == "main" {
                let old = r.sha().to_string();
                r.revision_configs.insert(old, r.config.clone());
                if let Some(c) = config {
                    r.config = c;
                }
                r.last_modified = repo::now();
            } else {
                if let Some(old) = r.revisions.get(name).cloned() {
                    let had = r.revision_configs.get(&old).unwrap_or(&r.config).clone();
                    r.revision_configs.entry(old).or_insert(had);
                }
                if let Some(c) = config {
                    r.revision_configs.insert(sha.clone(), c);
                }
            }
            r.revisions.insert(name.to_string(), sha.clone());
            sha
        })
    }

    pub fn stats(&self) -> HubStats {
        HubStats {
            requests: self.requests.load(Ordering::SeqCst),
            faults_injected: self.faults_injected.load(Ordering::SeqCst),
            by_kind: self.by_kind.lock().expect("stats lock").clone(),
        }
    }

    fn seed(&self) {
        for r in seed_repos() {
            let gated = r.gated.is_gated();
            let id = r.id.clone();
            self.publish(r).expect("seed repositories are valid");
            if gated {
                self.update(&id, |r| r.granted.insert(SEED_READER_TOKEN.to_string()))
                    .expect("just published");
            }
        }
        self.add_token(SEED_READER_TOKEN, SEED_READER_USER)
            .expect("seed token is valid");
    }
}

/// A running Hub simulator. Dropping it stops the server.
pub struct HubSim {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl HubSim {
    /// Starts a simulator on `addr` (port 0: a free one), seeded with [`seed_repos`] and the
    /// token [`SEED_READER_TOKEN`] (user [`SEED_READER_USER`]), granted to every gated seed.
    pub async fn start(addr: SocketAddr) -> anyhow::Result<HubSim> {
        let sim = Self::start_empty(addr).await?;
        sim.shared.seed();
        Ok(sim)
    }

    /// As [`HubSim::start`], with no repositories and no tokens.
    pub async fn start_empty(addr: SocketAddr) -> anyhow::Result<HubSim> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new());
        let app = api::router(shared.clone()).merge(admin::router(shared.clone()));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.await;
            });
            if let Err(e) = served.await {
                tracing::warn!(error = %e, "hub simulator stopped");
            }
        });
        Ok(HubSim {
            addr,
            shared,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The base URL, e.g. `http://127.0.0.1:41234` (no trailing slash): the `HF_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Creates or replaces a repository; returns it as stored (with `main`, `last_modified`).
    pub fn publish(&self, repo: Repo) -> anyhow::Result<Repo> {
        self.shared.publish(repo)
    }

    /// Deletes a repository; false if there was none.
    pub fn remove(&self, repo_id: &str) -> bool {
        self.shared.remove(repo_id)
    }

    /// The repository as stored.
    pub fn repo(&self, repo_id: &str) -> Option<Repo> {
        self.shared.read().repo(repo_id).cloned()
    }

    pub fn set_gated(&self, repo_id: &str, gated: Gated) -> anyhow::Result<()> {
        self.shared.update(repo_id, |r| r.gated = gated)
    }

    pub fn set_private(&self, repo_id: &str, private: bool) -> anyhow::Result<()> {
        self.shared.update(repo_id, |r| r.private = private)
    }

    /// Gives `token` read access to the repository (gated or private).
    pub fn grant(&self, repo_id: &str, token: &str) -> anyhow::Result<()> {
        self.shared.update(repo_id, |r| {
            r.granted.insert(token.to_string());
        })
    }

    /// Makes `token` a valid token of user `user_name` (replacing an earlier one).
    pub fn add_token(&self, token: &str, user_name: &str) -> anyhow::Result<()> {
        self.shared.add_token(token, user_name)
    }

    /// Invalidates `token`: every request carrying it is then answered 401. False if unknown.
    pub fn revoke_token(&self, token: &str) -> bool {
        self.shared.revoke_token(token)
    }

    /// Points branch `revision_name` at a new commit (its own `config.json` when given, else the
    /// repository's); returns the commit's sha. The commit it left stays readable by sha.
    pub fn push_revision(
        &self,
        repo_id: &str,
        revision_name: &str,
        config: Option<Value>,
    ) -> anyhow::Result<String> {
        self.shared.push_revision(repo_id, revision_name, config)
    }

    pub fn faults(&self) -> HubFaults {
        self.shared.faults.lock().expect("faults lock").clone()
    }

    pub fn set_faults(&self, faults: HubFaults) {
        *self.shared.faults.lock().expect("faults lock") = faults;
    }

    pub fn stats(&self) -> HubStats {
        self.shared.stats()
    }

    /// Stops serving and waits for the server to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for HubSim {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
