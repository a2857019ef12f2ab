//! Regions failing, slow or down, central restarting, clients retrying: reads keep working, writes
//! fail cleanly with 503, and a create happens exactly once on both sides.

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use system_tests::proxy::Mode;
use system_tests::{create_body, Options, Reply, System};
use test_support::{eventually, until};
use uuid::Uuid;

async fn post_with_key(sys: &System, token: &str, key: &str, body: &Value) -> Reply {
    Keyed { sys, token }
        .send(Method::POST, "/v2/dedicated-inferences", key, Some(body))
        .await
}

/// A team's requests with an Idempotency-Key.
struct Keyed<'a> {
    sys: &'a System,
    token: &'a str,
}

impl Keyed<'_> {
    fn request(
        &self,
        method: Method,
        path: &str,
        key: &str,
        body: Option<&Value>,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .sys
            .http
            .request(method, self.sys.url(path))
            .bearer_auth(self.token)
            .header("idempotency-key", key);
        if let Some(body) = body {
            request = request.json(body);
        }
        request
    }

    async fn send(&self, method: Method, path: &str, key: &str, body: Option<&Value>) -> Reply {
        let request = self.request(method, path, key, body);
        Reply::from(request.send().await.unwrap()).await
    }

    /// Sends the request from a client that gives up after half a second and cuts its
    /// connection, as a client with a short timeout does while the region stalls.
    async fn give_up_after_half_a_second(
        &self,
        method: Method,
        path: &str,
        key: &str,
        body: Option<&Value>,
    ) {
        let sent = self
            .request(method, path, key, body)
            .timeout(Duration::from_millis(500))
            .send()
            .await;
        assert!(
            sent.as_ref().is_err_and(reqwest::Error::is_timeout),
            "the client was meant to give up first: {sent:?}"
        );
    }
}

/// Rows of a table in central's database.
async fn central_rows(sys: &System, table: &str) -> i64 {
    central_count(sys, &format!("SELECT count(*) FROM {table}")).await
}

/// A `SELECT count(*) …` in central's database.
async fn central_count(sys: &System, query: &str) -> i64 {
    sqlx::query_scalar(query)
        .fetch_one(sys.central.app.store.pool())
        .await
        .unwrap()
}

/// Makes central's pending creates older than recovery's age, by the database's clock (the one
/// recovery goes by), instead of waiting for that age to pass.
async fn age_pending_creates(sys: &System) {
    sqlx::query("UPDATE pending_creates SET created_at = created_at - make_interval(secs => $1)")
        .bind((central::feed::RECOVERY_AGE + Duration::from_secs(1)).as_secs_f64())
        .execute(sys.central.app.store.pool())
        .await
        .unwrap();
}

/// The lowercase hex SHA-256 of each live access token of DI `id`, as its region stores them.
async fn region_token_hashes(sys: &System, region: &str, id: &str) -> Vec<String> {
    let handle = sys.regions.iter().find(|r| r.name == region).unwrap();
    let hashes = handle
        .store()
        .token_hashes(Uuid::parse_str(id).unwrap())
        .await
        .unwrap();
    hashes.into_iter().map(|(_, hash)| hash).collect()
}

async fn region_rows(sys: &System, region: &str) -> i64 {
    let url = &sys
        .regions
        .iter()
        .find(|r| r.name == region)
        .unwrap()
        .database_url;
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let n = sqlx::query_scalar("SELECT count(*) FROM dedicated_inferences")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    n
}

async fn listed(sys: &System, token: &str) -> Vec<Value> {
    let reply = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?per_page=200",
            token,
            None,
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.body["dedicated_inferences"]
        .as_array()
        .unwrap()
        .clone()
}

#[tokio::test]
async fn a_down_region_keeps_reads_and_refuses_writes_with_503() {
    let mut sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let (id, created) = sys.create_di(&token, "steady", "atl1").await;

    sys.region("atl1").go_down();
    let got = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            None,
        )
        .await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["dedicated_inference"]["status"], "new");
    assert_eq!(listed(&sys, &token).await.len(), 1);

    let spec = created["dedicated_inference"]["spec"].clone();
    for reply in [
        sys.call(
            Method::PATCH,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            Some(json!({"spec": spec})),
        )
        .await,
        sys.call(
            Method::DELETE,
            &format!("/v2/dedicated-inferences/{id}"),
            &token,
            None,
        )
        .await,
        sys.call(
            Method::POST,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &token,
            Some(json!({"name": "t"})),
        )
        .await,
        sys.call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(create_body("during-outage", "atl1")),
        )
        .await,
    ] {
        reply.assert_error(503, "service_unavailable");
        assert!(reply.headers.contains_key("retry-after"));
    }
    // Other regions are unaffected.
    let other = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(create_body("elsewhere", "nyc2")),
        )
        .await;
    assert_eq!(other.status, 202);
    // The rename reservation of the failed patch was released: the name is still "steady".
    assert!(listed(&sys, &token)
        .await
        .iter()
        .any(|d| d["name"] == "steady"));

    // When the region returns, the create that failed during the outage is finished by recovery
    // (it was accepted into central's pending creates), exactly once.
    sys.region("atl1").come_back();
    let names = eventually(Duration::from_secs(15), "during-outage listed", || async {
        let names: Vec<String> = listed(&sys, &token)
            .await
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect();
        names
            .contains(&"during-outage".to_string())
            .then_some(names)
    })
    .await;
    assert_eq!(names.len(), 3);
    assert_eq!(region_rows(&sys, "atl1").await, 2);
}

#[tokio::test]
async fn a_retried_create_after_region_failure_is_exactly_once() {
    let mut sys = System::start_with(Options {
        background: false,
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let body = create_body("retry-me", "tor1");

    sys.region("tor1").go_down();
    post_with_key(&sys, &token, "k-1", &body)
        .await
        .assert_error(503, "service_unavailable");
    post_with_key(&sys, &token, "k-1", &body)
        .await
        .assert_error(503, "service_unavailable");
    assert_eq!(
        listed(&sys, &token).await.len(),
        0,
        "a create not yet in the region is not listed"
    );

    sys.region("tor1").come_back();
    let first = post_with_key(&sys, &token, "k-1", &body).await;
    assert_eq!(first.status, 202, "{}", first.body);
    let again = post_with_key(&sys, &token, "k-1", &body).await;
    assert_eq!(again.status, 202);
    assert_eq!(
        again.body, first.body,
        "the replay is the first response, token included"
    );
    assert_eq!(listed(&sys, &token).await.len(), 1);
    assert_eq!(region_rows(&sys, "tor1").await, 1);

    // The same key with another body is refused.
    post_with_key(&sys, &token, "k-1", &create_body("other", "tor1"))
        .await
        .assert_error(422, "unprocessable_entity");
}

#[tokio::test]
async fn a_slow_region_timeout_then_retry_yields_one_di() {
    let mut sys = System::start_with(Options {
        region_timeout: Duration::from_millis(500),
        background: false,
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let body = create_body("slow", "atl1");

    // The region creates the DI, but its answer arrives after central gave up.
    sys.region("atl1")
        .proxy
        .set_mode(Mode::SlowResponses(Duration::from_millis(1500)));
    post_with_key(&sys, &token, "slow-key", &body)
        .await
        .assert_error(503, "service_unavailable");
    // pydo retries without a key: the retry of an unanswered create finishes it, too.
    let keyless = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(body.clone()),
        )
        .await;
    keyless.assert_error(503, "service_unavailable");
    until(Duration::from_secs(5), "the DI made in atl1", || async {
        region_rows(&sys, "atl1").await == 1
    })
    .await;

    sys.region("atl1").proxy.set_mode(Mode::Pass);
    let retried = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(body.clone()),
        )
        .await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    let keyed = post_with_key(&sys, &token, "slow-key", &body).await;
    assert_eq!(keyed.status, 202);
    assert_eq!(
        keyed.body["dedicated_inference"]["id"],
        retried.body["dedicated_inference"]["id"]
    );
    assert_eq!(keyed.body["token"]["value"], retried.body["token"]["value"]);
    assert_eq!(listed(&sys, &token).await.len(), 1);
    assert_eq!(region_rows(&sys, "atl1").await, 1);
    // Once answered, a plain retry replays the same create, not a second DI.
    let replayed = sys
        .call(Method::POST, "/v2/dedicated-inferences", &token, Some(body))
        .await;
    assert_eq!(replayed.status, 202, "{}", replayed.body);
    assert_eq!(replayed.body, retried.body);
    assert_eq!(region_rows(&sys, "atl1").await, 1);
}

#[tokio::test]
async fn an_identical_create_retried_after_recovery_settled_it_gets_its_202() {
    // Central gives up on a region call after 5 s; the region stalls for 7 s. The create is
    // made there but answered 503 here, and recovery settles it once the region answers again.
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let body = create_body("stalled", "atl1");
    let stall = tokio::time::Instant::now();
    sys.proxy("atl1")
        .set_mode(Mode::SlowResponses(Duration::from_secs(7)));
    let create = || {
        let body = body.clone();
        sys.call(Method::POST, "/v2/dedicated-inferences", &token, Some(body))
    };
    let first = create().await;
    first.assert_error(503, "service_unavailable");
    let answered = tokio::time::Instant::now();
    let retry_after: u64 = first.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Real time: the region's stall is the scenario, as long as it says.
    tokio::time::sleep_until(stall + Duration::from_secs(7)).await;
    sys.proxy("atl1").set_mode(Mode::Pass);
    until(
        Duration::from_secs(20),
        "recovery settled the create",
        || async { central_rows(&sys, "pending_creates").await == 0 },
    )
    .await;
    // A client's pace: it retries once Retry-After has passed, as pydo does.
    tokio::time::sleep_until(answered + Duration::from_secs(retry_after)).await;

    // The client retries the same body, as pydo and plain clients do after Retry-After.
    let retried = create().await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    let id = retried.body["dedicated_inference"]["id"].as_str().unwrap();
    let listed = listed(&sys, &token).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["id"], id);
    // The token shown is the DI's managed token, the one its region checks.
    let value = retried.body["token"]["value"].as_str().unwrap();
    assert_eq!(
        region_token_hashes(&sys, "atl1", id).await,
        vec![common::tokens::sha256_hex(value)]
    );
    let again = create().await;
    assert_eq!(again.status, 202);
    assert_eq!(again.body, retried.body);
    assert_eq!(region_rows(&sys, "atl1").await, 1);
}

/// A system without background work (only requests finish what they start, until a restart
/// turns it on), a token, a DI in atl1, and a PATCH body that scales it to 3.
async fn a_di_to_patch(name: &str) -> (System, String, String, Value) {
    let sys = System::start_with(Options {
        background: false,
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let (id, created) = sys.create_di(&token, name, "atl1").await;
    let mut spec = created["dedicated_inference"]["spec"].clone();
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(3);
    let path = format!("/v2/dedicated-inferences/{id}");
    (sys, token, path, json!({ "spec": spec }))
}

#[tokio::test]
async fn a_keyed_patch_runs_to_its_end_after_its_client_gave_up() {
    let (sys, token, path, body) = a_di_to_patch("impatient").await;
    sys.proxy("atl1")
        .set_mode(Mode::SlowResponses(Duration::from_secs(2)));
    let keyed = Keyed {
        sys: &sys,
        token: &token,
    };
    keyed
        .give_up_after_half_a_second(Method::PATCH, &path, "patch-once", Some(&body))
        .await;
    // Central drives it on once the client is gone, to an answer it keeps for the key.
    until(
        Duration::from_secs(10),
        "the PATCH answered for its key after its client gave up",
        || async {
            central_count(
                &sys,
                "SELECT count(*) FROM idempotency_keys WHERE key = 'patch-once' AND status_code IS NOT NULL",
            )
            .await
                == 1
        },
    )
    .await;
    sys.proxy("atl1").set_mode(Mode::Pass);

    let retried = keyed
        .send(Method::PATCH, &path, "patch-once", Some(&body))
        .await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    let pending = &retried.body["dedicated_inference"]["pending_deployment_spec"];
    assert_eq!(pending["version"], 2, "applied once: {}", retried.body);
    assert_eq!(
        pending["model_deployments"][0]["accelerators"][0]["scale"],
        3
    );
    let again = keyed
        .send(Method::PATCH, &path, "patch-once", Some(&body))
        .await;
    assert_eq!(again.body, retried.body);
}

#[tokio::test]
async fn keyed_operations_cut_off_by_a_central_restart_are_finished_by_recovery() {
    let (mut sys, token, path, patch) = a_di_to_patch("restarted").await;
    let tokens_path = format!("{path}/tokens");
    let mint = json!({"name": "ci"});

    // The region applies both requests but holds its answers back; central dies before it hears
    // them (its connections to the region are cut) and a new central takes over.
    sys.region("atl1")
        .proxy
        .set_mode(Mode::SlowResponses(Duration::from_secs(3)));
    let keyed = Keyed {
        sys: &sys,
        token: &token,
    };
    tokio::join!(
        keyed.give_up_after_half_a_second(Method::PATCH, &path, "patch-key", Some(&patch)),
        keyed.give_up_after_half_a_second(Method::POST, &tokens_path, "mint-key", Some(&mint)),
    );
    sys.region("atl1").go_down();
    sys.restart_central().await;
    sys.region("atl1").come_back();

    // Recovery finishes both without any client asking again.
    until(
        Duration::from_secs(20),
        "recovery finished both keyed operations",
        || async {
            central_count(
                &sys,
                "SELECT count(*) FROM idempotency_keys WHERE status_code IS NULL",
            )
            .await
                == 0
        },
    )
    .await;

    let keyed = Keyed {
        sys: &sys,
        token: &token,
    };
    let patched = keyed
        .send(Method::PATCH, &path, "patch-key", Some(&patch))
        .await;
    assert_eq!(patched.status, 202, "{}", patched.body);
    assert_eq!(
        patched.body["dedicated_inference"]["pending_deployment_spec"]["version"], 2,
        "applied once, and its re-drive was not a stale version: {}",
        patched.body
    );
    let minted = keyed
        .send(Method::POST, &tokens_path, "mint-key", Some(&mint))
        .await;
    assert_eq!(minted.status, 202, "{}", minted.body);
    let value = minted.body["token"]["value"].as_str().unwrap();
    let id = path.rsplit('/').next().unwrap();
    let hashes = region_token_hashes(&sys, "atl1", id).await;
    assert_eq!(hashes.len(), 2, "the managed token and the one minted");
    assert!(hashes.contains(&common::tokens::sha256_hex(value)));
    let again = keyed
        .send(Method::POST, &tokens_path, "mint-key", Some(&mint))
        .await;
    assert_eq!(again.body, minted.body);
}

#[tokio::test]
async fn recovery_settles_a_create_it_cannot_open_as_failed() {
    let sys = System::start_with(Options {
        background: false,
        ..Options::default()
    })
    .await;
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    // A pending create whose intent cannot be opened, as one written by a faulty central.
    sys.central
        .app
        .store
        .create_begin(&central_store::NewCreate {
            di_id: Uuid::new_v4(),
            team_id: team,
            region: "atl1",
            name: "unopenable",
            fingerprint: b"fingerprint",
            sealed_intent: b"not a sealed intent",
            idempotency_key: None,
        })
        .await
        .unwrap();
    age_pending_creates(&sys).await;
    let _ = central::feed::recover_once(&sys.central.app).await;
    assert_eq!(
        central_rows(&sys, "pending_creates").await,
        0,
        "settled as failed, not retried forever"
    );
    // Nothing of it remains: the name is free.
    sys.create_di(&token, "unopenable", "atl1").await;
}

#[tokio::test]
async fn recovery_after_central_restart_settles_unanswered_creates() {
    let mut sys = System::start_with(Options {
        region_timeout: Duration::from_millis(500),
        background: false,
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;

    // One create the region never saw, one the region made but central never heard back from.
    sys.region("nyc2").go_down();
    post_with_key(
        &sys,
        &token,
        "never-seen",
        &create_body("never-seen", "nyc2"),
    )
    .await
    .assert_error(503, "service_unavailable");
    sys.region("nyc2").come_back();
    sys.region("nyc2")
        .proxy
        .set_mode(Mode::SlowResponses(Duration::from_millis(1500)));
    post_with_key(
        &sys,
        &token,
        "unanswered",
        &create_body("unanswered", "nyc2"),
    )
    .await
    .assert_error(503, "service_unavailable");
    sys.region("nyc2").proxy.set_mode(Mode::Pass);

    // Central restarts: a new process on the same database, running the background work.
    sys.restart_central().await;

    let names = eventually(Duration::from_secs(20), "both creates listed", || async {
        let list = listed(&sys, &token).await;
        (list.len() == 2).then_some(list)
    })
    .await;
    assert!(names.iter().all(|d| d["status"] == "new"));
    assert_eq!(region_rows(&sys, "nyc2").await, 2);
    // Each key now replays the settled create.
    for key in ["never-seen", "unanswered"] {
        let replay = post_with_key(&sys, &token, key, &create_body(key, "nyc2")).await;
        assert_eq!(replay.status, 202, "{}", replay.body);
        assert_eq!(replay.body["dedicated_inference"]["name"], key);
        assert!(replay.body["token"]["value"]
            .as_str()
            .unwrap()
            .starts_with("di_"));
    }
    let settled = central::feed::recover_once(&sys.central.app).await.unwrap();
    assert_eq!(settled, 0, "nothing left pending");
}

#[tokio::test]
async fn concurrent_creates_with_one_key_make_one_di() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let body = create_body("racy", "atl1");
    let replies = futures_join(&sys, &token, &body).await;
    let ok: Vec<&Reply> = replies.iter().filter(|r| r.status == 202).collect();
    assert!(!ok.is_empty());
    for r in &replies {
        assert!(
            r.status == 202 || r.status == 409,
            "{} {}",
            r.status,
            r.body
        );
    }
    let ids: std::collections::HashSet<String> = ok
        .iter()
        .map(|r| r.body["dedicated_inference"]["id"].to_string())
        .collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(listed(&sys, &token).await.len(), 1);
    assert_eq!(region_rows(&sys, "atl1").await, 1);
}

async fn futures_join(sys: &System, token: &str, body: &Value) -> Vec<Reply> {
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (http, url, token, body) = (
            sys.http.clone(),
            sys.url("/v2/dedicated-inferences"),
            token.to_string(),
            body.clone(),
        );
        tasks.push(tokio::spawn(async move {
            Reply::from(
                http.post(url)
                    .bearer_auth(token)
                    .header("idempotency-key", "same")
                    .json(&body)
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test]
async fn idempotent_patch_delete_and_token_create() {
    let sys = System::start().await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let (id, created) = sys.create_di(&token, "keys", "atl1").await;
    let send = |method: Method, path: String, key: &'static str, body: Option<Value>| {
        let mut req = sys
            .http
            .request(method, sys.url(&path))
            .bearer_auth(&token)
            .header("idempotency-key", key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move { Reply::from(req.send().await.unwrap()).await }
    };
    let t1 = send(
        Method::POST,
        format!("/v2/dedicated-inferences/{id}/tokens"),
        "tok",
        Some(json!({"name": "a"})),
    )
    .await;
    let t2 = send(
        Method::POST,
        format!("/v2/dedicated-inferences/{id}/tokens"),
        "tok",
        Some(json!({"name": "a"})),
    )
    .await;
    assert_eq!(t1.status, 202);
    assert_eq!(t1.body, t2.body);
    let tokens = sys
        .call(
            Method::GET,
            &format!("/v2/dedicated-inferences/{id}/tokens"),
            &token,
            None,
        )
        .await;
    assert_eq!(tokens.body["meta"]["total"], 2, "managed + one");

    let spec = created["dedicated_inference"]["spec"].clone();
    let p1 = send(
        Method::PATCH,
        format!("/v2/dedicated-inferences/{id}"),
        "patch",
        Some(json!({"spec": spec})),
    )
    .await;
    let p2 = send(
        Method::PATCH,
        format!("/v2/dedicated-inferences/{id}"),
        "patch",
        Some(json!({"spec": spec})),
    )
    .await;
    assert_eq!(p1.status, 202, "{}", p1.body);
    assert_eq!(
        p1.body, p2.body,
        "the retried patch is not a stale-version conflict"
    );

    let d1 = send(
        Method::DELETE,
        format!("/v2/dedicated-inferences/{id}"),
        "del",
        None,
    )
    .await;
    let d2 = send(
        Method::DELETE,
        format!("/v2/dedicated-inferences/{id}"),
        "del",
        None,
    )
    .await;
    assert_eq!((d1.status, d2.status), (202, 202));
}

/// A create is sent to its region by one driver at a time: while the customer's request waits
/// on a slow region, recovery leaves that create alone instead of sending it too. (Found by the
/// soak: recovery's attempt landed while the request's was answered "changed nothing", the
/// request gave the create up, and the customer's retry found its own name taken.)
#[tokio::test]
async fn recovery_leaves_a_create_alone_while_a_request_sends_it() {
    let sys = System::start_with(Options {
        background: false,
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    sys.proxy("atl1")
        .set_mode(Mode::SlowResponses(Duration::from_secs(6)));
    let request = {
        let (sys_url, http, token) = (
            sys.url("/v2/dedicated-inferences"),
            sys.http.clone(),
            token.clone(),
        );
        tokio::spawn(async move {
            http.post(sys_url)
                .bearer_auth(token)
                .json(&create_body("one-at-a-time", "atl1"))
                .send()
                .await
                .map(|r| r.status())
        })
    };
    // Still waiting on the region (6 s) and older than recovery's age: recovery's turn.
    until(
        Duration::from_secs(5),
        "the request is sending it",
        || async {
            central_count(
                &sys,
                "SELECT count(*) FROM pending_creates WHERE driven_until > now()",
            )
            .await
                == 1
        },
    )
    .await;
    age_pending_creates(&sys).await;
    let completed = central::feed::recover_once(&sys.central.app)
        .await
        .expect("recovery runs");
    assert_eq!(completed, 0);
    // Had it sent it too, its attempt would have failed on the slow region and been counted.
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM pending_creates")
        .fetch_one(sys.central.app.store.pool())
        .await
        .unwrap();
    assert_eq!(attempts, 0, "recovery sent a create a request was sending");
    let answered = request.await.unwrap().unwrap();
    assert_eq!(answered, 503, "the region answered after central's wait");
    sys.proxy("atl1").set_mode(Mode::Pass);
    // Now recovery finishes it, once.
    eventually(
        Duration::from_secs(20),
        "recovery finished the create",
        || async {
            let done = central::feed::recover_once(&sys.central.app).await.unwrap();
            (central_rows(&sys, "pending_creates").await == 0).then_some(done)
        },
    )
    .await;
    assert_eq!(region_rows(&sys, "atl1").await, 1);
}

/// A keyed PATCH's retry waits while the first attempt of its operation is in flight. When the
/// region refuses that attempt (here: over the team's GPU quota) the key is released; the retry
/// then runs its own attempt and gets the refusal too. It used to find the key gone, fail to
/// drive an operation that was never stored, and answer 409 once its patience ran out, which
/// clients do not retry (found by review).
#[tokio::test]
async fn a_keyed_retry_whose_first_attempt_is_refused_gets_the_refusal() {
    let mut sys = System::start_with(Options {
        background: false,
        ..Options::default()
    })
    .await;
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    let (id, created) = sys.create_di(&token, "over-quota", "atl1").await;
    // It holds 2 GPUs; 2 in all is its team's limit.
    sys.region("atl1")
        .store()
        .quota_overrides_set(
            team,
            &region_store::QuotaOverrides {
                gpus: Some(2),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut spec = created["dedicated_inference"]["spec"].clone();
    spec["model_deployments"][0]["accelerators"][0]["scale"] = json!(3);
    let body = json!({ "spec": spec });
    let path = format!("/v2/dedicated-inferences/{id}");
    sys.proxy("atl1")
        .set_mode(Mode::SlowResponses(Duration::from_secs(1)));
    let keyed = Keyed {
        sys: &sys,
        token: &token,
    };
    let (first, retry) = tokio::join!(
        keyed.send(Method::PATCH, &path, "refused", Some(&body)),
        async {
            // Sent while the first attempt waits for the region's answer.
            until(
                Duration::from_secs(5),
                "the first attempt sent to the region",
                || async {
                    central_count(
                        &sys,
                        "SELECT count(*) FROM idempotency_keys WHERE key = 'refused' AND driven_until > now()",
                    )
                    .await
                        == 1
                },
            )
            .await;
            keyed
                .send(Method::PATCH, &path, "refused", Some(&body))
                .await
        }
    );
    first.assert_error(422, "unprocessable_entity");
    retry.assert_error(422, "unprocessable_entity");
}

/// A keyed create's retry whose first attempt is still being sent by another driver (a replica
/// that took the drive as it lapsed, and a slow region) waits as long as its patience, then is
/// answered 503 with Retry-After, which clients retry; never 409, which they do not (found by
/// review).
#[tokio::test]
async fn a_keyed_create_retry_that_outwaits_its_patience_is_told_to_retry() {
    let mut sys = System::start_with(Options {
        background: false,
        region_timeout: Duration::from_secs(1),
        ..Options::default()
    })
    .await;
    let token = sys.token(Uuid::new_v4(), &[]).await;
    let body = create_body("held", "tor1");
    sys.region("tor1").go_down();
    post_with_key(&sys, &token, "held-1", &body)
        .await
        .assert_error(503, "service_unavailable");
    sys.region("tor1").come_back();
    // Another driver holds the create's drive for longer than a retry waits.
    sqlx::query("UPDATE pending_creates SET driven_until = now() + interval '1 hour'")
        .execute(sys.central.app.store.pool())
        .await
        .unwrap();
    let retried = post_with_key(&sys, &token, "held-1", &body).await;
    retried.assert_error(503, "service_unavailable");
    assert!(
        retried.headers.get("retry-after").is_some(),
        "{:?}",
        retried.headers
    );
}
