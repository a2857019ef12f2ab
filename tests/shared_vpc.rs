//! DIs that share a VPC share its cluster. Whatever the interleaving of their creates and deletes
//! (`terraform destroy` deletes in parallel; a create may arrive while the last DI's teardown is
//! removing the cluster), nothing remains once every DI is gone, and a live DI's cluster is never
//! deleted under it. The cloud's deletions take seconds, as real ones do.

use std::future::ready;
use std::time::Duration;

use region_sim::Delays;
use reqwest::Method;
use system_tests::{CloudOptions, System};
use test_support::{until, within};
use uuid::Uuid;

use crate::lifecycle::{create, di_path, start, wait_active, wait_gone};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";

fn slow_deletions() -> CloudOptions {
    CloudOptions {
        delays: Delays {
            deletion_ms: 3000,
            ..CloudOptions::quick_delays()
        },
        // Two workers, as in production: passes of the VPC's DIs run on both.
        workers: 2,
        ..CloudOptions::default()
    }
}

async fn delete(sys: &System, api: &str, id: &str) {
    let reply = sys.call(Method::DELETE, &di_path(id, ""), api, None).await;
    assert_eq!(reply.status, 202, "delete {id}: {}", reply.body);
}

/// Until `GET` of the DI is 404 (other DIs may still hold the region's resources).
async fn wait_404(sys: &System, api: &str, id: &str) {
    within(Duration::from_secs(60), || async {
        let reply = sys.call(Method::GET, &di_path(id, ""), api, None).await;
        (reply.status == 404).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("{id} not gone within 60 s"));
}

/// The clusters of the region that are not being deleted.
fn live_clusters(sys: &System, region: &str) -> Vec<serde_json::Value> {
    sys.cloud(region)
        .sim
        .inventory()
        .cloud
        .clusters
        .into_iter()
        .filter(|c| !matches!(c["state"].as_str(), Some("deleting") | Some("deleted")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_deletes_in_one_vpc_leave_nothing() {
    let sys = start(slow_deletions()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let a = create(&sys, &api, region, "first", MODEL, 1).await;
    let b = create(&sys, &api, region, "second", MODEL, 1).await;
    wait_active(&sys, &api, region, &a.id, 1).await;
    wait_active(&sys, &api, region, &b.id, 1).await;
    assert_eq!(live_clusters(&sys, region).len(), 1, "one cluster per VPC");

    // As `terraform destroy` does: both at once.
    tokio::join!(delete(&sys, &api, &a.id), delete(&sys, &api, &b.id));
    // Each waits for 404 and then for the region to hold nothing at all.
    wait_gone(&sys, &api, region, &a.id).await;
    wait_gone(&sys, &api, region, &b.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_during_the_last_teardown_gets_a_cluster_and_nothing_leaks() {
    let sys = start(slow_deletions()).await;
    let region = "atl1";
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let a = create(&sys, &api, region, "first", MODEL, 1).await;
    wait_active(&sys, &api, region, &a.id, 1).await;
    delete(&sys, &api, &a.id).await;
    // The last DI's teardown reaches the cluster…
    let sim = &sys.cloud(region).sim;
    until(
        Duration::from_secs(30),
        "the teardown deletes the VPC's cluster",
        || {
            ready(
                sim.inventory()
                    .cloud
                    .clusters
                    .iter()
                    .any(|c| c["state"] == "deleting"),
            )
        },
    )
    .await;
    // …and a create in the same VPC arrives meanwhile: it becomes active on a cluster of its own.
    let b = create(&sys, &api, region, "second", MODEL, 1).await;
    wait_active(&sys, &api, region, &b.id, 1).await;
    wait_404(&sys, &api, &a.id).await;
    assert_eq!(live_clusters(&sys, region).len(), 1);
    delete(&sys, &api, &b.id).await;
    wait_gone(&sys, &api, region, &b.id).await;
}
