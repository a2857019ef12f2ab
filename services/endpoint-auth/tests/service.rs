//! The service over real HTTP, and its hashes fed by a real kube-rs client from the project's
//! simulated Kubernetes API server.

use std::time::Duration;

use endpoint_auth::{router, HashSource, TokenHashes};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sim_kube::{Cluster, ClusterConfig};
use test_support::until;

const LIMIT: Duration = Duration::from_secs(10);
const GOOD: &str = "di_0123456789abcdefghijABCDEFGHIJ0123456789xyzXYZ";
const OTHER: &str = "di_ZYXzyx9876543210JIHGFEDCBAjihgfedcba9876543210";

fn sha(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Serves `router(hashes)` on 127.0.0.1:0; its base URL.
async fn serve(hashes: HashSource) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(hashes)).await.unwrap() });
    format!("http://{addr}")
}

/// The status of a check as Envoy would send it: `/check` + the original path and method.
async fn check(base: &str, token: Option<&str>) -> reqwest::StatusCode {
    let mut req = reqwest::Client::new().post(format!("{base}/check/v1/chat/completions"));
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    req.send().await.unwrap().status()
}

#[tokio::test]
async fn checks_over_http_allow_a_known_token_and_refuse_in_openai_shape() {
    let hashes = HashSource::fixed(None);
    let base = serve(hashes.clone()).await;
    let http = reqwest::Client::new();

    assert_eq!(
        http.get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        503,
        "not ready before any hashes"
    );
    assert_eq!(
        check(&base, Some(GOOD)).await,
        503,
        "fail closed before any hashes, and not with the client's fault"
    );

    hashes.set(Some(TokenHashes::from_hex([sha(GOOD)])));
    assert_eq!(
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    let allowed = http
        .post(format!("{base}/check/v1/chat/completions"))
        .header("authorization", format!("Bearer {GOOD}"))
        .header("content-length", "0")
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);
    assert_eq!(
        allowed.bytes().await.unwrap().len(),
        0,
        "empty body on allow"
    );

    // Any method, any path under /check, and /check itself.
    for (method, path) in [
        (reqwest::Method::GET, "/check/v1/models"),
        (reqwest::Method::DELETE, "/check/"),
        (reqwest::Method::PUT, "/check"),
    ] {
        let r = http
            .request(method.clone(), format!("{base}{path}"))
            .header("authorization", format!("bearer {GOOD}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{method} {path}");
    }

    let refused = http
        .post(format!("{base}/check/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer");
    assert_eq!(refused.headers()["content-type"], "application/json");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(
        body,
        json!({"error": {
            "message": "Invalid or missing access token.",
            "type": "invalid_request_error",
            "param": null,
            "code": "invalid_api_key",
        }})
    );
    assert_eq!(check(&base, Some(OTHER)).await, 401);

    // Two Authorization headers, one of them good: ambiguous, refused.
    let twice = http
        .post(format!("{base}/check/v1/chat/completions"))
        .header("authorization", format!("Bearer {OTHER}"))
        .header("authorization", format!("Bearer {GOOD}"))
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 401);

    // Not a check: not answered as one.
    let elsewhere = http
        .post(format!("{base}/v1/chat/completions"))
        .header("authorization", format!("Bearer {GOOD}"))
        .send()
        .await
        .unwrap();
    assert_eq!(elsewhere.status(), 404);
}

/// A kube-rs client built from the simulated cluster's own kubeconfig.
async fn client_for(cluster: &Cluster) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(&cluster.kubeconfig_yaml()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

fn tokens_secret(name: &str, hashes: &[(&str, String)]) -> Secret {
    let data: serde_json::Map<String, Value> = hashes
        .iter()
        .map(|(id, hex)| {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(hex);
            (id.to_string(), json!(b64))
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "type": "Opaque",
        "data": data,
    }))
    .unwrap()
}

#[tokio::test]
async fn the_secret_watched_in_kubernetes_grants_and_revokes() {
    let cluster = Cluster::start("auth", ClusterConfig::default())
        .await
        .unwrap();
    let client = client_for(&cluster).await;
    let ns = "di-3f1c0e6a";
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);

    let (hashes, feed) = HashSource::watch_secret(client.clone(), ns, "access-tokens");
    let feed = tokio::spawn(feed);
    let base = serve(hashes.clone()).await;
    let http = reqwest::Client::new();
    let ready = async || {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
    };

    assert_eq!(ready().await, 503, "no hashes read yet");
    assert_eq!(check(&base, Some(GOOD)).await, 503);

    let id_good = "11111111-1111-4111-8111-111111111111";
    let id_other = "22222222-2222-4222-8222-222222222222";
    secrets
        .create(
            &PostParams::default(),
            &tokens_secret(
                "access-tokens",
                // As the worker writes it, but with what a hand edit may leave.
                &[
                    (id_good, format!(" {}\n", sha(GOOD).to_ascii_uppercase())),
                    (id_other, sha(OTHER)),
                ],
            ),
        )
        .await
        .unwrap();
    until(
        LIMIT,
        "the good token is allowed once the Secret exists",
        async || check(&base, Some(GOOD)).await == 200,
    )
    .await;
    assert_eq!(ready().await, 200);
    assert_eq!(check(&base, Some(OTHER)).await, 200);
    assert_eq!(check(&base, None).await, 401);
    assert_eq!(check(&base, Some("di_not-a-token")).await, 401);

    // Revocation: the Secret replaced without the good token's hash.
    let mut without = tokens_secret("access-tokens", &[(id_other, sha(OTHER))]);
    without.metadata.resource_version = secrets
        .get("access-tokens")
        .await
        .unwrap()
        .metadata
        .resource_version;
    secrets
        .replace("access-tokens", &PostParams::default(), &without)
        .await
        .unwrap();
    until(LIMIT, "the revoked token is refused", async || {
        check(&base, Some(GOOD)).await == 401
    })
    .await;
    assert_eq!(check(&base, Some(OTHER)).await, 200);
    assert_eq!(hashes.current().map(|h| h.len()), Some(1));

    // Deleted: nothing to check against: not ready, and every check 503 (never a 200).
    secrets
        .delete("access-tokens", &DeleteParams::default())
        .await
        .unwrap();
    until(LIMIT, "no hashes once the Secret is deleted", async || {
        hashes.current().is_none()
    })
    .await;
    assert_eq!(check(&base, Some(OTHER)).await, 503);
    assert_eq!(ready().await, 503);

    // Created again: read again.
    secrets
        .create(
            &PostParams::default(),
            &tokens_secret("access-tokens", &[(id_good, sha(GOOD))]),
        )
        .await
        .unwrap();
    until(
        LIMIT,
        "the re-created Secret's token is allowed",
        async || check(&base, Some(GOOD)).await == 200,
    )
    .await;
    assert_eq!(check(&base, Some(OTHER)).await, 401);

    feed.abort();
    cluster.shutdown().await;
}

/// A Secret that already exists when the service starts is read by the watcher's first list,
/// and only that Secret of the namespace.
#[tokio::test]
async fn a_secret_present_at_start_is_read_by_the_first_list() {
    let cluster = Cluster::start("auth-list", ClusterConfig::default())
        .await
        .unwrap();
    let client = client_for(&cluster).await;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    secrets
        .create(
            &PostParams::default(),
            &tokens_secret("tokens", &[("a", sha(GOOD))]),
        )
        .await
        .unwrap();
    // Another Secret of the namespace, listed after it (a list is in name order): were it read,
    // it would be what the list leaves in force.
    secrets
        .create(
            &PostParams::default(),
            &tokens_secret("tokens-decoy", &[("b", sha(OTHER))]),
        )
        .await
        .unwrap();
    let (hashes, feed) = HashSource::watch_secret(client, "default", "tokens");
    let feed = tokio::spawn(feed);
    until(LIMIT, "ready from the first list", async || {
        hashes.is_ready()
    })
    .await;
    assert_eq!(hashes.current(), Some(TokenHashes::from_hex([sha(GOOD)])));
    feed.abort();
    cluster.shutdown().await;
}

/// What a subscriber writes, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Every log line of a check, down to TRACE and from every crate (hyper and axum too), is free
/// of the token's text. On the current-thread runtime, so the server's task logs to this
/// thread's subscriber.
#[tokio::test(flavor = "current_thread")]
async fn no_log_line_holds_a_token() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let hashes = HashSource::fixed(Some(TokenHashes::from_hex([sha(GOOD)])));
    let base = serve(hashes).await;
    assert_eq!(check(&base, Some(GOOD)).await, 200);
    assert_eq!(check(&base, Some(OTHER)).await, 401);
    assert_eq!(check(&base, None).await, 401);

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("checked"), "the checks were logged: {logs}");
    for token in [GOOD, OTHER] {
        assert!(!logs.contains(token), "a token in the logs: {logs}");
        assert!(
            !logs.contains(&sha(token)),
            "a token's hash in the logs: {logs}"
        );
    }
}
