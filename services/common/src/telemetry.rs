//! Structured logging set-up shared by every binary: JSON lines when `LOG_FORMAT=json`, readable
//! text otherwise, filtered by `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

pub fn init(service: &'static str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let json = std::env::var("LOG_FORMAT")
        .map(|f| f == "json")
        .unwrap_or(false);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let result = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
    if result.is_ok() {
        tracing::info!(service, "logging initialised");
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, which is what Kubernetes sends to stop a pod.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
