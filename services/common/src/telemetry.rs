//! Telemetry set-up shared by every binary, and W3C trace-context propagation.
//!
//! - Logs: readable text, or JSON lines with `LOG_FORMAT=json`, filtered by `RUST_LOG` (default
//!   `info`). Each JSON line lists the spans it happened in; the root span of a request or of a
//!   reconcile pass carries `trace_id`, so every line can be joined to its trace.
//! - Traces: every span is an OpenTelemetry span. They are exported over OTLP/HTTP (protobuf)
//!   only when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set; off
//!   by default. Trace ids exist either way, for logs and for propagation.
//! - Propagation: `traceparent` travels central → region over HTTP ([`inject`], [`continue_from`])
//!   and region → worker through the work queue ([`traceparent`], [`continue_from_traceparent`]).

use std::sync::OnceLock;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Flushes and stops the trace exporter when dropped: keep it alive for the life of `main`.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends every finished span now (tests call this before looking at what was exported).
    pub fn flush(&self) {
        if let Some(provider) = &self.provider {
            let _ = provider.force_flush();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// Logs and traces for `service`, configured from the environment (see the module docs).
pub fn init(service: &'static str) -> Telemetry {
    init_with(service, otlp_traces_url_from_env())
}

/// As [`init`], exporting spans to `otlp_traces_url` (a full `…/v1/traces` URL) when given.
/// Only the first call in a process installs anything.
pub fn init_with(service: &'static str, otlp_traces_url: Option<String>) -> Telemetry {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|f| f == "json");
    let mut provider = SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name(service).build());
    let exporting = otlp_traces_url.is_some();
    if let Some(url) = &otlp_traces_url {
        use opentelemetry_otlp::WithExportConfig;
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .build()
        {
            Ok(exporter) => provider = provider.with_batch_exporter(exporter),
            Err(error) => eprintln!("OTLP trace export disabled: {error}"),
        }
    }
    let provider = provider.build();
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer(service));
    let logs = tracing_subscriber::fmt::layer().with_target(false);
    let logs = if json {
        logs.json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .boxed()
    } else {
        logs.boxed()
    };
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(otel)
        .with(logs)
        .try_init()
        .is_ok();
    if !installed {
        return Telemetry { provider: None };
    }
    propagator();
    tracing::info!(service, exporting, "telemetry initialised");
    Telemetry {
        provider: Some(provider),
    }
}

fn otlp_traces_url_from_env() -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| {
        var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .map(|base| format!("{}/v1/traces", base.trim_end_matches('/')))
    })
}

fn propagator() -> &'static TraceContextPropagator {
    static PROPAGATOR: OnceLock<TraceContextPropagator> = OnceLock::new();
    PROPAGATOR.get_or_init(TraceContextPropagator::new)
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Adds the current span's `traceparent` (and `tracestate`) to outgoing request headers.
pub fn inject(headers: &mut http::HeaderMap) {
    let cx = tracing::Span::current().context();
    propagator().inject_context(&cx, &mut HeadersMut(headers));
}

/// Makes `span` a child of the trace the incoming `headers` name, if any, and records its
/// `trace_id` field (declare it `tracing::field::Empty`). Call before anything enters `span`.
pub fn continue_from(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = propagator().extract(&Headers(headers));
    set_parent(span, parent);
}

/// The current span as a W3C `traceparent` value, to carry the trace through the work queue.
pub fn traceparent() -> Option<String> {
    let mut headers = http::HeaderMap::new();
    inject(&mut headers);
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// As [`continue_from`], from a stored `traceparent` value.
pub fn continue_from_traceparent(span: &tracing::Span, traceparent: Option<&str>) {
    let mut headers = http::HeaderMap::new();
    if let Some(value) = traceparent.and_then(|v| http::HeaderValue::from_str(v).ok()) {
        headers.insert("traceparent", value);
    }
    continue_from(span, &headers);
}

fn set_parent(span: &tracing::Span, parent: opentelemetry::Context) {
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
    let trace_id = span.context().span().span_context().trace_id();
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, which is what Kubernetes sends to stop a pod.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
