//! `region-sim`: runs one simulated DigitalOcean region until interrupted.

/// mimalloc rather than the system's allocator: the simulated clusters parse and drop their
/// objects as they are used (sim-kube's store keeps them as JSON otherwise), and mimalloc gives
/// freed memory back to the system where glibc's malloc kept it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use clap::Parser;
use region_sim::{ApiFaults, Delays, FaultConfig, ModelTiming, RegionSim, SimConfig};

#[derive(Debug, Parser)]
#[command(
    name = "region-sim",
    about = "Simulated DigitalOcean region (DO API subset, DOKS clusters, data plane)"
)]
struct Args {
    /// Region slug.
    #[arg(long, env = "REGION_SIM_REGION", default_value = "atl1")]
    region: String,
    /// Address for the DigitalOcean API and the /_sim admin endpoints.
    #[arg(long, env = "REGION_SIM_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The port every cluster's Kubernetes API and every load balancer shares, each at a
    /// loopback address of its own (127.x.y.z); 0 picks a free one.
    #[arg(long, env = "REGION_SIM_FRONT_PORT", default_value_t = 0)]
    front_port: u16,
    /// Bearer token the DigitalOcean API accepts.
    #[arg(long, env = "REGION_SIM_TOKEN", hide_env_values = true)]
    token: String,
    /// GPU capacity, `size=nodes` pairs separated by commas (replaces the defaults).
    #[arg(long, env = "REGION_SIM_GPU_CAPACITY", value_delimiter = ',')]
    gpu_capacity: Vec<String>,
    #[arg(long, env = "REGION_SIM_CLUSTER_PROVISION_MS")]
    cluster_provision_ms: Option<u64>,
    #[arg(long, env = "REGION_SIM_NODE_PROVISION_MS")]
    node_provision_ms: Option<u64>,
    #[arg(long, env = "REGION_SIM_DELETION_MS")]
    deletion_ms: Option<u64>,
    #[arg(long, env = "REGION_SIM_LB_PROVISION_MS")]
    lb_provision_ms: Option<u64>,
    #[arg(long, env = "REGION_SIM_MODEL_LOAD_MS")]
    model_load_ms: Option<u64>,
    #[arg(long, env = "REGION_SIM_GATEWAY_ADDRESS_MS")]
    gateway_address_ms: Option<u64>,
    /// Fraction of DO API requests answered 500.
    #[arg(long, env = "REGION_SIM_DO_ERROR_RATE", default_value_t = 0.0)]
    do_error_rate: f64,
    /// Fraction of DO API requests answered 429.
    #[arg(long, env = "REGION_SIM_DO_429_RATE", default_value_t = 0.0)]
    do_429_rate: f64,
    #[arg(long, env = "REGION_SIM_DO_LATENCY_MS", default_value_t = 0)]
    do_latency_ms: u64,
    #[arg(long, env = "REGION_SIM_KUBE_ERROR_RATE", default_value_t = 0.0)]
    kube_error_rate: f64,
    #[arg(long, env = "REGION_SIM_KUBE_429_RATE", default_value_t = 0.0)]
    kube_429_rate: f64,
    #[arg(long, env = "REGION_SIM_KUBE_LATENCY_MS", default_value_t = 0)]
    kube_latency_ms: u64,
    #[arg(long, env = "REGION_SIM_DATA_PLANE_ERROR_RATE", default_value_t = 0.0)]
    data_plane_error_rate: f64,
    #[arg(long, env = "REGION_SIM_DATA_PLANE_429_RATE", default_value_t = 0.0)]
    data_plane_429_rate: f64,
    #[arg(long, env = "REGION_SIM_DATA_PLANE_LATENCY_MS", default_value_t = 0)]
    data_plane_latency_ms: u64,
    /// How often the simulated cloud controller checks a settled cluster (every load balancer
    /// active) for changes it missed; it re-derives it only if its objects changed since.
    #[arg(
        long,
        env = "REGION_SIM_CLOUD_CONTROLLER_IDLE_MS",
        default_value_t = 100
    )]
    cloud_controller_idle_ms: u64,
    /// Lifetime of the cluster credentials the kubeconfig and credentials endpoints issue when
    /// the request has no `expiry_seconds` (default 7 days, as DOKS).
    #[arg(long, env = "REGION_SIM_CREDENTIAL_TTL_SECS", default_value_t = region_sim::DEFAULT_CREDENTIAL_TTL.as_secs())]
    credential_ttl_secs: u64,
    /// A Hugging Face Hub (on loopback) standing in for the public one: simulated model servers
    /// whose environment names no `HF_ENDPOINT` ask it whether their repository loads. Unset,
    /// their loads succeed without asking.
    #[arg(long, env = "REGION_SIM_DEFAULT_HUB")]
    default_hub: Option<String>,
    /// Fake model: time to first token.
    #[arg(long, env = "REGION_SIM_TTFT_MS")]
    ttft_ms: Option<u64>,
    /// Fake model: delay between tokens.
    #[arg(long, env = "REGION_SIM_PER_TOKEN_MS")]
    per_token_ms: Option<u64>,
    /// Serving model (per-replica batching, prefix cache, endpoint picker): real seconds per
    /// simulated second. 1 is real time; 0.1 ten times faster; 0 (the default, until the
    /// control plane scales on it) turns it off: every request is answered after
    /// `--ttft-ms`/`--per-token-ms`, round robin.
    #[arg(long, env = "REGION_SIM_SERVING_TIME_SCALE", default_value_t = 0.0)]
    serving_time_scale: f64,
}

fn parse_capacity(items: &[String]) -> anyhow::Result<BTreeMap<String, u32>> {
    items
        .iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let (k, v) = s
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--gpu-capacity expects size=nodes, got {s:?}"))?;
            Ok((k.trim().to_string(), v.trim().parse()?))
        })
        .collect()
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
    let mut cfg = SimConfig::new(&a.region, &a.token);
    cfg.listen = a.listen;
    cfg.front_port = a.front_port;
    cfg.cloud_controller_idle_ms = a.cloud_controller_idle_ms;
    cfg.credential_ttl = std::time::Duration::from_secs(a.credential_ttl_secs.max(1));
    cfg.default_hub = a.default_hub;
    if !a.gpu_capacity.is_empty() {
        cfg.gpu_capacity = parse_capacity(&a.gpu_capacity)?;
    }
    let d = Delays::default();
    cfg.delays = Delays {
        cluster_provision_ms: a.cluster_provision_ms.unwrap_or(d.cluster_provision_ms),
        node_provision_ms: a.node_provision_ms.unwrap_or(d.node_provision_ms),
        deletion_ms: a.deletion_ms.unwrap_or(d.deletion_ms),
        lb_provision_ms: a.lb_provision_ms.unwrap_or(d.lb_provision_ms),
        model_load_ms: a.model_load_ms.unwrap_or(d.model_load_ms),
        gateway_address_ms: a.gateway_address_ms.unwrap_or(d.gateway_address_ms),
    };
    let api = |e: f64, r: f64, l: u64| ApiFaults {
        error_rate: e,
        rate_limit_rate: r,
        latency_ms: l,
        retry_after_secs: 1,
        seed: None,
    };
    cfg.faults = FaultConfig {
        do_api: api(a.do_error_rate, a.do_429_rate, a.do_latency_ms),
        kube: api(a.kube_error_rate, a.kube_429_rate, a.kube_latency_ms),
        data_plane: api(
            a.data_plane_error_rate,
            a.data_plane_429_rate,
            a.data_plane_latency_ms,
        ),
    };
    let m = ModelTiming::default();
    cfg.model = ModelTiming {
        ttft_ms: a.ttft_ms.unwrap_or(m.ttft_ms),
        per_token_ms: a.per_token_ms.unwrap_or(m.per_token_ms),
        serving: region_sim::ServingConfig {
            time_scale: a.serving_time_scale.max(0.0),
            ..Default::default()
        },
    };
    let sim = RegionSim::start(cfg).await?;
    // The one line on stdout: scripts read the base URL from it.
    println!("{}", sim.base_url());
    tokio::signal::ctrl_c().await?;
    sim.shutdown().await;
    Ok(())
}
