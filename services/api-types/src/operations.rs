//! The operations of the project's HTTP contracts as their clients call them: each is the
//! operation id, method and path template that an OpenAPI document under `openapi/` gives it,
//! and a client builds its URLs only through [`Operation::path_with`]. [`documented`] and
//! [`listed`] let a client's test show that its operations are exactly the document's.

use std::fmt;

pub use http::Method;
use serde_json::Value;

/// One operation of a document.
#[derive(Debug, Clone)]
pub struct Operation {
    /// The document's `operationId`.
    pub id: &'static str,
    pub method: Method,
    /// With its parameters in braces, as in the document.
    pub path: &'static str,
}

/// A value that may stand in a path parameter as it is: an id whose text needs no escaping
/// and cannot change the path's shape (no `/`, `?`, `%` or `..`).
pub trait PathValue: fmt::Display + Sync {}

impl PathValue for uuid::Uuid {}

impl Operation {
    pub const fn new(id: &'static str, method: Method, path: &'static str) -> Operation {
        Operation { id, method, path }
    }

    /// The path with each `{parameter}` replaced by the next of `values`, in order.
    pub fn path_with(&self, values: &[&dyn PathValue]) -> String {
        let mut out = String::with_capacity(self.path.len() + 40 * values.len());
        let mut values = values.iter();
        for (i, part) in self.path.split('{').enumerate() {
            match (i, part.split_once('}')) {
                (0, _) | (_, None) => out.push_str(part),
                (_, Some((_, rest))) => {
                    let value = values.next().expect("a value for every path parameter");
                    out.push_str(&value.to_string());
                    out.push_str(rest);
                }
            }
        }
        debug_assert!(values.next().is_none(), "more values than path parameters");
        out
    }
}

/// Every operation of OpenAPI document `doc` as (operationId, METHOD, path), sorted.
pub fn documented(doc: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (path, operations) in doc["paths"].as_object().into_iter().flatten() {
        for (method, operation) in operations.as_object().into_iter().flatten() {
            let id = operation["operationId"].as_str().unwrap_or_default();
            out.push((id.to_string(), method.to_uppercase(), path.clone()));
        }
    }
    out.sort();
    out
}

/// `operations` in the form of [`documented`], sorted.
pub fn listed(operations: &[&Operation]) -> Vec<(String, String, String)> {
    let mut out: Vec<_> = operations
        .iter()
        .map(|o| (o.id.to_string(), o.method.to_string(), o.path.to_string()))
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    const REVOKE: Operation = Operation::new(
        "revoke",
        Method::DELETE,
        "/v2/things/{id}/tokens/{token_id}",
    );

    #[test]
    fn path_parameters_are_filled_in_order() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        assert_eq!(
            REVOKE.path_with(&[&a, &b]),
            format!("/v2/things/{a}/tokens/{b}")
        );
        let list = Operation::new("list", Method::GET, "/v2/things");
        assert_eq!(list.path_with(&[]), "/v2/things");
    }

    #[test]
    fn a_document_and_a_list_compare_as_the_same_rows() {
        let doc = serde_json::json!({"paths": {
            "/v2/things/{id}/tokens/{token_id}": {"delete": {"operationId": "revoke"}},
        }});
        assert_eq!(documented(&doc), listed(&[&REVOKE]));
        let other = Operation::new("revoke", Method::GET, REVOKE.path);
        assert_ne!(documented(&doc), listed(&[&other]));
    }
}
