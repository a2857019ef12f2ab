//! The `pods/proxy` subresource: `/api/v1/namespaces/{ns}/pods/{name}[:{port}]/proxy/{path}`,
//! through which the real API server forwards a request to a pod's port (how an in-cluster
//! component without a network route to the pods, or a client outside the cluster, reads a
//! pod's `/metrics`). The cluster runs no containers, so what a pod answers is the answer of an
//! optional hook ([`PodProxy`]); the cluster itself checks only what the API server checks
//! before it forwards: that the pod exists and can be reached.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, StatusCode, Uri};
use axum::response::Response;
use serde_json::Value;

use crate::error::{ApiError, ApiResult};
use crate::resources::{self, TYPES};
use crate::store::Key;
use crate::Shared;

/// One request to a pod's port, as a [`PodProxy`] is asked to answer it.
#[derive(Debug, Clone)]
pub struct ProxyRequest {
    pub method: String,
    pub namespace: String,
    pub pod_name: String,
    /// The pod as stored (labels, container args, status).
    pub pod: Value,
    /// The port of the URL's `{name}:{port}` form (a number or a port name); `None` when the
    /// URL names none (the real server then uses the pod's first port).
    pub port: Option<String>,
    /// The path on the pod, with its leading `/` (`/metrics`).
    pub path: String,
    /// The query string, without `?`.
    pub query: Option<String>,
    /// Every object of the cluster at the time of the request, shared rather than copied: what
    /// the process in the pod could learn from the API (its Deployment, its Service, its
    /// ConfigMaps), for hooks whose answer depends on more than the pod.
    pub objects: Vec<Arc<Value>>,
}

/// What the pod answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyResponse {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// Answers requests to pods' ports on behalf of the containers the cluster does not run (see
/// [`crate::ClusterConfig::pod_proxy`]). Called on the API request's task, so it must answer
/// at once.
pub trait PodProxy: Send + Sync {
    /// `None`: nothing listens there (the API server answers 503, as when it cannot connect).
    fn proxy(&self, request: &ProxyRequest) -> Option<ProxyResponse>;
}

/// `Some((namespace, pod segment, path on the pod))` when `path` addresses a pod's proxy.
pub(crate) fn parse(path: &str) -> Option<(&str, &str, String)> {
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let (ns, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("pods/")?;
    let (pod, rest) = rest.split_once('/')?;
    let tail = if rest == "proxy" {
        ""
    } else {
        rest.strip_prefix("proxy/")?
    };
    if ns.is_empty() || pod.is_empty() {
        return None;
    }
    Some((ns, pod, format!("/{tail}")))
}

/// `name`, `name:port` or `scheme:name:port`, as the API server accepts them.
fn split_port(segment: &str) -> (&str, Option<&str>) {
    let parts: Vec<&str> = segment.split(':').collect();
    match parts.as_slice() {
        [name] => (name, None),
        [name, port] => (name, Some(*port).filter(|p| !p.is_empty())),
        [_scheme, name, port, ..] => (name, Some(*port).filter(|p| !p.is_empty())),
        [] => (segment, None),
    }
}

fn unreachable(why: &str) -> ApiError {
    ApiError::service_unavailable(format!("error trying to reach service: {why}"))
}

fn ready(pod: &Value) -> bool {
    pod.pointer("/status/phase").and_then(Value::as_str) == Some("Running")
        && pod
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
}

pub(crate) fn serve(shared: &Shared, method: &Method, uri: &Uri) -> ApiResult<Response> {
    let path = uri.path();
    let Some((ns, segment, on_pod)) = parse(path) else {
        return Err(ApiError::not_found_path(path));
    };
    let (name, port) = split_port(segment);
    let rt = resources::index_of("Pod");
    let (pod, objects) = {
        let inner = shared.store.lock();
        let pod = inner
            .get(&Key::new(rt, ns, name))
            .map(Arc::unwrap_or_clone)
            .ok_or_else(|| ApiError::not_found(&TYPES[rt], name))?;
        (pod, inner.objects.values().map(|o| o.value()).collect())
    };
    // The API server connects to the pod's IP: a pod that is not running has none to connect
    // to, and one that is not ready is not serving yet.
    if !ready(&pod) {
        return Err(unreachable(&format!(
            "pod {ns}/{name} is not running and ready"
        )));
    }
    let Some(hook) = shared.config().pod_proxy else {
        return Err(unreachable(&format!(
            "dial tcp: connection refused (pod {ns}/{name})"
        )));
    };
    let request = ProxyRequest {
        method: method.to_string(),
        namespace: ns.to_string(),
        pod_name: name.to_string(),
        pod,
        port: port.map(str::to_string),
        path: on_pod,
        query: uri.query().map(str::to_string),
        objects,
    };
    let Some(answer) = hook.proxy(&request) else {
        return Err(unreachable(&format!(
            "dial tcp: connection refused (pod {ns}/{name}, port {})",
            port.unwrap_or("default")
        )));
    };
    Ok(Response::builder()
        .status(StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY))
        .header("content-type", answer.content_type)
        .body(Body::from(answer.body))
        .expect("response"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_paths() {
        assert_eq!(
            parse("/api/v1/namespaces/ns/pods/vllm-abc:8000/proxy/metrics"),
            Some(("ns", "vllm-abc:8000", "/metrics".to_string()))
        );
        assert_eq!(
            parse("/api/v1/namespaces/ns/pods/p/proxy"),
            Some(("ns", "p", "/".to_string()))
        );
        assert_eq!(
            parse("/api/v1/namespaces/ns/pods/p/proxy/a/b"),
            Some(("ns", "p", "/a/b".to_string()))
        );
        assert_eq!(parse("/api/v1/namespaces/ns/pods/p/status"), None);
        assert_eq!(parse("/api/v1/namespaces/ns/pods/p"), None);
        assert_eq!(split_port("p:8000"), ("p", Some("8000")));
        assert_eq!(split_port("https:p:9090"), ("p", Some("9090")));
        assert_eq!(split_port("p"), ("p", None));
    }
}
