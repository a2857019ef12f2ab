//! Quotas on real Postgres: what a team holds is counted in the transaction that stores a create
//! or patch, under the team's lock, so concurrent creates cannot overshoot; a lowered limit
//! leaves what runs alone.

use api_types::public::RegionQuotas;
use api_types::regional::{CreateRequest, NewToken, Record};
use api_types::spec::{AcceleratorGroup, ModelDeployment, Spec};
use common::seal::Sealer;
use region_store::{NewCa, QuotaOverrides, Quotas, Store, StoreError};
use sqlx::PgPool;
use uuid::Uuid;

const H1: &str = "gpu-h100x1-80gb";
const H8: &str = "gpu-h100x8-640gb";

fn store(pool: PgPool) -> Store {
    Store::new(pool, Sealer::from_base64(&Sealer::generate_key()).unwrap()).with_quotas(Quotas {
        region: "atl1".into(),
        dedicated_inferences: 3,
        gpus: 24,
        gpus_per_size: 16,
        gpus_per_node: [(H1.to_string(), 1), (H8.to_string(), 8)].into(),
    })
}

fn deployment(size: &str, scale: i32, workload_config: serde_json::Value) -> ModelDeployment {
    ModelDeployment {
        model_id: None,
        model_slug: "qwen/qwen2.5-7b-instruct".into(),
        model_provider: "hugging_face".into(),
        provider_model_id: String::new(),
        source: api_types::spec::ModelSource::default(),
        workload_config,
        accelerators: vec![AcceleratorGroup {
            accelerator_slug: size.into(),
            role: "prefill_decode".into(),
            scale,
        }],
    }
}

fn create(team: Uuid, deployments: Vec<ModelDeployment>) -> CreateRequest {
    CreateRequest {
        id: Uuid::new_v4(),
        team_id: team,
        spec: Spec {
            version: 1,
            name: "di".into(),
            region: "atl1".into(),
            vpc_uuid: Some(Uuid::from_u128(7)),
            enable_public_endpoint: true,
            model_deployments: deployments,
        },
        hugging_face_token: None,
        managed_token: NewToken {
            id: Uuid::new_v4(),
            name: "managed".into(),
            sha256_hex: common::tokens::sha256_hex(&Uuid::new_v4().to_string()),
        },
    }
}

/// Creates a DI of one deployment of `scale` nodes of `size`.
async fn create_one(
    store: &Store,
    team: Uuid,
    size: &str,
    scale: i32,
    workload_config: serde_json::Value,
) -> Result<Record, StoreError> {
    let req = create(team, vec![deployment(size, scale, workload_config)]);
    store.dedicated_inference_create(&req, &ca()).await
}

fn ca() -> NewCa {
    NewCa {
        cert_pem: "cert".into(),
        key_pem: "key".into(),
        not_after: (std::time::SystemTime::now() + std::time::Duration::from_secs(86_400)).into(),
    }
}

/// (limit, used) of the team's GPUs of `size`.
fn size_use(report: &RegionQuotas, size: &str) -> (u32, u32) {
    let u = report
        .gpus_per_size
        .iter()
        .find(|u| u.accelerator_slug == size)
        .expect("reported");
    (u.limit, u.used)
}

fn dis_use(report: &RegionQuotas) -> (u32, u32) {
    (
        report.dedicated_inferences.limit,
        report.dedicated_inferences.used,
    )
}

fn refused(result: Result<Record, StoreError>, says: &str) {
    match result {
        Err(StoreError::Unprocessable(m)) => assert!(m.contains(says), "{m}"),
        other => panic!("expected a quota refusal ({says}), got {other:?}"),
    }
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn concurrent_creates_of_one_team_cannot_overshoot(pool: PgPool) {
    let store = store(pool);
    let team = Uuid::new_v4();
    let attempts: Vec<_> = (0..10)
        .map(|_| {
            let (store, req) = (
                store.clone(),
                create(team, vec![deployment(H1, 1, serde_json::json!({}))]),
            );
            tokio::spawn(async move { store.dedicated_inference_create(&req, &ca()).await })
        })
        .collect();
    let (mut accepted, mut over) = (0, 0);
    for attempt in attempts {
        match attempt.await.unwrap() {
            Ok(_) => accepted += 1,
            Err(StoreError::Unprocessable(m)) if m.contains("dedicated inferences") => over += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!((accepted, over), (3, 7));
    let report = store.quota_use(team).await.unwrap();
    assert_eq!(dis_use(&report), (3, 3));
    assert_eq!(size_use(&report, H1), (16, 3));
    // Another team is not held back by the first.
    let other = Uuid::new_v4();
    create_one(&store, other, H1, 1, serde_json::json!({}))
        .await
        .unwrap();
}

/// A patch locks its DI's row and then its team; a create, its new row and then its team: racing
/// one another they neither deadlock nor, between them, overshoot a limit.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn concurrent_patches_and_creates_of_one_team_neither_deadlock_nor_overshoot(pool: PgPool) {
    let store = store(pool);
    for _ in 0..5 {
        let team = Uuid::new_v4();
        let mut patches = Vec::new();
        for _ in 0..2 {
            let di = create_one(&store, team, H1, 2, serde_json::json!({}))
                .await
                .unwrap();
            let mut spec = create(team, vec![deployment(H1, 8, serde_json::json!({}))]).spec;
            spec.version = 1;
            let store = store.clone();
            patches.push(tokio::spawn(async move {
                store
                    .dedicated_inference_patch(di.id, team, Some(&spec), None, false)
                    .await
            }));
        }
        let creating = {
            let store = store.clone();
            tokio::spawn(
                async move { create_one(&store, team, H1, 8, serde_json::json!({})).await },
            )
        };
        let mut results = Vec::new();
        for task in patches.into_iter().chain([creating]) {
            results.push(task.await.unwrap());
        }
        let accepted = results.iter().filter(|r| r.is_ok()).count();
        for r in results {
            if let Err(e) = r {
                assert!(
                    matches!(&e, StoreError::Unprocessable(m) if m.contains("GPUs")),
                    "only a quota refusal, no deadlock or other failure: {e:?}"
                );
            }
        }
        // 4 held; +6, +6, +8 against 16 of the size: two patches, or the create alone.
        assert!((1..=2).contains(&accepted), "{accepted}");
        let (limit, used) = size_use(&store.quota_use(team).await.unwrap(), H1);
        assert!(used <= limit, "{used} of {limit}");
    }
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn gpus_count_per_node_and_up_to_max_replicas(pool: PgPool) {
    let store = store(pool);
    let team = Uuid::new_v4();
    // Two nodes of eight GPUs: 16 of size H8, the whole size limit.
    create_one(&store, team, H8, 2, serde_json::json!({}))
        .await
        .unwrap();
    refused(
        create_one(&store, team, H8, 1, serde_json::json!({})).await,
        &format!("GPUs of size {H8} in atl1: spec.model_deployments needs 8 more, your team's limit is 16 and it holds 16, so 0 more fit"),
    );
    // An autoscaled deployment counts the replicas it may grow to, not those it starts with:
    // 16 + 9 is above the 24 GPUs in all.
    let autoscaled = serde_json::json!({"autoscaling": {"min_replicas": 0, "max_replicas": 9}});
    refused(
        create_one(&store, team, H1, 1, autoscaled).await,
        "GPUs in atl1, every size together: spec.model_deployments needs 9 more, your team's limit is 24 and it holds 16, so 8 more fit",
    );
    let autoscaled = serde_json::json!({"autoscaling": {"min_replicas": 0, "max_replicas": 8}});
    create_one(&store, team, H1, 1, autoscaled).await.unwrap();
    let report = store.quota_use(team).await.unwrap();
    assert_eq!((report.gpus.limit, report.gpus.used), (24, 24));
    assert_eq!(size_use(&report, H1), (16, 8));
}

#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_lowered_limit_refuses_only_what_grows_and_a_delete_frees_at_once(pool: PgPool) {
    let store = store(pool);
    let team = Uuid::new_v4();
    let first = create(team, vec![deployment(H1, 4, serde_json::json!({}))]);
    let di = store
        .dedicated_inference_create(&first, &ca())
        .await
        .unwrap();
    let second = create(team, vec![deployment(H1, 2, serde_json::json!({}))]);
    store
        .dedicated_inference_create(&second, &ca())
        .await
        .unwrap();

    // The operator lowers the team's limits below what it holds; the other limits stay.
    store
        .quota_overrides_set(
            team,
            &QuotaOverrides {
                dedicated_inferences: Some(1),
                gpus: None,
                gpus_per_size: [(H1.to_string(), 3)].into(),
            },
        )
        .await
        .unwrap();
    store
        .quota_overrides_set(
            team,
            &QuotaOverrides {
                gpus: Some(20),
                ..QuotaOverrides::default()
            },
        )
        .await
        .unwrap();
    let overrides = store.quota_overrides(team).await.unwrap();
    assert_eq!(
        (
            overrides.dedicated_inferences,
            overrides.gpus,
            overrides.gpus_per_size.get(H1)
        ),
        (Some(1), Some(20), Some(&3))
    );
    let report = store.quota_use(team).await.unwrap();
    assert_eq!(dis_use(&report), (1, 2));
    assert_eq!(size_use(&report, H1), (3, 6));

    // Both DIs stay as they are; a change that does not grow the team's use is accepted, one
    // that does is refused, and so is a third DI.
    let record = store.dedicated_inference_get(di.id, team).await.unwrap();
    assert!(record.pending_spec.is_some(), "nothing was touched");
    let mut spec = first.spec.clone();
    spec.name = "renamed".into();
    store
        .dedicated_inference_patch(di.id, team, Some(&spec), None, false)
        .await
        .unwrap();
    spec.version = 2;
    spec.model_deployments[0].accelerators[0].scale = 5;
    refused(
        store
            .dedicated_inference_patch(di.id, team, Some(&spec), None, false)
            .await,
        &format!("GPUs of size {H1} in atl1: spec.model_deployments needs 1 more"),
    );
    spec.model_deployments[0].accelerators[0].scale = 3;
    store
        .dedicated_inference_patch(di.id, team, Some(&spec), None, false)
        .await
        .unwrap();
    refused(
        create_one(&store, team, H8, 1, serde_json::json!({})).await,
        "dedicated inferences in atl1: your team's limit is 1 and it has 2",
    );

    // A DI being deleted stops counting at once; a retry of a create that landed is answered
    // with it, not refused by the quota it now fills.
    store.dedicated_inference_delete(di.id, team).await.unwrap();
    let report = store.quota_use(team).await.unwrap();
    assert_eq!(dis_use(&report), (1, 1));
    assert_eq!(size_use(&report, H1), (3, 2));
    let again = store
        .dedicated_inference_create(&second, &ca())
        .await
        .unwrap();
    assert_eq!(again.id, second.id);

    // Back to the service's limits.
    store.quota_overrides_clear(team).await.unwrap();
    let report = store.quota_use(team).await.unwrap();
    assert_eq!(dis_use(&report), (3, 1));
}

/// While a spec rolls out, a DI holds the more of what its current and its pending spec ask per
/// size: the old replicas serve until the new ones do (and go on serving if the rollout fails).
/// A scale-down or a move frees GPUs when it has rolled out, not when it is accepted: otherwise
/// a scale-down to a size the region has none of (the DI goes to `error`, its old nodes kept)
/// would let the team hold twice its limit.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn a_rollout_frees_gpus_when_it_completes_not_when_it_is_accepted(pool: PgPool) {
    let store = store(pool);
    let team = Uuid::new_v4();
    let first = create(team, vec![deployment(H1, 16, serde_json::json!({}))]);
    let di = store
        .dedicated_inference_create(&first, &ca())
        .await
        .unwrap();
    store.provisioning_begin(di.id).await.unwrap();
    store
        .rollout_complete(di.id, 1, &region_store::Endpoints::default())
        .await
        .unwrap();
    // Down to one H100 (or moved away from H100): accepted, but the sixteen still serve.
    let mut spec = first.spec.clone();
    spec.model_deployments[0].accelerators[0].scale = 1;
    store
        .dedicated_inference_patch(di.id, team, Some(&spec), None, false)
        .await
        .unwrap();
    assert_eq!(
        size_use(&store.quota_use(team).await.unwrap(), H1),
        (16, 16)
    );
    refused(
        create_one(&store, team, H1, 8, serde_json::json!({})).await,
        &format!("GPUs of size {H1} in atl1"),
    );
    // Rolled out: the fifteen are free.
    store.updating_begin(di.id).await.unwrap();
    store
        .rollout_complete(di.id, 2, &region_store::Endpoints::default())
        .await
        .unwrap();
    assert_eq!(size_use(&store.quota_use(team).await.unwrap(), H1), (16, 1));
    create_one(&store, team, H1, 8, serde_json::json!({}))
        .await
        .unwrap();
}

/// What a team holds is kept as its DIs change (migration 0017), not counted at each check. Any
/// mix of creates, patches, refusals, rollouts, failures, deletes and teardowns must leave it
/// equal to a count from scratch over the team's DIs, after every step.
#[sqlx::test(migrator = "region_store::MIGRATOR")]
async fn what_a_team_holds_is_kept_as_its_dis_change(pool: PgPool) {
    let store = Store::new(
        pool.clone(),
        Sealer::from_base64(&Sealer::generate_key()).unwrap(),
    )
    .with_quotas(Quotas {
        region: "atl1".into(),
        dedicated_inferences: 6,
        gpus: 40,
        gpus_per_size: 24,
        gpus_per_node: [(H1.to_string(), 1), (H8.to_string(), 8)].into(),
    });
    let teams = [Uuid::new_v4(), Uuid::new_v4()];
    // Each DI made, with its team and the spec it was created with.
    let mut dis: Vec<(Uuid, Uuid, Spec)> = Vec::new();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) % n
    };
    let (mut refused_for_quota, mut accepted) = (0, 0);
    for _ in 0..300 {
        let size = if next(3) == 0 { H8 } else { H1 };
        let scale = next(4) as i32 + 1;
        let config = if next(3) == 0 {
            serde_json::json!({"autoscaling": {"min_replicas": 0, "max_replicas": scale + 2}})
        } else {
            serde_json::json!({})
        };
        let op = next(7);
        let di = (!dis.is_empty()).then(|| dis[next(dis.len() as u64) as usize].clone());
        let outcome = match (op, di) {
            (0 | 1, _) | (_, None) => {
                let team = teams[next(2) as usize];
                let req = create(team, vec![deployment(size, scale, config)]);
                let created = store.dedicated_inference_create(&req, &ca()).await;
                if created.is_ok() {
                    dis.push((req.id, team, req.spec.clone()));
                }
                created.map(|_| ())
            }
            (2, Some((id, team, mut spec))) => {
                match store.dedicated_inference_get(id, team).await {
                    Ok(record) => {
                        spec.version = record.pending_spec.or(record.spec).expect("a spec").version;
                        spec.model_deployments = vec![deployment(size, scale, config)];
                        store
                            .dedicated_inference_patch(id, team, Some(&spec), None, false)
                            .await
                            .map(|_| ())
                    }
                    Err(e) => Err(e),
                }
            }
            (3, Some((id, team, _))) => {
                // The worker rolls the pending spec out, from whichever status the DI is in.
                let _ = store.provisioning_begin(id).await;
                let _ = store.updating_begin(id).await;
                match store.dedicated_inference_get(id, team).await {
                    Ok(record) => match record.pending_spec {
                        Some(pending) => store
                            .rollout_complete(
                                id,
                                pending.version,
                                &region_store::Endpoints::default(),
                            )
                            .await
                            .map(|_| ()),
                        None => Ok(()),
                    },
                    Err(e) => Err(e),
                }
            }
            (4, Some((id, _, _))) => store
                .error_set(id, None, "Stalled", "stalled")
                .await
                .map(|_| ()),
            (5, Some((id, team, _))) => {
                store.dedicated_inference_delete(id, team).await.map(|_| ())
            }
            (_, Some((id, _, _))) => store.gone(id).await.map(|_| ()),
        };
        match outcome {
            Ok(()) => accepted += 1,
            Err(StoreError::Unprocessable(m)) if m.contains("Quota exceeded") => {
                refused_for_quota += 1
            }
            Err(StoreError::Conflict(_) | StoreError::NotFound) => {}
            Err(e) => panic!("{e:?}"),
        }
        for team in teams {
            let report = store.quota_use(team).await.unwrap();
            let mut kept: Vec<(String, i64)> = report
                .gpus_per_size
                .iter()
                .filter(|u| u.used > 0)
                .map(|u| (u.accelerator_slug.clone(), i64::from(u.used)))
                .collect();
            kept.push((String::new(), report.dedicated_inferences.used.into()));
            kept.sort();
            assert_eq!(kept, counted_from_scratch(&pool, team).await, "team {team}");
        }
    }
    // The walk went through refusals as well as changes.
    assert!(
        refused_for_quota > 10 && accepted > 100,
        "{refused_for_quota} refused, {accepted} accepted"
    );
}

/// A team's GPUs per size (and its DIs under the empty size), counted over all of its DIs the
/// way quota checks counted them before migration 0017 (with its reading of `max_replicas`).
async fn counted_from_scratch(pool: &PgPool, team: Uuid) -> Vec<(String, i64)> {
    let mut rows: Vec<(String, i64)> = sqlx::query_as(
        "WITH counting AS (
             SELECT id, current_version, pending_version FROM dedicated_inferences
             WHERE team_id = $1 AND gone_at IS NULL AND status <> 'deleting'),
         versions AS (
             SELECT id, current_version AS version FROM counting WHERE current_version IS NOT NULL
             UNION
             SELECT id, pending_version FROM counting WHERE pending_version IS NOT NULL),
         per_version AS (
             SELECT v.id, v.version, g.accelerator_slug,
                    sum(CASE WHEN jsonb_typeof(m.workload_config #> '{autoscaling,max_replicas}') = 'number'
                             THEN greatest(g.scale, least(ceil((m.workload_config #>> '{autoscaling,max_replicas}')::numeric), 1000000))
                             ELSE g.scale END) AS replicas
             FROM versions v
             JOIN model_deployments m ON m.di_id = v.id AND m.version = v.version
             JOIN accelerator_groups g
               ON g.di_id = m.di_id AND g.version = m.version AND g.deployment_position = m.position
             GROUP BY v.id, v.version, g.accelerator_slug),
         per_di AS (
             SELECT id, accelerator_slug, max(replicas) AS replicas FROM per_version
             GROUP BY id, accelerator_slug)
         SELECT '', count(*) FROM counting
         UNION ALL
         SELECT accelerator_slug, sum(replicas)::bigint FROM per_di GROUP BY accelerator_slug",
    )
    .bind(team)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.iter_mut().for_each(|(size, n)| {
        if !size.is_empty() {
            *n *= if size == H8 { 8 } else { 1 };
        }
    });
    rows.sort();
    rows
}

/// A region upgraded to kept holdings starts from what its teams hold already: DIs being
/// deleted, rolling out, autoscaled or gone.
#[sqlx::test(migrations = false)]
async fn the_upgrade_counts_what_teams_hold_already(pool: PgPool) {
    let (before, from) = region_store::MIGRATOR
        .iter()
        .partition::<Vec<_>, _>(|m| m.version < 17);
    for migration in before {
        sqlx::raw_sql(&migration.sql).execute(&pool).await.unwrap();
    }
    let teams = [Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4()];
    // (team, status, current spec, pending spec, gone): a spec is (size, scale, max_replicas).
    use serde_json::json;
    let dis = [
        (0, "active", Some((H1, 2, None)), None, false),
        (
            0,
            "updating",
            Some((H1, 4, None)),
            Some((H8, 1, Some(json!(3)))),
            false,
        ),
        (0, "deleting", Some((H8, 2, None)), None, false),
        (0, "deleting", Some((H8, 2, None)), None, true),
        (1, "new", None, Some((H1, 1, Some(json!(5)))), false),
        (1, "error", Some((H8, 1, None)), Some((H8, 2, None)), false),
        // Stored before max_replicas was validated: anything. A fraction holds the next whole
        // number, what is not a number holds `scale`, and nothing holds above a million; none
        // of them stops the upgrade.
        (2, "active", Some((H1, 1, Some(json!("auto")))), None, false),
        (2, "active", Some((H1, 1, Some(json!(2.5)))), None, false),
        (2, "active", Some((H1, 1, Some(json!(1e19)))), None, false),
        (2, "active", Some((H1, 2, Some(json!(null)))), None, false),
    ];
    for (team, status, current, pending, gone) in dis {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, vpc_uuid, enable_public_endpoint, status,
                                               current_version, pending_version, gone_at)
             VALUES ($1, $2, 'atl1', $1, true, $3, $4, $5, CASE WHEN $6 THEN now() END)",
        )
        .bind(id)
        .bind(teams[team])
        .bind(status)
        .bind(current.as_ref().map(|_| 1))
        .bind(pending.as_ref().map(|_| 2))
        .bind(gone)
        .execute(&pool)
        .await
        .unwrap();
        for (version, spec) in [(1, current), (2, pending)] {
            let Some((size, scale, max_replicas)) = spec else {
                continue;
            };
            let config = match max_replicas {
                Some(max) => json!({"autoscaling": {"min_replicas": 0, "max_replicas": max}}),
                None => json!({}),
            };
            sqlx::query(
                "WITH v AS (INSERT INTO spec_versions (di_id, version, id, name, enable_public_endpoint, vpc_uuid)
                            VALUES ($1, $2, gen_random_uuid(), 'di', true, $1)),
                      m AS (INSERT INTO model_deployments (di_id, version, position, model_id, model_slug, model_provider, workload_config)
                            VALUES ($1, $2, 0, gen_random_uuid(), 'm', 'hugging_face', $5))
                 INSERT INTO accelerator_groups (di_id, version, deployment_position, position, accelerator_slug, role, scale)
                 VALUES ($1, $2, 0, 0, $3, 'prefill_decode', $4)",
            )
            .bind(id)
            .bind(version)
            .bind(size)
            .bind(scale)
            .bind(config)
            .execute(&pool)
            .await
            .unwrap();
        }
    }
    for migration in from {
        sqlx::raw_sql(&migration.sql).execute(&pool).await.unwrap();
    }
    let store = store(pool.clone());
    let expected = [
        vec![
            (String::new(), 2),
            (H1.to_string(), 6),
            (H8.to_string(), 24),
        ],
        vec![
            (String::new(), 2),
            (H1.to_string(), 5),
            (H8.to_string(), 16),
        ],
        vec![(String::new(), 4), (H1.to_string(), 1 + 3 + 1_000_000 + 2)],
    ];
    for (team, expected) in teams.into_iter().zip(expected) {
        assert_eq!(counted_from_scratch(&pool, team).await, expected);
        let figure = |size: &str| {
            expected
                .iter()
                .find(|(s, _)| s == size)
                .map_or(0, |(_, n)| *n as u32)
        };
        let report = store.quota_use(team).await.unwrap();
        assert_eq!(
            (
                dis_use(&report).1,
                size_use(&report, H1).1,
                size_use(&report, H8).1
            ),
            (figure(""), figure(H1), figure(H8))
        );
    }
}
