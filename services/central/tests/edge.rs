//! Central at its public edge, through real HTTP on a real Postgres: what anonymous traffic
//! costs (made-up tokens refused without a database query, failed authentications budgeted per
//! client address, metric series that made-up methods and paths cannot grow, `/metrics` only
//! on the internal listener), and the operator commands that list and revoke API tokens.
//!
//! The test that counts the process's metric series runs alone ([`PROCESS`]): no other test's
//! traffic may add to them. The others run together: each counts the transactions of a database
//! of its own, and each waits out Postgres's statistics (seconds) while the others work. The
//! lone test waits for a moment when none runs rather than queueing, so that it never holds back
//! the others (a queued writer would: tokio's lock is fair).

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::Value;
use sqlx::Connection;
use uuid::Uuid;

static PROCESS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The Postgres server to create test databases on. Missing is an error, never a skip.
fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .expect("DATABASE_URL must point at a Postgres server; run the tests with scripts/test, which starts one")
}

/// A fresh database on it: (its name, its URL).
async fn fresh_database() -> (String, String) {
    let name = format!("central_edge_{}", Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin_url()).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let mut url = reqwest::Url::parse(&admin_url()).unwrap();
    url.set_path(&name);
    (name, url.to_string())
}

/// The key every central of these tests mints and recognises API tokens with (replicas of one
/// deployment share it).
const API_TOKEN_KEY: &str = "6eimjnHfMhYN5C4Z+gWwxYYUXNed+xyJrvXpV2rpz1g=";

fn mint() -> String {
    common::tokens::ApiTokenKey::from_base64(API_TOKEN_KEY)
        .unwrap()
        .mint()
}

/// Central on `database_url`, caching tokens for `auth_cache_ttl_ms`.
async fn start(database_url: &str, auth_cache_ttl_ms: u64) -> central::Server {
    start_with(database_url, auth_cache_ttl_ms, None).await
}

/// As [`start`], with the client's address taken from `client_ip_header` (behind a proxy).
async fn start_with(
    database_url: &str,
    auth_cache_ttl_ms: u64,
    client_ip_header: Option<&str>,
) -> central::Server {
    central::Server::start(central::Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: "127.0.0.1:0".parse().unwrap(),
        database_url: database_url.into(),
        api_token_key: API_TOKEN_KEY.into(),
        seal_key: common::seal::Sealer::generate_key(),
        seal_open_keys: vec![],
        // No region: these tests stay at central's edge.
        regions: vec![],
        region_secrets: vec![],
        region_ca_file: None,
        public_url: None,
        catalog: None,
        auth_cache_ttl_ms,
        rate_limit_per_hour: 1_000_000,
        region_timeout_ms: 1000,
        db_max_connections: 8,
        background: false,
        auth_failures_per_minute: 10,
        client_ip_header: client_ip_header.map(str::to_string),
    })
    .await
    .expect("central starts")
}

/// Stores `value` as an API token with every scope, of a new team.
async fn store_token(server: &central::Server, value: &str) {
    let team = Uuid::new_v4();
    let scopes: Vec<String> = central::auth::SCOPES
        .iter()
        .map(|s| s.to_string())
        .collect();
    server
        .app
        .store
        .api_token_create(team, "test", &common::tokens::sha256(value), &scopes, None)
        .await
        .unwrap();
}

/// Asserts the API error shape with `id`, and returns the body.
async fn assert_error(response: reqwest::Response, status: StatusCode, id: &str) -> Value {
    assert_eq!(response.status(), status);
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["id"], id, "{body}");
    assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(body["request_id"], request_id.as_str());
    body
}

fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count()
}

async fn scrape(http: &reqwest::Client, addr: SocketAddr) -> String {
    let response = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap()
}

/// The finding: 3,000 unauthenticated requests with random methods and paths added 48,000
/// series lines to `/metrics`, served on the public port. Now they add none, and the public
/// port answers `/metrics` as the unknown path it is there.
#[tokio::test]
async fn made_up_methods_and_paths_leave_the_metric_series_unchanged() {
    let _alone = test_support::eventually(
        Duration::from_secs(600),
        "the other tests of the process done",
        async || PROCESS.try_write().ok(),
    )
    .await;
    let (_, url) = fresh_database().await;
    let server = start(&url, 1000).await;
    let http = reqwest::Client::new();
    let send = |method: &str, path: String| {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        http.request(method, format!("http://{}{path}", server.addr))
            .send()
    };
    // One of each kind first: the series they make are the ones that may exist.
    for method in ["GET", "QWXZ"] {
        assert_eq!(send(method, "/warm".into()).await.unwrap().status(), 401);
    }
    let before = scrape(&http, server.metrics_addr).await;
    for i in 0..1000u32 {
        let method = format!("M{}", Uuid::new_v4().simple()).to_uppercase();
        let path = format!("/{}/{i}", Uuid::new_v4().simple());
        let method = if i % 2 == 0 { method.as_str() } else { "GET" };
        assert_eq!(send(method, path).await.unwrap().status(), 401);
    }
    let after = scrape(&http, server.metrics_addr).await;
    assert_eq!(series(&before), series(&after), "{after}");
    assert!(
        after.contains("route=\"unmatched\",method=\"other\",status=\"401\""),
        "{after}"
    );

    let token = mint();
    store_token(&server, &token).await;
    let public = http
        .get(format!("http://{}/metrics", server.addr))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_error(public, StatusCode::NOT_FOUND, "not_found").await;
}

async fn get(http: &reqwest::Client, server: &central::Server, token: &str) -> reqwest::Response {
    http.get(format!(
        "http://{}/v2/dedicated-inferences/sizes",
        server.addr
    ))
    .bearer_auth(token)
    .send()
    .await
    .unwrap()
}

/// A made-up value of each kind a flood sends: junk, the current format with a wrong MAC (a
/// changed character, or a MAC made with another key: the shape is no secret), and the legacy
/// shape, which only the budgets keep from the database.
fn forged(i: usize) -> String {
    let minted = mint();
    match i % 4 {
        0 => format!("{}-{i}", Uuid::new_v4()),
        1 => format!(
            "{}{}",
            &minted[..minted.len() - 1],
            if minted.ends_with('0') { '1' } else { '0' }
        ),
        2 => {
            let random = &minted[common::tokens::API_TOKEN_PREFIX.len()..][..40];
            format!("{}{random}", common::tokens::LEGACY_API_TOKEN_PREFIX)
        }
        _ => common::tokens::ApiTokenKey::from_base64(&common::tokens::ApiTokenKey::generate())
            .unwrap()
            .mint(),
    }
}

/// Autovacuum's first visit to a new database analyses every table the migrations made, a
/// transaction each, whenever it comes: done now, it has nothing left to do in a measurement.
async fn vacuum(url: &str) {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query("VACUUM ANALYZE")
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

/// Transactions committed in `database`, read once the number has stood still for longer than
/// a Postgres backend may hold its counts back: it reports them at most once a second, and an
/// idle one that had to wait reports them within 10 s (Postgres 15's `PGSTAT_IDLE_INTERVAL`).
async fn settled_commits(database: &str) -> i64 {
    let mut conn = sqlx::PgConnection::connect(&admin_url()).await.unwrap();
    let (mut last, mut still) = (-1, 0);
    while still < 11 {
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut conn)
            .await
            .unwrap();
        let now: i64 =
            sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
                .bind(database)
                .fetch_one(&mut conn)
                .await
                .unwrap();
        (last, still) = if now == last {
            (now, still + 1)
        } else {
            (now, 0)
        };
        // Real time: Postgres reports its counts on its own clock, at most once a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    last
}

/// The finding: 20,000 requests with random bearer tokens made 19,956 transactions on central's
/// database. Now the format and the failure budget refuse them before any lookup (a handful,
/// for the values that pass the format, until the address's budget is spent), and a customer
/// using a valid token from the same address meanwhile gets every answer.
#[tokio::test]
async fn a_flood_of_made_up_tokens_costs_a_handful_of_queries_and_no_customer_request() {
    let _shared = PROCESS.read().await;
    let (database, url) = fresh_database().await;
    // The longest TTL, so that the customer's token is read again as seldom as may be.
    let server = start(&url, 5000).await;
    let http = reqwest::Client::new();
    let token = mint();
    store_token(&server, &token).await;
    assert_eq!(get(&http, &server, &token).await.status(), 200);
    vacuum(&url).await;
    let before = settled_commits(&database).await;

    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let customer = tokio::spawn({
        let (http, flooding, token) = (http.clone(), flooding.clone(), token.clone());
        let url = format!("http://{}/v2/dedicated-inferences/sizes", server.addr);
        async move {
            let mut answered = 0;
            while flooding.load(std::sync::atomic::Ordering::SeqCst) || answered == 0 {
                let status = http
                    .get(&url)
                    .bearer_auth(&token)
                    .send()
                    .await
                    .unwrap()
                    .status();
                assert_eq!(status, 200, "a customer's request failed during the flood");
                answered += 1;
            }
            answered
        }
    });
    let mut floods = Vec::new();
    for worker in 0..16 {
        let http = http.clone();
        let url = format!("http://{}/v2/dedicated-inferences", server.addr);
        floods.push(tokio::spawn(async move {
            let mut statuses = std::collections::BTreeMap::new();
            for i in (worker..20_000).step_by(16) {
                let response = http.get(&url).bearer_auth(forged(i)).send().await.unwrap();
                let status = response.status();
                if status == 429 {
                    assert!(response.headers().contains_key("retry-after"));
                }
                *statuses.entry(status.as_u16()).or_insert(0) += 1;
            }
            statuses
        }));
    }
    let mut statuses = std::collections::BTreeMap::new();
    for flood in floods {
        for (status, n) in flood.await.unwrap() {
            *statuses.entry(status).or_insert(0) += n;
        }
    }
    flooding.store(false, std::sync::atomic::Ordering::SeqCst);
    let answered = customer.await.unwrap();
    let spent = settled_commits(&database).await - before;
    eprintln!(
        "20,000 made-up tokens: {statuses:?}; {answered} customer requests, all 200; {spent} transactions"
    );
    assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), [401, 429]);
    // The budget's 10 lookups and its refill while the flood lasts (one every 6 s), and the
    // customer's token read again every 5 s.
    assert!(
        spent <= 25,
        "{spent} transactions for 20,000 made-up tokens"
    );
}

/// Tokens of the current format and of exactly the legacy shape work; beyond the failure
/// budget an address gets 429 with `Retry-After`, yet the tokens central knows, and any token it
/// minted, keep working from it: only a legacy token it has never seen waits.
#[tokio::test]
async fn the_failure_budget_refuses_guesses_not_customers() {
    let _shared = PROCESS.read().await;
    let (_, url) = fresh_database().await;
    // TTL 0: every request with a known token reads it again, as one does once its TTL is up.
    let server = start(&url, 0).await;
    let http = reqwest::Client::new();
    let current = mint();
    let minted = mint();
    let legacy = format!(
        "{}{}",
        common::tokens::LEGACY_API_TOKEN_PREFIX,
        &minted[common::tokens::API_TOKEN_PREFIX.len()..][..40]
    );
    let unseen = mint();
    let unseen_legacy = format!(
        "{}{}",
        common::tokens::LEGACY_API_TOKEN_PREFIX,
        &mint()[common::tokens::API_TOKEN_PREFIX.len()..][..40]
    );
    for token in [&current, &legacy, &unseen, &unseen_legacy] {
        store_token(&server, token).await;
    }
    for token in [&current, &legacy] {
        assert_eq!(get(&http, &server, token).await.status(), 200);
    }
    // A legacy value with one character more is neither shape. Ten failures spend the budget.
    for i in 0..10 {
        let value = if i == 0 {
            format!("{legacy}x")
        } else {
            forged(i)
        };
        assert_error(
            get(&http, &server, &value).await,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await;
    }
    let refused = get(&http, &server, &forged(11)).await;
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=6).contains(&retry_after), "{retry_after}");
    assert!(refused.headers().contains_key("ratelimit-limit"));
    assert_error(refused, StatusCode::TOO_MANY_REQUESTS, "too_many_requests").await;
    for token in [&current, &legacy] {
        assert_eq!(get(&http, &server, token).await.status(), 200);
    }
    // A token central minted is looked up whatever the address's budget: it is no guess.
    assert_eq!(get(&http, &server, &unseen).await.status(), 200);
    // A legacy one it has never seen might be one: it waits out the budget.
    assert_error(
        get(&http, &server, &unseen_legacy).await,
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_requests",
    )
    .await;
    // No token at all is no guess: 401, not budgeted.
    let anonymous = http
        .get(format!("http://{}/v2/dedicated-inferences", server.addr))
        .send()
        .await
        .unwrap();
    assert_error(anonymous, StatusCode::UNAUTHORIZED, "unauthorized").await;
}

fn central(args: &[&str], database_url: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_central"))
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("API_TOKEN_KEY", API_TOKEN_KEY)
        .env_remove("RUST_LOG")
        .output()
        .expect("the central binary runs")
}

/// An operator mints a token, lists the team's tokens (never a value) and revokes one; two
/// central replicas that had the token cached both refuse it. Nothing tells a replica of the
/// revoke: the TTL of its cache (at most 5 s, `the_auth_cache_lives_at_most_five_seconds`) is
/// the whole delay, so that bound holds however many replicas run.
#[tokio::test]
async fn an_operator_lists_and_revokes_tokens_and_every_replica_refuses_a_revoked_one() {
    let _shared = PROCESS.read().await;
    let (_, url) = fresh_database().await;
    let replicas = [start(&url, 1000).await, start(&url, 1000).await];
    let team = Uuid::new_v4().to_string();
    let mint = |name: &str| {
        let out = central(
            &[
                "mint-token",
                "--team",
                &team,
                "--name",
                name,
                "--scopes",
                "dedicated_inference:read",
            ],
            &url,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let (doomed, kept) = (mint("doomed"), mint("kept"));
    let key = common::tokens::ApiTokenKey::from_base64(API_TOKEN_KEY).unwrap();
    assert!(key.minted(&doomed), "minted with central's key");
    let http = reqwest::Client::new();
    for replica in &replicas {
        for token in [&doomed, &kept] {
            assert_eq!(get(&http, replica, token).await.status(), 200);
        }
    }

    let list = |url: &str| {
        let out = central(&["list-tokens", "--team", &team], url);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let listed = list(&url);
    let rows: Vec<Vec<&str>> = listed
        .lines()
        .skip(1)
        .map(|l| l.split('\t').collect())
        .collect();
    assert_eq!(
        listed.lines().next(),
        Some("ID\tNAME\tSCOPES\tCREATED\tREVOKED")
    );
    assert_eq!(rows.len(), 2, "{listed}");
    assert_eq!(
        (rows[0][1], rows[0][2], rows[0][4]),
        ("doomed", "dedicated_inference:read", "-")
    );
    assert!(
        !listed.contains(&doomed[7..20]) && !listed.contains(&kept[7..20]),
        "{listed}"
    );
    let doomed_id = rows[0][0].to_string();

    let out = central(&["revoke-token", &doomed_id], &url);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for replica in &replicas {
        // Only a guard against hanging: the bound is the TTL's, checked where it is set.
        let refused = "the revoked token refused on the replica within a minute";
        test_support::until(Duration::from_secs(60), refused, async || {
            let status = get(&http, replica, &doomed).await.status();
            assert!(status == 401 || status == 200, "{status}");
            status == 401
        })
        .await;
        assert_eq!(get(&http, replica, &kept).await.status(), 200);
    }
    let listed = list(&url);
    let row = listed.lines().find(|l| l.starts_with(&doomed_id)).unwrap();
    assert!(!row.ends_with("\t-"), "{row}");
    // Revoked already, or no such token: said, and a failure.
    for id in [doomed_id, Uuid::new_v4().to_string()] {
        let out = central(&["revoke-token", &id], &url);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains(&id));
    }
}

/// A flood of values shaped exactly like current tokens, each from another address (an attacker
/// with an IPv6 block behind the proxy, whose per-address budgets would each let some through):
/// none reaches the database, because only central's key makes their MAC. (With a checksum
/// anyone can compute, each address got its budget of lookups.)
#[tokio::test]
async fn well_shaped_made_up_tokens_from_many_addresses_reach_no_database() {
    let _shared = PROCESS.read().await;
    let (database, url) = fresh_database().await;
    let server = start_with(&url, 1000, Some("X-Forwarded-For")).await;
    let http = reqwest::Client::new();
    vacuum(&url).await;
    let before = settled_commits(&database).await;
    let another_key =
        common::tokens::ApiTokenKey::from_base64(&common::tokens::ApiTokenKey::generate()).unwrap();
    let mut floods = Vec::new();
    for worker in 0..8 {
        let (http, another_key) = (http.clone(), another_key.clone());
        let url = format!("http://{}/v2/dedicated-inferences", server.addr);
        floods.push(tokio::spawn(async move {
            for i in (worker..2_000).step_by(8) {
                let status = http
                    .get(&url)
                    .bearer_auth(another_key.mint())
                    .header("x-forwarded-for", format!("2001:db8:{i:x}::1"))
                    .send()
                    .await
                    .unwrap()
                    .status();
                assert_eq!(
                    status, 401,
                    "a fresh address gets its first failures answered"
                );
            }
        }));
    }
    for flood in floods {
        flood.await.unwrap();
    }
    let spent = settled_commits(&database).await - before;
    // Autovacuum or the statistics collector may still commit a transaction or two.
    assert!(
        spent <= 5,
        "{spent} transactions for 2,000 well-shaped made-up tokens"
    );
}
