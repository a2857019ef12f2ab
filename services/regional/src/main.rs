use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    common::telemetry::init("regional");
    let config = regional::Config::parse();
    let server = regional::Server::start(config).await?;
    tracing::info!(addr = %server.addr, "regional service listening");
    tokio::signal::ctrl_c().await?;
    tracing::info!("shutting down");
    Ok(())
}
