//! `regional fleet`, the operator's command over fleet rollouts (a new worker version whose
//! rendering restarts the pods of DIs nobody changed; the workers roll it a few DIs at a time,
//! see the worker's README): show how far each got, pause the newest, resume it (after a halt,
//! its failed DIs try again), or go back to an older version's rendering by resuming it.

use clap::{Parser, Subcommand};
use common::seal::Sealer;
use region_store::{RolloutProgress, RolloutState, Store};

#[derive(Parser, Debug)]
#[command(
    name = "regional fleet",
    about = "Show, pause or resume the rollout of a new worker rendering across this region's DIs"
)]
pub struct FleetCommand {
    /// Postgres URL of the regional database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Every rollout, newest first, with its DIs rolling, done and failed, as JSON.
    Status,
    /// No DI starts rolling the newest rendering; those rolling finish.
    Pause,
    /// The newest rollout (or `--rendering`, which becomes the newest) goes on; after a halt its
    /// failed DIs try again.
    Resume {
        #[arg(long)]
        rendering: Option<String>,
    },
}

fn shown(p: &RolloutProgress) -> serde_json::Value {
    serde_json::json!({
        "rendering": p.rendering,
        "state": p.state.as_str(),
        "reason": p.reason,
        "started_at": p.started_at,
        "dis": {"rolling": p.rolling, "done": p.done, "failed": p.failed},
    })
}

impl FleetCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        let pool = sqlx::PgPool::connect(&self.database_url).await?;
        // Rollouts touch no secret: any key opens this store.
        let store = Store::new(pool, Sealer::from_base64(&Sealer::generate_key())?);
        let shown = match self.action {
            Action::Status => {
                serde_json::Value::Array(store.fleet_progress().await?.iter().map(shown).collect())
            }
            Action::Pause => shown(&store.fleet_set(RolloutState::Paused, None).await?),
            Action::Resume { rendering } => shown(
                &store
                    .fleet_set(RolloutState::Rolling, rendering.as_deref())
                    .await?,
            ),
        };
        println!("{}", serde_json::to_string_pretty(&shown)?);
        Ok(())
    }
}
