//! Read-only views of one dedicated inference: its lifecycle events, its replicas with recent
//! scaling decisions, its accelerators and its private endpoint's CA certificate.

use serde_json::{json, Value};

use super::{print_json, print_raw};
use crate::client::{Client, Id};
use crate::render::{self, s};
use crate::{Failure, Output};

pub(crate) async fn events(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
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

pub(crate) async fn replicas(
    client: &Client,
    out: Output,
    id: &str,
    last: usize,
) -> Result<(), Failure> {
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

pub(crate) async fn accelerators(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
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

pub(crate) async fn ca(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
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
