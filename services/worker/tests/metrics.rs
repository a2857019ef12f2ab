//! The worker's `/metrics` and `/healthz` over HTTP, after a DI went through provisioning and
//! deletion against the region simulator. The registry is process-wide, so this is a test binary
//! of its own with a single test: every count it reads comes from this test's worker.
//!
//! Needs DATABASE_URL (a Postgres the tests may create databases in).

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::*;

/// The value of the series `name{labels}` (labels in any order, all of them given), if present.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, v) = line.rsplit_once(' ').expect("`series value`");
        let (metric, label_text) = series.split_once('{').unwrap_or((series, ""));
        let pairs: Vec<&str> = label_text
            .trim_end_matches('}')
            .split(',')
            .filter(|p| !p.is_empty())
            .collect();
        if metric == name
            && pairs.len() == wanted.len()
            && wanted.iter().all(|w| pairs.contains(&w.as_str()))
        {
            assert!(found.is_none(), "two series {name}{labels:?}");
            found = Some(v.parse::<f64>().expect("a number"));
        }
    }
    found
}

/// Like [`value`], for a series that must exist.
fn must(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(text, name, labels).unwrap_or_else(|| panic!("no series {name}{labels:?} in:\n{text}"))
}

async fn scrape(http: &reqwest::Client, addr: SocketAddr) -> String {
    let resp = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(resp.status(), reqwest::StatusCode::OK);
    let content_type = resp.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    resp.text().await.unwrap()
}

/// Scrapes until `ok` holds for the text (10 s at most).
async fn scrape_until(
    http: &reqwest::Client,
    addr: SocketAddr,
    what: &str,
    ok: impl Fn(&str) -> bool,
) -> String {
    let last = std::sync::Mutex::new(String::new());
    let found = test_support::within(Duration::from_secs(10), || async {
        let text = scrape(http, addr).await;
        *last.lock().unwrap() = text.clone();
        ok(&text).then_some(text)
    })
    .await;
    let last = last.into_inner().unwrap();
    found.unwrap_or_else(|| panic!("timed out waiting for {what}:\n{last}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_passes_queue_leases_and_cloud_calls() {
    let env = env_with(None).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let (rec, token) = env.create(1).await;

    // A worker that claimed the DI and died: its lease runs out while our worker watches.
    let dead = env
        .store
        .work_claim("dead-worker", Duration::from_secs(5), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert!(!dead[0].lease_expired, "a fresh DI had no lease to expire");

    let w = env.worker().await;
    let addr = w.metrics_addr();
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let health = http
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), reqwest::StatusCode::OK);
    assert_eq!(health.text().await.unwrap(), "ok");

    // While the dead worker's lease lives, the queue holds one leased DI and nothing ready.
    let text = scrape_until(&http, addr, "the first queue sample", |t| {
        value(t, "worker_queue_depth", &[("state", "leased")]).is_some()
    })
    .await;
    assert_eq!(
        must(&text, "worker_queue_depth", &[("state", "leased")]),
        1.0
    );
    assert_eq!(
        must(&text, "worker_queue_depth", &[("state", "ready")]),
        0.0
    );
    assert_eq!(must(&text, "worker_lease_expiries_total", &[]), 0.0);

    // Our worker takes over once the lease expires, provisions, and tears down.
    env.wait_active(rec.id, 1).await;
    let probe_token = env.store.probe_token(rec.id).await.unwrap();
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;

    // Once the DI is gone the queue is empty again.
    let text = scrape_until(&http, addr, "an empty queue", |t| {
        value(t, "worker_queue_depth", &[("state", "leased")]) == Some(0.0)
            && value(t, "worker_queue_depth", &[("state", "ready")]) == Some(0.0)
    })
    .await;

    assert_eq!(must(&text, "worker_lease_expiries_total", &[]), 1.0);
    assert_eq!(must(&text, "worker_leases_lost_total", &[]), 0.0);

    // Passes by phase and outcome: provisioning waits on the cloud, then converges once the
    // endpoint answers; deleting waits for the cluster to go, then converges when the DI is gone.
    let passes = |phase: &str, outcome: &str| {
        value(
            &text,
            "worker_reconcile_passes_total",
            &[("phase", phase), ("outcome", outcome)],
        )
        .unwrap_or(0.0)
    };
    assert!(passes("provisioning", "progress") >= 2.0, "{text}");
    assert_eq!(passes("provisioning", "converged"), 1.0, "{text}");
    assert!(passes("deleting", "progress") >= 1.0, "{text}");
    assert_eq!(passes("deleting", "converged"), 1.0, "{text}");
    assert_eq!(passes("provisioning", "error"), 0.0, "{text}");
    // Every pass that leaves its DI waiting says what for: the provisioning waited for the
    // cluster it created, the teardown for the cluster's deletion.
    let waits = |reason: &str| {
        value(&text, "worker_reconcile_waits_total", &[("reason", reason)]).unwrap_or(0.0)
    };
    let phases = [
        "provisioning",
        "updating",
        "deleting",
        "resync",
        "idle",
        "unknown",
    ];
    let waiting_passes: f64 = phases.iter().map(|p| passes(p, "progress")).sum();
    let reasons = [
        "cluster",
        "cluster_unreachable",
        "scale_up_refused",
        "applied",
        "rollout",
        "endpoint_address",
        "probe",
        "superseded",
        "namespace_terminating",
    ];
    assert_eq!(
        reasons.iter().map(|r| waits(r)).sum::<f64>(),
        waiting_passes,
        "{text}"
    );
    assert!(waits("cluster") >= 2.0, "{text}");
    for (phase, outcome) in [("provisioning", "progress"), ("deleting", "converged")] {
        let labels = [("phase", phase), ("outcome", outcome)];
        let count = must(&text, "worker_reconcile_duration_seconds_count", &labels);
        assert_eq!(count, passes(phase, outcome), "{phase}/{outcome}");
        let inf = [("phase", phase), ("outcome", outcome), ("le", "+Inf")];
        assert_eq!(
            must(&text, "worker_reconcile_duration_seconds_bucket", &inf),
            count
        );
        assert!(must(&text, "worker_reconcile_duration_seconds_sum", &labels) > 0.0);
    }

    // The clients' calls: a cluster and a node pool created, then deleted; reads throughout.
    let do_calls = |method: &str, outcome: &str| {
        value(
            &text,
            "digitalocean_api_requests_total",
            &[("method", method), ("outcome", outcome)],
        )
        .unwrap_or(0.0)
    };
    assert!(do_calls("POST", "ok") >= 2.0, "{text}");
    assert!(do_calls("GET", "ok") >= 1.0, "{text}");
    assert!(do_calls("DELETE", "ok") >= 2.0, "{text}");
    let kube_calls = |verb: &str, outcome: &str| {
        value(
            &text,
            "kubernetes_api_requests_total",
            &[("verb", verb), ("outcome", outcome)],
        )
        .unwrap_or(0.0)
    };
    // Every object is applied once at least. One that its kind's list did not show is applied
    // without reading it first; the namespace, which no list shows, is read first (404 the
    // first time).
    assert!(kube_calls("apply", "ok") >= 10.0, "{text}");
    assert!(kube_calls("get", "not_found") >= 1.0, "{text}");
    assert!(kube_calls("get", "not_found") < 10.0, "{text}");
    assert!(kube_calls("list", "ok") >= 1.0, "{text}");
    assert!(kube_calls("delete", "ok") >= 1.0, "the namespace: {text}");

    // Labels are bounded sets: no ids, names or secrets.
    for secret_or_id in [
        rec.id.to_string(),
        env.vpc.to_string(),
        token.clone(),
        SIM_TOKEN.to_string(),
        probe_token,
    ] {
        assert!(!text.contains(&secret_or_id), "{secret_or_id} in:\n{text}");
    }

    w.shutdown().await;
    // The server stops with the worker.
    assert!(http
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .is_err());
    env.sim.shutdown().await;
}
