//! `dictl`, the command-line client people use to manage dedicated inferences through the
//! central API (`/v2/dedicated-inferences`, DigitalOcean-compatible, plus the `/events`
//! extension). The crate owns only the client side: argument parsing with environment fallbacks,
//! the HTTP calls (bearer token, an `Idempotency-Key` per write, retries after 429/503 honouring
//! `Retry-After`), following pagination, rendering tables and key/value views for terminals or the
//! API's JSON as is for scripts, `--wait` progress, and exit codes that say what happened
//! (0 ok, 1 API error, 2 usage, 3 the DI ended in error, 4 timeout, 5 API unreachable or 5xx).

mod client;
mod render;
mod wait;

use std::fmt;
use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Map, Value};

use client::{Client, Id, ListFilter};
use render::s;
use wait::{EventCursor, Goal, Outcome};

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

// ---------------------------------------------------------------------------------------------
// Helpers

/// The API's answer exactly as it came (nothing for an empty body).
fn print_raw<T>(answer: &client::Answer<T>) {
    let raw = answer.raw.trim_end();
    if !raw.is_empty() {
        println!("{raw}");
    }
}

/// A document dictl assembled (all pages, or a create's answer with the final state), compact
/// like the API's own answers.
fn print_json(v: &Value) {
    println!("{v}");
}

/// Reads a JSON object from a file or stdin (`-`).
fn read_object(file: &PathBuf) -> Result<Map<String, Value>, Failure> {
    let (text, name) = if file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| Failure::Usage(format!("cannot read stdin: {e}")))?;
        (text, "stdin".to_string())
    } else {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(file)
            .map_err(|e| Failure::Usage(format!("cannot read {name}: {e}")))?;
        (text, name)
    };
    let value: Value = serde_json::from_str(&text).map_err(|e| {
        let yaml = matches!(
            file.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        );
        Failure::Usage(if yaml {
            format!("{name}: only JSON is supported; convert the YAML to JSON ({e})")
        } else {
            format!("{name} is not valid JSON: {e}")
        })
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(Failure::Usage(format!("{name} must hold a JSON object"))),
    }
}

/// A request body from a file that holds either the body or just the spec.
fn as_body(map: Map<String, Value>) -> Map<String, Value> {
    let is_body = ["spec", "access_tokens", "secrets"]
        .iter()
        .any(|k| map.contains_key(*k));
    if is_body {
        map
    } else {
        let mut body = Map::new();
        body.insert("spec".into(), Value::Object(map));
        body
    }
}

fn done_or(outcome: Outcome, what: &str) -> (Option<Value>, Result<(), Failure>) {
    match outcome {
        Outcome::Done(di) => (di, Ok(())),
        Outcome::Failed(di, reason) => (
            di,
            Err(Failure::DiError(format!(
                "{what} failed: the dedicated inference is in status error: {reason}"
            ))),
        ),
        Outcome::TimedOut(di) => {
            let status = di
                .as_ref()
                .map(|d| format!(" (status {})", s(&d["status"])))
                .unwrap_or_default();
            (
                di,
                Err(Failure::Timeout(format!(
                    "{what} did not finish before the timeout{status}"
                ))),
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Commands

async fn create(
    client: &Client,
    out: Output,
    file: &PathBuf,
    wait: &WaitArgs,
) -> Result<(), Failure> {
    let mut body = as_body(read_object(file)?);
    if let Some(Value::Object(spec)) = body.get_mut("spec") {
        spec.entry("version").or_insert(json!(1));
    }
    let answer = client.create(&body).await?;
    let mut created = answer.body.clone();
    let di = created["dedicated_inference"].clone();
    let id = s(&di["id"]);
    if out == Output::Text {
        println!(
            "Created dedicated inference {id} ({} in {}), status {}.",
            s(&di["name"]),
            s(&di["region"]),
            s(&di["status"])
        );
        if let Some(value) = created["token"]["value"].as_str() {
            println!(
                "Endpoint access token {} ({}), shown only this once; store it now:",
                s(&created["token"]["name"]),
                s(&created["token"]["id"])
            );
            println!("  {value}");
        }
        let _ = std::io::stdout().flush();
    }
    if !wait.wait {
        if out == Output::Json {
            print_raw(&answer);
        }
        return Ok(());
    }
    let outcome = wait::wait(
        client,
        &Id::from(answer.typed.dedicated_inference.id),
        Goal::Ready,
        wait.timeout,
        EventCursor::default(),
    )
    .await;
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            // Never lose the one-time token in JSON mode.
            if out == Output::Json {
                print_raw(&answer);
            }
            return Err(e);
        }
    };
    let (last, result) = done_or(outcome, "create");
    match out {
        Output::Json => {
            if let Some(last) = last {
                created["dedicated_inference"] = last;
            }
            print_json(&created);
        }
        Output::Text => {
            if result.is_ok() {
                println!();
                println!("Dedicated inference {id} is active.");
                if let Some(last) = &last {
                    print!("{}", render::di(last));
                }
            }
        }
    }
    result
}

async fn get(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
    let answer = client.get(&Id::parse(id)?).await?;
    match out {
        Output::Json => print_raw(&answer),
        Output::Text => print!("{}", render::di(&answer.body["dedicated_inference"])),
    }
    Ok(())
}

async fn list(
    client: &Client,
    out: Output,
    region: Option<String>,
    name: Option<String>,
) -> Result<(), Failure> {
    let filter = &ListFilter { region, name };
    let (items, total) = client
        .every_page(move |page| client.list(filter, page))
        .await?;
    match out {
        Output::Json => print_json(&json!({
            "dedicated_inferences": items,
            "links": {"pages": {}},
            "meta": {"total": total},
        })),
        Output::Text => {
            if items.is_empty() {
                eprintln!("No dedicated inferences.");
            } else {
                let rows: Vec<Vec<String>> = items.iter().map(render::di_row).collect();
                print!("{}", render::table(render::DI_HEADERS, &rows));
            }
        }
    }
    Ok(())
}

/// The spec fields a PATCH accepts, from a spec the API returned.
fn spec_input(spec: &Value) -> Map<String, Value> {
    let mut m = Map::new();
    for key in ["version", "name", "region", "vpc", "enable_public_endpoint"] {
        if !spec[key].is_null() {
            m.insert(key.into(), spec[key].clone());
        }
    }
    if let Some(deployments) = spec["model_deployments"].as_array() {
        let list: Vec<Value> = deployments
            .iter()
            .map(|d| {
                let accelerators: Vec<Value> = d["accelerators"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|a| {
                                json!({"scale": a["scale"], "type": a["type"],
                                       "accelerator_slug": a["accelerator_slug"]})
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let mut out = json!({
                    "model_slug": d["model_slug"],
                    "model_provider": d["model_provider"],
                    "workload_config": d["workload_config"],
                    "accelerators": accelerators,
                });
                if d["model_id"].as_str().is_some_and(|s| !s.is_empty()) {
                    out["model_id"] = d["model_id"].clone();
                }
                // A customer's own repository is named by it: without it the deployment would
                // read as a catalog model.
                if d["provider_model_id"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
                {
                    out["provider_model_id"] = d["provider_model_id"].clone();
                }
                out
            })
            .collect();
        m.insert("model_deployments".into(), Value::Array(list));
    }
    m
}

/// Completes the file's spec with the latest spec: missing fields and the version.
fn complete_spec(spec: &mut Map<String, Value>, latest: &Value) {
    let latest = spec_input(latest);
    for (key, value) in latest {
        let present = spec.contains_key(&key) || (key == "vpc" && spec.contains_key("vpc_config"));
        if !present {
            spec.insert(key, value);
        }
    }
}

async fn update(
    client: &Client,
    out: Output,
    id: &str,
    file: &PathBuf,
    wait: &WaitArgs,
) -> Result<(), Failure> {
    let di_id = Id::parse(id)?;
    let mut body = as_body(read_object(file)?);
    let current = client.get(&di_id).await?;
    let di = &current.body["dedicated_inference"];
    if let Some(Value::Object(spec)) = body.get_mut("spec") {
        // The latest spec: the pending one while a rollout runs, else the current one.
        let latest = if di["pending_deployment_spec"].is_object() {
            &di["pending_deployment_spec"]
        } else {
            &di["spec"]
        };
        complete_spec(spec, latest);
        if spec.get("region").is_none() {
            spec.insert("region".into(), di["region"].clone());
        }
    }
    let cursor = if wait.wait {
        EventCursor::snapshot(client, &di_id).await
    } else {
        EventCursor::default()
    };
    let answer = client.patch(&di_id, &body).await?;
    let new = &answer.body["dedicated_inference"];
    if out == Output::Text {
        match new["pending_deployment_spec"]["version"].as_i64() {
            Some(v) => println!(
                "Update of {id} accepted: version {v} is rolling out (status {}).",
                s(&new["status"])
            ),
            None => println!("Update of {id} accepted (status {}).", s(&new["status"])),
        }
        let _ = std::io::stdout().flush();
    }
    if !wait.wait {
        match out {
            Output::Json => print_raw(&answer),
            Output::Text => print!("{}", render::di(new)),
        }
        return Ok(());
    }
    let outcome = wait::wait(client, &di_id, Goal::Ready, wait.timeout, cursor).await?;
    let (last, result) = done_or(outcome, "update");
    match out {
        Output::Json => print_json(&json!({
            "dedicated_inference": last.unwrap_or_else(|| new.clone())
        })),
        Output::Text => {
            if result.is_ok() {
                println!();
                println!("Dedicated inference {id} is active.");
                if let Some(last) = &last {
                    print!("{}", render::di(last));
                }
            }
        }
    }
    result
}

/// Asks on the terminal; `Ok(false)` when the answer is not yes.
fn confirm(question: &str) -> Result<bool, Failure> {
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Failure::Usage(format!("cannot read the answer: {e}")))?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

async fn delete(
    client: &Client,
    out: Output,
    id: &str,
    force: bool,
    wait: &WaitArgs,
) -> Result<(), Failure> {
    let di_id = Id::parse(id)?;
    if !force && std::io::stdin().is_terminal() {
        // Name it, so the person confirms the right one (and a wrong id fails here, not later).
        let current = client.get(&di_id).await?;
        let di = &current.body["dedicated_inference"];
        let question = format!(
            "Delete dedicated inference {} ({id}) in {}? Its endpoint and tokens stop working.",
            s(&di["name"]),
            s(&di["region"])
        );
        if !confirm(&question)? {
            return Err(Failure::Usage("not deleted".into()));
        }
    }
    let cursor = if wait.wait {
        EventCursor::snapshot(client, &di_id).await
    } else {
        EventCursor::default()
    };
    let answer = client.delete(&di_id).await?;
    if !wait.wait {
        match out {
            Output::Json => print_raw(&answer),
            Output::Text => println!(
                "Deletion of {id} accepted; it reads as deleting until every resource is gone."
            ),
        }
        return Ok(());
    }
    if out == Output::Text {
        println!("Deletion of {id} accepted.");
        let _ = std::io::stdout().flush();
    }
    let outcome = wait::wait(client, &di_id, Goal::Gone, wait.timeout, cursor).await?;
    let (last, result) = done_or(outcome, "delete");
    match out {
        Output::Json => {
            if let (Some(last), Err(_)) = (last, &result) {
                print_json(&json!({ "dedicated_inference": last }));
            }
        }
        Output::Text => {
            if result.is_ok() {
                println!("Dedicated inference {id} is deleted.");
            }
        }
    }
    result
}

async fn tokens(client: &Client, out: Output, command: TokensCommand) -> Result<(), Failure> {
    match command {
        TokensCommand::List { id } => {
            let id = &Id::parse(&id)?;
            let (items, total) = client
                .every_page(move |page| client.tokens(id, page))
                .await?;
            match out {
                Output::Json => print_json(&json!({
                    "tokens": items, "links": {"pages": {}}, "meta": {"total": total}
                })),
                Output::Text => {
                    let rows: Vec<Vec<String>> = items
                        .iter()
                        .map(|t| {
                            vec![
                                s(&t["id"]),
                                s(&t["name"]),
                                s(&t["is_managed"]),
                                render::time(&t["created_at"]),
                            ]
                        })
                        .collect();
                    print!(
                        "{}",
                        render::table(&["ID", "NAME", "MANAGED", "CREATED"], &rows)
                    );
                }
            }
        }
        TokensCommand::Create { id, name } => {
            let answer = client.token_create(&Id::parse(&id)?, &name).await?;
            match out {
                Output::Json => print_raw(&answer),
                Output::Text => {
                    let t = &answer.body["token"];
                    println!(
                        "Created token {} ({}), shown only this once; store it now:",
                        s(&t["name"]),
                        s(&t["id"])
                    );
                    println!("  {}", s(&t["value"]));
                }
            }
        }
        TokensCommand::Delete { id, token_id } => {
            let di_id = Id::parse(&id)?;
            let answer = client.token_revoke(&di_id, &Id::parse(&token_id)?).await?;
            match out {
                Output::Json => print_raw(&answer),
                Output::Text => println!("Revoked token {token_id}."),
            }
        }
    }
    Ok(())
}

async fn sizes(client: &Client, out: Output) -> Result<(), Failure> {
    let answer = client.sizes().await?;
    if out == Output::Json {
        print_raw(&answer);
        return Ok(());
    }
    let body = answer.body;
    let rows: Vec<Vec<String>> = body["sizes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|z| {
            vec![
                s(&z["gpu_slug"]),
                s(&z["region"]),
                format!("{} {}", s(&z["price_per_hour"]), s(&z["currency"])),
            ]
        })
        .collect();
    print!("{}", render::table(&["GPU", "REGION", "PRICE/HOUR"], &rows));
    if let Some(enabled) = body["enabled_regions"].as_array() {
        println!(
            "\nEnabled regions: {}",
            enabled.iter().map(s).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

async fn gpu_model_config(client: &Client, out: Output) -> Result<(), Failure> {
    let answer = client.gpu_model_config().await?;
    if out == Output::Json {
        print_raw(&answer);
        return Ok(());
    }
    let body = answer.body;
    let rows: Vec<Vec<String>> = body["gpu_model_configs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            vec![
                s(&c["model_slug"]),
                s(&c["model_name"]),
                s(&c["is_gated_model"]),
                c["gpu_slugs"]
                    .as_array()
                    .map(|g| g.iter().map(s).collect::<Vec<_>>().join(","))
                    .unwrap_or_default(),
            ]
        })
        .collect();
    print!(
        "{}",
        render::table(&["MODEL", "NAME", "GATED", "GPUS"], &rows)
    );
    Ok(())
}

async fn events(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
    let id = &Id::parse(id)?;
    let (items, total) = client
        .every_page(move |page| client.events(id, page))
        .await?;
    match out {
        Output::Json => print_json(&json!({
            "events": items, "links": {"pages": {}}, "meta": {"total": total}
        })),
        Output::Text => {
            let rows: Vec<Vec<String>> = items
                .iter()
                .map(|e| {
                    vec![
                        render::time(&e["time"]),
                        s(&e["phase"]),
                        s(&e["reason"]),
                        s(&e["message"]),
                    ]
                })
                .collect();
            print!(
                "{}",
                render::table(&["TIME", "PHASE", "REASON", "MESSAGE"], &rows)
            );
        }
    }
    Ok(())
}

/// The events that are scaling decisions (see the worker's autoscaler).
fn is_scaling(e: &Value) -> bool {
    e["reason"]
        .as_str()
        .is_some_and(|r| r.starts_with("Scaled"))
}

async fn replicas(client: &Client, out: Output, id: &str, last: usize) -> Result<(), Failure> {
    let id = &Id::parse(id)?;
    let answer = client.get(id).await?;
    let di = &answer.body["dedicated_inference"];
    let (items, _) = client
        .every_page(move |page| client.events(id, page))
        .await?;
    let scaling: Vec<&Value> = items.iter().filter(|e| is_scaling(e)).collect();
    let recent = &scaling[scaling.len().saturating_sub(last)..];
    match out {
        Output::Json => print_json(&json!({"replicas": di["replicas"], "events": recent})),
        Output::Text => {
            let rows: Vec<Vec<String>> = di["replicas"]
                .as_array()
                .map(|rs| {
                    rs.iter()
                        .map(|r| {
                            let deployment = di["spec"]["model_deployments"]
                                .as_array()
                                .and_then(|ds| ds.iter().find(|d| d["model_id"] == r["model_id"]));
                            vec![
                                s(&r["model_slug"]),
                                s(&r["ready"]),
                                s(&r["wanted"]),
                                deployment
                                    .and_then(render::bounds)
                                    .unwrap_or_else(|| "fixed".into()),
                            ]
                        })
                        .collect()
                })
                .unwrap_or_default();
            if rows.is_empty() {
                eprintln!("No replicas counted yet.");
            } else {
                print!(
                    "{}",
                    render::table(&["MODEL", "READY", "WANTED", "AUTOSCALING"], &rows)
                );
            }
            if !recent.is_empty() {
                println!();
                let rows: Vec<Vec<String>> = recent
                    .iter()
                    .map(|e| vec![render::time(&e["time"]), s(&e["reason"]), s(&e["message"])])
                    .collect();
                print!("{}", render::table(&["TIME", "DECISION", "WHY"], &rows));
            }
        }
    }
    Ok(())
}

async fn accelerators(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
    let id = &Id::parse(id)?;
    let (items, total) = client
        .every_page(move |page| client.accelerators(id, page))
        .await?;
    match out {
        Output::Json => print_json(&json!({
            "accelerators": items, "links": {"pages": {}}, "meta": {"total": total}
        })),
        Output::Text => {
            if items.is_empty() {
                eprintln!("No accelerators yet.");
                return Ok(());
            }
            let rows: Vec<Vec<String>> = items
                .iter()
                .map(|a| {
                    vec![
                        s(&a["id"]),
                        s(&a["name"]),
                        s(&a["slug"]),
                        s(&a["role"]),
                        s(&a["status"]),
                        render::time(&a["created_at"]),
                    ]
                })
                .collect();
            print!(
                "{}",
                render::table(&["ID", "NAME", "SLUG", "ROLE", "STATUS", "CREATED"], &rows)
            );
        }
    }
    Ok(())
}

async fn ca(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
    use base64::Engine;
    let answer = client.ca(&Id::parse(id)?).await?;
    if out == Output::Json {
        print_raw(&answer);
        return Ok(());
    }
    let body = answer.body;
    let cert = body["cert"].as_str().unwrap_or_default();
    // The API sends base64 of the PEM; people want the PEM itself.
    match base64::engine::general_purpose::STANDARD.decode(cert.trim()) {
        Ok(pem) if pem.starts_with(b"-----BEGIN") => {
            let pem = String::from_utf8_lossy(&pem);
            print!("{pem}");
            if !pem.ends_with('\n') {
                println!();
            }
        }
        _ => println!("{cert}"),
    }
    Ok(())
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
    fn a_bare_spec_becomes_a_body() {
        let spec = json!({"name": "x", "region": "atl1"});
        let body = as_body(spec.as_object().unwrap().clone());
        assert_eq!(
            Value::Object(body),
            json!({"spec": {"name": "x", "region": "atl1"}})
        );
        let full = json!({"spec": {"name": "x"}, "access_tokens": {}});
        assert_eq!(
            Value::Object(as_body(full.as_object().unwrap().clone())),
            full
        );
    }

    #[test]
    fn update_takes_missing_fields_from_the_latest_spec() {
        let latest = json!({
            "version": 3, "name": "old", "region": "atl1",
            "vpc": {"uuid": "v"}, "vpc_config": {"vpc_uuid": "v"},
            "enable_public_endpoint": true, "status": "updating",
            "model_deployments": [{"model_id": "", "model_slug": "m", "provider_model_id": "org/m@v1",
                "model_provider": "hugging_face", "workload_config": {},
                "accelerators": [{"scale": 1, "type": "prefill_decode",
                                  "accelerator_slug": "g", "status": "new"}]}]
        });
        let mut spec = json!({"name": "new"}).as_object().unwrap().clone();
        complete_spec(&mut spec, &latest);
        assert_eq!(
            Value::Object(spec),
            json!({"version": 3, "name": "new", "region": "atl1", "vpc": {"uuid": "v"},
                   "enable_public_endpoint": true,
                   "model_deployments": [{"model_slug": "m", "model_provider": "hugging_face",
                       "provider_model_id": "org/m@v1", "workload_config": {},
                       "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": "g"}]}]})
        );
        // A version in the file wins; godo's vpc spelling is not doubled.
        let mut spec = json!({"version": 2, "vpc_config": {"vpc_uuid": "v"}})
            .as_object()
            .unwrap()
            .clone();
        complete_spec(&mut spec, &latest);
        assert_eq!(spec["version"], 2);
        assert!(!spec.contains_key("vpc"));
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
