//! How the gateway rewrites answers, derived from a cluster's objects the way Envoy Gateway
//! derives it: the `responseOverride` list of the BackendTrafficPolicy that targets the Gateway,
//! applied by Envoy's custom response filter (envoy.filters.http.custom_response, its local
//! response policy).
//!
//! Envoy Gateway's behaviour, followed here:
//! - only a policy its controller accepted for its current generation is applied; none, or one
//!   refused, leaves answers as they are;
//! - the first override whose match holds wins: any of its `statusCodes` (a value or a range)
//!   and every one of its `responseHeaders` (a header sent more than once is matched as its
//!   values joined with commas, as Envoy's header match input reads it);
//! - the answer is then replaced by a local reply (`sendLocalReply`): the override's status code
//!   (else the original's), content type and body (else none), and its header additions and
//!   settings; nothing of the original's headers or body is kept.
//!
//! Which answers the filter sees is not settled by the documents for one case: the endpoint
//! picker's own reply (an ext_proc immediate response) reaches it only if the inference
//! extension puts its ext_proc filter after the custom response filter. The simulation takes
//! the answer in which it does; the worker's design holds with either (see its README).

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::Value;

use crate::auth::accepted;
use crate::objects::{gateway_policy, Objects};

/// One `responseOverride` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseOverride {
    /// Inclusive ranges; empty: any status.
    statuses: Vec<(u16, u16)>,
    headers: Vec<HeaderMatch>,
    status: Option<u16>,
    content_type: Option<String>,
    body: Option<String>,
    add: Vec<(String, String)>,
    set: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct HeaderMatch {
    name: String,
    kind: MatchKind,
    value: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MatchKind {
    Exact,
    Prefix,
    Suffix,
}

impl ResponseOverride {
    fn parse(o: &Value) -> Option<ResponseOverride> {
        let m = &o["match"];
        let mut statuses = Vec::new();
        for s in m["statusCodes"].as_array().into_iter().flatten() {
            let code = |v: &Value| v.as_u64().and_then(|c| u16::try_from(c).ok());
            statuses.push(match s["type"].as_str().unwrap_or("Value") {
                "Range" => (
                    code(s.pointer("/range/start")?)?,
                    code(s.pointer("/range/end")?)?,
                ),
                _ => {
                    let c = code(&s["value"])?;
                    (c, c)
                }
            });
        }
        let mut headers = Vec::new();
        for h in m["responseHeaders"].as_array().into_iter().flatten() {
            let kind = match h.pointer("/value/type").and_then(Value::as_str) {
                None | Some("Exact") => MatchKind::Exact,
                Some("Prefix") => MatchKind::Prefix,
                Some("Suffix") => MatchKind::Suffix,
                // Not simulated: such an override never matches.
                Some(_) => return None,
            };
            headers.push(HeaderMatch {
                name: h["name"].as_str()?.to_ascii_lowercase(),
                kind,
                value: h.pointer("/value/value")?.as_str()?.to_string(),
            });
        }
        let r = o.get("response")?;
        let pairs = |key: &str| -> Vec<(String, String)> {
            r.pointer(&format!("/header/{key}"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|h| Some((h["name"].as_str()?.into(), h["value"].as_str()?.into())))
                .collect()
        };
        Some(ResponseOverride {
            statuses,
            headers,
            status: r["statusCode"].as_u64().map(|c| c as u16),
            content_type: r["contentType"].as_str().map(str::to_string),
            body: r
                .pointer("/body/inline")
                .and_then(Value::as_str)
                .map(str::to_string),
            add: pairs("add"),
            set: pairs("set"),
        })
    }

    fn matches(&self, resp: &Response) -> bool {
        let code = resp.status().as_u16();
        (self.statuses.is_empty() || self.statuses.iter().any(|(a, b)| (*a..=*b).contains(&code)))
            && self.headers.iter().all(|h| {
                let values: Vec<&str> = resp
                    .headers()
                    .get_all(h.name.as_str())
                    .iter()
                    .map(|v| v.to_str().unwrap_or(""))
                    .collect();
                if values.is_empty() {
                    return false;
                }
                let v = values.join(",");
                match h.kind {
                    MatchKind::Exact => v == h.value,
                    MatchKind::Prefix => v.starts_with(&h.value),
                    MatchKind::Suffix => v.ends_with(&h.value),
                }
            })
    }
}

/// The overrides of Gateway `gw` in namespace `ns`, and a note of what is wrong, if anything.
pub fn overrides(objs: &Objects, ns: &str, gw: &str) -> (Vec<ResponseOverride>, Option<String>) {
    let policy = gateway_policy(objs, "BackendTrafficPolicy", ns, gw);
    let Some(policy) = policy else {
        return (Vec::new(), None);
    };
    let name = policy["metadata"]["name"].as_str().unwrap_or("");
    match accepted(policy) {
        Some(true) => {}
        Some(false) => {
            return (
                Vec::new(),
                Some(format!("BackendTrafficPolicy {ns}/{name} not accepted")),
            )
        }
        None => return (Vec::new(), None),
    }
    let list = policy
        .pointer("/spec/responseOverride")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(ResponseOverride::parse)
        .collect();
    (list, None)
}

/// `resp` as the first matching override replaces it (unchanged when none matches).
pub fn apply(overrides: &[ResponseOverride], resp: Response) -> Response {
    let Some(o) = overrides.iter().find(|o| o.matches(&resp)) else {
        return resp;
    };
    let status = o
        .status
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(resp.status());
    let mut reply = Response::new(Body::from(o.body.clone().unwrap_or_default()));
    *reply.status_mut() = status;
    let headers = reply.headers_mut();
    if let Some(ct) = o
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
    {
        headers.insert(axum::http::header::CONTENT_TYPE, ct);
    }
    let header = |(n, v): &(String, String)| {
        Some((
            HeaderName::from_bytes(n.as_bytes()).ok()?,
            HeaderValue::from_str(v).ok()?,
        ))
    };
    for (n, v) in o.set.iter().filter_map(header) {
        headers.insert(n, v);
    }
    for (n, v) in o.add.iter().filter_map(header) {
        headers.append(n, v);
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;
    use serde_json::json;
    use std::sync::Arc;

    /// The overrides of Gateway `ns`/`gw` in a cluster holding `policy` alone.
    fn of(policy: Arc<Value>, ns: &str, gw: &str) -> (Vec<ResponseOverride>, Option<String>) {
        overrides(&Objects::new(&[policy]), ns, gw)
    }

    fn policy(accepted: &str) -> Arc<Value> {
        Arc::new(json!({
            "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "BackendTrafficPolicy",
            "metadata": {"name": "p", "namespace": "di", "generation": 1},
            "spec": {
                "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}],
                "responseOverride": [{
                    "match": {"statusCodes": [{"type": "Value", "value": 503}],
                              "responseHeaders": [{"name": "X-Why", "value": {"value": "cold"}}]},
                    "response": {"contentType": "application/json", "body": {"type": "Inline", "inline": "{}"},
                                 "header": {"add": [{"name": "Retry-After", "value": "30"}]}},
                }],
            },
            "status": {"ancestors": [{"conditions": [{"type": "Accepted", "status": accepted, "observedGeneration": 1}]}]},
        }))
    }

    fn answer(code: StatusCode, why: Option<&str>) -> Response {
        let mut r = (code, "bare").into_response();
        if let Some(w) = why {
            r.headers_mut()
                .insert("x-why", HeaderValue::from_str(w).unwrap());
        }
        r
    }

    #[tokio::test]
    async fn an_accepted_override_rewrites_only_the_answers_it_matches() {
        let (list, note) = of(policy("True"), "di", "gw");
        assert_eq!((list.len(), note), (1, None));
        let r = apply(&list, answer(StatusCode::SERVICE_UNAVAILABLE, Some("cold")));
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "30");
        assert_eq!(r.headers()["content-type"], "application/json");
        assert!(
            r.headers().get("x-why").is_none(),
            "a local reply keeps nothing of the original"
        );
        let body = axum::body::to_bytes(r.into_body(), 1 << 10).await.unwrap();
        assert_eq!(&body[..], b"{}");
        let mut twice = answer(StatusCode::SERVICE_UNAVAILABLE, Some("cold"));
        twice
            .headers_mut()
            .append("x-why", HeaderValue::from_static("cold"));
        assert!(
            apply(&list, twice).headers().get("retry-after").is_none(),
            "matched as \"cold,cold\""
        );
        for other in [
            answer(StatusCode::SERVICE_UNAVAILABLE, None),
            answer(StatusCode::SERVICE_UNAVAILABLE, Some("other")),
            answer(StatusCode::TOO_MANY_REQUESTS, Some("cold")),
        ] {
            assert!(apply(&list, other).headers().get("retry-after").is_none());
        }
    }

    #[test]
    fn a_policy_not_accepted_or_on_another_gateway_changes_nothing() {
        let (list, note) = of(policy("False"), "di", "gw");
        assert!(list.is_empty() && note.is_some());
        assert!(of(policy("True"), "di", "other").0.is_empty());
        assert!(of(policy("True"), "elsewhere", "gw").0.is_empty());
    }
}
