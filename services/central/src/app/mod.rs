//! Central's application methods: one per public operation. Each authorises, validates, talks to
//! central's store and the owning region, and returns a `Reply` (status + JSON bytes) so that
//! idempotent replays can return the stored bytes unchanged. Creates (`creates`), writes to an
//! existing DI (`operations`) and reads (`reads`) each have a module; what they share is here.

use std::sync::Arc;
use std::time::Duration;

use api_types::public::{
    AcceleratorInfo, AcceleratorList, AccessToken, CaResponse, CreateRequest, CreateResponse,
    DedicatedInference, DedicatedInferenceEnvelope, EventInfo, EventList, GpuModelConfig,
    GpuModelConfigsResponse, Links, Meta, QuotasResponse, Size, SizeGpu, SizesResponse,
    TokenCreateRequest, TokenEnvelope, TokenList, UpdateRequest,
};
use api_types::regional::{
    self, NewToken, PageQuery, Record, RecordEnvelope, TeamQuery, TeamScoped,
};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use central_store::{
    CreateBegin, CreateState, IdempotencyState, KeyedOperation, NewCreate, ReadModelUpdate,
    SealedAt, StoreError,
};
use common::errors::{Classify, ErrorClass};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use uuid::Uuid;

use crate::auth::Principal;
use crate::body::Parsed;
use crate::error::ApiError;
use crate::regions::RegionCallError;
use crate::{validate, App};

mod creates;
mod operations;
mod reads;

/// A response as bytes: what handlers return and what idempotency records replay.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Vec<u8>,
}

impl Reply {
    fn json<T: Serialize>(status: StatusCode, value: &T) -> Reply {
        Reply {
            status,
            body: serde_json::to_vec(value).expect("response types serialise"),
        }
    }

    fn empty(status: StatusCode) -> Reply {
        Reply {
            status,
            body: Vec::new(),
        }
    }
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        if self.body.is_empty() {
            return self.status.into_response();
        }
        let mut response = (self.status, self.body).into_response();
        response.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// Everything needed to (re-)send a create to its region, sealed at rest in `pending_creates`.
#[derive(Serialize, Deserialize)]
struct CreateIntent {
    request: regional::CreateRequest,
    token_value: String,
}

/// A write to an existing DI as central sends it to the region. Under an Idempotency-Key it is
/// sealed at rest with the key (it may carry a Hugging Face token or a minted token value), so
/// that whoever finds the key unfinished (a retry, recovery after a restart) sends the very same
/// operation again; its operation id makes the region apply it at most once.
#[derive(Serialize, Deserialize)]
struct Operation {
    team_id: Uuid,
    di_id: Uuid,
    region: String,
    kind: OperationKind,
}

#[derive(Serialize, Deserialize)]
enum OperationKind {
    Patch(regional::PatchRequest),
    Delete {
        operation_id: Uuid,
    },
    TokenCreate {
        request: regional::TokenCreateRequest,
        token_value: String,
    },
    TokenRevoke {
        token_id: Uuid,
        operation_id: Uuid,
    },
}

impl Operation {
    fn new(p: &Principal, owned: &central_store::Owned, kind: OperationKind) -> Operation {
        Operation {
            team_id: p.team_id,
            di_id: owned.id,
            region: owned.region.clone(),
            kind,
        }
    }
}

/// Why an operation did not complete.
enum OperationError {
    /// It changed nothing (the region refused it, or central did before calling): a key is
    /// released, so that a retry runs the request afresh.
    Refused(ApiError),
    /// Its outcome is unknown (the region was unreachable or slow, or central failed after the
    /// call): a key keeps the operation, for a retry or recovery to drive again.
    Unsettled(ApiError),
}

impl From<OperationError> for ApiError {
    fn from(e: OperationError) -> ApiError {
        match e {
            OperationError::Refused(e) | OperationError::Unsettled(e) => e,
        }
    }
}

fn region_failure(e: RegionCallError) -> OperationError {
    match e {
        RegionCallError::Rejected { .. } | RegionCallError::NotApplied(_) => {
            OperationError::Refused(region_error(e))
        }
        _ => OperationError::Unsettled(region_error(e)),
    }
}

/// A database failure, passing or not, leaves the outcome unknown (a commit may have landed
/// before the answer was lost); only central's own refusals are known to have changed nothing.
fn store_failure(e: StoreError) -> OperationError {
    match e.class() {
        ErrorClass::Transient { .. } | ErrorClass::Permanent => OperationError::Unsettled(e.into()),
        ErrorClass::Conflict
        | ErrorClass::NotFound
        | ErrorClass::Unauthorized
        | ErrorClass::Refused => OperationError::Refused(e.into()),
    }
}

/// Page parameters, already validated.
#[derive(Debug, Clone, Copy)]
pub struct Paging {
    pub page: i64,
    pub per_page: i64,
}

impl Paging {
    /// The region's query for this page of `team_id`'s things.
    fn of(&self, team_id: Uuid) -> PageQuery {
        PageQuery {
            team_id,
            page: self.page,
            per_page: self.per_page,
            slug: None,
        }
    }
}

/// The region's query for the principal's team.
fn team(p: &Principal) -> TeamQuery {
    TeamQuery { team_id: p.team_id }
}

/// How long a first response is replayed: for an Idempotency-Key, and for an identical create
/// retried without one.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(24 * 3600);
const MANAGED_TOKEN_NAME: &str = "managed";

fn fingerprint(method: &str, path: &str, canonical: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update(b" ");
    h.update(path.as_bytes());
    h.update(b"\n");
    h.update(canonical.as_bytes());
    h.finalize().to_vec()
}

fn response_aad(team_id: Uuid) -> String {
    format!("idempotent-response:{team_id}")
}

/// The answer to a create without a key while another attempt of it is still being sent after
/// the request waited for it: a retry soon finds it done (clients retry a 503, not a 409).
fn busy() -> ApiError {
    ApiError::ServiceUnavailable {
        retry_after_secs: 1,
    }
}

/// The public answer to a failed call to a region: by its class ([`ApiError::of_class`]), with
/// the region's own words for a conflict or a refusal.
fn region_error(e: RegionCallError) -> ApiError {
    let class = e.class();
    match class {
        ErrorClass::Transient { .. } => tracing::warn!(error = %e, "region unavailable"),
        ErrorClass::Unauthorized => tracing::error!(error = %e, "region refused central"),
        _ => {}
    }
    ApiError::of_class(class, e.message().unwrap_or_default().to_string(), e)
}

fn provider_token(
    tokens: Option<&std::collections::BTreeMap<String, String>>,
) -> Result<Option<String>, ApiError> {
    let Some(value) = tokens.and_then(|t| t.get("hugging_face_token")) else {
        return Ok(None);
    };
    check_provider_token(value).map(Some)
}

fn check_provider_token(value: &str) -> Result<String, ApiError> {
    if value.is_empty() || value.len() > 1024 || value.chars().any(char::is_control) {
        return Err(ApiError::Unprocessable(
            "access_tokens.hugging_face_token is not a valid token.".into(),
        ));
    }
    Ok(value.to_string())
}

pub fn check_idempotency_key(key: Option<&str>) -> Result<Option<&str>, ApiError> {
    match key {
        None => Ok(None),
        Some(k) if !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(k))
        }
        Some(_) => Err(ApiError::BadRequest(
            "Idempotency-Key must be 1 to 255 visible ASCII characters.".into(),
        )),
    }
}

/// The read-model row for a region record and its public view.
fn read_model_update<'a>(
    record: &'a Record,
    public: &'a DedicatedInference,
    body: &'a serde_json::Value,
) -> ReadModelUpdate<'a> {
    ReadModelUpdate {
        id: record.id,
        team_id: record.team_id,
        region: &record.region,
        name: &public.name,
        status: record.status.as_str(),
        body: Some(body),
        gone: record.gone,
        seq: record.seq,
    }
}

impl App {
    fn replay(&self, team_id: Uuid, status_code: u16, sealed: &[u8]) -> Result<Reply, ApiError> {
        let body = self
            .sealer
            .open(sealed, response_aad(team_id).as_bytes())
            .map_err(ApiError::internal)?;
        Ok(Reply {
            status: StatusCode::from_u16(status_code).map_err(ApiError::internal)?,
            body,
        })
    }

    /// Opens and decodes a sealed intent. The error says what failed without quoting the
    /// plaintext, which may hold secrets.
    fn open_intent<T: DeserializeOwned>(&self, sealed: &[u8], aad: &str) -> Result<T, String> {
        let plain = self
            .sealer
            .open(sealed, aad.as_bytes())
            .map_err(|_| "cannot be opened".to_string())?;
        serde_json::from_slice(&plain).map_err(|e| {
            format!(
                "cannot be decoded ({:?} error at line {} column {})",
                e.classify(),
                e.line(),
                e.column()
            )
        })
    }

    /// The caller's DI; another team's, an unknown, a pending or a gone one is 404 alike.
    async fn owned(&self, p: &Principal, id: Uuid) -> Result<Arc<central_store::Owned>, ApiError> {
        match self.store.dedicated_inference(id, p.team_id).await? {
            Some(owned) if owned.state == "live" => Ok(owned),
            _ => Err(ApiError::NotFound),
        }
    }

    /// Merges a region record into the read model and returns its public view.
    pub async fn apply(&self, record: &Record) -> Result<DedicatedInference, ApiError> {
        let public = DedicatedInference::from_record(record)
            .ok_or_else(|| ApiError::internal("region returned a DI without spec"))?;
        let body = serde_json::to_value(&public).expect("serialises");
        self.store
            .read_model_apply(&read_model_update(record, &public, &body))
            .await?;
        Ok(public)
    }

    fn links(&self, path: &str, paging: Paging, total: i64, extra: &[(&str, &str)]) -> Links {
        let last = ((total + paging.per_page - 1) / paging.per_page).max(1);
        let url = |page: i64| {
            let mut u = format!(
                "{}{path}?page={page}&per_page={}",
                self.public_url, paging.per_page
            );
            for (k, v) in extra {
                u.push_str(&format!("&{k}={}", urlencode(v)));
            }
            u
        };
        let mut pages = std::collections::BTreeMap::new();
        pages.insert("first".to_string(), url(1));
        pages.insert("last".to_string(), url(last));
        if paging.page > 1 {
            pages.insert("prev".to_string(), url((paging.page - 1).min(last)));
        }
        if paging.page < last {
            pages.insert("next".to_string(), url(paging.page + 1));
        }
        Links { pages }
    }
}

/// What a value stored at `at` was sealed for (its associated data).
pub(crate) fn sealed_aad(at: &SealedAt) -> String {
    match at {
        SealedAt::CreateIntent { di_id } => intent_aad(*di_id),
        SealedAt::CreateResponse { team_id, .. } | SealedAt::KeyResponse { team_id, .. } => {
            response_aad(*team_id)
        }
        SealedAt::KeyOperation { team_id, key } => operation_aad(*team_id, key),
    }
}

fn intent_aad(di_id: Uuid) -> String {
    format!("create-intent:{di_id}")
}

fn operation_aad(team_id: Uuid, key: &str) -> String {
    format!("keyed-operation:{team_id}:{key}")
}

fn key_mismatch() -> ApiError {
    ApiError::Unprocessable(
        "This Idempotency-Key was already used with a different request.".into(),
    )
}

fn key_in_progress() -> ApiError {
    ApiError::Conflict(
        "A request with this Idempotency-Key is still in progress; retry shortly.".into(),
    )
}

fn urlencode(s: &str) -> String {
    serde_urlencoded::to_string([("", s)])
        .map(|e| e.trim_start_matches('=').to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::regional::RegionError;

    fn rejected(status: u16) -> ApiError {
        region_error(RegionCallError::Rejected {
            status,
            error: RegionError {
                id: "x".into(),
                message: "refused".into(),
            },
        })
    }

    /// What a region's refusal becomes for the customer: its own 4xx for what the customer
    /// asked, 503 (retried by clients) when the region refused central itself or was rate
    /// limited, 500 only for a request central should never have sent.
    #[test]
    fn a_region_refusing_central_is_a_503() {
        for status in [401, 403, 429] {
            assert!(
                matches!(rejected(status), ApiError::ServiceUnavailable { .. }),
                "{status}"
            );
        }
        assert!(matches!(rejected(404), ApiError::NotFound));
        assert!(matches!(rejected(422), ApiError::Unprocessable(_)));
        assert!(matches!(rejected(400), ApiError::Internal(_)));
    }

    /// Every way a region call fails keeps its answer: the region's words for a conflict or a
    /// refusal, a 503 with central's Retry-After for anything that passes, a 500 for the rest.
    #[test]
    fn every_region_failure_keeps_its_answer() {
        let unavailable = |e: ApiError| {
            matches!(
                e,
                ApiError::ServiceUnavailable {
                    retry_after_secs: crate::error::RETRY_AFTER_SECS
                }
            )
        };
        assert!(unavailable(region_error(RegionCallError::UnknownRegion)));
        assert!(unavailable(region_error(RegionCallError::Unavailable(
            "timed out".into()
        ))));
        assert!(unavailable(region_error(RegionCallError::NotApplied(
            "the Hub did not answer".into()
        ))));
        for status in [401, 403, 429] {
            assert!(unavailable(rejected(status)), "{status}");
        }
        assert!(matches!(rejected(409), ApiError::Conflict(m) if m == "refused"));
        assert!(matches!(rejected(422), ApiError::Unprocessable(m) if m == "refused"));
        for status in [400, 405, 410, 302] {
            assert!(
                matches!(rejected(status), ApiError::Internal(d) if d.contains(&status.to_string())),
                "{status}"
            );
        }
    }

    /// Whether a failed operation keeps its key: only a database failure leaves the outcome
    /// unknown.
    #[test]
    fn only_database_failures_leave_an_operation_unsettled() {
        use central_store::sqlx;
        let unsettled = |e: StoreError| matches!(store_failure(e), OperationError::Unsettled(_));
        assert!(unsettled(StoreError::Unavailable(
            sqlx::Error::PoolTimedOut
        )));
        assert!(unsettled(StoreError::Database(sqlx::Error::RowNotFound)));
        assert!(!unsettled(StoreError::NameTaken));
        assert!(!unsettled(StoreError::NotFound));
    }
}
