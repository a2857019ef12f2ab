//! `KubeClient` built from the kubeconfig the simulated DigitalOcean API hands out, driving the
//! simulated cluster's Kubernetes API server: apply twice, get, list, delete, errors, retries.

mod common;

use std::time::Duration;

use ::common::errors::{Classify, ErrorClass};
use cloud_clients::kubernetes::known_resource;
use cloud_clients::{Deleted, DoClient, KubeClient, KubeError, RetryConfig};
use common::*;
use region_sim::{ApiFaults, Delays, FaultConfig, RegionSim};
use serde_json::{json, Value};

const NS: &str = "di-abc";

fn small_delays() -> Delays {
    Delays {
        cluster_provision_ms: 50,
        node_provision_ms: 50,
        deletion_ms: 100,
        lb_provision_ms: 50,
        model_load_ms: 50,
        gateway_address_ms: 20,
    }
}

async fn cluster(sim: &RegionSim, name: &str) -> (DoClient, String, KubeClient) {
    let api = do_client(sim, fast_retry());
    let c = api.cluster_create(&cpu_cluster(name)).await.unwrap();
    let kube = kube_client(&api, &c.id, fast_retry()).await;
    (api, c.id, kube)
}

fn namespace() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NS, "labels": {"app.kubernetes.io/managed-by": "di-worker", "di.do/id": "abc"}}
    })
}

fn config_map(name: &str, labelled: bool, value: &str) -> Value {
    let labels = if labelled {
        json!({"di.do/id": "abc", "di.do/part": "config"})
    } else {
        json!({"other": "x"})
    };
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "data": {"key": value}
    })
}

fn deployment() -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": NS, "labels": {"di.do/id": "abc"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "vllm"}},
            "template": {
                "metadata": {"labels": {"app": "vllm"}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "args": ["--model", "m1"],
                    "ports": [{"containerPort": 8000}]
                }]}
            }
        }
    })
}

fn gateway() -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "gw", "namespace": NS},
        "spec": {
            "gatewayClassName": "di",
            "listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
                "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "tls"}]}}]
        }
    })
}

fn names(items: &[Value]) -> Vec<String> {
    let mut v: Vec<String> = items
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn apply_twice_get_list_delete() {
    let sim = start_sim(small_delays()).await;
    let (_api, _id, kube) = cluster(&sim, "k1").await;
    let objects = [
        namespace(),
        config_map("settings", true, "v1"),
        config_map("unrelated", false, "v1"),
        deployment(),
        gateway(),
    ];

    // First pass creates everything.
    for o in &objects {
        let a = kube.apply(o).await.unwrap();
        assert!(a.changed, "first apply of {}", o["kind"]);
        assert_eq!(a.object["metadata"]["name"], o["metadata"]["name"]);
        assert!(a.object["metadata"]["uid"].is_string());
    }
    assert_eq!(kube.changes(), objects.len() as u64);

    // Let the simulated controllers write statuses (Deployment replicas, Gateway address), so
    // the second pass sees objects that moved under it.
    eventually("gateway programmed", || async {
        let gw = kube
            .get("gateway.networking.k8s.io/v1", "Gateway", Some(NS), "gw")
            .await
            .unwrap()
            .unwrap();
        gw["status"]["addresses"][0]["value"]
            .is_string()
            .then_some(())
    })
    .await;

    // Second pass over the same manifests changes nothing and sends no write at all.
    let (changes, sent) = (kube.changes(), kube.mutating_requests());
    for o in &objects {
        let a = kube.apply(o).await.unwrap();
        assert!(!a.changed, "second apply of {} changed it", o["kind"]);
    }
    assert_eq!(kube.changes(), changes);
    assert_eq!(kube.mutating_requests(), sent);

    // A real change is reported and lands.
    let a = kube
        .apply(&config_map("settings", true, "v2"))
        .await
        .unwrap();
    assert!(a.changed);
    let got = kube
        .get("v1", "ConfigMap", Some(NS), "settings")
        .await
        .unwrap()
        .expect("exists");
    assert_eq!(got["data"]["key"], "v2");
    assert_eq!(got["kind"], "ConfigMap");
    assert_eq!(got["apiVersion"], "v1");
    assert!(got["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["manager"] == FIELD_MANAGER && m["operation"] == "Apply"));
    assert!(kube
        .get("v1", "ConfigMap", Some(NS), "nope")
        .await
        .unwrap()
        .is_none());
    let ns = kube
        .get("v1", "Namespace", None, NS)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ns["metadata"]["labels"]["di.do/id"], "abc");

    // Lists by label, in one namespace and across all of them.
    let labelled = kube
        .list("v1", "ConfigMap", Some(NS), "di.do/id=abc")
        .await
        .unwrap();
    assert_eq!(names(&labelled), ["settings"]);
    assert!(labelled.iter().all(|o| o["kind"] == "ConfigMap"));
    let everywhere = kube
        .list("v1", "ConfigMap", None, "di.do/id")
        .await
        .unwrap();
    assert_eq!(names(&everywhere), ["settings"]);
    let all_here = kube.list("v1", "ConfigMap", Some(NS), "").await.unwrap();
    assert!(names(&all_here).contains(&"unrelated".to_string()));
    let deployments = kube
        .list("apps/v1", "Deployment", Some(NS), "di.do/id=abc")
        .await
        .unwrap();
    assert_eq!(names(&deployments), ["vllm"]);
    let namespaces = kube
        .list(
            "v1",
            "Namespace",
            None,
            "app.kubernetes.io/managed-by=di-worker",
        )
        .await
        .unwrap();
    assert_eq!(names(&namespaces), [NS]);

    // Delete: once for real, then it is already gone.
    assert_eq!(
        kube.delete("v1", "ConfigMap", Some(NS), "settings")
            .await
            .unwrap(),
        Deleted::Deleted
    );
    assert_eq!(
        kube.delete("v1", "ConfigMap", Some(NS), "settings")
            .await
            .unwrap(),
        Deleted::AlreadyGone
    );
    assert!(kube
        .get("v1", "ConfigMap", Some(NS), "settings")
        .await
        .unwrap()
        .is_none());

    // A Namespace terminates (its content goes with it), then is gone.
    let first = kube.delete("v1", "Namespace", None, NS).await.unwrap();
    assert_ne!(first, Deleted::AlreadyGone);
    eventually("namespace gone", || async {
        match kube.delete("v1", "Namespace", None, NS).await.unwrap() {
            Deleted::AlreadyGone => Some(()),
            Deleted::Deleting | Deleted::Deleted => None,
        }
    })
    .await;
    assert!(kube
        .get("v1", "Namespace", None, NS)
        .await
        .unwrap()
        .is_none());
    // Children of a deleted namespace are gone too, and deleting them is not an error.
    assert_eq!(
        kube.delete("apps/v1", "Deployment", Some(NS), "vllm")
            .await
            .unwrap(),
        Deleted::AlreadyGone
    );
    assert_eq!(
        kube.delete("gateway.networking.k8s.io/v1", "Gateway", Some(NS), "gw")
            .await
            .unwrap(),
        Deleted::AlreadyGone
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn local_and_validation_errors_are_permanent() {
    let sim = start_sim(Delays::instant()).await;
    let (_api, _id, kube) = cluster(&sim, "k2").await;

    let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x", "namespace": NS}});
    let err = kube.apply(&sts).await.unwrap_err();
    assert!(matches!(err, KubeError::UnknownKind { .. }), "{err:?}");
    let mut no_ns = config_map("c", true, "v");
    no_ns["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("namespace");
    let err = kube.apply(&no_ns).await.unwrap_err();
    assert!(matches!(err, KubeError::InvalidObject(_)), "{err:?}");
    let err = kube.apply(&json!({"kind": "ConfigMap"})).await.unwrap_err();
    assert!(matches!(err, KubeError::InvalidObject(_)), "{err:?}");
    assert_eq!(kube.mutating_requests(), 0, "nothing was sent");

    // Into a namespace that does not exist: 404 from the server, not retried.
    let err = kube.apply(&config_map("c", true, "v")).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::NotFound, "{err:?}");

    // Invalid object: the Deployment's selector does not match its template. Sent once.
    kube.apply(&namespace()).await.unwrap();
    let mut bad = deployment();
    bad["spec"]["selector"]["matchLabels"]["app"] = json!("other");
    let before = kube.mutating_requests();
    let err = kube.apply(&bad).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Refused, "{err:?}");
    assert_eq!(err.code(), Some(422), "{err:?}");
    assert_eq!(kube.mutating_requests(), before + 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn kube_faults_are_retried() {
    let sim = start_sim(Delays::instant()).await;
    let (api, id, kube) = cluster(&sim, "k3").await;
    kube.apply(&namespace()).await.unwrap();

    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    // Without retries the fault shows, and is transient.
    let once = kube_client(&api, &id, RetryConfig::none()).await;
    let err = once.apply(&config_map("c", true, "v")).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::TRANSIENT, "{err:?}");
    assert_eq!(err.code(), Some(500));

    let kube_calls = || -> u64 {
        sim.stats()
            .requests
            .get("kube")
            .map_or(0, |k| k.values().sum())
    };
    let before = kube_calls();
    let task = {
        let kube = kube.clone();
        tokio::spawn(async move { kube.apply(&config_map("c", true, "v")).await })
    };
    // Its first attempt and a retry meet the fault; then it clears.
    let retried = async || kube_calls() >= before + 2;
    test_support::until(Duration::from_secs(10), "a retry under the fault", retried).await;
    sim.set_faults(FaultConfig::default());
    let applied = task.await.unwrap().expect("retried to success");
    assert!(applied.changed);

    // 429s are transient too.
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            rate_limit_rate: 1.0,
            retry_after_secs: 1,
            ..Default::default()
        },
        ..Default::default()
    });
    let err = once
        .get("v1", "ConfigMap", Some(NS), "c")
        .await
        .unwrap_err();
    assert!(
        err.class().is_transient() && err.code() == Some(429),
        "{err:?}"
    );
    sim.set_faults(FaultConfig::default());

    // Random faults: every call still succeeds, and a second pass still changes nothing.
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            error_rate: 0.3,
            ..Default::default()
        },
        ..Default::default()
    });
    let changes = kube.changes();
    for _ in 0..3 {
        assert!(
            !kube
                .apply(&config_map("c", true, "v"))
                .await
                .unwrap()
                .changed
        );
        assert!(!kube.apply(&namespace()).await.unwrap().changed);
    }
    assert_eq!(kube.changes(), changes);
    sim.shutdown().await;
}

#[tokio::test]
async fn load_balancer_service_appears_in_the_do_api() {
    let sim = start_sim(small_delays()).await;
    let (api, id, kube) = cluster(&sim, "k4").await;
    kube.apply(&namespace()).await.unwrap();
    let svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gw-private", "namespace": NS, "annotations": {
            "service.beta.kubernetes.io/do-loadbalancer-name": "di-abc-private",
            "service.beta.kubernetes.io/do-loadbalancer-network": "INTERNAL",
            "service.beta.kubernetes.io/do-loadbalancer-type": "REGIONAL_NETWORK"
        }},
        "spec": {"type": "LoadBalancer", "selector": {"gateway.networking.k8s.io/gateway-name": "gw"},
                 "ports": [{"name": "https", "port": 443, "targetPort": 443}]}
    });
    assert!(kube.apply(&svc).await.unwrap().changed);
    let lb = eventually("load balancer active", || async {
        let lbs = api.load_balancer_list().await.unwrap();
        lbs.into_iter()
            .find(|l| l.name == "di-abc-private" && l.status == "active")
    })
    .await;
    assert_eq!(lb.tag, format!("k8s:{id}"));
    assert_eq!(lb.network, "INTERNAL");
    assert_eq!(lb.lb_type, "REGIONAL_NETWORK");
    assert_eq!(lb.forwarding_rules[0].entry_port, 443);
    assert!(!lb.ip.is_empty());
    assert_eq!(api.load_balancer_get(&lb.id).await.unwrap(), lb);
    // The simulator wrote the Service's status; our second apply still changes nothing.
    eventually("service ingress", || async {
        let s = kube
            .get("v1", "Service", Some(NS), "gw-private")
            .await
            .unwrap()
            .unwrap();
        s["status"]["loadBalancer"]["ingress"][0]["ip"]
            .is_string()
            .then_some(())
    })
    .await;
    assert!(!kube.apply(&svc).await.unwrap().changed);

    // Deleting the Service removes the load balancer.
    assert_eq!(
        kube.delete("v1", "Service", Some(NS), "gw-private")
            .await
            .unwrap(),
        Deleted::Deleted
    );
    eventually("load balancer gone", || async {
        match api.load_balancer_get(&lb.id).await {
            Err(e) if e.is_not_found() => Some(()),
            _ => None,
        }
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test]
async fn kubeconfig_problems_are_config_errors() {
    let err = KubeClient::from_kubeconfig_yaml("not: [a kubeconfig", "di-worker")
        .await
        .unwrap_err();
    assert!(matches!(err, KubeError::Config(_)), "{err:?}");
    let no_context = "apiVersion: v1\nkind: Config\nclusters: []\nusers:\n- name: u\n  user:\n    token: super-secret-token\n";
    let err = KubeClient::from_kubeconfig_yaml(no_context, "di-worker")
        .await
        .unwrap_err();
    assert!(matches!(err, KubeError::Config(_)), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("super-secret-token"));
    assert!(
        known_resource("inference.networking.k8s.io/v1", "InferencePool")
            .unwrap()
            .namespaced
    );
}

#[tokio::test]
async fn unreachable_api_server_is_transient() {
    let yaml = "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: http://127.0.0.1:1\n  name: c\ncontexts:\n- context:\n    cluster: c\n    user: u\n  name: c\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n";
    let kube = KubeClient::from_kubeconfig_yaml(yaml, "di-worker")
        .await
        .unwrap()
        .with_retry(RetryConfig {
            max_attempts: 2,
            ..fast_retry()
        });
    let err = kube.get("v1", "Namespace", None, "x").await.unwrap_err();
    assert!(matches!(err, KubeError::Transport(_)), "{err:?}");
    assert_eq!(err.class(), ErrorClass::TRANSIENT);
}

/// A cluster's API server offers HTTP/2 (as kube-apiserver does): a client's watches and its
/// requests, many at once, share one connection, so a worker's descriptors follow the clusters
/// it uses rather than its requests (with HTTP/1.1, each open watch held a connection of its
/// own). A watch sees what a request wrote through that same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_watches_share_one_connection() {
    use futures::StreamExt;
    let sim = start_sim(small_delays()).await;
    let before = sim.open_connections();
    // A client fresh from its credentials, whose first requests all go out at once: its
    // cluster's watches and a pass's lists, as when a worker first meets a cluster.
    let (_, _, kube) = cluster(&sim, "h2").await;
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let watches: Vec<_> = ["ConfigMap", "Secret", "Service", "ServiceAccount"]
        .into_iter()
        .map(|kind| {
            let mut watch = Box::pin(kube.watch("v1", kind, "").unwrap());
            let seen = seen_tx.clone();
            tokio::spawn(async move {
                while let Some(event) = watch.next().await {
                    // Listed, if the watch had not listed yet when the write came; else watched.
                    if let Ok(
                        cloud_clients::WatchEvent::Apply(o)
                        | cloud_clients::WatchEvent::InitApply(o),
                    ) = event
                    {
                        let _ = seen.send(o);
                    }
                }
            })
        })
        .collect();
    let lists = (0..40).map(|_| kube.list("v1", "ConfigMap", Some(NS), ""));
    let (namespace, lists) = futures::future::join(
        kube.apply(&namespace()),
        futures::future::try_join_all(lists),
    )
    .await;
    namespace.unwrap();
    lists.unwrap();
    kube.apply(&config_map("seen", true, "v")).await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let o = seen.recv().await.expect("the watches ended");
            if o["kind"] == "ConfigMap" && o["metadata"]["name"] == "seen" {
                return o;
            }
        }
    })
    .await
    .expect("the watch sees the write");
    assert_eq!(seen["data"]["key"], "v");
    one_connection_settles(&sim, before).await;
    watches.iter().for_each(|w| w.abort());
    sim.shutdown().await;
}

/// A cluster's connection carries its watches between requests: it stays pooled however long
/// no request used it, so the next request shares it rather than opening a second connection
/// beside it (what hyper's pool does with a connection idle past its timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_carrying_watches_stays_pooled_while_no_request_uses_it() {
    use futures::StreamExt;
    let sim = start_sim(small_delays()).await;
    let api = do_client(&sim, fast_retry());
    let c = api.cluster_create(&cpu_cluster("idle")).await.unwrap();
    let yaml = api.kubeconfig(&c.id).await.unwrap();
    let before = sim.open_connections();
    let idle_timeout = Duration::from_millis(200);
    let kube = KubeClient::from_kubeconfig_yaml_with(
        &yaml,
        "di-worker",
        cloud_clients::KubeClientOptions {
            idle_timeout,
            retry: fast_retry(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut watch = Box::pin(kube.watch("v1", "ConfigMap", "").unwrap());
    let watching = tokio::spawn(async move { while watch.next().await.is_some() {} });
    kube.list("v1", "ConfigMap", Some(NS), "").await.unwrap();
    one_connection_settles(&sim, before).await;
    // Real time: hyper's pool evicts on its own timer (`TokioTimer`), which a paused clock
    // does not drive.
    tokio::time::sleep(idle_timeout * 5).await;
    kube.list("v1", "ConfigMap", Some(NS), "").await.unwrap();
    assert_eq!(
        sim.open_connections(),
        before + 1,
        "the watch's connection served the list"
    );
    watching.abort();
    sim.shutdown().await;
}

/// Waits until the simulator holds one connection more than `before`: the client's own (the
/// connection on which it asked the server's protocol closes as its first client is dropped).
async fn one_connection_settles(sim: &RegionSim, before: usize) {
    let mut now = 0;
    let settled = test_support::within(Duration::from_secs(5), async || {
        now = sim.open_connections();
        (now == before + 1).then_some(())
    })
    .await;
    assert!(
        settled.is_some(),
        "{now} connections open, {before} before the client"
    );
}
