//! Making a [`KubeClient`] for a cluster: from a kubeconfig or DigitalOcean's token credentials,
//! over a connection stack of our own that speaks HTTP/2 wherever the API server does (asked
//! once, when the client is made), so that one connection carries every request and watch of the
//! cluster, with pings and TCP keepalive to notice a cluster lost without a word.

use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::retry::RetryConfig;

use super::{KubeClient, KubeError};

/// How often an HTTP/2 connection is pinged, and how long a ping may go unanswered before the
/// connection is taken for dead: what notices a cluster lost without a word under a watch,
/// which may be silent for minutes.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Idle HTTP/1.1 connections kept per cluster, for a server that does not speak HTTP/2: as many
/// as a pass's lists at once.
const MAX_IDLE_HTTP1: usize = 16;

/// Transport settings of a [`KubeClient`].
#[derive(Debug, Clone)]
pub struct KubeClientOptions {
    pub connect_timeout: Duration,
    /// Time to wait for a response's headers (a watch's body then streams for minutes).
    pub read_timeout: Duration,
    /// How long an HTTP/1.1 connection no request used stays pooled. An HTTP/2 connection stays
    /// while its client lives: the cluster's watches run on it between requests.
    pub idle_timeout: Duration,
    pub retry: RetryConfig,
}

impl Default for KubeClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            retry: RetryConfig::default(),
        }
    }
}

impl KubeClient {
    /// A client from a kubeconfig document (its current context), e.g. the one DigitalOcean's
    /// `/v2/kubernetes/clusters/{id}/kubeconfig` returns. Plain `http://` servers work.
    pub async fn from_kubeconfig_yaml(
        yaml: &str,
        field_manager: &str,
    ) -> Result<KubeClient, KubeError> {
        Self::from_kubeconfig_yaml_with(yaml, field_manager, KubeClientOptions::default()).await
    }

    pub async fn from_kubeconfig_yaml_with(
        yaml: &str,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        // Errors from here may quote the document; say what failed without echoing it (it
        // carries the cluster token).
        let kubeconfig = Kubeconfig::from_yaml(yaml).map_err(|_| {
            KubeError::Config("the kubeconfig is not valid YAML of a kubeconfig".into())
        })?;
        Self::from_kubeconfig(kubeconfig, field_manager, options).await
    }

    /// A client from a cluster's token credentials, as DigitalOcean's
    /// `/v2/kubernetes/clusters/{id}/credentials` returns them: the server is trusted through
    /// exactly the CA they carry (the system's roots when there is none).
    pub async fn from_credentials(
        credentials: &crate::digitalocean::ClusterCredentials,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        // The same document a kubeconfig download holds, so that both paths build clients the
        // same way (kube decodes the CA data and sets up TLS from it).
        let mut cluster = serde_json::json!({"server": credentials.server});
        if !credentials.certificate_authority_data.is_empty() {
            cluster["certificate-authority-data"] =
                credentials.certificate_authority_data.clone().into();
        }
        let doc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": "user", "user": {"token": credentials.token}}],
            "contexts": [{"name": "context", "context": {"cluster": "cluster", "user": "user"}}],
            "current-context": "context",
        });
        let kubeconfig: Kubeconfig = serde_json::from_value(doc)
            .map_err(|_| KubeError::Config("the credentials do not make a kubeconfig".into()))?;
        Self::from_kubeconfig(kubeconfig, field_manager, options).await
    }

    async fn from_kubeconfig(
        kubeconfig: Kubeconfig,
        field_manager: &str,
        options: KubeClientOptions,
    ) -> Result<KubeClient, KubeError> {
        if field_manager.is_empty() {
            return Err(KubeError::Config(
                "the field manager must not be empty".into(),
            ));
        }
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| {
                KubeError::Config(format!(
                    "the kubeconfig cannot be used: {}",
                    kubeconfig_error_kind(&e)
                ))
            })?;
        // A plain-http server never negotiates TLS, so it needs no trust store; without one,
        // kube-rs would load and parse the system's whole CA bundle for every client.
        if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
            config.root_cert = Some(Vec::new());
        }
        let client = one_connection_client(&config, &options, Protocol::Negotiated)?;
        let client = match speaks_http2(&client).await {
            true => one_connection_client(&config, &options, Protocol::Http2)?,
            false => client,
        };
        Ok(Self::from_client(client, field_manager, options.retry))
    }
}

/// The HTTP versions a client may speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    /// HTTP/2 where the server picks it through ALPN, else HTTP/1.1, whose idle connections
    /// leave the pool after [`KubeClientOptions::idle_timeout`].
    Negotiated,
    /// HTTP/2 only, for a server seen to speak it: one connection is made at a time and shared,
    /// and it is kept while the client lives (its pings find it dead). hyper's pool would drop
    /// a connection no request used for its idle timeout, though watches still run on it, and
    /// the next request would open a second one beside it.
    Http2,
}

/// Whether the server answered `GET /version` over HTTP/2 (real API servers do, through ALPN).
/// Asked once when a client is made; if the question fails, the client negotiates as before.
async fn speaks_http2(client: &Client) -> bool {
    let Ok(request) = http::Request::get("/version").body(kube::client::Body::empty()) else {
        return false;
    };
    match client.send(request).await {
        Ok(response) => response.version() == http::Version::HTTP_2,
        Err(e) => {
            tracing::debug!(error = %e, "asking the API server its version failed");
            false
        }
    }
}

/// A kube client that speaks HTTP/2 to the cluster wherever the server offers it (real API
/// servers do, through ALPN): every request and watch of the cluster then shares one
/// connection, so a worker's descriptors grow with the clusters it uses, not with its requests
/// and watches. kube-rs's own stack offers HTTP/1.1 only. The rest is as kube-rs builds it:
/// its TLS configuration (the kubeconfig's CA, nothing else), base URI and authentication.
fn one_connection_client(
    config: &Config,
    options: &KubeClientOptions,
    protocol: Protocol,
) -> Result<Client, KubeError> {
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt;
    let failed = |e: &dyn std::fmt::Display| KubeError::Config(format!("building the client: {e}"));
    // What this stack does not do is refused rather than silently skipped (DOKS credentials
    // carry neither).
    if config.proxy_url.is_some() {
        return Err(failed(&"a proxy is not supported"));
    }
    if config.tls_server_name.is_some() {
        return Err(failed(&"tls-server-name is not supported"));
    }
    let tls = config.rustls_client_config().map_err(|e| failed(&e))?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(options.connect_timeout));
    // An HTTP/1.1 connection has no pings: TCP's keepalive notices a peer gone without a word
    // (a NAT or load balancer dropping the connection) under a quiet watch.
    http.set_keepalive(Some(KEEP_ALIVE_INTERVAL));
    http.set_keepalive_interval(Some(KEEP_ALIVE_INTERVAL / 3));
    http.set_keepalive_retries(Some(3));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    let mut builder = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(options.idle_timeout)
        .pool_max_idle_per_host(MAX_IDLE_HTTP1)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .http2_keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .http2_keep_alive_while_idle(true);
    if protocol == Protocol::Http2 {
        builder.http2_only(true).pool_idle_timeout(None);
    }
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> = builder.build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().map_err(|e| failed(&e))?)
        .layer(config.extra_headers_layer().map_err(|e| failed(&e))?)
        // Until the response's headers: a watch's body goes on for minutes after them.
        .layer(tower::timeout::TimeoutLayer::new(options.read_timeout))
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(Client::new(service, config.default_namespace.clone()))
}

/// Names the kind of kubeconfig problem without quoting values (which may hold the token).
fn kubeconfig_error_kind(e: &kube::config::KubeconfigError) -> String {
    let s = e.to_string();
    // The variants' messages are fixed strings followed by details; keep the fixed part.
    s.split(':').next().unwrap_or("invalid").trim().to_string()
}
