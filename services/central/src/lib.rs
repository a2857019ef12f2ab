//! The central API: the public, DigitalOcean-compatible `/v2/dedicated-inferences` endpoint. It
//! authenticates bearer tokens (team + scopes), rate-limits per token, validates requests against
//! the catalog, owns the ownership map (DI id → team, region) and a read model of every DI, and
//! forwards writes to the region that owns the DI. It never holds desired state of its own beyond
//! what makes a create exactly-once, and never talks to the cloud.

pub mod app;
pub mod auth;
pub mod body;
pub mod error;
pub mod feed;
pub mod handlers;
pub mod regions;
pub mod reseal;
pub mod validate;

use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;
use central_store::CentralStore;
use common::seal::Sealer;

use crate::auth::Authenticator;
use crate::error::ApiError;
use crate::regions::Regions;
use api_types::catalog::{self, Catalog};

pub use handlers::ApiDoc;

#[derive(clap::Args, Debug, Clone)]
pub struct Config {
    /// The public API.
    #[arg(long, env = "LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// `GET /metrics` (Prometheus), for operators only: never the public API's address.
    #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: SocketAddr,
    /// Postgres URL of central's database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Base64 of the 32-byte key API tokens are minted with and recognised by (their MAC): a
    /// value this key did not mint is refused without a database query. Changing it invalidates
    /// every token minted with it.
    #[arg(long, env = "API_TOKEN_KEY", hide_env_values = true)]
    pub api_token_key: String,
    /// Base64 of the 32-byte key sealing secrets at rest (pending creates, replayable responses).
    #[arg(long, env = "SEAL_KEY", hide_env_values = true)]
    pub seal_key: String,
    /// More keys that open sealed values but never seal, comma-separated: the previous
    /// `SEAL_KEY` while a rotation re-seals (`central reseal`), or the next one while it reaches
    /// every replica before it becomes `SEAL_KEY`.
    #[arg(
        long,
        env = "SEAL_OPEN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub seal_open_keys: Vec<String>,
    /// Regional services, `name=base_url`, comma-separated.
    #[arg(long, env = "REGIONS", value_delimiter = ',')]
    pub regions: Vec<String>,
    /// Shared secrets of the regional services, `name=secret`, comma-separated.
    #[arg(
        long,
        env = "REGION_SECRETS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub region_secrets: Vec<String>,
    /// PEM bundle of the CA(s) that sign the regional services' certificates, trusted (besides
    /// the public roots) for `https://` region URLs. Read at start.
    #[arg(long, env = "REGION_CA_FILE")]
    pub region_ca_file: Option<std::path::PathBuf>,
    /// The URL clients reach this API at, used in pagination links. Defaults to `http://LISTEN`.
    #[arg(long, env = "PUBLIC_URL")]
    pub public_url: Option<String>,
    /// A catalog file replacing the one built in.
    #[arg(long, env = "CATALOG")]
    pub catalog: Option<std::path::PathBuf>,
    /// How long a token read from the database is trusted without reading it again: how long
    /// a revoked token may still work. At most 5000.
    #[arg(long, env = "AUTH_CACHE_TTL_MS", default_value_t = 1000)]
    pub auth_cache_ttl_ms: u64,
    /// Failed authentications per client address per minute (also how many may fail at once);
    /// beyond, 429 and no database lookup for tokens this replica has not seen.
    #[arg(long, env = "AUTH_FAILURES_PER_MINUTE", default_value_t = 10)]
    pub auth_failures_per_minute: u32,
    /// A header holding the client's address, set by the proxy in front of central (e.g.
    /// `X-Forwarded-For`; the last address in it counts). Only when every request comes through
    /// that proxy: a client reaching central directly could claim any address. Unset: the TCP
    /// peer's address.
    #[arg(long, env = "CLIENT_IP_HEADER")]
    pub client_ip_header: Option<String>,
    /// Requests per token per hour unless the token has its own limit.
    #[arg(long, env = "RATE_LIMIT_PER_HOUR", default_value_t = 5000)]
    pub rate_limit_per_hour: u32,
    #[arg(long, env = "REGION_TIMEOUT_MS", default_value_t = 5000)]
    pub region_timeout_ms: u64,
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 32)]
    pub db_max_connections: u32,
    /// Run the change-feed consumers and create recovery in this process.
    #[arg(long, env = "BACKGROUND", default_value_t = true, action = clap::ArgAction::Set)]
    pub background: bool,
}

pub struct Inner {
    pub store: CentralStore,
    pub regions: Regions,
    /// How long one attempt at sending a create or keyed operation to its region may last:
    /// longer than any region call (see `App::drive_create`).
    pub drive_lease: Duration,
    pub catalog: Catalog,
    pub sealer: Sealer,
    pub auth: Authenticator,
    pub public_url: String,
}

/// Shared application state; cheap to clone.
#[derive(Clone)]
pub struct App(Arc<Inner>);

impl Deref for App {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

fn pairs(items: &[String], what: &str) -> anyhow::Result<Vec<(String, String)>> {
    items
        .iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| anyhow::anyhow!("{what} entries look like name=value"))
        })
        .collect()
}

impl App {
    pub async fn new(config: &Config) -> anyhow::Result<App> {
        // A request waits up to 5 s for a connection, then is answered 503.
        let pool = common::db::pool_options(config.db_max_connections, Duration::from_secs(5))
            .connect(&config.database_url)
            .await?;
        let store = CentralStore::new(pool);
        store.migrate().await?;
        let catalog = match &config.catalog {
            Some(path) => Catalog::parse(&std::fs::read_to_string(path)?)?,
            None => Catalog::parse(catalog::EMBEDDED)?,
        };
        let secrets = pairs(&config.region_secrets, "REGION_SECRETS")?;
        let mut endpoints = Vec::new();
        for (name, url) in pairs(&config.regions, "REGIONS")? {
            let secret = secrets
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, s)| s.clone())
                .ok_or_else(|| anyhow::anyhow!("no shared secret configured for region {name}"))?;
            endpoints.push((name, url, secret));
        }
        let region_roots = match &config.region_ca_file {
            Some(path) => regions::roots(path)?,
            None => Vec::new(),
        };
        let regions = Regions::new(
            endpoints,
            Duration::from_millis(config.region_timeout_ms),
            &region_roots,
        )?;
        Ok(App(Arc::new(Inner {
            store,
            regions,
            // A region call is one request bounded by the region timeout: twice that, and
            // some, covers an attempt and its bookkeeping.
            drive_lease: Duration::from_millis(config.region_timeout_ms) * 2
                + Duration::from_secs(5),
            catalog,
            sealer: Sealer::from_keys(&config.seal_key, &config.seal_open_keys)?,
            auth: Authenticator::new(
                common::tokens::ApiTokenKey::from_base64(&config.api_token_key)?,
                Duration::from_millis(config.auth_cache_ttl_ms),
                config.rate_limit_per_hour,
                config.auth_failures_per_minute,
                config.client_ip_header.as_deref(),
            )?,
            public_url: config
                .public_url
                .clone()
                .unwrap_or_else(|| format!("http://{}", config.listen))
                .trim_end_matches('/')
                .to_string(),
        })))
    }
}

pub fn router(app: App) -> axum::Router {
    handlers::routes()
        .fallback(|| async { ApiError::NotFound.into_response() })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed.into_response() })
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            auth::layer,
        ))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .layer(axum::middleware::from_fn(common::metrics::layer))
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            "central",
            common::request_id::layer,
        ))
        .with_state(app)
}

/// A running central API.
pub struct Server {
    pub addr: SocketAddr,
    /// Where `/metrics` is served.
    pub metrics_addr: SocketAddr,
    pub app: App,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Server {
    pub async fn start(config: Config) -> anyhow::Result<Server> {
        let app = App::new(&config).await?;
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let metrics_listener = tokio::net::TcpListener::bind(config.metrics_listen)
            .await
            .map_err(|e| anyhow::anyhow!("metrics listener on {}: {e}", config.metrics_listen))?;
        let metrics_addr = metrics_listener.local_addr()?;
        let mut tasks = if config.background {
            feed::spawn(app.clone())
        } else {
            Vec::new()
        };
        tasks.push(tokio::spawn(app.store.watch_read_cache()));
        tasks.push(tokio::spawn(common::metrics::serve(metrics_listener)));
        // The peer's address is the client's (failed authentications are budgeted by it).
        let router = router(app.clone()).into_make_service_with_connect_info::<SocketAddr>();
        tasks.push(tokio::spawn(async move {
            if let Err(error) = axum::serve(common::listener::no_delay(listener), router).await {
                tracing::error!(%error, "central server stopped");
            }
        }));
        Ok(Server {
            addr,
            metrics_addr,
            app,
            tasks,
        })
    }
}

/// The public OpenAPI document, as committed in `openapi/public.json`.
pub fn openapi_json() -> String {
    use utoipa::OpenApi;
    ApiDoc::openapi()
        .to_pretty_json()
        .expect("OpenAPI document serialises")
}
