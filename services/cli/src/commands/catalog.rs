//! What can be deployed: GPU sizes with their prices and regions, and which models run on which
//! GPUs.

use super::print_raw;
use crate::client::Client;
use crate::render::{self, s};
use crate::{Failure, Output};

pub(crate) async fn sizes(client: &Client, out: Output) -> Result<(), Failure> {
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

pub(crate) async fn gpu_model_config(client: &Client, out: Output) -> Result<(), Failure> {
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
