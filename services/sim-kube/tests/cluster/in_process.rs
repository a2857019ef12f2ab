//! A cluster started in process: no socket, the same API through `Cluster::call`, driven by a
//! real kube-rs client whose transport is that call.

use std::convert::Infallible;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::Client;
use serde_json::json;
use sim_kube::{Cluster, ClusterConfig};

/// A kube-rs client whose every request is served by `cluster.call`, in this process.
fn in_process_client(cluster: &Cluster) -> Client {
    let cluster = cluster.clone();
    let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let cluster = cluster.clone();
        async move {
            let (parts, body) = req.into_parts();
            let req = http::Request::from_parts(parts, axum::body::Body::new(body));
            Ok::<_, Infallible>(cluster.call(req).await)
        }
    });
    Client::new(svc, "default")
}

#[tokio::test]
async fn an_in_process_cluster_serves_its_api_without_a_socket() {
    let cluster = Cluster::start_in_process("inproc", ClusterConfig::default()).unwrap();
    assert_eq!(cluster.addr(), None, "no listener");
    let client = in_process_client(&cluster);

    let nss: Api<Namespace> = Api::all(client.clone());
    let names: Vec<String> = nss
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(names.contains(&"default".to_string()), "{names:?}");

    // A watch streams through the call as it would over HTTP.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let rv = cms
        .list(&Default::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut events = cms
        .watch(&WatchParams::default().timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"k": "v"}})).unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), events.try_next())
        .await
        .expect("an event within 5 s")
        .unwrap();
    assert!(
        matches!(&first, Some(WatchEvent::Added(c)) if c.metadata.name.as_deref() == Some("c")),
        "{first:?}"
    );

    // Server-side apply, with its field manager, as over HTTP.
    let applied = cms
        .patch(
            "c",
            &PatchParams::apply("tester").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "c"}, "data": {"k": "w"}})),
        )
        .await
        .unwrap();
    assert_eq!(applied.data.unwrap()["k"], "w");
    assert!(applied
        .metadata
        .managed_fields
        .unwrap()
        .iter()
        .any(|m| m.manager.as_deref() == Some("tester")));
    assert_eq!(
        cluster.write_count(),
        2,
        "API writes are counted as over HTTP"
    );
    cluster.shutdown().await;
}

#[tokio::test]
#[should_panic(expected = "has no URL")]
async fn an_in_process_cluster_has_no_url() {
    let cluster = Cluster::start_in_process("inproc", ClusterConfig::default()).unwrap();
    let _ = cluster.url();
}

/// The controllers run after changes and when one of their timers is due, not on a clock: a
/// cluster where nothing happens costs no pass (the region simulator runs thousands), while
/// timed work (a pod's model load) still completes on its own. On tokio's paused clock: the
/// seconds of quiet pass at once (`sleep`, not `advance`: a paused clock's sleep moves time one
/// timer at a time, so every wake-up that falls due in the quiet actually runs).
#[tokio::test(start_paused = true)]
async fn a_settled_cluster_makes_no_controller_passes() {
    let config = ClusterConfig {
        model_load_delay: Duration::from_millis(300),
        ..ClusterConfig::default()
    };
    let cluster = Cluster::start_in_process("quiet", config).unwrap();
    let client = in_process_client(&cluster);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = cluster.controller_passes();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(cluster.controller_passes(), idle, "no change, no pass");

    // A Deployment on a node: scheduled on the change, Ready when the load timer fires.
    cluster.upsert_node(crate::common::cpu_node("n1", "cpu"));
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), "default");
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                  "template": {"metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}}))
            .unwrap(),
        )
        .await
        .unwrap();
    crate::common::eventually(
        Duration::from_secs(5),
        "the deployment available",
        || async {
            let d = deployments.get("web").await.ok()?;
            (d.status?.available_replicas? == 1).then_some(())
        },
    )
    .await;
    assert!(cluster.controller_passes() > idle);

    // Settled again: passes stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let settled = cluster.controller_passes();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(cluster.controller_passes(), settled, "settled, no pass");
    cluster.shutdown().await;
}
