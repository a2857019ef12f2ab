//! Reading request bodies strictly: a size cap, JSON syntax (400), no NUL characters anywhere
//! (422; Postgres text cannot hold them), then the typed shape with the failing field's path
//! named (422). Each failure is a clear 4xx, never a 5xx.

use axum::body::Body;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A parsed body: the typed request plus the canonical JSON it came from (for fingerprints).
pub struct Parsed<T> {
    pub value: T,
    pub canonical: String,
}

pub async fn read<T: DeserializeOwned>(body: Body) -> Result<Parsed<T>, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge)?;
    parse(&bytes)
}

pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<Parsed<T>, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::BadRequest(format!("The request body is not valid JSON: {e}.")))?;
    if let Some(path) = nul_path(&value, String::new()) {
        return Err(ApiError::Unprocessable(format!(
            "{path} must not contain NUL characters."
        )));
    }
    let canonical = value.to_string();
    let value = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::Unprocessable(format!("The request body is invalid: {inner}."))
        } else {
            ApiError::Unprocessable(format!("{path} is invalid: {inner}."))
        }
    })?;
    Ok(Parsed { value, canonical })
}

fn nul_path(value: &serde_json::Value, at: String) -> Option<String> {
    use serde_json::Value;
    let here = || {
        if at.is_empty() {
            "body".to_string()
        } else {
            at.clone()
        }
    };
    match value {
        Value::String(s) if s.contains('\0') => Some(here()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| nul_path(v, format!("{}[{i}]", here()))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            if k.contains('\0') {
                return Some(here());
            }
            nul_path(
                v,
                if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                },
            )
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Probe {
        #[allow(dead_code)]
        spec: Inner,
    }
    #[derive(serde::Deserialize, Debug)]
    struct Inner {
        #[allow(dead_code)]
        scale: u32,
    }

    fn message(e: ApiError) -> (u16, String) {
        let (status, _, message) = e.parts();
        (status.as_u16(), message)
    }

    #[test]
    fn syntax_errors_are_400() {
        let err = parse::<Probe>(b"{\"spec\":").err().unwrap();
        assert_eq!(message(err).0, 400);
    }

    #[test]
    fn escaped_nul_is_422_naming_the_field() {
        let err = parse::<Probe>(br#"{"spec":{"scale":1,"name":"a\u0000b"}}"#)
            .err()
            .unwrap();
        let (status, msg) = message(err);
        assert_eq!(status, 422);
        assert!(msg.contains("spec.name"), "{msg}");
    }

    #[test]
    fn wrong_types_are_422_naming_the_field() {
        let err = parse::<Probe>(br#"{"spec":{"scale":"two"}}"#)
            .err()
            .unwrap();
        let (status, msg) = message(err);
        assert_eq!(status, 422);
        assert!(msg.contains("spec.scale"), "{msg}");
    }
}
