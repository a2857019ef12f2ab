//! Internal API handlers: extract, call one store method, map the result.

use std::time::Duration;

use api_types::public::RegionQuotas;
use api_types::regional::{
    Accelerator, CaCertificate, Changes, ChangesQuery, CreateRequest, Event, Page, PageQuery,
    PatchRequest, RecordEnvelope, RegionError, TeamQuery, TeamScoped, Token, TokenCreateRequest,
};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use utoipa::OpenApi;
use uuid::Uuid;

use crate::{ca, models, ApiError, AppState};

type ApiResult<T> = Result<Json<T>, ApiError>;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Dedicated Inference regional service (internal)",
        version = "1"
    ),
    paths(
        create,
        get_one,
        patch,
        delete,
        changes,
        accelerators,
        accelerator,
        ca_certificate,
        tokens,
        token_create,
        token_revoke,
        events,
        quotas
    ),
    components(schemas(RegionError))
)]
pub struct ApiDoc;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/internal/v1/dedicated-inferences", post(create))
        .route(
            "/internal/v1/dedicated-inferences/{id}",
            get(get_one).patch(patch).delete(delete),
        )
        .route(
            "/internal/v1/dedicated-inferences/{id}/accelerators",
            get(accelerators),
        )
        .route(
            "/internal/v1/dedicated-inferences/{id}/accelerators/{accelerator_id}",
            get(accelerator),
        )
        .route(
            "/internal/v1/dedicated-inferences/{id}/ca",
            get(ca_certificate),
        )
        .route(
            "/internal/v1/dedicated-inferences/{id}/tokens",
            get(tokens).post(token_create),
        )
        .route(
            "/internal/v1/dedicated-inferences/{id}/tokens/{token_id}",
            axum::routing::delete(token_revoke),
        )
        .route("/internal/v1/dedicated-inferences/{id}/events", get(events))
        .route("/internal/v1/changes", get(changes))
        .route("/internal/v1/quotas", get(quotas))
}

fn body<T>(payload: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    payload
        .map(|Json(v)| v)
        .map_err(|e| ApiError::BadRequest(e.body_text()))
}

fn checked_page(q: &PageQuery) -> Result<(i64, i64), ApiError> {
    if q.page < 1 || !(1..=200).contains(&q.per_page) {
        return Err(ApiError::BadRequest(
            "page must be >= 1 and per_page within 1..=200".into(),
        ));
    }
    Ok((q.page, q.per_page))
}

/// Create a dedicated inference with a central-chosen id; idempotent on that id.
#[utoipa::path(post, path = "/internal/v1/dedicated-inferences", request_body = CreateRequest,
    responses((status = 200, body = RecordEnvelope), (status = 409, body = RegionError),
        (status = 422, body = RegionError), (status = 503, body = RegionError)))]
async fn create(
    State(state): State<AppState>,
    payload: Result<Json<CreateRequest>, JsonRejection>,
) -> ApiResult<RecordEnvelope> {
    let mut req = body(payload)?;
    if let Some(record) = state.store.dedicated_inference_created(&req).await? {
        return Ok(Json(RecordEnvelope { record }));
    }
    // The VPC is the team's own in this region, or its default here: answered before anything
    // is stored, so a foreign or unknown VPC is refused at once.
    // So is a model that cannot be served as declared. Both questions at once: the answer must
    // arrive inside central's wait.
    let kept = models::keep_commits(&mut req.spec.model_deployments, &[]);
    let (vpc, reported) = tokio::try_join!(
        state.vpcs.resolve(req.team_id, req.spec.vpc_uuid),
        state.models.check(
            &req.spec.model_deployments,
            &[],
            req.hugging_face_token.as_deref(),
            true,
        ),
    )?;
    models::pin_reported(&mut req.spec.model_deployments, &kept, reported);
    req.spec.vpc_uuid = Some(vpc);
    let authority = ca::generate_with(req.id, &state.ca, std::time::SystemTime::now())
        .map_err(|e| ApiError::Internal(format!("CA generation: {e}")))?;
    let record = state
        .store
        .dedicated_inference_create(&req, &authority)
        .await?;
    Ok(Json(RecordEnvelope { record }))
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}", params(("id" = Uuid, Path), TeamQuery),
    responses((status = 200, body = RecordEnvelope), (status = 404, body = RegionError)))]
async fn get_one(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<TeamQuery>,
) -> ApiResult<RecordEnvelope> {
    Ok(Json(RecordEnvelope {
        record: state.store.dedicated_inference_get(id, q.team_id).await?,
    }))
}

#[utoipa::path(patch, path = "/internal/v1/dedicated-inferences/{id}", params(("id" = Uuid, Path)), request_body = PatchRequest,
    responses((status = 200, body = RecordEnvelope), (status = 409, body = RegionError), (status = 422, body = RegionError)))]
async fn patch(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    payload: Result<Json<PatchRequest>, JsonRejection>,
) -> ApiResult<RecordEnvelope> {
    let mut req = body(payload)?;
    let store = state.store.for_operation(req.operation_id);
    // A repeated operation (central's retry or recovery after a lost answer) was checked when
    // it was applied: asking the Hub again could refuse what already landed. The store answers
    // it with the DI as it is, so its spec's commits do not matter.
    if !store.operation_applied().await? {
        check_models(&state, id, &mut req).await?;
    }
    let record = store
        .dedicated_inference_patch(
            id,
            req.team_id,
            req.spec.as_ref(),
            req.hugging_face_token.as_deref(),
            req.requires_hugging_face_token,
        )
        .await?;
    Ok(Json(RecordEnvelope { record }))
}

/// A PATCH's models, as a create's are checked: with the token it sends, else the DI's own; the
/// deployments the DI already serves as they are (and a token that stays) are not asked about.
/// Its spec's deployments keep the commits of the DI's that name the same repository and
/// revision, and the others take the Hub's answer: a branch moves only when a PATCH names
/// another revision.
async fn check_models(state: &AppState, id: Uuid, req: &mut PatchRequest) -> Result<(), ApiError> {
    if req.spec.is_none() && req.hugging_face_token.is_none() {
        return Ok(());
    }
    let record = state.store.dedicated_inference_get(id, req.team_id).await?;
    let latest = record.pending_spec.as_ref().or(record.spec.as_ref());
    let latest = latest.map_or(&[][..], |s| s.model_deployments.as_slice());
    // Terraform sends the token with every update: only a token that differs from the DI's is
    // a change to check.
    let stored = state.store.hugging_face_token(id).await?;
    let token = req.hugging_face_token.as_deref().or(stored.as_deref());
    let token_changed = token != stored.as_deref();
    match req.spec.as_mut() {
        Some(spec) => {
            let kept = models::keep_commits(&mut spec.model_deployments, latest);
            let reported = state
                .models
                .check(&spec.model_deployments, latest, token, token_changed)
                .await?;
            models::pin_reported(&mut spec.model_deployments, &kept, reported);
        }
        // A new token alone: the DI's deployments, at the commits they load, are asked about.
        None => {
            state
                .models
                .check(latest, &[], token, token_changed)
                .await?;
        }
    }
    Ok(())
}

#[utoipa::path(delete, path = "/internal/v1/dedicated-inferences/{id}", params(("id" = Uuid, Path), TeamScoped),
    responses((status = 200, body = RecordEnvelope), (status = 404, body = RegionError)))]
async fn delete(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<TeamScoped>,
) -> ApiResult<RecordEnvelope> {
    Ok(Json(RecordEnvelope {
        record: state
            .store
            .for_operation(q.operation_id)
            .dedicated_inference_delete(id, q.team_id)
            .await?,
    }))
}

/// The change feed: the latest state of every DI changed after `after`, including gone ones.
#[utoipa::path(get, path = "/internal/v1/changes", params(ChangesQuery), responses((status = 200, body = Changes)))]
async fn changes(
    State(state): State<AppState>,
    Query(q): Query<ChangesQuery>,
) -> ApiResult<Changes> {
    let limit = q.limit.clamp(1, 1000);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(q.wait_ms.min(30_000));
    loop {
        // Register interest before reading, so a change committed in between still wakes us.
        let notified = state.changed.notified();
        let found = state.store.changes_since(q.after, limit).await?;
        if !found.records.is_empty() || tokio::time::Instant::now() >= deadline {
            return Ok(Json(found));
        }
        let _ = tokio::time::timeout_at(deadline, notified).await;
    }
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}/accelerators", params(("id" = Uuid, Path), PageQuery),
    responses((status = 200, body = Page<Accelerator>)))]
async fn accelerators(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<PageQuery>,
) -> ApiResult<Page<Accelerator>> {
    let (page, per_page) = checked_page(&q)?;
    Ok(Json(
        state
            .store
            .accelerators_list(id, q.team_id, q.slug.as_deref(), page, per_page)
            .await?,
    ))
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}/accelerators/{accelerator_id}",
    params(("id" = Uuid, Path), ("accelerator_id" = Uuid, Path), TeamQuery), responses((status = 200, body = Accelerator)))]
async fn accelerator(
    State(state): State<AppState>,
    Path((id, accelerator_id)): Path<(Uuid, Uuid)>,
    Query(q): Query<TeamQuery>,
) -> ApiResult<Accelerator> {
    Ok(Json(
        state
            .store
            .accelerator_get(id, q.team_id, accelerator_id)
            .await?,
    ))
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}/ca", params(("id" = Uuid, Path), TeamQuery),
    responses((status = 200, body = CaCertificate)))]
async fn ca_certificate(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<TeamQuery>,
) -> ApiResult<CaCertificate> {
    Ok(Json(CaCertificate {
        cert_pem: state.store.ca_certificate(id, q.team_id).await?,
    }))
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}/tokens", params(("id" = Uuid, Path), PageQuery),
    responses((status = 200, body = Page<Token>)))]
async fn tokens(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<PageQuery>,
) -> ApiResult<Page<Token>> {
    let (page, per_page) = checked_page(&q)?;
    Ok(Json(
        state
            .store
            .tokens_list(id, q.team_id, page, per_page)
            .await?,
    ))
}

#[utoipa::path(post, path = "/internal/v1/dedicated-inferences/{id}/tokens", params(("id" = Uuid, Path)),
    request_body = TokenCreateRequest, responses((status = 200, body = Token)))]
async fn token_create(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    payload: Result<Json<TokenCreateRequest>, JsonRejection>,
) -> ApiResult<Token> {
    let req = body(payload)?;
    Ok(Json(
        state
            .store
            .for_operation(req.operation_id)
            .token_create(id, req.team_id, &req.token)
            .await?,
    ))
}

#[utoipa::path(delete, path = "/internal/v1/dedicated-inferences/{id}/tokens/{token_id}",
    params(("id" = Uuid, Path), ("token_id" = Uuid, Path), TeamScoped), responses((status = 204)))]
async fn token_revoke(
    State(state): State<AppState>,
    Path((id, token_id)): Path<(Uuid, Uuid)>,
    Query(q): Query<TeamScoped>,
) -> Result<StatusCode, ApiError> {
    state
        .store
        .for_operation(q.operation_id)
        .token_revoke(id, q.team_id, token_id)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/internal/v1/dedicated-inferences/{id}/events", params(("id" = Uuid, Path), PageQuery),
    responses((status = 200, body = Page<Event>)))]
async fn events(
    State(state): State<AppState>,
    Path(id): Path<Uuid>,
    Query(q): Query<PageQuery>,
) -> ApiResult<Page<Event>> {
    let (page, per_page) = checked_page(&q)?;
    Ok(Json(
        state
            .store
            .events_list(id, q.team_id, page, per_page)
            .await?,
    ))
}

/// The team's quotas in this region: each limit and what the team holds against it.
#[utoipa::path(get, path = "/internal/v1/quotas", params(TeamQuery),
    responses((status = 200, body = RegionQuotas), (status = 503, body = RegionError)))]
async fn quotas(
    State(state): State<AppState>,
    Query(q): Query<TeamQuery>,
) -> ApiResult<RegionQuotas> {
    Ok(Json(state.store.quota_use(q.team_id).await?))
}
