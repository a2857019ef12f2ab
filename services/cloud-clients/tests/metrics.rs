//! Every request the clients send is counted in the process-wide Prometheus registry by verb and
//! outcome. This file is its own test binary (its own process, its own registry) with a single
//! test, so the counts are exact.

mod common;

use cloud_clients::metrics::{DO_REQUESTS, KUBE_REQUESTS};
use cloud_clients::{Deleted, DoClient, RetryConfig};
use region_sim::{ApiFaults, Delays, FaultConfig};
use serde_json::json;

use crate::common::*;
use ::common::errors::Classify;

/// The value of the series `name{labels}` in the rendered registry (labels in any order), or 0
/// when the series does not exist.
fn value(name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = ::common::metrics::render();
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric, label_text) = series.split_once('{').unwrap_or((series, ""));
        if metric != name {
            continue;
        }
        let pairs: Vec<String> = label_text
            .trim_end_matches('}')
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect();
        let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        if pairs.len() == wanted.len() && wanted.iter().all(|w| pairs.contains(w)) {
            assert!(found.is_none(), "two series {name}{labels:?}:\n{text}");
            found = Some(v.parse::<f64>().expect("a number"));
        }
    }
    found.unwrap_or(0.0)
}

fn do_calls(method: &str, outcome: &str) -> f64 {
    value(DO_REQUESTS, &[("method", method), ("outcome", outcome)])
}

fn kube_calls(verb: &str, outcome: &str) -> f64 {
    value(KUBE_REQUESTS, &[("verb", verb), ("outcome", outcome)])
}

#[tokio::test]
async fn every_request_is_counted_by_verb_and_outcome() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let ghost = "6f1b5e0a-0000-4000-8000-000000000001";

    // DigitalOcean: successes, a 404, a 401, and 500s retried to success.
    api.vpc_list().await.unwrap();
    assert!(api.vpc_get(ghost).await.unwrap_err().is_not_found());
    let c = api.cluster_create(&cpu_cluster("metrics")).await.unwrap();
    let wrong = DoClient::new(&sim.base_url(), "dop_v1_wrong_secret").unwrap();
    assert_eq!(wrong.vpc_list().await.unwrap_err().status(), Some(401));
    sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let once = do_client(&sim, RetryConfig::none());
    assert!(once.cluster_get(&c.id).await.unwrap_err().is_transient());
    assert!(once.cluster_delete(&c.id).await.unwrap_err().is_transient());
    sim.set_faults(no_faults());
    let kube = kube_client(&api, &c.id, fast_retry()).await;

    assert_eq!(do_calls("GET", "ok"), 2.0, "vpc list and kubeconfig");
    assert_eq!(do_calls("GET", "not_found"), 1.0);
    assert_eq!(do_calls("GET", "permanent"), 1.0, "the 401");
    assert_eq!(do_calls("GET", "transient"), 1.0);
    assert_eq!(do_calls("POST", "ok"), 1.0);
    assert_eq!(do_calls("DELETE", "transient"), 1.0);
    assert_eq!(do_calls("DELETE", "ok"), 0.0);

    // Kubernetes: an apply is a GET then a PATCH, or only the GET when the object is already as
    // applied; a GET or DELETE of nothing is a 404.
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "metrics"}});
    assert!(kube.apply(&ns).await.unwrap().changed);
    assert!(!kube.apply(&ns).await.unwrap().changed);
    let namespaces = kube.list("v1", "Namespace", None, "").await.unwrap();
    assert!(namespaces
        .iter()
        .any(|n| n["metadata"]["name"] == "metrics"));
    assert!(kube
        .get("v1", "ConfigMap", Some("metrics"), "nothing")
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        kube.delete("v1", "ConfigMap", Some("metrics"), "nothing")
            .await
            .unwrap(),
        Deleted::AlreadyGone
    );
    assert_ne!(
        kube.delete("v1", "Namespace", None, "metrics")
            .await
            .unwrap(),
        Deleted::AlreadyGone
    );
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let err = kube
        .clone()
        .with_retry(RetryConfig::none())
        .list("v1", "Pod", Some("metrics"), "")
        .await
        .unwrap_err();
    assert!(err.class().is_transient(), "{err:?}");
    sim.set_faults(no_faults());
    // Requests that never leave the process are not API calls.
    kube.get("v1", "NoSuchKind", None, "x").await.unwrap_err();

    assert_eq!(
        kube_calls("get", "not_found"),
        2.0,
        "first apply and the get"
    );
    assert_eq!(kube_calls("get", "ok"), 1.0, "second apply");
    assert_eq!(
        kube_calls("apply", "ok"),
        1.0,
        "the second apply had nothing to write"
    );
    assert_eq!(kube_calls("list", "ok"), 1.0);
    assert_eq!(kube_calls("list", "transient"), 1.0);
    assert_eq!(kube_calls("delete", "not_found"), 1.0);
    assert_eq!(kube_calls("delete", "ok"), 1.0);
    let text = ::common::metrics::render();
    assert!(
        !text.contains("NoSuchKind") && !text.contains(&c.id) && !text.contains("wrong_secret"),
        "no names, ids or tokens in labels:\n{text}"
    );
    sim.shutdown().await;
}
