use clap::Parser;

/// `regional migrate`: apply the embedded migrations to DATABASE_URL and exit.
#[derive(Parser)]
#[command(name = "regional migrate")]
struct Migrate {
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Its standard output is the JSON it shows: no log lines there.
    if std::env::args().nth(1).as_deref() == Some("quota") {
        return regional::quota::QuotaCommand::parse_from(std::env::args().skip(1))
            .run()
            .await;
    }
    let _telemetry = common::telemetry::init("regional");
    if std::env::args().nth(1).as_deref() == Some("migrate") {
        let args = Migrate::parse_from(std::env::args().skip(1));
        let pool = sqlx::PgPool::connect(&args.database_url).await?;
        region_store::MIGRATOR.run(&pool).await?;
        tracing::info!("migrations applied");
        return Ok(());
    }
    let config = regional::Config::parse();
    let server = regional::Server::start(config).await?;
    tracing::info!(addr = %server.addr, "regional service listening");
    common::telemetry::shutdown_signal().await;
    tracing::info!("shutting down");
    Ok(())
}
