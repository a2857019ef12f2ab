//! Quotas per team and region, through the public API: a create or update that would take a team
//! above a limit (DIs, GPUs of a size, GPUs in all; an autoscaled deployment counting its
//! max_replicas) is `422` at once, naming the limit, the use and what fits, while another team
//! creates freely; concurrent creates cannot overshoot; a limit lowered below what a team holds
//! leaves its DIs running and refuses only what would grow; the team reads its limits and use at
//! `GET /v2/dedicated-inferences/quotas`.

use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{create_body, CloudOptions, Reply, System};
use uuid::Uuid;

use crate::lifecycle::{di_path, start, wait_active};

const CREATE: &str = "/v2/dedicated-inferences";
const QUOTAS: &str = "/v2/dedicated-inferences/quotas";
const H100: &str = "gpu-h100x1-80gb";

/// A create body for `scale` nodes of H100 (one GPU each) in atl1.
fn body(name: &str, scale: i64) -> Value {
    let mut body = create_body(name, "atl1");
    body["spec"]["model_deployments"][0]["accelerators"][0]["scale"] = json!(scale);
    body
}

async fn post(sys: &System, api: &str, body: Value) -> Reply {
    sys.call(Method::POST, CREATE, api, Some(body)).await
}

async fn patch(sys: &System, api: &str, id: &str, spec: &Value) -> Reply {
    let body = json!({ "spec": spec });
    sys.call(Method::PATCH, &di_path(id, ""), api, Some(body))
        .await
}

/// Sets `team`'s own limits in atl1, as `regional quota set` does.
async fn limit(sys: &mut System, team: Uuid, set: region_store::QuotaOverrides) {
    sys.region("atl1")
        .store()
        .quota_overrides_set(team, &set)
        .await
        .expect("limits set");
}

/// The team's quotas in `region` as the API shows them.
async fn quotas_in(sys: &System, api: &str, region: &str) -> Value {
    let reply = sys.call(Method::GET, QUOTAS, api, None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.body["unavailable_regions"],
        json!([]),
        "{}",
        reply.body
    );
    reply.body["quotas"]
        .as_array()
        .expect("quotas")
        .iter()
        .find(|q| q["region"] == region)
        .cloned()
        .unwrap_or_else(|| panic!("no quotas for {region}: {}", reply.body))
}

fn size_use(quotas: &Value, size: &str) -> Value {
    quotas["gpus_per_size"]
        .as_array()
        .expect("sizes")
        .iter()
        .find(|s| s["accelerator_slug"] == size)
        .map(|s| json!({"limit": s["limit"], "used": s["used"]}))
        .unwrap_or_else(|| panic!("no {size} in {quotas}"))
}

fn refused(reply: &Reply, says: &[&str]) {
    reply.assert_error(422, "unprocessable_entity");
    let message = reply.body["message"].as_str().unwrap();
    for s in says {
        assert!(message.contains(s), "{message:?} should say {s:?}");
    }
}

#[tokio::test]
async fn a_team_over_its_quota_is_refused_at_once_and_another_team_is_not() {
    let mut sys = System::start().await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let (api_a, api_b) = (sys.token(a, &[]).await, sys.token(b, &[]).await);
    limit(
        &mut sys,
        a,
        region_store::QuotaOverrides {
            gpus_per_size: [(H100.to_string(), 3)].into(),
            ..Default::default()
        },
    )
    .await;

    let first = post(&sys, &api_a, body("a-one", 2)).await;
    assert_eq!(first.status, 202, "{}", first.body);
    let over = post(&sys, &api_a, body("a-two", 2)).await;
    refused(
        &over,
        &[
            "GPUs of size gpu-h100x1-80gb in atl1: spec.model_deployments needs 2 more",
            "your team's limit is 3 and it holds 2, so 1 more fit",
        ],
    );
    // Refused before anything was stored: the name is free, and one more GPU fits.
    let fits = post(&sys, &api_a, body("a-two", 1)).await;
    assert_eq!(fits.status, 202, "{}", fits.body);
    // Another team holds nothing of A's quota: its own, the service's defaults, apply.
    let other = post(&sys, &api_b, body("b-one", 2)).await;
    assert_eq!(other.status, 202, "{}", other.body);

    // An autoscaled deployment counts the replicas it may grow to.
    let mut autoscaled = body("a-auto", 1);
    autoscaled["spec"]["model_deployments"][0]["workload_config"] =
        json!({"autoscaling": {"min_replicas": 0, "max_replicas": 2}});
    autoscaled["spec"]["model_deployments"][0]["accelerators"][0]["accelerator_slug"] =
        json!("gpu-l40sx1-48gb");
    limit(
        &mut sys,
        a,
        region_store::QuotaOverrides {
            gpus: Some(4),
            ..Default::default()
        },
    )
    .await;
    refused(
        &post(&sys, &api_a, autoscaled).await,
        &[
            "GPUs in atl1, every size together: spec.model_deployments needs 2 more",
            "limit is 4 and it holds 3, so 1 more fit",
            "max_replicas",
        ],
    );

    // The team reads its limits and use, in every region.
    let atl1 = quotas_in(&sys, &api_a, "atl1").await;
    assert_eq!(
        atl1["dedicated_inferences"],
        json!({"limit": 20, "used": 2})
    );
    assert_eq!(atl1["gpus"], json!({"limit": 4, "used": 3}));
    assert_eq!(size_use(&atl1, H100), json!({"limit": 3, "used": 3}));
    assert_eq!(
        size_use(&atl1, "gpu-l40sx1-48gb"),
        json!({"limit": 32, "used": 0})
    );
    let nyc2 = quotas_in(&sys, &api_a, "nyc2").await;
    assert_eq!(
        nyc2["dedicated_inferences"],
        json!({"limit": 20, "used": 0})
    );
    assert_eq!(
        size_use(&quotas_in(&sys, &api_b, "atl1").await, H100),
        json!({"limit": 32, "used": 2})
    );
    // A region that does not answer is said, and the others still are.
    sys.proxy("tor1").set_mode(system_tests::proxy::Mode::Down);
    let partial = sys.call(Method::GET, QUOTAS, &api_a, None).await;
    assert_eq!(partial.status, 200, "{}", partial.body);
    assert_eq!(partial.body["unavailable_regions"], json!(["tor1"]));
    assert_eq!(partial.body["quotas"].as_array().unwrap().len(), 2);
}

/// Terraform creates a team's resources in parallel: the quota holds however they interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_through_the_api_cannot_overshoot() {
    let mut sys = System::start().await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    limit(
        &mut sys,
        team,
        region_store::QuotaOverrides {
            dedicated_inferences: Some(2),
            ..Default::default()
        },
    )
    .await;
    let calls = (0..6).map(|i| {
        let request = sys
            .http
            .post(sys.url(CREATE))
            .bearer_auth(&api)
            .json(&body(&format!("parallel-{i}"), 1));
        tokio::spawn(async move { Reply::from(request.send().await.unwrap()).await })
    });
    let mut statuses = Vec::new();
    for call in calls.collect::<Vec<_>>() {
        let reply = call.await.unwrap();
        if reply.status == 422 {
            refused(
                &reply,
                &["dedicated inferences in atl1: your team's limit is 2 and it has 2"],
            );
        }
        statuses.push(reply.status);
    }
    statuses.sort();
    assert_eq!(statuses, [202, 202, 422, 422, 422, 422]);
    let listed = sys.call(Method::GET, CREATE, &api, None).await;
    assert_eq!(listed.body["meta"]["total"], 2, "{}", listed.body);
}

/// A limit lowered below what a team holds touches nothing that runs: its DIs stay active on
/// their spec, an update that does not grow its use is accepted, one that does is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_a_limit_leaves_what_runs_alone() {
    let mut sys = start(CloudOptions::default()).await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    let mut ids = Vec::new();
    for name in ["kept-one", "kept-two"] {
        let created = post(&sys, &api, body(name, 2)).await;
        assert_eq!(created.status, 202, "{}", created.body);
        ids.push(
            created.body["dedicated_inference"]["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    for id in &ids {
        wait_active(&sys, &api, "atl1", id, 1).await;
    }
    limit(
        &mut sys,
        team,
        region_store::QuotaOverrides {
            dedicated_inferences: Some(1),
            gpus: Some(2),
            gpus_per_size: [(H100.to_string(), 1)].into(),
        },
    )
    .await;
    let atl1 = quotas_in(&sys, &api, "atl1").await;
    assert_eq!(atl1["dedicated_inferences"], json!({"limit": 1, "used": 2}));
    assert_eq!(size_use(&atl1, H100), json!({"limit": 1, "used": 4}));
    for id in &ids {
        let (di, _) = wait_active(&sys, &api, "atl1", id, 1).await;
        assert_eq!(
            di["spec"]["model_deployments"][0]["accelerators"][0]["scale"], 2,
            "{di}"
        );
    }

    // Shrinking, or changing nothing the quota counts, is accepted; growing is not.
    let mut spec = body("kept-one", 1)["spec"].clone();
    let shrunk = patch(&sys, &api, &ids[0], &spec).await;
    assert_eq!(shrunk.status, 202, "{}", shrunk.body);
    wait_active(&sys, &api, "atl1", &ids[0], 2).await;
    spec["version"] = json!(2);
    spec["name"] = json!("renamed");
    let renamed = patch(&sys, &api, &ids[0], &spec).await;
    assert_eq!(renamed.status, 202, "{}", renamed.body);
    spec["version"] = json!(3);
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(2);
    refused(
        &patch(&sys, &api, &ids[0], &spec).await,
        &[
            "GPUs in atl1, every size together: spec.model_deployments needs 1 more",
            "limit is 2 and it holds 3, so 0 more fit",
        ],
    );
    refused(
        &post(&sys, &api, body("a-third", 1)).await,
        &[
            "dedicated inferences in atl1: your team's limit is 1 and it has 2",
            "so 0 more fit",
        ],
    );
    wait_active(&sys, &api, "atl1", &ids[0], 3).await;
    wait_active(&sys, &api, "atl1", &ids[1], 1).await;
}
