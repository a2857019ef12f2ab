//! Central at its public edge, through real HTTP on a real Postgres: metric series that
//! made-up methods and paths cannot grow, and `/metrics` only on the internal listener.
//!
//! The tests run one at a time ([`SERIAL`]): one counts the process's metric series, which
//! no other may add to meanwhile.

use std::net::SocketAddr;

use reqwest::{Method, StatusCode};
use serde_json::Value;
use sqlx::Connection;
use uuid::Uuid;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// Central on `database_url`, caching tokens for `auth_cache_ttl_ms`.
async fn start(database_url: &str, auth_cache_ttl_ms: u64) -> central::Server {
    central::Server::start(central::Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: "127.0.0.1:0".parse().unwrap(),
        database_url: database_url.into(),
        seal_key: common::seal::Sealer::generate_key(),
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
    })
    .await
    .expect("central starts")
}

/// Stores an API token with every scope for a new team and returns its value.
async fn store_token(server: &central::Server, value: &str) -> Uuid {
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
    team
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
    let _serial = SERIAL.lock().await;
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

    let token = common::tokens::mint(common::tokens::API_TOKEN_PREFIX);
    store_token(&server, &token).await;
    let public = http
        .get(format!("http://{}/metrics", server.addr))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_error(public, StatusCode::NOT_FOUND, "not_found").await;
}
