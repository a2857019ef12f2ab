//! Bad input never yields a 5xx: each case gets the exact status and error id, in the
//! `{id, message, request_id}` shape.

use reqwest::Method;
use serde_json::json;
use system_tests::{create_body, System};
use test_support::eventually;
use uuid::Uuid;

async fn raw(
    sys: &System,
    method: Method,
    path: &str,
    token: &str,
    body: Vec<u8>,
) -> system_tests::Reply {
    let resp = sys
        .http
        .request(method, sys.url(path))
        .bearer_auth(token)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    system_tests::Reply::from(resp).await
}

#[tokio::test]
async fn malformed_bodies() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let post = |body: Vec<u8>| raw(&sys, Method::POST, "/v2/dedicated-inferences", &token, body);

    post(b"{\"spec\": ".to_vec())
        .await
        .assert_error(400, "bad_request");
    post(b"not json at all".to_vec())
        .await
        .assert_error(400, "bad_request");
    post(b"".to_vec()).await.assert_error(400, "bad_request");

    // A raw NUL byte is not JSON; an escaped one is refused by validation, naming the field.
    let mut with_raw_nul = serde_json::to_vec(&create_body("nul", "atl1")).unwrap();
    with_raw_nul.insert(10, 0);
    post(with_raw_nul).await.assert_error(400, "bad_request");
    let mut escaped = create_body("nul", "atl1");
    escaped["spec"]["name"] = json!("a\u{0}b");
    let reply = post(serde_json::to_vec(&escaped).unwrap()).await;
    reply.assert_error(422, "unprocessable_entity");
    assert!(reply.body["message"]
        .as_str()
        .unwrap()
        .contains("spec.name"));

    // Wrong types name the field.
    let mut wrong = create_body("types", "atl1");
    wrong["spec"]["model_deployments"][0]["accelerators"][0]["scale"] = json!("two");
    let reply = post(serde_json::to_vec(&wrong).unwrap()).await;
    reply.assert_error(422, "unprocessable_entity");
    assert!(
        reply.body["message"].as_str().unwrap().contains("scale"),
        "{}",
        reply.body
    );
    let mut wrong = create_body("types", "atl1");
    wrong["spec"]["enable_public_endpoint"] = json!("yes");
    post(serde_json::to_vec(&wrong).unwrap())
        .await
        .assert_error(422, "unprocessable_entity");
    post(serde_json::to_vec(&json!([1, 2, 3])).unwrap())
        .await
        .assert_error(422, "unprocessable_entity");
    post(serde_json::to_vec(&json!({"spec": {"name": "missing-fields"}})).unwrap())
        .await
        .assert_error(422, "unprocessable_entity");

    // Oversized.
    let mut huge = create_body("huge", "atl1");
    huge["spec"]["model_deployments"][0]["workload_config"] =
        json!({"padding": "x".repeat(200_000)});
    post(serde_json::to_vec(&huge).unwrap())
        .await
        .assert_error(413, "request_entity_too_large");

    // PATCH's access_tokens allows only hugging_face_token.
    let (id, _) = sys.create_di(&token, "patchme", "atl1").await;
    let reply = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"access_tokens": {"github": "x"}})),
        )
        .await;
    reply.assert_error(422, "unprocessable_entity");
    sys.call(
        Method::PATCH,
        &format!("/v2/dedicated-inferences/{id}"),
        &token,
        Some(json!({})),
    )
    .await
    .assert_error(422, "unprocessable_entity");
}

/// A create body whose first deployment's `workload_config` is `workload_config` (raw JSON).
fn create_with_workload_config(name: &str, workload_config: &str) -> Vec<u8> {
    let mut body = create_body(name, "atl1");
    body["spec"]["model_deployments"][0]["workload_config"] = json!("@WORKLOAD@");
    body.to_string()
        .replace("\"@WORKLOAD@\"", workload_config)
        .into_bytes()
}

/// An object nested `levels` deep: `{"a":{"a":…{}…}}`.
fn nested(levels: usize) -> String {
    format!(
        "{}{{}}{}",
        "{\"a\":".repeat(levels - 1),
        "}".repeat(levels - 1)
    )
}

#[tokio::test]
async fn deep_or_large_input_is_refused_at_the_edge() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let post = |body: Vec<u8>| raw(&sys, Method::POST, "/v2/dedicated-inferences", &token, body);
    let field = "spec.model_deployments[0].workload_config";

    // Deep enough to pass serde_json's own limit but not what central seals and re-reads.
    for levels in [122, 20] {
        let reply = post(create_with_workload_config("deep", &nested(levels))).await;
        reply.assert_error(422, "unprocessable_entity");
        let message = reply.body["message"].as_str().unwrap();
        assert!(message.contains(field), "{levels} levels: {message}");
    }
    // Deeper than any JSON parser's recursion limit, in a field central does not even read.
    let mut body = create_body("deeper", "atl1");
    body["extra"] = json!("@DEEP@");
    let body = body.to_string().replace("\"@DEEP@\"", &nested(300));
    let reply = post(body.into_bytes()).await;
    reply.assert_error(422, "unprocessable_entity");
    assert!(
        reply.body["message"].as_str().unwrap().starts_with("extra"),
        "{}",
        reply.body
    );
    // Large but under the body limit.
    let padding = format!("{{\"padding\":\"{}\"}}", "x".repeat(20 * 1024));
    let reply = post(create_with_workload_config("large", &padding)).await;
    reply.assert_error(422, "unprocessable_entity");
    assert!(
        reply.body["message"].as_str().unwrap().contains(field),
        "{}",
        reply.body
    );
    // The limits allow what real workload hints look like.
    let hints = r#"{"input_tokens":512,"output_tokens":256,"slo":{"ttft_ms":300,"tpot_ms":40,"percentile":95},
        "autoscaling":{"min_replicas":1,"max_replicas":4,"scale_to_zero_after_seconds":600}}"#;
    let reply = post(create_with_workload_config("hinted", hints)).await;
    assert_eq!(reply.status, 202, "{}", reply.body);

    // Nothing refused was left for recovery.
    assert_eq!(
        central::feed::recover_once(&sys.central.app).await.unwrap(),
        0
    );
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pending_creates")
        .fetch_one(sys.central.app.store.pool())
        .await
        .unwrap();
    assert_eq!(pending, 0);
}

#[tokio::test]
async fn catalog_validation() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let mut cases = Vec::new();
    let mut b = create_body("x", "atl1");
    b["spec"]["region"] = json!("ams3");
    cases.push(("unknown region", b, "spec.region"));
    let mut b = create_body("x", "atl1");
    b["spec"]["model_deployments"][0]["accelerators"][0]["accelerator_slug"] =
        json!("gpu-b300x1-288gb");
    cases.push(("unknown size", b, "accelerator_slug"));
    let mut b = create_body("x", "tor1");
    b["spec"]["model_deployments"][0]["accelerators"][0]["accelerator_slug"] =
        json!("gpu-h200x1-141gb");
    cases.push(("size not in region", b, "not available in tor1"));
    let mut b = create_body("x", "atl1");
    b["spec"]["model_deployments"][0]["model_slug"] = json!("acme/not-a-model");
    cases.push(("unknown model", b, "model_slug"));
    let mut b = create_body("x", "atl1");
    b["spec"]["model_deployments"][0]["model_slug"] = json!("meta-llama/llama-3.1-8b-instruct");
    cases.push(("gated model without token", b, "hugging_face_token"));
    let mut b = create_body("x", "atl1");
    b["spec"]["model_deployments"][0]["accelerators"][0]["scale"] = json!(0);
    cases.push(("zero scale", b, "scale"));
    let mut b = create_body("x", "atl1");
    b["spec"]["model_deployments"] = json!([]);
    cases.push(("no deployments", b, "model_deployments"));
    let mut b = create_body("x", "atl1");
    b["spec"]["vpc"]["uuid"] = json!("not-a-uuid");
    cases.push(("bad vpc", b, "vpc"));
    let mut b = create_body("bad name!", "atl1");
    b["spec"]["version"] = json!(1);
    cases.push(("bad name", b, "spec.name"));
    for (what, body, mentions) in cases {
        let reply = sys
            .call(Method::POST, "/v2/dedicated-inferences", &token, Some(body))
            .await;
        assert_eq!(reply.status, 422, "{what}: {}", reply.body);
        reply.assert_error(422, "unprocessable_entity");
        assert!(
            reply.body["message"].as_str().unwrap().contains(mentions),
            "{what}: {}",
            reply.body
        );
    }
    // Nothing was created by any of them.
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &token, None)
        .await;
    assert_eq!(list.body["meta"]["total"], 0);
    // The gated model is fine with a token.
    let mut b = create_body("gated", "atl1");
    b["spec"]["model_deployments"][0]["model_slug"] = json!("meta-llama/llama-3.1-8b-instruct");
    b["access_tokens"] = json!({"hugging_face_token": system_tests::HF_TOKEN});
    assert_eq!(
        sys.call(Method::POST, "/v2/dedicated-inferences", &token, Some(b))
            .await
            .status,
        202
    );
}

#[tokio::test]
async fn paging_parameters() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    for query in [
        "page=0",
        "per_page=10000",
        "per_page=0",
        "page=-1",
        "page=abc",
        "per_page=1.5",
        "page=99999999999999999999",
        "region=ams3",
    ] {
        let reply = sys
            .call(
                Method::GET,
                &format!("/v2/dedicated-inferences?{query}"),
                &token,
                None,
            )
            .await;
        reply.assert_error(422, "unprocessable_entity");
    }
    let reply = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?page=%00",
            &token,
            None,
        )
        .await;
    reply.assert_error(422, "unprocessable_entity");
    // A page past the end is empty, not an error.
    let reply = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?page=1000",
            &token,
            None,
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["dedicated_inferences"], json!([]));
}

#[tokio::test]
async fn conflicts() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let created = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(create_body("dup", "atl1")),
        )
        .await;
    assert_eq!(created.status, 202);
    // Duplicate name, even in another region.
    let mut other = create_body("dup", "nyc2");
    other["spec"]["enable_public_endpoint"] = json!(false);
    sys.call(
        Method::POST,
        "/v2/dedicated-inferences",
        &token,
        Some(other),
    )
    .await
    .assert_error(409, "conflict");
    // Another team may use the name.
    let other_team = sys.token(Uuid::new_v4(), &[]).await;
    assert_eq!(
        sys.call(
            Method::POST,
            "/v2/dedicated-inferences",
            &other_team,
            Some(create_body("dup", "atl1"))
        )
        .await
        .status,
        202
    );
    // Stale version.
    let id = created.body["dedicated_inference"]["id"].as_str().unwrap();
    let mut spec = create_body("dup", "atl1")["spec"].clone();
    spec["version"] = json!(7);
    let reply = sys
        .call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": spec})),
        )
        .await;
    reply.assert_error(409, "conflict");
    assert!(reply.body["message"]
        .as_str()
        .unwrap()
        .contains("current version is 1"));
    // Renaming onto another DI's name.
    sys.call(
        Method::POST,
        "/v2/dedicated-inferences",
        &token,
        Some(create_body("taken", "atl1")),
    )
    .await;
    let mut spec = create_body("taken", "atl1")["spec"].clone();
    spec["version"] = json!(1);
    sys.call(
        Method::PATCH,
        &format!("/v2/dedicated-inferences/{id}"),
        &token,
        Some(json!({"spec": spec})),
    )
    .await
    .assert_error(409, "conflict");
}

#[tokio::test]
async fn authentication_and_authorisation() {
    let sys = System::start().await;
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    let (id, _) = sys.create_di(&token, "mine", "atl1").await;

    // No token, a garbage token.
    let resp = sys
        .http
        .get(sys.url("/v2/dedicated-inferences"))
        .send()
        .await
        .unwrap();
    system_tests::Reply::from(resp)
        .await
        .assert_error(401, "unauthorized");
    sys.call(Method::GET, "/v2/dedicated-inferences", "dia_v1_nope", None)
        .await
        .assert_error(401, "unauthorized");

    // Missing scope: 403, and it does not leak whether the body would have been valid.
    let reader = sys.token(team, &["dedicated_inference:read"]).await;
    sys.call(
        Method::POST,
        "/v2/dedicated-inferences",
        &reader,
        Some(create_body("nope", "atl1")),
    )
    .await
    .assert_error(403, "forbidden");
    sys.call(
        Method::DELETE,
        &format!("/v2/dedicated-inferences/{id}"),
        &reader,
        None,
    )
    .await
    .assert_error(403, "forbidden");
    sys.call(
        Method::GET,
        &format!("/v2/dedicated-inferences/{id}/tokens"),
        &reader,
        None,
    )
    .await
    .assert_error(403, "forbidden");
    assert_eq!(
        sys.call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}"),
            &reader,
            None
        )
        .await
        .status,
        200
    );
    // The singular spelling of the tokens scope is accepted.
    let singular = sys.token(team, &["dedicated_inference_token:read"]).await;
    assert_eq!(
        sys.call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &singular,
            None
        )
        .await
        .status,
        200
    );

    // Another team's DI is 404 on every operation, never 403.
    let stranger = sys.token(Uuid::new_v4(), &[]).await;
    for (method, path) in [
        (Method::GET, format!("/v2/dedicated-inferences/{id}")),
        (Method::DELETE, format!("/v2/dedicated-inferences/{id}")),
        (Method::GET, format!("/v2/dedicated-inferences/{id}/ca")),
        (Method::GET, format!("/v2/dedicated-inferences/{id}/tokens")),
        (
            Method::GET,
            format!("/v2/dedicated-inferences/{id}/accelerators"),
        ),
    ] {
        sys.call(method, &path, &stranger, None)
            .await
            .assert_error(404, "not_found");
    }
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &stranger, None)
        .await;
    assert_eq!(list.body["meta"]["total"], 0);
    sys.call(
        Method::GET,
        "/v2/dedicated-inferences/not-a-uuid",
        &token,
        None,
    )
    .await
    .assert_error(404, "not_found");

    // A revoked API token stops working (within the auth cache's TTL).
    let doomed = sys.token(team, &[]).await;
    assert_eq!(
        sys.call(Method::GET, "/v2/dedicated-inferences", &doomed, None)
            .await
            .status,
        200
    );
    let doomed_id = sys
        .central
        .app
        .store
        .api_token_by_hash(&common::tokens::sha256(&doomed))
        .await
        .unwrap()
        .unwrap()
        .id;
    sys.central
        .app
        .store
        .api_token_revoke(doomed_id)
        .await
        .unwrap();
    eventually(
        std::time::Duration::from_secs(5),
        "the revoked API token refused",
        || async {
            let reply = sys
                .call(Method::GET, "/v2/dedicated-inferences", &doomed, None)
                .await;
            (reply.status == 401).then_some(reply)
        },
    )
    .await
    .assert_error(401, "unauthorized");

    // Unknown routes and methods use the error shape too.
    sys.call(Method::GET, "/v2/nothing", &token, None)
        .await
        .assert_error(404, "not_found");
    sys.call(Method::PUT, "/v2/dedicated-inferences", &token, None)
        .await
        .assert_error(405, "method_not_allowed");
}
