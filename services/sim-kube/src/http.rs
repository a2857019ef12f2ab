//! HTTP surface: authentication, URL parsing into (type, namespace, name,
//! subresource), and dispatch of each verb to one store operation.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use crate::discovery;
use crate::error::{ApiError, ApiResult};
use crate::managed::Scope;
use crate::ops::{self, DeleteOptions, Outcome, PatchKind, Writer};
use crate::resources::{self, TYPES};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{Key, Store};
use crate::watch::{self, WatchRequest};
use crate::Shared;

pub fn json_response(code: StatusCode, v: &Value) -> Response {
    json_text_response(code, serde_json::to_string(v).expect("json"))
}

/// A response of JSON already written (a stored object, a list of them).
fn json_text_response(code: StatusCode, json: String) -> Response {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(json))
        .expect("response")
}

fn ok(v: &Value) -> Response {
    json_response(StatusCode::OK, v)
}

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

/// A parsed resource URL.
struct Target {
    rt: usize,
    ns: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn parse_target(path: &str) -> ApiResult<Option<Target>> {
    let segs: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Ok(None),
    };
    if rest.is_empty() {
        return Ok(None);
    }
    let lookup = |plural: &str| {
        resources::by_plural(group, version, plural).ok_or_else(|| ApiError::not_found_path(path))
    };
    let t = |rt, ns: Option<&str>, name: Option<&str>, sub: Option<&str>| Target {
        rt,
        ns: ns.map(String::from),
        name: name.map(String::from),
        subresource: sub.map(String::from),
    };
    let target = match rest {
        [plural] => t(lookup(plural)?, None, None, None),
        [plural, name] => t(lookup(plural)?, None, Some(name), None),
        ["namespaces", ns, plural]
            if resources::by_plural(group, version, plural)
                .is_some_and(|i| TYPES[i].namespaced) =>
        {
            t(lookup(plural)?, Some(ns), None, None)
        }
        [plural, name, sub] => t(lookup(plural)?, None, Some(name), Some(sub)),
        ["namespaces", ns, plural, name] => t(lookup(plural)?, Some(ns), Some(name), None),
        ["namespaces", ns, plural, name, sub] => {
            t(lookup(plural)?, Some(ns), Some(name), Some(sub))
        }
        _ => return Err(ApiError::not_found_path(path)),
    };
    let rt = &TYPES[target.rt];
    // Namespaced kinds are addressed through /namespaces/{ns}/ (or cluster-wide
    // for list/watch); cluster-scoped kinds never are.
    if rt.namespaced == target.ns.is_none() && !(rt.namespaced && target.name.is_none()) {
        return Err(ApiError::not_found_path(path));
    }
    if let Some(sub) = &target.subresource {
        let known = (sub == "status" && rt.status) || (sub == "scale" && rt.kind == "Deployment");
        if !known {
            return Err(ApiError::not_found_path(path));
        }
    }
    Ok(Some(target))
}

fn parse_query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn is_true(q: &HashMap<String, String>, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("true" | "1"))
}

/// The field manager for non-apply writes: `fieldManager`, else the user agent's
/// product name (what the real server records for clients that send none).
fn manager_for(q: &HashMap<String, String>, headers: &HeaderMap) -> String {
    if let Some(m) = q.get("fieldManager").filter(|m| !m.is_empty()) {
        return m.clone();
    }
    headers
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .and_then(|ua| ua.split(['/', ' ']).next())
        .filter(|s| !s.is_empty())
        .unwrap_or("unknown")
        .to_string()
}

fn parse_body(body: &Bytes) -> ApiResult<Value> {
    if body.is_empty() {
        return Err(ApiError::bad_request("the request body is empty"));
    }
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return Ok(v);
    }
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("the request body is not UTF-8"))?;
    serde_saphyr::from_str::<Value>(text)
        .map_err(|e| ApiError::bad_request(format!("the request body could not be decoded: {e}")))
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    tracing::debug!(%method, %uri, "sim-kube request");
    if let Some(token) = shared.config().bearer_token {
        let public = matches!(path.as_str(), "/healthz" | "/livez" | "/readyz");
        let sent = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !public && sent != Some(token.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    match dispatch(&shared, &method, &uri, &headers, &body) {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn dispatch(
    shared: &Arc<Shared>,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> ApiResult<Response> {
    let path = uri.path();
    let aggregated = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=APIGroupDiscoveryList"));
    let discovery_doc = |v: Value| {
        if aggregated {
            let mut r = ok(&v);
            r.headers_mut().insert(
                "content-type",
                discovery::AGGREGATED_CONTENT_TYPE.parse().expect("header"),
            );
            r
        } else {
            ok(&v)
        }
    };
    match path.trim_end_matches('/') {
        "/healthz" | "/livez" | "/readyz" => return Ok((StatusCode::OK, "ok").into_response()),
        "/version" => return Ok(ok(&discovery::version())),
        "/api" if aggregated => return Ok(discovery_doc(discovery::aggregated(true))),
        "/api" => return Ok(ok(&discovery::api_versions())),
        "/apis" if aggregated => return Ok(discovery_doc(discovery::aggregated(false))),
        "/apis" => return Ok(ok(&discovery::api_group_list())),
        _ => {}
    }
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", v] => {
            return discovery::resource_list("", v)
                .map(|d| ok(&d))
                .ok_or_else(|| ApiError::not_found_path(path))
        }
        ["apis", g, v] => {
            return discovery::resource_list(g, v)
                .map(|d| ok(&d))
                .ok_or_else(|| ApiError::not_found_path(path))
        }
        _ => {}
    }
    // A pod's port, through the API server: not a stored resource.
    if crate::pod_proxy::parse(path).is_some() {
        return crate::pod_proxy::serve(shared, method, uri);
    }
    // Only JSON (and YAML) bodies: protobuf/CBOR clients get 415 and fall back to JSON.
    if let Some(ct) = headers.get("content-type").and_then(|v| v.to_str().ok()) {
        if ct.contains("protobuf") || ct.contains("cbor") {
            return Err(ApiError::unsupported_media(ct));
        }
    }
    let Some(target) = parse_target(path)? else {
        return Err(ApiError::not_found_path(path));
    };
    let q = parse_query(uri);
    let store = &shared.store;
    let rt = &TYPES[target.rt];
    let ns = target.ns.as_deref();
    let writer = Writer {
        manager: manager_for(&q, headers),
        dry_run: q.get("dryRun").is_some_and(|d| d == "All"),
    };
    if target.subresource.as_deref() == Some("scale") {
        let name = target.name.as_deref().unwrap_or_default();
        return scale(
            store,
            target.rt,
            ns.unwrap_or_default(),
            name,
            method,
            headers,
            body,
            &writer,
        );
    }
    let scope = if target.subresource.is_some() {
        Scope::Status
    } else {
        Scope::for_main(rt)
    };
    let counted = |o: Outcome, created_code: StatusCode| -> Response {
        if o.changed && !writer.dry_run {
            store.count_write();
        }
        let code = if o.changed {
            created_code
        } else {
            StatusCode::OK
        };
        json_response(code, &o.object)
    };
    match (method.clone(), target.name.as_deref()) {
        (Method::GET, None) => {
            let labels =
                LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?;
            let fields =
                FieldSelector::parse(q.get("fieldSelector").map(String::as_str).unwrap_or(""))?;
            if is_true(&q, "watch") {
                let timeout = q
                    .get("timeoutSeconds")
                    .and_then(|t| t.parse::<u64>().ok())
                    .map(Duration::from_secs)
                    .unwrap_or(Duration::from_secs(1800));
                return watch::serve(
                    shared.store.clone(),
                    shared.shutdown_rx(),
                    WatchRequest {
                        rt: target.rt,
                        ns: target.ns.clone(),
                        labels,
                        fields,
                        resource_version: q.get("resourceVersion").cloned(),
                        send_initial_events: is_true(&q, "sendInitialEvents"),
                        bookmarks: is_true(&q, "allowWatchBookmarks"),
                        timeout,
                    },
                );
            }
            Ok(list_response(store, target.rt, ns, &labels, &fields))
        }
        (Method::GET, Some(name)) => {
            // The object as stored: no parse, no serialisation.
            let text = store
                .lock()
                .objects
                .get(&Key::new(target.rt, ns.unwrap_or(""), name))
                .map(|o| o.text().to_owned())
                .ok_or_else(|| ApiError::not_found(rt, name))?;
            Ok(json_text_response(StatusCode::OK, text))
        }
        (Method::POST, None) => {
            if rt.namespaced && ns.is_none() {
                return Err(ApiError::method_not_allowed());
            }
            let obj = parse_body(body)?;
            Ok(counted(
                ops::create(store, target.rt, ns, obj, &writer)?,
                StatusCode::CREATED,
            ))
        }
        (Method::PUT, Some(name)) => {
            let obj = parse_body(body)?;
            Ok(counted(
                ops::replace(store, target.rt, ns, name, obj, scope, &writer)?,
                StatusCode::OK,
            ))
        }
        (Method::PATCH, Some(name)) => {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_string();
            let kind = match ct.as_str() {
                "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                    PatchKind::Merge
                }
                "application/json-patch+json" => PatchKind::Json,
                "application/apply-patch+yaml" | "application/apply-patch+json" => PatchKind::Apply,
                other => return Err(ApiError::unsupported_media(other)),
            };
            if kind == PatchKind::Apply && !q.contains_key("fieldManager") {
                return Err(ApiError::bad_request(
                    "PATCH, application/apply-patch+yaml requires fieldManager parameter",
                ));
            }
            let obj = parse_body(body)?;
            let existed = store
                .lock()
                .get(&Key::new(target.rt, ns.unwrap_or(""), name))
                .is_some();
            let out = ops::patch(
                store,
                target.rt,
                ns,
                name,
                kind,
                obj,
                is_true(&q, "force"),
                scope,
                &writer,
            )?;
            let code = if existed {
                StatusCode::OK
            } else {
                StatusCode::CREATED
            };
            Ok(counted(out, code))
        }
        (Method::DELETE, Some(name)) => {
            let opts = delete_options(&q, body)?;
            let out = ops::delete(store, target.rt, ns, name, &opts)?;
            if out.changed && !opts.dry_run {
                store.count_write();
            }
            if out.removed {
                let mut details =
                    json!({"name": name, "kind": rt.plural, "uid": out.object["metadata"]["uid"]});
                if !rt.group.is_empty() {
                    details["group"] = json!(rt.group);
                }
                return Ok(ok(&json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Success", "details": details
                })));
            }
            Ok(ok(&out.object))
        }
        (Method::DELETE, None) => {
            let opts = delete_options(&q, body)?;
            let labels =
                LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?;
            let fields =
                FieldSelector::parse(q.get("fieldSelector").map(String::as_str).unwrap_or(""))?;
            let victims = list(store, target.rt, ns, &labels, &fields);
            let mut items = Vec::new();
            for obj in victims["items"].as_array().cloned().unwrap_or_default() {
                let name = obj["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let ons = obj["metadata"]["namespace"].as_str().map(String::from);
                if let Ok(out) = ops::delete(store, target.rt, ons.as_deref(), &name, &opts) {
                    if out.changed && !opts.dry_run {
                        store.count_write();
                    }
                    items.push(out.object);
                }
            }
            let mut l = victims;
            l["items"] = Value::Array(items);
            Ok(ok(&l))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// An `autoscaling/v1` Scale view of a Deployment.
fn scale_of(d: &Value) -> Value {
    let meta = &d["metadata"];
    let selector = d
        .pointer("/spec/selector/matchLabels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    json!({
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
            "resourceVersion": meta["resourceVersion"], "creationTimestamp": meta["creationTimestamp"],
        },
        "spec": {"replicas": d.pointer("/spec/replicas").cloned().unwrap_or(json!(1))},
        "status": {"replicas": d.pointer("/status/replicas").cloned().unwrap_or(json!(0)), "selector": selector},
    })
}

/// `deployments/{name}/scale`: reads and writes `spec.replicas` through a Scale object.
#[allow(clippy::too_many_arguments)]
fn scale(
    store: &Store,
    rti: usize,
    ns: &str,
    name: &str,
    method: &Method,
    headers: &HeaderMap,
    body: &Bytes,
    writer: &Writer,
) -> ApiResult<Response> {
    let current = store
        .lock()
        .get(&Key::new(rti, ns, name))
        .ok_or_else(|| ApiError::not_found(&TYPES[rti], name))?;
    let mut wanted = scale_of(&current);
    match *method {
        Method::GET => return Ok(ok(&wanted)),
        Method::PUT => {
            let b = parse_body(body)?;
            let rv = b
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !rv.is_empty()
                && Some(rv)
                    != current
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
            {
                return Err(ApiError::stale(&TYPES[rti], name));
            }
            wanted["spec"] = b["spec"].clone();
        }
        Method::PATCH => {
            let b = parse_body(body)?;
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if ct.starts_with("application/json-patch+json") {
                crate::patch::json_patch(&mut wanted, &b)?;
            } else {
                crate::patch::merge_patch(&mut wanted, &b);
            }
        }
        _ => return Err(ApiError::method_not_allowed()),
    }
    let replicas = wanted
        .pointer("/spec/replicas")
        .cloned()
        .unwrap_or(json!(0));
    if !replicas.is_i64() || replicas.as_i64() < Some(0) {
        return Err(ApiError::invalid(
            &TYPES[rti],
            name,
            vec![crate::error::Cause::invalid(
                "spec.replicas",
                &replicas.to_string(),
                "must be greater than or equal to 0",
            )],
        ));
    }
    let out = ops::patch(
        store,
        rti,
        Some(ns),
        name,
        PatchKind::Merge,
        json!({"spec": {"replicas": replicas}}),
        false,
        Scope::for_main(&TYPES[rti]),
        writer,
    )?;
    if out.changed && !writer.dry_run {
        store.count_write();
    }
    Ok(ok(&scale_of(&out.object)))
}

fn delete_options(q: &HashMap<String, String>, body: &Bytes) -> ApiResult<DeleteOptions> {
    let b: Value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?
    };
    let s = |v: &Value| v.as_str().map(String::from);
    let mut opts = DeleteOptions {
        propagation: s(&b["propagationPolicy"]).or_else(|| q.get("propagationPolicy").cloned()),
        uid: s(&b["preconditions"]["uid"]),
        resource_version: s(&b["preconditions"]["resourceVersion"]),
        dry_run: q.get("dryRun").is_some_and(|d| d == "All")
            || b["dryRun"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == "All")),
    };
    // The deprecated orphanDependents flag maps onto a propagation policy.
    if opts.propagation.is_none() {
        match b["orphanDependents"]
            .as_bool()
            .or_else(|| q.get("orphanDependents").map(|v| v == "true"))
        {
            Some(true) => opts.propagation = Some("Orphan".into()),
            Some(false) => opts.propagation = Some("Background".into()),
            None => {}
        }
    }
    Ok(opts)
}

/// A list response as the client reads it, its items as stored: matching them parses them (if
/// they were not in use), writing them does not.
fn list_response(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> Response {
    let rt = &TYPES[rti];
    let inner = store.lock();
    let mut body = format!(
        "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{}\"}},\"items\":[",
        rt.kind,
        rt.api_version(),
        inner.rv
    );
    let mut first = true;
    for o in inner.stored(rti, ns) {
        let value = o.value();
        if labels.matches(&value) && fields.matches(&value) {
            if !first {
                body.push(',');
            }
            first = false;
            body.push_str(o.text());
        }
    }
    body.push_str("]}");
    json_text_response(StatusCode::OK, body)
}

/// A list response: items carry apiVersion/kind, metadata carries the store's
/// current resourceVersion (the point to start a watch from).
pub fn list(
    store: &Store,
    rti: usize,
    ns: Option<&str>,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> Value {
    let rt = &TYPES[rti];
    let inner = store.lock();
    let items: Vec<Value> = inner
        .list(rti, ns)
        .filter(|o| labels.matches(o) && fields.matches(o))
        .map(Arc::unwrap_or_clone)
        .collect();
    json!({
        "kind": format!("{}List", rt.kind),
        "apiVersion": rt.api_version(),
        "metadata": {"resourceVersion": inner.rv.to_string()},
        "items": items,
    })
}
