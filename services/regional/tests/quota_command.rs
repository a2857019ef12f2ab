//! `regional quota`, the operator's command: it sets a team's own limits (keeping those it does
//! not name), shows them with the team's use as the API does, and gives the team the service's
//! limits again; the regional service's store enforces what it set.

use std::process::Command;

use serde_json::{json, Value};
use sqlx::Connection;
use uuid::Uuid;

/// A fresh, migrated regional database on `DATABASE_URL`'s server (required: never a skip).
async fn fresh_database() -> String {
    let admin = std::env::var("DATABASE_URL")
        .expect("DATABASE_URL must point at a Postgres server; run the tests with scripts/test");
    let name = format!("quota_command_{}", Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let (base, _) = admin.rsplit_once('/').expect("a database URL");
    let url = format!("{base}/{name}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    region_store::MIGRATOR.run(&pool).await.unwrap();
    pool.close().await;
    url
}

/// Runs `regional quota ARGS…` with the service's settings in its environment; returns its JSON.
fn quota(database_url: &str, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_regional"))
        .arg("quota")
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("REGION", "nyc2")
        .env("QUOTA_DEDICATED_INFERENCES", "5")
        .env_remove("CATALOG")
        .output()
        .expect("regional runs");
    assert!(
        out.status.success(),
        "regional quota {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn size<'a>(shown: &'a Value, slug: &str) -> &'a Value {
    shown["quotas"]["gpus_per_size"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["accelerator_slug"] == slug)
        .unwrap_or_else(|| panic!("no {slug} in {shown}"))
}

#[tokio::test]
async fn the_operator_sets_shows_and_resets_a_teams_limits() {
    let db = fresh_database().await;
    let team = Uuid::new_v4().to_string();

    // The service's limits, from its settings; only the region's sizes are listed (the
    // catalog offers no L40S in nyc2).
    let shown = quota(&db, &["show", "--team", &team]);
    assert_eq!(shown["quotas"]["region"], "nyc2");
    assert_eq!(
        shown["quotas"]["dedicated_inferences"],
        json!({"limit": 5, "used": 0})
    );
    assert_eq!(shown["quotas"]["gpus"], json!({"limit": 64, "used": 0}));
    assert_eq!(size(&shown, "gpu-h100x8-640gb")["limit"], 32);
    assert!(!shown.to_string().contains("gpu-l40sx1-48gb"), "{shown}");
    assert_eq!(shown["team_limits"]["dedicated_inferences"], Value::Null);

    quota(
        &db,
        &[
            "set",
            "--team",
            &team,
            "--dedicated-inferences",
            "1",
            "--gpus-per-size",
            "gpu-h100x8-640gb=16",
        ],
    );
    let shown = quota(&db, &["set", "--team", &team, "--gpus", "8"]);
    assert_eq!(
        shown["quotas"]["dedicated_inferences"],
        json!({"limit": 1, "used": 0})
    );
    assert_eq!(shown["quotas"]["gpus"], json!({"limit": 8, "used": 0}));
    assert_eq!(size(&shown, "gpu-h100x8-640gb")["limit"], 16);
    assert_eq!(size(&shown, "gpu-h100x1-80gb")["limit"], 32);
    assert_eq!(
        shown["team_limits"],
        json!({"dedicated_inferences": 1, "gpus": 8, "gpus_per_size": {"gpu-h100x8-640gb": 16}})
    );

    // What it set is what the service's store enforces.
    let catalog = regional::quota::catalog(None).unwrap();
    let args = regional::quota::QuotaArgs {
        quota_dedicated_inferences: 5,
        ..Default::default()
    };
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let key = common::seal::Sealer::generate_key();
    let store = region_store::Store::new(pool, common::seal::Sealer::from_base64(&key).unwrap())
        .with_quotas(args.quotas("nyc2", &catalog));
    let quotas = store
        .quota_use(Uuid::parse_str(&team).unwrap())
        .await
        .unwrap();
    assert_eq!(
        quotas,
        serde_json::from_value(shown["quotas"].clone()).unwrap()
    );

    // A size the catalog does not know is refused, and nothing changes.
    let out = Command::new(env!("CARGO_BIN_EXE_regional"))
        .args([
            "quota",
            "set",
            "--team",
            &team,
            "--gpus-per-size",
            "gpu-nope=4",
        ])
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpu-nope"));

    let shown = quota(&db, &["reset", "--team", &team]);
    assert_eq!(
        shown["quotas"]["dedicated_inferences"],
        json!({"limit": 5, "used": 0})
    );
    assert_eq!(size(&shown, "gpu-h100x8-640gb")["limit"], 32);
}
