//! The API-server surface, driven by a real kube-rs client.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::{eventually, start, start_with};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::ByteString;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::discovery::{Discovery, Scope};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use sim_kube::ClusterConfig;

fn api_code<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> u16 {
    match r {
        Err(kube::Error::Api(s)) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn make_ns(client: &Client, name: &str) {
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    nss.create(&PostParams::default(), &ns).await.unwrap();
}

fn deployment(name: &str, image: &str) -> serde_json::Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "main", "image": image}]}
            }
        }
    })
}

#[tokio::test]
async fn typed_crud_round_trips() {
    let (cluster, client) = start().await;
    make_ns(&client, "crud").await;
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns = nss.get("crud").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Active"));
    assert_eq!(
        ns.metadata.labels.unwrap()["kubernetes.io/metadata.name"],
        "crud"
    );

    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "crud");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "cfg"}, "data": {"a": "1"}
    }))
    .unwrap();
    let created = cms.create(&PostParams::default(), &cm).await.unwrap();
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    assert_eq!(api_code(cms.create(&PostParams::default(), &cm).await), 409);

    let mut got = cms.get("cfg").await.unwrap();
    assert_eq!(got.data.as_ref().unwrap()["a"], "1");
    got.data.as_mut().unwrap().insert("b".into(), "2".into());
    let replaced = cms
        .replace("cfg", &PostParams::default(), &got)
        .await
        .unwrap();
    assert_ne!(replaced.resource_version(), created.resource_version());
    assert_eq!(
        cms.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );

    let patched = cms
        .patch(
            "cfg",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": null, "c": "3"}})),
        )
        .await
        .unwrap();
    let keys: Vec<&String> = patched.data.as_ref().unwrap().keys().collect();
    assert_eq!(keys, vec!["b", "c"]);

    let secrets: Api<Secret> = Api::namespaced(client.clone(), "crud");
    let mut data = BTreeMap::new();
    data.insert("token".to_string(), ByteString(b"s3cret".to_vec()));
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("tok".into()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &s).await.unwrap();
    let back = secrets.get("tok").await.unwrap();
    assert_eq!(back.data.unwrap()["token"].0, b"s3cret");
    assert_eq!(back.type_.as_deref(), Some("Opaque"));

    let deleted = cms.delete("cfg", &DeleteParams::default()).await.unwrap();
    assert!(
        deleted.is_right(),
        "an immediate delete answers with a Status"
    );
    assert_eq!(api_code(cms.get("cfg").await), 404);

    // Namespaced create in a namespace that does not exist.
    let missing: Api<ConfigMap> = Api::namespaced(client.clone(), "nope");
    assert_eq!(
        api_code(missing.create(&PostParams::default(), &cm).await),
        404
    );
    // Services get a cluster IP and defaulted ports.
    let svcs: Api<Service> = Api::namespaced(client.clone(), "crud");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}
    }))
    .unwrap();
    let svc = svcs.create(&PostParams::default(), &svc).await.unwrap();
    let spec = svc.spec.unwrap();
    assert!(spec.cluster_ip.unwrap().starts_with("10.96."));
    assert_eq!(spec.ports.unwrap()[0].protocol.as_deref(), Some("TCP"));
    assert!(cluster.write_count() >= 6);
    cluster.shutdown().await;
}

#[tokio::test]
async fn scale_subresource_and_secret_string_data() {
    let (cluster, client) = start().await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d: Deployment = serde_json::from_value(deployment("web", "nginx")).unwrap();
    deploys.create(&PostParams::default(), &d).await.unwrap();
    let scale = deploys.get_scale("web").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(1));
    assert_eq!(scale.status.unwrap().selector.as_deref(), Some("app=web"));
    deploys
        .patch_scale(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .unwrap();
    let d = deploys.get("web").await.unwrap();
    assert_eq!(d.spec.replicas, Some(3));
    assert_eq!(d.metadata.generation, Some(2));

    // stringData is folded into data, so re-applying it is a no-op.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    let s = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "stringData": {"HF_TOKEN": "hf_abc"}});
    let pp = PatchParams::apply("di-worker").force();
    let first = secrets.patch("hf", &pp, &Patch::Apply(&s)).await.unwrap();
    assert_eq!(first.data.as_ref().unwrap()["HF_TOKEN"].0, b"hf_abc");
    assert!(first.string_data.is_none());
    let second = secrets.patch("hf", &pp, &Patch::Apply(&s)).await.unwrap();
    assert_eq!(first.resource_version(), second.resource_version());
    cluster.shutdown().await;
}

/// A Pod is Pending from the moment it is created, with the QoS class its resources give it,
/// as kube-apiserver creates it: a reader never sees a Pod without a status.
#[tokio::test]
async fn a_new_pod_is_pending_with_its_qos_class() {
    let (cluster, client) = start().await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "default");
    let cases = [
        ("none", json!({}), "BestEffort"),
        (
            "limits",
            json!({"limits": {"cpu": "1", "memory": "1Gi"}}),
            "Guaranteed",
        ),
        (
            "less",
            json!({"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}),
            "Burstable",
        ),
        (
            "gpu-only",
            json!({"limits": {"nvidia.com/gpu": "1"}}),
            "BestEffort",
        ),
    ];
    for (name, resources, class) in cases {
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": resources}]},
            "status": {"phase": "Running"}});
        let made = pods
            .create(
                &PostParams::default(),
                &serde_json::from_value(pod).unwrap(),
            )
            .await
            .unwrap();
        let status = made.status.expect("a status from creation");
        assert_eq!(status.phase.as_deref(), Some("Pending"), "{name}");
        assert_eq!(status.qos_class.as_deref(), Some(class), "{name}");
    }
    cluster.shutdown().await;
}

#[tokio::test]
async fn validation_errors_are_kubernetes_statuses() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let bad: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "Not_Valid"}})).unwrap();
    match cms.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422);
            assert_eq!(s.reason, "Invalid");
            assert!(s.message.contains("metadata.name"), "{}", s.message);
        }
        other => panic!("expected 422, got {other:?}"),
    }
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let mut d = deployment("web", "nginx");
    d["spec"]["selector"]["matchLabels"]["app"] = json!("other");
    let d: Deployment = serde_json::from_value(d).unwrap();
    assert_eq!(
        api_code(deploys.create(&PostParams::default(), &d).await),
        422
    );
    let mut d = deployment("web", "");
    d["spec"]["template"]["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("image");
    let d: Deployment = serde_json::from_value(d).unwrap();
    assert_eq!(
        api_code(deploys.create(&PostParams::default(), &d).await),
        422
    );
    let svcs: Api<Service> = Api::namespaced(client.clone(), "default");
    let svc: Service =
        serde_json::from_value(json!({"metadata": {"name": "noports"}, "spec": {}})).unwrap();
    assert_eq!(
        api_code(svcs.create(&PostParams::default(), &svc).await),
        422
    );
    assert_eq!(cluster.write_count(), 0, "rejected writes are not counted");
    cluster.shutdown().await;
}

#[tokio::test]
async fn server_side_apply_is_idempotent_and_prunes() {
    let (cluster, client) = start().await;
    make_ns(&client, "ssa").await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "ssa");
    let pp = PatchParams::apply("di-worker").force();
    let mut desired = deployment("vllm", "vllm/vllm-openai:v0.11");
    desired["metadata"]["labels"]["extra"] = json!("yes");
    let first = deploys
        .patch("vllm", &pp, &Patch::Apply(&desired))
        .await
        .unwrap();
    let mf = first.metadata.managed_fields.clone().unwrap();
    assert!(mf
        .iter()
        .any(|e| e.manager.as_deref() == Some("di-worker")
            && e.operation.as_deref() == Some("Apply")));

    // Let the controller write status so the object moves underneath us.
    eventually(Duration::from_secs(5), "deployment status", || {
        let deploys = deploys.clone();
        async move {
            let d = deploys.get("vllm").await.ok()?;
            d.status.and_then(|s| s.observed_generation).map(|_| ())
        }
    })
    .await;
    let before = deploys.get("vllm").await.unwrap();
    let writes = cluster.write_count();
    let second = deploys
        .patch("vllm", &pp, &Patch::Apply(&desired))
        .await
        .unwrap();
    assert_eq!(
        cluster.write_count(),
        writes,
        "an identical apply writes nothing"
    );
    let after = deploys.get("vllm").await.unwrap();
    assert_eq!(second.metadata.generation, before.metadata.generation);
    // The status controller may have moved on, but the apply itself changed nothing
    // in spec/metadata.
    assert_eq!(second.spec, before.spec);
    let worker_entry = |d: &Deployment| {
        d.metadata
            .managed_fields
            .clone()
            .unwrap()
            .into_iter()
            .find(|e| e.manager.as_deref() == Some("di-worker"))
            .unwrap()
    };
    assert_eq!(
        worker_entry(&after),
        worker_entry(&before),
        "ownership and time untouched"
    );

    // Dropping a label this manager set removes it; generation unchanged (metadata only).
    let mut trimmed = desired.clone();
    trimmed["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("extra");
    let third = deploys
        .patch("vllm", &pp, &Patch::Apply(&trimmed))
        .await
        .unwrap();
    assert!(!third.labels().contains_key("extra"));
    assert_eq!(third.metadata.generation, first.metadata.generation);
    assert_eq!(cluster.write_count(), writes + 1);

    // A spec change bumps generation.
    let mut scaled = trimmed.clone();
    scaled["spec"]["replicas"] = json!(2);
    let fourth = deploys
        .patch("vllm", &pp, &Patch::Apply(&scaled))
        .await
        .unwrap();
    assert_eq!(
        fourth.metadata.generation,
        Some(first.metadata.generation.unwrap() + 1)
    );

    // Another manager changing an owned field conflicts unless forced.
    let mut rival = scaled.clone();
    rival["spec"]["replicas"] = json!(5);
    let err = deploys
        .patch(
            "vllm",
            &PatchParams::apply("someone-else"),
            &Patch::Apply(&rival),
        )
        .await;
    assert_eq!(api_code(err), 409);
    let forced = deploys
        .patch(
            "vllm",
            &PatchParams::apply("someone-else").force(),
            &Patch::Apply(&rival),
        )
        .await
        .unwrap();
    assert_eq!(forced.spec.replicas, Some(5));
    cluster.shutdown().await;
}

#[tokio::test]
async fn apply_to_missing_object_creates_it_once() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let pp = PatchParams::apply("di-worker").force();
    let cfg = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "epp"}, "data": {"config.yaml": "x: 1"}});
    let a = cms.patch("epp", &pp, &Patch::Apply(&cfg)).await.unwrap();
    let b = cms.patch("epp", &pp, &Patch::Apply(&cfg)).await.unwrap();
    assert_eq!(a.resource_version(), b.resource_version());
    assert_eq!(cluster.write_count(), 1);
    cluster.shutdown().await;
}

#[tokio::test]
async fn replace_with_stale_resource_version_conflicts() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"k": "1"}})).unwrap();
    let v1 = cms.create(&PostParams::default(), &cm).await.unwrap();
    let mut a = v1.clone();
    a.data.as_mut().unwrap().insert("k".into(), "2".into());
    cms.replace("c", &PostParams::default(), &a).await.unwrap();
    let mut stale = v1.clone();
    stale.data.as_mut().unwrap().insert("k".into(), "3".into());
    match cms.replace("c", &PostParams::default(), &stale).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409);
            assert_eq!(s.reason, "Conflict");
        }
        other => panic!("expected 409, got {other:?}"),
    }
    assert_eq!(cms.get("c").await.unwrap().data.unwrap()["k"], "2");
    cluster.shutdown().await;
}

#[tokio::test]
async fn watcher_sees_added_modified_deleted() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let mut stream = watcher(cms.clone(), watcher::Config::default()).boxed();
    // Drain the initial list.
    loop {
        match stream.try_next().await.unwrap().unwrap() {
            watcher::Event::InitDone => break,
            _ => continue,
        }
    }
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "w"}, "data": {"k": "1"}})).unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    cms.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "2"}})),
    )
    .await
    .unwrap();
    cms.delete("w", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let ev = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
            .await
            .expect("event in time")
            .unwrap()
            .unwrap();
        match ev {
            watcher::Event::Apply(o) => seen.push(format!("apply:{}", o.data.unwrap()["k"])),
            watcher::Event::Delete(o) => seen.push(format!("delete:{}", o.name_any())),
            _ => {}
        }
    }
    assert_eq!(seen, vec!["apply:1", "apply:2", "delete:w"]);
    cluster.shutdown().await;
}

#[tokio::test]
async fn raw_watch_resumes_and_expires() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let list = cms.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "r", "labels": {"x": "1"}}})).unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    // Resuming from the list's resourceVersion replays the create.
    let mut events = cms
        .watch(&WatchParams::default().timeout(5), &rv)
        .await
        .unwrap()
        .boxed();
    match events.try_next().await.unwrap().unwrap() {
        WatchEvent::Added(o) => assert_eq!(o.name_any(), "r"),
        other => panic!("expected ADDED, got {other:?}"),
    }
    // Label selector transitions: relabelling out of the selection is a DELETED.
    let mut selected = cms
        .watch(
            &WatchParams::default().labels("x=1").timeout(5),
            &cms.get("r").await.unwrap().resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    cms.patch(
        "r",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "2"}}})),
    )
    .await
    .unwrap();
    match selected.try_next().await.unwrap().unwrap() {
        WatchEvent::Deleted(o) => assert_eq!(o.labels()["x"], "2"),
        other => panic!("expected DELETED, got {other:?}"),
    }
    // After compaction an old resourceVersion is 410 Gone, as an ERROR event.
    cluster.compact_history();
    let mut gone = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match gone.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        other => panic!("expected 410, got {other:?}"),
    }
    cluster.shutdown().await;
}

#[tokio::test]
async fn watcher_relists_after_gone() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    // Short server-side timeouts make the watcher reconnect from its last resourceVersion.
    let mut stream = watcher(cms.clone(), watcher::Config::default().timeout(1)).boxed();
    loop {
        if let watcher::Event::InitDone = stream.try_next().await.unwrap().unwrap() {
            break;
        }
    }
    // A change this watcher does not see moves the store on; compaction then
    // expires the watcher's resume point.
    let other: Api<ConfigMap> = Api::namespaced(client.clone(), "kube-system");
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "elsewhere"}})).unwrap();
    other.create(&PostParams::default(), &cm).await.unwrap();
    cluster.compact_history();
    let mut saw_gone = false;
    let relisted = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.next().await {
                Some(Err(watcher::Error::WatchError(e))) if e.code == 410 => saw_gone = true,
                Some(Ok(watcher::Event::Init)) => return true,
                Some(_) => continue,
                None => return false,
            }
        }
    })
    .await
    .expect("watcher re-lists in time");
    assert!(saw_gone, "the expired resume point surfaced as 410");
    assert!(relisted);
    cluster.shutdown().await;
}

#[tokio::test]
async fn finalizers_block_deletion_until_removed() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "held", "finalizers": ["di.do/cleanup"]}
    }))
    .unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    let res = cms.delete("held", &DeleteParams::default()).await.unwrap();
    let pending = res.left().expect("deletion pending returns the object");
    assert!(pending.metadata.deletion_timestamp.is_some());
    let still = cms.get("held").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_some());
    // JSON patch, the way kube::runtime::finalizer removes its finalizer.
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "di.do/cleanup"},
        {"op": "remove", "path": "/metadata/finalizers/0"}
    ]))
    .unwrap();
    cms.patch("held", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .unwrap();
    assert_eq!(api_code(cms.get("held").await), 404);
    cluster.shutdown().await;
}

#[tokio::test]
async fn namespace_deletion_cascades() {
    let (cluster, client) = start().await;
    make_ns(&client, "di-123").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "di-123");
    for n in ["a", "b"] {
        let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": n}})).unwrap();
        cms.create(&PostParams::default(), &cm).await.unwrap();
    }
    let held: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "held", "finalizers": ["x/y"]}}))
            .unwrap();
    cms.create(&PostParams::default(), &held).await.unwrap();
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "di-123");
    let d: Deployment = serde_json::from_value(deployment("m", "img")).unwrap();
    deploys.create(&PostParams::default(), &d).await.unwrap();

    let nss: Api<Namespace> = Api::all(client.clone());
    nss.delete("di-123", &DeleteParams::default())
        .await
        .unwrap();
    let ns = nss.get("di-123").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Terminating"));
    // New content is refused while terminating.
    let late: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "late"}})).unwrap();
    assert_eq!(
        api_code(cms.create(&PostParams::default(), &late).await),
        403
    );
    // Everything but the finalizer-held object goes; the namespace waits for it.
    eventually(Duration::from_secs(5), "namespace emptied", || {
        let cluster = cluster.clone();
        async move {
            let left: Vec<String> = cluster
                .list_all()
                .into_iter()
                .filter(|o| o["metadata"]["namespace"] == "di-123")
                .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
                .collect();
            (left == vec!["held".to_string()]).then_some(())
        }
    })
    .await;
    assert!(nss.get("di-123").await.is_ok());
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually(Duration::from_secs(5), "namespace gone", || {
        let nss = nss.clone();
        async move { nss.get_opt("di-123").await.unwrap().is_none().then_some(()) }
    })
    .await;
    assert!(cluster
        .list_all()
        .iter()
        .all(|o| o["metadata"]["namespace"] != "di-123"));
    cluster.shutdown().await;
}

#[tokio::test]
async fn label_and_field_selectors() {
    let (cluster, client) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    for (n, tier) in [("a", "web"), ("b", "web"), ("c", "db")] {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": n, "labels": {"tier": tier}}}))
                .unwrap();
        cms.create(&PostParams::default(), &cm).await.unwrap();
    }
    let names = |l: kube::core::ObjectList<ConfigMap>| {
        l.items.iter().map(|c| c.name_any()).collect::<Vec<_>>()
    };
    assert_eq!(
        names(
            cms.list(&ListParams::default().labels("tier=web"))
                .await
                .unwrap()
        ),
        ["a", "b"]
    );
    assert_eq!(
        names(
            cms.list(&ListParams::default().labels("tier!=web"))
                .await
                .unwrap()
        ),
        ["c"]
    );
    assert_eq!(
        names(
            cms.list(&ListParams::default().labels("tier in (db,cache)"))
                .await
                .unwrap()
        ),
        ["c"]
    );
    assert_eq!(
        names(
            cms.list(&ListParams::default().labels("tier notin (db)"))
                .await
                .unwrap()
        ),
        ["a", "b"]
    );
    assert_eq!(
        names(
            cms.list(&ListParams::default().labels("!tier"))
                .await
                .unwrap()
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        names(
            cms.list(&ListParams::default().fields("metadata.name=b"))
                .await
                .unwrap()
        ),
        ["b"]
    );
    let all: Api<ConfigMap> = Api::all(client.clone());
    assert_eq!(
        names(
            all.list(&ListParams::default().fields("metadata.namespace=default,metadata.name!=a"))
                .await
                .unwrap()
        ),
        ["b", "c"]
    );
    cluster.shutdown().await;
}

#[tokio::test]
async fn discovery_lists_every_kind() {
    let (cluster, client) = start().await;
    for aggregated in [false, true] {
        let d = Discovery::new(client.clone());
        let d = if aggregated {
            d.run_aggregated().await.unwrap()
        } else {
            d.run().await.unwrap()
        };
        for (g, v, k, scope) in [
            ("", "v1", "Namespace", Scope::Cluster),
            ("", "v1", "Node", Scope::Cluster),
            ("", "v1", "Pod", Scope::Namespaced),
            ("apps", "v1", "Deployment", Scope::Namespaced),
            (
                "networking.k8s.io",
                "v1",
                "NetworkPolicy",
                Scope::Namespaced,
            ),
            (
                "rbac.authorization.k8s.io",
                "v1",
                "RoleBinding",
                Scope::Namespaced,
            ),
            (
                "gateway.networking.k8s.io",
                "v1",
                "GatewayClass",
                Scope::Cluster,
            ),
            (
                "gateway.networking.k8s.io",
                "v1",
                "HTTPRoute",
                Scope::Namespaced,
            ),
            (
                "inference.networking.k8s.io",
                "v1",
                "InferencePool",
                Scope::Namespaced,
            ),
        ] {
            let (ar, caps) = d
                .resolve_gvk(&GroupVersionKind::gvk(g, v, k))
                .unwrap_or_else(|| panic!("{k} discovered (aggregated={aggregated})"));
            assert_eq!(caps.scope, scope, "{k}");
            assert!(caps.operations.iter().any(|o| o == "watch"), "{k}");
            if k == "Deployment" {
                assert_eq!(ar.plural, "deployments");
                assert!(
                    caps.subresources.iter().any(|(s, _)| s.plural == "status"),
                    "deployments/status"
                );
            }
        }
    }
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(v.major, "1");
    cluster.shutdown().await;
}

#[tokio::test]
async fn bearer_token_is_required_when_configured() {
    let (cluster, client) = start_with(ClusterConfig {
        bearer_token: Some("t0ken".into()),
        ..Default::default()
    })
    .await;
    // The kubeconfig carries the token.
    let nss: Api<Namespace> = Api::all(client.clone());
    assert!(nss.get("default").await.is_ok());
    let anonymous = reqwest_free_get(&cluster.url(), "/api/v1/namespaces").await;
    assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
    assert!(
        anonymous.contains("\"reason\":\"Unauthorized\""),
        "{anonymous}"
    );
    cluster.shutdown().await;
}

/// A bare HTTP/1.1 GET (no client library, no credentials).
async fn reqwest_free_get(base: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The API resources of Gateways, HTTPRoutes and InferencePools.
fn gateway_resources() -> (ApiResource, ApiResource, ApiResource) {
    let gvk = |g: &str, k: &str, p: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(g, "v1", k), p)
    };
    (
        gvk("gateway.networking.k8s.io", "Gateway", "gateways"),
        gvk("gateway.networking.k8s.io", "HTTPRoute", "httproutes"),
        gvk(
            "inference.networking.k8s.io",
            "InferencePool",
            "inferencepools",
        ),
    )
}

#[tokio::test]
async fn gateway_route_and_pool_as_dynamic_objects() {
    let (cluster, client) = start().await;
    make_ns(&client, "di-9").await;
    let (gw_ar, route_ar, pool_ar) = gateway_resources();
    let gws: Api<DynamicObject> = Api::namespaced_with(client.clone(), "di-9", &gw_ar);
    let routes: Api<DynamicObject> = Api::namespaced_with(client.clone(), "di-9", &route_ar);
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), "di-9", &pool_ar);
    let svcs: Api<Service> = Api::namespaced(client.clone(), "di-9");
    let pp = PatchParams::apply("di-worker").force();

    let gw = DynamicObject::new("inference", &gw_ar).data(json!({
        "spec": {
            "gatewayClassName": "istio",
            "listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
                           "tls": {"mode": "Terminate", "certificateRefs": [{"name": "tls"}]}}],
            "infrastructure": {"annotations": {"service.beta.kubernetes.io/do-loadbalancer-network": "INTERNAL"}}
        }
    }));
    gws.patch("inference", &pp, &Patch::Apply(&gw))
        .await
        .unwrap();
    let pool = DynamicObject::new("llama", &pool_ar).data(json!({
        "spec": {
            "selector": {"matchLabels": {"llm-d.ai/model": "llama"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
        }
    }));
    pools
        .patch("llama", &pp, &Patch::Apply(&pool))
        .await
        .unwrap();
    let route = DynamicObject::new("llama", &route_ar).data(json!({
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference"}],
            "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"}]}]
        }
    }));
    routes
        .patch("llama", &pp, &Patch::Apply(&route))
        .await
        .unwrap();

    // Gateway: programmed with a private address; the missing TLS secret shows on the listener.
    let gw = eventually(Duration::from_secs(5), "gateway programmed", || {
        let gws = gws.clone();
        async move {
            let g = gws.get("inference").await.ok()?;
            g.data["status"]["addresses"][0]["value"]
                .is_string()
                .then_some(g)
        }
    })
    .await;
    assert!(gw.data["status"]["addresses"][0]["value"]
        .as_str()
        .unwrap()
        .starts_with("10."));
    let conds = gw.data["status"]["conditions"].as_array().unwrap();
    assert!(conds
        .iter()
        .any(|c| c["type"] == "Programmed" && c["status"] == "True"));
    let listener = &gw.data["status"]["listeners"][0];
    assert_eq!(listener["attachedRoutes"], 1);
    assert!(listener["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["reason"] == "InvalidCertificateRef"));

    // Route accepted and resolved; pool accepted by the gateway but its EPP Service is missing.
    let route = eventually(Duration::from_secs(5), "route status", || {
        let routes = routes.clone();
        async move {
            let r = routes.get("llama").await.ok()?;
            r.data["status"]["parents"][0]["conditions"]
                .is_array()
                .then_some(r)
        }
    })
    .await;
    let rc = route.data["status"]["parents"][0]["conditions"]
        .as_array()
        .unwrap();
    assert!(rc
        .iter()
        .any(|c| c["type"] == "Accepted" && c["status"] == "True"));
    assert!(rc
        .iter()
        .any(|c| c["type"] == "ResolvedRefs" && c["status"] == "True"));
    let pool = eventually(Duration::from_secs(5), "pool parents", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("llama").await.ok()?;
            p.data["status"]["parents"][0]["parentRef"]["name"]
                .is_string()
                .then_some(p)
        }
    })
    .await;
    assert_eq!(
        pool.data["status"]["parents"][0]["parentRef"]["name"],
        "inference"
    );
    let pc = pool.data["status"]["parents"][0]["conditions"]
        .as_array()
        .unwrap();
    assert!(pc
        .iter()
        .any(|c| c["type"] == "ResolvedRefs" && c["reason"] == "InvalidExtensionRef"));

    // Creating the EPP Service resolves the pool's reference.
    let epp: Service = serde_json::from_value(json!({
        "metadata": {"name": "llama-epp"}, "spec": {"ports": [{"name": "grpc", "port": 9002}]}
    }))
    .unwrap();
    svcs.create(&PostParams::default(), &epp).await.unwrap();
    eventually(Duration::from_secs(5), "pool refs resolved", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("llama").await.ok()?;
            let cs = p.data["status"]["parents"][0]["conditions"]
                .as_array()?
                .clone();
            cs.iter()
                .any(|c| c["type"] == "ResolvedRefs" && c["status"] == "True")
                .then_some(())
        }
    })
    .await;

    // Applying the same objects again writes nothing, even though status moved.
    let writes = cluster.write_count();
    let gw_again = DynamicObject::new("inference", &gw_ar).data(json!({
        "spec": {
            "gatewayClassName": "istio",
            "listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
                           "tls": {"mode": "Terminate", "certificateRefs": [{"name": "tls"}]}}],
            "infrastructure": {"annotations": {"service.beta.kubernetes.io/do-loadbalancer-network": "INTERNAL"}}
        }
    }));
    gws.patch("inference", &pp, &Patch::Apply(&gw_again))
        .await
        .unwrap();
    routes
        .patch("llama", &pp, &Patch::Apply(&route_again(&route_ar)))
        .await
        .unwrap();
    assert_eq!(cluster.write_count(), writes);
    // Unknown kinds and wrong bodies are rejected like a real server would.
    let bad = DynamicObject::new("x", &pool_ar)
        .data(json!({"spec": {"targetPorts": [{"number": 8000}]}}));
    assert_eq!(
        api_code(pools.create(&PostParams::default(), &bad).await),
        422
    );
    cluster.shutdown().await;
}

/// Routes of another namespace attach to a Gateway whose listener admits them (a parentRef
/// naming the Gateway's namespace, counted once however many of its refs name the Gateway),
/// and the pools they send to, by a backendRef naming the pool's namespace, list that Gateway.
#[tokio::test]
async fn routes_of_another_namespace_attach_where_a_listener_admits_them() {
    let (cluster, client) = start().await;
    make_ns(&client, "di-9").await;
    make_ns(&client, "team").await;
    let (gw_ar, route_ar, pool_ar) = gateway_resources();
    let pp = PatchParams::apply("di-worker").force();
    let apply = |ns: &str, ar: &ApiResource, name: &str, spec: serde_json::Value| {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, ar);
        let obj = DynamicObject::new(name, ar).data(json!({ "spec": spec }));
        let (name, pp) = (name.to_string(), pp.clone());
        async move { api.patch(&name, &pp, &Patch::Apply(&obj)).await.unwrap() }
    };
    apply(
        "di-9",
        &gw_ar,
        "inference",
        json!({
            "gatewayClassName": "istio",
            "listeners": [
                {"name": "https", "port": 443, "protocol": "HTTPS"},
                {"name": "shared", "port": 8443, "protocol": "HTTPS",
                 "allowedRoutes": {"namespaces": {"from": "All"}}},
            ]
        }),
    )
    .await;
    apply(
        "di-9",
        &pool_ar,
        "llama",
        json!({
            "selector": {"matchLabels": {"llm-d.ai/model": "llama"}},
            "targetPorts": [{"number": 8000}]
        }),
    )
    .await;
    let to_pool = |ns: Option<&str>| {
        let mut b = json!({"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"});
        if let Some(ns) = ns {
            b["namespace"] = json!(ns);
        }
        json!([{"backendRefs": [b]}])
    };
    apply(
        "di-9",
        &route_ar,
        "own",
        json!({
            "parentRefs": [{"name": "inference"}],
            "rules": [{"backendRefs": [{"name": "elsewhere"}]}]
        }),
    )
    .await;
    apply(
        "team",
        &route_ar,
        "guest",
        json!({
            "parentRefs": [{"name": "inference", "namespace": "di-9", "sectionName": "shared"},
                           {"name": "inference", "namespace": "di-9"}],
            "rules": to_pool(Some("di-9"))
        }),
    )
    .await;
    // Naming the pool without its namespace: a pool of `team`, which has none.
    apply(
        "team",
        &route_ar,
        "lost",
        json!({
            "parentRefs": [{"name": "inference", "namespace": "di-9"}],
            "rules": to_pool(None)
        }),
    )
    .await;

    // What the controllers write once they have seen every route (eventually: the first
    // passes may write before the last route is applied).
    let gws: Api<DynamicObject> = Api::namespaced_with(client.clone(), "di-9", &gw_ar);
    let attached = || async {
        let g = gws.get("inference").await.unwrap();
        let ls = g.data["status"]["listeners"].as_array().cloned()?;
        let counts: Vec<(String, i64)> = ls
            .iter()
            .map(|l| {
                (
                    l["name"].as_str().unwrap().into(),
                    l["attachedRoutes"].as_i64().unwrap(),
                )
            })
            .collect();
        (counts == [("https".into(), 1), ("shared".into(), 3)]).then_some(())
    };
    eventually(
        Duration::from_secs(5),
        "https: 1 route, shared: 3",
        attached,
    )
    .await;
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), "di-9", &pool_ar);
    let gateway = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway",
                         "name": "inference", "namespace": "di-9"});
    let pool_parents = || async {
        let p = pools.get("llama").await.unwrap();
        let parents: Vec<_> = p.data["status"]["parents"]
            .as_array()?
            .iter()
            .map(|p| p["parentRef"].clone())
            .collect();
        (parents == [gateway.clone()]).then_some(())
    };
    eventually(
        Duration::from_secs(5),
        "the pool's one parent",
        pool_parents,
    )
    .await;
    let routes: Api<DynamicObject> = Api::namespaced_with(client.clone(), "team", &route_ar);
    let resolved = |name: &'static str, want: bool| {
        let routes = routes.clone();
        async move || {
            let r = routes.get(name).await.unwrap();
            let cs = r.data["status"]["parents"][0]["conditions"]
                .as_array()?
                .clone();
            cs.iter()
                .any(|c| c["type"] == "ResolvedRefs" && (c["status"] == "True") == want)
                .then_some(())
        }
    };
    eventually(
        Duration::from_secs(5),
        "guest resolved",
        resolved("guest", true),
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "lost unresolved",
        resolved("lost", false),
    )
    .await;
    cluster.shutdown().await;
}

fn route_again(ar: &ApiResource) -> DynamicObject {
    DynamicObject::new("llama", ar).data(json!({
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference"}],
            "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"}]}]
        }
    }))
}

#[tokio::test]
async fn network_policies_are_stored_validated_and_go_with_their_namespace() {
    let (cluster, client) = start().await;
    make_ns(&client, "di-np").await;
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), "di-np");
    let policy = |ingress: serde_json::Value| {
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "allow-gateway"},
            "spec": {"podSelector": {"matchLabels": {"app": "vllm"}}, "policyTypes": ["Ingress"],
                     "ingress": ingress},
        })
    };
    let good = policy(json!([{
        "from": [{"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "gw"}}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }]));
    let ssa = PatchParams::apply("test").force();
    policies
        .patch("allow-gateway", &ssa, &Patch::Apply(&good))
        .await
        .unwrap();
    let writes = cluster.write_count();
    let stored = policies
        .patch("allow-gateway", &ssa, &Patch::Apply(&good))
        .await
        .unwrap();
    assert_eq!(
        cluster.write_count(),
        writes,
        "an unchanged apply writes nothing"
    );
    let rule = &stored.spec.unwrap().ingress.unwrap()[0];
    assert_eq!(
        rule.ports.as_ref().unwrap()[0].port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8000))
    );
    // What the API server refuses: an empty peer, two peer types, a bad port or policy type.
    for bad in [
        policy(json!([{"from": [{}]}])),
        policy(json!([{"from": [{"podSelector": {}, "ipBlock": {"cidr": "10.0.0.0/8"}}]}])),
        policy(json!([{"ports": [{"protocol": "TCP", "port": 70000}]}])),
        policy(json!([{"ports": [{"protocol": "ICMP", "port": 1}]}])),
        {
            let mut p = policy(json!([]));
            p["spec"]["policyTypes"] = json!(["Sideways"]);
            p
        },
    ] {
        let mut bad = bad;
        bad["metadata"]["name"] = json!("bad");
        assert_eq!(
            api_code(policies.patch("bad", &ssa, &Patch::Apply(&bad)).await),
            422,
            "{bad}"
        );
    }
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.delete("di-np", &DeleteParams::default()).await.unwrap();
    eventually(Duration::from_secs(5), "namespace gone", || {
        let nss = nss.clone();
        async move { nss.get_opt("di-np").await.unwrap().is_none().then_some(()) }
    })
    .await;
    assert!(cluster
        .list_all()
        .iter()
        .all(|o| o["kind"] != "NetworkPolicy"));
    cluster.shutdown().await;
}

/// A scale-down removes the pods the ReplicaSet controller ranks first: among ready pods, the
/// lowest `controller.kubernetes.io/pod-deletion-cost` (how a controller of the pods, here the
/// worker, says which replica is least busy).
#[tokio::test]
async fn a_scale_down_removes_the_lowest_deletion_cost_first() {
    use k8s_openapi::api::core::v1::Pod;
    let (cluster, client) = start().await;
    cluster.upsert_node(crate::common::cpu_node("cpu-1", "default-pool"));
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut d = deployment("web", "nginx");
    d["spec"]["replicas"] = json!(3);
    let d: Deployment = serde_json::from_value(d).unwrap();
    deploys.create(&PostParams::default(), &d).await.unwrap();
    let live = async || {
        let list = pods
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap();
        let mut names: Vec<String> = list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| p.name_any())
            .collect();
        names.sort();
        names
    };
    eventually(Duration::from_secs(10), "3 ready pods", async || {
        let ready = deploys.get("web").await.unwrap().status?.ready_replicas;
        (ready == Some(3)).then_some(())
    })
    .await;
    let names = live().await;
    // The busiest last: the middle one by name is the one to keep.
    for (name, cost) in names.iter().zip(["-5", "10", "3"]) {
        let patch = json!({"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": cost}}});
        pods.patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }
    deploys
        .patch_scale(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    let kept = eventually(Duration::from_secs(10), "one pod left", async || {
        let l = live().await;
        (l.len() == 1).then_some(l)
    })
    .await;
    assert_eq!(kept, [names[1].clone()]);
    cluster.shutdown().await;
}
