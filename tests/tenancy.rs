//! Teams own their VPCs. A team is a DigitalOcean account: a create naming a VPC the team does not
//! own in that region (another team's, another region's, none at all) is `422` at once; a create
//! without a VPC (absent or `null`, as godo and Terraform send) lands in the team's default VPC
//! there, and the DI reports it; a cluster (one per VPC) therefore never hosts two teams' DIs.

use region_sim::{ApiFaults, FaultConfig};
use reqwest::Method;
use serde_json::{json, Value};
use system_tests::{create_body, create_body_in, CloudOptions, Reply, System};
use uuid::Uuid;

use crate::lifecycle::{di_path, start, wait_active};

const CREATE: &str = "/v2/dedicated-inferences";

async fn post(sys: &System, api: &str, body: Value) -> Reply {
    sys.call(Method::POST, CREATE, api, Some(body)).await
}

fn vpc_of(reply_body: &Value) -> Uuid {
    let di = &reply_body["dedicated_inference"];
    let vpc = Uuid::parse_str(di["vpc_uuid"].as_str().expect("vpc_uuid")).expect("a UUID");
    // Both spellings of the spec show the same VPC (pydo reads one, godo and Terraform the other).
    assert_eq!(di["spec"]["vpc"]["uuid"], vpc.to_string(), "{di}");
    assert_eq!(
        di["spec"]["vpc_config"]["vpc_uuid"],
        vpc.to_string(),
        "{di}"
    );
    vpc
}

#[tokio::test]
async fn a_team_creates_only_in_its_own_vpcs() {
    let sys = System::start().await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let (api_a, api_b) = (sys.token(a, &[]).await, sys.token(b, &[]).await);
    let a_net = sys.cloud("atl1").create_vpc(a, "a-net").await;
    let a_elsewhere = sys.cloud("nyc2").create_vpc(a, "a-net").await;

    // Refused at once, naming the field: another team's VPC, another region's, an unknown one.
    for (what, api, vpc) in [
        ("another team's VPC", &api_b, a_net),
        ("a VPC of another region", &api_a, a_elsewhere),
        ("a VPC that does not exist", &api_a, Uuid::new_v4()),
    ] {
        let reply = post(&sys, api, create_body_in("web", "atl1", vpc)).await;
        reply.assert_error(422, "unprocessable_entity");
        let message = reply.body["message"].as_str().unwrap();
        assert!(message.contains("spec.vpc.uuid"), "{what}: {message}");
    }

    // Its own VPC: accepted and reported.
    let created = post(&sys, &api_a, create_body_in("web", "atl1", a_net)).await;
    assert_eq!(created.status, 202, "{}", created.body);
    assert_eq!(vpc_of(&created.body), a_net);

    // No VPC, as godo sends it (`null`) and as a body without the field: the team's default VPC
    // in that region, each team its own. B's refused create left its name free.
    let b_default = post(&sys, &api_b, create_body("web", "atl1")).await;
    assert_eq!(b_default.status, 202, "{}", b_default.body);
    assert_eq!(
        vpc_of(&b_default.body),
        sys.cloud("atl1").default_vpc(b).await
    );
    let mut absent = create_body("plain", "atl1");
    absent["spec"].as_object_mut().unwrap().remove("vpc");
    let a_default = post(&sys, &api_a, absent).await;
    assert_eq!(a_default.status, 202, "{}", a_default.body);
    let a_default_vpc = vpc_of(&a_default.body);
    assert_eq!(a_default_vpc, sys.cloud("atl1").default_vpc(a).await);
    assert_ne!(
        a_default_vpc,
        vpc_of(&b_default.body),
        "each team its own default VPC"
    );

    // A patch without a VPC keeps the DI's; one naming another VPC is refused.
    let id = created.body["dedicated_inference"]["id"].as_str().unwrap();
    let mut spec = create_body("web", "atl1")["spec"].clone();
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(1);
    let kept = sys
        .call(
            Method::PATCH,
            &di_path(id, ""),
            &api_a,
            Some(json!({"spec": spec.clone()})),
        )
        .await;
    assert_eq!(kept.status, 202, "{}", kept.body);
    assert_eq!(vpc_of(&kept.body), a_net);
    spec["version"] = json!(2);
    spec["vpc"] = json!({"uuid": a_default_vpc});
    let moved = sys
        .call(
            Method::PATCH,
            &di_path(id, ""),
            &api_a,
            Some(json!({"spec": spec})),
        )
        .await;
    moved.assert_error(422, "unprocessable_entity");
    assert!(moved.body["message"]
        .as_str()
        .unwrap()
        .contains("spec.vpc.uuid"));
}

/// The VPC is asked of the cloud before anything is stored: when the cloud fails, the create is
/// a `503` with `Retry-After` that leaves nothing behind, and the client's retry succeeds.
#[tokio::test]
async fn a_cloud_that_cannot_answer_for_the_vpc_is_a_503_that_stores_nothing() {
    let sys = System::start().await;
    let team = Uuid::new_v4();
    let api = sys.token(team, &[]).await;
    let sim = &sys.cloud("atl1").sim;
    sim.set_faults(FaultConfig {
        do_api: ApiFaults {
            error_rate: 1.0,
            ..ApiFaults::default()
        },
        ..FaultConfig::default()
    });
    let refused = post(&sys, &api, create_body("later", "atl1")).await;
    refused.assert_error(503, "service_unavailable");
    assert!(
        refused.headers.contains_key("retry-after"),
        "{:?}",
        refused.headers
    );
    let listed = sys.call(Method::GET, CREATE, &api, None).await;
    assert_eq!(listed.body["meta"]["total"], 0, "{}", listed.body);

    sim.set_faults(FaultConfig::default());
    let retried = post(&sys, &api, create_body("later", "atl1")).await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    let listed = sys.call(Method::GET, CREATE, &api, None).await;
    assert_eq!(listed.body["meta"]["total"], 1, "{}", listed.body);
}

/// Two teams' DIs in one region, each in its default VPC: each team's DIs run in a cluster of
/// their own, whose namespaces are that team's only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_teams_never_share_a_cluster() {
    let sys = start(CloudOptions::default()).await;
    let region = "atl1";
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let (api_a, api_b) = (sys.token(a, &[]).await, sys.token(b, &[]).await);
    let mut ids = Vec::new();
    for (team, api, name) in [
        (a, &api_a, "a-one"),
        (a, &api_a, "a-two"),
        (b, &api_b, "b-one"),
    ] {
        let created = post(&sys, api, create_body(name, region)).await;
        assert_eq!(created.status, 202, "{}", created.body);
        let id = created.body["dedicated_inference"]["id"]
            .as_str()
            .unwrap()
            .to_string();
        ids.push((team, api, id));
    }
    for (_, api, id) in &ids {
        wait_active(&sys, api, region, id, 1).await;
    }

    let cloud = sys.cloud(region);
    let inventory = cloud.sim.inventory();
    let (default_a, default_b) = (cloud.default_vpc(a).await, cloud.default_vpc(b).await);
    let cluster_of = |vpc: Uuid| -> String {
        let clusters: Vec<&Value> = inventory
            .cloud
            .clusters
            .iter()
            .filter(|c| c["vpc_uuid"] == vpc.to_string())
            .collect();
        assert_eq!(clusters.len(), 1, "one cluster in VPC {vpc}: {clusters:?}");
        clusters[0]["id"].as_str().unwrap().to_string()
    };
    let (cluster_a, cluster_b) = (cluster_of(default_a), cluster_of(default_b));
    assert_ne!(cluster_a, cluster_b);
    let di_namespaces = |cluster: &str| -> Vec<String> {
        inventory.kubernetes[cluster]
            .iter()
            .filter(|o| o["kind"] == "Namespace")
            .filter_map(|o| o["metadata"]["name"].as_str())
            .filter(|n| n.starts_with("di-"))
            .map(str::to_string)
            .collect()
    };
    let expected = |team: Uuid| -> Vec<String> {
        let mut names: Vec<String> = ids
            .iter()
            .filter(|(t, _, _)| *t == team)
            .map(|(_, _, id)| format!("di-{id}"))
            .collect();
        names.sort();
        names
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(sorted(di_namespaces(&cluster_a)), expected(a));
    assert_eq!(sorted(di_namespaces(&cluster_b)), expected(b));
}
