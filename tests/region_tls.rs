//! Central ↔ region over TLS, as deployed: every regional service serves HTTPS with a certificate
//! of a CA that central trusts (`REGION_CA_FILE`), on `https://` region URLs. A central that does
//! not trust the CA gets no answer from a region (503, never a call in the clear or unverified),
//! and a certificate renewed on disk is served without a restart.

use std::time::Duration;

use reqwest::Method;
use system_tests::{Options, Reply, System};
use test_support::until;
use uuid::Uuid;

async fn tls_system() -> System {
    System::start_with(Options {
        region_tls: true,
        ..Options::default()
    })
    .await
}

/// A GET through central's public API that must succeed.
async fn get(sys: &System, token: &str, path: &str) -> Reply {
    let reply = sys.call(Method::GET, path, token, None).await;
    assert_eq!(reply.status, 200, "GET {path}: {}", reply.body);
    reply
}

/// A client that trusts only the test CA and reports the certificate each answer came with.
fn client_trusting(sys: &System) -> reqwest::Client {
    let ca = &sys.region_tls.as_ref().expect("TLS is on").ca;
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .tls_info(true)
        .build()
        .unwrap()
}

/// The certificate region `name` serves now (through its proxy, as central reaches it). A new
/// client each time: a client's kept-alive connections and resumed TLS sessions would report
/// the certificate of their first handshake.
async fn served_certificate(sys: &System, name: &str) -> Vec<u8> {
    let reply = client_trusting(sys)
        .get(format!("https://{}/healthz", sys.proxy(name).addr))
        .send()
        .await
        .expect("the region answers over TLS");
    assert_eq!(reply.status(), 200);
    reply
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|info| info.peer_certificate())
        .expect("the server's certificate")
        .to_vec()
}

#[tokio::test]
async fn central_creates_and_reads_through_regions_that_serve_only_https() {
    let sys = tls_system().await;
    assert!(
        sys.central_config
            .regions
            .iter()
            .all(|r| r.contains("=https://127.0.0.1:")),
        "{:?}",
        sys.central_config.regions
    );
    let token = sys.token(Uuid::new_v4(), &[]).await;

    let (id, created) = sys.create_di(&token, "over-tls", "atl1").await;
    assert_eq!(created["dedicated_inference"]["region"], "atl1");
    let got = get(&sys, &token, &format!("/v2/dedicated-inferences/{id}")).await;
    assert_eq!(got.body["dedicated_inference"]["name"], "over-tls");
    // Reads that go to the region itself.
    let tokens = get(
        &sys,
        &token,
        &format!("/v2/dedicated-inferences/{id}/tokens"),
    )
    .await;
    assert_eq!(tokens.body["meta"]["total"], 1);
    get(&sys, &token, &format!("/v2/dedicated-inferences/{id}/ca")).await;
    // The change feed's long polls (central's other client) reach the region over TLS too.
    let head = sys.regions[0].store().outbox_head().await.unwrap();
    assert!(head > 0);
    until(
        Duration::from_secs(10),
        "central's change feed cursor of atl1 at the region's outbox head",
        || async { sys.central.app.store.cursor("atl1").await.unwrap_or(0) >= head },
    )
    .await;

    // The listener speaks TLS only: plain HTTP to it gets no answer, /healthz over HTTPS does.
    let plain = reqwest::get(format!("http://{}/healthz", sys.proxy("atl1").addr)).await;
    assert!(plain.is_err(), "plain HTTP must not be served: {plain:?}");
    let http = client_trusting(&sys);
    let healthz = http
        .get(format!("https://{}/healthz", sys.proxy("atl1").addr))
        .send()
        .await
        .expect("healthz over TLS");
    assert_eq!(healthz.status(), 200);
    assert_eq!(healthz.text().await.unwrap(), "ok");
}

#[tokio::test]
async fn a_central_that_does_not_trust_the_regions_ca_gets_503_and_sends_nothing() {
    let sys = tls_system().await;
    // The same regions and secrets, without REGION_CA_FILE; a database of its own, so that no
    // other central recovers the create it leaves pending.
    let mut config = sys.central_config.clone();
    config.region_ca_file = None;
    config.background = false;
    config.database_url = system_tests::fresh_database("central_untrusting").await;
    let untrusting = central::Server::start(config)
        .await
        .expect("central starts");
    let team = Uuid::new_v4();
    let token = untrusting.app.auth.mint();
    untrusting
        .app
        .store
        .api_token_create(
            team,
            "test",
            &common::tokens::sha256(&token),
            &central::auth::SCOPES
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
            None,
        )
        .await
        .unwrap();

    let reply = Reply::from(
        sys.http
            .post(format!(
                "http://{}/v2/dedicated-inferences",
                untrusting.addr
            ))
            .bearer_auth(&token)
            .json(&system_tests::create_body("untrusted", "atl1"))
            .send()
            .await
            .expect("central answers"),
    )
    .await;
    reply.assert_error(503, "service_unavailable");
    assert!(
        reply.headers.contains_key("retry-after"),
        "{:?}",
        reply.headers
    );

    // The region never saw the request: it holds nothing of the team.
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedicated_inferences WHERE team_id = $1")
            .bind(team)
            .fetch_one(sys.regions[0].store().pool())
            .await
            .unwrap();
    assert_eq!(stored, 0);

    // The central that trusts the CA is unaffected.
    let trusted = sys.token(team, &[]).await;
    sys.create_di(&trusted, "trusted", "atl1").await;
}

#[tokio::test]
async fn a_certificate_renewed_on_disk_is_served_without_a_restart() {
    let mut sys = tls_system().await;
    let tls = sys.region_tls.as_ref().expect("TLS is on");
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let (id, _) = sys.create_di(&token, "before-renewal", "atl1").await;

    let first = served_certificate(&sys, "atl1").await;
    let (cert_file, _) = tls.files("atl1");
    assert_eq!(
        first,
        system_tests::tls::der(&std::fs::read_to_string(&cert_file).unwrap())
    );

    let renewed = system_tests::tls::der(&tls.issue("atl1"));
    assert_ne!(first, renewed);
    until(
        Duration::from_secs(10),
        "the renewed certificate served",
        || async { served_certificate(&sys, "atl1").await == renewed },
    )
    .await;

    // Central trusts the CA, not a certificate: it goes on working, and a central started now
    // (no kept-alive connection, no TLS session to resume) verifies the renewed certificate.
    sys.create_di(&token, "after-renewal", "atl1").await;
    sys.restart_central().await;
    get(
        &sys,
        &token,
        &format!("/v2/dedicated-inferences/{id}/tokens"),
    )
    .await;
    sys.create_di(&token, "after-restart", "atl1").await;

    // A pair that does not match (a key from another issue) is not served: the renewed one stays.
    let tls = sys.region_tls.as_ref().expect("TLS is on");
    let (_, stray_key) = tls.ca.issue();
    std::fs::write(tls.files("atl1").1, stray_key).unwrap();
    // Real time: that a pair is not taken up shows only over time, and nothing says when the
    // regional service looked (every RELOAD): three looks' worth.
    tokio::time::sleep(system_tests::tls::RELOAD * 3).await;
    assert_eq!(served_certificate(&sys, "atl1").await, renewed);
}
