//! A revoked access token is refused by the data plane within 5 s in every status in which the
//! endpoint serves: `active` (see the lifecycle test), `updating` while a slow rollout is under
//! way, and `error` after an update the region could not satisfy (the old replicas keep
//! serving).

use std::time::Duration;

use region_sim::Delays;
use reqwest::Method;
use serde_json::json;
use system_tests::{CloudOptions, System};
use test_support::within;
use uuid::Uuid;

use crate::lifecycle::{
    assert_chat_ok, ca_client, chat, create, di_path, fetch_ca, spec, start, status, wait_active,
    wait_for, Created,
};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";

/// A second token for `di`; returns (id, value) once the endpoint accepts it.
pub(crate) async fn second_token(
    sys: &System,
    api: &str,
    di: &Created,
    client: &reqwest::Client,
    endpoint: &str,
) -> (String, String) {
    let created = sys
        .call(
            Method::POST,
            &di_path(&di.id, "/tokens"),
            api,
            Some(json!({"name": "second"})),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let value = created.body["token"]["value"].as_str().unwrap().to_string();
    let id = created.body["token"]["id"].as_str().unwrap().to_string();
    within(Duration::from_secs(10), || async {
        matches!(chat(client, endpoint, &value, MODEL).await, Ok((200, _))).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("the new token was not accepted within 10 s"));
    (id, value)
}

/// Revokes token `token_id` and asserts that the endpoint refuses `value` (401) within 5 s,
/// while `other` keeps working.
async fn revoke_and_expect_refusal(
    sys: &System,
    api: &str,
    di: &Created,
    client: &reqwest::Client,
    endpoint: &str,
    (token_id, value): (&str, &str),
    other: &str,
) {
    let revoked = sys
        .call(
            Method::DELETE,
            &di_path(&di.id, &format!("/tokens/{token_id}")),
            api,
            None,
        )
        .await;
    assert_eq!(revoked.status, 204, "{}", revoked.body);
    let refused = within(Duration::from_secs(5), || async {
        match chat(client, endpoint, value, MODEL).await {
            Ok((401, _)) => Some(()),
            Ok((200, _)) => None,
            other => panic!("the token must work until refused with 401: {other:?}"),
        }
    })
    .await;
    if refused.is_none() {
        panic!(
            "the revoked token still worked 5 s after the revoke returned (status {})",
            status(sys, api, &di.id).await
        );
    }
    assert_chat_ok(client, endpoint, other, MODEL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_reaches_a_di_in_error() {
    let sys = start(CloudOptions::default()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, region, "failing", MODEL, 1).await;
    let (active, _) = wait_active(&sys, &api, region, &di.id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di.id).await);
    let second = second_token(&sys, &api, &di, &client, &endpoint).await;

    // More GPUs than the region has (8 of this size), within the team's quota (32): the update
    // fails, the old replica keeps serving.
    let mut too_big = spec(region, "failing", MODEL, 20);
    too_big["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(&di.id, ""),
            &api,
            Some(json!({ "spec": too_big })),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    let errored = wait_error(&sys, &api, &di.id).await;
    assert_eq!(errored["status"], "error", "{errored}");
    assert_chat_ok(&client, &endpoint, &di.token, MODEL).await;

    revoke_and_expect_refusal(
        &sys,
        &api,
        &di,
        &client,
        &endpoint,
        (&second.0, &second.1),
        &di.token,
    )
    .await;
    // So is the managed token's, the one the customer revoked.
    let tokens = sys
        .call(Method::GET, &di_path(&di.id, "/tokens"), &api, None)
        .await;
    let managed = tokens.body["tokens"][0]["id"].as_str().unwrap().to_string();
    let third = second_token(&sys, &api, &di, &client, &endpoint).await;
    revoke_and_expect_refusal(
        &sys,
        &api,
        &di,
        &client,
        &endpoint,
        (&managed, &di.token),
        &third.1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_reaches_a_di_while_it_updates() {
    // Nodes that take long to come: the rollout is still under way when the token is revoked.
    let sys = start(CloudOptions {
        delays: Delays {
            node_provision_ms: 20_000,
            ..CloudOptions::quick_delays()
        },
        ..CloudOptions::default()
    })
    .await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, region, "growing", MODEL, 1).await;
    let (active, _) = wait_for(
        &sys,
        &api,
        region,
        &di.id,
        "active on version 1",
        Duration::from_secs(60),
        |d| d["status"] == "active" && d["pending_deployment_spec"].is_null(),
    )
    .await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di.id).await);
    let second = second_token(&sys, &api, &di, &client, &endpoint).await;

    let mut bigger = spec(region, "growing", MODEL, 3);
    bigger["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(&di.id, ""),
            &api,
            Some(json!({ "spec": bigger })),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    wait_for(
        &sys,
        &api,
        region,
        &di.id,
        "updating",
        Duration::from_secs(30),
        |d| d["status"] == "updating",
    )
    .await;
    revoke_and_expect_refusal(
        &sys,
        &api,
        &di,
        &client,
        &endpoint,
        (&second.0, &second.1),
        &di.token,
    )
    .await;
    assert_eq!(status(&sys, &api, &di.id).await, "updating");
}

/// While DigitalOcean fails every call (its passes retry and back off), a revocation still
/// reaches the gateway: it does not wait for the cloud API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_does_not_wait_for_a_failing_cloud_api() {
    let sys = start(CloudOptions {
        delays: Delays {
            node_provision_ms: 20_000,
            ..CloudOptions::quick_delays()
        },
        ..CloudOptions::default()
    })
    .await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, region, "cloudy", MODEL, 1).await;
    let (active, _) = wait_for(
        &sys,
        &api,
        region,
        &di.id,
        "active on version 1",
        Duration::from_secs(60),
        |d| d["status"] == "active" && d["pending_deployment_spec"].is_null(),
    )
    .await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di.id).await);
    let second = second_token(&sys, &api, &di, &client, &endpoint).await;

    // An update is under way (its nodes take 20 s), and then DigitalOcean fails every call.
    let mut bigger = spec(region, "cloudy", MODEL, 2);
    bigger["model_deployments"][0]["model_id"] = json!(di.model_id);
    let patched = sys
        .call(
            Method::PATCH,
            &di_path(&di.id, ""),
            &api,
            Some(json!({ "spec": bigger })),
        )
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    wait_for(
        &sys,
        &api,
        region,
        &di.id,
        "updating",
        Duration::from_secs(30),
        |d| d["status"] == "updating",
    )
    .await;
    sys.cloud(region).sim.set_faults(region_sim::FaultConfig {
        do_api: region_sim::ApiFaults {
            error_rate: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    revoke_and_expect_refusal(
        &sys,
        &api,
        &di,
        &client,
        &endpoint,
        (&second.0, &second.1),
        &di.token,
    )
    .await;
    sys.cloud(region)
        .sim
        .set_faults(region_sim::FaultConfig::default());
}

/// Polls until the DI is in `error`; returns it.
async fn wait_error(sys: &System, api: &str, id: &str) -> serde_json::Value {
    within(Duration::from_secs(60), || async {
        let reply = sys.call(Method::GET, &di_path(id, ""), api, None).await;
        let di = reply.body["dedicated_inference"].clone();
        (di["status"] == "error").then_some(di)
    })
    .await
    .unwrap_or_else(|| panic!("{id} did not go to error within 60 s"))
}
