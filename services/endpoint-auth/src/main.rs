//! `endpoint-auth`: the Envoy HTTP external-authorization service of one DI's namespace (see the
//! library's docs). Reads the access-token Secret through the in-cluster Kubernetes config.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use endpoint_auth::{router, HashSource};

#[derive(Parser)]
#[command(
    name = "endpoint-auth",
    about = "Checks a DI endpoint's bearer tokens for Envoy (HTTP ext_authz)"
)]
struct Args {
    /// Address to serve `/check/*`, `/healthz` and `/readyz` on.
    #[arg(long, env = "LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Namespace of the access-token Secret (the DI's; the pod's own via the downward API).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: String,
    /// Name of the access-token Secret.
    #[arg(long, env = "ACCESS_TOKENS_SECRET", default_value = "access-tokens")]
    secret: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = common::telemetry::init("endpoint-auth");
    let args = Args::parse();
    let client = kube::Client::try_default()
        .await
        .context("loading the Kubernetes client configuration")?;
    let (hashes, feed) = HashSource::watch_secret(client, &args.namespace, &args.secret);
    let feed = tokio::spawn(feed);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %args.listen, namespace = %args.namespace, secret = %args.secret, "serving");
    axum::serve(common::listener::no_delay(listener), router(hashes))
        .with_graceful_shutdown(common::telemetry::shutdown_signal())
        .await
        .context("serving")?;
    tracing::info!("shut down");
    feed.abort();
    Ok(())
}
