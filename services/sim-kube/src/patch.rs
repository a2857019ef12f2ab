//! JSON merge patch (RFC 7386) and JSON patch (RFC 6902). Strategic merge patch
//! is served as a merge patch: lists are replaced, not merged by key.

use serde_json::Value;

use crate::error::{ApiError, ApiResult};

pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn split_pointer(path: &str) -> ApiResult<(String, String)> {
    if !path.starts_with('/') {
        return Err(ApiError::unprocessable(format!(
            "invalid JSON pointer {path:?}"
        )));
    }
    let idx = path.rfind('/').expect("starts with /");
    Ok((path[..idx].to_string(), unescape(&path[idx + 1..])))
}

fn parent_mut<'a>(doc: &'a mut Value, parent: &str) -> ApiResult<&'a mut Value> {
    doc.pointer_mut(parent).ok_or_else(|| {
        ApiError::unprocessable(format!("jsonpatch: path {parent:?} does not exist"))
    })
}

fn add(doc: &mut Value, path: &str, value: Value) -> ApiResult<()> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    match parent_mut(doc, &parent)? {
        Value::Object(m) => {
            m.insert(last, value);
        }
        Value::Array(a) => {
            if last == "-" {
                a.push(value);
            } else {
                let i: usize = last.parse().map_err(|_| {
                    ApiError::unprocessable(format!("jsonpatch: bad index {last:?}"))
                })?;
                if i > a.len() {
                    return Err(ApiError::unprocessable("jsonpatch: index out of range"));
                }
                a.insert(i, value);
            }
        }
        _ => {
            return Err(ApiError::unprocessable(
                "jsonpatch: parent is not a container",
            ))
        }
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &str) -> ApiResult<Value> {
    let (parent, last) = split_pointer(path)?;
    let missing = || {
        ApiError::unprocessable(format!(
            "jsonpatch remove operation does not apply: doc is missing path: {path:?}"
        ))
    };
    match parent_mut(doc, &parent)? {
        Value::Object(m) => m.remove(&last).ok_or_else(missing),
        Value::Array(a) => {
            let i: usize = last.parse().map_err(|_| missing())?;
            if i >= a.len() {
                return Err(missing());
            }
            Ok(a.remove(i))
        }
        _ => Err(missing()),
    }
}

pub fn json_patch(doc: &mut Value, ops: &Value) -> ApiResult<()> {
    let ops = ops
        .as_array()
        .ok_or_else(|| ApiError::bad_request("json patch must be an array of operations"))?;
    for op in ops {
        let path = op["path"].as_str().unwrap_or_default();
        match op["op"].as_str().unwrap_or_default() {
            "add" => add(doc, path, op["value"].clone())?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                remove(doc, path)?;
                add(doc, path, op["value"].clone())?;
            }
            "test" => {
                if doc.pointer(path) != Some(&op["value"]) {
                    return Err(ApiError::unprocessable(format!(
                        "the server rejected our request due to an error in our request: testing value {path} failed"
                    )));
                }
            }
            "move" => {
                let from = op["from"].as_str().unwrap_or_default();
                let v = remove(doc, from)?;
                add(doc, path, v)?;
            }
            "copy" => {
                let from = op["from"].as_str().unwrap_or_default();
                let v = doc.pointer(from).cloned().ok_or_else(|| {
                    ApiError::unprocessable(format!("jsonpatch: missing {from:?}"))
                })?;
                add(doc, path, v)?;
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown json patch op {other:?}"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_removes_nulls_and_replaces_lists() {
        let mut d = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge_patch(&mut d, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(d, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    #[test]
    fn json_patch_finalizer_style() {
        let mut d = json!({"metadata": {"finalizers": ["x"]}});
        json_patch(
            &mut d,
            &json!([
                {"op": "test", "path": "/metadata/finalizers", "value": ["x"]},
                {"op": "add", "path": "/metadata/finalizers/-", "value": "y"},
                {"op": "remove", "path": "/metadata/finalizers/0"}
            ]),
        )
        .unwrap();
        assert_eq!(d, json!({"metadata": {"finalizers": ["y"]}}));
        assert!(json_patch(
            &mut d,
            &json!([{"op": "test", "path": "/metadata/finalizers", "value": []}])
        )
        .is_err());
    }
}
