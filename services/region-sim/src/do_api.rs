//! The DigitalOcean API subset (`/v2/...`) and the simulator's admin endpoints (`/_sim/...`).
//!
//! Handlers parse, call one [`World`](crate::world::World) method and map the result; the shapes,
//! status codes and error bodies follow DigitalOcean's public OpenAPI document so that production
//! clients cannot tell the difference.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dataplane_sim::serving::{pod_metrics_text, METRICS_CONTENT_TYPE};
use region_sim_base::faults::{Api, ArmedKind, CallVerdict, Counting, FaultConfig, Verdict};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::world::{ClusterCreate, Delays, PoolSpec, VpcCreate, WorldError};
use crate::Shared;

/// An error in DigitalOcean's shape: `{"id", "message", "request_id"}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    id: &'static str,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, id: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            id,
            message: message.into(),
            retry_after: None,
        }
    }

    fn not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "The resource you requested could not be found.",
        )
    }

    fn bad_request(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", msg)
    }
}

impl From<WorldError> for ApiError {
    fn from(e: WorldError) -> Self {
        match e {
            WorldError::NotFound => Self::not_found(),
            WorldError::Unprocessable(m) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unprocessable_entity", m)
            }
            WorldError::Conflict(m) => Self::new(StatusCode::CONFLICT, "conflict", m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let request_id = Uuid::new_v4().to_string();
        let body = json!({"id": self.id, "message": self.message, "request_id": request_id});
        let mut resp = (self.status, Json(body)).into_response();
        let h = resp.headers_mut();
        h.insert(
            "x-request-id",
            HeaderValue::from_str(&request_id).expect("uuid header"),
        );
        if let Some(secs) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            h.insert("ratelimit-remaining", HeaderValue::from(0));
        }
        resp
    }
}

type ApiResult = Result<Response, ApiError>;

fn parse_json<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error parsing request body: {e}")))
}

fn reply(status: StatusCode, body: Value) -> ApiResult {
    Ok((status, Json(body)).into_response())
}

/// DigitalOcean pagination: `page`/`per_page` in, `links.pages` and `meta.total` out.
/// One page of a list. `list` is asked for the items at the page's positions (fewer past the
/// end) and the list's length, so that only the page is rendered: the workers page through
/// thousands of clusters, and rendering every one for every page made listing them quadratic.
fn paginate(
    base_url: &str,
    path: &str,
    q: &HashMap<String, String>,
    key: &str,
    list: impl FnOnce(std::ops::Range<usize>) -> (Vec<Value>, usize),
) -> ApiResult {
    let num =
        |name: &str, default: usize| -> Result<usize, ApiError> {
            match q.get(name) {
                None => Ok(default),
                Some(v) => v.parse::<usize>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    ApiError::bad_request(format!("{name} must be a positive integer"))
                }),
            }
        };
    let page = num("page", 1)?;
    let per_page = num("per_page", 20)?.min(200);
    let start = (page - 1).saturating_mul(per_page);
    let (items, total) = list(start..start.saturating_add(per_page));
    let last = total.div_ceil(per_page).max(1);
    let link = |p: usize| format!("{base_url}{path}?page={p}&per_page={per_page}");
    let mut pages = serde_json::Map::new();
    if page > 1 {
        pages.insert("first".into(), json!(link(1)));
        pages.insert("prev".into(), json!(link((page - 1).min(last))));
    }
    if page < last {
        pages.insert("next".into(), json!(link(page + 1)));
        pages.insert("last".into(), json!(link(last)));
    }
    reply(
        StatusCode::OK,
        json!({
            key: items,
            "links": {"pages": pages},
            "meta": {"total": total},
        }),
    )
}

// ------------------------------------------------------------------ middleware

/// Adds the headers every DigitalOcean response carries.
async fn common_headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    if !h.contains_key("x-request-id") {
        h.insert(
            "x-request-id",
            HeaderValue::from_str(&Uuid::new_v4().to_string()).expect("uuid header"),
        );
    }
    h.entry("ratelimit-limit")
        .or_insert(HeaderValue::from(5000));
    h.entry("ratelimit-remaining")
        .or_insert(HeaderValue::from(4999));
    let reset = chrono::Utc::now().timestamp() + 60;
    h.entry("ratelimit-reset")
        .or_insert(HeaderValue::from(reset));
    resp
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Bearer auth, call accounting and fault injection, in that order: an unauthenticated call is
/// not a call, and a faulted call still counts (the client did send it).
async fn guard(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    if bearer(req.headers()) != Some(s.token.as_str()) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unable to authenticate you.",
        )
        .into_response();
    }
    let line = format!("{} {}", req.method(), req.uri().path());
    let kind = s.stats.record_do(req.method(), req.uri().path());
    let is_write = crate::is_mutating(req.method());
    let resp = match s.faults.apply_call(Api::Do, is_write, &kind).await {
        CallVerdict::Now(Verdict::Pass) => next.run(req).await,
        CallVerdict::LoseResponse => {
            // The handler has run (whatever it created exists); only its answer is lost.
            drop(next.run(req).await);
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "gateway_timeout",
                "The server did not answer in time.",
            )
            .into_response()
        }
        CallVerdict::Now(Verdict::Error) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "Unexpected server-side error",
        )
        .into_response(),
        CallVerdict::Now(Verdict::RateLimited(secs)) => ApiError {
            retry_after: Some(secs),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "API rate limit exceeded.",
            )
        }
        .into_response(),
    };
    s.stats
        .record_call(format!("{line} -> {}", resp.status().as_u16()));
    resp
}

// ------------------------------------------------------------------ VPCs

/// The header with which the platform's credential acts for one customer account: the API then
/// answers as that account sees it (its VPCs only; its default VPC made on first use). The
/// control plane's regional service sends it to learn whether a team owns a VPC and which VPC is
/// its default. Without it the credential is the platform's own and sees every VPC.
pub const ACTING_ACCOUNT_HEADER: &str = "x-acting-account";

fn acting(headers: &HeaderMap) -> Result<Option<Uuid>, ApiError> {
    match headers.get(ACTING_ACCOUNT_HEADER) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| Uuid::parse_str(s.trim()).ok())
            .map(Some)
            .ok_or_else(|| {
                ApiError::bad_request(format!("{ACTING_ACCOUNT_HEADER} must be an account UUID"))
            }),
    }
}

async fn vpcs_list(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let acting = acting(&headers)?;
    paginate(&s.base_url, "/v2/vpcs", &q, "vpcs", |r| {
        s.world.vpc_page(acting, r)
    })
}

async fn vpcs_create(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let req: VpcCreate = parse_json(&body)?;
    let vpc = s.world.vpc_create(acting(&headers)?, req)?;
    reply(StatusCode::CREATED, json!({"vpc": vpc}))
}

async fn vpcs_get(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let vpc = s.world.vpc_get(acting(&headers)?, &id)?;
    reply(StatusCode::OK, json!({"vpc": vpc}))
}

async fn vpcs_delete(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    s.world.vpc_delete(acting(&headers)?, &id)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

// ------------------------------------------------------------------ clusters

async fn clusters_list(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    paginate(
        &s.base_url,
        "/v2/kubernetes/clusters",
        &q,
        "kubernetes_clusters",
        |r| s.world.cluster_page(r),
    )
}

async fn clusters_create(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req: ClusterCreate = parse_json(&body)?;
    let cluster = s.world.cluster_create(req)?;
    let id = cluster["id"].as_str().unwrap_or_default().to_string();
    let name = cluster["name"].as_str().unwrap_or_default().to_string();
    // The API server exists from the start so the kubeconfig can be fetched right away; the
    // cluster only reports `running` (and an endpoint) after the provisioning delay.
    if let Err(e) = s.clusters.ensure(&s, &id, &name).await {
        tracing::error!(error = %e, cluster_id = %id, "starting simulated Kubernetes API failed");
    }
    reply(StatusCode::CREATED, json!({"kubernetes_cluster": cluster}))
}

async fn clusters_get(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    reply(
        StatusCode::OK,
        json!({"kubernetes_cluster": s.world.cluster_get(&id)?}),
    )
}

async fn clusters_delete(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    s.world.cluster_delete(&id)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `expiry_seconds` of the kubeconfig and credentials endpoints: how long the issued token is
/// valid; absent or 0 means the default.
fn expiry_seconds(q: &HashMap<String, String>) -> Result<Option<u64>, ApiError> {
    q.get("expiry_seconds")
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| ApiError::bad_request("expiry_seconds must be a non-negative integer"))
        })
        .transpose()
}

/// New credentials for cluster `id`, as the kubeconfig and credentials endpoints issue them.
fn issue_credentials(
    s: &Shared,
    id: &str,
    q: &HashMap<String, String>,
) -> Result<crate::clusters::Credentials, ApiError> {
    let expiry = expiry_seconds(q)?;
    if !s.world.cluster_exists(id) {
        return Err(ApiError::not_found());
    }
    s.clusters
        .credentials(id, expiry)
        .ok_or_else(ApiError::not_found)
}

async fn kubeconfig(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let yaml = issue_credentials(&s, &id, &q)?.kubeconfig_yaml();
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/yaml")],
        yaml,
    )
        .into_response())
}

async fn credentials(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let creds = issue_credentials(&s, &id, &q)?;
    reply(
        StatusCode::OK,
        json!({
            "server": creds.server,
            "certificate_authority_data": creds.certificate_authority_data,
            "client_certificate_data": null,
            "client_key_data": null,
            "token": creds.token,
            "expires_at": creds.expires_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        }),
    )
}

// ------------------------------------------------------------------ node pools

async fn pools_list(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    reply(
        StatusCode::OK,
        json!({"node_pools": s.world.pool_list(&id)?}),
    )
}

async fn pools_create(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let spec: PoolSpec = parse_json(&body)?;
    let pool = s.world.pool_create(&id, spec)?;
    reply(StatusCode::CREATED, json!({"node_pool": pool}))
}

async fn pools_get(
    State(s): State<Arc<Shared>>,
    Path((id, pool)): Path<(String, String)>,
) -> ApiResult {
    reply(
        StatusCode::OK,
        json!({"node_pool": s.world.pool_get(&id, &pool)?}),
    )
}

async fn pools_update(
    State(s): State<Arc<Shared>>,
    Path((id, pool)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult {
    let spec: PoolSpec = parse_json(&body)?;
    let pool = s.world.pool_update(&id, &pool, spec)?;
    reply(StatusCode::ACCEPTED, json!({"node_pool": pool}))
}

async fn pools_delete(
    State(s): State<Arc<Shared>>,
    Path((id, pool)): Path<(String, String)>,
) -> ApiResult {
    s.world.pool_delete(&id, &pool)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn nodes_delete(
    State(s): State<Arc<Shared>>,
    Path((id, pool, node)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let replace = q.get("replace").is_some_and(|v| v == "1" || v == "true");
    s.world.node_delete(&id, &pool, &node, replace)?;
    Ok(StatusCode::ACCEPTED.into_response())
}

// ------------------------------------------------------------------ load balancers

async fn lbs_list(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    paginate(
        &s.base_url,
        "/v2/load_balancers",
        &q,
        "load_balancers",
        |r| s.world.lb_page(r),
    )
}

async fn lbs_get(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    reply(
        StatusCode::OK,
        json!({"load_balancer": s.world.lb_get(&id)?}),
    )
}

async fn not_found() -> ApiError {
    ApiError::not_found()
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "The method is not allowed for this resource.",
    )
}

// ------------------------------------------------------------------ admin

async fn admin_inventory(State(s): State<Arc<Shared>>) -> Response {
    Json(s.inventory()).into_response()
}

async fn admin_faults_get(State(s): State<Arc<Shared>>) -> Response {
    Json(s.faults.get()).into_response()
}

async fn admin_faults_put(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let f: FaultConfig = parse_json(&body)?;
    s.faults.set(f.clone());
    reply(StatusCode::OK, json!(f))
}

/// Calls counted so far, armed faults and those that fired.
async fn admin_armed_get(State(s): State<Arc<Shared>>) -> Response {
    let counts = |api| {
        json!({
            "calls": s.faults.calls(api, Counting::Calls).unwrap_or(0),
            "writes": s.faults.calls(api, Counting::Writes).unwrap_or(0),
        })
    };
    Json(json!({
        "counts": {"do": counts(Api::Do), "kube": counts(Api::Kube)},
        "armed": s.faults.armed(),
        "fired": s.faults.fired(),
    }))
    .into_response()
}

/// `{"api": "do" | "kube", "nth": N, "kind": "refuse" | "lose_response" | "outage",
/// "counting": "calls" | "writes"}`: the Nth call (or write) from now (0: the next one).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ArmRequest {
    api: Api,
    #[serde(default)]
    nth: u64,
    kind: ArmedKind,
    #[serde(default)]
    counting: Counting,
}

async fn admin_armed_arm(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req: ArmRequest = parse_json(&body)?;
    let armed = s
        .faults
        .arm(req.api, req.counting, req.nth, req.kind)
        .map_err(|m| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unprocessable_entity", m))?;
    reply(StatusCode::CREATED, json!(armed))
}

async fn admin_armed_disarm(State(s): State<Arc<Shared>>) -> Response {
    Json(json!({"disarmed": s.faults.disarm()})).into_response()
}

async fn admin_delays_get(State(s): State<Arc<Shared>>) -> Response {
    Json(s.world.delays()).into_response()
}

async fn admin_delays_put(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let d: Delays = parse_json(&body)?;
    s.set_delays(d.clone());
    reply(StatusCode::OK, json!(d))
}

async fn admin_capacity_get(State(s): State<Arc<Shared>>) -> Response {
    Json(s.world.capacity()).into_response()
}

async fn admin_capacity_put(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let c: BTreeMap<String, u32> = parse_json(&body)?;
    s.world.set_capacity(c.clone());
    reply(StatusCode::OK, json!(c))
}

async fn admin_model_get(State(s): State<Arc<Shared>>) -> Response {
    Json(s.model_timing()).into_response()
}

async fn admin_model_put(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let m: dataplane_sim::data_plane::ModelTiming = parse_json(&body)?;
    s.set_model_timing(m.clone());
    reply(StatusCode::OK, json!(m))
}

async fn admin_stats(State(s): State<Arc<Shared>>) -> Response {
    Json(s.stats()).into_response()
}

async fn admin_stats_reset(State(s): State<Arc<Shared>>) -> StatusCode {
    s.stats.reset();
    StatusCode::NO_CONTENT
}

async fn admin_kill_node(State(s): State<Arc<Shared>>, Path(name): Path<String>) -> ApiResult {
    s.world.kill_node(&name)?;
    // Apply the NotReady status now rather than on the next tick, so tests see it immediately.
    s.drive(Instant::now()).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /_sim/clusters/{id}/pods/{ns}/{name}/metrics`: the pod's vLLM `/metrics`
/// ([`pod_metrics_text`]; the cluster API's `pods/proxy` answers the same).
async fn admin_pod_metrics(
    State(s): State<Arc<Shared>>,
    Path((id, ns, name)): Path<(String, String, String)>,
) -> Response {
    let objects = s.clusters.objects();
    let Some(objs) = objects.get(&id) else {
        return (StatusCode::NOT_FOUND, format!("cluster {id} not found\n")).into_response();
    };
    let objs: Vec<Arc<Value>> = objs.iter().cloned().map(Arc::new).collect();
    let objs = dataplane_sim::objects::Objects::new(&objs);
    let Some(pod) = dataplane_sim::objects::find(&objs, "Pod", "", &ns, &name) else {
        return (
            StatusCode::NOT_FOUND,
            format!("pod {ns}/{name} not found\n"),
        )
            .into_response();
    };
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        pod_metrics_text(&objs, pod),
    )
        .into_response()
}

/// The router for the DO API and the admin endpoints.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let v2 = Router::new()
        .route("/v2/vpcs", get(vpcs_list).post(vpcs_create))
        .route("/v2/vpcs/{id}", get(vpcs_get).delete(vpcs_delete))
        .route(
            "/v2/kubernetes/clusters",
            get(clusters_list).post(clusters_create),
        )
        .route(
            "/v2/kubernetes/clusters/{id}",
            get(clusters_get).delete(clusters_delete),
        )
        .route("/v2/kubernetes/clusters/{id}/kubeconfig", get(kubeconfig))
        .route("/v2/kubernetes/clusters/{id}/credentials", get(credentials))
        .route(
            "/v2/kubernetes/clusters/{id}/node_pools",
            get(pools_list).post(pools_create),
        )
        .route(
            "/v2/kubernetes/clusters/{id}/node_pools/{pool}",
            get(pools_get).put(pools_update).delete(pools_delete),
        )
        .route(
            "/v2/kubernetes/clusters/{id}/node_pools/{pool}/nodes/{node}",
            axum::routing::delete(nodes_delete),
        )
        .route("/v2/load_balancers", get(lbs_list))
        .route("/v2/load_balancers/{id}", get(lbs_get))
        .route_layer(middleware::from_fn_with_state(shared.clone(), guard));
    let admin = Router::new()
        .route("/_sim/inventory", get(admin_inventory))
        .route("/_sim/faults", get(admin_faults_get).put(admin_faults_put))
        .route(
            "/_sim/faults/armed",
            get(admin_armed_get)
                .post(admin_armed_arm)
                .delete(admin_armed_disarm),
        )
        .route("/_sim/delays", get(admin_delays_get).put(admin_delays_put))
        .route(
            "/_sim/capacity",
            get(admin_capacity_get).put(admin_capacity_put),
        )
        .route("/_sim/model", get(admin_model_get).put(admin_model_put))
        .route("/_sim/stats", get(admin_stats))
        .route("/_sim/stats/reset", post(admin_stats_reset))
        .route("/_sim/nodes/{name}/kill", post(admin_kill_node))
        .route(
            "/_sim/clusters/{id}/pods/{ns}/{name}/metrics",
            get(admin_pod_metrics),
        );
    Router::new()
        .merge(v2)
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(common_headers))
        .layer(axum::extract::DefaultBodyLimit::max(1024 * 1024))
        .with_state(shared)
}
