//! The work queue on real Postgres: leases keep claimers apart, expire, and follow changes.

use std::time::Duration;

use api_types::regional::{CreateRequest, NewToken};
use api_types::spec::{AcceleratorGroup, ModelDeployment, Spec};
use common::seal::Sealer;
use region_store::{sqlx, NewCa, Store};
use sqlx::PgPool;
use uuid::Uuid;

fn store(pool: PgPool) -> Store {
    Store::new(pool, Sealer::from_base64(&Sealer::generate_key()).unwrap())
}

async fn create(store: &Store, team: Uuid) -> Uuid {
    let req = CreateRequest {
        id: Uuid::new_v4(),
        team_id: team,
        spec: Spec {
            version: 1,
            name: format!("di-{}", Uuid::new_v4().simple()),
            region: "atl1".into(),
            vpc_uuid: Some(Uuid::from_u128(7)),
            enable_public_endpoint: false,
            model_deployments: vec![ModelDeployment {
                model_id: None,
                model_slug: "m".into(),
                model_provider: "hugging_face".into(),
                provider_model_id: String::new(),
                source: api_types::spec::ModelSource::default(),
                workload_config: serde_json::json!({}),
                accelerators: vec![AcceleratorGroup {
                    accelerator_slug: "gpu-h100x1-80gb".into(),
                    role: "prefill_decode".into(),
                    scale: 1,
                }],
            }],
        },
        hugging_face_token: None,
        managed_token: NewToken {
            id: Uuid::new_v4(),
            name: "managed".into(),
            sha256_hex: common::tokens::sha256_hex(&Uuid::new_v4().to_string()),
        },
    };
    let ca = NewCa {
        cert_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
        key_pem: "k".into(),
        not_after: (std::time::SystemTime::now() + LEASE * 1000).into(),
    };
    store
        .dedicated_inference_create(&req, &ca)
        .await
        .unwrap()
        .id
}

const LEASE: Duration = Duration::from_secs(30);

/// Moves DI `id`'s work item `by` into the past, as if that much time had passed on the
/// database's clock (which decides leases, backoffs and how long progress has stood still):
/// the test then needs no real wait for it.
async fn age(pool: &PgPool, id: Uuid, by: Duration) {
    sqlx::query(
        "UPDATE work_items SET expires_at = expires_at - $2 * interval '1 millisecond',
                next_check_after = next_check_after - $2 * interval '1 millisecond',
                progress_since = progress_since - $2 * interval '1 millisecond'
          WHERE di_id = $1",
    )
    .bind(id)
    .bind(by.as_millis() as f64)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn two_claimers_never_share_a_di(pool: PgPool) {
    let s = store(pool);
    let team = Uuid::new_v4();
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(create(&s, team).await);
    }
    let (a, b) = tokio::join!(s.work_claim("a", LEASE, 15), s.work_claim("b", LEASE, 15));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.len() + b.len(), 20);
    for c in &a {
        assert!(!b.iter().any(|d| d.di_id == c.di_id));
    }
    // Everything is held: nothing more to claim.
    assert!(s.work_claim("c", LEASE, 100).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn an_expired_lease_is_claimed_by_another_worker(pool: PgPool) {
    let s = store(pool.clone());
    let id = create(&s, Uuid::new_v4()).await;
    let first = s
        .work_claim("dead", Duration::from_millis(200), 10)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    assert!(!first[0].lease_expired);
    assert!(s.work_claim("b", LEASE, 10).await.unwrap().is_empty());
    age(&pool, id, Duration::from_millis(300)).await;
    let second = s.work_claim("b", LEASE, 10).await.unwrap();
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].di_id, id);
    assert!(second[0].lease_expired, "taken over from the dead worker");
    // The dead worker's token no longer renews or releases.
    assert!(!s.work_renew(id, first[0].lease_token, LEASE).await.unwrap());
    assert!(!s
        .work_release(id, first[0].lease_token, first[0].seq, Duration::ZERO)
        .await
        .unwrap());
    assert!(s
        .work_renew(id, second[0].lease_token, LEASE)
        .await
        .unwrap());
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn released_work_waits_for_its_time_or_a_change(pool: PgPool) {
    let s = store(pool);
    let team = Uuid::new_v4();
    let id = create(&s, team).await;
    let c = s.work_claim("a", LEASE, 10).await.unwrap().remove(0);
    // The pass's own progress (status, events) is not a change it has to come back for.
    s.provisioning_begin(id).await.unwrap();
    s.event_append(id, "Progress", "cluster: creating")
        .await
        .unwrap();
    assert!(s
        .work_release(id, c.lease_token, c.seq, Duration::from_secs(3600))
        .await
        .unwrap());
    assert!(s.work_claim("a", LEASE, 10).await.unwrap().is_empty());
    // A change a customer asked for (here a delete) makes it due at once.
    s.dedicated_inference_delete(id, team).await.unwrap();
    let again = s.work_claim("a", LEASE, 10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert!(again[0].seq > c.seq);
    assert!(
        !again[0].lease_expired,
        "a released lease is not an expired one"
    );
}

/// A change a cluster watch saw wakes a resting DI at once, leaves one due within seconds as it
/// is, and reaches a DI whose pass is running through that pass's release, unless the pass
/// backs off from a failure or looks again soon anyway.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_wake_makes_a_resting_di_due_and_outlives_a_running_pass(pool: PgPool) {
    let s = store(pool);
    let team = Uuid::new_v4();
    let id = create(&s, team).await;
    let hour = Duration::from_secs(3600);
    let claim = async || s.work_claim("a", LEASE, 10).await.unwrap();
    let c = claim().await.remove(0);
    assert!(s
        .work_release(id, c.lease_token, c.seq, hour)
        .await
        .unwrap());
    assert!(claim().await.is_empty());
    assert_eq!(s.work_wake(&[id]).await.unwrap(), 1);
    let c = claim().await.remove(0);

    // Looking again within a second: a wake leaves it be.
    assert!(s
        .work_release(id, c.lease_token, c.seq, Duration::from_secs(1))
        .await
        .unwrap());
    assert_eq!(s.work_wake(&[id]).await.unwrap(), 0);

    // Woken while its pass runs: the release does not put it off for an hour.
    age(s.pool(), id, Duration::from_secs(2)).await;
    let c = claim().await.remove(0);
    assert_eq!(s.work_wake(&[id]).await.unwrap(), 1);
    assert!(s
        .work_release(id, c.lease_token, c.seq, hour)
        .await
        .unwrap());
    let c = claim().await.remove(0);
    // ... and the claim forgets the wake: the next release waits as asked.
    assert!(s
        .work_release(id, c.lease_token, c.seq, hour)
        .await
        .unwrap());
    assert!(claim().await.is_empty());

    // A pass backing off from a failure keeps its backoff.
    assert_eq!(s.work_wake(&[id]).await.unwrap(), 1);
    let c = claim().await.remove(0);
    s.work_wake(&[id]).await.unwrap();
    assert!(s
        .work_release_to_retry(id, c.lease_token, c.seq, hour)
        .await
        .unwrap());
    assert!(claim().await.is_empty());
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn depth_counts_what_is_claimable_and_what_is_leased(pool: PgPool) {
    let s = store(pool.clone());
    let team = Uuid::new_v4();
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(create(&s, team).await);
    }
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (4, 0));

    let claimed = s.work_claim("a", LEASE, 2).await.unwrap();
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (2, 2));

    // Released with a later check: neither ready nor leased.
    let c = claimed[0].clone();
    s.work_release(c.di_id, c.lease_token, c.seq, Duration::from_secs(3600))
        .await
        .unwrap();
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (2, 1));

    // An error DI is due only for a customer's change it has not seen: `free` was never looked
    // at since it was created, so it is; once a worker has seen that, it waits.
    let free = ids
        .iter()
        .copied()
        .find(|id| !claimed.iter().any(|c| c.di_id == *id))
        .unwrap();
    s.error_set(free, None, "CapacityExhausted", "no GPUs")
        .await
        .unwrap();
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (2, 1));
    // A worker looks at both free DIs and lets them go at once: the error DI, having nothing
    // new, waits; the other is ready again.
    for c in s.work_claim("a", LEASE, 10).await.unwrap() {
        s.work_release(c.di_id, c.lease_token, c.seq, Duration::ZERO)
            .await
            .unwrap();
    }
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (1, 1));

    // An expired lease is claimable again: ready, no longer leased.
    let short = s
        .work_claim("dead", Duration::from_millis(100), 10)
        .await
        .unwrap();
    assert_eq!(short.len(), 1);
    assert_eq!(s.work_depth().await.unwrap().leased, 2);
    age(&pool, short[0].di_id, Duration::from_millis(200)).await;
    let depth = s.work_depth().await.unwrap();
    assert_eq!((depth.ready, depth.leased), (1, 1));
    // What depth calls ready is what a claim takes.
    assert_eq!(s.work_claim("b", LEASE, 10).await.unwrap().len(), 1);
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn error_dis_wait_for_a_new_spec(pool: PgPool) {
    let s = store(pool);
    let team = Uuid::new_v4();
    let id = create(&s, team).await;
    let c = s.work_claim("a", LEASE, 10).await.unwrap().remove(0);
    s.error_set(id, None, "CapacityExhausted", "no GPUs")
        .await
        .unwrap();
    s.work_release(id, c.lease_token, c.seq, Duration::ZERO)
        .await
        .unwrap();
    assert!(s.work_claim("a", LEASE, 10).await.unwrap().is_empty());
    let rec = s.dedicated_inference_any(id).await.unwrap();
    let mut spec: Spec = Spec {
        version: rec.pending_spec.as_ref().unwrap().version,
        name: "renamed".into(),
        region: "atl1".into(),
        vpc_uuid: Some(Uuid::from_u128(7)),
        enable_public_endpoint: false,
        model_deployments: rec.pending_spec.unwrap().model_deployments,
    };
    spec.model_deployments[0].accelerators[0].scale = 1;
    s.dedicated_inference_patch(id, team, Some(&spec), None, false)
        .await
        .unwrap();
    assert_eq!(s.work_claim("a", LEASE, 10).await.unwrap().len(), 1);
}

/// A customer's change to an `error` DI (a revoked token) whose pass fails transiently is tried
/// again after the backoff; once a pass for it succeeds, the DI waits again.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn an_error_dis_failed_pass_is_tried_again(pool: PgPool) {
    let s = store(pool.clone());
    let team = Uuid::new_v4();
    let id = create(&s, team).await;
    let c = s.work_claim("a", LEASE, 10).await.unwrap().remove(0);
    s.error_set(id, None, "CapacityExhausted", "no GPUs")
        .await
        .unwrap();
    s.work_release(id, c.lease_token, c.seq, Duration::ZERO)
        .await
        .unwrap();
    assert!(s.work_claim("a", LEASE, 10).await.unwrap().is_empty());

    // A token is revoked: the DI is due for it, and that pass fails transiently.
    let token = s.tokens_list(id, team, 1, 10).await.unwrap().items[0].id;
    s.token_revoke(id, team, token).await.unwrap();
    let c = s.work_claim("a", LEASE, 10).await.unwrap().remove(0);
    s.work_release_to_retry(id, c.lease_token, c.seq, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(
        s.work_claim("a", LEASE, 10).await.unwrap().is_empty(),
        "not before its backoff"
    );
    age(&pool, id, Duration::from_millis(300)).await;
    let c = s.work_claim("a", LEASE, 10).await.unwrap();
    assert_eq!(c.len(), 1, "tried again after its backoff");
    // This time it succeeds: the DI waits for the next change.
    s.work_release(id, c[0].lease_token, c[0].seq, Duration::ZERO)
        .await
        .unwrap();
    assert!(s.work_claim("a", LEASE, 10).await.unwrap().is_empty());
}

/// Two DIs of one cluster released at once (`terraform destroy` deletes in parallel): exactly
/// one of them is its last user, whatever the interleaving.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn concurrent_releases_leave_exactly_one_last_user(pool: PgPool) {
    let s = store(pool);
    let team = Uuid::new_v4();
    for round in 0..20 {
        let name = format!("di-vpc-{round}");
        let (a, b) = (create(&s, team).await, create(&s, team).await);
        for di in [a, b] {
            assert!(s.ledger_cluster_use(di, &name, "c1").await.unwrap());
        }
        let (ra, rb) = tokio::join!(
            s.ledger_cluster_release(a, &name, "c1"),
            s.ledger_cluster_release(b, &name, "c1")
        );
        let lasts = [ra.unwrap(), rb.unwrap()]
            .iter()
            .filter(|r| **r == region_store::ClusterRelease::Last)
            .count();
        assert_eq!(lasts, 1, "round {round}: one DI must delete the cluster");
    }
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn ledger_and_stall_tracking(pool: PgPool) {
    let s = store(pool.clone());
    let team = Uuid::new_v4();
    let a = create(&s, team).await;
    let b = create(&s, team).await;
    s.ledger_record(a, "cluster", "di-vpc", "", None)
        .await
        .unwrap();
    s.ledger_record(a, "cluster", "di-vpc", "", Some("c1"))
        .await
        .unwrap();
    s.ledger_record(a, "node_pool", "pool-a", "di-vpc", None)
        .await
        .unwrap();
    s.ledger_record(b, "cluster", "di-vpc", "", Some("c1"))
        .await
        .unwrap();
    let entries = s.ledger_entries(a).await.unwrap();
    assert_eq!(
        entries.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["cluster", "node_pool"]
    );
    assert_eq!(entries[0].external_id.as_deref(), Some("c1"));
    // A leaves a cluster B uses: it stays, and A's entry goes.
    use region_store::ClusterRelease::{Last, Shared};
    assert_eq!(
        s.ledger_cluster_release(a, "di-vpc", "c1").await.unwrap(),
        Shared
    );
    assert!(s
        .ledger_entries(a)
        .await
        .unwrap()
        .iter()
        .all(|e| e.kind != "cluster"));
    // B is then the last user: its entry retires, and no DI may start using that cluster.
    assert_eq!(
        s.ledger_cluster_release(b, "di-vpc", "c1").await.unwrap(),
        Last
    );
    assert!(s.ledger_entries(b).await.unwrap()[0].retiring);
    assert!(!s.ledger_cluster_use(a, "di-vpc", "c1").await.unwrap());
    // A cluster of the same name made after it is another cluster: usable.
    assert!(s.ledger_cluster_use(a, "di-vpc", "c2").await.unwrap());
    let entries = s.ledger_entries(a).await.unwrap();
    let cluster = entries.iter().find(|e| e.kind == "cluster").unwrap();
    assert_eq!(cluster.external_id.as_deref(), Some("c2"));

    let first = s.work_progress(a, "provisioning|x").await.unwrap();
    assert!(!first.reported);
    age(&pool, a, Duration::from_secs(50)).await;
    let same = s.work_progress(a, "provisioning|x").await.unwrap();
    assert!(same.unchanged_for >= Duration::from_secs(50));
    s.work_stall_reported(a).await.unwrap();
    assert!(s.work_progress(a, "provisioning|x").await.unwrap().reported);
    let moved = s.work_progress(a, "provisioning|y").await.unwrap();
    assert!(!moved.reported && moved.unchanged_for < Duration::from_millis(40));
    assert_eq!(moved.previous.as_deref(), Some("provisioning|x"));
    // Idle over idle writes nothing (and so reports no previous fingerprint).
    let idle = region_store::PROGRESS_IDLE;
    assert_eq!(
        s.work_progress(a, idle).await.unwrap().previous.as_deref(),
        Some("provisioning|y")
    );
    assert_eq!(s.work_progress(a, idle).await.unwrap().previous, None);
}

/// A worker that stalled past its lease (another worker has the DI now) writes nothing: its
/// store refuses every write about the DI with `LeaseLost`, while the new holder's go through.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_write_under_a_lost_lease_is_refused_and_writes_nothing(pool: PgPool) {
    let s = store(pool.clone());
    let id = create(&s, Uuid::new_v4()).await;
    let stale = s
        .work_claim("stalled", Duration::from_millis(100), 10)
        .await
        .unwrap()
        .remove(0);
    let stalled = s.under_lease(id, stale.lease_token);
    // While it is held, its writes go through.
    stalled.event_append(id, "Still", "held").await.unwrap();
    age(&pool, id, Duration::from_millis(200)).await;
    // Run out: refused even before anyone else takes it.
    assert!(matches!(
        stalled.event_append(id, "Late", "run out").await,
        Err(region_store::StoreError::LeaseLost)
    ));
    let taken = s.work_claim("next", LEASE, 10).await.unwrap().remove(0);
    let holder = s.under_lease(id, taken.lease_token);
    let events = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events WHERE di_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = events(pool.clone()).await;
    let lost = |r: region_store::Result<_>| matches!(r, Err(region_store::StoreError::LeaseLost));
    assert!(lost(stalled.provisioning_begin(id).await.map(|_| ())));
    assert!(lost(
        stalled.ledger_record(id, "node_pool", "p", "c", None).await
    ));
    assert!(lost(stalled.ledger_remove(id, "node_pool", "p").await));
    assert!(lost(
        stalled
            .error_set(id, None, "Stalled", "m")
            .await
            .map(|_| ())
    ));
    assert!(lost(stalled.replicas_record(id, &[], &[]).await));
    assert_eq!(events(pool.clone()).await, before, "nothing written");
    assert_eq!(
        s.dedicated_inference_any(id).await.unwrap().status.as_str(),
        "new"
    );
    assert!(s.ledger_entries(id).await.unwrap().is_empty());
    // The holder's writes go through, and a lease held for another DI fences nothing of it.
    holder.provisioning_begin(id).await.unwrap();
    holder
        .ledger_record(id, "node_pool", "p", "c", None)
        .await
        .unwrap();
    let other = create(&s, Uuid::new_v4()).await;
    assert!(lost(holder.event_append(other, "Wrong", "lease").await));
}

/// A worker's leases are free as soon as its database session ends (it died: its connections
/// closed with it), however long they had left; a live session keeps them.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_dead_workers_leases_are_free_when_its_session_ends(pool: PgPool) {
    let s = store(pool.clone());
    let id = create(&s, Uuid::new_v4()).await;
    let mut conn = pool.acquire().await.unwrap().detach();
    let session = region_store::HolderSession::of(&mut conn).await.unwrap();
    let long = Duration::from_secs(600);
    let held = s
        .work_claim_in_session("dying", Some(session), long, 10)
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    // Alive: nobody else may take it.
    assert!(s.work_claim("b", LEASE, 10).await.unwrap().is_empty());
    assert_eq!(s.work_depth().await.unwrap().leased, 1);
    use sqlx::Connection;
    conn.close().await.unwrap();
    // The session ends with the connection (the server notices the close at once). From then
    // on the holder cannot renew the lease nor write under it, before anyone takes it: if its
    // process lives on (a connection cut, not a death), its passes stop.
    let renewal_refused = "a lease whose session ended no longer renewed";
    test_support::until(Duration::from_secs(10), renewal_refused, || async {
        !s.work_renew(id, held[0].lease_token, long).await.unwrap()
    })
    .await;
    assert!(matches!(
        s.under_lease(id, held[0].lease_token)
            .event_append(id, "Late", "session gone")
            .await,
        Err(region_store::StoreError::LeaseLost)
    ));
    let freed = "the dead worker's lease freed";
    let taken = test_support::eventually(Duration::from_secs(10), freed, || async {
        let got = s.work_claim("b", LEASE, 10).await.unwrap();
        (!got.is_empty()).then_some(got)
    })
    .await;
    assert_eq!(taken[0].di_id, id);
    assert!(taken[0].lease_expired, "taken over from the dead worker");
    assert!(!s.work_renew(id, held[0].lease_token, long).await.unwrap());
}

/// Each worker claims only the DIs of its share of the clusters (VPCs): the live workers' shares
/// cover every cluster once, and a worker that dies leaves its share to the others.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn workers_share_the_clusters_and_a_dead_workers_share_moves(pool: PgPool) {
    use std::collections::{HashMap, HashSet};
    let s = store(pool.clone());
    let mut vpc_of = HashMap::new();
    for i in 0..40u128 {
        let id = create(&s, Uuid::new_v4()).await;
        // Two DIs per VPC.
        let vpc = Uuid::from_u128(1000 + i / 2);
        sqlx::query("UPDATE dedicated_inferences SET vpc_uuid = $2 WHERE id = $1")
            .bind(id)
            .bind(vpc)
            .execute(&pool)
            .await
            .unwrap();
        vpc_of.insert(id, vpc);
    }
    let mut conns = Vec::new();
    let mut sessions = Vec::new();
    for name in ["a", "b"] {
        let mut conn = pool.acquire().await.unwrap().detach();
        let session = region_store::HolderSession::of(&mut conn).await.unwrap();
        region_store::worker_register(&mut conn, name, session)
            .await
            .unwrap();
        conns.push(conn);
        sessions.push(session);
    }
    // Worker a's claims, in its session.
    let claim_a = || async {
        s.work_claim_in_session("a", Some(sessions[0]), LEASE, 100)
            .await
            .unwrap()
    };
    let a = claim_a().await;
    let b = s
        .work_claim_in_session("b", Some(sessions[1]), LEASE, 100)
        .await
        .unwrap();
    assert!(
        !a.is_empty() && !b.is_empty(),
        "{} and {}",
        a.len(),
        b.len()
    );
    assert_eq!(a.len() + b.len(), 40, "every DI is someone's");
    let vpcs = |c: &[region_store::Claim]| -> HashSet<Uuid> {
        c.iter().map(|c| vpc_of[&c.di_id]).collect()
    };
    assert!(vpcs(&a).is_disjoint(&vpcs(&b)), "a cluster is one worker's");
    for c in &a {
        s.work_release(c.di_id, c.lease_token, c.seq, Duration::ZERO)
            .await
            .unwrap();
    }
    // Nothing of b's share is a's while b lives, even with b's DIs due again.
    for c in &b {
        s.work_release(c.di_id, c.lease_token, c.seq, Duration::ZERO)
            .await
            .unwrap();
    }
    let again = claim_a().await;
    assert_eq!(vpcs(&again), vpcs(&a));
    let release_all = |claims: Vec<region_store::Claim>| {
        let s = s.clone();
        async move {
            for c in claims {
                s.work_release(c.di_id, c.lease_token, c.seq, Duration::ZERO)
                    .await
                    .unwrap();
            }
        }
    };
    release_all(again).await;
    // A worker that stops saying it works (a hung process keeps its session open) loses its
    // share until it says so again.
    sqlx::query("UPDATE workers SET seen_at = now() - interval '1 minute' WHERE worker_id = 'b'")
        .execute(&pool)
        .await
        .unwrap();
    let hung = claim_a().await;
    assert_eq!(hung.len(), 40, "b's share taken while b is silent");
    release_all(hung).await;
    assert!(
        region_store::worker_heartbeat(&mut conns[1], "b", sessions[1])
            .await
            .unwrap()
    );
    let back = claim_a().await;
    assert_eq!(vpcs(&back), vpcs(&a), "b's share is b's again");
    release_all(back).await;
    // A DI of b's overdue by a minute (b stuck, or with more than it can do) is anyone's.
    let late = b[0].di_id;
    age(&pool, late, Duration::from_secs(61)).await;
    let with_late = claim_a().await;
    assert!(with_late.iter().any(|c| c.di_id == late));
    assert_eq!(with_late.len(), a.len() + 1);
    release_all(with_late).await;
    // So is one of b's with a change a customer asked for over a minute ago and no pass since;
    // a change as old that a pass has just seen past is not (the pass ran long).
    let changed = b[1].di_id;
    sqlx::query(
        "INSERT INTO outbox (di_id, kind, requested, created_at)
         VALUES ($1, 'token', true, now() - interval '2 minutes')",
    )
    .bind(changed)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE work_items SET next_check_after = now() + interval '1 hour' WHERE di_id = $1",
    )
    .bind(changed)
    .execute(&pool)
    .await
    .unwrap();
    let fresh_pass = claim_a().await;
    assert!(
        !fresh_pass.iter().any(|c| c.di_id == changed),
        "b looked at it just now"
    );
    release_all(fresh_pass).await;
    sqlx::query("UPDATE work_items SET checked_at = now() - interval '2 minutes' WHERE di_id = $1")
        .bind(changed)
        .execute(&pool)
        .await
        .unwrap();
    let with_changed = claim_a().await;
    assert!(with_changed.iter().any(|c| c.di_id == changed));
    release_all(with_changed).await;
    // A worker that begins to stop withdraws: its share is the others' at once, while its
    // session (and the leases of the passes it lets finish) lives on.
    region_store::worker_deregister(&mut conns[1], "b", sessions[1])
        .await
        .unwrap();
    let drained = claim_a().await;
    assert_eq!(drained.len(), 40, "b's share taken while b drains");
    release_all(drained).await;
    region_store::worker_register(&mut conns[1], "b", sessions[1])
        .await
        .unwrap();
    use sqlx::Connection;
    conns.pop().unwrap().close().await.unwrap();
    let all = test_support::eventually(Duration::from_secs(10), "b's share moved to a", || async {
        let got = claim_a().await;
        if got.len() == 40 {
            return Some(got);
        }
        for c in &got {
            s.work_release(c.di_id, c.lease_token, c.seq, Duration::ZERO)
                .await
                .unwrap();
        }
        None
    })
    .await;
    assert_eq!(vpcs(&all).len(), 20);
}

/// A renewal that the database refuses or that fails stops the pass at once (its lease may be
/// someone else's now).
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_failed_renewal_stops_the_pass(pool: PgPool) {
    use std::sync::Arc;
    let s = store(pool.clone());
    create(&s, Uuid::new_v4()).await;
    let lease = Duration::from_secs(2);
    let queue = worker::queue::Queue::new(s.clone(), "w", lease);
    let mut claim = queue.claim(1).await.unwrap().remove(0);
    // Held: the renewals go on.
    let lost = Arc::new(tokio::sync::Notify::new());
    let keep = queue.keep_alive(claim.clone(), lost.clone());
    assert!(
        tokio::time::timeout(lease * 2, lost.notified())
            .await
            .is_err(),
        "a held lease is kept"
    );
    drop(keep);
    // Refused: another token.
    claim.lease_token = Uuid::new_v4();
    let lost = Arc::new(tokio::sync::Notify::new());
    let _keep = queue.keep_alive(claim.clone(), lost.clone());
    tokio::time::timeout(lease * 4, lost.notified())
        .await
        .expect("a refused renewal stops the pass");
    // Failed: the database is gone.
    let lost = Arc::new(tokio::sync::Notify::new());
    let _keep = queue.keep_alive(claim, lost.clone());
    pool.close().await;
    tokio::time::timeout(lease * 4, lost.notified())
        .await
        .expect("a failed renewal stops the pass");
}

/// A fenced write of a worker and a customer's write of the regional service on one DI take
/// their locks in one order (the DI's row, then the lease's): neither waits for the other in a
/// cycle. The customer's write here holds the DI's row, as a PATCH does, while the worker
/// records a ledger entry (whose foreign key check needs that row), then updates the lease's row
/// (the PATCH's trace); both must commit.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_fenced_write_and_a_customers_write_do_not_deadlock(pool: PgPool) {
    let s = store(pool.clone());
    let id = create(&s, Uuid::new_v4()).await;
    let claim = s.work_claim("w", LEASE, 1).await.unwrap().remove(0);
    let fenced = s.under_lease(id, claim.lease_token);
    let mut patch = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM dedicated_inferences WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *patch)
        .await
        .unwrap();
    let worker =
        tokio::spawn(async move { fenced.ledger_record(id, "node_pool", "p", "c", None).await });
    // The worker's write must have reached its first lock (and block on the DI's row) before
    // the customer's write goes on: Postgres shows it waiting.
    test_support::until(
        Duration::from_secs(10),
        "the worker's write waiting for the row",
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting > 0
        },
    )
    .await;
    sqlx::query("UPDATE work_items SET traceparent = NULL WHERE di_id = $1")
        .bind(id)
        .execute(&mut *patch)
        .await
        .expect("the customer's write is not a deadlock victim");
    patch.commit().await.unwrap();
    worker
        .await
        .unwrap()
        .expect("the worker's write is not a deadlock victim");
}
