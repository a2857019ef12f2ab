//! API errors rendered as Kubernetes `Status` objects, the only error shape
//! kube-rs and kubectl understand.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::resources::ResourceType;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

/// One field-level problem inside a 422.
#[derive(Debug, Clone)]
pub struct Cause {
    pub reason: &'static str,
    pub field: String,
    pub message: String,
}

impl Cause {
    pub fn required(field: &str) -> Cause {
        Cause {
            reason: "FieldValueRequired",
            field: field.to_string(),
            message: "Required value".to_string(),
        }
    }
    pub fn invalid(field: &str, value: &str, msg: &str) -> Cause {
        Cause {
            reason: "FieldValueInvalid",
            field: field.to_string(),
            message: format!("Invalid value: {value:?}: {msg}"),
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, rt: &ResourceType, name: &str) -> ApiError {
        let mut d = json!({"name": name, "kind": rt.plural});
        if !rt.group.is_empty() {
            d["group"] = json!(rt.group);
        }
        self.details = Some(d);
        self
    }

    pub fn not_found(rt: &ResourceType, name: &str) -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", rt.qualified()),
        )
        .with_details(rt, name)
    }
    pub fn namespace_not_found(ns: &str) -> ApiError {
        ApiError::new(404, "NotFound", format!("namespaces \"{ns}\" not found"))
            .with_details(&crate::resources::TYPES[0], ns)
    }
    pub fn not_found_path(path: &str) -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }
    pub fn already_exists(rt: &ResourceType, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", rt.qualified()),
        )
        .with_details(rt, name)
    }
    pub fn conflict(rt: &ResourceType, name: &str, why: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                rt.qualified()
            ),
        )
        .with_details(rt, name)
    }
    pub fn stale(rt: &ResourceType, name: &str) -> ApiError {
        ApiError::conflict(
            rt,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }
    pub fn apply_conflict(
        rt: &ResourceType,
        name: &str,
        conflicts: &[(String, String)],
    ) -> ApiError {
        let list: Vec<String> = conflicts
            .iter()
            .map(|(m, f)| format!("conflict with \"{m}\": {f}"))
            .collect();
        let mut e = ApiError::new(
            409,
            "Conflict",
            format!(
                "Apply failed with {} conflict{}: {}",
                conflicts.len(),
                if conflicts.len() == 1 { "" } else { "s" },
                list.join("; ")
            ),
        )
        .with_details(rt, name);
        if let Some(d) = e.details.as_mut() {
            d["causes"] = conflicts
                .iter()
                .map(|(m, f)| json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{m}\""), "field": f}))
                .collect();
        }
        e
    }
    pub fn invalid(rt: &ResourceType, name: &str, causes: Vec<Cause>) -> ApiError {
        let summary: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let msg = if summary.len() == 1 {
            summary[0].clone()
        } else {
            format!("[{}]", summary.join(", "))
        };
        let kind = if rt.group.is_empty() {
            rt.kind.to_string()
        } else {
            format!("{}.{}", rt.kind, rt.group)
        };
        let mut e = ApiError::new(
            422,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: {msg}"),
        );
        let mut d = json!({"name": name, "kind": rt.kind});
        if !rt.group.is_empty() {
            d["group"] = json!(rt.group);
        }
        d["causes"] = causes
            .iter()
            .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
            .collect();
        e.details = Some(d);
        e
    }
    pub fn bad_request(msg: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", msg)
    }
    pub fn unprocessable(msg: impl Into<String>) -> ApiError {
        ApiError::new(422, "Invalid", msg)
    }
    pub fn forbidden(msg: impl Into<String>) -> ApiError {
        ApiError::new(403, "Forbidden", msg)
    }
    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }
    pub fn unsupported_media(ct: &str) -> ApiError {
        ApiError::new(415, "UnsupportedMediaType", format!("the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/merge-patch+json, application/strategic-merge-patch+json, application/json-patch+json, application/apply-patch+yaml (got {ct:?})"))
    }
    pub fn service_unavailable(msg: impl Into<String>) -> ApiError {
        ApiError::new(503, "ServiceUnavailable", msg)
    }
    pub fn gone(msg: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", msg)
    }

    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        crate::http::json_response(code, &self.to_status())
    }
}
