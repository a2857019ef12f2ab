//! `worker`: the reconcile worker of one region. Flags fall back to environment variables;
//! pass secrets through the environment (or `*_FILE` variables naming a file), not argv.

/// mimalloc rather than the system's allocator: a pass parses, renders and drops thousands of
/// small JSON maps, and glibc's malloc spent about 40 % of the worker's CPU in a resync of
/// 3,000 DIs (bench/README.md, "Watch caches and one connection per cluster").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use worker::runtime::{Config, Worker};

#[derive(Parser)]
#[command(
    name = "worker",
    about = "Reconcile worker of one Dedicated Inference region"
)]
struct Args {
    /// Region slug, e.g. atl1.
    #[arg(long, env = "REGION")]
    region: String,
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// DigitalOcean API base URL (paths start with /v2).
    #[arg(
        long,
        env = "DO_API_URL",
        default_value = "https://api.digitalocean.com"
    )]
    do_api_url: String,
    /// DigitalOcean API token (or DO_TOKEN_FILE).
    #[arg(long, env = "DO_TOKEN", hide_env_values = true)]
    do_token: Option<String>,
    /// Base64 of the 32-byte key sealing secrets at rest (or SEAL_KEY_FILE).
    #[arg(long, env = "SEAL_KEY", hide_env_values = true)]
    seal_key: Option<String>,
    /// More keys that only open sealed values, comma-separated (or SEAL_OPEN_KEYS_FILE): the
    /// previous SEAL_KEY while a rotation re-seals.
    #[arg(long, env = "SEAL_OPEN_KEYS", hide_env_values = true)]
    seal_open_keys: Option<String>,
    /// This worker's name in leases (default: a random one).
    #[arg(long, env = "WORKER_ID")]
    worker_id: Option<String>,
    /// Reconcile passes running at once.
    #[arg(long, env = "WORKER_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// How long a DI stays claimed by a worker that stopped renewing it (renewed every quarter
    /// of it). Long enough to ride out a stall of the database; a worker that dies does not
    /// keep its DIs that long, since its database session ends with it and its leases with the
    /// session.
    #[arg(long, env = "WORKER_LEASE_SECS", default_value_t = 10)]
    lease_secs: u64,
    /// How often the claim loop looks for due work besides being woken: among it, the DIs of a
    /// worker that died (no notification says so).
    #[arg(long, env = "WORKER_TICK_MS", default_value_t = 1000)]
    tick_ms: u64,
    /// Longest polling interval while waiting for the cloud.
    #[arg(long, env = "WORKER_POLL_MS", default_value_t = 2000)]
    poll_ms: u64,
    /// Shortest one: right after progress, growing with the time nothing changed.
    #[arg(long, env = "WORKER_POLL_MIN_MS", default_value_t = 50)]
    poll_min_ms: u64,
    /// Periodic resync of converged DIs.
    #[arg(long, env = "WORKER_RESYNC_SECS", default_value_t = 300)]
    resync_secs: u64,
    /// Whether resyncs read each cluster's watches instead of listing, and changes the watches
    /// see wake their DIs (`false`: every pass lists, drift waits for the resync; an escape
    /// hatch should a cluster's API server mistreat long watches).
    #[arg(long, env = "WORKER_WATCH_CACHES", default_value_t = true, action = clap::ArgAction::Set)]
    watch_caches: bool,
    /// How often the autoscaler looks at a DI that declares `autoscaling`.
    #[arg(long, env = "WORKER_AUTOSCALE_INTERVAL_MS", default_value_t = 10_000)]
    autoscale_interval_ms: u64,
    /// How long the load must fit in one replica fewer before the autoscaler removes one.
    #[arg(long, env = "WORKER_SCALE_DOWN_WINDOW_SECS", default_value_t = 120)]
    scale_down_window_secs: u64,
    /// No progress for this long in a phase turns the DI to error.
    #[arg(long, env = "WORKER_STALL_TIMEOUT_SECS", default_value_t = 1800)]
    stall_timeout_secs: u64,
    /// A pass that takes longer is abandoned and tried again.
    #[arg(long, env = "WORKER_PASS_TIMEOUT_SECS", default_value_t = 120)]
    pass_timeout_secs: u64,
    #[arg(long, env = "GATEWAY_CLASS", default_value = "inference-gateway")]
    gateway_class: String,
    /// Size and node count of the CPU pool of new clusters.
    #[arg(long, env = "SYSTEM_POOL_SIZE", default_value = "s-4vcpu-8gb")]
    system_pool_size: String,
    #[arg(long, env = "SYSTEM_POOL_COUNT", default_value_t = 2)]
    system_pool_count: u32,
    #[arg(long, env = "KUBERNETES_VERSION", default_value = "latest")]
    kubernetes_version: String,
    /// The Hugging Face Hub the model servers download from (their `HF_ENDPOINT`); unset, the
    /// public Hub.
    #[arg(long, env = "HF_ENDPOINT")]
    hf_endpoint: Option<String>,
    /// The model servers' image on NVIDIA GPUs, if not the one this version pins. A change is
    /// rolled over the region's DIs as a fleet rollout.
    #[arg(long, env = "VLLM_IMAGE")]
    vllm_image: Option<String>,
    /// The model servers' image on AMD GPUs, if not the one this version pins.
    #[arg(long, env = "VLLM_ROCM_IMAGE")]
    vllm_rocm_image: Option<String>,
    /// The endpoint picker's image, if not the one this version pins.
    #[arg(long, env = "EPP_IMAGE")]
    epp_image: Option<String>,
    /// How long a request to a model deployment scaled to zero is held while a replica starts
    /// (a one-GPU node and a model load), as the endpoint picker's queue TTL; each further GPU
    /// of the size adds 90 s (larger weights); beyond it, 503 with `Retry-After`.
    #[arg(long, env = "COLD_START_HOLD_SECS", default_value_t = 900)]
    cold_start_hold_secs: u64,
    /// Fleet rollouts (a new version of this worker whose rendering restarts the pods of DIs
    /// nobody changed): DIs restarted at once in the region.
    #[arg(long, env = "FLEET_MAX_ROLLING", default_value_t = 10)]
    fleet_max_rolling: u32,
    /// DIs that must roll and serve before any other DI starts (one batch at once).
    #[arg(long, env = "FLEET_CANARIES", default_value_t = 2)]
    fleet_canaries: u32,
    /// A DI that does not serve its new pods this long after its restart began fails its slot,
    /// and the rollout halts (`regional fleet resume` goes on). Long enough for a GPU node and a
    /// model load.
    #[arg(long, env = "FLEET_SLOT_TIMEOUT_SECS", default_value_t = 3600)]
    fleet_slot_timeout_secs: u64,
    /// Address of the HTTP server for `/metrics` (Prometheus) and `/healthz`.
    #[arg(long, env = "METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    metrics_listen: SocketAddr,
}

/// A secret from its flag/variable, else from the file `<VAR>_FILE` names.
fn secret(value: Option<String>, var: &str) -> anyhow::Result<String> {
    if let Some(v) = value.filter(|v| !v.is_empty()) {
        return Ok(v);
    }
    let file_var = format!("{var}_FILE");
    let path = std::env::var(&file_var)
        .map_err(|_| anyhow::anyhow!("{var} (or {file_var}) is required"))?;
    let v =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("reading {file_var}: {e}"))?;
    Ok(v.trim().to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = common::telemetry::init("worker");
    let config = config_from(Args::parse())?;
    tracing::info!(?config, "starting");
    let worker = Worker::start(config).await?;
    common::telemetry::shutdown_signal().await;
    tracing::info!("shutting down; finishing running passes");
    worker.shutdown().await;
    Ok(())
}

/// The worker's configuration from its arguments, secrets read from their files where given.
fn config_from(args: Args) -> anyhow::Result<Config> {
    let do_token = secret(args.do_token, "DO_TOKEN")?;
    let seal_key = secret(args.seal_key, "SEAL_KEY")?;
    let seal_open_keys = match args.seal_open_keys {
        Some(keys) => keys,
        None if std::env::var_os("SEAL_OPEN_KEYS_FILE").is_some() => {
            secret(None, "SEAL_OPEN_KEYS")?
        }
        None => String::new(),
    };
    let mut config = Config::new(
        &args.region,
        &args.database_url,
        &seal_key,
        &args.do_api_url,
        &do_token,
    );
    config.seal_open_keys = seal_open_keys.split(',').map(str::to_string).collect();
    if let Some(id) = args.worker_id {
        config.worker_id = id;
    }
    config.concurrency = args.concurrency.max(1);
    config.lease = Duration::from_secs(args.lease_secs.max(1));
    config.tick = Duration::from_millis(args.tick_ms.max(10));
    config.stall_timeout = Duration::from_secs(args.stall_timeout_secs.max(1));
    config.pass_timeout = Duration::from_secs(args.pass_timeout_secs.max(1));
    config.settings.poll = Duration::from_millis(args.poll_ms.max(10));
    config.poll_min = Duration::from_millis(args.poll_min_ms.max(1));
    config.settings.resync = Duration::from_secs(args.resync_secs.max(1));
    config.settings.autoscale_interval = Duration::from_millis(args.autoscale_interval_ms.max(100));
    config.settings.watch_caches = args.watch_caches;
    config.settings.scale_down_window = Duration::from_secs(args.scale_down_window_secs);
    config.settings.gateway_class = args.gateway_class;
    config.settings.system_pool_size = args.system_pool_size;
    config.settings.system_pool_count = args.system_pool_count.max(1);
    config.settings.kubernetes_version = args.kubernetes_version;
    config.settings.hub_endpoint = args.hf_endpoint;
    let images = &mut config.settings.images;
    for (image, flag) in [
        (&mut images.vllm_nvidia, args.vllm_image),
        (&mut images.vllm_amd, args.vllm_rocm_image),
        (&mut images.epp, args.epp_image),
    ] {
        if let Some(set) = flag.filter(|f| !f.is_empty()) {
            *image = set;
        }
    }
    config.settings.cold_start_hold = Duration::from_secs(args.cold_start_hold_secs.max(1));
    config.settings.fleet_budget = region_store::FleetBudget {
        max_rolling: args.fleet_max_rolling.max(1),
        canaries: args.fleet_canaries,
    };
    config.settings.fleet_slot_timeout = Duration::from_secs(args.fleet_slot_timeout_secs.max(1));
    config.metrics_listen = args.metrics_listen;
    Ok(config)
}
