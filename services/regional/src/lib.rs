//! The regional service: one per region, the source of truth for that region's desired state. It
//! serves an internal JSON API to central only (authenticated with the region's shared secret),
//! turns each call into one regional-store method, and publishes the change feed central's read
//! model is built from. It does not validate against the catalog (central does) and never returns
//! secrets. Before it stores a change it asks two questions: of the cloud, which VPC a create
//! lands in ([`vpcs`]: a team's own, or its default); of the Hugging Face Hub, whether a
//! customer's own model can be served as declared ([`models`]). It configures the team quotas its
//! store enforces, and gives operators `regional quota` to set a team's own ([`quota`]) and
//! `regional fleet` to pause or resume a rollout of a new worker rendering ([`fleet`]). It makes
//! each DI's certificate authority and, in the background, renews those nearing their end
//! ([`ca`]). Everything else in the cloud is the workers' business.

pub mod ca;
pub mod fleet;
mod handlers;
pub mod models;
pub mod quota;
pub mod tls;
pub mod vpcs;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use api_types::regional::{RegionError, SECRET_HEADER};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use common::errors::{Classify, ErrorClass};
use common::seal::Sealer;
use region_store::{Store, StoreError};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

pub use handlers::ApiDoc;

#[derive(clap::Parser, Debug, Clone)]
#[command(name = "regional", about = "Regional Dedicated Inference service")]
pub struct Config {
    /// Region this service owns.
    #[arg(long, env = "REGION", default_value = "atl1")]
    pub region: String,
    /// The internal API for central.
    #[arg(long, env = "LISTEN", default_value = "127.0.0.1:8101")]
    pub listen: SocketAddr,
    /// `GET /metrics` (Prometheus), for operators only: not the API's address.
    #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: SocketAddr,
    /// Postgres URL of the regional database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Shared secret central presents in `x-region-secret`.
    #[arg(long, env = "REGION_SECRET", hide_env_values = true)]
    pub region_secret: String,
    /// A second secret accepted while the shared secret is rotated: set the new one here, then
    /// in central, then make it `REGION_SECRET` and drop this.
    #[arg(long, env = "REGION_SECRET_NEXT", hide_env_values = true)]
    pub region_secret_next: Option<String>,
    /// Base64 of the 32-byte key sealing secrets at rest.
    #[arg(long, env = "SEAL_KEY", hide_env_values = true)]
    pub seal_key: String,
    /// More keys that open sealed values but never seal, comma-separated: the previous
    /// `SEAL_KEY` while a rotation re-seals (`regional reseal`), or the next one while it reaches
    /// every service before it becomes `SEAL_KEY`.
    #[arg(
        long,
        env = "SEAL_OPEN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub seal_open_keys: Vec<String>,
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,
    /// The region's DigitalOcean API, asked which VPCs a team owns.
    #[arg(long, env = "DO_API_URL")]
    pub do_api_url: String,
    /// The platform's DigitalOcean API token.
    #[arg(long, env = "DO_TOKEN", hide_env_values = true)]
    pub do_token: String,
    /// The Hugging Face Hub, asked whether a customer's own model can be served.
    #[arg(long, env = "HF_ENDPOINT", default_value = "https://huggingface.co")]
    pub hf_endpoint: String,
    /// A catalog file replacing the one built in (the same file central reads).
    #[arg(long, env = "CATALOG")]
    pub catalog: Option<std::path::PathBuf>,
    /// HTTPS: `TLS_CERT_FILE`, `TLS_KEY_FILE`, `TLS_RELOAD_SECS`.
    #[command(flatten)]
    pub tls: tls::TlsArgs,
    /// The DIs' CAs: `CA_VALIDITY_DAYS`, `CA_RENEW_BEFORE_DAYS`, `CA_PERMITTED_NAMES`.
    #[command(flatten)]
    pub ca: ca::CaPolicy,
    /// Every team's limits unless it has its own: `QUOTA_DEDICATED_INFERENCES`, `QUOTA_GPUS`,
    /// `QUOTA_GPUS_PER_SIZE`.
    #[command(flatten)]
    pub quotas: quota::QuotaArgs,
}

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub vpcs: vpcs::Vpcs,
    pub models: models::Models,
    /// How the DIs' CAs are made.
    pub ca: ca::CaPolicy,
    /// Digests of the accepted shared secrets (two while one is rotated).
    secret_hashes: Vec<[u8; 32]>,
    /// Woken whenever the outbox grows (Postgres NOTIFY), for long-polling change feeds.
    pub changed: Arc<Notify>,
}

pub struct Server {
    pub addr: SocketAddr,
    /// Where `/metrics` is served.
    pub metrics_addr: SocketAddr,
    pub store: Store,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// How long the region remembers an applied operation: central repeats one for at most a day.
const APPLIED_OPERATIONS_KEPT: Duration = Duration::from_secs(2 * 24 * 3600);

impl Server {
    /// Connects, migrates, binds and serves in the background.
    pub async fn start(config: Config) -> anyhow::Result<Server> {
        let tls = tls::Tls::load(&config.tls)?;
        config.ca.check()?;
        // A request waits up to 5 s for a connection, then is answered 503.
        let pool = common::db::pool_options(config.db_max_connections, Duration::from_secs(5))
            .connect(&config.database_url)
            .await?;
        let catalog = quota::catalog(config.catalog.as_deref())?;
        let store = Store::new(
            pool,
            Sealer::from_keys(&config.seal_key, &config.seal_open_keys)?,
        )
        .with_quotas(config.quotas.quotas(&config.region, &catalog));
        store.migrate().await?;
        let changed = Arc::new(Notify::new());
        let listener_task = tokio::spawn(listen_for_changes(store.pool().clone(), changed.clone()));
        let purge_task = tokio::spawn(purge_applied_operations(store.clone()));
        let renewal_task = tokio::spawn(renew_certificate_authorities(
            store.clone(),
            config.ca.clone(),
        ));
        let state = AppState {
            store: store.clone(),
            vpcs: vpcs::Vpcs::new(&config.region, &config.do_api_url, &config.do_token)?,
            models: models::Models::new(&config.region, &config.hf_endpoint, catalog)?,
            ca: config.ca.clone(),
            secret_hashes: std::iter::once(&config.region_secret)
                .chain(config.region_secret_next.iter().filter(|s| !s.is_empty()))
                .map(|s| Sha256::digest(s.as_bytes()).into())
                .collect(),
            changed,
        };
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let metrics_listener = tokio::net::TcpListener::bind(config.metrics_listen)
            .await
            .map_err(|e| anyhow::anyhow!("metrics listener on {}: {e}", config.metrics_listen))?;
        let metrics_addr = metrics_listener.local_addr()?;
        let app = router(state);
        let mut tasks = tls::serve(listener, app, tls)?;
        tasks.extend([
            listener_task,
            purge_task,
            renewal_task,
            tokio::spawn(common::metrics::serve(metrics_listener)),
        ]);
        Ok(Server {
            addr,
            metrics_addr,
            store,
            tasks,
        })
    }
}

/// Retries for what the regional service asks while central waits for its answer (the cloud's
/// VPCs, the Hub's models): brief, so that the whole answer arrives well inside that wait.
fn retry_within_a_request() -> cloud_clients::retry::RetryConfig {
    cloud_clients::retry::RetryConfig {
        min_delay: Duration::from_millis(100),
        max_delay: Duration::from_millis(500),
        max_attempts: 3,
        max_elapsed: Duration::from_secs(3),
        max_retry_after: Duration::from_secs(1),
        jitter: true,
    }
}

pub fn router(state: AppState) -> axum::Router {
    handlers::routes()
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_secret,
        ))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .layer(axum::middleware::from_fn(common::metrics::layer))
        .layer(axum::middleware::from_fn_with_state(
            "regional",
            common::request_id::layer,
        ))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(256 * 1024))
        .with_state(state)
}

async fn require_secret(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(SECRET_HEADER)
        .map(|v| Sha256::digest(v.as_bytes()));
    // Comparing digests keeps the comparison's timing independent of the secret.
    match presented {
        Some(digest) if state.secret_hashes.iter().any(|h| digest.as_slice() == h) => {
            next.run(req).await
        }
        _ => ApiError::Unauthorized.into_response(),
    }
}

async fn listen_for_changes(pool: sqlx::PgPool, changed: Arc<Notify>) {
    loop {
        match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                if let Err(error) = listener.listen("di_changes").await {
                    tracing::warn!(%error, "LISTEN failed");
                } else {
                    // `Ok(None)`: the connection dropped and sqlx listens again on a new one;
                    // whatever was notified in between is lost, so long-pollers re-read.
                    while listener.try_recv().await.is_ok() {
                        changed.notify_waiters();
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "change listener could not connect"),
        }
        // Wake any long-poller so it re-reads rather than waiting out a notification we missed.
        changed.notify_waiters();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn purge_applied_operations(store: Store) {
    let mut hourly = tokio::time::interval(Duration::from_secs(3600));
    loop {
        hourly.tick().await;
        if let Err(error) = store
            .applied_operations_purge(APPLIED_OPERATIONS_KEPT)
            .await
        {
            tracing::warn!(%error, "purging applied operations failed");
        }
    }
}

/// Renews the DIs' CAs that near their end, at start and hourly (a window of months needs no
/// more); every replica may, the store lets only one renewal per DI through.
async fn renew_certificate_authorities(store: Store, policy: ca::CaPolicy) {
    let mut hourly = tokio::time::interval(Duration::from_secs(3600));
    loop {
        hourly.tick().await;
        match ca::renew_due(&store, &policy).await {
            Ok(0) => {}
            Ok(renewed) => tracing::info!(renewed, "certificate authorities renewed"),
            Err(error) => tracing::warn!(%error, "renewing certificate authorities failed"),
        }
    }
}

/// The regional API's errors. Internal detail goes to the log, never into the body.
#[derive(Debug)]
pub enum ApiError {
    Unauthorized,
    NotFound,
    Conflict(String),
    Unprocessable(String),
    BadRequest(String),
    /// A dependency (the DigitalOcean API) did not answer; nothing was stored, a retry may work.
    Unavailable(String),
    /// The region's database is unavailable for now (restarting, failing over): a retry may work,
    /// but whether a write landed is unknown, so central must not take it as refused.
    DatabaseUnavailable(String),
    Internal(String),
}

impl From<StoreError> for ApiError {
    /// The answer to the region's database failing, by the failure's class. (The cloud's and
    /// the Hub's failures are read where their answers are worded: `vpcs` and `models`.)
    fn from(e: StoreError) -> Self {
        match e.class() {
            ErrorClass::NotFound => ApiError::NotFound,
            // The store words conflicts and refusals for the customer.
            ErrorClass::Conflict => ApiError::Conflict(e.to_string()),
            ErrorClass::Refused => ApiError::Unprocessable(e.to_string()),
            ErrorClass::Transient { .. } => ApiError::DatabaseUnavailable(e.to_string()),
            ErrorClass::Unauthorized | ErrorClass::Permanent => ApiError::Internal(e.to_string()),
        }
    }
}

/// What a `503` asks central to wait before it retries, seconds.
const RETRY_AFTER_SECS: u32 = 2;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, id, message) = match self {
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong region secret".into(),
            ),
            ApiError::NotFound => (
                StatusCode::NOT_FOUND,
                "not_found",
                "The resource you requested could not be found.".into(),
            ),
            ApiError::Conflict(m) => (StatusCode::CONFLICT, "conflict", m),
            ApiError::Unprocessable(m) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "unprocessable_entity", m)
            }
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, "bad_request", m),
            ApiError::Unavailable(detail) => {
                tracing::warn!(%detail, "dependency unavailable");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    api_types::regional::DEPENDENCY_UNAVAILABLE,
                    "A dependency is unavailable and nothing was changed; retry shortly".into(),
                )
            }
            ApiError::DatabaseUnavailable(detail) => {
                tracing::warn!(%detail, "database unavailable");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "The region's database is unavailable; retry shortly".into(),
                )
            }
            ApiError::Internal(detail) => {
                tracing::error!(%detail, "internal error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "Unexpected server-side error".into(),
                )
            }
        };
        let mut response = (
            status,
            Json(RegionError {
                id: id.into(),
                message,
            }),
        )
            .into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_SECS),
            );
        }
        response
    }
}

/// The regional API's OpenAPI document, as committed in `openapi/regional.json`.
pub fn openapi_json() -> String {
    use utoipa::OpenApi;
    ApiDoc::openapi()
        .to_pretty_json()
        .expect("OpenAPI document serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn answer(e: StoreError) -> (StatusCode, Option<String>, RegionError) {
        let response = ApiError::from(e).into_response();
        let status = response.status();
        let retry_after = response
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, retry_after, serde_json::from_slice(&body).unwrap())
    }

    /// Each class of the database's failures keeps the answer central reads it by: a 503 with
    /// `service_unavailable` (whether it landed is unknown), the store's own words for a
    /// conflict or a refusal, and nothing of the driver's in a body.
    #[tokio::test]
    async fn store_errors_keep_their_answers() {
        let (status, retry, body) = answer(StoreError::NotFound).await;
        assert_eq!(
            (status, retry, body.id.as_str()),
            (StatusCode::NOT_FOUND, None, "not_found")
        );
        let (status, _, body) = answer(StoreError::Conflict("current version is 2".into())).await;
        assert_eq!(
            (status, body.id.as_str()),
            (StatusCode::CONFLICT, "conflict")
        );
        assert_eq!(body.message, "current version is 2");
        let (status, _, body) = answer(StoreError::Unprocessable("over quota".into())).await;
        assert_eq!(
            (status, body.id.as_str(), body.message.as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                "unprocessable_entity",
                "over quota"
            )
        );
        let down = StoreError::Unavailable(region_store::sqlx::Error::PoolTimedOut);
        let (status, retry, body) = answer(down).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry.as_deref(), Some("2"));
        assert_eq!(body.id, "service_unavailable");
        for internal in [
            StoreError::Database(region_store::sqlx::Error::RowNotFound),
            StoreError::Seal,
            StoreError::LeaseLost,
        ] {
            let (status, _, body) = answer(internal).await;
            assert_eq!(
                (status, body.id.as_str()),
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
            );
        }
    }
}
