//! Calls from central to the regional services, over HTTP or HTTPS (trusting `REGION_CA_FILE`)
//! with each region's shared secret.
//!
//! Outcomes are sorted by what central may conclude: `Rejected` means the region answered and
//! refused (nothing changed there); `Unavailable` means central cannot know whether the call took
//! effect (connection refused, timeout, 5xx), so only idempotent retries may follow.

use std::collections::HashMap;
use std::time::Duration;

use api_types::regional::{RegionError, SECRET_HEADER};
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;

#[derive(Debug)]
pub enum RegionCallError {
    UnknownRegion,
    Unavailable(String),
    /// The region answered that it changed nothing because something it asks first (the cloud,
    /// the Hugging Face Hub) did not answer: a retry may work, and nothing is left to settle.
    NotApplied(String),
    Rejected {
        status: u16,
        error: RegionError,
    },
}

#[derive(Clone)]
pub struct Region {
    pub name: String,
    base_url: String,
    secret: String,
}

#[derive(Clone)]
pub struct Regions {
    http: reqwest::Client,
    long_poll: reqwest::Client,
    by_name: HashMap<String, Region>,
}

impl Regions {
    /// `endpoints`: region name → (base URL, shared secret). `roots`: CAs trusted for the
    /// regions' certificates besides the public roots.
    pub fn new(
        endpoints: Vec<(String, String, String)>,
        timeout: Duration,
        roots: &[reqwest::Certificate],
    ) -> anyhow::Result<Regions> {
        let client = |timeout| {
            roots
                .iter()
                .fold(reqwest::Client::builder(), |b, root| {
                    b.add_root_certificate(root.clone())
                })
                .connect_timeout(Duration::from_secs(2))
                .timeout(timeout)
                .build()
        };
        let http = client(timeout)?;
        let long_poll = client(Duration::from_secs(40))?;
        let by_name = endpoints
            .into_iter()
            .map(|(name, base_url, secret)| {
                (
                    name.clone(),
                    Region {
                        name,
                        base_url: base_url.trim_end_matches('/').to_string(),
                        secret,
                    },
                )
            })
            .collect();
        Ok(Regions {
            http,
            long_poll,
            by_name,
        })
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_name.keys().cloned().collect();
        names.sort();
        names
    }

    pub async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        region: &str,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, RegionCallError> {
        let r = self
            .by_name
            .get(region)
            .ok_or(RegionCallError::UnknownRegion)?;
        let mut request = self
            .http
            .request(method, format!("{}{path}", r.base_url))
            .header(SECRET_HEADER, &r.secret);
        request = request.header(common::request_id::HEADER, common::request_id::current());
        let mut trace = reqwest::header::HeaderMap::new();
        common::telemetry::inject(&mut trace);
        request = request.headers(trace);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| RegionCallError::Unavailable(e.to_string()))?;
        decode(response).await
    }

    /// Long-polls the region's change feed.
    pub async fn changes(
        &self,
        region: &str,
        after: i64,
        wait: Duration,
    ) -> Result<api_types::regional::Changes, RegionCallError> {
        let r = self
            .by_name
            .get(region)
            .ok_or(RegionCallError::UnknownRegion)?;
        let url = format!(
            "{}/internal/v1/changes?after={after}&limit=200&wait_ms={}",
            r.base_url,
            wait.as_millis()
        );
        let response = self
            .long_poll
            .get(url)
            .header(SECRET_HEADER, &r.secret)
            .send()
            .await
            .map_err(|e| RegionCallError::Unavailable(e.to_string()))?;
        decode(response).await
    }
}

/// The certificates of the PEM bundle at `path` (`REGION_CA_FILE`).
pub fn roots(path: &std::path::Path) -> anyhow::Result<Vec<reqwest::Certificate>> {
    use anyhow::Context;
    let pem = std::fs::read(path)
        .with_context(|| format!("reading REGION_CA_FILE {}", path.display()))?;
    let roots = reqwest::Certificate::from_pem_bundle(&pem)
        .with_context(|| format!("REGION_CA_FILE {} is not a PEM bundle", path.display()))?;
    anyhow::ensure!(
        !roots.is_empty(),
        "REGION_CA_FILE {} holds no certificate",
        path.display()
    );
    Ok(roots)
}

async fn decode<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, RegionCallError> {
    let status = response.status();
    if status.is_success() {
        if status == reqwest::StatusCode::NO_CONTENT {
            return serde_json::from_value(serde_json::Value::Null).map_err(|e| {
                RegionCallError::Unavailable(format!("decoding empty region answer: {e}"))
            });
        }
        return response
            .json::<T>()
            .await
            .map_err(|e| RegionCallError::Unavailable(format!("decoding region answer: {e}")));
    }
    if status.is_server_error() {
        let error = response.json::<RegionError>().await.ok();
        return Err(match error {
            Some(e) if e.id == api_types::regional::DEPENDENCY_UNAVAILABLE => {
                RegionCallError::NotApplied(e.message)
            }
            _ => RegionCallError::Unavailable(format!("region answered {status}")),
        });
    }
    let error = response
        .json::<RegionError>()
        .await
        .unwrap_or_else(|_| RegionError {
            id: "unknown".into(),
            message: format!("region answered {status}"),
        });
    Err(RegionCallError::Rejected {
        status: status.as_u16(),
        error,
    })
}
