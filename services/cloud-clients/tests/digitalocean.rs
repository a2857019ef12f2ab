//! `DoClient` against the region simulator's DigitalOcean API: CRUD, pagination, error classes,
//! retries on injected faults, and the mutation counter.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cloud_clients::digitalocean::{
    ClusterState, NodePoolCreateRequest, NodePoolUpdateRequest, NodeState, Taint,
};
use cloud_clients::{DoClient, DoClientOptions, DoError, RetryConfig};
use common::*;
use region_sim::{ApiFaults, Delays, FaultConfig};

fn small_delays() -> Delays {
    Delays {
        cluster_provision_ms: 100,
        node_provision_ms: 100,
        deletion_ms: 150,
        lb_provision_ms: 50,
        model_load_ms: 50,
        gateway_address_ms: 20,
    }
}

fn do_faults(f: ApiFaults) -> FaultConfig {
    FaultConfig {
        do_api: f,
        ..Default::default()
    }
}

#[tokio::test]
async fn vpcs_list_and_get_the_default_vpc() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let vpcs = api.vpc_list().await.unwrap();
    assert_eq!(vpcs.len(), 1, "{vpcs:?}");
    let vpc = &vpcs[0];
    assert_eq!(vpc.name, format!("default-{REGION}"));
    assert!(vpc.default);
    assert_eq!(vpc.region, REGION);
    assert!(!vpc.ip_range.is_empty());
    assert_eq!(&api.vpc_get(&vpc.id).await.unwrap(), vpc);
    let missing = api
        .vpc_get("00000000-0000-4000-8000-000000000000")
        .await
        .unwrap_err();
    assert!(missing.is_not_found(), "{missing:?}");
    assert!(!missing.is_transient());
    assert_eq!(api.mutating_calls(), 0, "reads are not writes");
    sim.shutdown().await;
}

#[tokio::test]
async fn cluster_and_node_pool_crud() {
    let sim = start_sim(small_delays()).await;
    let api = do_client(&sim, fast_retry());
    let default_vpc = api.vpc_list().await.unwrap().remove(0);

    // Create: provisioning, in the default VPC, no endpoint yet.
    let created = api.cluster_create(&cpu_cluster("di-c1")).await.unwrap();
    assert_eq!(created.status.state, ClusterState::Provisioning);
    assert_eq!(created.vpc_uuid, default_vpc.id);
    assert_eq!(created.endpoint, "");
    assert!(created.tags.contains(&format!("k8s:{}", created.id)));
    assert!(created.tags.contains(&"dedicated-inference".to_string()));
    assert_eq!(created.node_pools.len(), 1);
    assert_eq!(created.node_pools[0].count, 1);
    let id = created.id.clone();

    // A duplicate name is a permanent conflict, not retried.
    let before = api.mutating_calls();
    let dup = api.cluster_create(&cpu_cluster("di-c1")).await.unwrap_err();
    assert!(!dup.is_transient() && dup.is_already_exists(), "{dup:?}");
    assert_eq!(dup.status(), Some(409));
    assert_eq!(api.mutating_calls(), before + 1);

    let running = eventually("cluster running", || async {
        let c = api.cluster_get(&id).await.unwrap();
        (c.status.state == ClusterState::Running).then_some(c)
    })
    .await;
    assert!(
        running.endpoint.starts_with("https://"),
        "{}",
        running.endpoint
    );
    let listed = api.cluster_list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, id);

    // Node pool: create with labels, taints and tags.
    let mut req = NodePoolCreateRequest::new("gpu-h100", "gpu-h100x1-80gb", 1);
    req.labels = BTreeMap::from([("di.do/id".to_string(), "abc".to_string())]);
    req.tags = vec!["di-abc".to_string()];
    req.taints = vec![Taint {
        key: "di.do/dedicated".into(),
        value: "abc".into(),
        effect: "NoSchedule".into(),
    }];
    let pool = api.node_pool_create(&id, &req).await.unwrap();
    assert_eq!(pool.size, "gpu-h100x1-80gb");
    assert_eq!(pool.count, 1);
    assert_eq!(pool.labels["di.do/id"], "abc");
    assert_eq!(pool.taints, req.taints);
    assert!(pool.tags.contains(&"di-abc".to_string()));
    assert!(pool.tags.contains(&"k8s:worker".to_string()));
    assert_eq!(pool.nodes.len(), 1);
    let pools = api.node_pool_list(&id).await.unwrap();
    assert_eq!(
        pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
        ["cpu", "gpu-h100"]
    );
    assert_eq!(api.node_pool_get(&id, &pool.id).await.unwrap().id, pool.id);

    // Update: scale to 2, new labels and tags.
    let mut up = NodePoolUpdateRequest::new("gpu-h100", 2);
    up.labels = Some(BTreeMap::from([
        ("di.do/id".to_string(), "abc".to_string()),
        ("di.do/model".to_string(), "m1".to_string()),
    ]));
    up.tags = Some(vec!["di-abc".to_string(), "scaled".to_string()]);
    let updated = api.node_pool_update(&id, &pool.id, &up).await.unwrap();
    assert_eq!(updated.count, 2);
    assert_eq!(updated.labels.len(), 2);
    assert!(updated.tags.contains(&"scaled".to_string()));
    assert_eq!(updated.taints, req.taints, "taints untouched when not sent");
    let scaled = eventually("two running nodes", || async {
        let p = api.node_pool_get(&id, &pool.id).await.unwrap();
        (p.running_nodes() == 2).then_some(p)
    })
    .await;
    assert!(scaled
        .nodes
        .iter()
        .all(|n| n.status.state == NodeState::Running && !n.name.is_empty()));

    // Reads never count as writes.
    let writes = api.mutating_calls();
    api.cluster_list().await.unwrap();
    api.node_pool_list(&id).await.unwrap();
    assert_eq!(api.mutating_calls(), writes);

    // Delete the pool, then the cluster; both end in NotFound.
    api.node_pool_delete(&id, &pool.id).await.unwrap();
    eventually("pool gone", || async {
        match api.node_pool_get(&id, &pool.id).await {
            Err(e) if e.is_not_found() => Some(()),
            Ok(_) => None,
            Err(e) => panic!("{e}"),
        }
    })
    .await;
    api.cluster_delete(&id).await.unwrap();
    // Deleting a deleting cluster is accepted.
    api.cluster_delete(&id).await.unwrap();
    eventually("cluster gone", || async {
        match api.cluster_get(&id).await {
            Err(e) if e.is_not_found() => Some(()),
            Ok(c) => {
                assert!(matches!(
                    c.status.state,
                    ClusterState::Deleting | ClusterState::Running
                ));
                None
            }
            Err(e) => panic!("{e}"),
        }
    })
    .await;
    assert!(api.cluster_list().await.unwrap().is_empty());

    // Our count of writes is the simulator's count of writes.
    assert_eq!(api.mutating_calls(), sim.do_mutations());
    assert!(sim.inventory().leftovers().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn list_follows_pagination() {
    let sim = start_sim(Delays::instant()).await;
    let api = DoClient::with_options(
        &sim.base_url(),
        TOKEN,
        DoClientOptions {
            page_size: 2,
            retry: fast_retry(),
            ..Default::default()
        },
    )
    .unwrap();
    for i in 0..5 {
        api.cluster_create(&cpu_cluster(&format!("c{i}")))
            .await
            .unwrap();
    }
    let mut names: Vec<String> = api
        .cluster_list()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    names.sort();
    assert_eq!(names, ["c0", "c1", "c2", "c3", "c4"]);
    let pages = sim
        .stats()
        .recent_calls
        .iter()
        .filter(|c| c.starts_with("GET /v2/kubernetes/clusters ->"))
        .count();
    assert_eq!(pages, 3, "pages of 2, 2 and 1, and no more");
    // The default page size reads them in one call.
    sim.reset_stats();
    assert_eq!(
        do_client(&sim, fast_retry())
            .cluster_list()
            .await
            .unwrap()
            .len(),
        5
    );
    assert_eq!(sim.stats().recent_calls.len(), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn capacity_exhaustion_is_permanent() {
    let sim = start_sim(Delays::instant()).await;
    sim.set_gpu_capacity(BTreeMap::from([("gpu-h100x1-80gb".to_string(), 1)]));
    let api = do_client(&sim, fast_retry());
    let c = api.cluster_create(&cpu_cluster("cap")).await.unwrap();

    let before = api.mutating_calls();
    let err = api
        .node_pool_create(
            &c.id,
            &NodePoolCreateRequest::new("gpu", "gpu-h100x1-80gb", 2),
        )
        .await
        .unwrap_err();
    assert!(!err.is_transient(), "{err:?}");
    assert!(err.is_capacity(), "{err:?}");
    assert_eq!(err.status(), Some(422));
    assert!(err.request_id().is_some());
    assert!(matches!(err, DoError::Api { status: 422, .. }));
    assert_eq!(
        api.mutating_calls(),
        before + 1,
        "a permanent error is not retried"
    );

    // Within capacity it works; scaling past it is the same permanent error.
    let pool = api
        .node_pool_create(
            &c.id,
            &NodePoolCreateRequest::new("gpu", "gpu-h100x1-80gb", 1),
        )
        .await
        .unwrap();
    let err = api
        .node_pool_update(&c.id, &pool.id, &NodePoolUpdateRequest::new("gpu", 3))
        .await
        .unwrap_err();
    assert!(err.is_capacity() && !err.is_transient(), "{err:?}");
    // A validation 422 is permanent but not about capacity.
    let err = api
        .node_pool_create(
            &c.id,
            &NodePoolCreateRequest::new("Bad Name", "s-1vcpu-2gb", 1),
        )
        .await
        .unwrap_err();
    assert!(!err.is_transient() && !err.is_capacity(), "{err:?}");
    sim.shutdown().await;
}

#[tokio::test]
async fn not_found_is_distinct() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let ghost = "6f1b5e0a-0000-4000-8000-000000000001";
    for err in [
        api.cluster_get(ghost).await.unwrap_err(),
        api.kubeconfig(ghost).await.unwrap_err(),
        api.node_pool_list(ghost).await.unwrap_err(),
        api.load_balancer_get(ghost).await.unwrap_err(),
        api.cluster_delete(ghost).await.unwrap_err(),
    ] {
        assert!(err.is_not_found(), "{err:?}");
        assert!(!err.is_transient());
        assert_eq!(err.status(), Some(404));
    }
    let c = api.cluster_create(&cpu_cluster("nf")).await.unwrap();
    let err = api.node_pool_get(&c.id, ghost).await.unwrap_err();
    assert!(matches!(err, DoError::NotFound { .. }), "{err:?}");
    sim.shutdown().await;
}

#[tokio::test]
async fn bad_token_is_permanent_and_never_shown() {
    let sim = start_sim(Delays::instant()).await;
    let api = DoClient::new(&sim.base_url(), "dop_v1_wrong_secret").unwrap();
    let err = api.vpc_list().await.unwrap_err();
    assert_eq!(err.status(), Some(401));
    assert!(!err.is_transient());
    assert!(!format!("{err} {err:?} {api:?}").contains("wrong_secret"));
    sim.shutdown().await;
}

#[tokio::test]
async fn transient_errors_are_retried_until_success() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let c = api.cluster_create(&cpu_cluster("flaky")).await.unwrap();
    let pool_id = c.node_pools[0].id.clone();

    // Every call fails with 500 for a while, then the API recovers.
    sim.set_faults(do_faults(ApiFaults {
        error_rate: 1.0,
        ..Default::default()
    }));
    // Without retries the failure is visible and transient.
    let once = do_client(&sim, RetryConfig::none());
    let err = once.cluster_get(&c.id).await.unwrap_err();
    assert!(err.is_transient() && matches!(err, DoError::Server { status: 500, .. }));

    let before = api.mutating_calls();
    let refused = calls_answered(&sim, 500);
    let update = {
        let api = api.clone();
        let (cid, pid) = (c.id.clone(), pool_id.clone());
        tokio::spawn(async move {
            api.node_pool_update(&cid, &pid, &NodePoolUpdateRequest::new("cpu", 2))
                .await
        })
    };
    // The update's first attempt is refused; then the fault clears.
    let more_refused = async || calls_answered(&sim, 500) > refused;
    test_support::until(Duration::from_secs(10), "an attempt refused", more_refused).await;
    sim.set_faults(no_faults());
    let pool = update.await.unwrap().expect("retried to success");
    assert_eq!(pool.count, 2);
    let attempts = api.mutating_calls() - before;
    assert!(attempts > 1, "retried: {attempts} attempts");
    assert!(calls_answered(&sim, 500) >= 2);

    // Random faults on every call: each call still succeeds.
    sim.set_faults(do_faults(ApiFaults {
        error_rate: 0.3,
        rate_limit_rate: 0.0,
        ..Default::default()
    }));
    for _ in 0..5 {
        api.cluster_get(&c.id).await.unwrap();
        api.node_pool_list(&c.id).await.unwrap();
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn rate_limits_are_retried_after_retry_after() {
    let sim = start_sim(Delays::instant()).await;
    let api = do_client(&sim, fast_retry());
    let c = api.cluster_create(&cpu_cluster("limited")).await.unwrap();
    sim.reset_stats();

    sim.set_faults(do_faults(ApiFaults {
        rate_limit_rate: 1.0,
        retry_after_secs: 1,
        ..Default::default()
    }));
    let start = Instant::now();
    let get = {
        let api = api.clone();
        let id = c.id.clone();
        tokio::spawn(async move { api.cluster_get(&id).await })
    };
    let limited = async || calls_answered(&sim, 429) > 0;
    test_support::until(Duration::from_secs(10), "a 429", limited).await;
    sim.set_faults(no_faults());
    let got = get.await.unwrap().expect("retried after Retry-After");
    assert_eq!(got.id, c.id);
    // The backoff alone would have retried every few milliseconds; Retry-After: 1 means exactly
    // one 429 and a wait of at least a second.
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        calls_answered(&sim, 429),
        1,
        "{:?}",
        sim.stats().recent_calls
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn retries_are_bounded() {
    let sim = start_sim(Delays::instant()).await;
    let bounded = RetryConfig {
        max_attempts: 3,
        ..fast_retry()
    };
    let api = do_client(&sim, bounded);
    let c = api.cluster_create(&cpu_cluster("bounded")).await.unwrap();
    sim.set_faults(do_faults(ApiFaults {
        error_rate: 1.0,
        ..Default::default()
    }));
    let (before, sim_before) = (api.mutating_calls(), sim.do_mutations());
    let err = api
        .node_pool_create(&c.id, &NodePoolCreateRequest::new("p2", "s-1vcpu-2gb", 1))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    assert_eq!(api.mutating_calls() - before, 3);
    assert_eq!(sim.do_mutations() - sim_before, 3);

    // A Retry-After beyond what the policy waits for ends the call at once, still transient.
    sim.set_faults(do_faults(ApiFaults {
        rate_limit_rate: 1.0,
        retry_after_secs: 30,
        ..Default::default()
    }));
    let start = Instant::now();
    let err = api.cluster_get(&c.id).await.unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(err.is_transient());
    assert!(matches!(
        err,
        DoError::RateLimited { retry_after: Some(d), .. } if d == Duration::from_secs(30)
    ));

    // Total time is bounded too.
    let api = do_client(
        &sim,
        RetryConfig {
            max_attempts: 1000,
            max_elapsed: Duration::from_millis(300),
            ..fast_retry()
        },
    );
    sim.set_faults(do_faults(ApiFaults {
        error_rate: 1.0,
        ..Default::default()
    }));
    let start = Instant::now();
    assert!(api.cluster_get(&c.id).await.unwrap_err().is_transient());
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(2),
        "{took:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn connection_errors_are_transient() {
    // Nothing listens on port 1 of loopback.
    let api = DoClient::with_options(
        "http://127.0.0.1:1",
        TOKEN,
        DoClientOptions {
            retry: RetryConfig {
                max_attempts: 2,
                ..fast_retry()
            },
            ..Default::default()
        },
    )
    .unwrap();
    let err = api.vpc_list().await.unwrap_err();
    assert!(matches!(err, DoError::Transport(_)), "{err:?}");
    assert!(err.is_transient());
    assert!(DoClient::new("not a url", TOKEN).is_err());
}
