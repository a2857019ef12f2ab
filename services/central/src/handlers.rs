//! Public HTTP handlers: extract, call one application method, map the result. The `utoipa`
//! annotations are the source of `openapi/public.json`.

use api_types::public::{
    AcceleratorInfo, AcceleratorList, CaResponse, CreateRequest, CreateResponse,
    DedicatedInferenceEnvelope, DedicatedInferenceList, ErrorBody, EventList,
    GpuModelConfigsResponse, QuotasResponse, SizesResponse, TokenCreateRequest, TokenEnvelope,
    TokenList, UpdateRequest,
};
use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::routing::{delete, get};
use axum::{Extension, Router};
use uuid::Uuid;

use crate::app::{check_idempotency_key, Paging, Reply};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::{body, App};

type Result<T> = std::result::Result<T, ApiError>;

pub fn routes() -> Router<App> {
    Router::new()
        .route("/v2/dedicated-inferences", get(list).post(create))
        .route("/v2/dedicated-inferences/sizes", get(sizes))
        .route("/v2/dedicated-inferences/quotas", get(quotas))
        .route(
            "/v2/dedicated-inferences/gpu-model-config",
            get(gpu_model_config),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}",
            get(get_one).patch(patch).delete(remove),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators",
            get(accelerators),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators/{accelerator_id}",
            get(accelerator),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/ca",
            get(ca),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/tokens",
            get(tokens).post(token_create),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/tokens/{token_id}",
            delete(token_revoke),
        )
        .route(
            "/v2/dedicated-inferences/{dedicated_inference_id}/events",
            get(events),
        )
}

/// Ids that are not UUIDs name nothing: 404, like an unknown id.
fn id(text: &str) -> Result<Uuid> {
    Uuid::parse_str(text).map_err(|_| ApiError::NotFound)
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>> {
    let raw = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::BadRequest("Idempotency-Key must be ASCII.".into()))?,
        ),
    };
    Ok(check_idempotency_key(raw)?.map(str::to_owned))
}

/// The query string's parameters. Unknown parameters are ignored, as DigitalOcean does.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: Option<String>) -> Result<Query> {
        let raw = raw.unwrap_or_default();
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(&raw)
            .map_err(|_| ApiError::BadRequest("The query string is malformed.".into()))?;
        if pairs
            .iter()
            .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(ApiError::Unprocessable(
                "Query parameters must not contain NUL characters.".into(),
            ));
        }
        Ok(Query(pairs))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn int(&self, name: &str, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64> {
        let Some(text) = self.get(name) else {
            return Ok(default);
        };
        let value: i64 = text.parse().map_err(|_| {
            ApiError::Unprocessable(format!(
                "{name} must be an integer between {} and {}.",
                range.start(),
                range.end()
            ))
        })?;
        if !range.contains(&value) {
            return Err(ApiError::Unprocessable(format!(
                "{name} must be between {} and {}.",
                range.start(),
                range.end()
            )));
        }
        Ok(value)
    }

    fn paging(&self) -> Result<Paging> {
        Ok(Paging {
            page: self.int("page", 1, 1..=1_000_000)?,
            per_page: self.int("per_page", 20, 1..=200)?,
        })
    }
}

#[utoipa::path(get, path = "/v2/dedicated-inferences", operation_id = "dedicatedInferences_list", tag = "Dedicated Inference",
    params(("per_page" = Option<i64>, Query), ("page" = Option<i64>, Query), ("region" = Option<String>, Query), ("name" = Option<String>, Query)),
    responses((status = 200, body = DedicatedInferenceList), (status = 401, body = ErrorBody), (status = 422, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn list(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> Result<Reply> {
    let q = Query::parse(raw)?;
    let paging = q.paging()?;
    app.list(
        &p,
        q.get("region"),
        q.get("name").filter(|n| !n.is_empty()),
        paging,
    )
    .await
}

#[utoipa::path(post, path = "/v2/dedicated-inferences", operation_id = "dedicatedInferences_create", tag = "Dedicated Inference",
    request_body = CreateRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "Replays the first response for 24 h")),
    responses((status = 202, body = CreateResponse), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:create"])))]
async fn create(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<Reply> {
    let key = idempotency_key(&headers)?;
    // Scope before body: a token that may not create learns nothing from validation errors.
    p.require("dedicated_inference:create")?;
    let parsed = body::read::<CreateRequest>(body).await?;
    app.create(&p, key.as_deref(), parsed).await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}", operation_id = "dedicatedInferences_get", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path)),
    responses((status = 200, body = DedicatedInferenceEnvelope), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn get_one(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
) -> Result<Reply> {
    app.get(&p, id(&di)?).await
}

#[utoipa::path(patch, path = "/v2/dedicated-inferences/{dedicated_inference_id}", operation_id = "dedicatedInferences_patch", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    request_body = UpdateRequest,
    responses((status = 202, body = DedicatedInferenceEnvelope), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody), (status = 429, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:update"])))]
async fn patch(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Reply> {
    let key = idempotency_key(&headers)?;
    p.require("dedicated_inference:update")?;
    let di = id(&di)?;
    let parsed = body::read::<UpdateRequest>(body).await?;
    app.patch(&p, di, key.as_deref(), parsed).await
}

#[utoipa::path(delete, path = "/v2/dedicated-inferences/{dedicated_inference_id}", operation_id = "dedicatedInferences_delete", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 202, description = "Deletion accepted"), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:delete"])))]
async fn remove(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    headers: HeaderMap,
) -> Result<Reply> {
    let key = idempotency_key(&headers)?;
    app.delete(&p, id(&di)?, key.as_deref()).await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators", operation_id = "dedicatedInferences_list_accelerators", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("per_page" = Option<i64>, Query), ("page" = Option<i64>, Query), ("slug" = Option<String>, Query)),
    responses((status = 200, body = AcceleratorList), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn accelerators(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Reply> {
    let q = Query::parse(raw)?;
    app.accelerators(
        &p,
        id(&di)?,
        q.get("slug").filter(|s| !s.is_empty()),
        q.paging()?,
    )
    .await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators/{accelerator_id}", operation_id = "dedicatedInferences_get_accelerator", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("accelerator_id" = Uuid, Path)),
    responses((status = 200, body = AcceleratorInfo), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn accelerator(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path((di, acc)): Path<(String, String)>,
) -> Result<Reply> {
    app.accelerator(&p, id(&di)?, id(&acc)?).await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}/ca", operation_id = "dedicatedInferences_get_ca", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path)),
    responses((status = 200, body = CaResponse), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn ca(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
) -> Result<Reply> {
    app.ca(&p, id(&di)?).await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}/tokens", operation_id = "dedicatedInferences_list_tokens", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("per_page" = Option<i64>, Query), ("page" = Option<i64>, Query)),
    responses((status = 200, body = TokenList), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference_tokens:read"])))]
async fn tokens(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Reply> {
    let q = Query::parse(raw)?;
    app.tokens(&p, id(&di)?, q.paging()?).await
}

#[utoipa::path(post, path = "/v2/dedicated-inferences/{dedicated_inference_id}/tokens", operation_id = "dedicatedInferences_create_tokens", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    request_body = TokenCreateRequest,
    responses((status = 202, body = TokenEnvelope), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 422, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference_tokens:create"])))]
async fn token_create(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Reply> {
    let key = idempotency_key(&headers)?;
    p.require("dedicated_inference_tokens:create")?;
    let di = id(&di)?;
    let parsed = body::read::<TokenCreateRequest>(body).await?;
    app.token_create(&p, di, key.as_deref(), parsed).await
}

#[utoipa::path(delete, path = "/v2/dedicated-inferences/{dedicated_inference_id}/tokens/{token_id}", operation_id = "dedicatedInferences_delete_tokens", tag = "Dedicated Inference",
    params(("dedicated_inference_id" = Uuid, Path), ("token_id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 204, description = "Token revoked"), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference_tokens:delete"])))]
async fn token_revoke(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path((di, token)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Reply> {
    let key = idempotency_key(&headers)?;
    app.token_revoke(&p, id(&di)?, id(&token)?, key.as_deref())
        .await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/{dedicated_inference_id}/events", operation_id = "dedicatedInferences_list_events", tag = "Dedicated Inference",
    description = "Extension: the lifecycle events of a dedicated inference (phase, reason, message, time), oldest first.",
    params(("dedicated_inference_id" = Uuid, Path), ("per_page" = Option<i64>, Query), ("page" = Option<i64>, Query)),
    responses((status = 200, body = EventList), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn events(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
    Path(di): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Reply> {
    let q = Query::parse(raw)?;
    app.events(&p, id(&di)?, q.paging()?).await
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/sizes", operation_id = "dedicatedInferences_list_sizes", tag = "Dedicated Inference",
    responses((status = 200, body = SizesResponse), (status = 401, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn sizes(State(app): State<App>, Extension(p): Extension<Principal>) -> Result<Reply> {
    app.sizes(&p)
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/gpu-model-config", operation_id = "dedicatedInferences_get_gpu_model_config", tag = "Dedicated Inference",
    responses((status = 200, body = GpuModelConfigsResponse), (status = 401, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn gpu_model_config(
    State(app): State<App>,
    Extension(p): Extension<Principal>,
) -> Result<Reply> {
    app.gpu_model_config(&p)
}

#[utoipa::path(get, path = "/v2/dedicated-inferences/quotas", operation_id = "dedicatedInferences_get_quotas", tag = "Dedicated Inference",
    description = "Extension: the team's quotas in each region (dedicated inferences, GPUs of each size, GPUs in all) and what it holds against them. A create or update that would raise a figure above its limit is refused with 422.",
    responses((status = 200, body = QuotasResponse), (status = 401, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer_auth" = ["dedicated_inference:read"])))]
async fn quotas(State(app): State<App>, Extension(p): Extension<Principal>) -> Result<Reply> {
    app.quotas(&p).await
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "Dedicated Inference API", version = "2.0",
        description = "DigitalOcean-compatible Dedicated Inference API (`/v2/dedicated-inferences`), served by the central API."),
    paths(list, create, get_one, patch, remove, accelerators, accelerator, ca, tokens, token_create, token_revoke, events, sizes, gpu_model_config, quotas),
    modifiers(&BearerAuth),
    tags((name = "Dedicated Inference"))
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer_auth",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}
