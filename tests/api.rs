//! The public API end to end: central and three regional services on real sockets and real
//! Postgres, driven over HTTP like a customer would.

use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{create_body, System};
use uuid::Uuid;

async fn create(sys: &System, token: &str, name: &str, region: &str) -> Value {
    sys.create_di(token, name, region).await.1
}

#[tokio::test]
async fn create_get_list_patch_delete() {
    let sys = System::start().await;
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;

    let created = create(&sys, &token, "first", "atl1").await;
    let di = &created["dedicated_inference"];
    let id = di["id"].as_str().unwrap().to_string();
    assert_eq!(di["status"], "new");
    assert_eq!(di["name"], "first");
    assert_eq!(di["region"], "atl1");
    assert_eq!(di["spec"]["version"], 1);
    assert_eq!(di["pending_deployment_spec"]["version"], 1);
    assert_eq!(
        di["spec"]["vpc"]["uuid"],
        di["spec"]["vpc_config"]["vpc_uuid"]
    );
    let model_id = di["spec"]["model_deployments"][0]["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(Uuid::parse_str(&model_id).is_ok());
    let value = created["token"]["value"].as_str().unwrap();
    assert!(value.starts_with("di_") && value.len() >= 35, "{value}");
    assert_eq!(created["token"]["is_managed"], true);

    let got = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            None,
        )
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["dedicated_inference"]["id"], id.as_str());
    assert!(
        got.body.to_string().find("di_").is_none() || !got.body.to_string().contains(value),
        "token never shown again"
    );

    // A PATCH carries the latest version and becomes version 2, pending.
    let mut spec = create_body("renamed", "atl1")["spec"].clone();
    spec["model_deployments"][0]["model_id"] = json!(model_id);
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(3);
    let patched = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": spec})),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    let di = &patched.body["dedicated_inference"];
    assert_eq!(di["pending_deployment_spec"]["version"], 2);
    assert_eq!(
        di["pending_deployment_spec"]["model_deployments"][0]["accelerators"][0]["scale"],
        3
    );
    assert_eq!(
        di["pending_deployment_spec"]["model_deployments"][0]["model_id"],
        model_id.as_str()
    );
    assert_eq!(di["name"], "renamed");
    assert!(patched.body.get("token").is_none());

    // The same version again is stale now.
    let stale = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": spec})),
        )
        .await;
    stale.assert_error(409, "conflict");
    assert!(
        stale.body["message"]
            .as_str()
            .unwrap()
            .contains("current version is 2"),
        "{}",
        stale.body
    );

    // Immutable fields.
    let mut moved = spec.clone();
    moved["version"] = json!(2);
    moved["enable_public_endpoint"] = json!(false);
    let refused = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": moved})),
        )
        .await;
    refused.assert_error(422, "unprocessable_entity");
    assert!(refused.body["message"]
        .as_str()
        .unwrap()
        .contains("enable_public_endpoint"));

    // List, with a second DI in another region.
    create(&sys, &token, "second", "nyc2").await;
    let list = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?per_page=1",
            &token,
            None,
        )
        .await;
    assert_eq!(list.status, 200);
    assert_eq!(list.body["meta"]["total"], 2);
    assert_eq!(
        list.body["dedicated_inferences"].as_array().unwrap().len(),
        1
    );
    let pages = &list.body["links"]["pages"];
    assert!(pages["next"].as_str().unwrap().contains("page=2"));
    assert!(pages["last"].as_str().unwrap().contains("page=2"));
    assert!(pages.get("prev").is_none());
    let page2 = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?per_page=1&page=2",
            &token,
            None,
        )
        .await;
    assert!(page2.body["links"]["pages"]["prev"]
        .as_str()
        .unwrap()
        .contains("page=1"));
    assert!(page2.body["links"]["pages"].get("next").is_none());
    let filtered = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?region=nyc2",
            &token,
            None,
        )
        .await;
    assert_eq!(filtered.body["meta"]["total"], 1);
    assert_eq!(filtered.body["dedicated_inferences"][0]["region"], "nyc2");
    let by_name = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?name=renamed",
            &token,
            None,
        )
        .await;
    assert_eq!(by_name.body["meta"]["total"], 1);

    // Delete is idempotent and leaves the DI readable as deleting.
    for _ in 0..2 {
        let deleted = sys
            .call(
                Method::DELETE,
                &format!("/v2/dedicated-inferences/{id}"),
                &token,
                None,
            )
            .await;
        assert_eq!(deleted.status, 202, "{}", deleted.body);
    }
    let got = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            None,
        )
        .await;
    assert_eq!(got.body["dedicated_inference"]["status"], "deleting");
    let patch_while_deleting = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": moved})),
        )
        .await;
    patch_while_deleting.assert_error(409, "conflict");

    // The workers finish the teardown: the DI is gone for good.
    let store = &sys
        .regions
        .iter()
        .find(|r| r.name == "atl1")
        .unwrap()
        .store()
        .clone();
    store.gone(Uuid::parse_str(&id).unwrap()).await.unwrap();
    sys.settle().await;
    let gone = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            None,
        )
        .await;
    gone.assert_error(404, "not_found");
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &token, None)
        .await;
    assert_eq!(list.body["meta"]["total"], 1);
}

#[tokio::test]
async fn worker_progress_reaches_the_read_model() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let created = create(&sys, &token, "watched", "tor1").await;
    let id = Uuid::parse_str(created["dedicated_inference"]["id"].as_str().unwrap()).unwrap();
    let store = sys
        .regions
        .iter()
        .find(|r| r.name == "tor1")
        .unwrap()
        .store()
        .clone();
    store.provisioning_begin(id).await.unwrap();
    store
        .rollout_complete(
            id,
            1,
            &region_store::Endpoints {
                public_fqdn: Some("https://pub.example".into()),
                private_fqdn: Some("https://priv.example".into()),
            },
        )
        .await
        .unwrap();
    // The background feed consumer brings the change to central without help.
    let di = sys
        .wait_status(&token, &id, "active", std::time::Duration::from_secs(10))
        .await;
    assert!(di["pending_deployment_spec"].is_null());
    assert_eq!(
        di["endpoints"]["public_endpoint_fqdn"],
        "https://pub.example"
    );
    assert_eq!(
        di["spec"]["model_deployments"][0]["accelerators"][0]["status"],
        "active"
    );

    let events = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/events"),
            &token,
            None,
        )
        .await;
    let reasons: Vec<&str> = events.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["Created", "ProvisioningStarted", "RolloutComplete"]
    );
}

#[tokio::test]
async fn tokens_ca_accelerators_sizes_and_models() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let created = create(&sys, &token, "tokens", "atl1").await;
    let id = created["dedicated_inference"]["id"]
        .as_str()
        .unwrap()
        .to_string();

    let made = sys
        .call(
            Method::POST,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &token,
            Some(json!({"name": "ci"})),
        )
        .await;
    assert_eq!(made.status, 202, "{}", made.body);
    assert!(made.body["token"]["value"]
        .as_str()
        .unwrap()
        .starts_with("di_"));
    assert_eq!(made.body["token"]["is_managed"], false);
    let token_id = made.body["token"]["id"].as_str().unwrap().to_string();

    let listed = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &token,
            None,
        )
        .await;
    assert_eq!(listed.body["meta"]["total"], 2);
    assert!(listed.body["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.get("value").is_none()));

    let revoked = sys
        .call(
            Method::DELETE,
            &format!("/v2/dedicated-inferences/{id}/tokens/{token_id}"),
            &token,
            None,
        )
        .await;
    assert_eq!(revoked.status, 204);
    let again = sys
        .call(
            Method::DELETE,
            &format!("/v2/dedicated-inferences/{id}/tokens/{token_id}"),
            &token,
            None,
        )
        .await;
    again.assert_error(404, "not_found");
    let listed = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &token,
            None,
        )
        .await;
    assert_eq!(listed.body["meta"]["total"], 1);

    let ca = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/ca"),
            &token,
            None,
        )
        .await;
    assert_eq!(ca.status, 200);
    use base64::Engine as _;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(ca.body["cert"].as_str().unwrap())
        .unwrap();
    assert!(String::from_utf8(pem)
        .unwrap()
        .starts_with("-----BEGIN CERTIFICATE-----"));

    let none = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/accelerators"),
            &token,
            None,
        )
        .await;
    assert_eq!(none.body["meta"]["total"], 0);
    let store = sys
        .regions
        .iter()
        .find(|r| r.name == "atl1")
        .unwrap()
        .store()
        .clone();
    let di = Uuid::parse_str(&id).unwrap();
    store
        .accelerators_replace(
            di,
            &[
                region_store::ObservedAccelerator {
                    name: "h100-a".into(),
                    slug: "gpu-h100x1-80gb".into(),
                    role: "prefill_decode".into(),
                    status: "active".into(),
                },
                region_store::ObservedAccelerator {
                    name: "h100-b".into(),
                    slug: "gpu-h100x1-80gb".into(),
                    role: "prefill_decode".into(),
                    status: "provisioning".into(),
                },
            ],
        )
        .await
        .unwrap();
    let accs = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/accelerators?slug=gpu-h100x1-80gb"),
            &token,
            None,
        )
        .await;
    assert_eq!(accs.body["meta"]["total"], 2);
    let first = &accs.body["accelerators"][0];
    assert_eq!(first["id"], first["accelerator_id"]);
    assert_eq!(first["status"], first["state"]);
    let one = sys
        .call(
            Method::GET,
            &format!(
                "/v2/dedicated-inferences/{id}/accelerators/{}",
                first["id"].as_str().unwrap()
            ),
            &token,
            None,
        )
        .await;
    assert_eq!(one.status, 200);
    assert_eq!(one.body["name"], first["name"]);

    let sizes = sys
        .call(Method::GET, "/v2/dedicated-inferences/sizes", &token, None)
        .await;
    assert_eq!(sizes.status, 200);
    assert!(sizes.body["enabled_regions"]
        .as_array()
        .unwrap()
        .contains(&json!("atl1")));
    assert!(sizes.body["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["gpu_slug"] == "gpu-h100x1-80gb" && s["currency"] == "USD"));
    let models = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences/gpu-model-config",
            &token,
            None,
        )
        .await;
    assert_eq!(models.status, 200);
    let configs = models.body["gpu_model_configs"].as_array().unwrap();
    assert!(configs
        .iter()
        .any(|m| m["is_gated_model"] == true && m["is_model_gated"] == true));
}

#[tokio::test]
async fn godo_dialect_is_accepted() {
    let sys = System::start().await;
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    let vpc = sys.cloud("nyc2").create_vpc(team, "godo").await;
    let body = json!({
        "spec": {
            "version": 1, "name": "godo", "region": "nyc2",
            "vpc_config": {"vpc_uuid": vpc},
            "enable_public_endpoint": false,
            "model_deployments": [{"model_slug": "mistral/mistral-7b-instruct-v3", "model_provider": "hugging_face",
                "provider_model_id": "",
                "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": "gpu-mi300x1-192gb"}]}]
        },
        "secrets": {"hugging_face_token": system_tests::HF_TOKEN}
    });
    let created = sys
        .call(Method::POST, "/v2/dedicated-inferences", &token, Some(body))
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let di = &created.body["dedicated_inference"];
    assert_eq!(di["vpc_uuid"], vpc.to_string());
    // godo reads provider_model_id back as it sent it.
    let d = &di["spec"]["model_deployments"][0];
    assert_eq!(d["model_slug"], "mistral/mistral-7b-instruct-v3");
    assert_eq!(d["provider_model_id"], "");
    assert!(
        !created.body.to_string().contains(system_tests::HF_TOKEN),
        "the HF token is never echoed"
    );
}

#[tokio::test]
async fn every_response_has_request_id_and_rate_limit_headers() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    for (method, path, auth) in [
        (Method::GET, "/v2/dedicated-inferences", true),
        (Method::GET, "/v2/dedicated-inferences/sizes", true),
        (
            Method::GET,
            &*format!("/v2/dedicated-inferences/{}", Uuid::new_v4()),
            true,
        ),
        (Method::GET, "/v2/dedicated-inferences", false),
        (Method::GET, "/v2/nothing-here", true),
    ] {
        let mut req = sys.http.request(method.clone(), sys.url(path));
        if auth {
            req = req.bearer_auth(&token);
        }
        let resp = req.send().await.unwrap();
        for header in [
            "x-request-id",
            "ratelimit-limit",
            "ratelimit-remaining",
            "ratelimit-reset",
        ] {
            assert!(
                resp.headers().contains_key(header),
                "{method} {path}: missing {header}"
            );
        }
    }
    // A caller's own request id is echoed.
    let resp = sys
        .http
        .get(sys.url("/v2/dedicated-inferences"))
        .bearer_auth(&token)
        .header("x-request-id", "trace-me-123")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "trace-me-123");
}

#[tokio::test]
async fn rate_limit_answers_429_with_retry_after() {
    let sys = System::start().await;
    let token = sys.token_with_limit(Uuid::new_v4(), &[], Some(3)).await;
    let mut remaining = Vec::new();
    for _ in 0..3 {
        let r = sys
            .call(Method::GET, "/v2/dedicated-inferences", &token, None)
            .await;
        assert_eq!(r.status, 200);
        remaining.push(
            r.headers["ratelimit-remaining"]
                .to_str()
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(remaining, ["2", "1", "0"]);
    let limited = sys
        .call(Method::GET, "/v2/dedicated-inferences", &token, None)
        .await;
    limited.assert_error(429, "too_many_requests");
    let retry: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3600).contains(&retry));
    assert_eq!(limited.headers["ratelimit-limit"], "3");
}

#[tokio::test]
async fn regional_services_demand_their_shared_secret() {
    let sys = System::start().await;
    let region = &sys.regions[0];
    let url = format!("http://{}/internal/v1/changes", region.proxy.addr);
    let anonymous = sys.http.get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let wrong = sys
        .http
        .get(&url)
        .header("x-region-secret", "guess")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let right = sys
        .http
        .get(&url)
        .header("x-region-secret", &region.secret)
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    // Another region's secret does not open this one.
    let other = sys
        .http
        .get(&url)
        .header("x-region-secret", &sys.regions[1].secret)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 401);
}

/// `/metrics` is served on each service's metrics listener, never on its API port (where it is
/// an unknown path like any other), and its labels take values from small fixed sets: made-up
/// methods and paths, which anyone can send, do not become series.
#[tokio::test]
async fn metrics_are_served_on_an_internal_listener_with_bounded_labels() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    assert_eq!(
        sys.call(Method::GET, "/v2/dedicated-inferences", &token, None)
            .await
            .status,
        200
    );
    let region = &sys.regions[0];
    let region_api = format!("http://{}", region.proxy.addr);
    for i in 0..50 {
        let method =
            Method::from_bytes(format!("X{}", Uuid::new_v4().simple()).as_bytes()).unwrap();
        let path = format!("/made-up-{i}/{}", Uuid::new_v4().simple());
        for base in [&sys.base, &region_api] {
            let status = sys
                .http
                .request(method.clone(), format!("{base}{path}"))
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status, 401, "{method} {base}{path}");
        }
    }
    let scrape = |addr: std::net::SocketAddr| {
        let http = sys.http.clone();
        async move {
            let response = http
                .get(format!("http://{addr}/metrics"))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.text().await.unwrap()
        }
    };
    let text = scrape(sys.central.metrics_addr).await;
    assert!(
        text.contains("# TYPE http_request_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("route=\"/v2/dedicated-inferences\",method=\"GET\",status=\"200\""),
        "{text}"
    );
    let region_metrics = region.server.as_ref().unwrap().metrics_addr;
    for text in [text, scrape(region_metrics).await] {
        for line in text
            .lines()
            .filter(|l| l.starts_with("http_request_duration_seconds_count"))
        {
            let method = line
                .split("method=\"")
                .nth(1)
                .and_then(|m| m.split('"').next());
            assert!(
                matches!(
                    method,
                    Some(
                        "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS" | "other"
                    )
                ),
                "{line}"
            );
            assert!(!line.contains("made-up"), "{line}");
        }
    }
    // The API ports: `/metrics` is nothing there.
    sys.call(Method::GET, "/metrics", &token, None)
        .await
        .assert_error(404, "not_found");
    for path in ["/metrics", "/made-up"] {
        let status = sys
            .http
            .get(format!("{region_api}{path}"))
            .header("x-region-secret", &region.secret)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 404, "{path}");
    }
}

/// While the central ↔ region secret is rotated, the regional service accepts the current and
/// the next one (central may present either), and nothing else.
#[tokio::test]
async fn a_region_accepts_a_second_secret_while_it_is_rotated() {
    let config = regional::Config {
        region: "atl1".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: "127.0.0.1:0".parse().unwrap(),
        database_url: system_tests::fresh_database("region_rotation").await,
        region_secret: "rs_current".into(),
        region_secret_next: Some("rs_next".into()),
        seal_key: common::seal::Sealer::generate_key(),
        seal_open_keys: Vec::new(),
        db_max_connections: 2,
        // Not asked: no create is sent.
        do_api_url: "http://127.0.0.1:9".into(),
        do_token: "unused".into(),
        hf_endpoint: "http://127.0.0.1:9".into(),
        catalog: None,
        tls: Default::default(),
        ca: Default::default(),
        quotas: Default::default(),
    };
    let server = regional::Server::start(config)
        .await
        .expect("regional starts");
    let http = reqwest::Client::new();
    for (secret, status) in [
        ("rs_current", 200),
        ("rs_next", 200),
        ("rs_other", 401),
        ("", 401),
    ] {
        let reply = http
            .get(format!("http://{}/internal/v1/changes", server.addr))
            .header(api_types::regional::SECRET_HEADER, secret)
            .send()
            .await
            .expect("the region answers");
        assert_eq!(reply.status(), status, "secret {secret:?}");
    }
}
