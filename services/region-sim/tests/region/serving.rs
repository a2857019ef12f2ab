//! The serving model in a simulated cluster: the endpoint picker's configuration comes from the
//! ConfigMap its Deployment mounts (the serving model on a data-plane endpoint alone:
//! `dataplane-sim`'s tests).

use std::collections::BTreeSet;

use region_sim::{ModelTiming, ServingConfig};
use reqwest::Method;
use serde_json::json;

use crate::doks::{eventually, running_cluster, Kube};
use crate::scale_from_zero::{MODEL, TOKEN};

/// Prefix-cache scoring alone.
const PREFIX_ONLY: &str = "kind: EndpointPickerConfig
plugins: [{type: prefix-cache-scorer}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: prefix-cache-scorer, weight: 1}]}]
";

/// No scorer at all: round robin.
const ROUND_ROBIN: &str = "kind: EndpointPickerConfig
plugins: [{type: random-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: random-picker}]}]
";

/// `n` distinct words: a document of `n` tokens.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The whole chain in a simulated cluster: the picker's configuration comes from the ConfigMap
/// its Deployment mounts; changing it changes the routing; each pod's metrics are at
/// `/_sim/clusters/{id}/pods/{ns}/{name}/metrics`.
#[tokio::test]
async fn the_configmap_the_picker_mounts_decides_the_routing() {
    let sim = crate::doks::start().await;
    sim.set_model_timing(ModelTiming {
        serving: ServingConfig {
            time_scale: 0.02,
            ..Default::default()
        },
        ..Default::default()
    });
    let id = running_cluster(
        &sim,
        json!([
            {"name": "cpu", "size": "s-2vcpu-4gb", "count": 1},
            {"name": "gpu", "size": "gpu-h100x1-80gb", "count": 2}
        ]),
    )
    .await;
    let kube = Kube::for_cluster(&sim, &id).await;
    let (ns, core) = ("di-1", "/api/v1/namespaces/di-1");
    let (https, url) = crate::scale_from_zero::pool_di(&sim, &kube, 2, PREFIX_ONLY, None).await;
    let messages = [json!({"role": "user", "content": words("shared", 300)})];
    let send = async |n: usize| {
        let mut pods = Vec::new();
        for _ in 0..n {
            let r = https
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(TOKEN)
                .json(&json!({"model": MODEL, "messages": messages, "max_tokens": 5}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            pods.push(r.headers()["x-sim-backend"].to_str().unwrap().to_string());
        }
        pods
    };
    // Prefix-cache scoring: the same prompt keeps going where its blocks are.
    let pods = send(4).await;
    assert!(pods.iter().all(|p| *p == pods[0]), "{pods:?}");
    let hot = pods[0].clone();

    // The pod's metrics show the requests, the queries and the hits.
    let metrics = |pod: String| {
        let base = sim.base_url().to_string();
        let id = id.clone();
        async move {
            let r = reqwest::get(format!("{base}/_sim/clusters/{id}/pods/{ns}/{pod}/metrics"))
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain"));
            let text = r.text().await.unwrap();
            let value = |name: &str| -> f64 {
                text.lines()
                    .find(|l| l.starts_with(&format!("{name}{{")))
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{name} in\n{text}"))
            };
            (
                value("vllm:prefix_cache_queries_total"),
                value("vllm:prefix_cache_hits_total"),
                value("vllm:time_to_first_token_seconds_count"),
                value("vllm:num_requests_running"),
            )
        }
    };
    let (queries, hits, ttfts, running) = metrics(hot.clone()).await;
    assert_eq!(ttfts, 4.0);
    assert_eq!(running, 0.0);
    assert!(queries >= 4.0 * 300.0, "{queries}");
    assert!(hits >= 3.0 * 288.0, "{hits}");
    let (_, _, cold_ttfts, _) = metrics(
        sim.inventory().endpoints[0]
            .ready_endpoints
            .iter()
            .find(|p| **p != hot)
            .unwrap()
            .clone(),
    )
    .await;
    assert_eq!(cold_ttfts, 0.0);
    let r = reqwest::get(format!(
        "{}/_sim/clusters/{id}/pods/{ns}/nope/metrics",
        sim.base_url()
    ))
    .await
    .unwrap();
    assert_eq!(r.status(), 404);

    // A round-robin configuration in the ConfigMap: the same prompt now alternates.
    let (s, v) = kube
        .call(
            Method::PUT,
            &format!("{core}/configmaps/pool-epp"),
            Some(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pool-epp"},
                        "data": {"config.yaml": ROUND_ROBIN}}),
            ),
        )
        .await;
    assert!(s.is_success(), "{s} {v}");
    eventually("round robin", async || {
        let pods = send(2).await;
        (pods[0] != pods[1]).then_some(())
    })
    .await;
    let pods = send(4).await;
    assert_eq!(pods.iter().collect::<BTreeSet<_>>().len(), 2, "{pods:?}");
    sim.shutdown().await;
}
