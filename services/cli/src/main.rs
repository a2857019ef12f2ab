//! `dictl`, the command-line client people use to manage dedicated inferences through the
//! central API (`/v2/dedicated-inferences`, DigitalOcean-compatible, plus the `/events`
//! extension). The crate owns only the client side: argument parsing with environment fallbacks,
//! the HTTP calls (bearer token, an `Idempotency-Key` per write, retries after 429/503 honouring
//! `Retry-After`), following pagination, rendering tables and key/value views for terminals or the
//! API's JSON as is for scripts, `--wait` progress, and exit codes that say what happened
//! (0 ok, 1 API error, 2 usage, 3 the DI ended in error, 4 timeout, 5 API unreachable or 5xx).

mod client;
mod commands;
mod render;
mod wait;

use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use client::Client;
use commands::{
    accelerators, ca, create, delete, events, get, gpu_model_config, list, replicas, sizes, tokens,
    update,
};

#[derive(Parser)]
#[command(
    name = "dictl",
    version,
    about = "Manage Dedicated Inference endpoints",
    long_about = "Manage Dedicated Inference endpoints through the central API \
                  (/v2/dedicated-inferences).\n\nExit codes: 0 success, 1 API error (4xx), 2 usage \
                  error, 3 the dedicated inference ended in error while waiting, 4 timeout, \
                  5 API unreachable or server error (5xx)."
)]
struct Cli {
    /// Base URL of the central API.
    #[arg(
        long,
        global = true,
        env = "DI_API_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    api_url: String,
    /// API token (prefer the environment variable: arguments are visible to other users).
    #[arg(long, global = true, env = "DI_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Output format: `text` for people, `json` for the API's JSON as is.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create a dedicated inference from a JSON file (the create body, or just its spec).
    Create {
        /// The file (`-` for stdin).
        #[arg(short, long)]
        file: PathBuf,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Show one dedicated inference.
    Get { id: String },
    /// List dedicated inferences (every page).
    #[command(visible_alias = "ls")]
    List {
        /// Only this region.
        #[arg(long)]
        region: Option<String>,
        /// Only this name.
        #[arg(long)]
        name: Option<String>,
    },
    /// Change a dedicated inference's spec. Fields the file leaves out are taken from the latest
    /// spec (pending if any, else current), the version included.
    Update {
        id: String,
        /// The file (`-` for stdin): the PATCH body, or just a (partial) spec.
        #[arg(short, long)]
        file: PathBuf,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Delete a dedicated inference (asks first on a terminal).
    #[command(visible_alias = "rm")]
    Delete {
        id: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// The endpoint's access tokens.
    Tokens {
        #[command(subcommand)]
        command: TokensCommand,
    },
    /// GPU sizes, prices and regions.
    Sizes,
    /// Which models run on which GPUs.
    GpuModelConfig,
    /// A dedicated inference's lifecycle events, oldest first.
    Events { id: String },
    /// A dedicated inference's accelerators.
    Accelerators { id: String },
    /// Each model deployment's replicas (ready and wanted, with its autoscaling bounds) and the
    /// most recent scaling decisions.
    Replicas {
        id: String,
        /// How many recent scaling events to show.
        #[arg(long, default_value_t = 10)]
        events: usize,
    },
    /// The CA certificate (PEM) of a dedicated inference's private endpoint.
    Ca { id: String },
}

#[derive(Subcommand)]
enum TokensCommand {
    /// List the tokens of a dedicated inference.
    #[command(visible_alias = "ls")]
    List { id: String },
    /// Create a token; its value is shown once.
    Create { id: String, name: String },
    /// Revoke a token.
    #[command(visible_alias = "rm")]
    Delete { id: String, token_id: String },
}

#[derive(Args)]
struct WaitArgs {
    /// Wait until the operation finishes, showing progress.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits (e.g. 90s, 30m, 1h).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    timeout: Duration,
}

/// What went wrong, and so the exit code.
#[derive(Debug)]
pub enum Failure {
    Usage(String),
    Api {
        status: u16,
        id: String,
        message: String,
        request_id: String,
    },
    Unreachable(String),
    DiError(String),
    Timeout(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Api { status, .. } if *status >= 500 => 5,
            Failure::Api { .. } => 1,
            Failure::Usage(_) => 2,
            Failure::DiError(_) => 3,
            Failure::Timeout(_) => 4,
            Failure::Unreachable(_) => 5,
        }
    }

    /// Worth another poll: the API may answer next time.
    pub fn transient(&self) -> bool {
        self.code() == 5
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(m)
            | Failure::Unreachable(m)
            | Failure::DiError(m)
            | Failure::Timeout(m) => f.write_str(m),
            Failure::Api {
                status,
                id,
                message,
                request_id,
            } => {
                write!(f, "{id} (HTTP {status}): {message}")?;
                if !request_id.is_empty() {
                    write!(f, " [request_id: {request_id}]")?;
                }
                Ok(())
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("Error: cannot start: {e}");
            return ExitCode::from(5);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            match &failure {
                Failure::Api {
                    status,
                    id,
                    message,
                    request_id,
                } => {
                    eprintln!("Error: {message}");
                    eprintln!("  id:         {id}");
                    eprintln!("  status:     {status}");
                    if !request_id.is_empty() {
                        eprintln!("  request_id: {request_id}");
                    }
                }
                other => eprintln!("Error: {other}"),
            }
            ExitCode::from(failure.code())
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let token = cli
        .token
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| Failure::Usage("no API token: set DI_TOKEN or pass --token".into()))?;
    let client = Client::new(&cli.api_url, token)?;
    let out = cli.output;
    match cli.command {
        Command::Create { file, wait } => create(&client, out, &file, &wait).await,
        Command::Get { id } => get(&client, out, &id).await,
        Command::List { region, name } => list(&client, out, region, name).await,
        Command::Update { id, file, wait } => update(&client, out, &id, &file, &wait).await,
        Command::Delete { id, force, wait } => delete(&client, out, &id, force, &wait).await,
        Command::Tokens { command } => tokens(&client, out, command).await,
        Command::Sizes => sizes(&client, out).await,
        Command::GpuModelConfig => gpu_model_config(&client, out).await,
        Command::Events { id } => events(&client, out, &id).await,
        Command::Accelerators { id } => accelerators(&client, out, &id).await,
        Command::Replicas { id, events } => replicas(&client, out, &id, events).await,
        Command::Ca { id } => ca(&client, out, &id).await,
    }
}

/// `90s`, `30m`, `1h30m`, `500ms`, or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let bad = || format!("{text:?} is not a duration (e.g. 90s, 30m, 1h)");
    let mut total = Duration::ZERO;
    let mut rest = text;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        total += match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n * 60),
            "h" => Duration::from_secs(n * 3600),
            _ => return Err(bad()),
        };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn exit_codes() {
        let api = |status| Failure::Api {
            status,
            id: "x".into(),
            message: "m".into(),
            request_id: "r".into(),
        };
        assert_eq!(api(404).code(), 1);
        assert_eq!(api(500).code(), 5);
        assert_eq!(Failure::Usage("u".into()).code(), 2);
        assert_eq!(Failure::DiError("e".into()).code(), 3);
        assert_eq!(Failure::Timeout("t".into()).code(), 4);
        assert_eq!(Failure::Unreachable("u".into()).code(), 5);
    }

    #[test]
    fn the_token_is_never_in_help() {
        use clap::CommandFactory;
        std::env::set_var("DI_TOKEN", "dia_v1_secret_value");
        let help = Cli::command().render_long_help().to_string();
        std::env::remove_var("DI_TOKEN");
        assert!(!help.contains("dia_v1_secret_value"));
    }
}
