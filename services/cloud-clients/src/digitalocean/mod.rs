//! A client for the subset of DigitalOcean's public API the workers use: VPCs, DOKS clusters
//! (with their kubeconfig), node pools and nodes, and load balancers.
//!
//! Every call is retried on transient failures per [`RetryConfig`]; every attempt of a mutating
//! call (POST, PUT, DELETE) is counted, so tests can assert that a second reconcile pass over an
//! unchanged spec writes nothing; every attempt is also counted in the Prometheus registry by
//! method and outcome ([`crate::metrics`]). The token is sent as a sensitive header and never
//! logged.
//!
//! This module holds the client, its transport settings, and how one call is sent, retried,
//! counted and decoded. The endpoints' methods are in `endpoints`, errors and their classes in
//! `error`, and the API's request and response shapes in `types`.

mod endpoints;
mod error;
mod types;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::metrics::{self, Outcome};
use crate::retry::{retry, RetryConfig};

use error::error_from_response;
pub use error::DoError;
pub use types::{
    Cluster, ClusterCreateRequest, ClusterCredentials, ClusterState, ClusterStatus, ForwardingRule,
    LoadBalancer, MaintenancePolicy, Node, NodePool, NodePoolCreateRequest, NodePoolUpdateRequest,
    NodeState, NodeStatus, RegionRef, Taint, Vpc,
};

/// Largest page DigitalOcean serves.
const MAX_PER_PAGE: usize = 200;
/// A bound on pages followed in one list, against a server that never stops paginating.
const MAX_PAGES: usize = 1000;

/// Transport settings of a [`DoClient`].
#[derive(Debug, Clone)]
pub struct DoClientOptions {
    /// Whole-request timeout (connect, send, receive).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub retry: RetryConfig,
    pub user_agent: String,
    /// `per_page` of list calls (1..=200; DigitalOcean's maximum is the sensible value).
    pub page_size: usize,
}

impl Default for DoClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retry: RetryConfig::default(),
            user_agent: concat!("di-control-plane/", env!("CARGO_PKG_VERSION")).to_string(),
            page_size: MAX_PER_PAGE,
        }
    }
}

struct Inner {
    http: reqwest::Client,
    base: String,
    retry: RetryConfig,
    page_size: usize,
    mutations: AtomicU64,
}

/// The header with which the platform's credential acts for one customer account (a team: a
/// DigitalOcean team is an account, with the same UUID). The API then answers as that account
/// sees it: its own VPCs only, its default VPC made on first use.
pub const ACTING_ACCOUNT_HEADER: &str = "x-acting-account";

/// A DigitalOcean API client for one account token. Cheap to clone; clones share the connection
/// pool and the mutation counter.
#[derive(Clone)]
pub struct DoClient {
    inner: Arc<Inner>,
    /// The customer account this client acts for ([`DoClient::acting_for`]); none: the
    /// credential's own.
    account: Option<uuid::Uuid>,
}

impl fmt::Debug for DoClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the token.
        f.debug_struct("DoClient")
            .field("base_url", &self.inner.base)
            .field("account", &self.account)
            .field("retry", &self.inner.retry)
            .finish_non_exhaustive()
    }
}

/// A successful response, read in full.
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
}

impl DoClient {
    /// A client for `base_url` (e.g. `https://api.digitalocean.com`; paths start with `/v2`)
    /// with default timeouts and retries.
    pub fn new(base_url: &str, token: &str) -> Result<DoClient, DoError> {
        Self::with_options(base_url, token, DoClientOptions::default())
    }

    pub fn with_options(
        base_url: &str,
        token: &str,
        options: DoClientOptions,
    ) -> Result<DoClient, DoError> {
        let base = base_url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base)
            .map_err(|e| DoError::Config(format!("base URL {base:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(DoError::Config(format!(
                "base URL {base:?}: scheme must be http or https"
            )));
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", token.trim()))
            .map_err(|_| DoError::Config("the token contains invalid characters".into()))?;
        auth.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, auth);
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .user_agent(options.user_agent)
            .timeout(options.timeout)
            .connect_timeout(options.connect_timeout)
            .build()
            .map_err(|e| DoError::Config(format!("HTTP client: {e}")))?;
        Ok(DoClient {
            inner: Arc::new(Inner {
                http,
                base,
                retry: options.retry,
                page_size: options.page_size.clamp(1, MAX_PER_PAGE),
                mutations: AtomicU64::new(0),
            }),
            account: None,
        })
    }

    /// This client acting for customer `account`: what that account may see and do, with the
    /// platform's credential (e.g. whether a team owns a VPC). Shares the connection pool.
    pub fn acting_for(&self, account: uuid::Uuid) -> DoClient {
        DoClient {
            inner: self.inner.clone(),
            account: Some(account),
        }
    }

    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// Mutating requests (POST, PUT, DELETE) sent by this client and its clones, counting every
    /// attempt, retries included (which is also how DigitalOcean and the simulator count them).
    pub fn mutating_calls(&self) -> u64 {
        self.inner.mutations.load(Ordering::SeqCst)
    }

    /// One attempt, counted in [`metrics::DO_REQUESTS`].
    async fn send_once(
        &self,
        method: &Method,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Reply, DoError> {
        let result = self.request(method, path, body).await;
        metrics::digitalocean(method.as_str(), Outcome::of_result(&result));
        result
    }

    async fn request(
        &self,
        method: &Method,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Reply, DoError> {
        let url = format!("{}{path}", self.inner.base);
        let mut req = self.inner.http.request(method.clone(), &url);
        if let Some(account) = self.account {
            req = req.header(ACTING_ACCOUNT_HEADER, account.to_string());
        }
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_vec());
        }
        if *method != Method::GET && *method != Method::HEAD {
            self.inner.mutations.fetch_add(1, Ordering::SeqCst);
        }
        let resp = req.send().await.map_err(DoError::Transport)?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.map_err(DoError::Transport)?;
        tracing::debug!(%method, path, status = status.as_u16(), "DigitalOcean API call");
        if status.is_success() {
            Ok(Reply {
                status,
                body: bytes.to_vec(),
            })
        } else {
            Err(error_from_response(status, &headers, &bytes))
        }
    }

    /// With retries.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Reply, DoError> {
        let what = format!("{method} {path}");
        retry(&self.inner.retry, &what, || {
            self.send_once(&method, path, body.as_deref())
        })
        .await
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
        key: &str,
    ) -> Result<T, DoError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| DoError::Config(format!("request body: {e}")))?;
        let reply = self.send(method, path, body).await?;
        decode_key(&reply, key)
    }

    async fn get<T: DeserializeOwned>(&self, path: &str, key: &str) -> Result<T, DoError> {
        self.json(Method::GET, path, None::<&()>, key).await
    }

    async fn no_content(&self, method: Method, path: &str) -> Result<(), DoError> {
        self.send(method, path, None).await.map(|_| ())
    }

    /// Follows DigitalOcean pagination (`page`/`per_page`, `links.pages.next`).
    async fn list_all<T: DeserializeOwned>(
        &self,
        path: &str,
        key: &str,
    ) -> Result<Vec<T>, DoError> {
        let mut out = Vec::new();
        for page in 1..=MAX_PAGES {
            let reply = self
                .send(
                    Method::GET,
                    &format!("{path}?page={page}&per_page={}", self.inner.page_size),
                    None,
                )
                .await?;
            let v: Value = decode(&reply)?;
            let items: Vec<T> = match v.get(key) {
                Some(items) => {
                    serde_json::from_value(items.clone()).map_err(|e| DoError::Decode {
                        status: reply.status.as_u16(),
                        detail: format!("{key}: {e}"),
                    })?
                }
                None => {
                    return Err(DoError::Decode {
                        status: reply.status.as_u16(),
                        detail: format!("missing {key:?}"),
                    })
                }
            };
            let n = items.len();
            out.extend(items);
            let has_next = v
                .pointer("/links/pages/next")
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty());
            if !has_next || n == 0 {
                break;
            }
        }
        Ok(out)
    }
}

fn decode<T: DeserializeOwned>(reply: &Reply) -> Result<T, DoError> {
    serde_json::from_slice(&reply.body).map_err(|e| DoError::Decode {
        status: reply.status.as_u16(),
        detail: e.to_string(),
    })
}

fn decode_key<T: DeserializeOwned>(reply: &Reply, key: &str) -> Result<T, DoError> {
    let mut v: Value = decode(reply)?;
    let item = v
        .get_mut(key)
        .map(Value::take)
        .ok_or_else(|| DoError::Decode {
            status: reply.status.as_u16(),
            detail: format!("missing {key:?}"),
        })?;
    serde_json::from_value(item).map_err(|e| DoError::Decode {
        status: reply.status.as_u16(),
        detail: format!("{key}: {e}"),
    })
}

/// Percent-encodes a path segment (ids are UUIDs, but a stray `/` or `?` must not change the
/// route).
pub(crate) fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_escaped() {
        assert_eq!(seg("5f0e-ab_c.d~"), "5f0e-ab_c.d~");
        assert_eq!(seg("a/b?c"), "a%2Fb%3Fc");
    }

    #[test]
    fn debug_never_shows_the_token() {
        let c = DoClient::new("http://127.0.0.1:1", "dop_v1_secret_value").unwrap();
        assert!(!format!("{c:?}").contains("secret_value"));
    }
}
