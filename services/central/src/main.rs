use clap::{Parser, Subcommand};
use uuid::Uuid;

#[derive(Parser)]
#[command(name = "central", about = "Central Dedicated Inference API")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve the public API.
    Serve(central::Config),
    /// Mint an API token for a team and print it (the only time its value is shown).
    MintToken {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// The key central recognises its API tokens by (as `serve` has it).
        #[arg(long, env = "API_TOKEN_KEY", hide_env_values = true)]
        api_token_key: String,
        /// The team the token acts for; a new team when omitted.
        #[arg(long)]
        team: Option<Uuid>,
        #[arg(long, default_value = "cli")]
        name: String,
        /// Scopes, comma-separated; every dedicated inference scope when omitted.
        #[arg(long, value_delimiter = ',')]
        scopes: Vec<String>,
        /// Requests per hour for this token (the server default when omitted).
        #[arg(long)]
        rate_limit_per_hour: Option<i32>,
    },
    /// List a team's API tokens: id, name, scopes, when created and revoked (never a value).
    ListTokens {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long)]
        team: Uuid,
    },
    /// Revoke an API token by id. Every central replica refuses it within 5 s (the longest
    /// AUTH_CACHE_TTL_MS).
    RevokeToken {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// The token's id, as `list-tokens` shows it.
        id: Uuid,
    },
    /// Seal everything central keeps sealed again under SEAL_KEY, opening the old values with
    /// SEAL_OPEN_KEYS, in batches, while the replicas serve. Once it reports nothing unreadable,
    /// the old key can be dropped from SEAL_OPEN_KEYS everywhere. It can run again.
    Reseal {
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
    },
    /// Apply the embedded migrations to DATABASE_URL and exit.
    Migrate {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Print the public OpenAPI document.
    Openapi,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(config) => {
            let _telemetry = common::telemetry::init("central");
            let server = central::Server::start(config).await?;
            tracing::info!(addr = %server.addr, metrics = %server.metrics_addr, "central API listening");
            common::telemetry::shutdown_signal().await;
            tracing::info!("shutting down");
        }
        Command::MintToken {
            database_url,
            api_token_key,
            team,
            name,
            scopes,
            rate_limit_per_hour,
        } => {
            let pool = sqlx::PgPool::connect(&database_url).await?;
            let store = central_store::CentralStore::new(pool);
            store.migrate().await?;
            let scopes = if scopes.is_empty() {
                central::auth::SCOPES
                    .iter()
                    .map(|s| s.to_string())
                    .collect()
            } else {
                scopes
            };
            let team = team.unwrap_or_else(Uuid::new_v4);
            let value = common::tokens::ApiTokenKey::from_base64(&api_token_key)?.mint();
            store
                .api_token_create(
                    team,
                    &name,
                    &common::tokens::sha256(&value),
                    &scopes,
                    rate_limit_per_hour,
                )
                .await?;
            eprintln!("team {team}, scopes {}", scopes.join(","));
            println!("{value}");
        }
        Command::ListTokens { database_url, team } => {
            let store =
                central_store::CentralStore::new(sqlx::PgPool::connect(&database_url).await?);
            println!("ID\tNAME\tSCOPES\tCREATED\tREVOKED");
            for t in store.api_tokens_of_team(team).await? {
                let revoked = t.revoked_at.map_or("-".to_string(), |at| at.to_rfc3339());
                println!(
                    "{}\t{}\t{}\t{}\t{revoked}",
                    t.id,
                    t.name,
                    t.scopes.join(","),
                    t.created_at.to_rfc3339()
                );
            }
        }
        Command::RevokeToken { database_url, id } => {
            let store =
                central_store::CentralStore::new(sqlx::PgPool::connect(&database_url).await?);
            match store.api_token_revoke(id).await {
                Ok(()) => eprintln!("revoked {id}; refused everywhere within 5 s"),
                Err(central_store::StoreError::NotFound) => {
                    anyhow::bail!("no API token {id}, or it is revoked already")
                }
                Err(e) => return Err(e.into()),
            }
        }
        Command::Reseal {
            database_url,
            seal_key,
            seal_open_keys,
            batch,
        } => {
            let sealer = common::seal::Sealer::from_keys(&seal_key, &seal_open_keys)?;
            let pool = sqlx::PgPool::connect(&database_url).await?;
            let store = central_store::CentralStore::new(pool);
            store.migrate().await?;
            let report = central::reseal::reseal(&store, &sealer, batch.max(1)).await?;
            println!(
                "re-sealed {} values under key {}",
                report.resealed,
                sealer.key_id()
            );
            if !report.unreadable.is_empty() {
                anyhow::bail!(
                    "{} values no configured key opens ({:?}): keep the old key",
                    report.unreadable.len(),
                    report.unreadable
                );
            }
        }
        Command::Migrate { database_url } => {
            let _telemetry = common::telemetry::init("central");
            let pool = sqlx::PgPool::connect(&database_url).await?;
            common::db::migrate(&central_store::MIGRATOR, &pool).await?;
            tracing::info!("migrations applied");
        }
        Command::Openapi => {
            println!("{}", central::openapi_json());
        }
    }
    Ok(())
}
