//! Reading request bodies strictly: a size cap, JSON syntax (400), no nesting deeper than
//! [`MAX_DEPTH`] and no NUL characters anywhere (422, naming where), then the typed shape with the
//! failing field's path named (422). Each failure is a clear 4xx, never a 5xx.

use std::cell::Cell;
use std::fmt;

use axum::body::Body;
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::error::ApiError;

pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// How deep objects and arrays may nest in a body: far more than any request needs, and with
/// room under serde_json's recursion limit (128) for everything central wraps a request in (the
/// sealed intent, the region call, the change feed) and reads back.
pub const MAX_DEPTH: usize = 32;

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
    let value = bounded_value(bytes)?;
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

/// What a body may not carry, found while reading it.
#[derive(Clone, Copy)]
enum Refusal {
    TooDeep,
    Nul,
}

/// Reads JSON into a `Value`, refusing nesting deeper than [`MAX_DEPTH`] and NUL characters
/// (Postgres text cannot hold them) as it goes, with the path where it found them.
fn bounded_value(bytes: &[u8]) -> Result<Value, ApiError> {
    let refused = Cell::new(None);
    let mut track = serde_path_to_error::Track::new();
    let mut json = serde_json::Deserializer::from_slice(bytes);
    let seed = Bounded {
        levels_left: MAX_DEPTH,
        refused: &refused,
    };
    let read = seed.deserialize(serde_path_to_error::Deserializer::new(
        &mut json, &mut track,
    ));
    match (
        read.and_then(|value| json.end().map(|()| value)),
        refused.get(),
    ) {
        (Ok(value), _) => Ok(value),
        (Err(e), None) => Err(ApiError::BadRequest(format!(
            "The request body is not valid JSON: {e}."
        ))),
        (Err(_), Some(refusal)) => {
            let path = track.path().to_string();
            let at = if path == "." {
                "The request body"
            } else {
                &path
            };
            Err(ApiError::Unprocessable(match refusal {
                Refusal::TooDeep => format!("{at} nests deeper than {MAX_DEPTH} levels."),
                Refusal::Nul => format!("{at} must not contain NUL characters."),
            }))
        }
    }
}

/// A JSON value at most `levels_left` objects or arrays deep, without NUL characters; a refusal
/// is recorded in `refused` (the error itself only carries serde_json's position).
#[derive(Clone, Copy)]
struct Bounded<'a> {
    levels_left: usize,
    refused: &'a Cell<Option<Refusal>>,
}

impl Bounded<'_> {
    fn refuse<E: de::Error>(self, refusal: Refusal) -> E {
        self.refused.set(Some(refusal));
        E::custom("refused")
    }

    fn text<E: de::Error>(self, s: &str) -> Result<String, E> {
        if s.contains('\0') {
            return Err(self.refuse(Refusal::Nul));
        }
        Ok(s.to_owned())
    }

    fn inner<E: de::Error>(self) -> Result<Self, E> {
        match self.levels_left.checked_sub(1) {
            Some(levels_left) => Ok(Bounded {
                levels_left,
                ..self
            }),
            None => Err(self.refuse(Refusal::TooDeep)),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.text(v).map(Value::String)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(inner)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let key = self.text(&key)?;
            object.insert(key, map.next_value_seed(inner)?);
        }
        Ok(Value::Object(object))
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
    fn nesting_deeper_than_the_limit_is_422_naming_where() {
        let nested = |levels: usize| {
            format!(
                "{{\"spec\":{}1{}}}",
                "[".repeat(levels - 1),
                "]".repeat(levels - 1)
            )
        };
        assert_eq!(
            parse::<serde_json::Value>(nested(MAX_DEPTH).as_bytes())
                .err()
                .map(message),
            None
        );
        let (status, msg) = message(
            parse::<serde_json::Value>(nested(MAX_DEPTH + 1).as_bytes())
                .err()
                .unwrap(),
        );
        assert_eq!(status, 422);
        assert!(
            msg.starts_with(&format!("spec{}", "[0]".repeat(MAX_DEPTH - 1))),
            "{msg}"
        );
        // Far beyond serde_json's own recursion limit, still a 422 naming where.
        let (status, msg) = message(
            parse::<serde_json::Value>(nested(10_000).as_bytes())
                .err()
                .unwrap(),
        );
        assert_eq!(status, 422);
        assert!(msg.starts_with("spec[0]"), "{msg}");
    }

    #[test]
    fn the_value_read_is_the_json_sent() {
        let text = br#"{"b":[1,-2,3.5,true,null,"x\u00e9"],"a":{"c":{}}}"#;
        let parsed = parse::<serde_json::Value>(text).unwrap();
        assert_eq!(
            parsed.value,
            serde_json::from_slice::<serde_json::Value>(text).unwrap()
        );
        assert_eq!(
            parsed.canonical,
            r#"{"a":{"c":{}},"b":[1,-2,3.5,true,null,"xé"]}"#
        );
        let trailing = parse::<serde_json::Value>(b"{} {}").err().unwrap();
        assert_eq!(message(trailing).0, 400);
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
