//! What each command does: the API calls, then the answer rendered for a terminal or as the
//! API's JSON. `main` parses the arguments and dispatches here.

mod catalog;
mod inspect;
mod lifecycle;
mod tokens;

pub(super) use catalog::{gpu_model_config, sizes};
pub(super) use inspect::{accelerators, ca, events, replicas};
pub(super) use lifecycle::{create, delete, get, list, update};
pub(super) use tokens::tokens;

use std::io::Read;
use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::client;
use crate::render::s;
use crate::wait::Outcome;
use crate::Failure;

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
