//! The DigitalOcean API subset, driven over HTTP the way the control plane's workers drive it.
//! Field lists come from DigitalOcean's public OpenAPI document (cluster, kubernetes_node_pool,
//! node, vpc, load_balancer, error schemas).

use std::time::Duration;

use region_sim::{Api, ApiFaults, ArmedKind, Delays, FaultConfig, RegionSim, SimConfig};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

const TOKEN: &str = "dop_v1_test_token";

fn fast_delays() -> Delays {
    Delays {
        cluster_provision_ms: 300,
        node_provision_ms: 200,
        deletion_ms: 300,
        lb_provision_ms: 100,
        model_load_ms: 100,
        gateway_address_ms: 50,
    }
}

async fn start() -> RegionSim {
    let mut cfg = SimConfig::new("atl1", TOKEN);
    cfg.delays = fast_delays();
    RegionSim::start(cfg).await.expect("start simulator")
}

struct Do {
    base: String,
    http: Client,
    /// The customer account the platform's token acts for, if any.
    account: Option<String>,
}

impl Do {
    fn new(sim: &RegionSim) -> Self {
        Self {
            base: sim.base_url(),
            http: Client::new(),
            account: None,
        }
    }

    fn acting_for(sim: &RegionSim, account: &str) -> Self {
        Self {
            account: Some(account.to_string()),
            ..Self::new(sim)
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(TOKEN);
        if let Some(account) = &self.account {
            req = req.header("x-acting-account", account);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("send");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, v)
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }
    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }
    async fn put(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::PUT, path, Some(body)).await
    }
    async fn delete(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    /// Polls `path` until `pred` holds on a 200 body (or, with `gone`, until it is 404).
    async fn wait(&self, path: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        test_support::eventually(
            Duration::from_secs(5),
            format!("{what} on {path}"),
            async || {
                let (s, v) = self.get(path).await;
                (s == StatusCode::OK && pred(&v)).then_some(v)
            },
        )
        .await
    }

    async fn wait_gone(&self, path: &str) {
        test_support::until(Duration::from_secs(5), format!("{path} gone"), async || {
            self.get(path).await.0 == StatusCode::NOT_FOUND
        })
        .await
    }
}

fn assert_keys(v: &Value, keys: &[&str], what: &str) {
    for k in keys {
        assert!(v.get(k).is_some(), "{what} lacks `{k}`: {v}");
    }
}

fn assert_error(v: &Value, id: &str) {
    assert_eq!(v["id"], id, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["request_id"].as_str().is_some(), "{v}");
}

const CLUSTER_KEYS: &[&str] = &[
    "id",
    "name",
    "region",
    "version",
    "cluster_subnet",
    "service_subnet",
    "vpc_uuid",
    "ipv4",
    "endpoint",
    "tags",
    "node_pools",
    "maintenance_policy",
    "auto_upgrade",
    "status",
    "created_at",
    "updated_at",
    "surge_upgrade",
    "registry_enabled",
    "ha",
];
const POOL_KEYS: &[&str] = &[
    "id",
    "name",
    "size",
    "count",
    "tags",
    "labels",
    "taints",
    "auto_scale",
    "min_nodes",
    "max_nodes",
    "nodes",
];
const NODE_KEYS: &[&str] = &[
    "id",
    "name",
    "status",
    "droplet_id",
    "created_at",
    "updated_at",
];

fn cluster_body(name: &str, pools: Value) -> Value {
    json!({"name": name, "region": "atl1", "version": "latest", "node_pools": pools})
}

#[tokio::test]
async fn unauthenticated_calls_get_401_in_do_error_shape() {
    let sim = start().await;
    let http = Client::new();
    let url = format!("{}/v2/vpcs", sim.base_url());
    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(r.headers().contains_key("x-request-id"));
    assert!(r.headers().contains_key("ratelimit-limit"));
    assert_error(&r.json::<Value>().await.unwrap(), "unauthorized");
    let r = http.get(&url).bearer_auth("wrong").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = http
        .post(format!("{}/v2/kubernetes/clusters", sim.base_url()))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        sim.do_mutations(),
        0,
        "unauthenticated calls are not counted"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn vpcs_create_get_list_with_pagination() {
    let sim = start().await;
    let api = Do::new(&sim);
    let mut ids = Vec::new();
    for i in 0..3 {
        let (s, v) = api
            .post(
                "/v2/vpcs",
                json!({"name": format!("vpc-{i}"), "region": "atl1", "description": "d"}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let vpc = &v["vpc"];
        assert_keys(
            vpc,
            &[
                "id",
                "urn",
                "name",
                "description",
                "region",
                "ip_range",
                "default",
                "created_at",
            ],
            "vpc",
        );
        assert_eq!(
            vpc["urn"],
            format!("do:vpc:{}", vpc["id"].as_str().unwrap())
        );
        assert_eq!(vpc["default"], false);
        ids.push(vpc["id"].as_str().unwrap().to_string());
    }
    // The region's default VPC plus ours.
    let (s, v) = api.get("/v2/vpcs?per_page=2").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["meta"]["total"], 4);
    assert_eq!(v["vpcs"].as_array().unwrap().len(), 2);
    assert!(v["links"]["pages"]["next"]
        .as_str()
        .unwrap()
        .contains("page=2"));
    assert!(v["links"]["pages"]["last"]
        .as_str()
        .unwrap()
        .contains("page=2"));
    assert!(v["links"]["pages"].get("prev").is_none());
    let (_, v2) = api.get("/v2/vpcs?per_page=2&page=2").await;
    assert_eq!(v2["vpcs"].as_array().unwrap().len(), 2);
    assert!(v2["links"]["pages"]["prev"]
        .as_str()
        .unwrap()
        .contains("page=1"));
    assert!(v2["links"]["pages"].get("next").is_none());
    let (_, all) = api.get("/v2/vpcs").await;
    assert_eq!(
        all["vpcs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["default"] == true)
            .count(),
        1
    );

    let (s, v) = api.get(&format!("/v2/vpcs/{}", ids[1])).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["vpc"]["name"], "vpc-1");
    let (s, v) = api
        .get("/v2/vpcs/00000000-0000-0000-0000-000000000000")
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found");

    // Malformed JSON is a 400, a wrong region a 422, both in the DO error shape.
    let r = api
        .http
        .post(format!("{}/v2/vpcs", api.base))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_error(&r.json().await.unwrap(), "bad_request");
    let (s, v) = api
        .post("/v2/vpcs", json!({"name": "x", "region": "nyc2"}))
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_error(&v, "unprocessable_entity");
    sim.shutdown().await;
}

/// VPCs belong to accounts. Acting for an account, the platform's token sees only that account's
/// VPCs, its default one made on first use (the same id every time); other accounts' VPCs are
/// not found, to read or to delete. Without an account it sees every VPC.
#[tokio::test]
async fn vpcs_belong_to_accounts_each_with_a_default_vpc() {
    let sim = start().await;
    let (a, b) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let (as_a, as_b, platform) = (
        Do::acting_for(&sim, &a),
        Do::acting_for(&sim, &b),
        Do::new(&sim),
    );

    let default_of = |v: &Value| -> String {
        let defaults: Vec<&Value> = v["vpcs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["default"] == true)
            .collect();
        assert_eq!(defaults.len(), 1, "one default VPC: {v}");
        defaults[0]["id"].as_str().unwrap().to_string()
    };
    let (s, listed_a) = as_a.get("/v2/vpcs").await;
    assert_eq!(s, StatusCode::OK);
    let default_a = default_of(&listed_a);
    assert_eq!(
        default_of(&as_a.get("/v2/vpcs").await.1),
        default_a,
        "stable"
    );
    let default_b = default_of(&as_b.get("/v2/vpcs").await.1);
    assert_ne!(default_a, default_b);

    // A's own VPC, with a name B may use too.
    let (s, made) = as_a
        .post("/v2/vpcs", json!({"name": "net", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{made}");
    let a_net = made["vpc"]["id"].as_str().unwrap().to_string();
    let (s, _) = as_b
        .post("/v2/vpcs", json!({"name": "net", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "names are per account");
    let (s, v) = as_a
        .post("/v2/vpcs", json!({"name": "net", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");

    // B cannot see, read or delete A's VPCs; A and the platform can.
    let ids = |v: &Value| -> Vec<String> {
        v["vpcs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect()
    };
    let listed_b = ids(&as_b.get("/v2/vpcs").await.1);
    assert!(
        !listed_b.contains(&a_net) && !listed_b.contains(&default_a),
        "{listed_b:?}"
    );
    for id in [&a_net, &default_a] {
        let (s, v) = as_b.get(&format!("/v2/vpcs/{id}")).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_error(&v, "not_found");
        assert_eq!(as_a.get(&format!("/v2/vpcs/{id}")).await.0, StatusCode::OK);
        assert_eq!(
            platform.get(&format!("/v2/vpcs/{id}")).await.0,
            StatusCode::OK
        );
    }
    assert_eq!(
        as_b.delete(&format!("/v2/vpcs/{a_net}")).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        as_a.delete(&format!("/v2/vpcs/{a_net}")).await.0,
        StatusCode::NO_CONTENT
    );
    let all = ids(&platform.get("/v2/vpcs?per_page=200").await.1);
    assert!(
        all.contains(&default_a) && all.contains(&default_b),
        "{all:?}"
    );

    // A malformed account is a 400.
    let (s, v) = Do::acting_for(&sim, "not-a-uuid").get("/v2/vpcs").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "bad_request");
    // Accounts' default VPCs are not leftovers.
    assert!(sim
        .inventory()
        .leftovers()
        .iter()
        .all(|l| !l.contains(&default_a)));
    sim.shutdown().await;
}

#[tokio::test]
async fn cluster_provisions_then_node_pools_scale_and_delete() {
    let sim = start().await;
    let api = Do::new(&sim);
    let (_, vpc) = api
        .post("/v2/vpcs", json!({"name": "di-vpc", "region": "atl1"}))
        .await;
    let vpc_id = vpc["vpc"]["id"].as_str().unwrap().to_string();
    let mut body = cluster_body(
        "di-cluster",
        json!([{"name": "cpu", "size": "s-2vcpu-4gb", "count": 2, "tags": ["di"]}]),
    );
    body["vpc_uuid"] = json!(vpc_id);
    let (s, v) = api.post("/v2/kubernetes/clusters", body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let c = &v["kubernetes_cluster"];
    assert_keys(c, CLUSTER_KEYS, "cluster");
    assert_eq!(c["status"]["state"], "provisioning");
    assert_eq!(c["vpc_uuid"], vpc_id.as_str());
    assert_eq!(c["endpoint"], "");
    let id = c["id"].as_str().unwrap().to_string();
    assert!(c["tags"]
        .as_array()
        .unwrap()
        .contains(&json!(format!("k8s:{id}"))));
    let pool = &c["node_pools"][0];
    assert_keys(pool, POOL_KEYS, "node pool");
    assert_eq!(pool["nodes"].as_array().unwrap().len(), 2);
    assert_keys(&pool["nodes"][0], NODE_KEYS, "node");
    assert_eq!(pool["nodes"][0]["status"]["state"], "provisioning");

    let path = format!("/v2/kubernetes/clusters/{id}");
    let running = api
        .wait(&path, "running", |v| {
            v["kubernetes_cluster"]["status"]["state"] == "running"
        })
        .await;
    assert_ne!(running["kubernetes_cluster"]["endpoint"], "");
    api.wait(&path, "nodes running", |v| {
        v["kubernetes_cluster"]["node_pools"][0]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["status"]["state"] == "running")
    })
    .await;
    let (s, list) = api.get("/v2/kubernetes/clusters").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["meta"]["total"], 1);
    assert_eq!(list["kubernetes_clusters"][0]["id"], id.as_str());

    // A GPU pool with labels, taints and autoscaling.
    let pools = format!("{path}/node_pools");
    let (s, v) = api
        .post(
            &pools,
            json!({
                "name": "gpu-h100", "size": "gpu-h100x1-80gb", "count": 1,
                "labels": {"di.do/deployment": "abc"},
                "taints": [{"key": "di", "value": "abc", "effect": "NoSchedule"}],
                "auto_scale": true, "min_nodes": 0, "max_nodes": 3
            }),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let gp = &v["node_pool"];
    assert_keys(gp, POOL_KEYS, "node pool");
    assert_eq!(gp["labels"]["di.do/deployment"], "abc");
    assert_eq!(gp["taints"][0]["effect"], "NoSchedule");
    assert_eq!(
        (gp["auto_scale"].as_bool(), gp["max_nodes"].as_u64()),
        (Some(true), Some(3))
    );
    let gp_id = gp["id"].as_str().unwrap().to_string();
    let gp_path = format!("{pools}/{gp_id}");
    let (s, v) = api.get(&pools).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["node_pools"].as_array().unwrap().len(), 2);
    // Duplicate names are refused.
    let (s, _) = api
        .post(
            &pools,
            json!({"name": "gpu-h100", "size": "s-1vcpu-2gb", "count": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);

    // Scale up: 202 with the new count, extra node provisioning then running.
    let (s, v) = api.put(&gp_path, json!({"name": "gpu-h100", "count": 3, "auto_scale": true, "min_nodes": 0, "max_nodes": 3})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["node_pool"]["count"], 3);
    assert_eq!(v["node_pool"]["nodes"].as_array().unwrap().len(), 3);
    api.wait(&gp_path, "3 running nodes", |v| {
        let nodes = v["node_pool"]["nodes"].as_array().unwrap();
        nodes.len() == 3 && nodes.iter().all(|n| n["status"]["state"] == "running")
    })
    .await;
    // Scale down: surplus nodes go through `deleting`, then disappear.
    let (s, v) = api
        .put(&gp_path, json!({"name": "gpu-h100", "count": 1}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(v["node_pool"]["auto_scale"], false);
    assert_eq!(v["node_pool"]["min_nodes"], 0);
    let states: Vec<Value> = v["node_pool"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["status"]["state"].clone())
        .collect();
    assert_eq!(
        states.iter().filter(|s| **s == "deleting").count(),
        2,
        "{states:?}"
    );
    api.wait(&gp_path, "1 node", |v| {
        v["node_pool"]["nodes"].as_array().unwrap().len() == 1
    })
    .await;

    // Pool deletion: 204, then the pool is gone.
    let (s, v) = api.delete(&gp_path).await;
    assert_eq!((s, v), (StatusCode::NO_CONTENT, Value::Null));
    api.wait_gone(&gp_path).await;

    // Cluster deletion: 204, `deleting`, then 404 and gone from the list and the inventory.
    let (s, _) = api.delete(&path).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v) = api.get(&path).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["kubernetes_cluster"]["status"]["state"], "deleting");
    api.wait_gone(&path).await;
    let (_, list) = api.get("/v2/kubernetes/clusters").await;
    assert_eq!(list["meta"]["total"], 0);
    let inv = sim.inventory();
    let left = inv.leftovers();
    assert_eq!(left, vec![format!("vpc \"di-vpc\" (\"{vpc_id}\")")]);
    sim.shutdown().await;
}

/// `DELETE …/nodes/{node_id}`: without `replace` the node goes and the count drops (how workers
/// shrink a pool by idle nodes); with `replace=1` a new node takes its place.
#[tokio::test]
async fn a_node_is_deleted_by_id_with_or_without_replacement() {
    let sim = start().await;
    let api = Do::new(&sim);
    let (s, v) = api
        .post(
            "/v2/kubernetes/clusters",
            cluster_body(
                "nodes",
                json!([{"name": "cpu", "size": "s-2vcpu-4gb", "count": 2}]),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["kubernetes_cluster"]["id"].as_str().unwrap().to_string();
    let pool_id = v["kubernetes_cluster"]["node_pools"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool = format!("/v2/kubernetes/clusters/{id}/node_pools/{pool_id}");
    let running = |n: usize| {
        move |v: &Value| {
            let nodes = v["node_pool"]["nodes"].as_array().unwrap();
            nodes.len() == n && nodes.iter().all(|n| n["status"]["state"] == "running")
        }
    };
    let v = api.wait(&pool, "2 running nodes", running(2)).await;
    let ids: Vec<String> = v["node_pool"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_string())
        .collect();

    let (s, v) = api
        .delete(&format!("{pool}/nodes/{}?skip_drain=0&replace=0", ids[0]))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let (_, v) = api.get(&pool).await;
    assert_eq!(v["node_pool"]["count"], 1);
    let v = api.wait(&pool, "the other node alone", running(1)).await;
    assert_eq!(v["node_pool"]["nodes"][0]["id"], ids[1].as_str());

    let (s, _) = api
        .delete(&format!("{pool}/nodes/{}?replace=1", ids[1]))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let v = api
        .wait(&pool, "a replacement", |v| {
            running(1)(v) && v["node_pool"]["nodes"][0]["id"] != ids[1].as_str()
        })
        .await;
    assert_eq!(v["node_pool"]["count"], 1);

    let (s, v) = api.delete(&format!("{pool}/nodes/{}", ids[0])).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "a node that is gone: {v}");
    assert_error(&v, "not_found");
    sim.shutdown().await;
}

#[tokio::test]
async fn gpu_capacity_runs_out_with_422() {
    let sim = start().await;
    sim.set_gpu_capacity([("gpu-h100x1-80gb".to_string(), 3)].into());
    let api = Do::new(&sim);
    let (s, v) = api
        .post(
            "/v2/kubernetes/clusters",
            cluster_body(
                "c",
                json!([
                    {"name": "cpu", "size": "s-2vcpu-4gb", "count": 1},
                    {"name": "gpu", "size": "gpu-h100x1-80gb", "count": 2}
                ]),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["kubernetes_cluster"]["id"].as_str().unwrap().to_string();
    let gpu_pool = v["kubernetes_cluster"]["node_pools"][1]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pools = format!("/v2/kubernetes/clusters/{id}/node_pools");
    let (s, v) = api
        .post(
            &pools,
            json!({"name": "more", "size": "gpu-h100x1-80gb", "count": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_error(&v, "unprocessable_entity");
    assert!(v["message"].as_str().unwrap().contains("capacity"), "{v}");
    let (s, v) = api
        .put(
            &format!("{pools}/{gpu_pool}"),
            json!({"name": "gpu", "count": 4}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    // Exactly the remaining capacity still fits.
    let (s, _) = api
        .post(
            &pools,
            json!({"name": "more", "size": "gpu-h100x1-80gb", "count": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    // A GPU size the region does not offer has no capacity at all.
    let (s, v) = api
        .post(
            &pools,
            json!({"name": "h200", "size": "gpu-h200x8-1128gb", "count": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    // A size that is not a size at all.
    let (s, _) = api
        .post(
            &pools,
            json!({"name": "bad", "size": "no such size", "count": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    // A whole cluster that does not fit is refused and not created.
    let (s, _) = api
        .post(
            "/v2/kubernetes/clusters",
            cluster_body(
                "c2",
                json!([{"name": "g", "size": "gpu-h100x1-80gb", "count": 1}]),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(sim.inventory().cloud.clusters.len(), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn injected_faults_hit_at_the_configured_rate() {
    let sim = start().await;
    let api = Do::new(&sim);
    sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    let (s, v) = api.get("/v2/vpcs").await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_error(&v, "server_error");
    // A faulted write is still a call the client made.
    let before = sim.do_mutations();
    let (s, _) = api
        .post("/v2/vpcs", json!({"name": "x", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(sim.do_mutations(), before + 1);
    assert_eq!(
        sim.inventory().cloud.vpcs.len(),
        1,
        "a faulted create creates nothing"
    );

    sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            rate_limit_rate: 1.0,
            retry_after_secs: 7,
            ..Default::default()
        },
        ..Default::default()
    });
    let r = api
        .http
        .get(format!("{}/v2/vpcs", api.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers()["retry-after"], "7");
    assert_error(&r.json().await.unwrap(), "too_many_requests");

    // Half the requests fail: the observed rate is near one half (bounds are ~6 sigma).
    sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            error_rate: 0.3,
            rate_limit_rate: 0.2,
            ..Default::default()
        },
        ..Default::default()
    });
    let (mut errors, mut limited, mut ok) = (0, 0, 0);
    for _ in 0..300 {
        match api.get("/v2/vpcs").await.0 {
            StatusCode::INTERNAL_SERVER_ERROR => errors += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            StatusCode::OK => ok += 1,
            s => panic!("unexpected {s}"),
        }
    }
    assert!((50..=130).contains(&errors), "errors {errors}");
    assert!((25..=95).contains(&limited), "429s {limited}");
    assert!((100..=200).contains(&ok), "ok {ok}");

    // The admin endpoint sets the same thing over HTTP; latency applies to every call.
    let r = api
        .http
        .put(format!("{}/_sim/faults", api.base))
        .json(&json!({"do": {"latency_ms": 150}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let t = std::time::Instant::now();
    assert_eq!(api.get("/v2/vpcs").await.0, StatusCode::OK);
    assert!(t.elapsed() >= Duration::from_millis(150));
    sim.shutdown().await;
}

#[tokio::test]
async fn an_armed_fault_refuses_or_loses_the_nth_call_from_now() {
    let sim = start().await;
    let api = Do::new(&sim);
    let pools = json!([{"name": "cpu", "size": "s-2vcpu-4gb", "count": 1}]);
    api.get("/v2/vpcs").await;
    assert_eq!(sim.calls(Api::Do), 1);

    // Refused: the second call from now fails before it has any effect.
    sim.arm_fault(Api::Do, 1, ArmedKind::Refuse).unwrap();
    assert_eq!(api.get("/v2/kubernetes/clusters").await.0, StatusCode::OK);
    let (s, v) = api
        .post("/v2/kubernetes/clusters", cluster_body("c1", pools.clone()))
        .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_error(&v, "server_error");
    assert!(
        sim.inventory().cloud.clusters.is_empty(),
        "refused: no cluster"
    );
    assert!(sim.armed_faults().is_empty(), "an armed fault fires once");

    // Lost: the cluster is created, the client gets a 504, and sending the create again finds
    // the name taken.
    sim.arm_fault(Api::Do, 0, ArmedKind::LoseResponse).unwrap();
    let (s, v) = api
        .post("/v2/kubernetes/clusters", cluster_body("c1", pools.clone()))
        .await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert_error(&v, "gateway_timeout");
    assert_eq!(sim.inventory().cloud.clusters.len(), 1, "lost: created");
    let (s, _) = api
        .post("/v2/kubernetes/clusters", cluster_body("c1", pools))
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    let fired = sim.fired_faults();
    assert_eq!(
        fired
            .iter()
            .map(|f| (f.fault.kind, f.fault.call, f.request.as_str()))
            .collect::<Vec<_>>(),
        [
            (ArmedKind::Refuse, 2, "POST /v2/kubernetes/clusters"),
            (ArmedKind::LoseResponse, 3, "POST /v2/kubernetes/clusters"),
        ]
    );
    // Every call counts, faulted or not; a stats reset does not renumber them.
    sim.reset_stats();
    assert_eq!(sim.calls(Api::Do), 5);
    assert_eq!(sim.calls(Api::Kube), 0);

    // A fault whose call never comes is given back when disarmed.
    sim.arm_fault(Api::Do, 10, ArmedKind::Refuse).unwrap();
    let left = sim.disarm_faults();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].call, 15);
    assert!(sim.arm_fault(Api::DataPlane, 0, ArmedKind::Refuse).is_err());

    // The same over the admin endpoints (which are not DigitalOcean calls).
    const ADMIN: &str = "/_sim/faults/armed";
    let (s, armed) = api
        .post(ADMIN, json!({"api": "do", "nth": 0, "kind": "refuse"}))
        .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(
        armed,
        json!({"api": "do", "counting": "calls", "call": 5, "kind": "refuse"})
    );
    let (_, state) = api.get(ADMIN).await;
    assert_eq!(
        state["counts"],
        json!({"do": {"calls": 5, "writes": 3}, "kube": {"calls": 0, "writes": 0}})
    );
    assert_eq!(state["armed"], json!([armed]));
    assert_eq!(state["fired"][1]["request"], "POST /v2/kubernetes/clusters");
    assert_eq!(
        api.get("/v2/vpcs").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let (s, _) = api
        .post(ADMIN, json!({"api": "data_plane", "kind": "refuse"}))
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    // Counting writes only: the next write loses its answer, whatever reads come first.
    sim.arm_fault_on_write(Api::Do, 0, ArmedKind::LoseResponse)
        .unwrap();
    assert_eq!(api.get("/v2/vpcs").await.0, StatusCode::OK);
    let (s, _) = api
        .post("/v2/vpcs", json!({"name": "lost", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(sim.inventory().cloud.vpcs.len(), 2, "lost: created");
    assert_eq!(sim.writes(Api::Do), 4);

    // An outage: down from its call on, until disarmed.
    sim.arm_fault(Api::Do, 1, ArmedKind::Outage).unwrap();
    assert_eq!(api.get("/v2/vpcs").await.0, StatusCode::OK);
    for _ in 0..2 {
        assert_eq!(
            api.get("/v2/vpcs").await.0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    assert_eq!(sim.disarm_faults().len(), 1);
    assert_eq!(api.get("/v2/vpcs").await.0, StatusCode::OK);

    sim.arm_fault(Api::Kube, 0, ArmedKind::LoseResponse)
        .unwrap();
    let (_, disarmed) = api.delete(ADMIN).await;
    assert_eq!(disarmed["disarmed"][0]["api"], "kube");
    assert!(sim.armed_faults().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn mutation_counter_sees_only_writes() {
    let sim = start().await;
    let api = Do::new(&sim);
    api.get("/v2/vpcs").await;
    api.get("/v2/kubernetes/clusters").await;
    api.get("/v2/load_balancers").await;
    assert_eq!(sim.do_mutations(), 0);
    let (s, _) = api
        .post("/v2/vpcs", json!({"name": "a", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) = api
        .post("/v2/vpcs", json!({"name": "a", "region": "atl1"}))
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(sim.do_mutations(), 2);
    let stats: Value = api
        .http
        .get(format!("{}/_sim/stats", api.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["do_mutations"], 2);
    assert_eq!(stats["mutation_log"][0], "POST /v2/vpcs");
    sim.reset_stats();
    assert_eq!(sim.do_mutations(), 0);
    sim.shutdown().await;
}
