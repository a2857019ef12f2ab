//! Secrets die with their DI, the sealing key rotates, and a DI's CA is renewed, all through
//! the public API on the simulated cloud:
//! - after a DI is gone, no sealed value about it is left in its region's database or in
//!   central's, and what central answered under an Idempotency-Key is not replayed;
//! - the sealing keys of a region and of central are rotated (`regional reseal`, `central
//!   reseal`) while a DI serves, and after the old keys are removed the DI still reconciles;
//! - a DI's CA nearing its end gets a successor that `GET …/ca` publishes before the endpoint
//!   uses it, and a client trusting the bundle sees no failed request across the switch.

use std::collections::BTreeSet;
use std::future::ready;
use std::time::Duration;

use common::seal::Sealer;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;
use system_tests::{CloudOptions, Reply, System, HF_TOKEN};
use test_support::{until, within};
use uuid::Uuid;

use crate::lifecycle::{
    assert_chat_ok, ca_client, chat, create, di_path, fetch_ca, spec, start, wait_active,
    wait_gone, Caller, Created,
};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";
/// Gated on Hugging Face: its create carries the customer's Hugging Face token.
const GATED_MODEL: &str = "mistral/mistral-7b-instruct-v3";
const REGION: &str = "atl1";

async fn keyed(
    sys: &System,
    api: &str,
    method: Method,
    path: &str,
    key: &str,
    body: Option<Value>,
) -> Reply {
    let mut request = sys
        .http
        .request(method, sys.url(path))
        .bearer_auth(api)
        .header("idempotency-key", key);
    if let Some(body) = body {
        request = request.json(&body);
    }
    Reply::from(request.send().await.expect("central answers")).await
}

/// A second access token at `tokens` (a DI's `/tokens`), under the Idempotency-Key `token-1`.
async fn second_token(sys: &System, api: &str, tokens: &str) -> Reply {
    let name = Some(json!({"name": "second"}));
    keyed(sys, api, Method::POST, tokens, "token-1", name).await
}

async fn pool(url: &str) -> PgPool {
    PgPool::connect(url)
        .await
        .expect("connect to a test database")
}

/// Every `bytea` column of the database's own tables, as `table.column`: where sealed values
/// (and hashes) can be.
async fn bytea_columns(pool: &PgPool) -> BTreeSet<String> {
    sqlx::query_scalar(
        "SELECT table_name || '.' || column_name FROM information_schema.columns
         WHERE table_schema = 'public' AND data_type = 'bytea' AND table_name NOT LIKE '\\_sqlx%'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

fn set(columns: &[&str]) -> BTreeSet<String> {
    columns.iter().map(|c| c.to_string()).collect()
}

/// The region's sealed columns; the others hold hashes.
const REGION_SEALED: &[&str] = &[
    "certificate_authorities.key_sealed",
    "provider_secrets.sealed",
];
const REGION_HASHES: &[&str] = &["access_tokens.token_hash"];
/// Central's sealed columns; the others hold hashes.
const CENTRAL_SEALED: &[&str] = &[
    "dedicated_inferences.create_response",
    "idempotency_keys.sealed_body",
    "idempotency_keys.sealed_operation",
    "pending_creates.sealed",
];
const CENTRAL_HASHES: &[&str] = &[
    "api_tokens.token_hash",
    "dedicated_inferences.create_fingerprint",
    "idempotency_keys.fingerprint",
];

/// Sealed values about DI `id` in its region's database.
async fn region_sealed_values(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM provider_secrets WHERE di_id = $1)
              + (SELECT count(*) FROM certificate_authorities WHERE di_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Sealed values about DI `id` in central's database.
async fn central_sealed_values(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pending_creates WHERE di_id = $1)
              + (SELECT count(create_response) FROM dedicated_inferences WHERE id = $1)
              + (SELECT count(sealed_body) + count(sealed_operation) FROM idempotency_keys
                 WHERE di_id = $1 OR target_di_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_di_is_gone_no_secret_of_it_remains() {
    let mut sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let region_db = pool(&sys.region(REGION).database_url).await;
    let central_db = pool(&sys.central_config.database_url).await;
    // The guard of this test: a sealed column added later must be erased with the DI too, and
    // then listed here.
    let both = |a: &[&str], b: &[&str]| set(&[a, b].concat());
    assert_eq!(
        bytea_columns(&region_db).await,
        both(REGION_SEALED, REGION_HASHES)
    );
    assert_eq!(
        bytea_columns(&central_db).await,
        both(CENTRAL_SEALED, CENTRAL_HASHES)
    );

    // A create with the customer's Hugging Face token, under a key; it serves.
    let body = json!({
        "spec": spec(REGION, "short-lived", GATED_MODEL, 1),
        "access_tokens": {"hugging_face_token": HF_TOKEN},
    });
    let path = "/v2/dedicated-inferences";
    let created = keyed(
        &sys,
        &api,
        Method::POST,
        path,
        "create-1",
        Some(body.clone()),
    )
    .await;
    assert_eq!(
        created.status, 202,
        "{}",
        created.body["dedicated_inference"]
    );
    let di_id = created.body["dedicated_inference"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let id = Uuid::parse_str(&di_id).unwrap();
    let managed = created.body["token"]["value"].as_str().unwrap().to_string();
    let (active, _) = wait_active(&sys, &api, REGION, &di_id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di_id).await);
    assert_chat_ok(&client, &endpoint, &managed, GATED_MODEL).await;
    // A second token, under a key: central keeps its value to replay.
    let tokens = di_path(&di_id, "/tokens");
    let minted = second_token(&sys, &api, &tokens).await;
    assert_eq!(minted.status, 202);
    assert_eq!(
        region_sealed_values(&region_db, id).await,
        3,
        "the Hugging Face token, the probe token and the CA key"
    );
    assert_eq!(
        central_sealed_values(&central_db, id).await,
        3,
        "the create's response, its key's response, the token's response"
    );

    let deleted = keyed(
        &sys,
        &api,
        Method::DELETE,
        &di_path(&di_id, ""),
        "delete-1",
        None,
    )
    .await;
    assert_eq!(deleted.status, 202, "{}", deleted.body);
    wait_gone(&sys, &api, REGION, &di_id).await;

    assert_eq!(
        region_sealed_values(&region_db, id).await,
        0,
        "the region erased them"
    );
    assert_eq!(
        central_sealed_values(&central_db, id).await,
        0,
        "central erased them"
    );
    // The record stays in both (a tombstone and the ownership row), without its secrets.
    let tombstone: bool =
        sqlx::query_scalar("SELECT gone_at IS NOT NULL FROM dedicated_inferences WHERE id = $1")
            .bind(id)
            .fetch_one(&region_db)
            .await
            .unwrap();
    assert!(tombstone);
    // The keys still stand for their requests (nothing runs twice) but replay no secret: what
    // the same request about this DI gets now.
    let again = keyed(&sys, &api, Method::POST, path, "create-1", Some(body)).await;
    again.assert_error(409, "conflict");
    second_token(&sys, &api, &tokens)
        .await
        .assert_error(404, "not_found");
    let again = keyed(
        &sys,
        &api,
        Method::DELETE,
        &di_path(&di_id, ""),
        "delete-1",
        None,
    )
    .await;
    again.assert_error(404, "not_found");
}

/// Waits (up to 15 s) until a chat with `model` and `token` through `client` answers `status`.
async fn eventually_answers(
    client: &reqwest::Client,
    endpoint: &str,
    token: &str,
    model: &str,
    status: u16,
) {
    let last = std::cell::RefCell::new(None);
    let answered = within(Duration::from_secs(15), || async {
        match chat(client, endpoint, token, model).await {
            Ok((s, _)) if s == status => Some(()),
            other => {
                *last.borrow_mut() = Some(other);
                None
            }
        }
    })
    .await;
    if answered.is_none() {
        panic!(
            "{endpoint} never answered {status}; last: {:?}",
            last.into_inner()
        );
    }
}

/// Stops region `REGION`'s workers and service and starts them again sealing with `seal_key` and
/// opening also with `open`, as a rolling restart with new configuration does.
async fn restart_region(sys: &mut System, seal_key: &str, open: &[String]) {
    let region = sys.region(REGION);
    for i in 0..region.cloud.workers.len() {
        if region.cloud.workers[i].is_some() {
            region.kill_worker(i);
        }
    }
    region.server = None;
    region.seal_key = seal_key.to_string();
    region.seal_open_keys = open.to_vec();
    region.start().await;
    region.start_worker().await;
}

async fn restart_central(sys: &mut System, seal_key: &str, open: &[String]) {
    sys.central_config.seal_key = seal_key.to_string();
    sys.central_config.seal_open_keys = open.to_vec();
    sys.restart_central().await;
}

/// How many values of `columns` in the database are not sealed under `sealer`'s current key.
async fn not_under(pool: &PgPool, columns: &[&str], sealer: &Sealer) -> i64 {
    let mut n = 0;
    for column in columns {
        let (table, column) = column.split_once('.').unwrap();
        let count: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE {column} IS NOT NULL
               AND substring({column} from 1 for $1) <> $2"
        ))
        .bind(common::seal::PREFIX_LEN as i32)
        .bind(sealer.current_prefix())
        .fetch_one(pool)
        .await
        .unwrap();
        n += count;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sealing_keys_rotate_while_a_di_serves() {
    let mut sys = start(CloudOptions::default()).await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di: Created = create(&sys, &api, REGION, "rotating", GATED_MODEL, 1).await;
    let (active, _) = wait_active(&sys, &api, REGION, &di.id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let client = ca_client(&fetch_ca(&sys, &api, &di.id).await);
    let tokens = di_path(&di.id, "/tokens");
    let minted = second_token(&sys, &api, &tokens).await;
    assert_eq!(minted.status, 202);
    let second = minted.body["token"]["value"].as_str().unwrap().to_string();
    let second_id = minted.body["token"]["id"].as_str().unwrap().to_string();
    eventually_answers(&client, &endpoint, &second, GATED_MODEL, 200).await;
    let caller = Caller::start(
        client.clone(),
        vec![endpoint.clone()],
        di.token.clone(),
        vec![GATED_MODEL.to_string()],
    );

    // 1. Every service seals with the new keys and still opens with the old ones.
    let region_old = sys.region(REGION).seal_key.clone();
    let central_old = sys.central_config.seal_key.clone();
    let (region_new, central_new) = (Sealer::generate_key(), Sealer::generate_key());
    restart_region(&mut sys, &region_new, std::slice::from_ref(&region_old)).await;
    restart_central(&mut sys, &central_new, std::slice::from_ref(&central_old)).await;

    // 2. Re-seal, while everything runs; a second run finds nothing left.
    let region_sealer = Sealer::from_keys(&region_new, &[region_old]).unwrap();
    let region_db = pool(&sys.region(REGION).database_url).await;
    let region_store = region_store::Store::new(region_db.clone(), region_sealer.clone());
    let report = region_store.reseal(2).await.unwrap();
    assert!(
        report.resealed >= 3 && report.unreadable.is_empty(),
        "{report:?}"
    );
    assert_eq!(region_store.reseal(2).await.unwrap().resealed, 0);
    let central_sealer = Sealer::from_keys(&central_new, &[central_old]).unwrap();
    let central_db = pool(&sys.central_config.database_url).await;
    let report = central::reseal::reseal(&sys.central.app.store, &central_sealer, 2)
        .await
        .unwrap();
    assert!(
        report.resealed >= 2 && report.unreadable.is_empty(),
        "{report:?}"
    );
    assert_eq!(
        not_under(&region_db, REGION_SEALED, &region_sealer).await,
        0
    );
    assert_eq!(
        not_under(&central_db, CENTRAL_SEALED, &central_sealer).await,
        0
    );

    // 3. The old keys are removed everywhere.
    restart_region(&mut sys, &region_new, &[]).await;
    restart_central(&mut sys, &central_new, &[]).await;

    // The DI still reconciles: a revocation needs a pass that opens its secrets (the CA key to
    // keep the endpoint's certificate, the probe token, the Hugging Face token).
    let revoked = sys
        .call(
            Method::DELETE,
            &di_path(&di.id, &format!("/tokens/{second_id}")),
            &api,
            None,
        )
        .await;
    assert_eq!(revoked.status, 204, "{}", revoked.body);
    eventually_answers(&client, &endpoint, &second, GATED_MODEL, 401).await;
    // Central replays what it sealed before the rotation, with the new key alone.
    let replayed = second_token(&sys, &api, &tokens).await;
    assert_eq!(replayed.status, 202, "{}", replayed.body);
    assert_eq!(replayed.body["token"]["value"], second.as_str());
    let log = caller.finish().await;
    assert!(log.ok > 0 && log.failures.is_empty(), "{log:?}");
    assert_chat_ok(&client, &endpoint, &di.token, GATED_MODEL).await;
}

/// Moves the end of DI `id`'s CA `cert` to `days` from now: time passes by the end coming
/// closer, not by waiting.
async fn ends_in(db: &PgPool, id: Uuid, cert: &str, days: i32) {
    sqlx::query(
        "UPDATE certificate_authorities SET not_after = now() + make_interval(days => $2)
         WHERE di_id = $1 AND cert_pem = $3",
    )
    .bind(id)
    .bind(days)
    .bind(cert)
    .execute(db)
    .await
    .unwrap();
}

/// The certificates (PEM) in a bundle.
fn certificates(bundle: &str) -> Vec<String> {
    bundle
        .split_inclusive("-----END CERTIFICATE-----\n")
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_ca_is_published_before_the_endpoint_uses_it() {
    let mut sys = start(CloudOptions {
        resync: Some(Duration::from_millis(300)),
        ..CloudOptions::default()
    })
    .await;
    let api = sys.token(Uuid::new_v4(), &[]).await;
    let di = create(&sys, &api, REGION, "renewed", MODEL, 1).await;
    let (active, _) = wait_active(&sys, &api, REGION, &di.id, 1).await;
    let endpoint = active["endpoints"]["public_endpoint_fqdn"]
        .as_str()
        .unwrap()
        .to_string();
    let old = fetch_ca(&sys, &api, &di.id).await;
    assert_eq!(certificates(&old).len(), 1);
    let id = Uuid::parse_str(&di.id).unwrap();
    let region_db = pool(&sys.region(REGION).database_url).await;
    // Time moves by the CA's end coming closer, not by waiting: 100 days left, inside the
    // renewal window (a year) and still enough for a whole endpoint certificate (90 days).
    ends_in(&region_db, id, &old, 100).await;
    let policy = regional::ca::CaPolicy::default();
    let store = sys.region(REGION).store().clone();
    assert_eq!(regional::ca::renew_due(&store, &policy).await.unwrap(), 1);
    assert_eq!(regional::ca::renew_due(&store, &policy).await.unwrap(), 0);

    // Published at once, old first; the endpoint keeps the old one while it can.
    let bundle = fetch_ca(&sys, &api, &di.id).await;
    let both = certificates(&bundle);
    assert_eq!(both.len(), 2, "{bundle}");
    assert_eq!(both[0], old);
    let new = both[1].clone();
    let (trusts_old, trusts_new, trusts_both) =
        (ca_client(&old), ca_client(&new), ca_client(&bundle));
    let caller = Caller::start(
        trusts_both,
        vec![endpoint.clone()],
        di.token.clone(),
        vec![MODEL.into()],
    );
    let passes = sys.cloud(REGION).worker_stats().passes;
    until(
        Duration::from_secs(15),
        "the worker passes over the DI (resync every 300 ms)",
        || ready(sys.cloud(REGION).worker_stats().passes > passes + 2),
    )
    .await;
    assert_chat_ok(&trusts_old, &endpoint, &di.token, MODEL).await;
    assert!(
        chat(&trusts_new, &endpoint, &di.token, MODEL)
            .await
            .is_err(),
        "not switched yet"
    );

    // Less than a whole certificate left: the endpoint switches to the new CA.
    ends_in(&region_db, id, &old, 10).await;
    eventually_answers(&trusts_new, &endpoint, &di.token, MODEL, 200).await;
    let log = caller.finish().await;
    assert!(
        log.ok > 0 && log.failures.is_empty(),
        "a client of the bundle saw: {log:?}"
    );

    // Expired, the old CA is no longer published and goes with its key.
    ends_in(&region_db, id, &old, -1).await;
    assert_eq!(regional::ca::renew_due(&store, &policy).await.unwrap(), 0);
    assert_eq!(fetch_ca(&sys, &api, &di.id).await, new);
    assert_eq!(
        region_sealed_values(&region_db, id).await,
        2,
        "the new CA's key and the probe token"
    );
}
