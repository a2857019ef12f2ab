//! Trace context survives both hops it makes between services: HTTP headers and a stored
//! `traceparent` string.

use common::telemetry;

fn trace_id_of(span: &tracing::Span) -> String {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    span.context().span().span_context().trace_id().to_string()
}

#[test]
fn trace_context_crosses_http_headers_and_the_work_queue() {
    let _telemetry = telemetry::init_with("telemetry-test", None);

    let request = tracing::info_span!("request", trace_id = tracing::field::Empty);
    telemetry::continue_from(&request, &http::HeaderMap::new());
    let root = trace_id_of(&request);
    assert_ne!(root, opentelemetry::trace::TraceId::INVALID.to_string());

    // Central -> region: headers injected inside the span continue the trace on the other side.
    let mut headers = http::HeaderMap::new();
    request.in_scope(|| telemetry::inject(&mut headers));
    let traceparent = headers["traceparent"].to_str().unwrap().to_string();
    assert!(
        traceparent.starts_with(&format!("00-{root}-")),
        "{traceparent}"
    );
    let regional = tracing::info_span!("request", trace_id = tracing::field::Empty);
    telemetry::continue_from(&regional, &headers);
    assert_eq!(trace_id_of(&regional), root);

    // Region -> worker: the stored value continues it too.
    let stored = regional
        .in_scope(telemetry::traceparent)
        .expect("a traceparent");
    let pass = tracing::info_span!("reconcile", trace_id = tracing::field::Empty);
    telemetry::continue_from_traceparent(&pass, Some(&stored));
    assert_eq!(trace_id_of(&pass), root);

    // Without (or with a garbled) context, a span starts a trace of its own.
    let resync = tracing::info_span!("reconcile", trace_id = tracing::field::Empty);
    telemetry::continue_from_traceparent(&resync, Some("not a traceparent"));
    assert_ne!(trace_id_of(&resync), root);
}
