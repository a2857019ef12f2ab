//! Bring your own model: a customer's fine-tune published to the (simulated) Hugging Face Hub is
//! served end to end through the public API, under the name the customer calls it by, at the
//! commit its revision was at when accepted, and switched to another repository without a failed
//! call; what cannot be served as declared is refused at once with a message that says what to
//! change.

use std::time::Duration;

use hub_sim::{Gated, Repo};
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{CloudOptions, System};
use uuid::Uuid;

use crate::lifecycle::{assert_chat_ok, ca_client, di_path, fetch_ca, start, wait_active, Caller};

const GPU: &str = "gpu-h100x1-80gb";
/// The customer's own Hugging Face token: it owns the private fine-tunes below.
const OWNER: &str = "hf_owner_of_my_org_models";

/// An 8B Llama fine-tune (the Hub's numbers for Llama 3.1 8B).
fn llama_8b(id: &str) -> Repo {
    Repo::model(
        id,
        "LlamaForCausalLM",
        8_030_261_248,
        32,
        4096,
        32,
        8,
        131_072,
    )
}

fn deployment(repo: &str, name: Option<&str>, gpu: &str) -> Value {
    let mut d = json!({
        "model_provider": "hugging_face", "provider_model_id": repo,
        "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": gpu}]
    });
    if let Some(name) = name {
        d["model_slug"] = json!(name);
    }
    d
}

fn create_body(name: &str, deployment: Value, token: Option<&str>) -> Value {
    let mut body = json!({"spec": {
        "version": 0, "name": name, "region": "atl1", "enable_public_endpoint": true, "vpc": null,
        "model_deployments": [deployment]
    }});
    if let Some(token) = token {
        body["access_tokens"] = json!({"hugging_face_token": token});
    }
    body
}

async fn post(sys: &System, api: &str, body: Value) -> system_tests::Reply {
    sys.call(Method::POST, "/v2/dedicated-inferences", api, Some(body))
        .await
}

/// A PATCH of the DI's whole spec, as the clients send one.
async fn patch_spec(sys: &System, api: &str, id: &str, spec: Value) -> system_tests::Reply {
    sys.call(
        Method::PATCH,
        &di_path(id, ""),
        api,
        Some(json!({ "spec": spec })),
    )
    .await
}

/// The id of the DI a create made.
fn created_id(created: &system_tests::Reply) -> String {
    created.body["dedicated_inference"]["id"]
        .as_str()
        .expect("a created DI")
        .to_string()
}

/// The args of the DI's (first) model server Deployment in atl1, and its pod template's hash.
fn vllm_args(sys: &System, id: &str) -> (Vec<String>, Value) {
    let inv = sys.cloud("atl1").sim.inventory();
    let vllm = crate::lifecycle::objects(&inv, "Deployment", id)
        .into_iter()
        .find(|d| {
            d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("vllm-"))
        })
        .expect("a model server");
    let template = &vllm["spec"]["template"];
    let args = template["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect();
    (args, template["metadata"]["annotations"].clone())
}

/// The value after `flag` in `args`.
fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.windows(2)
        .find(|w| w[0] == flag)
        .map(|w| w[1].as_str())
}

/// A 422 naming `field`, whose message contains every one of `says`.
fn assert_refused(reply: &system_tests::Reply, field: &str, says: &[&str]) {
    reply.assert_error(422, "unprocessable_entity");
    let message = reply.body["message"].as_str().unwrap_or_default();
    assert!(message.contains(field), "names {field}: {message}");
    for s in says {
        assert!(message.contains(s), "says {s:?}: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fine_tune_is_served_by_its_name_and_switched_without_a_failed_call() {
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    sys.hub.add_token(OWNER, "my-org").unwrap();
    sys.hub
        .publish(llama_8b("my-org/support-llama").private().owned_by(OWNER))
        .unwrap();
    sys.hub
        .publish(
            llama_8b("my-org/support-llama-v2")
                .private()
                .owned_by(OWNER),
        )
        .unwrap();

    // godo's shape: model_slug (the name clients use), model_provider and provider_model_id
    // together, the token under `secrets`.
    let mut body = create_body(
        "support",
        deployment("my-org/support-llama", Some("support-bot"), GPU),
        None,
    );
    body["secrets"] = json!({"hugging_face_token": OWNER});
    let created = post(&sys, &api, body).await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created_id(&created);
    let token = created.body["token"]["value"].as_str().unwrap().to_string();
    let (active, _) = wait_active(&sys, &api, "atl1", &id, 1).await;
    let d = &active["spec"]["model_deployments"][0];
    assert_eq!(d["model_slug"], "support-bot", "{active}");
    assert_eq!(d["model_provider"], "hugging_face");
    assert_eq!(d["provider_model_id"], "my-org/support-llama");

    // The model server loads the repository and serves it under the customer's name.
    let args = vllm_args(&sys, &id).0;
    assert!(
        args.windows(2)
            .any(|w| w == ["--model", "my-org/support-llama"]),
        "{args:?}"
    );
    assert!(
        args.windows(2)
            .any(|w| w == ["--served-model-name", "support-bot"]),
        "{args:?}"
    );

    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &id).await);
    assert_chat_ok(&client, &endpoint, &token, "support-bot").await;

    // Another repository under the same name: the old one answers until the new one does.
    let caller = Caller::start(
        client.clone(),
        vec![endpoint.clone()],
        token.clone(),
        vec!["support-bot".to_string()],
    );
    // Under way on the old repository first.
    caller.until_ok(2).await;
    let mut spec = active["spec"].clone();
    spec["model_deployments"][0]["provider_model_id"] = json!("my-org/support-llama-v2");
    let patched = patch_spec(&sys, &api, &id, spec).await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    let (switched, _) = wait_active(&sys, &api, "atl1", &id, 2).await;
    // And after the switch: four rounds, about half a second at the caller's pace.
    caller.more_rounds(4).await;
    let log = caller.finish().await;
    assert!(log.failures.is_empty(), "{:#?}", log.failures);
    assert!(log.ok >= 10, "the client must have been calling: {log:?}");
    assert_eq!(
        switched["spec"]["model_deployments"][0]["provider_model_id"],
        "my-org/support-llama-v2"
    );

    let deleted = sys
        .call(Method::DELETE, &di_path(&id, ""), &api, None)
        .await;
    assert_eq!(deleted.status, 202, "{}", deleted.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_served_is_refused_at_once_saying_what_to_change() {
    // No cloud work is needed: every refusal comes before anything is stored.
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let hub = &sys.hub;
    hub.add_token(OWNER, "my-org").unwrap();
    hub.add_token("hf_someone_else", "someone").unwrap();
    hub.publish(llama_8b("my-org/private-tune").private().owned_by(OWNER))
        .unwrap();
    hub.publish(llama_8b("vendor/gated-tune").gated(Gated::Manual))
        .unwrap();
    hub.publish(
        Repo::model(
            "my-org/big-tune",
            "LlamaForCausalLM",
            70_553_706_496,
            80,
            8192,
            64,
            8,
            131_072,
        )
        .owned_by(OWNER),
    )
    .unwrap();
    hub.publish(Repo::model(
        "my-org/encoder",
        "BertForMaskedLM",
        110_000_000,
        12,
        768,
        12,
        12,
        512,
    ))
    .unwrap();
    let refused = |repo: &'static str, gpu: &'static str, token: Option<&'static str>| {
        let body = create_body("refused", deployment(repo, None, gpu), token);
        let (sys, api) = (&sys, &api);
        async move { post(sys, api, body).await }
    };
    let field = "spec.model_deployments[0].provider_model_id";

    let r = refused("my-org/no-such-model", GPU, None).await;
    assert_refused(&r, field, &["my-org/no-such-model", "public"]);
    let r = refused("my-org/private-tune", GPU, None).await;
    assert_refused(&r, field, &["hugging_face_token"]);
    let r = refused("my-org/private-tune", GPU, Some("hf_someone_else")).await;
    assert_refused(&r, field, &["grant"]);
    let r = refused("vendor/gated-tune", GPU, None).await;
    assert_refused(
        &r,
        field,
        &[
            "gated",
            "hugging_face_token",
            "request access at http",
            "/vendor/gated-tune",
        ],
    );
    let r = refused("vendor/gated-tune", GPU, Some("hf_someone_else")).await;
    assert_refused(&r, field, &["gated", "no access", "request access"]);
    let r = refused("my-org/private-tune", GPU, Some("hf_revoked_or_made_up")).await;
    assert_refused(&r, "hugging_face_token", &["not accepted"]);
    let r = refused("my-org/encoder", GPU, None).await;
    assert_refused(&r, field, &["BertForMaskedLM", "LlamaForCausalLM"]);
    // 70B in BF16 is ~131 GiB: one H100 cannot hold it; the region's smallest size that can
    // is named, with the numbers.
    let r = refused("my-org/big-tune", GPU, Some(OWNER)).await;
    assert_refused(
        &r,
        "spec.model_deployments[0].accelerators[0].accelerator_slug",
        &[
            "gpu-h100x1-80gb",
            "GiB",
            "131.4 GiB of weights",
            "gpu-mi300x1-192gb",
        ],
    );
    // A context beyond the model's own.
    let mut d = deployment("my-org/private-tune", None, GPU);
    d["workload_config"] = json!({"input_tokens": 200_000, "output_tokens": 1000});
    let r = post(&sys, &api, create_body("refused", d, Some(OWNER))).await;
    assert_refused(&r, "spec.model_deployments[0].workload_config", &["131072"]);

    // A catalog model too: a token the Hub rejects is refused, and a gated one needs access.
    let catalog = |slug: &str| {
        json!({"model_slug": slug, "model_provider": "modelcatalog",
               "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": GPU}]})
    };
    let r = post(
        &sys,
        &api,
        create_body(
            "refused",
            catalog("qwen/qwen2.5-7b-instruct"),
            Some("hf_made_up"),
        ),
    )
    .await;
    assert_refused(&r, "hugging_face_token", &["not accepted"]);
    let r = post(
        &sys,
        &api,
        create_body(
            "refused",
            catalog("meta-llama/llama-3.1-8b-instruct"),
            Some("hf_someone_else"),
        ),
    )
    .await;
    assert_refused(
        &r,
        "spec.model_deployments[0].model_slug",
        &["meta-llama/Llama-3.1-8B-Instruct", "no access"],
    );

    // Nothing was stored: the team has no DI.
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &api, None)
        .await;
    assert_eq!(list.body["meta"]["total"], 0, "{}", list.body);

    // With what the messages asked for, the same repositories are accepted.
    hub.grant("vendor/gated-tune", "hf_someone_else").unwrap();
    let r = refused("vendor/gated-tune", GPU, Some("hf_someone_else")).await;
    assert_eq!(r.status, 202, "{}", r.body);
}

/// A repository removed after the DI was created: the next model server that loads it (here a
/// scale-up) fails, and the DI turns `error` with the reason, while the running one serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_can_no_longer_be_loaded_is_an_error_with_the_reason() {
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    sys.hub.publish(llama_8b("my-org/short-lived")).unwrap();
    let created = post(
        &sys,
        &api,
        create_body(
            "short-lived",
            deployment("my-org/short-lived", None, GPU),
            None,
        ),
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created_id(&created);
    let token = created.body["token"]["value"].as_str().unwrap().to_string();
    let (active, _) = wait_active(&sys, &api, "atl1", &id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &id).await);

    assert!(sys.hub.remove("my-org/short-lived"));
    let mut spec = active["spec"].clone();
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(2);
    let patched = patch_spec(&sys, &api, &id, spec).await;
    // The deployment's repository did not change: the PATCH does not wait on the Hub.
    assert_eq!(patched.status, 202, "{}", patched.body);
    let errored = sys
        .wait_status(&api, &id, "error", Duration::from_secs(60))
        .await;
    let events = sys
        .call(Method::GET, &di_path(&id, "/events"), &api, None)
        .await;
    let text = events.body.to_string();
    assert!(text.contains("ModelLoadFailed"), "{errored}\n{text}");
    assert!(text.contains("Repository Not Found"), "{text}");
    // The model server that was running keeps serving.
    assert_chat_ok(&client, &endpoint, &token, "my-org/short-lived").await;
}

/// Central repeats an operation whose answer it lost (a timeout, a restart). The region checked
/// the Hub when it applied it; asking again — the Hub down now, or the token since revoked —
/// must not refuse what already landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_operation_is_answered_without_asking_the_hub_again() {
    let sys = System::start().await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    sys.hub.add_token(OWNER, "my-org").unwrap();
    sys.hub
        .publish(llama_8b("my-org/support-llama").private().owned_by(OWNER))
        .unwrap();
    let created = post(
        &sys,
        &api,
        create_body(
            "again",
            deployment("my-org/support-llama", None, GPU),
            Some(OWNER),
        ),
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created_id(&created);
    let mut spec = created.body["dedicated_inference"]["spec"].clone();
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(2);
    let spec: api_types::spec::Spec = {
        // The normalised spec central sends: the public one's fields, as central validates them.
        let d = &spec["model_deployments"][0];
        serde_json::from_value(json!({
            "version": spec["version"], "name": "again", "region": "atl1", "vpc_uuid": null,
            "enable_public_endpoint": true,
            "model_deployments": [{
                "model_id": d["model_id"], "model_slug": d["model_slug"],
                "model_provider": "hugging_face", "provider_model_id": "my-org/support-llama",
                "source": {"repository": "my-org/support-llama", "revision": null, "custom": true},
                "workload_config": {},
                "accelerators": [{"accelerator_slug": GPU, "role": "prefill_decode", "scale": 2}]
            }]
        }))
        .unwrap()
    };
    // Central's calls to the region, as central makes them.
    let region = &sys.regions[0];
    let patch = |operation: Uuid, spec: api_types::spec::Spec, token: Option<&str>| {
        let body = api_types::regional::PatchRequest {
            team_id: team,
            operation_id: Some(operation),
            spec: Some(spec),
            hugging_face_token: token.map(str::to_string),
            requires_hugging_face_token: false,
        };
        let request = sys
            .http
            .patch(format!(
                "http://{}/internal/v1/dedicated-inferences/{id}",
                region.proxy.addr
            ))
            .header(api_types::regional::SECRET_HEADER, &region.secret)
            .json(&body);
        async move {
            let reply = request.send().await.expect("the region answers");
            let status = reply.status().as_u16();
            (status, reply.json::<Value>().await.expect("a JSON body"))
        }
    };
    let first_operation = Uuid::new_v4();
    // A new token: every deployment is asked about, and the operation lands.
    sys.hub.add_token("hf_new_owner_token", "my-org").unwrap();
    sys.hub
        .grant("my-org/support-llama", "hf_new_owner_token")
        .unwrap();
    let (status, body) = patch(first_operation, spec.clone(), Some("hf_new_owner_token")).await;
    assert_eq!(status, 200, "{body}");
    // Another change lands after it (another GPU size: a change the Hub is asked about).
    let mut later = spec.clone();
    later.version = 2;
    later.model_deployments[0].accelerators[0].accelerator_slug = "gpu-h200x1-141gb".into();
    let (status, body) = patch(Uuid::new_v4(), later, None).await;
    assert_eq!(status, 200, "{body}");
    // Then the Hub fails, and the token is revoked: the first operation's repetition (its spec
    // now differs from the latest) still gets the DI as it is.
    sys.hub.revoke_token("hf_new_owner_token");
    sys.hub.set_faults(hub_sim::HubFaults {
        error_rate: 1.0,
        ..Default::default()
    });
    let (status, body) = patch(first_operation, spec.clone(), Some("hf_new_owner_token")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["record"]["pending_spec"]["version"], 3, "{body}");
    // A different operation is asked about: a token the Hub does not know is refused.
    sys.hub.set_faults(hub_sim::HubFaults::default());
    let mut other = spec.clone();
    other.version = 3;
    let (status, body) = patch(Uuid::new_v4(), other, Some("hf_never_issued")).await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("hugging_face_token"),
        "{body}"
    );
}

/// A revision that is a path (`refs/pr/1`, as the Hub names pull requests) is one revision, to
/// the API's check and to the model server's download alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_with_a_slash_is_served() {
    let sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    sys.hub.publish(llama_8b("my-org/reviewed")).unwrap();
    sys.hub
        .push_revision("my-org/reviewed", "refs/pr/1", None)
        .unwrap();
    let created = post(
        &sys,
        &api,
        create_body(
            "reviewed",
            deployment("my-org/reviewed@refs/pr/1", Some("pr-1"), GPU),
            None,
        ),
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["dedicated_inference"]["id"].as_str().unwrap();
    let (active, _) = wait_active(&sys, &api, "atl1", id, 1).await;
    assert_eq!(
        active["spec"]["model_deployments"][0]["provider_model_id"],
        "my-org/reviewed@refs/pr/1"
    );
    // A revision the repository does not have is refused at once.
    let r = post(
        &sys,
        &api,
        create_body(
            "unreviewed",
            deployment("my-org/reviewed@refs/pr/2", None, GPU),
            None,
        ),
    )
    .await;
    assert_refused(
        &r,
        "spec.model_deployments[0].provider_model_id",
        &["refs/pr/2"],
    );
}

/// The Hub down while a create is checked: 503 with Retry-After and nothing stored — not a
/// create that recovery finishes later behind the customer's back (billing a DI they were told
/// failed), nor a name held against their corrected retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_the_hub_could_not_check_is_not_created_later() {
    let sys = System::start().await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    sys.hub.add_token(OWNER, "my-org").unwrap();
    sys.hub
        .publish(llama_8b("my-org/support-llama").private().owned_by(OWNER))
        .unwrap();
    sys.hub.set_faults(hub_sim::HubFaults {
        error_rate: 1.0,
        ..Default::default()
    });
    let body = create_body(
        "later",
        deployment("my-org/support-llama", None, GPU),
        Some(OWNER),
    );
    let r = post(&sys, &api, body).await;
    r.assert_error(503, "service_unavailable");
    sys.hub.set_faults(hub_sim::HubFaults::default());
    // Recovery runs meanwhile, the Hub back: it finds nothing to finish.
    central::feed::recover_once(&sys.central.app)
        .await
        .expect("recovery runs");
    sys.settle().await;
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &api, None)
        .await;
    assert_eq!(list.body["meta"]["total"], 0, "{}", list.body);
    // The customer's retry, with another GPU size, is a create of its own under that name.
    let body = create_body(
        "later",
        deployment("my-org/support-llama", None, "gpu-h200x1-141gb"),
        Some(OWNER),
    );
    let r = post(&sys, &api, body).await;
    assert_eq!(r.status, 202, "{}", r.body);
}

/// A slow Hub and many deployments: the region asks about them at once, so the answer still
/// arrives inside central's wait for the region (asked one after another, eight deployments at
/// 400 ms an answer took about 7 s, past the 5 s central waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_deployments_are_checked_inside_centrals_wait() {
    let sys = System::start().await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    sys.hub.add_token(OWNER, "my-org").unwrap();
    let deployments: Vec<Value> = (0..8)
        .map(|i| {
            let repo = format!("my-org/tune-{i}");
            sys.hub
                .publish(llama_8b(&repo).private().owned_by(OWNER))
                .unwrap();
            deployment(&repo, None, GPU)
        })
        .collect();
    sys.hub.set_faults(hub_sim::HubFaults {
        latency_ms: 400,
        ..Default::default()
    });
    let mut body = create_body("many", deployments[0].clone(), Some(OWNER));
    body["spec"]["model_deployments"] = Value::Array(deployments);
    let started = std::time::Instant::now();
    let r = post(&sys, &api, body).await;
    assert_eq!(r.status, 202, "after {:?}: {}", started.elapsed(), r.body);
}

/// A revision is pinned to the commit the Hub reported when the region accepted it: the model
/// servers load that commit, a worker restarted after the branch moved renders it again, and a
/// PATCH repeating the spec keeps it. Only an update naming another revision (here the branch's
/// new commit itself) moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_is_pinned_to_its_commit_until_an_update_names_another() {
    let mut sys = start(CloudOptions {
        // A restarted worker looks again soon.
        resync: Some(Duration::from_millis(300)),
        ..CloudOptions::default()
    })
    .await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    const REPO: &str = "my-org/tracked";
    sys.hub.publish(llama_8b(REPO)).unwrap();
    let first = sys.hub.repo(REPO).unwrap().sha().to_string();

    let created = post(
        &sys,
        &api,
        create_body(
            "tracked",
            deployment(&format!("{REPO}@main"), Some("tracked"), GPU),
            None,
        ),
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created_id(&created);
    let commit_of =
        |di: &Value| di["spec"]["model_deployments"][0]["provider_model_commit"].clone();
    assert_eq!(
        commit_of(&created.body["dedicated_inference"]),
        first.as_str()
    );
    let (active, _) = wait_active(&sys, &api, "atl1", &id, 1).await;
    assert_eq!(commit_of(&active), first.as_str(), "{active}");
    assert_eq!(
        active["spec"]["model_deployments"][0]["provider_model_id"],
        format!("{REPO}@main"),
        "the revision named is shown as sent"
    );
    let (args, template) = vllm_args(&sys, &id);
    assert_eq!(arg(&args, "--revision"), Some(first.as_str()), "{args:?}");
    // The regional API's record carries it too, with the revision as named.
    let record = sys.region_record("atl1", &id, team).await.body;
    let source = &record["record"]["spec"]["model_deployments"][0]["source"];
    assert_eq!(source["revision"], "main", "{record}");
    assert_eq!(source["commit"], first.as_str(), "{record}");

    // The branch moves on the Hub. A worker started afresh renders the commit pinned, not the
    // branch's new head.
    let second = sys.hub.push_revision(REPO, "main", None).unwrap();
    assert_ne!(second, first);
    sys.region("atl1").kill_worker(0);
    let restarted = sys.region("atl1").start_worker().await;
    test_support::eventually(
        Duration::from_secs(30),
        "two passes of the restarted worker",
        || async {
            let w = sys.cloud("atl1").workers[restarted].as_ref().unwrap();
            (w.stats().passes >= 2).then_some(())
        },
    )
    .await;
    assert_eq!(vllm_args(&sys, &id), (args.clone(), template.clone()));

    // A PATCH repeating the spec, as Terraform sends one, keeps the commit.
    let patched = patch_spec(&sys, &api, &id, active["spec"].clone()).await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    let (repeated, _) = wait_active(&sys, &api, "atl1", &id, 2).await;
    assert_eq!(commit_of(&repeated), first.as_str(), "{repeated}");
    assert_eq!(vllm_args(&sys, &id), (args, template));

    // Naming the new commit is the explicit update: the model servers roll over to it.
    let mut spec = repeated["spec"].clone();
    spec["model_deployments"][0]["provider_model_id"] = json!(format!("{REPO}@{second}"));
    let patched = patch_spec(&sys, &api, &id, spec).await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    assert_eq!(
        patched.body["dedicated_inference"]["pending_deployment_spec"]["model_deployments"][0]
            ["provider_model_commit"],
        second.as_str(),
        "{}",
        patched.body
    );
    let (moved, _) = wait_active(&sys, &api, "atl1", &id, 3).await;
    assert_eq!(commit_of(&moved), second.as_str(), "{moved}");
    let (args, _) = vllm_args(&sys, &id);
    assert_eq!(arg(&args, "--revision"), Some(second.as_str()), "{args:?}");
}
