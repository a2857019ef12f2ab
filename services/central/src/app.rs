//! Central's application methods: one per public operation. Each authorises, validates, talks to
//! central's store and the owning region, and returns a `Reply` (status + JSON bytes) so that
//! idempotent replays can return the stored bytes unchanged.

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
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use uuid::Uuid;

use crate::auth::Principal;
use crate::body::Parsed;
use crate::error::{ApiError, RETRY_AFTER_SECS};
use crate::regions::RegionCallError;
use crate::{validate, App};

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

/// A database failure leaves the outcome unknown (a commit may have landed before the answer
/// was lost); only central's own refusals are known to have changed nothing.
fn store_failure(e: StoreError) -> OperationError {
    match e {
        StoreError::Database(_) | StoreError::Unavailable(_) => OperationError::Unsettled(e.into()),
        _ => OperationError::Refused(e.into()),
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

fn region_error(e: RegionCallError) -> ApiError {
    match e {
        RegionCallError::UnknownRegion => ApiError::ServiceUnavailable {
            retry_after_secs: RETRY_AFTER_SECS,
        },
        RegionCallError::Unavailable(detail) => {
            tracing::warn!(%detail, "region unavailable");
            ApiError::ServiceUnavailable {
                retry_after_secs: RETRY_AFTER_SECS,
            }
        }
        RegionCallError::NotApplied(detail) => {
            tracing::warn!(%detail, "region changed nothing: a dependency of it is unavailable");
            ApiError::ServiceUnavailable {
                retry_after_secs: RETRY_AFTER_SECS,
            }
        }
        RegionCallError::Rejected { status, error } => match status {
            404 => ApiError::NotFound,
            409 => ApiError::Conflict(error.message),
            422 => ApiError::Unprocessable(error.message),
            400 => ApiError::internal(format!(
                "region refused central's request: {}",
                error.message
            )),
            _ => ApiError::internal(format!("region answered {status}: {}", error.message)),
        },
    }
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
    // -----------------------------------------------------------------------------------------
    // Create

    pub async fn create(
        &self,
        p: &Principal,
        key: Option<&str>,
        parsed: Parsed<CreateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:create")?;
        let req = parsed.value;
        let checked = validate::spec(&self.catalog, &req.spec)?;
        let hf = provider_token(req.access_tokens.as_ref().or(req.secrets.as_ref()))?;
        if checked.gated && hf.is_none() {
            return Err(ApiError::Unprocessable(
                "access_tokens.hugging_face_token is required: the model is gated on Hugging Face."
                    .into(),
            ));
        }
        let fp = fingerprint("POST", "/v2/dedicated-inferences", &parsed.canonical);
        let di_id = Uuid::new_v4();
        let token_value = common::tokens::mint(common::tokens::ENDPOINT_TOKEN_PREFIX);
        let mut spec = checked.spec;
        spec.version = 1;
        let intent = CreateIntent {
            request: regional::CreateRequest {
                id: di_id,
                team_id: p.team_id,
                spec,
                hugging_face_token: hf,
                managed_token: NewToken {
                    id: Uuid::new_v4(),
                    name: MANAGED_TOKEN_NAME.into(),
                    sha256_hex: common::tokens::sha256_hex(&token_value),
                },
            },
            token_value,
        };
        let sealed = self.sealer.seal(
            &serde_json::to_vec(&intent).expect("intent serialises"),
            intent_aad(di_id).as_bytes(),
        );
        // A retry of this very request may find the create it repeats refused meanwhile (its
        // first attempt was answered "changed nothing" while this one waited for it): the
        // name is free again, and this request then starts afresh, once.
        for afresh in [false, true] {
            let begun = self
                .store
                .create_begin(&NewCreate {
                    di_id,
                    team_id: p.team_id,
                    region: &intent.request.spec.region,
                    name: &intent.request.spec.name,
                    fingerprint: &fp,
                    sealed_intent: &sealed,
                    idempotency_key: key,
                })
                .await;
            let repeated = match begun {
                Ok(CreateBegin::Started) => {
                    return self
                        .drive_create(di_id, p.team_id, self.drive_lease, busy)
                        .await
                }
                Ok(CreateBegin::KeyTaken) => match self
                    .store
                    .idempotency_state(p.team_id, key.unwrap_or_default(), &fp)
                    .await?
                {
                    IdempotencyState::Done {
                        status_code,
                        sealed_body,
                    } => return self.replay(p.team_id, status_code, &sealed_body),
                    IdempotencyState::Mismatch => return Err(key_mismatch()),
                    IdempotencyState::Erased { .. } => {
                        return Err(ApiError::Conflict(
                            "The dedicated inference this request created has been deleted \
                             since; send a new request to create another."
                                .into(),
                        ))
                    }
                    IdempotencyState::Unfinished {
                        di_id: Some(id), ..
                    } => (
                        id,
                        self.drive_create(id, p.team_id, self.drive_lease, key_in_progress)
                            .await,
                    ),
                    IdempotencyState::Unfinished { di_id: None, .. } | IdempotencyState::Fresh => {
                        return Err(key_in_progress())
                    }
                },
                Err(StoreError::NameTaken) => {
                    // The same request again, from a client that may never have got the answer
                    // (a timeout, a 503 that recovery then settled): finish that create, or
                    // replay its response with the token, rather than refuse the retry.
                    match self
                        .store
                        .create_by_fingerprint(
                            p.team_id,
                            &intent.request.spec.name,
                            &fp,
                            REPLAY_WINDOW,
                        )
                        .await?
                    {
                        Some(id) => (
                            id,
                            self.drive_create(id, p.team_id, self.drive_lease, busy)
                                .await,
                        ),
                        None => return Err(StoreError::NameTaken.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            };
            match repeated {
                (id, Err(_)) if !afresh && self.store.create_state(id).await?.is_none() => continue,
                (_, driven) => return driven,
            }
        }
        unreachable!("the second round returns")
    }

    /// Settles a create and answers with its response. A pending create is sent to its region
    /// (idempotent there) and confirmed with the region's view, or aborted when the region
    /// refuses it or its intent cannot be read; a settled one replays its first response. Used by
    /// the request path, by retries, and by recovery after a crash.
    /// Sends pending create `di_id` to its region and settles it, or answers with how it was
    /// settled. While another driver is sending it, waits up to `patience` for that attempt to
    /// end, then answers `busy`.
    pub async fn drive_create(
        &self,
        di_id: Uuid,
        team_id: Uuid,
        patience: Duration,
        busy: impl FnOnce() -> ApiError,
    ) -> Result<Reply, ApiError> {
        // One attempt at a time (a request, a retry, recovery, on any replica): the region's
        // "changed nothing" settles the create only because no other attempt of it can be in
        // flight and land after it (found by the soak: recovery's attempt landed while the
        // request's was told nothing changed, and the retry then found its name taken).
        let give_up = tokio::time::Instant::now() + patience;
        while !self
            .store
            .create_drive_begin(di_id, self.drive_lease)
            .await?
        {
            // Settled (its answer is replayed, nothing is sent), or being sent right now.
            if !matches!(
                self.store.create_state(di_id).await?,
                Some(CreateState::Pending { .. })
            ) {
                return self.drive_create_once(di_id, team_id).await;
            }
            if tokio::time::Instant::now() >= give_up {
                return Err(busy());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A task of its own: a client that goes away does not cut the attempt, or the giving
        // back of the drive, short (that would hold other drivers off until it lapses).
        let app = self.clone();
        let drive = async move {
            let driven = app.drive_create_once(di_id, team_id).await;
            if let Err(e) = app.store.create_drive_end(di_id).await {
                tracing::warn!(%di_id, error = %e, "giving a create's drive back failed; it lapses");
            }
            driven
        };
        tokio::spawn(drive.instrument(tracing::Span::current()))
            .await
            .map_err(ApiError::internal)?
    }

    async fn drive_create_once(&self, di_id: Uuid, team_id: Uuid) -> Result<Reply, ApiError> {
        let sealed = match self.store.create_state(di_id).await? {
            Some(CreateState::Pending {
                team_id: owner,
                sealed_intent,
            }) if owner == team_id => sealed_intent,
            Some(CreateState::Settled {
                team_id: owner,
                status_code,
                sealed_response,
            }) if owner == team_id => return self.replay(team_id, status_code, &sealed_response),
            Some(_) => return Err(ApiError::NotFound),
            None => {
                return Err(ApiError::Conflict(
                    "The create this request repeats was refused meanwhile; send it again.".into(),
                ))
            }
        };
        let intent: CreateIntent = match self.open_intent(&sealed, &intent_aad(di_id)) {
            Ok(intent) => intent,
            Err(problem) => {
                // Nothing can ever send it: settle it as failed rather than retry it forever.
                tracing::warn!(%di_id, "a pending create's intent {problem}; settling it as failed");
                self.store.create_abort(di_id).await?;
                return Err(ApiError::internal(format!("create intent {problem}")));
            }
        };
        let answer = self
            .regions
            .create(&intent.request.spec.region, &intent.request)
            .await;
        match answer {
            Ok(RecordEnvelope { record }) => {
                let public = DedicatedInference::from_record(&record)
                    .ok_or_else(|| ApiError::internal("region returned a DI without spec"))?;
                let body = CreateResponse {
                    token: AccessToken {
                        id: intent.request.managed_token.id,
                        name: intent.request.managed_token.name.clone(),
                        value: Some(intent.token_value.clone()),
                        created_at: record.created_at,
                        is_managed: true,
                    },
                    dedicated_inference: public,
                };
                let reply = Reply::json(StatusCode::ACCEPTED, &body);
                let body_value =
                    serde_json::to_value(&body.dedicated_inference).expect("serialises");
                let update = read_model_update(&record, &body.dedicated_inference, &body_value);
                let sealed_reply = self
                    .sealer
                    .seal(&reply.body, response_aad(team_id).as_bytes());
                self.store
                    .create_confirm(&update, reply.status.as_u16(), &sealed_reply)
                    .await?;
                Ok(reply)
            }
            Err(RegionCallError::Rejected { status, error }) if (400..500).contains(&status) => {
                self.store.create_abort(di_id).await?;
                Err(region_error(RegionCallError::Rejected { status, error }))
            }
            // Nothing was stored: the create is over (the customer's retry starts afresh), not
            // one for recovery to finish behind a 503.
            Err(e @ RegionCallError::NotApplied(_)) => {
                self.store.create_abort(di_id).await?;
                Err(region_error(e))
            }
            Err(e) => Err(region_error(e)),
        }
    }

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

    /// Runs `operation`; under an Idempotency-Key at most once: a stored response is replayed, a
    /// reused key with another body refused, and otherwise the key's operation (this one, or the
    /// one a first request stored and did not finish) is driven to its end in a task of its own,
    /// so that a client that disconnects cannot cut it off half-way.
    async fn idempotent(
        &self,
        key: Option<&str>,
        fp: Vec<u8>,
        operation: Operation,
    ) -> Result<Reply, ApiError> {
        let Some(key) = key else {
            return Ok(self.run_operation(&operation).await?);
        };
        let team_id = operation.team_id;
        let sealed = self.sealer.seal(
            &serde_json::to_vec(&operation).expect("operations serialise"),
            operation_aad(team_id, key).as_bytes(),
        );
        let mut state = self
            .store
            .idempotency_begin(
                team_id,
                key,
                &fp,
                Some(KeyedOperation {
                    di_id: operation.di_id,
                    sealed: &sealed,
                }),
            )
            .await?;
        // A retry while another attempt of the operation is in flight (recovery's, after the
        // first one's answer was lost) waits for it and replays its answer: clients do not
        // retry a 409.
        let give_up = tokio::time::Instant::now() + self.drive_lease;
        loop {
            let sealed = match state {
                IdempotencyState::Fresh => sealed.clone(),
                IdempotencyState::Unfinished {
                    sealed_operation: Some(first),
                    ..
                } => first,
                IdempotencyState::Done {
                    status_code,
                    sealed_body,
                } => return self.replay(team_id, status_code, &sealed_body),
                IdempotencyState::Mismatch => return Err(key_mismatch()),
                // The DI is gone: what this request would get now.
                IdempotencyState::Erased { .. } => return Err(ApiError::NotFound),
                IdempotencyState::Unfinished {
                    sealed_operation: None,
                    ..
                } => return Err(key_in_progress()),
            };
            let (app, owned_key) = (self.clone(), key.to_owned());
            let drive = async move { app.try_drive_operation(team_id, &owned_key, &sealed).await };
            let driven = tokio::spawn(drive.instrument(tracing::Span::current()))
                .await
                .map_err(ApiError::internal)?;
            match driven {
                Some(reply) => return reply,
                None if tokio::time::Instant::now() >= give_up => return Err(key_in_progress()),
                None => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    state = self.store.idempotency_state(team_id, key, &fp).await?;
                }
            }
        }
    }

    /// Drives a keyed operation to its end: its response is stored for the key, or the key is
    /// released when the operation changed nothing. While its outcome is unknown (the region was
    /// unreachable or slow) the key keeps it, for a retry or recovery to drive again.
    pub async fn drive_operation(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Result<Reply, ApiError> {
        self.try_drive_operation(team_id, key, sealed)
            .await
            .unwrap_or_else(|| Err(key_in_progress()))
    }

    /// As [`App::drive_operation`]; `None` while another attempt of the operation is in flight
    /// (one at a time, as for a create: see `drive_create`).
    async fn try_drive_operation(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Option<Result<Reply, ApiError>> {
        match self
            .store
            .operation_drive_begin(team_id, key, self.drive_lease)
            .await
        {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(Err(e.into())),
        }
        let driven = self.drive_operation_once(team_id, key, sealed).await;
        if let Err(e) = self.store.operation_drive_end(team_id, key).await {
            tracing::warn!(%team_id, error = %e, "giving an operation's drive back failed; it lapses");
        }
        Some(driven)
    }

    async fn drive_operation_once(
        &self,
        team_id: Uuid,
        key: &str,
        sealed: &[u8],
    ) -> Result<Reply, ApiError> {
        let operation: Operation = match self.open_intent(sealed, &operation_aad(team_id, key)) {
            Ok(operation) => operation,
            Err(problem) => {
                tracing::warn!(%team_id, "a keyed operation {problem}; releasing its key");
                self.store.idempotency_release(team_id, key).await?;
                return Err(ApiError::internal(format!("keyed operation {problem}")));
            }
        };
        match self.run_operation(&operation).await {
            Ok(reply) => {
                let sealed = self
                    .sealer
                    .seal(&reply.body, response_aad(team_id).as_bytes());
                self.store
                    .idempotency_complete(team_id, key, reply.status.as_u16(), &sealed)
                    .await?;
                Ok(reply)
            }
            Err(OperationError::Refused(e)) => {
                self.store.idempotency_release(team_id, key).await?;
                Err(e)
            }
            Err(OperationError::Unsettled(e)) => Err(e),
        }
    }

    /// Sends an operation to its region and answers with the public reply.
    async fn run_operation(&self, op: &Operation) -> Result<Reply, OperationError> {
        let scoped = |operation_id: &Uuid| TeamScoped {
            team_id: op.team_id,
            operation_id: Some(*operation_id),
        };
        match &op.kind {
            OperationKind::Patch(request) => self.run_patch(op, request).await,
            OperationKind::Delete { operation_id } => {
                let answer = self
                    .regions
                    .delete(&op.region, op.di_id, &scoped(operation_id))
                    .await
                    .map_err(region_failure)?;
                self.apply(&answer.record)
                    .await
                    .map_err(OperationError::Unsettled)?;
                Ok(Reply::empty(StatusCode::ACCEPTED))
            }
            OperationKind::TokenCreate {
                request,
                token_value,
            } => {
                let token = self
                    .regions
                    .token_create(&op.region, op.di_id, request)
                    .await
                    .map_err(region_failure)?;
                let mut public = AccessToken::from(&token);
                public.value = Some(token_value.clone());
                Ok(Reply::json(
                    StatusCode::ACCEPTED,
                    &TokenEnvelope { token: public },
                ))
            }
            OperationKind::TokenRevoke {
                token_id,
                operation_id,
            } => {
                self.regions
                    .token_revoke(&op.region, op.di_id, *token_id, &scoped(operation_id))
                    .await
                    .map_err(region_failure)?;
                Ok(Reply::empty(StatusCode::NO_CONTENT))
            }
        }
    }

    /// A patch that renames the DI reserves the new name in central before the region call, and
    /// gives it back if the call fails (should the patch have landed after all, the change feed
    /// renames again).
    async fn run_patch(
        &self,
        op: &Operation,
        request: &regional::PatchRequest,
    ) -> Result<Reply, OperationError> {
        let current = self
            .store
            .dedicated_inference(op.di_id, op.team_id)
            .await
            .map_err(store_failure)?
            .ok_or(OperationError::Refused(ApiError::NotFound))?;
        let new_name = request
            .spec
            .as_ref()
            .map(|s| s.name.as_str())
            .filter(|n| *n != current.name);
        if let Some(name) = new_name {
            self.store
                .rename(op.di_id, op.team_id, name)
                .await
                .map_err(store_failure)?;
        }
        let answer = self.regions.patch(&op.region, op.di_id, request).await;
        match answer {
            Ok(RecordEnvelope { record }) => {
                let public = self
                    .apply(&record)
                    .await
                    .map_err(OperationError::Unsettled)?;
                Ok(Reply::json(
                    StatusCode::ACCEPTED,
                    &DedicatedInferenceEnvelope {
                        dedicated_inference: public,
                    },
                ))
            }
            Err(e) => {
                if new_name.is_some() {
                    let _ = self.store.rename(op.di_id, op.team_id, &current.name).await;
                }
                Err(region_failure(e))
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Writes to an existing DI

    pub async fn patch(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
        parsed: Parsed<UpdateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:update")?;
        let owned = self.owned(p, id).await?;
        let req = parsed.value;
        let checked = req
            .spec
            .as_ref()
            .map(|s| validate::spec(&self.catalog, s))
            .transpose()?;
        let tokens = req.access_tokens.as_ref().or(req.secrets.as_ref());
        let hf = tokens
            .and_then(|t| t.hugging_face_token.as_deref())
            .map(check_provider_token)
            .transpose()?;
        if checked.is_none() && hf.is_none() {
            return Err(ApiError::Unprocessable(
                "The request must contain spec and/or access_tokens.".into(),
            ));
        }
        let fp = fingerprint(
            "PATCH",
            &format!("/v2/dedicated-inferences/{id}"),
            &parsed.canonical,
        );
        let request = regional::PatchRequest {
            team_id: p.team_id,
            operation_id: Some(Uuid::new_v4()),
            requires_hugging_face_token: checked.as_ref().is_some_and(|c| c.gated),
            spec: checked.map(|c| c.spec),
            hugging_face_token: hf,
        };
        let operation = Operation::new(p, &owned, OperationKind::Patch(request));
        self.idempotent(key, fp, operation).await
    }

    pub async fn delete(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:delete")?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint("DELETE", &format!("/v2/dedicated-inferences/{id}"), "");
        let kind = OperationKind::Delete {
            operation_id: Uuid::new_v4(),
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }

    pub async fn token_create(
        &self,
        p: &Principal,
        id: Uuid,
        key: Option<&str>,
        parsed: Parsed<TokenCreateRequest>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:create")?;
        validate::name("name", &parsed.value.name)?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint(
            "POST",
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &parsed.canonical,
        );
        let token_value = common::tokens::mint(common::tokens::ENDPOINT_TOKEN_PREFIX);
        let request = regional::TokenCreateRequest {
            team_id: p.team_id,
            operation_id: Some(Uuid::new_v4()),
            token: NewToken {
                id: Uuid::new_v4(),
                name: parsed.value.name,
                sha256_hex: common::tokens::sha256_hex(&token_value),
            },
        };
        let kind = OperationKind::TokenCreate {
            request,
            token_value,
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }

    pub async fn token_revoke(
        &self,
        p: &Principal,
        id: Uuid,
        token_id: Uuid,
        key: Option<&str>,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:delete")?;
        let owned = self.owned(p, id).await?;
        let fp = fingerprint(
            "DELETE",
            &format!("/v2/dedicated-inferences/{id}/tokens/{token_id}"),
            "",
        );
        let kind = OperationKind::TokenRevoke {
            token_id,
            operation_id: Uuid::new_v4(),
        };
        self.idempotent(key, fp, Operation::new(p, &owned, kind))
            .await
    }

    // -----------------------------------------------------------------------------------------
    // Reads

    pub async fn get(&self, p: &Principal, id: Uuid) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let body = owned.body.as_deref().ok_or(ApiError::NotFound)?;
        // The stored body is already the public JSON: wrap it without re-serialising.
        let mut out = Vec::with_capacity(body.len() + 26);
        out.extend_from_slice(b"{\"dedicated_inference\":");
        out.extend_from_slice(body.as_bytes());
        out.push(b'}');
        Ok(Reply {
            status: StatusCode::OK,
            body: out,
        })
    }

    pub async fn list(
        &self,
        p: &Principal,
        region: Option<&str>,
        name: Option<&str>,
        paging: Paging,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        if let Some(region) = region {
            validate::region(&self.catalog, "region", region)?;
        }
        let (bodies, total) = self
            .store
            .dedicated_inference_list(p.team_id, region, name, paging.page, paging.per_page)
            .await?;
        let mut extra = Vec::new();
        if let Some(r) = region {
            extra.push(("region", r));
        }
        if let Some(n) = name {
            extra.push(("name", n));
        }
        let links = self.links("/v2/dedicated-inferences", paging, total, &extra);
        let mut out = Vec::with_capacity(bodies.iter().map(String::len).sum::<usize>() + 256);
        out.extend_from_slice(b"{\"dedicated_inferences\":[");
        for (i, body) in bodies.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(body.as_bytes());
        }
        out.extend_from_slice(b"],\"links\":");
        out.extend_from_slice(&serde_json::to_vec(&links).expect("serialises"));
        out.extend_from_slice(b",\"meta\":");
        out.extend_from_slice(&serde_json::to_vec(&Meta { total }).expect("serialises"));
        out.push(b'}');
        Ok(Reply {
            status: StatusCode::OK,
            body: out,
        })
    }

    pub async fn accelerators(
        &self,
        p: &Principal,
        id: Uuid,
        slug: Option<&str>,
        paging: Paging,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let query = PageQuery {
            slug: slug.map(str::to_string),
            ..paging.of(p.team_id)
        };
        let page = self
            .regions
            .accelerators(&owned.region, id, &query)
            .await
            .map_err(region_error)?;
        let extra: Vec<(&str, &str)> = slug.map(|s| vec![("slug", s)]).unwrap_or_default();
        Ok(Reply::json(
            StatusCode::OK,
            &AcceleratorList {
                accelerators: page.items.iter().map(AcceleratorInfo::from).collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/accelerators"),
                    paging,
                    page.total,
                    &extra,
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub async fn accelerator(
        &self,
        p: &Principal,
        id: Uuid,
        accelerator_id: Uuid,
    ) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let a = self
            .regions
            .accelerator(&owned.region, id, accelerator_id, &team(p))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(StatusCode::OK, &AcceleratorInfo::from(&a)))
    }

    pub async fn ca(&self, p: &Principal, id: Uuid) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let ca = self
            .regions
            .ca_certificate(&owned.region, id, &team(p))
            .await
            .map_err(region_error)?;
        let cert = base64::engine::general_purpose::STANDARD.encode(ca.cert_pem.as_bytes());
        Ok(Reply::json(StatusCode::OK, &CaResponse { cert }))
    }

    pub async fn tokens(&self, p: &Principal, id: Uuid, paging: Paging) -> Result<Reply, ApiError> {
        p.require("dedicated_inference_tokens:read")?;
        let owned = self.owned(p, id).await?;
        let page = self
            .regions
            .tokens(&owned.region, id, &paging.of(p.team_id))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(
            StatusCode::OK,
            &TokenList {
                tokens: page.items.iter().map(AccessToken::from).collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/tokens"),
                    paging,
                    page.total,
                    &[],
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub async fn events(&self, p: &Principal, id: Uuid, paging: Paging) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let owned = self.owned(p, id).await?;
        let page = self
            .regions
            .events(&owned.region, id, &paging.of(p.team_id))
            .await
            .map_err(region_error)?;
        Ok(Reply::json(
            StatusCode::OK,
            &EventList {
                events: page
                    .items
                    .into_iter()
                    .map(|e| EventInfo {
                        id: e.id,
                        phase: e.phase,
                        reason: e.reason,
                        message: e.message,
                        time: e.created_at,
                    })
                    .collect(),
                links: self.links(
                    &format!("/v2/dedicated-inferences/{id}/events"),
                    paging,
                    page.total,
                    &[],
                ),
                meta: Meta { total: page.total },
            },
        ))
    }

    pub fn sizes(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let mut sizes = Vec::new();
        for size in &self.catalog.sizes {
            for region in &size.regions {
                sizes.push(Size {
                    gpu_slug: size.gpu_slug.clone(),
                    price_per_hour: size.price_per_hour.clone(),
                    region: region.clone(),
                    regions: size.regions.clone(),
                    currency: size.currency.clone(),
                    gpu: SizeGpu {
                        count: size.gpu.count,
                        vram_gb: size.gpu.vram_gb,
                        slug: size.gpu.slug.clone(),
                    },
                });
            }
        }
        Ok(Reply::json(
            StatusCode::OK,
            &SizesResponse {
                enabled_regions: self.catalog.regions.clone(),
                sizes,
            },
        ))
    }

    /// The team's quotas in every region, asked of all at once; a region that does not answer
    /// is listed as such rather than failing the others.
    pub async fn quotas(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let names = self.regions.names();
        let query = team(p);
        let answers = futures::future::join_all(
            names
                .iter()
                .map(|region| self.regions.quotas(region, &query)),
        )
        .await;
        let mut body = QuotasResponse {
            quotas: Vec::new(),
            unavailable_regions: Vec::new(),
        };
        for (region, answer) in names.into_iter().zip(answers) {
            match answer {
                Ok(quotas) => body.quotas.push(quotas),
                Err(error) => {
                    tracing::warn!(%region, ?error, "a region's quotas are unavailable");
                    body.unavailable_regions.push(region);
                }
            }
        }
        Ok(Reply::json(StatusCode::OK, &body))
    }

    pub fn gpu_model_config(&self, p: &Principal) -> Result<Reply, ApiError> {
        p.require("dedicated_inference:read")?;
        let gpu_model_configs = self
            .catalog
            .models
            .iter()
            .map(|m| GpuModelConfig {
                gpu_slugs: m.gpu_slugs.clone(),
                model_slug: m.model_slug.clone(),
                model_name: m.model_name.clone(),
                is_gated_model: m.is_gated_model,
                is_model_gated: m.is_gated_model,
            })
            .collect();
        Ok(Reply::json(
            StatusCode::OK,
            &GpuModelConfigsResponse { gpu_model_configs },
        ))
    }

    // -----------------------------------------------------------------------------------------

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
