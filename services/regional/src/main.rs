use clap::Parser;

/// `regional migrate`: apply the embedded migrations to DATABASE_URL and exit.
#[derive(Parser)]
#[command(name = "regional migrate")]
struct Migrate {
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
}

/// `regional reseal`: seal every secret stored in the region again under SEAL_KEY, opening the
/// old ones with SEAL_OPEN_KEYS, in batches, while the services run. Once it reports nothing
/// unreadable, the old key can be dropped from SEAL_OPEN_KEYS everywhere. It can run again.
#[derive(Parser)]
#[command(name = "regional reseal")]
struct Reseal {
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    #[arg(long, env = "SEAL_KEY", hide_env_values = true)]
    seal_key: String,
    #[arg(
        long,
        env = "SEAL_OPEN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    seal_open_keys: Vec<String>,
    /// Rows read per query.
    #[arg(long, default_value_t = 500)]
    batch: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Its standard output is the JSON it shows: no log lines there.
    if std::env::args().nth(1).as_deref() == Some("quota") {
        return regional::quota::QuotaCommand::parse_from(std::env::args().skip(1))
            .run()
            .await;
    }
    if std::env::args().nth(1).as_deref() == Some("fleet") {
        return regional::fleet::FleetCommand::parse_from(std::env::args().skip(1))
            .run()
            .await;
    }
    let _telemetry = common::telemetry::init("regional");
    match std::env::args().nth(1).as_deref() {
        Some("migrate") => {
            let args = Migrate::parse_from(std::env::args().skip(1));
            let pool = sqlx::PgPool::connect(&args.database_url).await?;
            common::db::migrate(&region_store::MIGRATOR, &pool).await?;
            tracing::info!("migrations applied");
            return Ok(());
        }
        Some("reseal") => {
            let args = Reseal::parse_from(std::env::args().skip(1));
            let sealer = common::seal::Sealer::from_keys(&args.seal_key, &args.seal_open_keys)?;
            let key_id = sealer.key_id();
            let pool = sqlx::PgPool::connect(&args.database_url).await?;
            let store = region_store::Store::new(pool, sealer);
            store.migrate().await?;
            let report = store.reseal(args.batch.max(1)).await?;
            println!("re-sealed {} values under key {key_id}", report.resealed);
            if !report.unreadable.is_empty() {
                anyhow::bail!(
                    "{} values no configured key opens (dedicated inferences {:?}): keep the old key",
                    report.unreadable.len(),
                    report.unreadable
                );
            }
            return Ok(());
        }
        _ => {}
    }
    let config = regional::Config::parse();
    let server = regional::Server::start(config).await?;
    tracing::info!(addr = %server.addr, metrics = %server.metrics_addr, "regional service listening");
    common::telemetry::shutdown_signal().await;
    tracing::info!("shutting down");
    Ok(())
}
