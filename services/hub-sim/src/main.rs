//! `hub-sim`: runs a simulated Hugging Face Hub until interrupted. Prints its base URL (the
//! `HF_ENDPOINT` to give clients) as the one line on stdout.

use std::net::SocketAddr;

use clap::Parser;
use hub_sim::{HubFaults, HubSim};

#[derive(Debug, Parser)]
#[command(
    name = "hub-sim",
    about = "Simulated Hugging Face Hub (whoami, model info, resolve) with /_sim admin endpoints"
)]
struct Args {
    /// Address for the Hub API and the /_sim admin endpoints.
    #[arg(long, env = "HUB_SIM_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Start with no repositories and no tokens (default: the catalog's models and the token
    /// hf_sim_reader, granted to the gated ones).
    #[arg(long, env = "HUB_SIM_EMPTY")]
    empty: bool,
    /// Fraction of Hub API requests answered 500.
    #[arg(long, env = "HUB_SIM_ERROR_RATE", default_value_t = 0.0)]
    error_rate: f64,
    /// Fraction of Hub API requests answered 429.
    #[arg(long, env = "HUB_SIM_429_RATE", default_value_t = 0.0)]
    rate_limit_rate: f64,
    /// Extra latency of every Hub API request.
    #[arg(long, env = "HUB_SIM_LATENCY_MS", default_value_t = 0)]
    latency_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Logs go to stderr: stdout carries only the base URL.
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let a = Args::parse();
    let sim = if a.empty {
        HubSim::start_empty(a.listen).await?
    } else {
        HubSim::start(a.listen).await?
    };
    sim.set_faults(HubFaults {
        error_rate: a.error_rate,
        rate_limit_rate: a.rate_limit_rate,
        latency_ms: a.latency_ms,
        retry_after_secs: 1,
        fail_next: 0,
    });
    // The one line on stdout: scripts read the base URL from it.
    println!("{}", sim.url());
    tokio::signal::ctrl_c().await?;
    sim.shutdown().await;
    Ok(())
}
