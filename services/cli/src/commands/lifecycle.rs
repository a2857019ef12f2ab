//! A dedicated inference's life: create, get, list, update (the file's spec completed from the
//! latest one) and delete (confirmed on a terminal), each optionally waiting for the outcome.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::{as_body, done_or, print_json, print_raw, read_object};
use crate::client::{Client, Id, ListFilter};
use crate::render::{self, s};
use crate::wait::{self, EventCursor, Goal};
use crate::{Failure, Output, WaitArgs};

pub(crate) async fn create(
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

pub(crate) async fn get(client: &Client, out: Output, id: &str) -> Result<(), Failure> {
    let answer = client.get(&Id::parse(id)?).await?;
    match out {
        Output::Json => print_raw(&answer),
        Output::Text => print!("{}", render::di(&answer.body["dedicated_inference"])),
    }
    Ok(())
}

pub(crate) async fn list(
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

pub(crate) async fn update(
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

pub(crate) async fn delete(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
