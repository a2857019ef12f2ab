//! The regional store on real Postgres (`#[sqlx::test]` gives each test a fresh database).

use api_types::lifecycle::Status;
use api_types::regional::{CreateRequest, NewToken};
use api_types::spec::{AcceleratorGroup, ModelDeployment, Spec};
use common::seal::Sealer;
use region_store::{
    Endpoints, FleetBudget, Held, NewCa, ObservedAccelerator, ResealReport, RolloutState, Store,
    StoreError, Take,
};
use sqlx::PgPool;
use uuid::Uuid;

fn store(pool: PgPool) -> Store {
    Store::new(pool, Sealer::from_base64(&Sealer::generate_key()).unwrap())
}

fn spec(name: &str, scale: i32) -> Spec {
    Spec {
        version: 1,
        name: name.into(),
        region: "atl1".into(),
        vpc_uuid: Some(Uuid::from_u128(7)),
        enable_public_endpoint: true,
        model_deployments: vec![ModelDeployment {
            model_id: None,
            model_slug: "qwen/qwen2.5-7b-instruct".into(),
            model_provider: "hugging_face".into(),
            provider_model_id: String::new(),
            source: api_types::spec::ModelSource::default(),
            workload_config: serde_json::json!({}),
            accelerators: vec![AcceleratorGroup {
                accelerator_slug: "gpu-h100x1-80gb".into(),
                role: "prefill_decode".into(),
                scale,
            }],
        }],
    }
}

fn create_request(team: Uuid, hf: Option<&str>) -> CreateRequest {
    CreateRequest {
        id: Uuid::new_v4(),
        team_id: team,
        spec: spec("di", 1),
        hugging_face_token: hf.map(str::to_owned),
        managed_token: NewToken {
            id: Uuid::new_v4(),
            name: "managed".into(),
            sha256_hex: common::tokens::sha256_hex(&Uuid::new_v4().to_string()),
        },
    }
}

fn ca() -> NewCa {
    ca_until("MIIB", 1095)
}

/// A stand-in CA whose certificate reads `cert` and that the control plane uses for `days`.
fn ca_until(cert: &str, days: i64) -> NewCa {
    NewCa {
        cert_pem: format!("-----BEGIN CERTIFICATE-----\n{cert}\n-----END CERTIFICATE-----\n"),
        key_pem: "-----BEGIN PRIVATE KEY-----\nsecret-key\n-----END PRIVATE KEY-----\n".into(),
        not_after: chrono::Utc::now() + chrono::Duration::days(days),
    }
}

async fn outbox_len(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn create_is_idempotent_on_id(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let req = create_request(team, Some("hf_secret_value"));
    let first = store.dedicated_inference_create(&req, &ca()).await.unwrap();
    assert_eq!(first.status, Status::New);
    assert_eq!(first.pending_spec.as_ref().unwrap().version, 1);
    assert!(first.spec.is_none());
    let again = store.dedicated_inference_create(&req, &ca()).await.unwrap();
    assert_eq!(first, again);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM dedicated_inferences")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    assert_eq!(outbox_len(&pool).await, 1);
    // Another team cannot claim the id.
    let mut stolen = req.clone();
    stolen.team_id = Uuid::new_v4();
    assert!(matches!(
        store.dedicated_inference_create(&stolen, &ca()).await,
        Err(StoreError::Conflict(_))
    ));
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn secrets_are_sealed_at_rest(pool: PgPool) {
    let store = store(pool.clone());
    let req = create_request(Uuid::new_v4(), Some("hf_secret_value"));
    store.dedicated_inference_create(&req, &ca()).await.unwrap();
    let dump: String =
        sqlx::query_scalar("SELECT string_agg(encode(sealed, 'escape'), '') FROM provider_secrets")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!dump.contains("hf_secret_value"));
    let key: Vec<u8> = sqlx::query_scalar("SELECT key_sealed FROM certificate_authorities")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!String::from_utf8_lossy(&key).contains("secret-key"));
    assert_eq!(
        store.hugging_face_token(req.id).await.unwrap().as_deref(),
        Some("hf_secret_value")
    );
    assert!(store
        .certificate_authority(req.id)
        .await
        .unwrap()
        .key_pem
        .contains("secret-key"));
    // A store with another key cannot open them.
    let other = Store::new(pool, Sealer::from_base64(&Sealer::generate_key()).unwrap());
    assert!(matches!(
        other.hugging_face_token(req.id).await,
        Err(StoreError::Seal)
    ));
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn patch_versions_supersede_and_check_staleness(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let req = create_request(team, None);
    let created = store.dedicated_inference_create(&req, &ca()).await.unwrap();
    let model_id = created.pending_spec.unwrap().model_deployments[0].model_id;

    let mut next = spec("renamed", 2);
    next.model_deployments[0].model_id = model_id;
    let v2 = store
        .dedicated_inference_patch(req.id, team, Some(&next), None, false)
        .await
        .unwrap();
    assert_eq!(v2.pending_spec.as_ref().unwrap().version, 2);
    assert_eq!(
        v2.pending_spec.as_ref().unwrap().model_deployments[0].model_id,
        model_id,
        "model ids are kept"
    );
    assert_eq!(v2.status, Status::New, "never provisioned: still new");

    // Stale: version 1 again.
    let err = store
        .dedicated_inference_patch(req.id, team, Some(&next), None, false)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Conflict(ref m) if m.contains("current version is 2")),
        "{err:?}"
    );
    // Immutable fields.
    let mut moved = next.clone();
    moved.version = 2;
    moved.vpc_uuid = Some(Uuid::from_u128(8));
    assert!(matches!(
        store
            .dedicated_inference_patch(req.id, team, Some(&moved), None, false)
            .await,
        Err(StoreError::Unprocessable(_))
    ));
    // Unknown model ids.
    let mut foreign = next.clone();
    foreign.version = 2;
    foreign.model_deployments[0].model_id = Some(Uuid::new_v4());
    assert!(matches!(
        store
            .dedicated_inference_patch(req.id, team, Some(&foreign), None, false)
            .await,
        Err(StoreError::Unprocessable(_))
    ));
    // Gated model without any stored token.
    let mut gated = next.clone();
    gated.version = 2;
    assert!(matches!(
        store
            .dedicated_inference_patch(req.id, team, Some(&gated), None, true)
            .await,
        Err(StoreError::Unprocessable(_))
    ));
    assert!(store
        .dedicated_inference_patch(req.id, team, Some(&gated), Some("hf_new"), true)
        .await
        .is_ok());
    // Another team sees nothing.
    assert!(matches!(
        store
            .dedicated_inference_patch(req.id, Uuid::new_v4(), Some(&gated), None, false)
            .await,
        Err(StoreError::NotFound)
    ));
    // Every version row is kept.
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM spec_versions WHERE di_id = $1")
        .bind(req.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(versions, 3);
}

/// The commit a deployment's revision was pinned to is stored with its spec version and read
/// back with it; a version without one (a catalog model, or one stored before pinning) has none.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_pinned_commit_is_kept_with_its_spec_version(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let mut req = create_request(team, None);
    req.spec.model_deployments[0].source = api_types::spec::ModelSource {
        repository: "my-org/tune".into(),
        revision: Some("main".into()),
        custom: true,
        commit: Some(commit.into()),
    };
    let created = store.dedicated_inference_create(&req, &ca()).await.unwrap();
    let source = &created.pending_spec.unwrap().model_deployments[0].source;
    assert_eq!(source.commit.as_deref(), Some(commit));
    assert_eq!(source.revision.as_deref(), Some("main"));

    let v2 = store
        .dedicated_inference_patch(req.id, team, Some(&spec("di", 1)), None, false)
        .await
        .unwrap();
    let source = &v2.pending_spec.unwrap().model_deployments[0].source;
    assert_eq!(source.commit, None);
    // Only commit ids are stored.
    let mut bad = spec("di", 1);
    bad.version = 2;
    bad.model_deployments[0].source.commit = Some("main".into());
    assert!(matches!(
        store
            .dedicated_inference_patch(req.id, team, Some(&bad), None, false)
            .await,
        Err(StoreError::Database(_))
    ));
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn worker_transitions_write_events_and_outbox(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let req = create_request(team, None);
    store.dedicated_inference_create(&req, &ca()).await.unwrap();

    let r = store.provisioning_begin(req.id).await.unwrap();
    assert_eq!(r.status, Status::Provisioning);
    let again = store.provisioning_begin(req.id).await.unwrap();
    assert_eq!(again.seq, r.seq, "a repeated transition writes nothing");

    let ends = Endpoints {
        public_fqdn: Some("https://pub".into()),
        private_fqdn: Some("https://priv".into()),
    };
    assert!(
        matches!(
            store.rollout_complete(req.id, 2, &ends).await,
            Err(StoreError::Conflict(_))
        ),
        "not the pending version"
    );
    let active = store.rollout_complete(req.id, 1, &ends).await.unwrap();
    assert_eq!(active.status, Status::Active);
    assert!(active.pending_spec.is_none());
    assert_eq!(active.spec.as_ref().unwrap().version, 1);
    assert_eq!(active.public_endpoint_fqdn.as_deref(), Some("https://pub"));

    // A patch on an active DI moves it to updating; a newer patch supersedes the pending one.
    let mut v2 = spec("di", 2);
    v2.model_deployments[0].model_id = active.spec.as_ref().unwrap().model_deployments[0].model_id;
    let updating = store
        .dedicated_inference_patch(req.id, team, Some(&v2), None, false)
        .await
        .unwrap();
    assert_eq!(updating.status, Status::Updating);
    let mut v3 = v2.clone();
    v3.version = 2;
    v3.model_deployments[0].accelerators[0].scale = 3;
    store
        .dedicated_inference_patch(req.id, team, Some(&v3), None, false)
        .await
        .unwrap();
    assert!(
        matches!(
            store.rollout_complete(req.id, 2, &ends).await,
            Err(StoreError::Conflict(_))
        ),
        "v2 was superseded"
    );
    let done = store.rollout_complete(req.id, 3, &ends).await.unwrap();
    assert_eq!(
        (done.status, done.spec.as_ref().unwrap().version),
        (Status::Active, 3)
    );

    // A failure of a spec that a newer one superseded while the pass worked on it changes
    // nothing: the newer one is tried next.
    let mut v4 = v3.clone();
    v4.version = 3;
    v4.model_deployments[0].accelerators[0].scale = 50;
    store
        .dedicated_inference_patch(req.id, team, Some(&v4), None, false)
        .await
        .unwrap();
    let superseded = store
        .error_set(req.id, Some(3), "CapacityExhausted", "no GPUs left")
        .await
        .unwrap();
    assert_eq!(superseded.status, Status::Updating);
    let failed = store
        .error_set(req.id, Some(4), "CapacityExhausted", "no GPUs left")
        .await
        .unwrap();
    assert_eq!(
        (failed.status, failed.status_reason.as_deref()),
        (Status::Error, Some("CapacityExhausted"))
    );

    let deleting = store
        .dedicated_inference_delete(req.id, team)
        .await
        .unwrap();
    assert_eq!(deleting.status, Status::Deleting);
    let still = store
        .error_set(req.id, None, "Late", "a late failure")
        .await
        .unwrap();
    assert_eq!(still.status, Status::Deleting, "deletion wins over errors");
    let gone = store.gone(req.id).await.unwrap();
    assert!(gone.gone);
    assert!(matches!(
        store.dedicated_inference_get(req.id, team).await,
        Err(StoreError::NotFound)
    ));
    assert!(
        store.token_hashes(req.id).await.unwrap().is_empty(),
        "tokens die with the DI"
    );

    let page = store.events_list(req.id, team, 1, 200).await;
    assert!(
        matches!(page, Err(StoreError::NotFound)),
        "events of a gone DI are gone for customers"
    );
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM events WHERE di_id = $1 ORDER BY id")
            .bind(req.id)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        reasons,
        [
            "Created",
            "ProvisioningStarted",
            "RolloutComplete",
            "SpecAccepted",
            "SpecAccepted",
            "RolloutComplete",
            "SpecAccepted",
            "CapacityExhausted",
            "DeleteRequested",
            "Deleted"
        ]
    );
    assert_eq!(
        outbox_len(&pool).await,
        reasons.len() as i64,
        "one outbox entry per change"
    );
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn change_feed_resumes_and_includes_gone(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let a = create_request(team, None);
    let b = create_request(team, None);
    store.dedicated_inference_create(&a, &ca()).await.unwrap();
    store.dedicated_inference_create(&b, &ca()).await.unwrap();
    let all = store.changes_since(0, 100).await.unwrap();
    assert_eq!(all.records.len(), 2);
    let cursor = all.last_seq;
    assert!(store
        .changes_since(cursor, 100)
        .await
        .unwrap()
        .records
        .is_empty());
    store.dedicated_inference_delete(a.id, team).await.unwrap();
    store.gone(a.id).await.unwrap();
    let next = store.changes_since(cursor, 100).await.unwrap();
    assert_eq!(
        next.records.len(),
        1,
        "two changes of one DI come as its latest state"
    );
    assert!(next.records[0].gone);
    assert!(next.last_seq > cursor);
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn an_operation_sent_again_is_applied_once(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let req = create_request(team, None);
    store.dedicated_inference_create(&req, &ca()).await.unwrap();
    let events = || async { store.events_list(req.id, team, 1, 200).await.unwrap().total };

    // A patch whose answer central never got, sent again: without its operation id the repeat
    // would be a stale version (or, with the next version, a second spec).
    let patch = store.for_operation(Some(Uuid::new_v4()));
    let first = patch
        .dedicated_inference_patch(req.id, team, Some(&spec("di", 2)), None, false)
        .await
        .unwrap();
    let before = events().await;
    let again = patch
        .dedicated_inference_patch(req.id, team, Some(&spec("di", 2)), None, false)
        .await
        .unwrap();
    assert_eq!(again.pending_spec.as_ref().unwrap().version, 2);
    assert_eq!(again.seq, first.seq, "nothing changed");
    assert_eq!(events().await, before);
    // A refused operation records nothing: sent again, it is refused again.
    let stale = store.for_operation(Some(Uuid::new_v4()));
    for _ in 0..2 {
        assert!(matches!(
            stale
                .dedicated_inference_patch(req.id, team, Some(&spec("di", 3)), None, false)
                .await,
            Err(StoreError::Conflict(_))
        ));
    }

    // A token revoked twice by one operation is not "not found" the second time.
    let token = NewToken {
        id: Uuid::new_v4(),
        name: "ci".into(),
        sha256_hex: common::tokens::sha256_hex("di_value"),
    };
    let mint = store.for_operation(Some(Uuid::new_v4()));
    let made = mint.token_create(req.id, team, &token).await.unwrap();
    let revoke = store.for_operation(Some(Uuid::new_v4()));
    revoke.token_revoke(req.id, team, token.id).await.unwrap();
    revoke.token_revoke(req.id, team, token.id).await.unwrap();
    // A repeated create of a token answers with the token, even once the DI is being deleted.
    let delete = store.for_operation(Some(Uuid::new_v4()));
    delete
        .dedicated_inference_delete(req.id, team)
        .await
        .unwrap();
    assert_eq!(mint.token_create(req.id, team, &token).await.unwrap(), made);
    let before = events().await;
    let deleting = delete
        .dedicated_inference_delete(req.id, team)
        .await
        .unwrap();
    assert_eq!(deleting.status, Status::Deleting);
    assert_eq!(events().await, before);

    // Concurrent copies of one operation: one applies it, the other answers with its result.
    let other = create_request(team, None);
    store
        .dedicated_inference_create(&other, &ca())
        .await
        .unwrap();
    let racing = store.for_operation(Some(Uuid::new_v4()));
    let next = spec("di", 2);
    let (a, b) = tokio::join!(
        racing.dedicated_inference_patch(other.id, team, Some(&next), None, false),
        racing.dedicated_inference_patch(other.id, team, Some(&next), None, false),
    );
    assert_eq!(a.unwrap().pending_spec, b.unwrap().pending_spec);

    // Old operations are forgotten.
    assert_eq!(
        store
            .applied_operations_purge(std::time::Duration::ZERO)
            .await
            .unwrap(),
        5
    );
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn tokens_and_accelerators(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let req = create_request(team, None);
    store.dedicated_inference_create(&req, &ca()).await.unwrap();
    let token = NewToken {
        id: Uuid::new_v4(),
        name: "ci".into(),
        sha256_hex: common::tokens::sha256_hex("di_value"),
    };
    let made = store.token_create(req.id, team, &token).await.unwrap();
    assert_eq!(
        store.token_create(req.id, team, &token).await.unwrap(),
        made,
        "idempotent on id"
    );
    assert_eq!(
        store.tokens_list(req.id, team, 1, 20).await.unwrap().total,
        2
    );
    let hashes = store.token_hashes(req.id).await.unwrap();
    assert!(hashes
        .iter()
        .any(|(id, h)| *id == token.id && *h == common::tokens::sha256_hex("di_value")));
    store.token_revoke(req.id, team, token.id).await.unwrap();
    assert!(matches!(
        store.token_revoke(req.id, team, token.id).await,
        Err(StoreError::NotFound)
    ));
    assert_eq!(store.token_hashes(req.id).await.unwrap().len(), 1);

    let observed = |status: &str| {
        vec![ObservedAccelerator {
            name: "node-a".into(),
            slug: "gpu-h100x1-80gb".into(),
            role: "prefill_decode".into(),
            status: status.into(),
        }]
    };
    store
        .accelerators_replace(req.id, &observed("provisioning"))
        .await
        .unwrap();
    let first = store
        .accelerators_list(req.id, team, None, 1, 20)
        .await
        .unwrap();
    store
        .accelerators_replace(req.id, &observed("active"))
        .await
        .unwrap();
    let second = store
        .accelerators_list(req.id, team, None, 1, 20)
        .await
        .unwrap();
    assert_eq!(
        first.items[0].id, second.items[0].id,
        "ids are stable by name"
    );
    assert_eq!(second.items[0].status, "active");
    store.accelerators_replace(req.id, &[]).await.unwrap();
    assert_eq!(
        store
            .accelerators_list(req.id, team, None, 1, 20)
            .await
            .unwrap()
            .total,
        0
    );
}

/// A pass reads its inputs in one statement; they are what each separate read returns, with
/// every kind of row present (and a DI with none of them reads as empty).
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_pass_reads_in_one_statement_what_each_read_returns(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let bare = create_request(team, None);
    store
        .dedicated_inference_create(&bare, &ca())
        .await
        .unwrap();
    let empty = store.pass_inputs(bare.id).await.unwrap();
    assert!(empty.ledger.is_empty() && empty.accelerators.is_empty() && empty.replicas.is_empty());
    assert_eq!(empty.hugging_face_token, None);
    assert_eq!(empty.retired_probe_token, None);
    assert_eq!(empty.fleet_slot, None);
    assert_eq!(
        empty.probe_token,
        store.probe_token(bare.id).await.unwrap(),
        "minted on first read"
    );

    let req = create_request(team, Some("hf_secret"));
    let the_ca = ca();
    store
        .dedicated_inference_create(&req, &the_ca)
        .await
        .unwrap();
    let id = req.id;
    let token = NewToken {
        id: Uuid::new_v4(),
        name: "ci".into(),
        sha256_hex: common::tokens::sha256_hex("di_value"),
    };
    store.token_create(id, team, &token).await.unwrap();
    store.probe_token(id).await.unwrap();
    store.probe_token_rotate(id).await.unwrap();
    store
        .accelerators_replace(
            id,
            &[ObservedAccelerator {
                name: "node-a".into(),
                slug: "gpu-h100x1-80gb".into(),
                role: "prefill_decode".into(),
                status: "active".into(),
            }],
        )
        .await
        .unwrap();
    for (kind, name) in [("cluster", "c-1"), ("node_pool", "p-1")] {
        store
            .ledger_record(id, kind, name, "scope-1", Some("ext-1"))
            .await
            .unwrap();
    }
    let replicas = region_store::DeploymentReplicas {
        model_id: Uuid::new_v4(),
        ready: 1,
        wanted: 2,
        autoscaler: Some(serde_json::json!({"since": 5})),
    };
    store
        .replicas_record(id, std::slice::from_ref(&replicas), &[])
        .await
        .unwrap();
    sqlx::query("UPDATE dedicated_inferences SET status = 'active' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    store.fleet_register("r1").await.unwrap();
    store
        .fleet_take(id, "r1", BUDGET, &serde_json::json!({"was": 1}))
        .await
        .unwrap();

    let inputs = store.pass_inputs(id).await.unwrap();
    assert_eq!(inputs.ledger, store.ledger_entries(id).await.unwrap());
    assert_eq!(inputs.ledger.len(), 2);
    assert_eq!(inputs.accelerators.len(), 1);
    assert_eq!(inputs.token_hashes, store.token_hashes(id).await.unwrap());
    assert_eq!(inputs.token_hashes.len(), 2);
    assert_eq!(inputs.hugging_face_token.as_deref(), Some("hf_secret"));
    assert_eq!(inputs.probe_token, store.probe_token(id).await.unwrap());
    assert_eq!(
        inputs.retired_probe_token,
        store.retired_probe_token(id).await.unwrap()
    );
    assert!(inputs.retired_probe_token.is_some());
    assert_eq!(inputs.replicas, vec![replicas]);
    assert_eq!(inputs.fleet_slot, store.fleet_slot(id).await.unwrap());
    assert!(inputs.fleet_slot.is_some());
    let certs: Vec<(&str, &str)> = inputs
        .cas
        .iter()
        .map(|c| (c.cert_pem.as_str(), c.key_pem.as_str()))
        .collect();
    assert_eq!(certs, [(the_ca.cert_pem.as_str(), the_ca.key_pem.as_str())]);
    assert_eq!(
        inputs.cas[0].not_after.timestamp_micros(),
        the_ca.not_after.timestamp_micros()
    );
}

/// The feed loads each changed DI after it has read which DIs changed. A change of another DI
/// committed in between must not be skipped, whatever the loaded records' positions say.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn change_feed_never_skips_a_change_committed_while_it_loads(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let a = create_request(team, None);
    let b = create_request(team, None);
    store.dedicated_inference_create(&a, &ca()).await.unwrap();
    store.dedicated_inference_create(&b, &ca()).await.unwrap();
    let cursor = store.changes_since(0, 100).await.unwrap().last_seq;

    // A changes; the feed reads the batch (A only)…
    store.provisioning_begin(a.id).await.unwrap();
    let batch = store.changed_since(cursor, 100).await.unwrap();
    assert_eq!(batch.ids, [a.id]);
    // …then B changes, then A again, before the feed loads A's record.
    store.provisioning_begin(b.id).await.unwrap();
    store
        .event_append(a.id, "Slow", "still provisioning")
        .await
        .unwrap();
    let first = store.changes_load(batch).await.unwrap();
    assert_eq!(first.records.len(), 1);

    // The next poll must bring B's change.
    let next = store.changes_since(first.last_seq, 100).await.unwrap();
    let ids: Vec<Uuid> = next.records.iter().map(|r| r.id).collect();
    assert!(
        ids.contains(&b.id),
        "B's change was skipped: the cursor moved to {} past it",
        first.last_seq
    );
    let b_now = next.records.iter().find(|r| r.id == b.id).unwrap();
    assert_eq!(b_now.status, Status::Provisioning);
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn probe_tokens_are_per_di_sealed_rotated_and_deleted_with_the_di(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let (a, b) = (create_request(team, None), create_request(team, None));
    for req in [&a, &b] {
        store.dedicated_inference_create(req, &ca()).await.unwrap();
    }
    let token = store.probe_token(a.id).await.unwrap();
    assert!(token.starts_with("di_") && token.len() > 32, "{token}");
    assert_eq!(store.probe_token(a.id).await.unwrap(), token, "made once");
    assert_ne!(store.probe_token(b.id).await.unwrap(), token, "per DI");
    let dump: String =
        sqlx::query_scalar("SELECT string_agg(encode(sealed, 'escape'), '') FROM provider_secrets")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!dump.contains(&token), "sealed at rest");
    // Nothing customers see lists it.
    let listed = store.tokens_list(a.id, team, 1, 20).await.unwrap();
    assert_eq!(listed.total, 1, "only the managed token");

    let outbox = outbox_len(&pool).await;
    store.probe_token_rotate(a.id).await.unwrap();
    let rotated = store.probe_token(a.id).await.unwrap();
    assert_ne!(rotated, token);
    assert_eq!(
        outbox_len(&pool).await,
        outbox + 1,
        "the rotation wakes a worker"
    );

    store.dedicated_inference_delete(a.id, team).await.unwrap();
    assert!(matches!(
        store.probe_token_rotate(a.id).await,
        Err(StoreError::Conflict(_))
    ));
    store.gone(a.id).await.unwrap();
    assert!(matches!(
        store.probe_token(a.id).await,
        Err(StoreError::NotFound)
    ));
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_secrets WHERE di_id = $1")
        .bind(a.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

/// Every sealed value of DI `id` in the regional database: its provider secrets (Hugging Face
/// token, probe token) and its CA keys.
async fn sealed_values_of(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM provider_secrets WHERE di_id = $1)
              + (SELECT count(*) FROM certificate_authorities WHERE di_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_gone_di_leaves_no_secret_behind(pool: PgPool) {
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let (a, b) = (
        create_request(team, Some("hf_secret_value")),
        create_request(team, Some("hf_other_value")),
    );
    for req in [&a, &b] {
        store.dedicated_inference_create(req, &ca()).await.unwrap();
        store.probe_token(req.id).await.unwrap();
    }
    assert_eq!(
        sealed_values_of(&pool, a.id).await,
        3,
        "HF token, probe token, CA key"
    );

    // Being deleted, it keeps what teardown may need.
    store.dedicated_inference_delete(a.id, team).await.unwrap();
    assert_eq!(sealed_values_of(&pool, a.id).await, 3);
    assert_eq!(
        store.hugging_face_token(a.id).await.unwrap().as_deref(),
        Some("hf_secret_value")
    );

    store.gone(a.id).await.unwrap();
    assert_eq!(sealed_values_of(&pool, a.id).await, 0, "erased with the DI");
    assert_eq!(store.hugging_face_token(a.id).await.unwrap(), None);
    assert!(matches!(
        store.certificate_authority(a.id).await,
        Err(StoreError::NotFound)
    ));
    // The record stays, as a tombstone, and the other DI keeps its secrets.
    assert!(store.dedicated_inference_any(a.id).await.unwrap().gone);
    assert_eq!(sealed_values_of(&pool, b.id).await, 3);
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_ca_is_renewed_before_it_expires_and_retired_after(pool: PgPool) {
    const WINDOW: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);
    let store = store(pool.clone());
    let team = Uuid::new_v4();
    let (expiring, fresh) = (create_request(team, None), create_request(team, None));
    let old = ca_until("OLD", 100);
    store
        .dedicated_inference_create(&expiring, &old)
        .await
        .unwrap();
    store
        .dedicated_inference_create(&fresh, &ca_until("FRESH", 1000))
        .await
        .unwrap();
    let due = store
        .certificate_authorities_due(WINDOW, 100)
        .await
        .unwrap();
    assert_eq!(due, [expiring.id], "only the CA within the window is due");

    let new = ca_until("NEW", 1095);
    assert!(store
        .certificate_authority_renew(expiring.id, &new, WINDOW)
        .await
        .unwrap());
    assert!(
        !store
            .certificate_authority_renew(expiring.id, &ca_until("THIRD", 1095), WINDOW)
            .await
            .unwrap(),
        "a second renewal (another replica's) finds it done"
    );
    assert!(store
        .certificate_authorities_due(WINDOW, 100)
        .await
        .unwrap()
        .is_empty());
    // During the overlap customers get both, the old one first, and the worker chooses from both.
    assert_eq!(
        store.ca_certificate(expiring.id, team).await.unwrap(),
        format!("{}{}", old.cert_pem, new.cert_pem)
    );
    let inputs = store.pass_inputs(expiring.id).await.unwrap();
    let certs: Vec<&str> = inputs.cas.iter().map(|c| c.cert_pem.as_str()).collect();
    assert_eq!(certs, [old.cert_pem.as_str(), new.cert_pem.as_str()]);
    assert_eq!(
        store
            .certificate_authority(expiring.id)
            .await
            .unwrap()
            .cert_pem,
        new.cert_pem
    );
    let events = store.events_list(expiring.id, team, 1, 50).await.unwrap();
    assert!(
        events
            .items
            .iter()
            .any(|e| e.reason == "CertificateAuthorityRenewed" && e.message.contains("/ca")),
        "the customer is told to fetch the new CA: {:?}",
        events.items
    );

    // Once the old one has expired (moved into the past here rather than waited for) it is no
    // longer published, and retiring deletes it with its key.
    sqlx::query("UPDATE certificate_authorities SET not_after = now() - interval '1 second' WHERE cert_pem = $1")
        .bind(&old.cert_pem)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        store.ca_certificate(expiring.id, team).await.unwrap(),
        new.cert_pem
    );
    assert_eq!(store.certificate_authorities_retire().await.unwrap(), 1);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM certificate_authorities WHERE di_id = $1")
            .bind(expiring.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 1);
    // A CA without a successor is never retired, even expired.
    sqlx::query("UPDATE certificate_authorities SET not_after = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(store.certificate_authorities_retire().await.unwrap(), 0);
    assert_eq!(
        store.ca_certificate(fresh.id, team).await.unwrap(),
        ca_until("FRESH", 0).cert_pem
    );

    // A DI being deleted gets no new CA.
    store
        .dedicated_inference_delete(fresh.id, team)
        .await
        .unwrap();
    assert_eq!(
        store
            .certificate_authorities_due(WINDOW, 100)
            .await
            .unwrap(),
        [expiring.id],
        "(whose CAs all expired just now)"
    );
    assert!(!store
        .certificate_authority_renew(fresh.id, &ca_until("LATE", 1095), WINDOW)
        .await
        .unwrap());
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_rotation_reseals_everything_and_then_the_old_key_can_go(pool: PgPool) {
    let (old_key, new_key) = (Sealer::generate_key(), Sealer::generate_key());
    let old = Store::new(pool.clone(), Sealer::from_base64(&old_key).unwrap());
    let team = Uuid::new_v4();
    let reqs: Vec<CreateRequest> = (0..5)
        .map(|i| create_request(team, Some(&format!("hf_{i}"))))
        .collect();
    for req in &reqs {
        old.dedicated_inference_create(req, &ca()).await.unwrap();
        old.probe_token(req.id).await.unwrap();
    }
    let probe = old.probe_token(reqs[0].id).await.unwrap();

    // The new key seals, the old one still opens: everything reads as before, in small batches.
    let rotating = Store::new(
        pool.clone(),
        Sealer::from_keys(&new_key, &[old_key]).unwrap(),
    );
    let report = rotating.reseal(2).await.unwrap();
    assert_eq!(
        report.resealed, 15,
        "5 HF tokens, 5 probe tokens, 5 CA keys"
    );
    assert!(report.unreadable.is_empty());
    assert_eq!(
        rotating.reseal(2).await.unwrap(),
        ResealReport::default(),
        "a second run finds nothing left"
    );

    // The old key removed: every value opens with the new key alone.
    let rotated = Store::new(pool.clone(), Sealer::from_base64(&new_key).unwrap());
    for (i, req) in reqs.iter().enumerate() {
        assert_eq!(
            rotated.hugging_face_token(req.id).await.unwrap(),
            Some(format!("hf_{i}"))
        );
        assert!(rotated
            .certificate_authority(req.id)
            .await
            .unwrap()
            .key_pem
            .contains("secret-key"));
    }
    assert_eq!(rotated.probe_token(reqs[0].id).await.unwrap(), probe);
    // A value no configured key opens is reported, not rewritten.
    let stranger = Store::new(pool, Sealer::from_base64(&Sealer::generate_key()).unwrap());
    let report = stranger.reseal(100).await.unwrap();
    assert_eq!(report.resealed, 0);
    assert_eq!(report.unreadable.len(), 15);
}

// Fleet rollouts: slots are counted under the rollout's lock, so concurrent passes never exceed
// the budget or start a DI before the canaries served; only the newest rendering rolls; a
// failure halts the rollout until an operator resumes it.

const BUDGET: FleetBudget = FleetBudget {
    max_rolling: 5,
    canaries: 2,
};

/// `n` active DIs.
async fn active_dis(store: &Store, n: usize) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let req = create_request(Uuid::new_v4(), None);
        ids.push(
            store
                .dedicated_inference_create(&req, &ca())
                .await
                .unwrap()
                .id,
        );
    }
    sqlx::query("UPDATE dedicated_inferences SET status = 'active'")
        .execute(store.pool())
        .await
        .unwrap();
    ids
}

/// Every DI asks at once; the granted ones, canaries marked.
async fn ask_all(store: &Store, dis: &[Uuid], rendering: &str) -> Vec<(Uuid, bool)> {
    let asks = dis.iter().map(|id| {
        let (store, id, rendering) = (store.clone(), *id, rendering.to_string());
        tokio::spawn(async move {
            let taken = store
                .fleet_take(
                    id,
                    &rendering,
                    BUDGET,
                    &serde_json::json!({"vllm": {"template": {}}}),
                )
                .await
                .unwrap();
            (id, taken)
        })
    });
    let mut granted = Vec::new();
    for ask in asks {
        if let (id, Take::Granted { canary }) = ask.await.unwrap() {
            granted.push((id, canary));
        }
    }
    granted
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn canaries_first_then_never_more_than_the_budget(pool: PgPool) {
    let store = store(pool);
    let dis = active_dis(&store, 20).await;
    store.fleet_register("r1").await.unwrap();

    let canaries = ask_all(&store, &dis, "r1").await;
    assert_eq!(canaries.len(), 2, "{canaries:?}");
    assert!(canaries.iter().all(|(_, canary)| *canary));
    // One canary served: still no room for anyone else.
    store.fleet_done(canaries[0].0, "r1").await.unwrap();
    let waiting: Vec<Uuid> = dis
        .iter()
        .copied()
        .filter(|d| !canaries.iter().any(|c| c.0 == *d))
        .collect();
    assert_eq!(
        store
            .fleet_take(waiting[0], "r1", BUDGET, &serde_json::json!({}))
            .await
            .unwrap(),
        Take::Held(Held::CanariesFirst)
    );
    store.fleet_done(canaries[1].0, "r1").await.unwrap();
    let batch = ask_all(&store, &waiting, "r1").await;
    assert_eq!(batch.len(), 5, "{batch:?}");
    assert!(batch.iter().all(|(_, canary)| !canary));
    // A rolling DI that went to error (its passes no longer end its slot) gives its place back.
    sqlx::query("UPDATE dedicated_inferences SET status = 'error' WHERE id = $1")
        .bind(batch[0].0)
        .execute(store.pool())
        .await
        .unwrap();
    let rest: Vec<Uuid> = waiting
        .iter()
        .copied()
        .filter(|d| !batch.iter().any(|b| b.0 == *d))
        .collect();
    assert_eq!(ask_all(&store, &rest, "r1").await.len(), 1);
    let p = &store.fleet_progress().await.unwrap()[0];
    assert_eq!((p.rendering.as_str(), p.rolling, p.done), ("r1", 5, 2));
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn only_the_newest_rendering_rolls_and_an_operator_pauses_it(pool: PgPool) {
    let store = store(pool);
    let dis = active_dis(&store, 3).await;
    store.fleet_register("r1").await.unwrap();
    store.fleet_register("r2").await.unwrap();
    // A worker of the older version restarting does not become the newest again.
    store.fleet_register("r1").await.unwrap();
    let take = |id, r: &'static str| {
        let store = store.clone();
        async move {
            store
                .fleet_take(id, r, BUDGET, &serde_json::json!({}))
                .await
                .unwrap()
        }
    };
    assert_eq!(take(dis[0], "r1").await, Take::Held(Held::Superseded));
    let paused = store.fleet_set(RolloutState::Paused, None).await.unwrap();
    assert_eq!(
        (paused.rendering.as_str(), paused.state),
        ("r2", RolloutState::Paused)
    );
    assert_eq!(take(dis[0], "r2").await, Take::Held(Held::Paused));
    store.fleet_set(RolloutState::Rolling, None).await.unwrap();
    assert_eq!(take(dis[0], "r2").await, Take::Granted { canary: true });
    // Going back to r1 is the operator's explicit choice: it becomes the newest.
    let back = store
        .fleet_set(RolloutState::Rolling, Some("r1"))
        .await
        .unwrap();
    assert_eq!(back.rendering, "r1");
    assert_eq!(take(dis[1], "r2").await, Take::Held(Held::Superseded));
    assert_eq!(take(dis[1], "r1").await, Take::Granted { canary: true });
    // dis[0] still rolls r2: with dis[1], the canary budget of 2 is used, whatever the rendering.
    assert_eq!(take(dis[2], "r1").await, Take::Held(Held::CanariesFirst));
    // A customer's change takes dis[0] out: its place goes to the next DI.
    store.fleet_release(dis[0]).await.unwrap();
    assert!(store.fleet_slot(dis[0]).await.unwrap().is_none());
    assert_eq!(take(dis[2], "r1").await, Take::Granted { canary: true });
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_failed_slot_halts_the_rollout_until_it_is_resumed(pool: PgPool) {
    let store = store(pool);
    let dis = active_dis(&store, 3).await;
    store.fleet_register("r1").await.unwrap();
    let previous = serde_json::json!({"vllm-a": {"template": {"spec": {}}, "hash": "h1"}});
    assert_eq!(
        store
            .fleet_take(dis[0], "r1", BUDGET, &previous)
            .await
            .unwrap(),
        Take::Granted { canary: true }
    );
    store
        .fleet_failed(dis[0], "r1", "the model server crashed")
        .await
        .unwrap();
    let slot = store.fleet_slot(dis[0]).await.unwrap().unwrap();
    assert_eq!(slot.state, region_store::SlotState::Failed);
    assert_eq!(slot.previous, previous, "what the DI goes back to");
    match store
        .fleet_take(dis[1], "r1", BUDGET, &serde_json::json!({}))
        .await
        .unwrap()
    {
        Take::Held(Held::Halted { reason }) => {
            assert!(
                reason.contains("crashed") && reason.contains(&dis[0].to_string()),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    let events =
        sqlx::query_scalar::<_, String>("SELECT reason FROM events WHERE di_id = $1 ORDER BY id")
            .bind(dis[0])
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert!(
        events.ends_with(&["PlatformUpdate".into(), "PlatformUpdateFailed".into()]),
        "{events:?}"
    );
    let paused = store.fleet_set(RolloutState::Paused, None).await.unwrap();
    assert_eq!(
        paused.state,
        RolloutState::Halted,
        "a pause does not hide the halt"
    );
    let resumed = store.fleet_set(RolloutState::Rolling, None).await.unwrap();
    assert_eq!(
        (resumed.state, resumed.failed, resumed.reason),
        (RolloutState::Rolling, 0, None)
    );
    assert!(
        store.fleet_slot(dis[0]).await.unwrap().is_none(),
        "it tries again"
    );
    assert_eq!(
        store
            .fleet_take(dis[1], "r1", BUDGET, &serde_json::json!({}))
            .await
            .unwrap(),
        Take::Granted { canary: true }
    );
}
