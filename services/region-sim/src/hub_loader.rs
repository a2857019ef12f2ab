//! What a vLLM container's model download does first, as the simulated clusters' model loader:
//! it asks the Hugging Face Hub the container is configured with for the repository's
//! `config.json` and fails with huggingface_hub's error when the Hub refuses, so a deleted
//! repository, a revoked token or a gated repository without access crash-loops the pod as it
//! would on DOKS.
//!
//! From the container it reads `--model` and `--revision` (default `main`) in its args and
//! `HF_ENDPOINT` and `HF_TOKEN` in its environment. A container without `--model` is not a model
//! server: loaded. Without `HF_ENDPOINT` the public Hub is meant, which the simulator does not
//! reach: loaded, unless [`crate::SimConfig::default_hub`] names a Hub standing in for it. A Hub
//! that is not on loopback is never asked either (the simulator reaches nothing beyond
//! loopback): loaded.
//!
//! The request runs on its own task, so the cluster's controller loop never waits for it; its
//! outcome is kept per (pod uid, restart count), one attempt of one container, until the loop
//! collects it. The token is sent, never logged, and never part of a message.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sim_kube::{LoadRequest, ModelLoader};

/// How long one request to the Hub may take before the load counts as failed.
const HUB_TIMEOUT: Duration = Duration::from_secs(10);
/// Outcomes nobody collected (their pod went meanwhile) are dropped after this long.
const KEEP_UNCOLLECTED: Duration = Duration::from_secs(120);

/// One attempt: the pod's uid, its container and that container's restart count.
type Attempt = (String, String, u32);

enum Slot {
    Pending,
    Done(Result<(), String>, Instant),
}

/// The simulated clusters' [`ModelLoader`]: one per region, shared by its clusters.
pub struct HubLoader {
    http: reqwest::Client,
    default_hub: Option<String>,
    runtime: tokio::runtime::Handle,
    attempts: Arc<Mutex<HashMap<Attempt, Slot>>>,
}

impl HubLoader {
    /// Must be called inside a Tokio runtime: the Hub requests run on it.
    pub fn new(default_hub: Option<String>) -> anyhow::Result<HubLoader> {
        let http = reqwest::Client::builder()
            .timeout(HUB_TIMEOUT)
            // The Hub redirects downloads to its storage; a redirect leaving loopback is not
            // followed (the answer so far shows the file exists).
            .redirect(reqwest::redirect::Policy::custom(|attempt| {
                if attempt.previous().len() < 10 && is_loopback(attempt.url()) {
                    attempt.follow()
                } else {
                    attempt.stop()
                }
            }))
            .build()?;
        Ok(HubLoader {
            http,
            default_hub: default_hub.map(|h| h.trim_end_matches('/').to_string()),
            runtime: tokio::runtime::Handle::try_current()?,
            attempts: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<Attempt, Slot>> {
        self.attempts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for HubLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubLoader")
            .field("default_hub", &self.default_hub)
            .finish_non_exhaustive()
    }
}

fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

impl ModelLoader for HubLoader {
    fn load(&self, request: &LoadRequest) -> Option<Result<(), String>> {
        let Some(repo) = request.arg("--model") else {
            return Some(Ok(()));
        };
        let hub = match request.env.get("HF_ENDPOINT").filter(|e| !e.is_empty()) {
            Some(e) => e.trim_end_matches('/').to_string(),
            None => match &self.default_hub {
                Some(h) => h.clone(),
                // The public Hub, assumed reachable.
                None => return Some(Ok(())),
            },
        };
        let revision = request.arg("--revision").unwrap_or("main");
        // As huggingface_hub builds it: the revision is one path segment (`refs/pr/1` encoded).
        let parsed = reqwest::Url::parse(&hub).ok().and_then(|mut url| {
            url.path_segments_mut()
                .ok()?
                .pop_if_empty()
                .extend(repo.split('/'))
                .extend(["resolve", revision, "config.json"]);
            Some(url)
        });
        let Some(parsed) = parsed else {
            return Some(Err(format!(
                "ValueError: invalid Hugging Face Hub URL: {hub}"
            )));
        };
        let url = parsed.to_string();
        if !is_loopback(&parsed) {
            return Some(Ok(()));
        }
        let attempt = (
            request.pod_uid.clone(),
            request.container.clone(),
            request.restart_count,
        );
        let mut slots = self.slots();
        match slots.remove(&attempt) {
            Some(Slot::Done(outcome, _)) => return Some(outcome),
            Some(Slot::Pending) => {
                slots.insert(attempt, Slot::Pending);
                return None;
            }
            None => {}
        }
        slots.retain(|_, s| !matches!(s, Slot::Done(_, at) if at.elapsed() > KEEP_UNCOLLECTED));
        slots.insert(attempt.clone(), Slot::Pending);
        drop(slots);
        let token = request
            .env
            .get("HF_TOKEN")
            .filter(|t| !t.is_empty())
            .cloned();
        let http = self.http.clone();
        let attempts = self.attempts.clone();
        let pod = format!("{}/{}", request.namespace, request.pod_name);
        self.runtime.spawn(async move {
            let outcome = fetch(&http, parsed, token.as_deref()).await;
            match &outcome {
                Ok(()) => tracing::debug!(%pod, %url, "model repository reachable"),
                Err(why) => tracing::info!(%pod, reason = %why, "model load fails"),
            }
            attempts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(attempt, Slot::Done(outcome, Instant::now()));
        });
        None
    }
}

/// `GET` of the repository's `config.json`: what decides whether vLLM's download starts.
async fn fetch(
    http: &reqwest::Client,
    url: reqwest::Url,
    token: Option<&str>,
) -> Result<(), String> {
    let mut req = http.get(url.clone());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return Err(connection_error(&url, &e)),
    };
    let status = resp.status();
    if status.is_success() || status.is_redirection() {
        return Ok(());
    }
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    Err(hub_error(
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        header("x-error-code").as_deref(),
        header("x-error-message").as_deref(),
        resp.url().as_str(),
    ))
}

fn connection_error(url: &reqwest::Url, e: &reqwest::Error) -> String {
    // reqwest's own message repeats the URL: its causes say what went wrong.
    let mut causes = Vec::new();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        causes.push(s.to_string());
        source = s.source();
    }
    let why = if causes.is_empty() {
        e.to_string()
    } else {
        causes.join(": ")
    };
    let what = if e.is_timeout() {
        "ReadTimeout"
    } else {
        "ConnectionError"
    };
    format!("{what}: could not reach the Hugging Face Hub at {url}: {why}")
}

/// The error huggingface_hub raises for a refused request (`hf_raise_for_status`), on one line:
/// its exception class, then its message.
pub fn hub_error(
    status: u16,
    reason: &str,
    code: Option<&str>,
    server_message: Option<&str>,
    url: &str,
) -> String {
    let client_or_server = if status >= 500 { "Server" } else { "Client" };
    let with_server_message = |msg: String| match server_message.filter(|m| !m.is_empty()) {
        Some(m) if !msg.contains(m) => format!("{msg} {m}"),
        _ => msg,
    };
    match code {
        Some("RevisionNotFound") => format!(
            "RevisionNotFoundError: {status} Client Error. Revision Not Found for url: {url}."
        ),
        Some("EntryNotFound") => {
            format!("EntryNotFoundError: {status} Client Error. Entry Not Found for url: {url}.")
        }
        Some("GatedRepo") => with_server_message(format!(
            "GatedRepoError: {status} Client Error. Cannot access gated repo for url {url}."
        )),
        _ if server_message == Some("Access to this resource is disabled.") => format!(
            "DisabledRepoError: {status} Client Error. Cannot access repository for url {url}. Access to this resource is disabled."
        ),
        Some("RepoNotFound") => repo_not_found(status, url),
        // A 401 without a code: the token itself was refused (revoked, mistyped, expired).
        _ if status == 401 => format!(
            "HfHubHTTPError: 401 Client Error: Unauthorized for url: {url}. {}",
            server_message
                .filter(|m| !m.is_empty())
                .unwrap_or("Invalid credentials in Authorization header")
        ),
        _ if status == 403 => format!(
            "HfHubHTTPError: 403 Forbidden: {}. Cannot access content at: {url}. Make sure your token has the correct permissions.",
            server_message.unwrap_or("None")
        ),
        _ => with_server_message(format!(
            "HfHubHTTPError: {status} {client_or_server} Error: {reason} for url: {url}"
        )),
    }
}

fn repo_not_found(status: u16, url: &str) -> String {
    format!(
        "RepositoryNotFoundError: {status} Client Error. Repository Not Found for url: {url}. Please make sure you specified the correct `repo_id` and `repo_type`. If you are trying to access a private or gated repo, make sure you are authenticated."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://127.0.0.1:1/org/m/resolve/main/config.json";

    #[test]
    fn refusals_read_as_huggingface_hub_raises_them() {
        let e = hub_error(401, "Unauthorized", Some("RepoNotFound"), None, URL);
        assert!(
            e.starts_with(&format!(
                "RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: {URL}."
            )),
            "{e}"
        );
        let e = hub_error(
            403,
            "Forbidden",
            Some("GatedRepo"),
            Some("Access to model org/m is restricted."),
            URL,
        );
        assert_eq!(
            e,
            format!("GatedRepoError: 403 Client Error. Cannot access gated repo for url {URL}. Access to model org/m is restricted.")
        );
        let e = hub_error(404, "Not Found", Some("RevisionNotFound"), None, URL);
        assert!(
            e.starts_with("RevisionNotFoundError: 404 Client Error. Revision Not Found for url: "),
            "{e}"
        );
        let e = hub_error(404, "Not Found", Some("EntryNotFound"), None, URL);
        assert!(
            e.starts_with("EntryNotFoundError: 404 Client Error. Entry Not Found for url: "),
            "{e}"
        );
        let e = hub_error(401, "Unauthorized", None, None, URL);
        assert_eq!(
            e,
            format!("HfHubHTTPError: 401 Client Error: Unauthorized for url: {URL}. Invalid credentials in Authorization header")
        );
        let e = hub_error(503, "Service Unavailable", None, None, URL);
        assert_eq!(
            e,
            format!("HfHubHTTPError: 503 Server Error: Service Unavailable for url: {URL}")
        );
    }

    #[test]
    fn only_loopback_hubs_are_asked() {
        for (u, want) in [
            ("http://127.0.0.1:8/x", true),
            ("http://localhost:8/x", true),
            ("http://[::1]:8/x", true),
            ("https://huggingface.co/x", false),
            ("http://10.0.0.1/x", false),
        ] {
            assert_eq!(is_loopback(&reqwest::Url::parse(u).unwrap()), want, "{u}");
        }
    }
}
