//! Model servers loading from a Hugging Face Hub: the region's loader against a stub Hub that
//! answers as huggingface.co does, alone and behind a simulated cluster's pods.

use std::time::Duration;

use region_sim::hub_loader::HubLoader;
use reqwest::Method;
use serde_json::{json, Value};
use sim_kube::{LoadRequest, ModelLoader};

use crate::doks::{cpu_cluster, eventually, start};

/// A Hub answering as huggingface.co does: `org/public` to anyone, `org/gated` to the
/// granted token (a revoked one is refused as invalid), revisions `main` and `v1`, every
/// other repository unknown.
async fn stub_hub() -> String {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    async fn answer(
        axum::extract::Path(path): axum::extract::Path<String>,
        headers: HeaderMap,
    ) -> axum::response::Response {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let refuse = |status: StatusCode, code: Option<&str>, msg: &str| {
            let mut h = HeaderMap::new();
            if let Some(c) = code {
                h.insert("x-error-code", c.parse().unwrap());
            }
            h.insert("x-error-message", msg.parse().unwrap());
            (status, h, "{}").into_response()
        };
        let Some((repo, rest)) = path.split_once("/resolve/") else {
            return StatusCode::NOT_FOUND.into_response();
        };
        if bearer == Some("hf_revoked") {
            return refuse(
                StatusCode::UNAUTHORIZED,
                None,
                "Invalid credentials in Authorization header",
            );
        }
        match repo {
            "org/public" => {}
            "org/gated" if bearer == Some("hf_granted") => {}
            "org/gated" => {
                return refuse(
                    if bearer.is_some() {
                        StatusCode::FORBIDDEN
                    } else {
                        StatusCode::UNAUTHORIZED
                    },
                    Some("GatedRepo"),
                    "Access to model org/gated is restricted.",
                )
            }
            _ => {
                return refuse(
                    StatusCode::UNAUTHORIZED,
                    Some("RepoNotFound"),
                    "Repository not found",
                )
            }
        }
        match rest.split_once('/') {
            Some(("main" | "v1", "config.json")) => {
                (StatusCode::OK, "{\"model_type\": \"qwen2\"}").into_response()
            }
            Some(("main" | "v1", _)) => refuse(
                StatusCode::NOT_FOUND,
                Some("EntryNotFound"),
                "Entry not found",
            ),
            _ => refuse(
                StatusCode::NOT_FOUND,
                Some("RevisionNotFound"),
                "Invalid rev id",
            ),
        }
    }
    let app = axum::Router::new().route("/{*path}", axum::routing::get(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

fn request(uid: &str, args: &[&str], env: &[(&str, &str)]) -> LoadRequest {
    LoadRequest {
        pod_uid: uid.into(),
        namespace: "ns".into(),
        pod_name: "vllm-1".into(),
        container: "vllm".into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        restart_count: 0,
    }
}

/// Asks until the loader knows.
async fn settled(loader: &HubLoader, r: &LoadRequest) -> Result<(), String> {
    let what = format!("an answer for {r:?}");
    test_support::eventually(Duration::from_secs(2), what, async || loader.load(r)).await
}

#[tokio::test]
async fn the_hub_decides_each_attempt_without_blocking() {
    let hub = stub_hub().await;
    let loader = HubLoader::new(None).unwrap();
    let with = |uid: &str, repo: &str, extra: &[&str], token: Option<&str>| {
        let mut args = vec!["--model", repo, "--served-model-name", "m"];
        args.extend_from_slice(extra);
        let mut env = vec![("HF_ENDPOINT", hub.as_str())];
        if let Some(t) = token {
            env.push(("HF_TOKEN", t));
        }
        request(uid, &args, &env)
    };
    // The first ask starts the request and does not wait for it.
    let r = with("p1", "org/public", &[], None);
    assert_eq!(loader.load(&r), None);
    assert_eq!(settled(&loader, &r).await, Ok(()));
    assert_eq!(
        settled(&loader, &with("p2", "org/gated", &[], Some("hf_granted"))).await,
        Ok(())
    );
    assert_eq!(
        settled(
            &loader,
            &with("p3", "org/gated", &["--revision", "v1"], Some("hf_granted"))
        )
        .await,
        Ok(())
    );
    let url = |repo: &str, rev: &str| format!("{hub}/{repo}/resolve/{rev}/config.json");
    let e = settled(&loader, &with("p4", "org/deleted", &[], Some("hf_granted")))
        .await
        .unwrap_err();
    assert!(
        e.starts_with(&format!(
            "RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: {}.",
            url("org/deleted", "main")
        )),
        "{e}"
    );
    let e = settled(&loader, &with("p5", "org/gated", &[], Some("hf_other")))
        .await
        .unwrap_err();
    assert_eq!(
        e,
        format!(
            "GatedRepoError: 403 Client Error. Cannot access gated repo for url {}. Access to model org/gated is restricted.",
            url("org/gated", "main")
        )
    );
    let e = settled(&loader, &with("p6", "org/gated", &[], None))
        .await
        .unwrap_err();
    assert!(e.starts_with("GatedRepoError: 401 Client Error."), "{e}");
    let e = settled(&loader, &with("p7", "org/gated", &[], Some("hf_revoked")))
        .await
        .unwrap_err();
    assert!(
        e.starts_with("HfHubHTTPError: 401 Client Error: Unauthorized for url: ")
            && e.ends_with("Invalid credentials in Authorization header"),
        "{e}"
    );
    assert!(
        !e.contains("hf_revoked"),
        "the token is never in a message: {e}"
    );
    let e = settled(
        &loader,
        &with("p8", "org/public", &["--revision", "nope"], None),
    )
    .await
    .unwrap_err();
    assert!(
        e.starts_with("RevisionNotFoundError: 404 Client Error."),
        "{e}"
    );

    // Each attempt is asked anew: the next restart of a failed pod sees a granted token.
    let mut again = with("p5", "org/gated", &[], Some("hf_granted"));
    again.restart_count = 1;
    assert_eq!(settled(&loader, &again).await, Ok(()));

    // A Hub that does not answer: the connection error.
    let e = settled(
        &loader,
        &request(
            "p9",
            &["--model", "org/public"],
            &[("HF_ENDPOINT", "http://127.0.0.1:1")],
        ),
    )
    .await
    .unwrap_err();
    assert!(e.starts_with("ConnectionError: "), "{e}");
}

#[tokio::test]
async fn only_model_servers_with_a_reachable_hub_are_asked() {
    let loader = HubLoader::new(None).unwrap();
    // Not a model server.
    assert_eq!(
        loader.load(&request("a", &["--port", "9002"], &[])),
        Some(Ok(()))
    );
    // The public Hub, not simulated.
    assert_eq!(
        loader.load(&request("b", &["--model", "org/x"], &[])),
        Some(Ok(()))
    );
    // A Hub beyond loopback is never reached.
    assert_eq!(
        loader.load(&request(
            "c",
            &["--model", "org/x"],
            &[("HF_ENDPOINT", "https://huggingface.co")]
        )),
        Some(Ok(()))
    );
    // A default Hub stands in for the public one.
    let hub = stub_hub().await;
    let loader = HubLoader::new(Some(format!("{hub}/"))).unwrap();
    let e = settled(&loader, &request("d", &["--model", "org/x"], &[]))
        .await
        .unwrap_err();
    assert!(e.starts_with("RepositoryNotFoundError: "), "{e}");
}

fn pod(name: &str, repo: &str, hub: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
        "args": ["--model", repo, "--served-model-name", "m"],
        "env": [
            {"name": "HF_ENDPOINT", "value": hub},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}},
        ]}]}})
}

/// A pod whose repository the Hub refuses crash-loops with huggingface_hub's error as its last
/// termination message; one the Hub serves (with the token from the pod's Secret) turns Ready.
#[tokio::test]
async fn a_pod_whose_hub_refuses_its_repository_crash_loops_with_the_hubs_error() {
    let hub = stub_hub().await;
    let sim = start().await;
    let (_id, kube) = cpu_cluster(&sim).await;
    kube.create(
        "/api/v1/namespaces/default/secrets",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
               "data": {"HF_TOKEN": "aGZfZ3JhbnRlZA=="}}), // hf_granted
    )
    .await;
    kube.create(
        "/api/v1/namespaces/default/pods",
        pod("refused", "org/deleted", &hub),
    )
    .await;
    kube.create(
        "/api/v1/namespaces/default/pods",
        pod("granted", "org/gated", &hub),
    )
    .await;
    let ready = |p: &Value| {
        p["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
    };
    eventually("the granted pod ready", async || {
        let (_, p) = kube.get("/api/v1/namespaces/default/pods/granted").await;
        ready(&p).then_some(())
    })
    .await;
    let refused = eventually("the refused pod crash-looping", async || {
        let (_, p) = kube.get("/api/v1/namespaces/default/pods/refused").await;
        let cs = &p["status"]["containerStatuses"][0];
        (cs["state"]["waiting"]["reason"] == "CrashLoopBackOff").then(|| cs.clone())
    })
    .await;
    let message = refused["lastState"]["terminated"]["message"]
        .as_str()
        .unwrap();
    assert!(
        message.starts_with(&format!(
            "RepositoryNotFoundError: 401 Client Error. Repository Not Found for url: {hub}/org/deleted/resolve/main/config.json."
        )),
        "{message}"
    );
    assert_eq!(refused["lastState"]["terminated"]["exitCode"], 1);
    assert_eq!(refused["restartCount"], 1);
    assert_eq!(refused["ready"], false);
    // It is asked again after its back-off, and refused again.
    let again = eventually("a second restart", async || {
        let (_, p) = kube.get("/api/v1/namespaces/default/pods/refused").await;
        let cs = &p["status"]["containerStatuses"][0];
        (cs["restartCount"] == 2).then(|| p.clone())
    })
    .await;
    assert!(!ready(&again));
    let (_, all) = kube
        .call(Method::GET, "/api/v1/namespaces/default/pods", None)
        .await;
    assert!(
        !all.to_string().contains("hf_granted"),
        "no token in any status"
    );
    sim.shutdown().await;
}
