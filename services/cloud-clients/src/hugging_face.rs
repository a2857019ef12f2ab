//! A client for the questions the control plane asks the Hugging Face Hub about a repository a
//! customer names: whose a token is (`GET /api/whoami-v2`), what a model is at a revision
//! (`GET /api/models/{id}[/revision/{rev}]`: its commit, visibility, gating, architectures,
//! safetensors parameter counts) and its `config.json` (`GET /{id}/resolve/{rev}/config.json`,
//! where the Hub says whether a gated repository lets the token in).
//!
//! The client is given the Hub's base URL only (what `HF_ENDPOINT` is to `huggingface_hub`).
//! Errors are classified as the Hub answers them and as `huggingface_hub`'s
//! `hf_raise_for_status` reads them: by `X-Error-Code` first (`RepoNotFound`, `RevisionNotFound`,
//! `GatedRepo`, `EntryNotFound`), then a 401 saying `Invalid credentials in Authorization header`
//! is a bad token, and any other 401 on a repository URL means the repository is not there for
//! this caller (the Hub answers so for missing repositories and for private ones the caller
//! cannot read). 429, 5xx, timeouts and connection failures are transient: retried per
//! [`RetryConfig`] (never sooner than a `Retry-After`), then returned. Every attempt is counted
//! in the process-wide registry ([`HUB_REQUESTS`]). Tokens are sent as sensitive headers and
//! appear in no log, error or `Debug` output.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, RETRY_AFTER};
use reqwest::StatusCode;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use common::errors::{Classify, ErrorClass};

use crate::metrics::Outcome;
use crate::retry::{retry, RetryConfig};

/// `hugging_face_hub_requests_total{endpoint, outcome}`: Hub requests sent (retries included),
/// by endpoint (`whoami`, `model_info`, `model_config`) and outcome.
pub const HUB_REQUESTS: &str = "hugging_face_hub_requests_total";

/// What the Hub says when a request carries a token it does not know (or no longer knows).
const INVALID_CREDENTIALS: &str = "Invalid credentials in Authorization header";

/// The largest answer read (a `config.json` is a few kilobytes; model info tens).
const MAX_BODY: usize = 8 * 1024 * 1024;

// ------------------------------------------------------------------ errors

/// A failed Hub call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    /// The token is not a valid Hugging Face token (unknown, revoked, malformed).
    #[error("the Hugging Face token is invalid or revoked")]
    InvalidToken,
    /// No such repository, or a private one the token (or no token) cannot read: the Hub does
    /// not tell the two apart.
    #[error("the Hugging Face repository does not exist or the token cannot read it")]
    RepoNotFound,
    /// The repository has no such branch, tag or commit.
    #[error("the Hugging Face repository has no such revision")]
    RevisionNotFound,
    /// The repository is gated: without a token, one is needed; with one, its user has not
    /// been granted access (they must ask for it on the model's page).
    #[error("the Hugging Face repository is gated and {}", if *with_token { "the token's user has not been granted access" } else { "needs a token with access" })]
    GatedNoAccess { with_token: bool },
    /// The repository has no such file at that revision.
    #[error("the Hugging Face repository has no such file at that revision")]
    EntryNotFound,
    /// 429, 5xx, timeout or connection failure, still so after the retries; `retry_after` is the
    /// Hub's `Retry-After`, when it sent one.
    #[error("Hugging Face Hub unavailable: {message}")]
    Transient {
        message: String,
        retry_after: Option<Duration>,
    },
    /// Anything else: an answer this client does not expect (a status without meaning here, a
    /// body not of the documented shape).
    #[error("unexpected Hugging Face Hub answer: {0}")]
    Unexpected(String),
}

impl Classify for HubError {
    /// Decided where the answer is read ([`classify`]), once. The token is the customer's, not
    /// ours: the Hub refusing it (or refusing it a gated repository) is a refusal of what the
    /// request carries, never [`ErrorClass::Unauthorized`].
    fn class(&self) -> ErrorClass {
        match self {
            HubError::InvalidToken | HubError::GatedNoAccess { .. } => ErrorClass::Refused,
            HubError::RepoNotFound | HubError::RevisionNotFound | HubError::EntryNotFound => {
                ErrorClass::NotFound
            }
            HubError::Transient { retry_after, .. } => ErrorClass::Transient {
                retry_after: *retry_after,
            },
            HubError::Unexpected(_) => ErrorClass::Permanent,
        }
    }
}

/// Which call a request is, for classification and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Whoami,
    ModelInfo,
    ModelConfig,
}

impl Endpoint {
    fn as_str(self) -> &'static str {
        match self {
            Endpoint::Whoami => "whoami",
            Endpoint::ModelInfo => "model_info",
            Endpoint::ModelConfig => "model_config",
        }
    }
}

/// The server's message: `X-Error-Message`, else the body's `error` (a string or a list).
fn server_message(headers: &HeaderMap, body: &[u8]) -> String {
    if let Some(m) = headers.get("x-error-message").and_then(|v| v.to_str().ok()) {
        return m.to_string();
    }
    match serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").cloned())
    {
        Some(Value::String(s)) => s,
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("; "),
        _ => String::from_utf8_lossy(body).chars().take(300).collect(),
    }
}

/// Classifies a non-success answer as the Hub means it.
fn classify(
    endpoint: Endpoint,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    with_token: bool,
) -> HubError {
    let code = headers.get("x-error-code").and_then(|v| v.to_str().ok());
    let message = server_message(headers, body);
    let answered = format!("HTTP {}: {message}", status.as_u16());
    match code {
        Some("RevisionNotFound") => HubError::RevisionNotFound,
        Some("EntryNotFound") => HubError::EntryNotFound,
        Some("GatedRepo") => HubError::GatedNoAccess { with_token },
        Some("RepoNotFound") => HubError::RepoNotFound,
        _ if status == StatusCode::UNAUTHORIZED => {
            if endpoint == Endpoint::Whoami || message.trim() == INVALID_CREDENTIALS {
                HubError::InvalidToken
            } else {
                HubError::RepoNotFound
            }
        }
        _ if status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::REQUEST_TIMEOUT
            || status.is_server_error() =>
        {
            HubError::Transient {
                message: answered,
                retry_after: headers
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs),
            }
        }
        _ => HubError::Unexpected(answered),
    }
}

fn transport(e: reqwest::Error) -> HubError {
    if e.is_builder() {
        HubError::Unexpected(format!("request: {e}"))
    } else {
        HubError::Transient {
            message: e.to_string(),
            retry_after: None,
        }
    }
}

// ------------------------------------------------------------------ types

/// How a repository is gated (model info's `gated`: `false`, `"auto"`, `"manual"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gated {
    #[default]
    No,
    /// Access requests are approved at once, but each user must still ask (and use a token).
    Auto,
    /// The authors review each request. Also what a gating this client does not know reads as.
    Manual,
}

impl Gated {
    pub fn is_gated(self) -> bool {
        self != Gated::No
    }
}

impl<'de> Deserialize<'de> for Gated {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<Value>::deserialize(d)? {
            None | Some(Value::Bool(false)) => Gated::No,
            Some(Value::String(s)) if s == "auto" => Gated::Auto,
            Some(Value::String(s)) if s == "false" => Gated::No,
            // `true` (before gating had modes), "manual", or a mode added since: gated.
            Some(_) => Gated::Manual,
        })
    }
}

/// The user a token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Whoami {
    pub name: String,
}

/// What the Hub says of a model repository at a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `org/name`, as the repository spells it (whatever case it was asked with).
    pub id: String,
    /// The commit the revision is at (40 hex).
    pub sha: String,
    pub private: bool,
    pub gated: Gated,
    /// `config.json`'s `architectures`; empty when it has none (or there is no config).
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    /// Safetensors parameter counts by dtype (`{"BF16": 7615616512}`); empty without
    /// safetensors weights.
    pub safetensors_parameters: BTreeMap<String, u64>,
}

impl ModelInfo {
    /// All safetensors parameters.
    pub fn parameters_total(&self) -> u64 {
        self.safetensors_parameters.values().sum()
    }
}

#[derive(Deserialize)]
struct WireInfo {
    id: String,
    sha: String,
    #[serde(default)]
    private: bool,
    #[serde(default)]
    gated: Gated,
    #[serde(default)]
    config: Option<WireConfig>,
    #[serde(default)]
    safetensors: Option<WireSafetensors>,
}

#[derive(Deserialize)]
struct WireConfig {
    #[serde(default)]
    architectures: Option<Vec<String>>,
    #[serde(default)]
    model_type: Option<String>,
}

#[derive(Deserialize)]
struct WireSafetensors {
    #[serde(default)]
    parameters: Option<BTreeMap<String, u64>>,
}

#[derive(Deserialize)]
struct WireWhoami {
    name: String,
}

/// A token, sent as a sensitive `Authorization` header; `Debug` shows none of it.
struct Credential(HeaderValue);

impl Credential {
    /// `None` for an absent or blank token. A token that cannot be a header value cannot be
    /// valid either.
    fn bearer(token: Option<&str>) -> Result<Option<Credential>, HubError> {
        let Some(t) = token.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(None);
        };
        let mut v =
            HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| HubError::InvalidToken)?;
        v.set_sensitive(true);
        Ok(Some(Credential(v)))
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

// ------------------------------------------------------------------ client

/// Transport settings of a [`HubClient`].
#[derive(Debug, Clone)]
pub struct HubClientOptions {
    /// Whole-request timeout.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub retry: RetryConfig,
}

impl Default for HubClientOptions {
    /// Shorter than the cloud clients': the Hub is asked while a customer's request waits.
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            retry: RetryConfig {
                max_attempts: 4,
                max_elapsed: Duration::from_secs(15),
                max_retry_after: Duration::from_secs(5),
                ..RetryConfig::default()
            },
        }
    }
}

struct Inner {
    http: reqwest::Client,
    base: String,
    retry: RetryConfig,
}

/// A Hugging Face Hub client. Holds no token: each call takes the customer's. Cheap to clone.
#[derive(Clone)]
pub struct HubClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for HubClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubClient")
            .field("base_url", &self.inner.base)
            .field("retry", &self.inner.retry)
            .finish_non_exhaustive()
    }
}

/// A successful answer, read in full.
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
}

impl HubClient {
    /// A client for the Hub at `base_url` (`https://huggingface.co`, or wherever `HF_ENDPOINT`
    /// points) with default timeouts and retries.
    pub fn new(base_url: &str) -> anyhow::Result<HubClient> {
        Self::with_options(base_url, HubClientOptions::default())
    }

    pub fn with_options(base_url: &str, options: HubClientOptions) -> anyhow::Result<HubClient> {
        let base = base_url.trim().trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base)
            .map_err(|e| anyhow::anyhow!("Hugging Face Hub URL {base:?}: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            anyhow::bail!("Hugging Face Hub URL {base:?}: scheme must be http or https");
        }
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .user_agent(concat!("di-control-plane/", env!("CARGO_PKG_VERSION")))
            .timeout(options.timeout)
            .connect_timeout(options.connect_timeout)
            // Redirects (a repository renamed or asked in another case) are followed; reqwest
            // drops the Authorization header on one to another host.
            .redirect(reqwest::redirect::Policy::limited(5))
            .build()?;
        Ok(HubClient {
            inner: Arc::new(Inner {
                http,
                base,
                retry: options.retry,
            }),
        })
    }

    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// The user `token` belongs to. [`HubError::InvalidToken`] for an unknown, revoked or blank
    /// token.
    pub async fn whoami(&self, token: &str) -> Result<Whoami, HubError> {
        let cred = Credential::bearer(Some(token))?.ok_or(HubError::InvalidToken)?;
        let reply = self
            .get(Endpoint::Whoami, "/api/whoami-v2", Some(&cred))
            .await?;
        let w: WireWhoami = decode(&reply, "whoami")?;
        Ok(Whoami { name: w.name })
    }

    /// The repository's info at `revision` (a branch, tag or commit; `None`: the default
    /// branch). A gated repository's info is readable without access; a private one's needs a
    /// token that can read it ([`HubError::RepoNotFound`] otherwise).
    pub async fn model_info(
        &self,
        repo_id: &str,
        revision: Option<&str>,
        token: Option<&str>,
    ) -> Result<ModelInfo, HubError> {
        let repo = repo_path(repo_id)?;
        let cred = Credential::bearer(token)?;
        let path = match revision {
            None => format!("/api/models/{repo}"),
            Some(rev) => format!("/api/models/{repo}/revision/{}", seg(rev)),
        };
        let reply = self.get(Endpoint::ModelInfo, &path, cred.as_ref()).await?;
        let w: WireInfo = decode(&reply, "model info")?;
        let (architectures, model_type) = match w.config {
            Some(c) => (c.architectures.unwrap_or_default(), c.model_type),
            None => (Vec::new(), None),
        };
        Ok(ModelInfo {
            id: w.id,
            sha: w.sha,
            private: w.private,
            gated: w.gated,
            architectures,
            model_type,
            safetensors_parameters: w.safetensors.and_then(|s| s.parameters).unwrap_or_default(),
        })
    }

    /// The repository's `config.json` at `revision` (`None`: the default branch). This is where
    /// a gated repository refuses a token without access ([`HubError::GatedNoAccess`]).
    pub async fn model_config(
        &self,
        repo_id: &str,
        revision: Option<&str>,
        token: Option<&str>,
    ) -> Result<Value, HubError> {
        let repo = repo_path(repo_id)?;
        let cred = Credential::bearer(token)?;
        let path = format!(
            "/{repo}/resolve/{}/config.json",
            seg(revision.unwrap_or("main"))
        );
        let reply = self
            .get(Endpoint::ModelConfig, &path, cred.as_ref())
            .await?;
        let v: Value = decode(&reply, "config.json")?;
        if !v.is_object() {
            return Err(HubError::Unexpected(
                "config.json is not a JSON object".into(),
            ));
        }
        Ok(v)
    }

    /// A GET, with retries.
    async fn get(
        &self,
        endpoint: Endpoint,
        path: &str,
        cred: Option<&Credential>,
    ) -> Result<Reply, HubError> {
        let what = format!("GET {path}");
        retry(&self.inner.retry, &what, || async {
            let result = self.get_once(endpoint, path, cred).await;
            let outcome = Outcome::of_result(&result);
            common::metrics::counter_add(
                HUB_REQUESTS,
                "Hugging Face Hub requests sent (retries included) by endpoint and outcome",
                vec![
                    ("endpoint", endpoint.as_str().to_string()),
                    ("outcome", outcome.as_str().to_string()),
                ],
                1.0,
            );
            result
        })
        .await
    }

    async fn get_once(
        &self,
        endpoint: Endpoint,
        path: &str,
        cred: Option<&Credential>,
    ) -> Result<Reply, HubError> {
        let url = format!("{}{path}", self.inner.base);
        let mut req = self.inner.http.get(&url);
        if let Some(c) = cred {
            req = req.header(AUTHORIZATION, c.0.clone());
        }
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        let headers = resp.headers().clone();
        if resp.content_length().is_some_and(|n| n > MAX_BODY as u64) {
            return Err(HubError::Unexpected(format!(
                "HTTP {}: an answer of {} bytes",
                status.as_u16(),
                resp.content_length().unwrap_or_default()
            )));
        }
        let body = resp.bytes().await.map_err(transport)?;
        tracing::debug!(path, status = status.as_u16(), "Hugging Face Hub call");
        if status.is_success() {
            Ok(Reply {
                status,
                body: body.to_vec(),
            })
        } else {
            Err(classify(endpoint, status, &headers, &body, cred.is_some()))
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(reply: &Reply, what: &str) -> Result<T, HubError> {
    serde_json::from_slice(&reply.body).map_err(|e| {
        HubError::Unexpected(format!(
            "HTTP {}: {what} is not the documented shape: {e}",
            reply.status.as_u16()
        ))
    })
}

/// `org/name`, each part escaped. An id that cannot name a repository names none.
fn repo_path(repo_id: &str) -> Result<String, HubError> {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !p.contains("--")
            && !p.contains("..")
    };
    match repo_id.split_once('/') {
        Some((org, name)) if part_ok(org) && part_ok(name) => Ok(format!("{org}/{name}")),
        _ => Err(HubError::RepoNotFound),
    }
}

// A revision such as `refs/pr/1` is one path segment, as `huggingface_hub` sends it.
use crate::digitalocean::seg;

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, code: Option<&str>, message: Option<&str>, body: &str) -> HubError {
        failure(status, code, message, body, Endpoint::ModelInfo, false)
    }

    fn failure(
        status: u16,
        code: Option<&str>,
        message: Option<&str>,
        body: &str,
        endpoint: Endpoint,
        with_token: bool,
    ) -> HubError {
        let mut h = HeaderMap::new();
        if let Some(c) = code {
            h.insert("x-error-code", HeaderValue::from_str(c).unwrap());
        }
        if let Some(m) = message {
            h.insert("x-error-message", HeaderValue::from_str(m).unwrap());
        }
        classify(
            endpoint,
            StatusCode::from_u16(status).unwrap(),
            &h,
            body.as_bytes(),
            with_token,
        )
    }

    #[test]
    fn classifies_as_the_hub_means() {
        assert_eq!(
            answer(
                401,
                Some("RepoNotFound"),
                None,
                r#"{"error":"Repository not found"}"#
            ),
            HubError::RepoNotFound
        );
        assert_eq!(
            answer(404, Some("RepoNotFound"), None, ""),
            HubError::RepoNotFound
        );
        assert_eq!(
            answer(404, Some("RevisionNotFound"), None, ""),
            HubError::RevisionNotFound
        );
        assert_eq!(
            answer(404, Some("EntryNotFound"), None, ""),
            HubError::EntryNotFound
        );
        assert_eq!(
            failure(
                403,
                Some("GatedRepo"),
                None,
                "",
                Endpoint::ModelConfig,
                true
            ),
            HubError::GatedNoAccess { with_token: true }
        );
        assert_eq!(
            failure(
                401,
                Some("GatedRepo"),
                None,
                "",
                Endpoint::ModelConfig,
                false
            ),
            HubError::GatedNoAccess { with_token: false }
        );
        // A bad token, said in the header or only in the body.
        assert_eq!(
            answer(401, None, Some(INVALID_CREDENTIALS), ""),
            HubError::InvalidToken
        );
        assert_eq!(
            answer(
                401,
                None,
                None,
                r#"{"error":"Invalid credentials in Authorization header"}"#
            ),
            HubError::InvalidToken
        );
        // Any other 401 on a repository URL: not found for this caller; on whoami: a bad token.
        assert_eq!(answer(401, None, None, ""), HubError::RepoNotFound);
        assert_eq!(
            failure(401, None, None, "", Endpoint::Whoami, true),
            HubError::InvalidToken
        );

        let limited = answer(429, None, None, "slow down");
        assert_eq!(limited.class(), ErrorClass::TRANSIENT);
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        let with_after = classify(
            Endpoint::ModelInfo,
            StatusCode::TOO_MANY_REQUESTS,
            &h,
            b"",
            false,
        );
        assert_eq!(
            with_after.class(),
            ErrorClass::Transient {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        for s in [500, 502, 503, 504, 408] {
            assert_eq!(
                answer(s, None, None, "").class(),
                ErrorClass::TRANSIENT,
                "{s}"
            );
        }
        let bad = answer(400, None, None, r#"{"error":["a","b"]}"#);
        assert_eq!(bad, HubError::Unexpected("HTTP 400: a; b".into()));
        assert_eq!(bad.class(), ErrorClass::Permanent);
        // A disabled repository is neither missing nor retried.
        assert!(matches!(
            answer(403, None, Some("Access to this resource is disabled."), ""),
            HubError::Unexpected(m) if m.contains("disabled")
        ));
    }

    /// The token is the customer's: the Hub refusing it is the request's fault, not ours.
    #[test]
    fn classes_say_whose_input_was_refused() {
        assert_eq!(HubError::InvalidToken.class(), ErrorClass::Refused);
        for with_token in [false, true] {
            assert_eq!(
                HubError::GatedNoAccess { with_token }.class(),
                ErrorClass::Refused
            );
        }
        for missing in [
            HubError::RepoNotFound,
            HubError::RevisionNotFound,
            HubError::EntryNotFound,
        ] {
            assert_eq!(missing.class(), ErrorClass::NotFound, "{missing}");
        }
        // A Retry-After on an answer that is not transient is no hint of anything.
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        h.insert("x-error-code", HeaderValue::from_static("RepoNotFound"));
        let missing = classify(
            Endpoint::ModelInfo,
            StatusCode::TOO_MANY_REQUESTS,
            &h,
            b"",
            false,
        );
        assert_eq!(missing.class(), ErrorClass::NotFound);
    }

    #[test]
    fn gated_reads_every_wire_form() {
        let g = |s: &str| serde_json::from_str::<Gated>(s).unwrap();
        assert_eq!(g("false"), Gated::No);
        assert_eq!(g("null"), Gated::No);
        assert_eq!(g("\"auto\""), Gated::Auto);
        assert_eq!(g("\"manual\""), Gated::Manual);
        assert_eq!(g("true"), Gated::Manual);
        assert_eq!(g("\"by-invitation\""), Gated::Manual);
    }

    #[test]
    fn repo_ids_and_revisions_are_escaped() {
        assert_eq!(
            repo_path("Qwen/Qwen2.5-7B-Instruct").unwrap(),
            "Qwen/Qwen2.5-7B-Instruct"
        );
        for bad in ["gpt2", "a/b/c", "a/../b", "a/b?x", "a/b c", "/b", "a/"] {
            assert_eq!(repo_path(bad), Err(HubError::RepoNotFound), "{bad}");
        }
        assert_eq!(seg("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(seg("v1.0_rc-2"), "v1.0_rc-2");
    }

    #[test]
    fn tokens_are_never_shown() {
        let c = Credential::bearer(Some("hf_secret_value"))
            .unwrap()
            .unwrap();
        assert!(!format!("{c:?}").contains("secret"));
        assert!(!format!("{:?}", c.0).contains("secret"));
        assert!(Credential::bearer(Some("  ")).unwrap().is_none());
        assert_eq!(
            Credential::bearer(Some("hf_bad\nvalue")).unwrap_err(),
            HubError::InvalidToken
        );
        let client = HubClient::new("http://127.0.0.1:1/").unwrap();
        assert_eq!(client.base_url(), "http://127.0.0.1:1");
        assert!(HubClient::new("ftp://x").is_err());
    }
}
