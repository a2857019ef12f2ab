//! The `pods/proxy` subresource: what a pod "answers" on its port comes from the cluster's
//! `PodProxy` hook, reached the way kube-rs reaches any subresource, with the cluster's token.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use sim_kube::{Cluster, ClusterConfig, PodProxy, ProxyRequest, ProxyResponse};

/// Answers `/metrics` with what it was asked, and nothing else.
#[derive(Default)]
struct Echo {
    asked: Mutex<Vec<ProxyRequest>>,
}

impl PodProxy for Echo {
    fn proxy(&self, r: &ProxyRequest) -> Option<ProxyResponse> {
        assert!(
            r.objects.iter().any(|o| o["kind"] == "Node"),
            "the hook sees the cluster's objects"
        );
        self.asked.lock().unwrap().push(r.clone());
        (r.path == "/metrics").then(|| ProxyResponse {
            status: 200,
            content_type: "text/plain; version=0.0.4".into(),
            body: format!(
                "up{{pod=\"{}\",port=\"{}\",app=\"{}\",arg=\"{}\",query=\"{}\"}} 1\n",
                r.pod_name,
                r.port.as_deref().unwrap_or(""),
                r.pod["metadata"]["labels"]["app"].as_str().unwrap_or(""),
                r.pod["spec"]["containers"][0]["args"][0]
                    .as_str()
                    .unwrap_or(""),
                r.query.as_deref().unwrap_or(""),
            )
            .into_bytes(),
        })
    }
}

fn pod(name: &str, node: Option<&str>) -> Pod {
    let mut spec = json!({"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
        "args": ["--model", "m"]}]});
    if let Some(n) = node {
        spec["nodeSelector"] = json!({"kubernetes.io/hostname": n});
    }
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"app": "vllm"}}, "spec": spec}),
    )
    .unwrap()
}

/// A client from the cluster's kubeconfig that does not retry 503s: kube-rs retries them (up to
/// 15 times, backing off to minutes) by default, which a caller expecting an unreachable pod
/// turns off.
async fn client_without_retries(cluster: &Cluster) -> kube::Client {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kubeconfig = Kubeconfig::from_yaml(&cluster.kubeconfig_yaml()).unwrap();
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
    config.default_retry = false;
    kube::Client::try_from(config).unwrap()
}

#[tokio::test]
async fn a_ready_pods_port_answers_through_the_api_with_the_token() {
    let echo = Arc::new(Echo::default());
    let (cluster, _) = crate::common::start_with(ClusterConfig {
        bearer_token: Some("secret-token".into()),
        model_load_delay: Duration::from_millis(50),
        pod_proxy: Some(echo.clone()),
        ..Default::default()
    })
    .await;
    let client = client_without_retries(&cluster).await;
    cluster.upsert_node(crate::common::cpu_node("n1", "cpu"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("vllm-a", None))
        .await
        .unwrap();
    crate::common::eventually(Duration::from_secs(5), "the pod ready", || async {
        let p = pods.get("vllm-a").await.ok()?;
        p.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(())
    })
    .await;

    // kube-rs's plain text request, on the `{name}:{port}` form.
    let req = http::Request::get("/api/v1/namespaces/default/pods/vllm-a:8000/proxy/metrics?x=1")
        .body(vec![])
        .unwrap();
    let text = client.request_text(req).await.unwrap();
    assert_eq!(
        text,
        "up{pod=\"vllm-a\",port=\"8000\",app=\"vllm\",arg=\"--model\",query=\"x=1\"} 1\n"
    );
    // Without a port: the hook hears none.
    let req = http::Request::get("/api/v1/namespaces/default/pods/vllm-a/proxy/metrics")
        .body(vec![])
        .unwrap();
    assert!(client
        .request_text(req)
        .await
        .unwrap()
        .contains("port=\"\""));

    // Nothing answers another path: 503 in the Status shape the real server uses.
    let req = http::Request::get("/api/v1/namespaces/default/pods/vllm-a:8000/proxy/healthz")
        .body(vec![])
        .unwrap();
    match client.request_text(req).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 503, "{s:?}");
            assert!(
                s.message.starts_with("error trying to reach service"),
                "{s:?}"
            );
        }
        other => panic!("expected 503, got {other:?}"),
    }
    // An unknown pod: 404 NotFound.
    let req = http::Request::get("/api/v1/namespaces/default/pods/nope:8000/proxy/metrics")
        .body(vec![])
        .unwrap();
    match client.request_text(req).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 404, "{s:?}");
            assert_eq!(s.reason, "NotFound");
        }
        other => panic!("expected 404, got {other:?}"),
    }
    // A pod that is not running (it cannot be scheduled): 503, and the hook is not asked.
    pods.create(&PostParams::default(), &pod("vllm-b", Some("elsewhere")))
        .await
        .unwrap();
    let asked = echo.asked.lock().unwrap().len();
    let req = http::Request::get("/api/v1/namespaces/default/pods/vllm-b:8000/proxy/metrics")
        .body(vec![])
        .unwrap();
    match client.request_text(req).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 503, "{s:?}"),
        other => panic!("expected 503, got {other:?}"),
    }
    assert_eq!(echo.asked.lock().unwrap().len(), asked);

    // Without the token: 401, as for every other call.
    let r = reqwest_free_get(
        &cluster,
        "/api/v1/namespaces/default/pods/vllm-a:8000/proxy/metrics",
    )
    .await;
    assert_eq!(r, 401);
    cluster.shutdown().await;
}

/// The status of an unauthenticated GET, served in process (the same router as the listener).
async fn reqwest_free_get(cluster: &Cluster, path: &str) -> u16 {
    let req = http::Request::get(path)
        .body(axum::body::Body::empty())
        .unwrap();
    cluster.call(req).await.status().as_u16()
}

#[tokio::test]
async fn without_a_hook_a_ready_pod_is_unreachable() {
    let (cluster, _) = crate::common::start_with(ClusterConfig {
        model_load_delay: Duration::from_millis(50),
        ..Default::default()
    })
    .await;
    let client = client_without_retries(&cluster).await;
    cluster.upsert_node(crate::common::cpu_node("n1", "cpu"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("p", None))
        .await
        .unwrap();
    let status = crate::common::eventually(Duration::from_secs(5), "the pod ready", || async {
        let p = pods.get("p").await.ok()?;
        p.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(())?;
        let req = http::Request::get("/api/v1/namespaces/default/pods/p/proxy/metrics")
            .body(vec![])
            .unwrap();
        match client.request_text(req).await {
            Err(kube::Error::Api(s)) => Some(s),
            other => panic!("expected an error, got {other:?}"),
        }
    })
    .await;
    assert_eq!(status.code, 503);
    assert_eq!(status.reason, "ServiceUnavailable");
    cluster.shutdown().await;
}
