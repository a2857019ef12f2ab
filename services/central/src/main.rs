use clap::{Parser, Subcommand};
use uuid::Uuid;

#[derive(Parser)]
#[command(name = "central", about = "Central Dedicated Inference API")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the public API.
    Serve(central::Config),
    /// Mint an API token for a team and print it (the only time its value is shown).
    MintToken {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
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
            let value = common::tokens::mint(common::tokens::API_TOKEN_PREFIX);
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
        Command::Migrate { database_url } => {
            let _telemetry = common::telemetry::init("central");
            let pool = sqlx::PgPool::connect(&database_url).await?;
            central_store::MIGRATOR.run(&pool).await?;
            tracing::info!("migrations applied");
        }
        Command::Openapi => {
            println!("{}", central::openapi_json());
        }
    }
    Ok(())
}
