//! What an autoscaler reads in a simulated cluster, and scale from zero: the pods' metrics
//! through the cluster API's `pods/proxy` (vLLM's on a model server, the endpoint picker's
//! pool gauges on its pod), and a gateway that holds requests while its flow-controlled pool has
//! no ready replica.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::doks::{b64, eventually, running_cluster, Kube};

/// The access token and the served model name of [`pool_di`]'s DI.
pub(crate) const TOKEN: &str = "di_0123456789abcdefghijklmnopqrstuvwxyzABCD";
pub(crate) const MODEL: &str = "llama-3.1-8b";

/// The llm-d default configuration with GIE's flow control switched on.
fn flow_controlled() -> String {
    format!(
        "{}featureGates:\n- flowControl\n",
        dataplane_sim::picker::LLM_D_DEFAULT_CONFIG
    )
}

/// The value of the first sample of `name` (with labels) in a Prometheus text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A client that trusts `ca` (PEM) alone.
fn client(ca: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .build()
        .unwrap()
}

/// A DI in namespace `di-1`: a vLLM Deployment with `replicas` replicas, its pool, the pool's endpoint
/// picker (its ConfigMap holding `epp_config`), a gateway whose route times requests out after
/// `timeout` (when set), and a load balancer with a certificate for its address. Returns the
/// client trusting that certificate and the endpoint's URL.
pub(crate) async fn pool_di(
    sim: &region_sim::RegionSim,
    kube: &Kube,
    replicas: usize,
    epp_config: &str,
    timeout: Option<&str>,
) -> (reqwest::Client, String) {
    let ns = "di-1";
    let core = format!("/api/v1/namespaces/{ns}");
    let apps = format!("/apis/apps/v1/namespaces/{ns}");
    kube.create(
        "/api/v1/namespaces",
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
    )
    .await;
    kube.create(&format!("{apps}/deployments"), json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "vllm"}},
          "template": {"metadata": {"labels": {"app": "vllm"}}, "spec": {
            "nodeSelector": {"doks.digitalocean.com/node-pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai",
              "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", MODEL],
              "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})).await;
    kube.create(
        &format!("{core}/configmaps"),
        json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pool-epp"},
        "data": {"config.yaml": epp_config}}),
    )
    .await;
    kube.create(&format!("{apps}/deployments"), json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "pool-epp"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"epp": "pool"}},
          "template": {"metadata": {"labels": {"epp": "pool"}}, "spec": {
            "containers": [{"name": "epp", "image": "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0",
              "args": ["--pool-name", "pool", "--config-file", "/config/config.yaml"],
              "ports": [{"name": "metrics", "containerPort": 9090}],
              "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": true}]}],
            "volumes": [{"name": "config", "configMap": {"name": "pool-epp"}}]}}}})).await;
    kube.create(
        &format!("{core}/services"),
        json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "pool-epp"},
        "spec": {"selector": {"epp": "pool"}, "ports": [{"name": "grpc-ext-proc", "port": 9002}]}}),
    )
    .await;
    kube.create(&format!("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"), json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"kind": "Service", "name": "pool-epp", "port": {"number": 9002}}}})).await;
    kube.create(&format!("/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/gateways"), json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": "gw"},
        "spec": {"gatewayClassName": "istio", "listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
          "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "endpoint-tls"}]}}]}})).await;
    let mut rule = json!({"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"}]});
    if let Some(t) = timeout {
        rule["timeouts"] = json!({"request": t});
    }
    kube.create(&format!("/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes"), json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "route"},
        "spec": {"parentRefs": [{"name": "gw"}], "rules": [rule]}})).await;
    kube.create(&format!("{core}/services"), json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "public"},
        "spec": {"type": "LoadBalancer", "selector": {"gateway.networking.k8s.io/gateway-name": "gw"},
                 "ports": [{"name": "https", "port": 443, "targetPort": 443, "protocol": "TCP"}]}})).await;
    kube.authenticate_gateway(ns, "gw", TOKEN).await;
    let url = eventually("a load balancer address", async || {
        Some(sim.inventory().endpoints.first()?.url.clone())
    })
    .await;
    let host = url
        .trim_start_matches("https://")
        .split(':')
        .next()
        .unwrap();
    let (ca, cert, key) = crate::doks::pki(host);
    kube.create(&format!("{core}/secrets"), json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "endpoint-tls"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64(&cert), "tls.key": b64(&key)}})).await;
    let url = eventually("an active load balancer with its certificate", async || {
        let inv = sim.inventory();
        let ep = inv.endpoints.first()?;
        let wired = replicas == 0 || ep.problems.is_empty();
        (ep.tls && ep.ready_endpoints.len() == replicas && wired).then(|| ep.url.clone())
    })
    .await;
    (client(&ca), url)
}

/// The single pod whose name starts with `prefix`, once it is Running and Ready.
async fn ready_pod(kube: &Kube, prefix: &str) -> String {
    eventually(&format!("a ready {prefix} pod"), async || {
        let (_, v) = kube.get("/api/v1/namespaces/di-1/pods").await;
        v["items"].as_array()?.iter().find_map(|p| {
            let name = p["metadata"]["name"].as_str()?;
            let ready = p["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            (name.starts_with(prefix) && ready).then(|| name.to_string())
        })
    })
    .await
}

async fn chat(https: &reqwest::Client, url: &str) -> reqwest::Response {
    https
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap()
}

async fn scale(kube: &Kube, replicas: u32) {
    let (s, v) = kube
        .call(
            Method::PUT,
            "/apis/apps/v1/namespaces/di-1/deployments/vllm/scale",
            Some(json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": "vllm", "namespace": "di-1"}, "spec": {"replicas": replicas}})),
        )
        .await;
    assert!(s.is_success(), "{s} {v}");
}

/// A request to a pool with no replica waits, counted by the endpoint picker's queue gauge
/// (read through the cluster API, as an autoscaler would), until the Deployment is scaled up
/// and its pod is ready; then it is served and the gauge is back to 0. The pod's vLLM metrics
/// come through the same API. Past the picker's queue TTL, a held request gets the picker's 503.
#[tokio::test]
async fn a_held_request_is_served_once_the_pool_scales_up_from_zero() {
    let sim = crate::doks::start().await;
    let id = running_cluster(
        &sim,
        json!([
            {"name": "cpu", "size": "s-2vcpu-4gb", "count": 1},
            {"name": "gpu", "size": "gpu-h100x1-80gb", "count": 1}
        ]),
    )
    .await;
    let kube = Kube::for_cluster(&sim, &id).await;
    let (https, url) = pool_di(&sim, &kube, 0, &flow_controlled(), Some("60s")).await;
    let epp = ready_pod(&kube, "pool-epp-").await;
    let epp_metrics = format!("/api/v1/namespaces/di-1/pods/{epp}:9090/proxy/metrics");
    let gauges = async || {
        let (s, text) = kube.get_text(&epp_metrics).await;
        assert_eq!(s, 200, "{text}");
        (
            sample(&text, "inference_extension_flow_control_queue_size").unwrap(),
            sample(&text, "inference_pool_ready_pods").unwrap(),
            text,
        )
    };
    let (queued, ready, text) = gauges().await;
    assert_eq!((queued, ready), (0.0, 0.0), "{text}");
    assert!(
        text.contains("inference_extension_flow_control_queue_size{inference_pool=\"pool\"} 0"),
        "{text}"
    );
    // The API's token guards the proxy like every other call.
    let r = kube
        .http
        .get(format!("{}{epp_metrics}", kube.server))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let (s, v) = kube
        .get("/api/v1/namespaces/di-1/pods/vllm-nope:8000/proxy/metrics")
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["reason"], "NotFound");

    // A request arrives while there is no replica: it is held and counted.
    let held = tokio::spawn({
        let (https, url) = (https.clone(), url.clone());
        async move { chat(&https, &url).await }
    });
    eventually("the request counted as held", async || {
        (gauges().await.0 == 1.0).then_some(())
    })
    .await;
    assert!(!held.is_finished());

    // Scaling up from zero serves it.
    scale(&kube, 1).await;
    let r = tokio::time::timeout(Duration::from_secs(20), held)
        .await
        .expect("served once a replica is ready")
        .unwrap();
    assert_eq!(r.status(), 200);
    let pod = r.headers()["x-sim-backend"].to_str().unwrap().to_string();
    assert!(pod.starts_with("vllm-"), "{pod}");
    let (queued, ready, text) = gauges().await;
    assert_eq!((queued, ready), (0.0, 1.0), "{text}");

    // The model server's vLLM metrics, through the same API (the serving model is off here:
    // a valid text with the pod's model and zero counters).
    let (s, text) = kube
        .get_text(&format!(
            "/api/v1/namespaces/di-1/pods/{pod}:8000/proxy/metrics"
        ))
        .await;
    assert_eq!(s, 200, "{text}");
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:request_success_total",
    ] {
        assert!(sample(&text, name).is_some(), "{name} in\n{text}");
    }
    assert!(text.contains(&format!("model_name=\"{MODEL}\"")), "{text}");
    // The simulator's own route answers the same.
    let direct = reqwest::get(format!(
        "{}/_sim/clusters/{id}/pods/di-1/{pod}/metrics",
        sim.base_url()
    ))
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    assert_eq!(direct, text);

    // Back to zero with a short queue TTL for the picker: a held request ends with the picker's
    // 503 and its reason.
    scale(&kube, 0).await;
    let config = "/api/v1/namespaces/di-1/configmaps/pool-epp";
    let (_, mut c) = kube.get(config).await;
    c["data"]["config.yaml"] = json!(format!(
        "{}flowControl:\n  defaultRequestTTL: 1s\n",
        flow_controlled()
    ));
    let (s, v) = kube.call(Method::PUT, config, Some(c)).await;
    assert!(s.is_success(), "{s} {v}");
    eventually("no ready replica behind the endpoint", async || {
        sim.inventory().endpoints[0]
            .ready_endpoints
            .is_empty()
            .then_some(())
    })
    .await;
    // Real time, as a window: the cloud controller reads the picker's new configuration on its
    // next look, and nothing outside it says when that was.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let r = chat(&https, &url).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(
        r.headers()["x-llm-d-request-dropped-reason"],
        "rejected-no-endpoints"
    );
    assert!(
        r.headers().get("retry-after").is_none(),
        "the picker says nothing of when"
    );
    assert_eq!(gauges().await.0, 0.0);

    // Envoy Gateway's BackendTrafficPolicy on the Gateway: once its controller accepted it, the
    // picker's 503 goes out with Retry-After and the policy's own body.
    let policies = "/apis/gateway.envoyproxy.io/v1alpha1/namespaces/di-1/backendtrafficpolicies";
    kube.create(policies, json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "BackendTrafficPolicy",
        "metadata": {"name": "traffic"},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}],
            "responseOverride": [{
                "match": {"statusCodes": [{"type": "Value", "value": 503}],
                          "responseHeaders": [{"name": "x-llm-d-request-dropped-reason",
                                               "value": {"type": "Exact", "value": "rejected-no-endpoints"}}]},
                "response": {"contentType": "application/json",
                             "body": {"type": "Inline", "inline": "{\"error\":{\"code\":503}}"},
                             "header": {"add": [{"name": "Retry-After", "value": "30"}]}},
            }],
        }})).await;
    eventually("the traffic policy accepted", async || {
        let (_, p) = kube.get(&format!("{policies}/traffic")).await;
        (p.pointer("/status/ancestors/0/conditions/0/status")? == "True").then_some(())
    })
    .await;
    // The endpoint takes the policy on the cloud controller's next look.
    let r = eventually("the 503 with Retry-After", async || {
        let r = chat(&https, &url).await;
        assert_eq!(r.status(), 503);
        r.headers().contains_key("retry-after").then_some(r)
    })
    .await;
    assert_eq!(r.headers()["retry-after"], "30");
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], 503);
    // An answer it does not match is left alone: a wrong token's 401.
    let r = https
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("di_wrong")
        .json(&json!({"model": MODEL, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().get("retry-after").is_none());
    sim.shutdown().await;
}

/// Without the feature gate the gateway answers at once, as before.
#[tokio::test]
async fn without_flow_control_a_pool_without_replicas_is_503_at_once() {
    let sim = crate::doks::start().await;
    let id = running_cluster(
        &sim,
        json!([{"name": "cpu", "size": "s-2vcpu-4gb", "count": 1}]),
    )
    .await;
    let kube = Kube::for_cluster(&sim, &id).await;
    let (https, url) = pool_di(
        &sim,
        &kube,
        0,
        dataplane_sim::picker::LLM_D_DEFAULT_CONFIG,
        None,
    )
    .await;
    let started = Instant::now();
    let r = chat(&https, &url).await;
    assert_eq!(r.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(r.headers().get("retry-after").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["message"], "no healthy upstream");
    let epp = ready_pod(&kube, "pool-epp-").await;
    let (s, text) = kube
        .get_text(&format!("/api/v1/namespaces/di-1/pods/{epp}/proxy/metrics"))
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        sample(&text, "inference_extension_flow_control_queue_size"),
        Some(0.0)
    );

    // The API server reaches pods through the Konnectivity agents of kube-system: a namespace
    // whose policies do not admit them has no metrics to read; one that does, has.
    let proxied = format!("/api/v1/namespaces/di-1/pods/{epp}:9090/proxy/metrics");
    let policies = "/apis/networking.k8s.io/v1/namespaces/di-1/networkpolicies";
    kube.create(
        policies,
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "deny"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}),
    )
    .await;
    assert_eq!(kube.get_text(&proxied).await.0, 503);
    kube.create(policies, json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "konnectivity"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                               "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}],
                     "ports": [{"protocol": "TCP", "port": 9090}]}]}})).await;
    assert_eq!(kube.get_text(&proxied).await.0, 200);
    sim.shutdown().await;
}
