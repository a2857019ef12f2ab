//! Central's store on real Postgres.

use std::time::Duration;

use central_store::{
    CentralStore, CreateBegin, CreateState, DueCreate, DueOperation, IdempotencyState,
    KeyedOperation, NewCreate, ReadModelUpdate, StoreError,
};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

fn new_create<'a>(id: Uuid, team: Uuid, name: &'a str, key: Option<&'a str>) -> NewCreate<'a> {
    NewCreate {
        di_id: id,
        team_id: team,
        region: "atl1",
        name,
        fingerprint: b"fp",
        sealed_intent: b"sealed",
        idempotency_key: key,
    }
}

fn update<'a>(
    id: Uuid,
    team: Uuid,
    name: &'a str,
    status: &'a str,
    body: &'a serde_json::Value,
    seq: i64,
) -> ReadModelUpdate<'a> {
    ReadModelUpdate {
        id,
        team_id: team,
        region: "atl1",
        name,
        status,
        body: Some(body),
        gone: false,
        seq,
    }
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn create_lifecycle_and_name_uniqueness(pool: PgPool) {
    let store = CentralStore::new(pool);
    let team = Uuid::new_v4();
    let id = Uuid::new_v4();
    assert_eq!(
        store
            .create_begin(&new_create(id, team, "a", Some("k")))
            .await
            .unwrap(),
        CreateBegin::Started
    );
    // The name is reserved while pending, for this team only.
    assert!(matches!(
        store
            .create_begin(&new_create(Uuid::new_v4(), team, "a", None))
            .await,
        Err(StoreError::NameTaken)
    ));
    assert_eq!(
        store
            .create_begin(&new_create(Uuid::new_v4(), Uuid::new_v4(), "a", None))
            .await
            .unwrap(),
        CreateBegin::Started
    );
    // The same key again is taken, and says which create it belongs to.
    assert_eq!(
        store
            .create_begin(&new_create(Uuid::new_v4(), team, "b", Some("k")))
            .await
            .unwrap(),
        CreateBegin::KeyTaken
    );
    assert!(
        matches!(store.idempotency_state(team, "k", b"fp").await.unwrap(), IdempotencyState::Unfinished { di_id: Some(d), sealed_operation: None } if d == id)
    );
    assert!(matches!(
        store.idempotency_state(team, "k", b"other").await.unwrap(),
        IdempotencyState::Mismatch
    ));
    // An identical retry finds the create by its fingerprint; another request does not.
    let by_fingerprint = |fingerprint: &'static [u8]| {
        store.create_by_fingerprint(team, "a", fingerprint, Duration::from_secs(24 * 3600))
    };
    assert_eq!(by_fingerprint(b"fp").await.unwrap(), Some(id));
    assert_eq!(by_fingerprint(b"different").await.unwrap(), None);
    assert_eq!(
        store.create_state(id).await.unwrap(),
        Some(CreateState::Pending {
            team_id: team,
            sealed_intent: b"sealed".to_vec()
        })
    );

    // Pending DIs are invisible to reads.
    assert_eq!(
        store
            .dedicated_inference_list(team, None, None, 1, 20)
            .await
            .unwrap()
            .1,
        0
    );

    let body = json!({"id": id, "status": "new"});
    store
        .create_confirm(
            &update(id, team, "a", "new", &body, 1),
            202,
            b"sealed-response",
        )
        .await
        .unwrap();
    // Settled: the response is kept for identical retries, with or without the key.
    let settled = CreateState::Settled {
        team_id: team,
        status_code: 202,
        sealed_response: b"sealed-response".to_vec(),
    };
    assert_eq!(store.create_state(id).await.unwrap(), Some(settled.clone()));
    assert_eq!(by_fingerprint(b"fp").await.unwrap(), Some(id));
    // A second confirmation (a concurrent retry, recovery) keeps the first response.
    store
        .create_confirm(&update(id, team, "a", "new", &body, 1), 202, b"later")
        .await
        .unwrap();
    assert_eq!(store.create_state(id).await.unwrap(), Some(settled));
    match store
        .idempotency_begin(team, "k", b"fp", None)
        .await
        .unwrap()
    {
        IdempotencyState::Done {
            status_code,
            sealed_body,
        } => assert_eq!(
            (status_code, sealed_body.as_slice()),
            (202, &b"sealed-response"[..])
        ),
        other => panic!("expected a stored response, got {other:?}"),
    }
    let (bodies, total) = store
        .dedicated_inference_list(team, None, None, 1, 20)
        .await
        .unwrap();
    assert_eq!(total, 1);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&bodies[0]).unwrap(),
        body
    );

    // Deleting frees the name.
    let deleting = json!({"id": id, "status": "deleting"});
    store
        .read_model_apply(&update(id, team, "a", "deleting", &deleting, 2))
        .await
        .unwrap();
    assert_eq!(
        store
            .create_begin(&new_create(Uuid::new_v4(), team, "a", None))
            .await
            .unwrap(),
        CreateBegin::Started
    );
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn read_model_ignores_older_views(pool: PgPool) {
    let store = CentralStore::new(pool);
    let team = Uuid::new_v4();
    let id = Uuid::new_v4();
    let newer = json!({"status": "active"});
    let older = json!({"status": "new"});
    store
        .read_model_apply(&update(id, team, "x", "active", &newer, 5))
        .await
        .unwrap();
    store
        .read_model_apply(&update(id, team, "x", "new", &older, 3))
        .await
        .unwrap();
    let owned = store.dedicated_inference(id, team).await.unwrap().unwrap();
    assert_eq!(owned.status, "active");
    assert!(
        store
            .dedicated_inference(id, Uuid::new_v4())
            .await
            .unwrap()
            .is_none(),
        "other teams see nothing"
    );
    // Gone is final.
    let gone = ReadModelUpdate {
        gone: true,
        ..update(id, team, "x", "deleting", &newer, 6)
    };
    store.read_model_apply(&gone).await.unwrap();
    store
        .read_model_apply(&update(id, team, "x", "active", &newer, 7))
        .await
        .unwrap();
    assert_eq!(
        store
            .dedicated_inference(id, team)
            .await
            .unwrap()
            .unwrap()
            .state,
        "gone"
    );
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn aborted_creates_leave_nothing(pool: PgPool) {
    let store = CentralStore::new(pool.clone());
    let team = Uuid::new_v4();
    let id = Uuid::new_v4();
    store
        .create_begin(&new_create(id, team, "gone-soon", Some("key")))
        .await
        .unwrap();
    store.create_abort(id).await.unwrap();
    for table in [
        "dedicated_inferences",
        "pending_creates",
        "idempotency_keys",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 0, "{table}");
    }
    assert!(matches!(
        store
            .idempotency_begin(team, "key", b"fp", None)
            .await
            .unwrap(),
        IdempotencyState::Fresh
    ));
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn recovery_backs_off_per_create_and_per_operation(pool: PgPool) {
    let store = CentralStore::new(pool);
    let team = Uuid::new_v4();
    let id = Uuid::new_v4();
    store
        .create_begin(&new_create(id, team, "slow", None))
        .await
        .unwrap();
    assert!(matches!(
        store
            .idempotency_begin(
                team,
                "op",
                b"fp",
                Some(KeyedOperation {
                    di_id: id,
                    sealed: b"sealed-op",
                }),
            )
            .await
            .unwrap(),
        IdempotencyState::Fresh
    ));
    assert!(
        store
            .pending_creates_due(Duration::from_secs(60))
            .await
            .unwrap()
            .is_empty(),
        "too young"
    );
    assert_eq!(
        store.pending_creates_due(Duration::ZERO).await.unwrap(),
        vec![DueCreate {
            di_id: id,
            team_id: team,
            attempts: 0
        }]
    );
    assert_eq!(
        store
            .unfinished_operations_due(Duration::ZERO)
            .await
            .unwrap(),
        vec![DueOperation {
            team_id: team,
            key: "op".into(),
            sealed_operation: b"sealed-op".to_vec(),
            attempts: 0
        }]
    );
    // A retry finds the operation it has to re-drive.
    assert!(matches!(
        store.idempotency_begin(team, "op", b"fp", Some(KeyedOperation { di_id: id, sealed: b"another" })).await.unwrap(),
        IdempotencyState::Unfinished { di_id: None, sealed_operation: Some(op) } if op == b"sealed-op"
    ));

    store
        .create_retry_later(id, Duration::from_secs(60))
        .await
        .unwrap();
    store
        .operation_retry_later(team, "op", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(store
        .pending_creates_due(Duration::ZERO)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .unfinished_operations_due(Duration::ZERO)
        .await
        .unwrap()
        .is_empty());
    store.create_retry_later(id, Duration::ZERO).await.unwrap();
    assert_eq!(
        store.pending_creates_due(Duration::ZERO).await.unwrap()[0].attempts,
        2
    );

    // Done operations are no longer due, and keep their first response.
    store
        .idempotency_complete(team, "op", 202, b"first")
        .await
        .unwrap();
    store
        .idempotency_complete(team, "op", 202, b"second")
        .await
        .unwrap();
    store
        .operation_retry_later(team, "op", Duration::ZERO)
        .await
        .unwrap();
    assert!(store
        .unfinished_operations_due(Duration::ZERO)
        .await
        .unwrap()
        .is_empty());
    assert!(matches!(
        store.idempotency_state(team, "op", b"fp").await.unwrap(),
        IdempotencyState::Done { sealed_body, .. } if sealed_body == b"first"
    ));
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn api_tokens(pool: PgPool) {
    let store = CentralStore::new(pool);
    let team = Uuid::new_v4();
    let id = store
        .api_token_create(
            team,
            "t",
            &[1u8; 32],
            &["dedicated_inference:read".into()],
            Some(10),
        )
        .await
        .unwrap();
    let found = store.api_token_by_hash(&[1u8; 32]).await.unwrap().unwrap();
    assert_eq!(
        (
            found.id,
            found.team_id,
            found.rate_limit_per_hour,
            found.revoked
        ),
        (id, team, Some(10), false)
    );
    let listed = store.api_tokens_of_team(team).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].id, listed[0].name.as_str()), (id, "t"));
    assert_eq!(listed[0].scopes, ["dedicated_inference:read"]);
    assert!(listed[0].revoked_at.is_none());
    assert!(store
        .api_tokens_of_team(Uuid::new_v4())
        .await
        .unwrap()
        .is_empty());
    store.api_token_revoke(id).await.unwrap();
    assert!(store.api_tokens_of_team(team).await.unwrap()[0]
        .revoked_at
        .is_some());
    assert!(
        store
            .api_token_by_hash(&[1u8; 32])
            .await
            .unwrap()
            .unwrap()
            .revoked
    );
    assert!(matches!(
        store.api_token_revoke(id).await,
        Err(StoreError::NotFound)
    ));
    assert!(store.api_token_by_hash(&[2u8; 32]).await.unwrap().is_none());
}

/// Starts the read caches of `replicas` (central replicas on one database) and waits until each
/// listens; abort the handles to stop them.
async fn caching(replicas: &[&CentralStore]) -> Vec<tokio::task::JoinHandle<()>> {
    let watchers = replicas
        .iter()
        .map(|r| tokio::spawn(r.watch_read_cache()))
        .collect();
    test_support::until(Duration::from_secs(10), "listeners connected", async || {
        replicas.iter().all(|r| r.read_cache_serving())
    })
    .await;
    watchers
}

/// Two central replicas on one database: each serves lookups from memory, sees its own writes at
/// once and the other's as soon as Postgres delivers the commit's notification.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn read_cache_is_coherent_across_replicas(pool: PgPool) {
    let a = CentralStore::new(pool.clone());
    let b = CentralStore::new(pool.clone());
    let team = Uuid::new_v4();
    let id = Uuid::new_v4();
    let body = json!({"status": "new"});
    // Committed before either replica listens, so its notification can never reach B late and
    // evict the row B is about to cache (which would make the check below read the database).
    a.read_model_apply(&update(id, team, "x", "new", &body, 1))
        .await
        .unwrap();
    let watchers = caching(&[&a, &b]).await;
    let ten_seconds = std::time::Duration::from_secs(10);
    let status = |s: &CentralStore| {
        let s = s.clone();
        async move {
            s.dedicated_inference(id, team)
                .await
                .unwrap()
                .unwrap()
                .status
                .clone()
        }
    };
    assert_eq!(status(&b).await, "new");

    // A write that sends no notification (its trigger off for that write) is invisible to a
    // replica that has the row cached: proof that B answers from memory.
    write_unnotified(
        &pool,
        "UPDATE dedicated_inferences SET status = 'unnotified' WHERE id = $1",
        id,
    )
    .await;
    assert_eq!(
        status(&b).await,
        "new",
        "B read the database, not its cache"
    );

    // A normal write: the writer reads it back at once, the other replica shortly after.
    let active = json!({"status": "active"});
    a.read_model_apply(&update(id, team, "x", "active", &active, 2))
        .await
        .unwrap();
    assert_eq!(status(&a).await, "active");
    test_support::until(ten_seconds, "replica B sees the write", async || {
        status(&b).await == "active"
    })
    .await;
    // Other teams still see nothing, cached or not.
    assert!(b
        .dedicated_inference(id, Uuid::new_v4())
        .await
        .unwrap()
        .is_none());
    for w in watchers {
        w.abort();
    }
}

/// A create that no attempt could settle within the replay window is handed to recovery to
/// give up; younger ones are not.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn creates_unsettled_past_the_window_are_given_up(pool: PgPool) {
    let store = CentralStore::new(pool.clone());
    let team = Uuid::new_v4();
    let (old, young) = (Uuid::new_v4(), Uuid::new_v4());
    for (id, name) in [(old, "old"), (young, "young")] {
        store
            .create_begin(&new_create(id, team, name, None))
            .await
            .unwrap();
    }
    sqlx::query(
        "UPDATE pending_creates SET created_at = now() - interval '25 hours' WHERE di_id = $1",
    )
    .bind(old)
    .execute(&pool)
    .await
    .unwrap();
    let day = Duration::from_secs(24 * 3600);
    assert_eq!(store.pending_creates_older_than(day).await.unwrap(), [old]);
    store.create_abort(old).await.unwrap();
    assert!(store
        .pending_creates_older_than(day)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store
            .pending_creates_due(Duration::ZERO)
            .await
            .unwrap()
            .len(),
        1,
        "the young one is still tried"
    );
}

/// Central reserves a new name before the region applies it, so the feed can bring a DI's older
/// name after another DI has taken it. The view is still applied, under central's name, and the
/// transaction it runs in stays usable.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn a_lagging_name_never_blocks_the_view(pool: PgPool) {
    let store = CentralStore::new(pool);
    let team = Uuid::new_v4();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let active = json!({"status": "active"});
    store
        .read_model_apply(&update(a, team, "x", "active", &active, 1))
        .await
        .unwrap();
    store.rename(a, team, "y").await.unwrap();
    assert_eq!(
        store
            .create_begin(&new_create(b, team, "x", None))
            .await
            .unwrap(),
        CreateBegin::Started
    );

    // The feed's view of A from before the rename: applied, A keeps its new name.
    let updating = json!({"status": "updating"});
    store
        .read_model_apply(&update(a, team, "x", "updating", &updating, 2))
        .await
        .unwrap();
    let seen = store.dedicated_inference(a, team).await.unwrap().unwrap();
    assert_eq!(
        (seen.status.as_str(), seen.name.as_str()),
        ("updating", "y")
    );

    // A create confirmed with a name another DI holds in central's view: still confirmed.
    let c = Uuid::new_v4();
    store
        .create_begin(&new_create(c, team, "c", None))
        .await
        .unwrap();
    store
        .create_confirm(
            &update(c, team, "y", "new", &json!({"status": "new"}), 3),
            202,
            b"resp",
        )
        .await
        .expect("confirm survives a name clash");
    let confirmed = store.dedicated_inference(c, team).await.unwrap().unwrap();
    assert_eq!(
        (confirmed.state.as_str(), confirmed.name.as_str()),
        ("live", "c")
    );
}

/// Every sealed value central keeps for DI `id`: its create's intent and first response, and
/// the responses and operations of idempotency keys about it.
async fn sealed_values_of(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pending_creates WHERE di_id = $1)
              + (SELECT count(*) FROM dedicated_inferences WHERE id = $1 AND create_response IS NOT NULL)
              + (SELECT count(sealed_body) + count(sealed_operation) FROM idempotency_keys
                 WHERE di_id = $1 OR target_di_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn a_gone_di_leaves_no_sealed_value(pool: PgPool) {
    let store = CentralStore::new(pool.clone());
    let team = Uuid::new_v4();
    let (id, other) = (Uuid::new_v4(), Uuid::new_v4());
    for (di, name, key) in [(id, "a", "create-a"), (other, "b", "create-b")] {
        store
            .create_begin(&new_create(di, team, name, Some(key)))
            .await
            .unwrap();
        let body = json!({"id": di, "status": "new"});
        store
            .create_confirm(
                &update(di, team, name, "new", &body, 1),
                202,
                b"sealed-token",
            )
            .await
            .unwrap();
        // A keyed token create, finished: its operation is no longer kept, its response is.
        let minted = KeyedOperation {
            di_id: di,
            sealed: b"sealed-op-with-token",
        };
        let token_key = format!("token-{name}");
        store
            .idempotency_begin(team, &token_key, b"fp", Some(minted))
            .await
            .unwrap();
        store
            .idempotency_complete(team, &token_key, 202, b"sealed-token-response")
            .await
            .unwrap();
        let kept: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT sealed_operation FROM idempotency_keys WHERE team_id = $1 AND key = $2",
        )
        .bind(team)
        .bind(&token_key)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(kept, None, "a finished operation is not kept");
        // A keyed patch still in flight.
        let patch = KeyedOperation {
            di_id: di,
            sealed: b"sealed-op-with-hf-token",
        };
        store
            .idempotency_begin(team, &format!("patch-{name}"), b"fp", Some(patch))
            .await
            .unwrap();
    }
    assert_eq!(sealed_values_of(&pool, id).await, 4);

    let gone = json!({"id": id, "status": "deleting"});
    store
        .read_model_apply(&ReadModelUpdate {
            gone: true,
            ..update(id, team, "a", "deleting", &gone, 9)
        })
        .await
        .unwrap();
    assert_eq!(sealed_values_of(&pool, id).await, 0, "erased with the DI");
    // Its keys still stand for their requests, so that none runs again, but replay nothing.
    assert!(matches!(
        store.idempotency_state(team, "create-a", b"fp").await.unwrap(),
        IdempotencyState::Erased { di_id: Some(d) } if d == id
    ));
    assert!(matches!(
        store
            .idempotency_state(team, "token-a", b"fp")
            .await
            .unwrap(),
        IdempotencyState::Erased { di_id: None }
    ));
    // The one in flight is over: the region would refuse it now.
    assert!(matches!(
        store
            .idempotency_state(team, "patch-a", b"fp")
            .await
            .unwrap(),
        IdempotencyState::Fresh
    ));
    assert_eq!(store.create_state(id).await.unwrap(), None);
    // The other DI keeps everything.
    assert_eq!(sealed_values_of(&pool, other).await, 4);
}

/// A create whose DI was deleted and is gone before its driver confirmed it (the feed made it
/// live first, so its customer could delete it): the confirm keeps no sealed response anywhere,
/// and the create's key reads as erased rather than replaying the managed token (found by
/// review).
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn a_create_confirmed_after_its_di_is_gone_keeps_no_response(pool: PgPool) {
    let store = CentralStore::new(pool.clone());
    let (team, id) = (Uuid::new_v4(), Uuid::new_v4());
    store
        .create_begin(&new_create(id, team, "late", Some("create-late")))
        .await
        .unwrap();
    let live = json!({"id": id, "status": "provisioning"});
    store
        .read_model_apply(&update(id, team, "late", "provisioning", &live, 1))
        .await
        .unwrap();
    let gone = json!({"id": id, "status": "deleting"});
    store
        .read_model_apply(&ReadModelUpdate {
            gone: true,
            ..update(id, team, "late", "deleting", &gone, 5)
        })
        .await
        .unwrap();
    // The driver's confirm arrives with the region's answer from before the delete.
    store
        .create_confirm(
            &update(id, team, "late", "new", &live, 1),
            202,
            b"sealed-token",
        )
        .await
        .unwrap();
    assert_eq!(sealed_values_of(&pool, id).await, 0);
    assert!(matches!(
        store
            .idempotency_state(team, "create-late", b"fp")
            .await
            .unwrap(),
        IdempotencyState::Erased { di_id: Some(d) } if d == id
    ));
}

/// Runs `statement` (on the DI `id`) with every trigger but the replicas' notification, which
/// it does not send.
async fn write_unnotified(pool: &PgPool, statement: &str, id: Uuid) {
    let mut tx = pool.begin().await.unwrap();
    let notify = |on: &str| {
        format!("ALTER TABLE dedicated_inferences {on} TRIGGER dedicated_inferences_notify")
    };
    sqlx::query(&notify("DISABLE"))
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(statement)
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(&notify("ENABLE"))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// A team's list served from memory agrees with the database page for page (filters, pages past
/// the end), follows the other replica's creates and deletes once Postgres delivers the commit's
/// notification and this replica's own writes at once, and a team too large to cache is paged
/// from the database.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn team_lists_are_served_from_memory_and_stay_coherent(pool: PgPool) {
    let a = CentralStore::new(pool.clone());
    let b = CentralStore::new(pool.clone());
    let uncached = CentralStore::new(pool.clone());
    let (team, other_team) = (Uuid::new_v4(), Uuid::new_v4());
    let apply = async |s: &CentralStore, id: Uuid, team: Uuid, region: &str, name: &str, seq| {
        let body = json!({"id": id, "name": name, "region": region});
        s.read_model_apply(&ReadModelUpdate {
            region,
            ..update(id, team, name, "active", &body, seq)
        })
        .await
        .unwrap();
    };
    let ids: Vec<Uuid> = (0..7).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        let region = if i % 2 == 0 { "atl1" } else { "nyc2" };
        apply(&a, *id, team, region, &format!("di-{i}"), 1).await;
    }
    apply(&a, Uuid::new_v4(), other_team, "atl1", "theirs", 1).await;
    let watchers = caching(&[&a, &b]).await;
    let ten_seconds = std::time::Duration::from_secs(10);
    let names = |s: &CentralStore,
                 region: Option<&'static str>,
                 name: Option<&'static str>,
                 page,
                 per_page| {
        let s = s.clone();
        async move {
            let (bodies, total) = s
                .dedicated_inference_list(team, region, name, page, per_page)
                .await
                .unwrap();
            let names: Vec<String> = bodies
                .iter()
                .map(|b| {
                    serde_json::from_str::<serde_json::Value>(b).unwrap()["name"]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect();
            (names, total)
        }
    };
    for (region, name) in [
        (None, None),
        (Some("nyc2"), None),
        (None, Some("di-4")),
        (Some("atl1"), Some("di-1")),
    ] {
        for (page, per_page) in [(1, 20), (1, 3), (2, 3), (3, 3), (4, 3), (9, 2)] {
            assert_eq!(
                names(&b, region, name, page, per_page).await,
                names(&uncached, region, name, page, per_page).await,
                "{region:?} {name:?} page {page} of {per_page}"
            );
        }
    }
    assert_eq!(
        names(&b, None, None, 1, 20).await.1,
        7,
        "only the team's own"
    );

    // A write that sends no notification is invisible to B: proof that it lists from memory.
    write_unnotified(
        &pool,
        "UPDATE dedicated_inferences SET state = 'gone' WHERE id = $1",
        ids[0],
    )
    .await;
    assert_eq!(
        names(&b, None, None, 1, 20).await.1,
        7,
        "B read the database"
    );
    assert_eq!(names(&uncached, None, None, 1, 20).await.1, 6);
    sqlx::query("UPDATE dedicated_inferences SET state = 'live' WHERE id = $1")
        .bind(ids[0])
        .execute(&pool)
        .await
        .unwrap();

    // A new DI from replica A: A lists it at once, B once the notification arrives.
    apply(&a, Uuid::new_v4(), team, "tor1", "newest", 1).await;
    assert_eq!(names(&a, None, None, 1, 20).await.1, 8);
    test_support::until(ten_seconds, "B lists the new DI", async || {
        names(&b, None, None, 3, 3).await.0 == ["di-6", "newest"]
    })
    .await;
    // B's own write: listed at once.
    apply(&b, Uuid::new_v4(), team, "tor1", "b-own", 1).await;
    assert_eq!(
        names(&b, Some("tor1"), None, 1, 20).await.0,
        ["newest", "b-own"]
    );

    // Past the size cached per team: pages come from the database, still right.
    sqlx::query(
        "INSERT INTO dedicated_inferences (id, team_id, region, name, state, status, body, created_at)
         SELECT gen_random_uuid(), $1, 'atl1', 'bulk-' || n, 'live', 'active',
                jsonb_build_object('name', 'bulk-' || n), now() + n * interval '1 second'
         FROM generate_series(1, 1000) n",
    )
    .bind(team)
    .execute(&pool)
    .await
    .unwrap();
    test_support::until(ten_seconds, "B sees the bulk insert", async || {
        names(&b, None, None, 1, 20).await.1 == 1009
    })
    .await;
    assert_eq!(
        names(&b, None, None, 50, 20).await,
        names(&uncached, None, None, 50, 20).await
    );
    let last = names(&b, None, None, 51, 20).await;
    assert_eq!(last, names(&uncached, None, None, 51, 20).await);
    assert_eq!(last.0.len(), 9);
    assert_eq!(last.0.last().unwrap(), "bulk-1000");
    for w in watchers {
        w.abort();
    }
}

/// What a team's list shows, read straight from `dedicated_inferences` as the first version
/// did: the oracle for the pages served from `team_list_members`.
async fn listed_from_rows(
    pool: &PgPool,
    team: Uuid,
    region: Option<&str>,
    name: Option<&str>,
    page: i64,
    per_page: i64,
) -> (Vec<String>, i64) {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT body::text, count(*) OVER () FROM dedicated_inferences
         WHERE team_id = $1 AND state = 'live' AND body IS NOT NULL
           AND ($2::text IS NULL OR region = $2) AND ($3::text IS NULL OR name = $3)
         ORDER BY created_at, id",
    )
    .bind(team)
    .bind(region)
    .bind(name)
    .fetch_all(pool)
    .await
    .unwrap();
    let total = rows.len() as i64;
    let page = rows
        .into_iter()
        .skip(((page - 1) * per_page) as usize)
        .take(per_page as usize)
        .map(|(body, _)| body)
        .collect();
    (page, total)
}

/// A team growing past and shrinking below the size cached per team, through every change its
/// DIs go through (creates pending and confirmed, aborted, renamed, new views, deleted), is
/// listed by every page and filter as its rows say, by a caching replica and an uncached one.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn a_large_teams_pages_follow_its_rows_through_every_change(pool: PgPool) {
    let cached = CentralStore::new(pool.clone());
    let uncached = CentralStore::new(pool.clone());
    let watchers = caching(&[&cached]).await;
    let (team, other_team) = (Uuid::new_v4(), Uuid::new_v4());
    // 245 listed DIs, oldest first, over two regions; another team's beside them.
    for t in [team, other_team] {
        sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, name, state, status, body, created_at)
             SELECT gen_random_uuid(), $1, CASE WHEN n % 3 = 0 THEN 'nyc2' ELSE 'atl1' END, 'seed-' || n,
                    'live', 'active', jsonb_build_object('name', 'seed-' || n, 'seq', 0),
                    now() - interval '1 day' + n * interval '1 second'
             FROM generate_series(1, 245) n",
        )
        .bind(t)
        .execute(&pool)
        .await
        .unwrap();
    }
    let mut listed: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, name FROM dedicated_inferences WHERE team_id = $1 ORDER BY created_at",
    )
    .bind(team)
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut pending: Vec<(Uuid, String)> = Vec::new();
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let (mut seq, mut crossed) = (1, [false, false]);
    for step in 0..240 {
        seq += 1;
        let body = |id: Uuid, name: &str, seq: i64| json!({"id": id, "name": name, "seq": seq});
        match next(10) {
            // A create reserves its name and shows nowhere until the region confirms it.
            0..=2 => {
                let (id, name) = (Uuid::new_v4(), format!("new-{step}"));
                cached
                    .create_begin(&new_create(id, team, &name, None))
                    .await
                    .unwrap();
                pending.push((id, name));
            }
            3..=5 if !pending.is_empty() => {
                let (id, name) = pending.swap_remove(next(pending.len()));
                if next(4) == 0 {
                    cached.create_abort(id).await.unwrap();
                } else {
                    let view = body(id, &name, seq);
                    cached
                        .create_confirm(&update(id, team, &name, "new", &view, seq), 202, b"r")
                        .await
                        .unwrap();
                    listed.push((id, name));
                }
            }
            6 if !listed.is_empty() => {
                let (id, name) = listed.remove(next(listed.len()));
                let view = body(id, &name, seq);
                cached
                    .read_model_apply(&ReadModelUpdate {
                        gone: true,
                        ..update(id, team, &name, "deleting", &view, seq)
                    })
                    .await
                    .unwrap();
            }
            7 if !listed.is_empty() => {
                let i = next(listed.len());
                let name = format!("renamed-{step}");
                cached.rename(listed[i].0, team, &name).await.unwrap();
                listed[i].1 = name;
            }
            _ if !listed.is_empty() => {
                let (id, name) = listed[next(listed.len())].clone();
                let view = body(id, &name, seq);
                cached
                    .read_model_apply(&update(id, team, &name, "active", &view, seq))
                    .await
                    .unwrap();
            }
            _ => continue,
        }
        crossed[usize::from(listed.len() > 250)] = true;
        let named = listed[next(listed.len())].1.clone();
        for (region, name) in [
            (None, None),
            (Some("nyc2"), None),
            (None, Some(named.as_str())),
            (Some("nyc2"), Some(named.as_str())),
        ] {
            for (page, per_page) in [(1, 20), (1 + next(40) as i64, 7), (13, 20), (200, 2)] {
                let expected = listed_from_rows(&pool, team, region, name, page, per_page).await;
                for store in [&cached, &uncached] {
                    let got = store
                        .dedicated_inference_list(team, region, name, page, per_page)
                        .await
                        .unwrap();
                    assert_eq!(
                        got, expected,
                        "step {step}: {region:?} {name:?} page {page} of {per_page}"
                    );
                }
            }
        }
        assert_eq!(
            listed_from_rows(&pool, team, None, None, 1, 1).await.1,
            listed.len() as i64,
            "the walk and the rows agree"
        );
    }
    assert_eq!(
        crossed,
        [true, true],
        "the team was listed from memory and not"
    );
    for w in watchers {
        w.abort();
    }
}

/// Central upgraded to kept list members starts from the lists as they are: live DIs with a
/// view, not pending creates, DIs gone, or a live row without a view.
#[sqlx::test(migrations = false)]
async fn the_upgrade_lists_every_team_as_before(pool: PgPool) {
    let (before, from) = central_store::MIGRATOR
        .iter()
        .partition::<Vec<_>, _>(|m| m.version < 7);
    for migration in before {
        sqlx::raw_sql(&migration.sql).execute(&pool).await.unwrap();
    }
    let teams = [Uuid::new_v4(), Uuid::new_v4()];
    for (n, (state, with_body)) in [
        ("live", true),
        ("pending", false),
        ("gone", true),
        ("live", false),
        ("live", true),
        ("live", true),
    ]
    .into_iter()
    .enumerate()
    {
        sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, name, state, status, body, created_at)
             VALUES (gen_random_uuid(), $1, $2, $3, $4, 'active',
                     CASE WHEN $5 THEN jsonb_build_object('name', $3::text) END,
                     now() + $6 * interval '1 second')",
        )
        .bind(teams[n % 2])
        .bind(if n < 3 { "atl1" } else { "nyc2" })
        .bind(format!("di-{n}"))
        .bind(state)
        .bind(with_body)
        .bind(n as f64)
        .execute(&pool)
        .await
        .unwrap();
    }
    for migration in from {
        sqlx::raw_sql(&migration.sql).execute(&pool).await.unwrap();
    }
    let store = CentralStore::new(pool.clone());
    for team in teams {
        for region in [None, Some("nyc2")] {
            let got = store
                .dedicated_inference_list(team, region, None, 1, 20)
                .await
                .unwrap();
            assert_eq!(
                got,
                listed_from_rows(&pool, team, region, None, 1, 20).await
            );
        }
    }
    let all = store
        .dedicated_inference_list(teams[0], None, None, 1, 20)
        .await
        .unwrap();
    assert_eq!(all.1, 2, "di-0 and di-4 of the first team");
}

/// A replica of this version that (re)starts on a database a newer version already migrated
/// further (a restart during a rolling upgrade, or a rollback) starts: sqlx's default refuses.
#[sqlx::test(migrator = "central_store::MIGRATOR")]
async fn a_database_migrated_by_a_newer_version_is_accepted(pool: PgPool) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99999999, 'from a newer version', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(
        central_store::MIGRATOR.run(&pool).await.is_err(),
        "sqlx's default refuses a migration it does not know"
    );
    CentralStore::new(pool.clone()).migrate().await.unwrap();
}
