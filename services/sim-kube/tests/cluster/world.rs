//! The simulated world: scheduling onto GPU nodes, readiness after model load,
//! rollouts, node loss, garbage collection and load balancer addresses.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{cpu_node, eventually, gpu_node, start_with};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use sim_kube::{ClusterConfig, LoadRequest, ModelLoader};
use test_support::until;

const WAIT: Duration = Duration::from_secs(10);

fn config(model_load: u64) -> ClusterConfig {
    ClusterConfig {
        model_load_delay: Duration::from_millis(model_load),
        lb_address_delay: Duration::from_millis(50),
        gateway_address_delay: Duration::from_millis(50),
        bearer_token: None,
        model_loader: None,
        pod_proxy: None,
    }
}

/// A vLLM-like Deployment pinned to a node pool with a GPU request.
fn vllm(name: &str, pool: &str, gpus: u32, tolerate: bool, replicas: i32) -> serde_json::Value {
    let mut spec = json!({
        "nodeSelector": {"doks.digitalocean.com/node-pool": pool},
        "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
            "ports": [{"containerPort": 8000, "name": "http"}],
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}, "requests": {"cpu": "2", "memory": "16Gi"}}
        }]
    });
    if tolerate {
        spec["tolerations"] =
            json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]);
    }
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "selector": {"matchLabels": {"llm-d.ai/model": name}},
            "template": {"metadata": {"labels": {"llm-d.ai/model": name}}, "spec": spec}
        }
    })
}

async fn apply(client: &Client, d: &serde_json::Value) {
    let api: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let name = d["metadata"]["name"].as_str().unwrap();
    api.patch(
        name,
        &PatchParams::apply("di-worker").force(),
        &Patch::Apply(d),
    )
    .await
    .unwrap();
}

async fn pods_of(client: &Client, model: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.list(&ListParams::default().labels(&format!("llm-d.ai/model={model}")))
        .await
        .unwrap()
        .items
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn gpu_pods_schedule_only_where_they_fit_and_turn_ready() {
    let (cluster, client) = start_with(config(300)).await;
    cluster.upsert_node(cpu_node("cpu-1", "default-pool"));
    cluster.upsert_node(gpu_node("gpu-1", "gpu-pool", "nvidia", 1));

    apply(&client, &vllm("fits", "gpu-pool", 1, true, 1)).await;
    // No toleration for the taint: stays Pending.
    apply(&client, &vllm("untolerated", "gpu-pool", 1, false, 1)).await;

    let pod = eventually(WAIT, "fitting pod bound", || {
        let client = client.clone();
        async move {
            let ps = pods_of(&client, "fits").await;
            ps.into_iter()
                .find(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()).is_some())
        }
    })
    .await;
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some("gpu-1")
    );
    assert!(pod.name_any().starts_with("fits-"));
    let owner = &pod.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("Deployment", "fits")
    );
    let status = pod.status.clone().unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    assert!(status.pod_ip.unwrap().starts_with("10."));
    assert!(!ready(&pod), "not ready before the model has loaded");

    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    eventually(WAIT, "readyReplicas == replicas", || {
        let deploys = deploys.clone();
        async move {
            let d = deploys.get("fits").await.ok()?;
            let s = d.status?;
            (s.ready_replicas == Some(1)
                && s.available_replicas == Some(1)
                && s.observed_generation == d.metadata.generation)
                .then_some(())
        }
    })
    .await;
    let d = deploys.get("fits").await.unwrap();
    let conds = d.status.unwrap().conditions.unwrap();
    assert!(conds
        .iter()
        .any(|c| c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True")));
    assert!(conds
        .iter()
        .any(|c| c.type_.as_deref() == Some("Progressing")
            && c.reason.as_deref() == Some("NewReplicaSetAvailable")));

    let pending = eventually(WAIT, "unschedulable condition", || {
        let client = client.clone();
        async move {
            let ps = pods_of(&client, "untolerated").await;
            let p = ps.into_iter().next()?;
            let c = p
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodScheduled")?
                .clone();
            Some((p, c))
        }
    })
    .await;
    assert_eq!(pending.1.status, "False");
    assert_eq!(pending.1.reason.as_deref(), Some("Unschedulable"));
    assert!(
        pending
            .1
            .message
            .as_deref()
            .unwrap()
            .contains("untolerated taint"),
        "{:?}",
        pending.1.message
    );
    assert_eq!(pending.0.status.unwrap().phase.as_deref(), Some("Pending"));
    assert!(pending.0.spec.unwrap().node_name.is_none());

    // A second replica of the fitting deployment does not fit: the only GPU is taken.
    apply(&client, &vllm("fits", "gpu-pool", 1, true, 2)).await;
    eventually(WAIT, "second replica pending for GPUs", || {
        let client = client.clone();
        async move {
            let ps = pods_of(&client, "fits").await;
            let unbound: Vec<_> = ps
                .iter()
                .filter(|p| p.spec.as_ref().unwrap().node_name.is_none())
                .collect();
            let msg = unbound
                .first()?
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodScheduled")?
                .message
                .clone()?;
            (ps.len() == 2 && msg.contains("Insufficient nvidia.com/gpu")).then_some(())
        }
    })
    .await;
    // A new GPU node in the pool makes room.
    cluster.upsert_node(gpu_node("gpu-2", "gpu-pool", "nvidia", 1));
    eventually(WAIT, "two ready replicas", || {
        let deploys = deploys.clone();
        async move { (deploys.get("fits").await.ok()?.status?.ready_replicas == Some(2)).then_some(()) }
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test]
async fn rollout_replaces_pods_and_node_loss_reschedules() {
    let (cluster, client) = start_with(config(50)).await;
    cluster.upsert_node(gpu_node("gpu-a", "pool", "nvidia", 1));
    cluster.upsert_node(gpu_node("gpu-b", "pool", "nvidia", 1));
    apply(&client, &vllm("m", "pool", 1, true, 2)).await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let all_ready = |image: &'static str| {
        let deploys = deploys.clone();
        let client = client.clone();
        move || {
            let deploys = deploys.clone();
            let client = client.clone();
            async move {
                let d = deploys.get("m").await.ok()?;
                let s = d.status?;
                let pods = pods_of(&client, "m").await;
                let on_image = pods.iter().all(|p| {
                    p.spec.as_ref().unwrap().containers[0].image.as_deref() == Some(image)
                });
                (s.ready_replicas == Some(2)
                    && s.updated_replicas == Some(2)
                    && s.replicas == Some(2)
                    && on_image
                    && pods.len() == 2)
                    .then_some(pods)
            }
        }
    };
    let before = eventually(
        WAIT,
        "initial rollout",
        all_ready("vllm/vllm-openai:v0.11.0"),
    )
    .await;

    let mut v2 = vllm("m", "pool", 1, true, 2);
    v2["spec"]["template"]["spec"]["containers"][0]["image"] = json!("vllm/vllm-openai:v0.12.0");
    apply(&client, &v2).await;
    let after = eventually(WAIT, "rolled out", all_ready("vllm/vllm-openai:v0.12.0")).await;
    let old_names: Vec<String> = before.iter().map(|p| p.name_any()).collect();
    assert!(after.iter().all(|p| !old_names.contains(&p.name_any())));
    assert_ne!(
        before[0].labels()["pod-template-hash"],
        after[0].labels()["pod-template-hash"]
    );

    // Losing a node deletes its pod; the controller recreates it, which stays
    // Pending until capacity returns.
    let victim = after
        .iter()
        .find(|p| p.spec.as_ref().unwrap().node_name.as_deref() == Some("gpu-a"))
        .unwrap()
        .name_any();
    cluster.delete_node("gpu-a");
    eventually(WAIT, "replacement pending", || {
        let client = client.clone();
        let victim = victim.clone();
        async move {
            let pods = pods_of(&client, "m").await;
            (pods.len() == 2
                && pods.iter().all(|p| p.name_any() != victim)
                && pods
                    .iter()
                    .any(|p| p.spec.as_ref().unwrap().node_name.is_none()))
            .then_some(())
        }
    })
    .await;
    cluster.upsert_node(gpu_node("gpu-c", "pool", "nvidia", 1));
    eventually(WAIT, "recovered", all_ready("vllm/vllm-openai:v0.12.0")).await;

    // Deleting the Deployment garbage-collects its pods.
    deploys.delete("m", &DeleteParams::default()).await.unwrap();
    eventually(WAIT, "pods collected", || {
        let client = client.clone();
        async move { pods_of(&client, "m").await.is_empty().then_some(()) }
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test]
async fn foreground_deletion_waits_for_dependents() {
    let (cluster, client) = start_with(config(10)).await;
    cluster.upsert_node(cpu_node("cpu-1", "pool"));
    let d = json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "epp"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "epp"}},
                 "template": {"metadata": {"labels": {"app": "epp"}},
                              "spec": {"containers": [{"name": "epp", "image": "epp:1"}]}}}
    });
    apply(&client, &d).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    eventually(WAIT, "two pods", || {
        let pods = pods.clone();
        async move {
            (pods
                .list(&ListParams::default().labels("app=epp"))
                .await
                .ok()?
                .items
                .len()
                == 2)
                .then_some(())
        }
    })
    .await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    deploys
        .delete("epp", &DeleteParams::foreground())
        .await
        .unwrap();
    eventually(WAIT, "deployment and pods gone", || {
        let pods = pods.clone();
        let deploys = deploys.clone();
        async move {
            let none_left = pods
                .list(&ListParams::default().labels("app=epp"))
                .await
                .ok()?
                .items
                .is_empty();
            (none_left && deploys.get_opt("epp").await.ok()?.is_none()).then_some(())
        }
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test]
async fn load_balancers_get_private_or_public_addresses_once() {
    let (cluster, client) = start_with(config(10)).await;
    let svcs: Api<Service> = Api::namespaced(client.clone(), "default");
    let lb = |name: &str, network: &str| {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "annotations": {
                "service.beta.kubernetes.io/do-loadbalancer-type": "REGIONAL_NETWORK",
                "service.beta.kubernetes.io/do-loadbalancer-network": network}},
            "spec": {"type": "LoadBalancer", "selector": {"app": "gw"}, "ports": [{"name": "https", "port": 443}]}
        })
    };
    let pp = PatchParams::apply("di-worker").force();
    svcs.patch("private", &pp, &Patch::Apply(lb("private", "INTERNAL")))
        .await
        .unwrap();
    svcs.patch("public", &pp, &Patch::Apply(lb("public", "EXTERNAL")))
        .await
        .unwrap();
    let ip = |name: &'static str| {
        let svcs = svcs.clone();
        move || {
            let svcs = svcs.clone();
            async move {
                let s = svcs.get(name).await.ok()?;
                s.status?.load_balancer?.ingress?.first()?.ip.clone()
            }
        }
    };
    let private = eventually(WAIT, "private address", ip("private")).await;
    let public = eventually(WAIT, "public address", ip("public")).await;
    assert!(private.starts_with("10."), "{private}");
    assert!(!public.starts_with("10."), "{public}");

    // Another component overwrites the address through /status: it sticks.
    svcs.patch_status(
        "public",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}}})),
    )
    .await
    .unwrap();
    // The controllers' chance to overwrite the address (which they must not take): a pass
    // that began after the write. A pass runs without yielding on this test's one thread, so
    // once the count shows it, it has finished.
    let passes = cluster.controller_passes();
    until(WAIT, "a controller pass after the write", async || {
        cluster.controller_passes() > passes
    })
    .await;
    assert_eq!(
        eventually(WAIT, "overwritten address", ip("public")).await,
        "127.0.0.1"
    );
    // The same through the library handle.
    assert!(cluster.merge_status(
        "v1",
        "Service",
        Some("default"),
        "private",
        json!({"loadBalancer": {"ingress": [{"ip": "127.0.0.2"}]}})
    ));
    assert_eq!(
        eventually(WAIT, "library overwrite", ip("private")).await,
        "127.0.0.2"
    );
    assert!(!cluster.merge_status("v1", "Service", Some("default"), "missing", json!({})));
    // The main resource ignores status; /status ignores everything else.
    let mut s = svcs.get("public").await.unwrap();
    s.status.as_mut().unwrap().load_balancer = None;
    let replaced = svcs
        .replace("public", &Default::default(), &s)
        .await
        .unwrap();
    assert_eq!(
        replaced
            .status
            .unwrap()
            .load_balancer
            .unwrap()
            .ingress
            .unwrap()[0]
            .ip
            .as_deref(),
        Some("127.0.0.1")
    );
    let st = svcs
        .patch_status(
            "public",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"type": "ClusterIP"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.spec.unwrap().type_.as_deref(), Some("LoadBalancer"));
    cluster.shutdown().await;
}

/// A loader that fails the first `failures` attempts of every container with `message`, does
/// not know the answer the first time it is asked about an attempt, and records every request.
struct Flaky {
    failures: u32,
    message: String,
    asked: Mutex<Vec<(LoadRequest, Instant)>>,
}

impl ModelLoader for Flaky {
    fn load(&self, request: &LoadRequest) -> Option<Result<(), String>> {
        let mut asked = self.asked.lock().unwrap();
        let first_ask = !asked
            .iter()
            .any(|(r, _)| r.pod_uid == request.pod_uid && r.restart_count == request.restart_count);
        asked.push((request.clone(), Instant::now()));
        if first_ask {
            return None;
        }
        Some(if request.restart_count < self.failures {
            Err(self.message.clone())
        } else {
            Ok(())
        })
    }
}

fn container_status(p: &Pod) -> k8s_openapi::api::core::v1::ContainerStatus {
    p.status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
        .clone()
}

#[tokio::test]
async fn a_failed_load_crash_loops_with_back_off_until_a_load_succeeds() {
    let loader = Arc::new(Flaky {
        failures: 2,
        message: "RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: http://hub/org/m/resolve/main/config.json.".into(),
        asked: Mutex::new(Vec::new()),
    });
    let mut cfg = config(100);
    cfg.model_loader = Some(loader.clone());
    let (cluster, client) = start_with(cfg).await;
    cluster.upsert_node(gpu_node("gpu-1", "pool", "nvidia", 1));
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");
    secrets
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "hf-token"},
                "stringData": {"HF_TOKEN": "hf_secret"}}))
            .unwrap(),
        )
        .await
        .unwrap();
    let mut d = vllm("m", "pool", 1, true, 1);
    let c = &mut d["spec"]["template"]["spec"]["containers"][0];
    c["args"] = json!(["--model", "org/m", "--served-model-name", "m"]);
    c["env"] = json!([
        {"name": "HF_ENDPOINT", "value": "http://hub"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}},
        {"name": "MISSING", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x"}}},
    ]);
    apply(&client, &d).await;

    // The first attempt fails: the container waits to restart, its last termination says why.
    let crashed = eventually(WAIT, "crash-looping", || {
        let client = client.clone();
        async move {
            let p = pods_of(&client, "m").await.into_iter().next()?;
            // A pod has no container statuses until its node reports them, as on a real
            // cluster: the kubelet writes them once it runs the pod.
            let cs = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
            let waiting = cs.state.as_ref()?.waiting.as_ref()?;
            (waiting.reason.as_deref() == Some("CrashLoopBackOff")).then_some(p)
        }
    })
    .await;
    let cs = container_status(&crashed);
    assert_eq!(cs.restart_count, 1);
    assert!(!cs.ready);
    let waiting = cs.state.unwrap().waiting.unwrap();
    let message = waiting.message.unwrap();
    assert!(
        message.starts_with("back-off 1s restarting failed container=vllm pod=m-"),
        "{message}"
    );
    let terminated = cs.last_state.unwrap().terminated.unwrap();
    assert_eq!(terminated.exit_code, 1);
    assert_eq!(terminated.reason.as_deref(), Some("Error"));
    assert_eq!(terminated.message.as_deref(), Some(loader.message.as_str()));
    assert!(terminated.started_at.is_some() && terminated.finished_at.is_some());
    let ready_cond = crashed
        .status
        .as_ref()
        .unwrap()
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap()
        .clone();
    assert_eq!(ready_cond.status, "False");
    assert_eq!(ready_cond.reason.as_deref(), Some("ContainersNotReady"));
    assert!(!ready(&crashed));

    // The second attempt fails too; the third loads: Ready, the restarts still counted.
    let loaded = eventually(WAIT, "ready after restarts", || {
        let client = client.clone();
        async move {
            let p = pods_of(&client, "m").await.into_iter().next()?;
            ready(&p).then_some(p)
        }
    })
    .await;
    let cs = container_status(&loaded);
    assert_eq!(cs.restart_count, 2);
    assert!(cs.ready);
    assert!(cs.state.unwrap().running.is_some());
    assert!(cs.last_state.unwrap().terminated.is_some());
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    eventually(WAIT, "the deployment counts it ready", || {
        let deploys = deploys.clone();
        async move { (deploys.get("m").await.ok()?.status?.ready_replicas == Some(1)).then_some(()) }
    })
    .await;

    // What the loader was told: args, the env resolved, each attempt's restart count; and the
    // back-off doubled between the attempts.
    let asked = loader.asked.lock().unwrap().clone();
    let (first, _) = &asked[0];
    assert_eq!(first.container, "vllm");
    assert_eq!(first.args, ["--model", "org/m", "--served-model-name", "m"]);
    assert_eq!(first.arg("--model"), Some("org/m"));
    assert_eq!(
        first.env,
        [("HF_ENDPOINT", "http://hub"), ("HF_TOKEN", "hf_secret")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into_iter()
            .collect()
    );
    let counts: Vec<u32> = asked.iter().map(|(r, _)| r.restart_count).collect();
    let mut distinct = counts.clone();
    distinct.dedup();
    assert_eq!(distinct, [0, 1, 2], "{counts:?}");
    let first_at = |n: u32| asked.iter().find(|(r, _)| r.restart_count == n).unwrap().1;
    let gap1 = first_at(1) - first_at(0);
    let gap2 = first_at(2) - first_at(1);
    assert!(gap1 >= Duration::from_millis(1000), "{gap1:?}");
    assert!(gap2 >= Duration::from_millis(2000), "{gap2:?}");
    cluster.shutdown().await;
}
