//! A small Prometheus registry: counters, gauges and latency histograms with labels, rendered in
//! the text exposition format on `GET /metrics`. One process-wide registry; label sets are few
//! (routes, statuses, phases), so a mutex-guarded map is plenty and keeps dependencies at zero.
//! A series is never dropped, so every label takes its value from a small fixed set, never from
//! what a request says; and `/metrics` is served on an internal listener ([`serve`]), never on
//! a public port.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;

const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
struct Histogram {
    /// Upper bounds of the buckets, fixed by the first observation of the series.
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct Families {
    help: BTreeMap<&'static str, (&'static str, &'static str)>,
    counters: BTreeMap<(&'static str, Labels), f64>,
    gauges: BTreeMap<(&'static str, Labels), f64>,
    histograms: BTreeMap<(&'static str, Labels), Histogram>,
}

fn registry() -> &'static Mutex<Families> {
    static REGISTRY: OnceLock<Mutex<Families>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

pub fn counter_add(name: &'static str, help: &'static str, labels: Labels, by: f64) {
    let mut r = registry().lock().unwrap();
    r.help.insert(name, ("counter", help));
    *r.counters.entry((name, labels)).or_default() += by;
}

pub fn gauge_set(name: &'static str, help: &'static str, labels: Labels, value: f64) {
    let mut r = registry().lock().unwrap();
    r.help.insert(name, ("gauge", help));
    r.gauges.insert((name, labels), value);
}

/// Records a latency in the default buckets (1 ms to 10 s, for request handling).
pub fn observe(name: &'static str, help: &'static str, labels: Labels, seconds: f64) {
    observe_in(name, help, labels, seconds, BUCKETS);
}

/// Records a value in the given buckets (ascending upper bounds; `+Inf` is implicit), for
/// durations that do not fit the default ones, e.g. a reconcile pass that waits on a cloud API
/// for a minute. Every observation of one metric name should pass the same buckets.
pub fn observe_in(
    name: &'static str,
    help: &'static str,
    labels: Labels,
    value: f64,
    buckets: &'static [f64],
) {
    let mut r = registry().lock().unwrap();
    r.help.insert(name, ("histogram", help));
    let h = r.histograms.entry((name, labels)).or_default();
    if h.counts.is_empty() {
        h.bounds = buckets;
        h.counts = vec![0; buckets.len()];
    }
    for (i, bound) in h.bounds.iter().enumerate() {
        if value <= *bound {
            h.counts[i] += 1;
        }
    }
    h.sum += value;
    h.count += 1;
}

fn label_text(labels: &Labels, extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The registry in Prometheus text format.
pub fn render() -> String {
    let r = registry().lock().unwrap();
    let mut out = String::new();
    for (name, (kind, help)) in &r.help {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for ((n, labels), v) in r.counters.iter().chain(r.gauges.iter()) {
            if n == name {
                let _ = writeln!(out, "{name}{} {v}", label_text(labels, None));
            }
        }
        for ((n, labels), h) in &r.histograms {
            if n != name {
                continue;
            }
            for (bound, count) in h.bounds.iter().zip(&h.counts) {
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {count}",
                    label_text(labels, Some(("le", bound.to_string())))
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{} {}",
                label_text(labels, Some(("le", "+Inf".into()))),
                h.count
            );
            let _ = writeln!(out, "{name}_sum{} {}", label_text(labels, None), h.sum);
            let _ = writeln!(out, "{name}_count{} {}", label_text(labels, None), h.count);
        }
    }
    out
}

/// Records `http_request_duration_seconds` by route template, method and status. A path no
/// route matched is `unmatched` and a method outside the standard ones is `other`: anyone can
/// send any path and method, and each distinct value would be a series kept forever.
pub async fn layer(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let method = method_label(req.method()).to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    observe(
        "http_request_duration_seconds",
        "HTTP request latency by route, method and status",
        vec![
            ("route", route),
            ("method", method),
            ("status", response.status().as_u16().to_string()),
        ],
        started.elapsed().as_secs_f64(),
    );
    response
}

fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Serves `GET /metrics` on `listener` until the task is dropped. The listener is the
/// operators' (`METRICS_LISTEN`, loopback unless deployed otherwise), not the API's.
pub async fn serve(listener: tokio::net::TcpListener) {
    let app = axum::Router::new().route("/metrics", axum::routing::get(handler));
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(%error, "metrics server stopped");
    }
}

/// `GET /metrics`.
pub async fn handler() -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        render(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_histograms_counters_and_gauges() {
        observe(
            "test_latency_seconds",
            "test",
            vec![("route", "/x".into())],
            0.003,
        );
        observe(
            "test_latency_seconds",
            "test",
            vec![("route", "/x".into())],
            2.0,
        );
        counter_add("test_total", "test", vec![("outcome", "ok".into())], 2.0);
        gauge_set("test_depth", "test", vec![], 7.0);
        let text = render();
        assert!(text.contains("# TYPE test_latency_seconds histogram"));
        assert!(text.contains("test_latency_seconds_bucket{route=\"/x\",le=\"0.005\"} 1"));
        assert!(text.contains("test_latency_seconds_bucket{route=\"/x\",le=\"+Inf\"} 2"));
        assert!(text.contains("test_latency_seconds_count{route=\"/x\"} 2"));
        assert!(text.contains("test_total{outcome=\"ok\"} 2"));
        assert!(text.contains("test_depth 7"));
    }

    #[test]
    fn methods_outside_the_standard_ones_share_one_label() {
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        assert_eq!(method_label(&Method::TRACE), "other");
        assert_eq!(
            method_label(&Method::from_bytes(b"XJ3KQ").unwrap()),
            "other"
        );
    }

    #[test]
    fn histograms_take_their_own_buckets() {
        const LONG: &[f64] = &[1.0, 60.0];
        observe_in("test_long_seconds", "test", vec![], 30.0, LONG);
        observe_in("test_long_seconds", "test", vec![], 90.0, LONG);
        let text = render();
        assert!(text.contains("test_long_seconds_bucket{le=\"1\"} 0"));
        assert!(text.contains("test_long_seconds_bucket{le=\"60\"} 1"));
        assert!(text.contains("test_long_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("test_long_seconds_sum 120"));
        // The default buckets are not rendered for it.
        assert!(!text.contains("test_long_seconds_bucket{le=\"0.001\"}"));
    }
}
