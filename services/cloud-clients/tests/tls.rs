//! The simulated clusters' Kubernetes API serves HTTPS with a CA of each cluster's own, as DOKS
//! does: the kube-rs client made from the kubeconfig or from the credentials the DigitalOcean API
//! hands out reaches it trusting exactly that CA, and kubectl works with that kubeconfig. When
//! kubectl is not installed the test says so loudly and runs everything else.

mod common;

use std::path::PathBuf;

use cloud_clients::digitalocean::ClusterCredentials;
use cloud_clients::{KubeClient, KubeClientOptions, RetryConfig};
use common::*;
use region_sim::Delays;
use serde_json::json;

fn options() -> KubeClientOptions {
    KubeClientOptions {
        retry: RetryConfig::none(),
        ..Default::default()
    }
}

async fn namespaces(kube: &KubeClient) -> Result<Vec<String>, cloud_clients::KubeError> {
    Ok(kube
        .list("v1", "Namespace", None, "")
        .await?
        .iter()
        .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_apis_serve_tls_with_the_clusters_own_ca() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let a = api.cluster_create(&cpu_cluster("tls-a")).await.unwrap();
    let b = api.cluster_create(&cpu_cluster("tls-b")).await.unwrap();
    let creds = api.cluster_credentials(&a.id).await.unwrap();
    let other = api.cluster_credentials(&b.id).await.unwrap();
    assert!(
        creds
            .server
            .strip_prefix("https://")
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|a| a.ip().is_loopback()),
        "{}",
        creds.server
    );
    assert!(!creds.certificate_authority_data.is_empty());
    assert_ne!(
        creds.certificate_authority_data, other.certificate_authority_data,
        "each cluster has a CA of its own"
    );
    let yaml = api.kubeconfig(&a.id).await.unwrap();
    assert!(
        yaml.contains(&format!(
            "certificate-authority-data: {}",
            creds.certificate_authority_data
        )),
        "the kubeconfig carries the same CA"
    );
    assert!(!yaml.contains("insecure-skip-tls-verify"));

    // The real client, from the kubeconfig and from the credentials.
    let from_kubeconfig = KubeClient::from_kubeconfig_yaml_with(&yaml, FIELD_MANAGER, options())
        .await
        .unwrap();
    let from_credentials = KubeClient::from_credentials(&creds, FIELD_MANAGER, options())
        .await
        .unwrap();
    for kube in [&from_kubeconfig, &from_credentials] {
        let names = namespaces(kube).await.expect("reached over TLS");
        assert!(names.contains(&"default".to_string()), "{names:?}");
    }

    // Exactly that CA: another cluster's CA, the system's roots, or plain HTTP get nowhere.
    let plain = creds.server.replacen("https://", "http://", 1);
    let wrong: [(&str, ClusterCredentials); 3] = [
        (
            "another cluster's CA",
            ClusterCredentials {
                certificate_authority_data: other.certificate_authority_data.clone(),
                ..creds.clone()
            },
        ),
        (
            "the system's roots",
            ClusterCredentials {
                certificate_authority_data: String::new(),
                ..creds.clone()
            },
        ),
        (
            "plain HTTP",
            ClusterCredentials {
                server: plain,
                certificate_authority_data: String::new(),
                ..creds.clone()
            },
        ),
    ];
    for (what, c) in wrong {
        let kube = KubeClient::from_credentials(&c, FIELD_MANAGER, options())
            .await
            .unwrap();
        match namespaces(&kube).await {
            Ok(names) => panic!("{what}: reached the API: {names:?}"),
            Err(e) => {
                assert!(e.code().is_none(), "{what}: the server answered: {e}");
                println!("{what}: {e}");
            }
        }
    }

    kubectl(&yaml, &from_credentials).await;
    sim.shutdown().await;
}

/// `kubectl` on the PATH, if any.
fn find_kubectl() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("kubectl"))
        .find(|p| p.is_file())
}

/// kubectl with the kubeconfig DigitalOcean returns: namespaces, describe, custom resources.
async fn kubectl(yaml: &str, kube: &KubeClient) {
    let Some(kubectl) = find_kubectl() else {
        // Straight to the process's stderr: the test harness captures `println!` and
        // `eprintln!` of a passing test, and this must be seen.
        use std::io::Write;
        let banner = "!".repeat(78);
        let _ = writeln!(
            std::io::stderr().lock(),
            "{banner}\nkubectl NOT FOUND on PATH: the kubectl checks of this TLS test DID NOT RUN.\nInstall it (Debian: apt-get install kubernetes-client) to run them.\n{banner}"
        );
        return;
    };
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tls-ns"}}))
        .await
        .unwrap();
    kube.apply(&json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool-a", "namespace": "tls-ns"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "pool-a-epp", "port": {"number": 9002}}
        }
    }))
    .await
    .unwrap();
    let dir = std::env::temp_dir().join(format!("tls-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kubeconfig");
    std::fs::write(&config, yaml).unwrap();
    let run = |args: &[&str]| {
        let mut cmd = tokio::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig")
            .arg(&config)
            .arg("--cache-dir")
            .arg(dir.join("cache"))
            .args(args);
        let shown = args.join(" ");
        async move {
            let out = cmd.output().await.expect("kubectl runs");
            let stdout = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(
                out.status.success(),
                "kubectl {shown}: {}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            stdout
        }
    };
    let names = run(&["get", "namespaces", "-o", "name"]).await;
    for ns in ["namespace/default", "namespace/tls-ns"] {
        assert!(names.lines().any(|l| l == ns), "{ns} in {names}");
    }
    let described = run(&["describe", "namespace", "tls-ns"]).await;
    assert!(
        described.contains("tls-ns") && described.contains("Active"),
        "{described}"
    );
    let pools = run(&["get", "inferencepools", "-n", "tls-ns", "-o", "name"]).await;
    assert!(pools.contains("pool-a"), "{pools}");
    let all = run(&[
        "get",
        "inferencepools.inference.networking.k8s.io",
        "--all-namespaces",
    ])
    .await;
    assert!(all.contains("tls-ns") && all.contains("pool-a"), "{all}");
    let pool = run(&["describe", "inferencepool", "pool-a", "-n", "tls-ns"]).await;
    assert!(pool.contains("pool-a-epp"), "{pool}");
    println!("kubectl ({}) drove the cluster over TLS", kubectl.display());
    let _ = std::fs::remove_dir_all(&dir);
}
