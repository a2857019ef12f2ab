//! The HTTP client: bearer auth, retries that are safe (transport errors on idempotent or keyed
//! requests, 429/503 after `Retry-After`), and the mapping of answers to `Failure`s.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::Failure;

/// Retries after 429/503 before giving up.
const BUSY_RETRIES: u32 = 4;
/// Attempts when the API cannot be reached at all.
const TRANSPORT_ATTEMPTS: u32 = 3;
/// The longest `Retry-After` we honour; a longer one is capped.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// Page size for the list endpoints (the API's maximum). `DICTL_PER_PAGE` lowers it, so tests
/// can cross page boundaries with a few items.
const PER_PAGE: usize = 200;

pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    per_page: usize,
}

/// A successful answer: the parsed JSON body (`Null` when empty) and its text exactly as sent,
/// for `--output json`.
pub struct Answer {
    pub body: Value,
    pub raw: String,
}

impl Client {
    pub fn new(base: &str, token: String) -> Result<Client, Failure> {
        let base = base.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Failure::Usage(format!(
                "--api-url must start with http:// or https:// (got {base:?})"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(60))
            .user_agent(concat!("dictl/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Failure::Unreachable(format!("cannot build the HTTP client: {e}")))?;
        let per_page = std::env::var("DICTL_PER_PAGE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=PER_PAGE).contains(n))
            .unwrap_or(PER_PAGE);
        Ok(Client {
            http,
            base,
            token,
            per_page,
        })
    }

    pub async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Value, Failure> {
        Ok(self.fetch(path, query).await?.body)
    }

    pub async fn fetch(&self, path: &str, query: &[(&str, String)]) -> Result<Answer, Failure> {
        self.send(Method::GET, path, query, None, None).await
    }

    /// Sends a state-changing request with a fresh `Idempotency-Key`, reused by every retry.
    pub async fn write(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, Failure> {
        let key = uuid::Uuid::new_v4().to_string();
        self.send(method, path, &[], body, Some(&key)).await
    }

    /// Fetches every page of a paginated list and returns the items under `field` plus the
    /// total the API reported.
    pub async fn get_all(
        &self,
        path: &str,
        field: &str,
        query: &[(&str, String)],
    ) -> Result<(Vec<Value>, i64), Failure> {
        let mut items = Vec::new();
        let mut total = 0;
        for page in 1.. {
            let mut q = query.to_vec();
            q.push(("page", page.to_string()));
            q.push(("per_page", self.per_page.to_string()));
            let body = self.get(path, &q).await?;
            total = body["meta"]["total"].as_i64().unwrap_or(0);
            let batch = body[field].as_array().cloned().unwrap_or_default();
            let short = batch.len() < self.per_page;
            items.extend(batch);
            if short || items.len() as i64 >= total {
                break;
            }
        }
        Ok((items, total))
    }

    /// One page of a list: the items under `field` and the reported total.
    pub async fn page(
        &self,
        path: &str,
        field: &str,
        page: usize,
    ) -> Result<(Vec<Value>, usize), Failure> {
        let q = [
            ("page", page.to_string()),
            ("per_page", self.per_page.to_string()),
        ];
        let body = self.get(path, &q).await?;
        let total = body["meta"]["total"].as_u64().unwrap_or(0) as usize;
        Ok((body[field].as_array().cloned().unwrap_or_default(), total))
    }

    pub fn per_page(&self) -> usize {
        self.per_page
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        idempotency_key: Option<&str>,
    ) -> Result<Answer, Failure> {
        let url = format!("{}{path}", self.base);
        let mut busy = 0;
        let mut transport = 0;
        loop {
            let mut req = self
                .http
                .request(method.clone(), &url)
                .bearer_auth(&self.token)
                .header("accept", "application/json");
            if !query.is_empty() {
                req = req.query(query);
            }
            if let Some(key) = idempotency_key {
                req = req.header("idempotency-key", key);
            }
            if let Some(body) = body {
                req = req.json(body);
            }
            let response = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    transport += 1;
                    // Safe to repeat: GETs are reads, every write carries its Idempotency-Key.
                    if transport < TRANSPORT_ATTEMPTS && (e.is_connect() || e.is_timeout()) {
                        tokio::time::sleep(Duration::from_millis(300 * (1 << transport))).await;
                        continue;
                    }
                    return Err(Failure::Unreachable(format!(
                        "cannot reach the API at {}: {}",
                        self.base,
                        describe(&e)
                    )));
                }
            };
            let status = response.status();
            if (status == StatusCode::TOO_MANY_REQUESTS
                || status == StatusCode::SERVICE_UNAVAILABLE)
                && busy < BUSY_RETRIES
            {
                busy += 1;
                let wait = retry_after(response.headers()).unwrap_or(Duration::from_secs(1));
                eprintln!(
                    "dictl: the API answered {} ; retrying in {}s ({busy}/{BUSY_RETRIES})",
                    status.as_u16(),
                    wait.as_secs().max(1)
                );
                tokio::time::sleep(wait).await;
                continue;
            }
            let header_request_id = response
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let bytes = match response.bytes().await {
                Ok(b) => b,
                Err(e) => {
                    return Err(Failure::Unreachable(format!(
                        "the API's answer was cut off: {}",
                        describe(&e)
                    )))
                }
            };
            let parsed: Option<Value> = if bytes.is_empty() {
                Some(Value::Null)
            } else {
                serde_json::from_slice(&bytes).ok()
            };
            if status.is_success() {
                let body = parsed.ok_or_else(|| Failure::Api {
                    status: status.as_u16(),
                    id: "invalid_response".into(),
                    message: "the API answered with something that is not JSON".into(),
                    request_id: header_request_id.clone().unwrap_or_default(),
                })?;
                return Ok(Answer {
                    body,
                    raw: String::from_utf8_lossy(&bytes).into_owned(),
                });
            }
            let body = parsed.unwrap_or(Value::Null);
            let text = |v: &Value| v.as_str().map(str::to_owned);
            return Err(Failure::Api {
                status: status.as_u16(),
                id: text(&body["id"])
                    .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").into()),
                message: text(&body["message"]).unwrap_or_else(|| {
                    let raw = String::from_utf8_lossy(&bytes);
                    let raw = raw.trim();
                    if raw.is_empty() {
                        format!("HTTP {}", status.as_u16())
                    } else {
                        raw.chars().take(500).collect()
                    }
                }),
                request_id: text(&body["request_id"])
                    .or(header_request_id)
                    .unwrap_or_default(),
            });
        }
    }
}

/// `Retry-After` in seconds (the API's form), capped.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let secs: u64 = headers
        .get("retry-after")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// The innermost cause of a transport error (reqwest's own message is generic).
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text = s.to_string();
        source = s.source();
    }
    text
}
