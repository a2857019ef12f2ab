//! One create through the public API yields one trace: central's request span, the regional
//! service's spans (reached over HTTP with `traceparent`) and every reconcile pass the worker made
//! for it (reached through the work queue) share a trace id.
//!
//! The test process exports its spans over OTLP/HTTP (protobuf), the production code path, to a
//! small collector of its own. It is its own test binary because the tracer is per process.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use reqwest::Method;
use system_tests::{create_body, CloudOptions, Options, System};
use test_support::eventually;
use uuid::Uuid;

/// What the collector keeps of a span.
#[derive(Debug, Clone)]
struct Span {
    trace_id: String,
    name: String,
    attributes: Vec<(String, String)>,
}

impl Span {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// An OTLP/HTTP trace receiver on loopback.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
}

impl Collector {
    async fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let sink = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut sink = sink.lock().unwrap();
                    for span in request
                        .resource_spans
                        .into_iter()
                        .flat_map(|r| r.scope_spans)
                        .flat_map(|s| s.spans)
                    {
                        sink.push(Span {
                            trace_id: hex(&span.trace_id),
                            name: span.name,
                            attributes: span
                                .attributes
                                .into_iter()
                                .map(|kv| {
                                    let value = match kv.value.and_then(|v| v.value) {
                                        Some(AnyValue::StringValue(s)) => s,
                                        Some(AnyValue::IntValue(i)) => i.to_string(),
                                        Some(AnyValue::BoolValue(b)) => b.to_string(),
                                        other => format!("{other:?}"),
                                    };
                                    (kv.key, value)
                                })
                                .collect(),
                        });
                    }
                    // An empty ExportTraceServiceResponse.
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Collector { url, spans }
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_create_yields_one_trace_across_central_region_and_worker() {
    let collector = Collector::start().await;
    let telemetry = common::telemetry::init_with("system-tests", Some(collector.url.clone()));
    let sys = System::start_with(Options {
        cloud: Some(CloudOptions::default()),
        ..Options::default()
    })
    .await;
    let token = sys
        .token(
            Uuid::new_v4(),
            &["dedicated_inference:create", "dedicated_inference:read"],
        )
        .await;
    let create = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(serde_json::json!({"spec": create_body("traced", "atl1")["spec"]})),
        )
        .await;
    assert_eq!(create.status, 202, "{}", create.body);
    let id = create.body["dedicated_inference"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    sys.wait_status(&token, &id, "active", Duration::from_secs(60))
        .await;

    // Every span of the create is finished once the DI is active; export them all.
    let spans = eventually(
        Duration::from_secs(20),
        "the worker's span of the pass that made it active, exported",
        || async {
            telemetry.flush();
            let spans = collector.spans();
            let done = spans.iter().any(|s| {
                s.name == "reconcile"
                    && s.attr("di_id") == Some(&id)
                    && s.attr("status") == Some("active")
            });
            done.then_some(spans)
        },
    )
    .await;

    let created = spans
        .iter()
        .filter(|s| {
            s.attr("service") == Some("central")
                && s.attr("method") == Some("POST")
                && s.attr("path") == Some("/v2/dedicated-inferences")
        })
        .collect::<Vec<_>>();
    assert_eq!(created.len(), 1, "one central span for the create");
    let trace = &created[0].trace_id;

    let in_trace = |s: &&Span| &s.trace_id == trace;
    let regional: Vec<_> = spans
        .iter()
        .filter(in_trace)
        .filter(|s| s.attr("service") == Some("regional"))
        .collect();
    assert!(
        regional.iter().any(|s| s.attr("method") == Some("POST")
            && s.attr("path") == Some("/internal/v1/dedicated-inferences")),
        "the regional create is in the create's trace: {regional:?}"
    );

    // Every reconcile pass that brought the DI up (from `new` to `active`) is in that trace.
    let passes: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "reconcile" && s.attr("di_id") == Some(&id))
        .collect();
    let bring_up: Vec<&&Span> = passes
        .iter()
        .filter(|s| matches!(s.attr("phase"), Some("new" | "provisioning")))
        .collect();
    assert!(
        !bring_up.is_empty(),
        "the worker reported its passes: {passes:?}"
    );
    let traces: BTreeSet<&str> = bring_up.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(
        traces,
        BTreeSet::from([trace.as_str()]),
        "all bring-up passes join the create's trace"
    );
    assert!(
        bring_up.iter().all(|s| s.attr("service") == Some("worker")),
        "reconcile spans say which service made them"
    );
    drop(sys);
}
