//! The DOKS side: kubeconfigs that work, Nodes for node pools, LoadBalancer Services mirrored as
//! DO load balancers, and a data-plane endpoint wired from the cluster's objects.

use std::time::Duration;

use base64::Engine;
use dataplane_sim::data_plane::token_hash;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use region_sim::{Api, ApiFaults, ArmedKind, Delays, FaultConfig, RegionSim, SimConfig};
use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

const TOKEN: &str = "dop_v1_kube_test";
const DI_TOKEN: &str = "di_abcdefghijklmnopqrstuvwxyz0123456789";

pub(crate) async fn start() -> RegionSim {
    let mut cfg = SimConfig::new("atl1", TOKEN);
    cfg.delays = Delays {
        cluster_provision_ms: 100,
        node_provision_ms: 100,
        deletion_ms: 200,
        lb_provision_ms: 150,
        model_load_ms: 100,
        gateway_address_ms: 50,
    };
    RegionSim::start(cfg).await.expect("start")
}

async fn do_call(
    sim: &RegionSim,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = Client::new()
        .request(method, format!("{}{path}", sim.base_url()))
        .bearer_auth(TOKEN);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let s = r.status();
    let t = r.text().await.unwrap();
    (
        s,
        if t.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&t).unwrap_or(Value::String(t))
        },
    )
}

/// An HTTPS client that trusts exactly the CA in `ca_data` (base64 of PEM, as kubeconfigs and
/// credentials carry it), and no other.
fn trusting(ca_data: &str) -> Client {
    let pem = base64::engine::general_purpose::STANDARD
        .decode(ca_data)
        .expect("the CA data is base64");
    Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("the CA is PEM"))
        .build()
        .unwrap()
}

/// A client built from the kubeconfig the DO API hands out.
pub(crate) struct Kube {
    pub(crate) server: String,
    pub(crate) token: String,
    pub(crate) http: Client,
}

impl Kube {
    pub(crate) async fn for_cluster(sim: &RegionSim, id: &str) -> Kube {
        let r = Client::new()
            .get(format!(
                "{}/v2/kubernetes/clusters/{id}/kubeconfig",
                sim.base_url()
            ))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "application/yaml");
        let yaml = r.text().await.unwrap();
        let cfg: Value = serde_saphyr::from_str(&yaml).expect("kubeconfig is YAML");
        assert_eq!(cfg["kind"], "Config");
        assert_eq!(cfg["current-context"], "do-atl1-c1");
        Kube {
            server: cfg["clusters"][0]["cluster"]["server"]
                .as_str()
                .unwrap()
                .to_string(),
            token: cfg["users"][0]["user"]["token"]
                .as_str()
                .unwrap()
                .to_string(),
            http: trusting(
                cfg["clusters"][0]["cluster"]["certificate-authority-data"]
                    .as_str()
                    .expect("the kubeconfig carries the cluster's CA"),
            ),
        }
    }

    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.server))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let s = r.status();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    /// A GET whose answer is not JSON (a pod's metrics through `pods/proxy`).
    pub(crate) async fn get_text(&self, path: &str) -> (StatusCode, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.server))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        let s = r.status();
        (s, r.text().await.unwrap_or_default())
    }

    pub(crate) async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    pub(crate) async fn create(&self, path: &str, body: Value) {
        let (s, v) = self.call(Method::POST, path, Some(body)).await;
        assert!(s.is_success(), "POST {path}: {s} {v}");
    }

    /// Authentication for Gateway `gw` of `ns` as a real cluster runs it: Envoy Gateway's
    /// SecurityPolicy asking an endpoint-auth Deployment, which may watch the Secret holding
    /// the hash of `token` (what the worker renders, by hand).
    pub(crate) async fn authenticate_gateway(&self, ns: &str, gw: &str, token: &str) {
        let core = format!("/api/v1/namespaces/{ns}");
        let rbac = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}");
        self.create(
            &format!("{core}/secrets"),
            json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tokens"}, "type": "Opaque",
            "data": {"tok-1": b64(&token_hash(token))}}),
        )
        .await;
        self.create(
            &format!("{core}/serviceaccounts"),
            json!({
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "auth"}}),
        )
        .await;
        self.create(&format!("{rbac}/roles"), json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "auth"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tokens"],
                       "verbs": ["get", "list", "watch"]}]})).await;
        self.create(&format!("{rbac}/rolebindings"), json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "auth"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "auth"},
            "subjects": [{"kind": "ServiceAccount", "name": "auth", "namespace": ns}]})).await;
        self.create(
            &format!("{core}/services"),
            json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "auth"},
            "spec": {"selector": {"app": "auth"}, "ports": [{"port": 8080, "targetPort": 8080}]}}),
        )
        .await;
        self.create(&format!("/apis/apps/v1/namespaces/{ns}/deployments"), json!({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "auth"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "auth"}},
              "template": {"metadata": {"labels": {"app": "auth"}}, "spec": {"serviceAccountName": "auth",
                "containers": [{"name": "auth", "image": "endpoint-auth", "args": ["--secret", "tokens"]}]}}}})).await;
        self.create(&format!("/apis/gateway.envoyproxy.io/v1alpha1/namespaces/{ns}/securitypolicies"), json!({
            "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "SecurityPolicy", "metadata": {"name": "auth"},
            "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw}],
                     "extAuth": {"http": {"backendRefs": [{"name": "auth", "port": 8080}], "path": "/check"}}}})).await;
        // In force once the policy is accepted and a replica can answer; before, Envoy would
        // admit everyone or fail every check.
        let policy =
            format!("/apis/gateway.envoyproxy.io/v1alpha1/namespaces/{ns}/securitypolicies/auth");
        eventually("the SecurityPolicy accepted", async || {
            let (_, p) = self.get(&policy).await;
            (p.pointer("/status/ancestors/0/conditions/0/status") == Some(&json!("True")))
                .then_some(())
        })
        .await;
        let deployment = format!("/apis/apps/v1/namespaces/{ns}/deployments/auth");
        eventually("an endpoint-auth replica ready", async || {
            let (_, d) = self.get(&deployment).await;
            (d["status"]["readyReplicas"].as_i64() >= Some(1)).then_some(())
        })
        .await;
    }
}

pub(crate) async fn eventually<T>(what: &str, f: impl AsyncFnMut() -> Option<T>) -> T {
    test_support::eventually(Duration::from_millis(7500), what, f).await
}

pub(crate) async fn running_cluster(sim: &RegionSim, pools: Value) -> String {
    let (s, v) = do_call(
        sim,
        Method::POST,
        "/v2/kubernetes/clusters",
        Some(json!({"name": "c1", "region": "atl1", "version": "latest", "node_pools": pools})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["kubernetes_cluster"]["id"].as_str().unwrap().to_string();
    eventually("cluster running", async || {
        let (_, v) = do_call(
            sim,
            Method::GET,
            &format!("/v2/kubernetes/clusters/{id}"),
            None,
        )
        .await;
        (v["kubernetes_cluster"]["status"]["state"] == "running").then_some(())
    })
    .await;
    id
}

/// A running cluster with one CPU node, and a client for its API.
pub(crate) async fn cpu_cluster(sim: &RegionSim) -> (String, Kube) {
    let id = running_cluster(
        sim,
        json!([{"name": "cpu", "size": "s-2vcpu-4gb", "count": 1}]),
    )
    .await;
    let kube = Kube::for_cluster(sim, &id).await;
    (id, kube)
}

fn items(v: &Value) -> Vec<Value> {
    v["items"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn kubeconfig_reaches_the_cluster_api_with_its_token_and_faults() {
    let sim = start().await;
    let (id, kube) = cpu_cluster(&sim).await;
    let (s, v) = kube.get("/version").await;
    assert_eq!(s, 200);
    assert!(v["gitVersion"].as_str().is_some(), "{v}");
    // The cluster's endpoint is the kubeconfig's server.
    let (_, c) = do_call(
        &sim,
        Method::GET,
        &format!("/v2/kubernetes/clusters/{id}"),
        None,
    )
    .await;
    assert_eq!(c["kubernetes_cluster"]["endpoint"], kube.server.as_str());
    // At the API server's own address (its `ipv4`) on the region's shared port, as the
    // certificate the cluster's CA signed says.
    let ipv4 = c["kubernetes_cluster"]["ipv4"].as_str().unwrap();
    assert_eq!(kube.server, format!("https://{ipv4}:{}", sim.front_port()));
    let ip: std::net::Ipv4Addr = ipv4.parse().unwrap();
    assert!(
        ip.is_loopback() && ip != std::net::Ipv4Addr::LOCALHOST,
        "{ip}"
    );
    // The credentials endpoint hands out the same server and a token of its own, which works
    // as well as the kubeconfig's.
    let (s, creds) = do_call(
        &sim,
        Method::GET,
        &format!("/v2/kubernetes/clusters/{id}/credentials"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(creds["server"], kube.server.as_str());
    assert_ne!(creds["token"], kube.token.as_str());
    assert!(creds["expires_at"].is_string());
    let other = Kube {
        server: kube.server.clone(),
        token: creds["token"].as_str().unwrap().to_string(),
        http: trusting(creds["certificate_authority_data"].as_str().unwrap()),
    };
    assert_eq!(other.get("/version").await.0, 200);
    // No token, no access.
    let r = kube
        .http
        .get(format!("{}/version", kube.server))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Kubernetes API faults come back as Kubernetes Status errors.
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let (s, v) = kube.get("/api/v1/nodes").await;
    assert_eq!(s, 500);
    assert_eq!(v["kind"], "Status");
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            rate_limit_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let (s, v) = kube.get("/api/v1/nodes").await;
    assert_eq!(s, 429);
    assert_eq!(v["reason"], "TooManyRequests");
    sim.set_faults(FaultConfig::default());
    assert_eq!(kube.get("/api/v1/nodes").await.0, 200);
    // An unknown cluster has no kubeconfig.
    let (s, v) = do_call(
        &sim,
        Method::GET,
        "/v2/kubernetes/clusters/nope/kubeconfig",
        None,
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(v["id"], "not_found");
    sim.shutdown().await;
}

/// Seconds from now until the RFC 3339 `expires_at` of a credentials response.
fn expires_in(creds: &Value) -> f64 {
    let at = chrono::DateTime::parse_from_rfc3339(creds["expires_at"].as_str().unwrap())
        .expect("expires_at is RFC 3339");
    (at.with_timezone(&chrono::Utc) - chrono::Utc::now()).num_milliseconds() as f64 / 1000.0
}

/// Credentials expire as on DOKS: after `expiry_seconds` when asked, else after the default
/// lifetime (here 1 s instead of 7 days, passed on the simulator's clock); the cluster's API then
/// refuses them with a Kubernetes `Status` 401, exactly like a token it never issued.
#[tokio::test]
async fn cluster_credentials_expire() {
    let mut cfg = SimConfig::new("atl1", TOKEN);
    cfg.delays = Delays::instant();
    cfg.credential_ttl = Duration::from_secs(1);
    let clock = cfg.clock.clone();
    let sim = RegionSim::start(cfg).await.expect("start");
    let (id, short) = cpu_cluster(&sim).await;
    let creds = |expiry: &'static str| {
        let sim = &sim;
        let id = id.clone();
        async move {
            let (s, v) = do_call(
                sim,
                Method::GET,
                &format!("/v2/kubernetes/clusters/{id}/credentials{expiry}"),
                None,
            )
            .await;
            assert_eq!(s, 200, "{v}");
            v
        }
    };
    let default = creds("").await;
    let zero = creds("?expiry_seconds=0").await;
    let long = creds("?expiry_seconds=600").await;
    for (what, c, want) in [
        ("default", &default, 1.0),
        ("0", &zero, 1.0),
        ("600", &long, 600.0),
    ] {
        let left = expires_in(c);
        assert!(
            left > want - 0.5 && left <= want + 0.05,
            "expiry_seconds {what}: expires in {left} s, want {want}"
        );
    }
    let client = |c: &Value| Kube {
        server: c["server"].as_str().unwrap().to_string(),
        token: c["token"].as_str().unwrap().to_string(),
        http: trusting(c["certificate_authority_data"].as_str().unwrap()),
    };
    let (default, long) = (client(&default), client(&long));
    // A kubeconfig asked for with a lifetime of its own.
    let r = Client::new()
        .get(format!(
            "{}/v2/kubernetes/clusters/{id}/kubeconfig?expiry_seconds=600",
            sim.base_url()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let cfg: Value = serde_saphyr::from_str(&r.text().await.unwrap()).unwrap();
    let long_kubeconfig = Kube {
        server: short.server.clone(),
        token: cfg["users"][0]["user"]["token"]
            .as_str()
            .unwrap()
            .to_string(),
        http: short.http.clone(),
    };
    for k in [&short, &default, &long, &long_kubeconfig] {
        assert_eq!(k.get("/api/v1/nodes").await.0, 200);
    }
    // The simulator's clock, moved on past the default lifetime.
    clock.advance(Duration::from_millis(1200));
    for expired in [&short, &default] {
        let (s, v) = expired.get("/api/v1/nodes").await;
        assert_eq!(s, 401, "{v}");
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["reason"], "Unauthorized");
        assert_eq!(v["code"], 401);
    }
    for k in [&long, &long_kubeconfig] {
        assert_eq!(k.get("/api/v1/nodes").await.0, 200);
    }
    let unknown = Kube {
        token: "not-a-token-it-issued".into(),
        ..client(&creds("?expiry_seconds=600").await)
    };
    assert_eq!(unknown.get("/api/v1/nodes").await.0, 401);
    // A lifetime that is not a non-negative integer is a bad request.
    for bad in ["-1", "soon"] {
        for what in ["credentials", "kubeconfig"] {
            let (s, v) = do_call(
                &sim,
                Method::GET,
                &format!("/v2/kubernetes/clusters/{id}/{what}?expiry_seconds={bad}"),
                None,
            )
            .await;
            assert_eq!(s, 400, "{what} {bad}: {v}");
            assert_eq!(v["id"], "bad_request");
        }
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn an_armed_fault_on_the_kube_api_refuses_or_loses_a_write() {
    let sim = start().await;
    let (_, kube) = cpu_cluster(&sim).await;
    let do_calls = sim.calls(Api::Do);
    let namespace =
        |name: &str| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});

    sim.arm_fault(Api::Kube, 0, ArmedKind::Refuse).unwrap();
    let (s, v) = kube
        .call(
            Method::POST,
            "/api/v1/namespaces",
            Some(namespace("refused")),
        )
        .await;
    assert_eq!(s, 500);
    assert_eq!(v["kind"], "Status");
    assert_eq!(kube.get("/api/v1/namespaces/refused").await.0, 404);

    sim.arm_fault(Api::Kube, 0, ArmedKind::LoseResponse)
        .unwrap();
    let (s, v) = kube
        .call(Method::POST, "/api/v1/namespaces", Some(namespace("lost")))
        .await;
    assert_eq!(s, 504);
    assert_eq!(v["reason"], "Timeout");
    assert_eq!(
        kube.get("/api/v1/namespaces/lost").await.0,
        200,
        "lost: created"
    );
    let (s, _) = kube
        .call(Method::POST, "/api/v1/namespaces", Some(namespace("lost")))
        .await;
    assert_eq!(s, 409, "sent again: it exists");

    assert_eq!(sim.calls(Api::Kube), 5);
    assert_eq!(sim.calls(Api::Do), do_calls, "the APIs are counted apart");
    let fired: Vec<(u64, String)> = sim
        .fired_faults()
        .into_iter()
        .map(|f| (f.fault.call, f.request))
        .collect();
    assert_eq!(
        fired,
        [
            (0, "POST namespaces".to_string()),
            (2, "POST namespaces".to_string())
        ]
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn node_pools_become_labelled_tainted_nodes() {
    let sim = start().await;
    let id = running_cluster(
        &sim,
        json!([
            {"name": "cpu", "size": "s-2vcpu-4gb", "count": 1},
            {"name": "amd", "size": "gpu-mi300x1-192gb", "count": 2, "labels": {"di.do/id": "d1"},
             "taints": [{"key": "di.do/id", "value": "d1", "effect": "NoSchedule"}]}
        ]),
    )
    .await;
    let kube = Kube::for_cluster(&sim, &id).await;
    let gpu_nodes = async || {
        let (_, v) = kube
            .get("/api/v1/nodes?labelSelector=doks.digitalocean.com%2Fnode-pool%3Damd")
            .await;
        items(&v)
    };
    let nodes = eventually("2 GPU nodes", async || {
        let n = gpu_nodes().await;
        (n.len() == 2).then_some(n)
    })
    .await;
    let n = &nodes[0];
    let labels = &n["metadata"]["labels"];
    assert!(n["metadata"]["name"].as_str().unwrap().starts_with("amd-"));
    assert_eq!(labels["doks.digitalocean.com/gpu-brand"], "amd");
    assert_eq!(
        labels["node.kubernetes.io/instance-type"],
        "gpu-mi300x1-192gb"
    );
    assert_eq!(labels["di.do/id"], "d1");
    assert!(labels["doks.digitalocean.com/node-pool-id"].is_string());
    assert_eq!(n["status"]["allocatable"]["amd.com/gpu"], "1");
    let taints: Vec<&str> = n["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["key"].as_str().unwrap())
        .collect();
    assert!(
        taints.contains(&"amd.com/gpu") && taints.contains(&"di.do/id"),
        "{taints:?}"
    );
    let ready = n["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    assert!(ready);
    // The CPU node carries no GPU taint.
    let (_, v) = kube
        .get("/api/v1/nodes?labelSelector=doks.digitalocean.com%2Fnode-pool%3Dcpu")
        .await;
    assert!(items(&v)[0]["spec"]["taints"]
        .as_array()
        .is_none_or(|t| t.is_empty()));

    // Scale down removes a Node.
    let (_, pools) = do_call(
        &sim,
        Method::GET,
        &format!("/v2/kubernetes/clusters/{id}/node_pools"),
        None,
    )
    .await;
    let amd = pools["node_pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "amd")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (s, _) = do_call(
        &sim,
        Method::PUT,
        &format!("/v2/kubernetes/clusters/{id}/node_pools/{amd}"),
        Some(json!({"name": "amd", "count": 1})),
    )
    .await;
    assert_eq!(s, 202);
    let left = eventually("1 GPU node", async || {
        let n = gpu_nodes().await;
        (n.len() == 1).then_some(n)
    })
    .await;
    // Killing it: NotReady at once, then replaced by a new node.
    let victim = left[0]["metadata"]["name"].as_str().unwrap().to_string();
    let r = Client::new()
        .post(format!("{}/_sim/nodes/{victim}/kill", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let (_, node) = kube.get(&format!("/api/v1/nodes/{victim}")).await;
    let ready = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap();
    assert_ne!(ready["status"], "True", "{node}");
    let replacement = eventually("replacement node", async || {
        let n = gpu_nodes().await;
        (n.len() == 1 && n[0]["metadata"]["name"] != victim.as_str()).then_some(n)
    })
    .await;
    assert_eq!(
        replacement[0]["metadata"]["labels"]["doks.digitalocean.com/gpu-brand"],
        "amd"
    );

    // Deleting the pool removes its nodes.
    let (s, _) = do_call(
        &sim,
        Method::DELETE,
        &format!("/v2/kubernetes/clusters/{id}/node_pools/{amd}"),
        None,
    )
    .await;
    assert_eq!(s, 204);
    eventually("no GPU nodes", async || {
        gpu_nodes().await.is_empty().then_some(())
    })
    .await;
    sim.shutdown().await;
}

/// A CA and a certificate for `host` it signed, as PEM: (ca, cert, key).
pub(crate) fn pki(host: &str) -> (String, String, String) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "di-ca");
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf = CertificateParams::new(vec![host.to_string()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &ca_cert, &ca_key).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

pub(crate) fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[tokio::test]
async fn load_balancer_services_are_mirrored_and_serve_the_model() {
    let sim = start().await;
    let id = running_cluster(
        &sim,
        json!([
            {"name": "cpu", "size": "s-2vcpu-4gb", "count": 1},
            {"name": "gpu", "size": "gpu-h100x1-80gb", "count": 1}
        ]),
    )
    .await;
    let kube = Kube::for_cluster(&sim, &id).await;
    eventually("gpu node", async || {
        let (_, v) = kube.get("/api/v1/nodes").await;
        (items(&v).len() == 2).then_some(())
    })
    .await;
    // The load balancer's address is not known yet: a certificate for 127.0.0.1 to begin with,
    // as the worker issues one before the address shows.
    let (first_ca, cert, key) = pki("127.0.0.1");
    let ns = "di-1";
    kube.create(
        "/api/v1/namespaces",
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
    )
    .await;
    let core = format!("/api/v1/namespaces/{ns}");
    kube.create(&format!("{core}/secrets"), json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "endpoint-tls"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64(&cert), "tls.key": b64(&key)}})).await;
    kube.create(&format!("/apis/apps/v1/namespaces/{ns}/deployments"), json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "vllm"}},
          "template": {"metadata": {"labels": {"app": "vllm"}}, "spec": {
            "nodeSelector": {"doks.digitalocean.com/node-pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai",
              "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3.1-8b"],
              "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})).await;
    kube.create(&format!("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"), json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "pool"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}})).await;
    kube.create(&format!("/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/gateways"), json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": "gw"},
        "spec": {"gatewayClassName": "istio", "listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
          "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "endpoint-tls"}]}}]}})).await;
    kube.create(&format!("/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes"), json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "route"},
        "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
          "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"}]}]}})).await;
    kube.create(&format!("{core}/services"), json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "private", "annotations": {
            "service.beta.kubernetes.io/do-loadbalancer-type": "REGIONAL_NETWORK",
            "service.beta.kubernetes.io/do-loadbalancer-network": "INTERNAL"}},
        "spec": {"type": "LoadBalancer", "selector": {"gateway.networking.k8s.io/gateway-name": "gw"},
                 "ports": [{"name": "https", "port": 443, "targetPort": 443, "protocol": "TCP"}]}})).await;
    kube.authenticate_gateway(ns, "gw", DI_TOKEN).await;

    // The DO API shows a load balancer for the Service: new, then active with an address.
    let lb = eventually("active load balancer", async || {
        let (_, v) = do_call(&sim, Method::GET, "/v2/load_balancers", None).await;
        let lbs = v["load_balancers"].as_array().cloned().unwrap_or_default();
        (lbs.len() == 1 && lbs[0]["status"] == "active").then(|| lbs[0].clone())
    })
    .await;
    assert_eq!(lb["network"], "INTERNAL");
    assert_eq!(lb["type"], "REGIONAL_NETWORK");
    // An address of its own, from the loopback block.
    let ip: std::net::Ipv4Addr = lb["ip"].as_str().unwrap().parse().unwrap();
    assert!(
        ip.is_loopback() && ip != std::net::Ipv4Addr::LOCALHOST,
        "{ip}"
    );
    assert_eq!(lb["region"]["slug"], "atl1");
    assert_eq!(lb["forwarding_rules"][0]["entry_port"], 443);
    let (s, one) = do_call(
        &sim,
        Method::GET,
        &format!("/v2/load_balancers/{}", lb["id"].as_str().unwrap()),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(one["load_balancer"]["id"], lb["id"]);

    // The Service gets its ingress: the load balancer's address and the region's shared port.
    let port = eventually("service ingress", async || {
        let (_, svc) = kube.get(&format!("{core}/services/private")).await;
        let ing = svc.pointer("/status/loadBalancer/ingress/0").cloned()?;
        (ing["ip"] == ip.to_string()).then_some(())?;
        ing.pointer("/ports/0/port").and_then(Value::as_u64)
    })
    .await;
    assert_eq!(port, u64::from(sim.front_port()));
    let trusting_pem = |ca: &str| {
        Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
            .build()
            .unwrap()
    };
    let url = format!("https://{ip}:{port}/v1/models");
    // A certificate that does not name the address does not verify...
    let err = trusting_pem(&first_ca)
        .get(&url)
        .bearer_auth(DI_TOKEN)
        .send()
        .await
        .expect_err("a certificate for 127.0.0.1 does not verify at the load balancer's address");
    assert!(
        format!("{err:?}").to_lowercase().contains("certificate"),
        "{err:?}"
    );
    // ... so the gateway's Secret gets one for the address, as the worker reissues it.
    let (ca, cert, key) = pki(&ip.to_string());
    let (s, v) = kube
        .call(
            Method::PUT,
            &format!("{core}/secrets/endpoint-tls"),
            Some(json!({
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "endpoint-tls"},
                "type": "kubernetes.io/tls", "data": {"tls.crt": b64(&cert), "tls.key": b64(&key)}})),
        )
        .await;
    assert!(s.is_success(), "{s} {v}");
    let https = trusting_pem(&ca);
    // Once the model server pod is ready, the endpoint serves its model.
    let models = eventually("model served", async || {
        let r = https.get(&url).bearer_auth(DI_TOKEN).send().await.ok()?;
        if r.status() != 200 {
            return None;
        }
        r.json::<Value>().await.ok()
    })
    .await;
    assert_eq!(models["data"][0]["id"], "llama-3.1-8b");
    let r = https
        .get(&url)
        .bearer_auth("di_wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = https
        .post(format!("https://{ip}:{port}/v1/chat/completions"))
        .bearer_auth(DI_TOKEN)
        .json(&json!({"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let pod = r.headers()["x-sim-backend"].to_str().unwrap().to_string();
    assert!(pod.starts_with("vllm-"), "{pod}");
    let inv = sim.inventory();
    assert_eq!(inv.endpoints.len(), 1);
    assert!(
        inv.endpoints[0].problems.is_empty(),
        "{:?}",
        inv.endpoints[0].problems
    );
    assert!(!inv.kube_objects("InferencePool").is_empty());

    // Removing the route: 404 at the same address.
    let (s, _) = kube
        .call(
            Method::DELETE,
            &format!("/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes/route"),
            None,
        )
        .await;
    assert!(s.is_success());
    eventually("404 without a route", async || {
        let r = https.get(&url).bearer_auth(DI_TOKEN).send().await.ok()?;
        (r.status() == 404).then_some(())
    })
    .await;

    // Deleting the Service removes the load balancer and closes the endpoint.
    let (s, _) = kube
        .call(Method::DELETE, &format!("{core}/services/private"), None)
        .await;
    assert!(s.is_success());
    eventually("load balancer gone", async || {
        let (_, v) = do_call(&sim, Method::GET, "/v2/load_balancers", None).await;
        (v["meta"]["total"] == 0).then_some(())
    })
    .await;
    eventually("endpoint closed", async || {
        https.get(&url).send().await.is_err().then_some(())
    })
    .await;

    // Deleting the cluster leaves nothing behind, Kubernetes objects included.
    let (s, _) = do_call(
        &sim,
        Method::DELETE,
        &format!("/v2/kubernetes/clusters/{id}"),
        None,
    )
    .await;
    assert_eq!(s, 204);
    eventually("cluster gone", async || {
        sim.inventory().leftovers().is_empty().then_some(())
    })
    .await;
    assert!(sim.inventory().kubernetes.is_empty());
    assert!(kube
        .http
        .get(format!("{}/version", kube.server))
        .bearer_auth(&kube.token)
        .send()
        .await
        .is_err());
    sim.shutdown().await;
}

#[tokio::test]
async fn kubernetes_and_do_calls_are_counted_by_kind() {
    let sim = start().await;
    let (id, kube) = cpu_cluster(&sim).await;
    sim.reset_stats();
    assert_eq!(sim.kube_mutations(), 0);

    // Reads.
    assert_eq!(kube.get("/version").await.0, 200);
    assert_eq!(kube.get("/api/v1/namespaces").await.0, 200);
    // Writes: a create, a server-side apply, a delete.
    kube.create(
        "/api/v1/namespaces",
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "counted"}}),
    )
    .await;
    assert_eq!(kube.get("/api/v1/namespaces/counted").await.0, 200);
    let applied = kube
        .http
        .patch(format!(
            "{}/api/v1/namespaces/counted/configmaps/c?fieldManager=bench&force=true",
            kube.server
        ))
        .bearer_auth(&kube.token)
        .header("content-type", "application/apply-patch+yaml")
        .body(
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "c", "namespace": "counted"}, "data": {"k": "v"}})
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert!(applied.status().is_success(), "{}", applied.status());
    let (s, _) = kube
        .call(
            Method::DELETE,
            "/api/v1/namespaces/counted/configmaps/c",
            None,
        )
        .await;
    assert!(s.is_success(), "{s}");
    // Not authenticated: not a call.
    let r = kube
        .http
        .delete(format!("{}/api/v1/namespaces/counted", kube.server))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Faulted: still a call the client made.
    sim.set_faults(FaultConfig {
        kube: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let (s, _) = kube
        .call(
            Method::PUT,
            "/apis/apps/v1/namespaces/counted/deployments/d/status",
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 500);
    sim.set_faults(FaultConfig::default());
    // One DO read and one DO write (a VPC create).
    let (s, _) = do_call(
        &sim,
        Method::GET,
        &format!("/v2/kubernetes/clusters/{id}"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = do_call(
        &sim,
        Method::POST,
        "/v2/vpcs",
        Some(json!({"name": "counted", "region": "atl1"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);

    assert_eq!(sim.kube_mutations(), 4);
    assert_eq!(sim.do_mutations(), 1);
    let stats: Value = Client::new()
        .get(format!("{}/_sim/stats", sim.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["kube_mutations"], 4);
    assert_eq!(stats["do_mutations"], 1);
    assert_eq!(
        stats["requests"]["kube"],
        json!({
            "GET /version": 1,
            "LIST namespaces": 1,
            "POST namespaces": 1,
            "GET namespaces": 1,
            "PATCH configmaps (apply)": 1,
            "DELETE configmaps": 1,
            "PUT deployments/status": 1,
        })
    );
    assert_eq!(
        stats["requests"]["do"],
        json!({"GET /v2/kubernetes/clusters/{id}": 1, "POST /v2/vpcs": 1})
    );
    assert_eq!(stats["data_plane_requests"], 0);
    sim.reset_stats();
    assert_eq!(sim.kube_mutations(), 0);
    assert!(sim.stats().requests.is_empty());
    sim.shutdown().await;
}

#[test]
fn call_kinds_name_the_resource_not_the_object() {
    use region_sim::{do_kind, kube_kind};
    let m = |s: &str| Method::from_bytes(s.as_bytes()).unwrap();
    assert_eq!(
        kube_kind(
            &m("GET"),
            "/apis/apps/v1/namespaces/di-1/deployments",
            "watch=true&resourceVersion=5",
            ""
        ),
        "WATCH deployments"
    );
    assert_eq!(
        kube_kind(
            &m("GET"),
            "/apis/apps/v1/namespaces/di-1/deployments",
            "labelSelector=a%3Db",
            ""
        ),
        "LIST deployments"
    );
    assert_eq!(
        kube_kind(
            &m("PATCH"),
            "/api/v1/namespaces/di-1/services/s/status",
            "",
            "application/merge-patch+json"
        ),
        "PATCH services/status (merge)"
    );
    assert_eq!(
        kube_kind(&m("DELETE"), "/api/v1/namespaces/di-1", "", ""),
        "DELETE namespaces"
    );
    assert_eq!(
        kube_kind(&m("GET"), "/api/v1/nodes/n-1", "", ""),
        "GET nodes"
    );
    assert_eq!(
        do_kind(
            &m("PUT"),
            "/v2/kubernetes/clusters/7e5c619c-359c-44ca-87e2-47e98170c012/node_pools/12345"
        ),
        "PUT /v2/kubernetes/clusters/{id}/node_pools/{id}"
    );
}

/// With a long idle interval a settled cluster is not re-derived on a timer, yet a new
/// LoadBalancer Service (a change) still gets its address as its load balancer turns active.
#[tokio::test]
async fn a_settled_cluster_idles_but_still_sees_changes() {
    let mut cfg = SimConfig::new("atl1", TOKEN);
    cfg.delays = Delays {
        cluster_provision_ms: 100,
        node_provision_ms: 100,
        deletion_ms: 200,
        lb_provision_ms: 150,
        model_load_ms: 100,
        gateway_address_ms: 50,
    };
    cfg.cloud_controller_idle_ms = 600_000;
    let sim = RegionSim::start(cfg).await.expect("start");
    let (_, kube) = cpu_cluster(&sim).await;
    let service = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"type": "LoadBalancer", "selector": {"gateway.networking.k8s.io/gateway-name": "gw"},
                        "ports": [{"name": "https", "port": 443, "protocol": "TCP"}]}})
    };
    let ingress = |name: &'static str| {
        let kube = &kube;
        async move {
            eventually("service ingress", async || {
                let (_, svc) = kube
                    .get(&format!("/api/v1/namespaces/default/services/{name}"))
                    .await;
                svc.pointer("/status/loadBalancer/ingress/0/ports/0/port")
                    .and_then(Value::as_u64)
            })
            .await
        }
    };
    kube.create("/api/v1/namespaces/default/services", service("first"))
        .await;
    ingress("first").await;
    // Settled now; the next Service is noticed through the change, then polled until active.
    // Real time, as a window: long enough for the cloud controller to go idle, which is the
    // state under test, and nothing outside it says when it has.
    tokio::time::sleep(Duration::from_millis(300)).await;
    kube.create("/api/v1/namespaces/default/services", service("second"))
        .await;
    ingress("second").await;
    sim.shutdown().await;
}
