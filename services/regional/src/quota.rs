//! Quotas: the service's limits for every team (flags with env fallbacks), what a GPU count
//! needs from the catalog, and `regional quota`, the operator's command to show a team's quotas,
//! set its own limits or give it the service's again. The store enforces them
//! ([`region_store::Quotas`]).

use std::path::PathBuf;

use api_types::catalog::Catalog;
use clap::{Parser, Subcommand};
use common::seal::Sealer;
use region_store::{QuotaOverrides, Quotas, Store};
use uuid::Uuid;

/// The limits of every team without its own, in this region.
#[derive(clap::Args, Debug, Clone)]
pub struct QuotaArgs {
    /// Dedicated inferences a team may have (those being deleted do not count).
    #[arg(long, env = "QUOTA_DEDICATED_INFERENCES", default_value_t = QuotaArgs::default().quota_dedicated_inferences)]
    pub quota_dedicated_inferences: u32,
    /// GPUs a team may hold, every size together. A deployment holds `scale` (or
    /// `autoscaling.max_replicas` when it autoscales) times its size's GPUs per node.
    #[arg(long, env = "QUOTA_GPUS", default_value_t = QuotaArgs::default().quota_gpus)]
    pub quota_gpus: u32,
    /// GPUs of each size a team may hold.
    #[arg(long, env = "QUOTA_GPUS_PER_SIZE", default_value_t = QuotaArgs::default().quota_gpus_per_size)]
    pub quota_gpus_per_size: u32,
}

impl Default for QuotaArgs {
    fn default() -> Self {
        QuotaArgs {
            quota_dedicated_inferences: 20,
            quota_gpus: 64,
            quota_gpus_per_size: 32,
        }
    }
}

impl QuotaArgs {
    /// The store's settings: these limits, and the GPUs per node of each size the catalog
    /// offers in `region`.
    pub fn quotas(&self, region: &str, catalog: &Catalog) -> Quotas {
        Quotas {
            region: region.into(),
            dedicated_inferences: self.quota_dedicated_inferences,
            gpus: self.quota_gpus,
            gpus_per_size: self.quota_gpus_per_size,
            gpus_per_node: catalog
                .sizes
                .iter()
                .filter(|s| s.regions.iter().any(|r| r == region))
                .map(|s| (s.gpu_slug.clone(), s.gpu.count))
                .collect(),
        }
    }
}

/// The catalog file `path`, or the one built in.
pub fn catalog(path: Option<&std::path::Path>) -> anyhow::Result<Catalog> {
    Ok(match path {
        Some(path) => Catalog::parse(&std::fs::read_to_string(path)?)?,
        None => Catalog::parse(api_types::catalog::EMBEDDED)?,
    })
}

/// `regional quota`: a team's quotas in this region.
#[derive(Parser, Debug)]
#[command(
    name = "regional quota",
    about = "Show a team's quotas in this region, set its own limits, or give it the service's again"
)]
pub struct QuotaCommand {
    /// Postgres URL of the regional database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    #[arg(long, env = "REGION", default_value = "atl1")]
    region: String,
    /// The catalog file the service reads, if not the one built in.
    #[arg(long, env = "CATALOG")]
    catalog: Option<PathBuf>,
    /// The service's limits, as it is configured.
    #[command(flatten)]
    defaults: QuotaArgs,
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Print the team's limits and use (as the API shows them) and its own limits, as JSON.
    Show {
        #[arg(long)]
        team: Uuid,
    },
    /// Set limits of the team's own (those not named keep theirs); then show. Nothing running
    /// changes: a limit below the team's use refuses only what would raise it.
    Set {
        #[arg(long)]
        team: Uuid,
        #[arg(long)]
        dedicated_inferences: Option<u32>,
        #[arg(long)]
        gpus: Option<u32>,
        /// `SIZE=GPUS`, e.g. `gpu-h100x8-640gb=16`; repeat or separate with commas.
        #[arg(long, value_delimiter = ',', value_parser = size_limit)]
        gpus_per_size: Vec<(String, u32)>,
    },
    /// Drop the team's own limits: the service's apply again; then show.
    Reset {
        #[arg(long)]
        team: Uuid,
    },
}

fn size_limit(text: &str) -> Result<(String, u32), String> {
    let (size, gpus) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not SIZE=GPUS"))?;
    let gpus = gpus
        .trim()
        .parse()
        .map_err(|_| format!("{gpus:?} is not a number of GPUs"))?;
    Ok((size.trim().to_string(), gpus))
}

impl QuotaCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        let catalog = catalog(self.catalog.as_deref())?;
        let quotas = self.defaults.quotas(&self.region, &catalog);
        let pool = sqlx::PgPool::connect(&self.database_url).await?;
        // Quotas touch no secret: any key opens this store.
        let sealer = Sealer::from_base64(&Sealer::generate_key())?;
        let store = Store::new(pool, sealer).with_quotas(quotas);
        let team = match self.action {
            Action::Show { team } => team,
            Action::Set {
                team,
                dedicated_inferences,
                gpus,
                gpus_per_size,
            } => {
                if let Some((size, _)) = gpus_per_size
                    .iter()
                    .find(|(size, _)| catalog.size(size).is_none())
                {
                    anyhow::bail!("{size} is not a size of the catalog");
                }
                let set = QuotaOverrides {
                    dedicated_inferences,
                    gpus,
                    gpus_per_size: gpus_per_size.into_iter().collect(),
                };
                store.quota_overrides_set(team, &set).await?;
                team
            }
            Action::Reset { team } => {
                store.quota_overrides_clear(team).await?;
                team
            }
        };
        let shown = serde_json::json!({
            "quotas": store.quota_use(team).await?,
            "team_limits": store.quota_overrides(team).await?,
        });
        println!("{}", serde_json::to_string_pretty(&shown)?);
        Ok(())
    }
}
