//! Calls from central to the regional services, over HTTP or HTTPS (trusting `REGION_CA_FILE`)
//! with each region's shared secret: a typed client of the regional API, one method per
//! operation of `openapi/regional.json` (held to it by a test), the only place a region's URL is
//! built.
//!
//! Outcomes are sorted by what central may conclude: `Rejected` means the region answered and
//! refused (nothing changed there); `Unavailable` means central cannot know whether the call took
//! effect (connection refused, timeout, 5xx), so only idempotent retries may follow.

use std::collections::HashMap;
use std::time::Duration;

use api_types::operations::{Method, Operation, PathValue};
use api_types::public::RegionQuotas;
use api_types::regional::{
    Accelerator, CaCertificate, Changes, ChangesQuery, CreateRequest, Event, Page, PageQuery,
    PatchRequest, RecordEnvelope, RegionError, TeamQuery, TeamScoped, Token, TokenCreateRequest,
    SECRET_HEADER,
};
use common::errors::{Classify, ErrorClass};
use serde::de::DeserializeOwned;
use serde::Serialize;
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum RegionCallError {
    /// The catalog offers the region but this process has no address for it.
    #[error("no address is configured for the region")]
    UnknownRegion,
    #[error("region unavailable: {0}")]
    Unavailable(String),
    /// The region answered that it changed nothing because something it asks first (the cloud,
    /// the Hugging Face Hub) did not answer: a retry may work, and nothing is left to settle.
    #[error("region changed nothing, a dependency of it is unavailable: {0}")]
    NotApplied(String),
    #[error("region answered {status} {}: {}", error.id, error.message)]
    Rejected { status: u16, error: RegionError },
}

impl Classify for RegionCallError {
    /// Decided here, from the region's answer (or its absence), once.
    fn class(&self) -> ErrorClass {
        match self {
            // Nothing was sent: a deployment in progress, or a configuration the operator
            // mends; the same request works once this process knows the region.
            RegionCallError::UnknownRegion => ErrorClass::TRANSIENT,
            RegionCallError::Unavailable(_) | RegionCallError::NotApplied(_) => {
                ErrorClass::TRANSIENT
            }
            RegionCallError::Rejected { status, .. } => match status {
                404 => ErrorClass::NotFound,
                409 => ErrorClass::Conflict,
                // The region's own checks refused what the customer asked.
                422 => ErrorClass::Refused,
                // The region refused central itself: a shared secret rotated on one side only.
                401 | 403 => ErrorClass::Unauthorized,
                // Something in front of the region limited the rate.
                429 => ErrorClass::TRANSIENT,
                // A request central should never have sent (a 400 included: central builds
                // every request the region reads), or a status the region does not answer.
                _ => ErrorClass::Permanent,
            },
        }
    }
}

impl RegionCallError {
    /// What the region said, for the customer: the message of its refusal.
    pub fn message(&self) -> Option<&str> {
        match self {
            RegionCallError::Rejected { error, .. } => Some(&error.message),
            _ => None,
        }
    }
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

    // One method per operation of the regional API (`openapi/regional.json`), each with the
    // types of the document; the test below holds the table of operations to the document.

    pub async fn create(
        &self,
        region: &str,
        request: &CreateRequest,
    ) -> Result<RecordEnvelope, RegionCallError> {
        self.send(region, &CREATE, &[], NO_QUERY, Some(request))
            .await
    }

    pub async fn patch(
        &self,
        region: &str,
        id: Uuid,
        request: &PatchRequest,
    ) -> Result<RecordEnvelope, RegionCallError> {
        self.send(region, &PATCH, &[&id], NO_QUERY, Some(request))
            .await
    }

    pub async fn delete(
        &self,
        region: &str,
        id: Uuid,
        query: &TeamScoped,
    ) -> Result<RecordEnvelope, RegionCallError> {
        self.send(region, &DELETE, &[&id], Some(query), NO_BODY)
            .await
    }

    pub async fn accelerators(
        &self,
        region: &str,
        id: Uuid,
        query: &PageQuery,
    ) -> Result<Page<Accelerator>, RegionCallError> {
        self.send(region, &ACCELERATORS, &[&id], Some(query), NO_BODY)
            .await
    }

    pub async fn accelerator(
        &self,
        region: &str,
        id: Uuid,
        accelerator_id: Uuid,
        query: &TeamQuery,
    ) -> Result<Accelerator, RegionCallError> {
        self.send(
            region,
            &ACCELERATOR,
            &[&id, &accelerator_id],
            Some(query),
            NO_BODY,
        )
        .await
    }

    pub async fn ca_certificate(
        &self,
        region: &str,
        id: Uuid,
        query: &TeamQuery,
    ) -> Result<CaCertificate, RegionCallError> {
        self.send(region, &CA_CERTIFICATE, &[&id], Some(query), NO_BODY)
            .await
    }

    pub async fn events(
        &self,
        region: &str,
        id: Uuid,
        query: &PageQuery,
    ) -> Result<Page<Event>, RegionCallError> {
        self.send(region, &EVENTS, &[&id], Some(query), NO_BODY)
            .await
    }

    pub async fn tokens(
        &self,
        region: &str,
        id: Uuid,
        query: &PageQuery,
    ) -> Result<Page<Token>, RegionCallError> {
        self.send(region, &TOKENS, &[&id], Some(query), NO_BODY)
            .await
    }

    pub async fn token_create(
        &self,
        region: &str,
        id: Uuid,
        request: &TokenCreateRequest,
    ) -> Result<Token, RegionCallError> {
        self.send(region, &TOKEN_CREATE, &[&id], NO_QUERY, Some(request))
            .await
    }

    pub async fn token_revoke(
        &self,
        region: &str,
        id: Uuid,
        token_id: Uuid,
        query: &TeamScoped,
    ) -> Result<(), RegionCallError> {
        self.send(
            region,
            &TOKEN_REVOKE,
            &[&id, &token_id],
            Some(query),
            NO_BODY,
        )
        .await
    }

    pub async fn quotas(
        &self,
        region: &str,
        query: &TeamQuery,
    ) -> Result<RegionQuotas, RegionCallError> {
        self.send(region, &QUOTAS, &[], Some(query), NO_BODY).await
    }

    /// Long-polls the region's change feed (on a client whose timeout outlasts the wait).
    pub async fn changes(
        &self,
        region: &str,
        after: i64,
        wait: Duration,
    ) -> Result<Changes, RegionCallError> {
        let query = ChangesQuery {
            after,
            limit: 200,
            wait_ms: wait.as_millis() as u64,
        };
        let request = self.request(&self.long_poll, region, &CHANGES, &[], Some(&query))?;
        answer(&CHANGES, request.send().await).await
    }

    async fn send<Q: Serialize, B: Serialize, T: DeserializeOwned>(
        &self,
        region: &str,
        operation: &Operation,
        path: &[&dyn PathValue],
        query: Option<&Q>,
        body: Option<&B>,
    ) -> Result<T, RegionCallError> {
        let mut request = self.request(&self.http, region, operation, path, query)?;
        request = request.header(common::request_id::HEADER, common::request_id::current());
        let mut trace = reqwest::header::HeaderMap::new();
        common::telemetry::inject(&mut trace);
        request = request.headers(trace);
        if let Some(body) = body {
            request = request.json(body);
        }
        answer(operation, request.send().await).await
    }

    /// The request for `operation` in `region`: its path with `path`'s ids put in its
    /// parameters in order, `query` as its query string, the region's secret.
    fn request<Q: Serialize>(
        &self,
        client: &reqwest::Client,
        region: &str,
        operation: &Operation,
        path: &[&dyn PathValue],
        query: Option<&Q>,
    ) -> Result<reqwest::RequestBuilder, RegionCallError> {
        let r = self
            .by_name
            .get(region)
            .ok_or(RegionCallError::UnknownRegion)?;
        let mut request = client
            .request(
                operation.method.clone(),
                format!("{}{}", r.base_url, operation.path_with(path)),
            )
            .header(SECRET_HEADER, &r.secret);
        if let Some(query) = query {
            request = request.query(query);
        }
        Ok(request)
    }
}

/// The operation's answer, or why there is none (naming the operation).
async fn answer<T: DeserializeOwned>(
    operation: &Operation,
    sent: reqwest::Result<reqwest::Response>,
) -> Result<T, RegionCallError> {
    let answered = match sent {
        Ok(response) => decode(response).await,
        Err(e) => Err(RegionCallError::Unavailable(e.to_string())),
    };
    answered.map_err(|e| match e {
        RegionCallError::Unavailable(why) => {
            RegionCallError::Unavailable(format!("{}: {why}", operation.id))
        }
        other => other,
    })
}

const fn op(id: &'static str, method: Method, path: &'static str) -> Operation {
    Operation::new(id, method, path)
}

const DIS: &str = "/internal/v1/dedicated-inferences";
const CHANGES: Operation = op("changes", Method::GET, "/internal/v1/changes");
const CREATE: Operation = op("create", Method::POST, DIS);
const PATCH: Operation = op(
    "patch",
    Method::PATCH,
    "/internal/v1/dedicated-inferences/{id}",
);
const DELETE: Operation = op(
    "delete",
    Method::DELETE,
    "/internal/v1/dedicated-inferences/{id}",
);
const ACCELERATORS: Operation = op(
    "accelerators",
    Method::GET,
    "/internal/v1/dedicated-inferences/{id}/accelerators",
);
const ACCELERATOR: Operation = op(
    "accelerator",
    Method::GET,
    "/internal/v1/dedicated-inferences/{id}/accelerators/{accelerator_id}",
);
const CA_CERTIFICATE: Operation = op(
    "ca_certificate",
    Method::GET,
    "/internal/v1/dedicated-inferences/{id}/ca",
);
const EVENTS: Operation = op(
    "events",
    Method::GET,
    "/internal/v1/dedicated-inferences/{id}/events",
);
const TOKENS: Operation = op(
    "tokens",
    Method::GET,
    "/internal/v1/dedicated-inferences/{id}/tokens",
);
const TOKEN_CREATE: Operation = op(
    "token_create",
    Method::POST,
    "/internal/v1/dedicated-inferences/{id}/tokens",
);
const TOKEN_REVOKE: Operation = op(
    "token_revoke",
    Method::DELETE,
    "/internal/v1/dedicated-inferences/{id}/tokens/{token_id}",
);
const QUOTAS: Operation = op("quotas", Method::GET, "/internal/v1/quotas");

/// The operations central calls; `get_one` it does not (its change feed tells it every
/// record).
#[cfg(test)]
const CALLED: [&Operation; 12] = [
    &CHANGES,
    &CREATE,
    &PATCH,
    &DELETE,
    &ACCELERATORS,
    &ACCELERATOR,
    &CA_CERTIFICATE,
    &EVENTS,
    &TOKENS,
    &TOKEN_CREATE,
    &TOKEN_REVOKE,
    &QUOTAS,
];

const NO_QUERY: Option<&()> = None;
const NO_BODY: Option<&()> = None;

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

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::operations::{documented, listed};
    use serde_json::Value;

    /// Every operation of the regional API's document is one central calls with the method and
    /// path the document gives, or `get_one`, which it does not need.
    #[test]
    fn the_operations_are_the_documents() {
        let doc: Value =
            serde_json::from_str(include_str!("../../../openapi/regional.json")).unwrap();
        let get_one = op(
            "get_one",
            Method::GET,
            "/internal/v1/dedicated-inferences/{id}",
        );
        let mut called = CALLED.to_vec();
        called.push(&get_one);
        assert_eq!(listed(&called), documented(&doc));
    }

    #[test]
    fn every_failure_has_its_class() {
        let rejected = |status: u16| RegionCallError::Rejected {
            status,
            error: RegionError {
                id: "x".into(),
                message: "no".into(),
            },
        };
        assert_eq!(
            RegionCallError::UnknownRegion.class(),
            ErrorClass::TRANSIENT
        );
        assert_eq!(
            RegionCallError::Unavailable("reset".into()).class(),
            ErrorClass::TRANSIENT
        );
        assert_eq!(
            RegionCallError::NotApplied("hub".into()).class(),
            ErrorClass::TRANSIENT
        );
        assert_eq!(rejected(404).class(), ErrorClass::NotFound);
        assert_eq!(rejected(409).class(), ErrorClass::Conflict);
        assert_eq!(rejected(422).class(), ErrorClass::Refused);
        assert_eq!(rejected(401).class(), ErrorClass::Unauthorized);
        assert_eq!(rejected(403).class(), ErrorClass::Unauthorized);
        assert_eq!(rejected(429).class(), ErrorClass::TRANSIENT);
        for status in [400, 405, 302] {
            assert_eq!(rejected(status).class(), ErrorClass::Permanent, "{status}");
        }
        assert_eq!(rejected(422).message(), Some("no"));
        assert_eq!(RegionCallError::UnknownRegion.message(), None);
    }
}
