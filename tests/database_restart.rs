//! Postgres restarting under load, as a managed database does on failover or a minor upgrade
//! (`pg_ctl restart -m fast`): no request is answered `500`; those the outage refuses are `503`
//! with `Retry-After`; central, the regional services and the workers reconnect by themselves;
//! and every create acknowledged with `202` becomes active.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use system_tests::postgres::OwnPostgres;
use system_tests::{create_body, CloudOptions, Options, Reply, System, REGIONS};
use test_support::until;
use uuid::Uuid;

use crate::lifecycle::wait_active;

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Every answer: (what, status, error id, Retry-After).
    answers: Vec<(String, u16, Value, Option<String>)>,
    /// Creates answered 202: (id, region).
    accepted: Vec<(String, String)>,
    /// Creates that ended otherwise: (name, status, body).
    refused: Vec<(String, u16, Value)>,
}

struct Load {
    sys: Arc<System>,
    token: String,
    seen: Mutex<Seen>,
    /// Creates the clients may still start: the test hands them out phase by phase.
    creates: AtomicUsize,
    /// Creates started and not yet answered with anything but 503.
    in_flight: AtomicUsize,
    names: AtomicUsize,
    stop: AtomicBool,
}

impl Load {
    fn record(&self, what: &str, reply: &Reply) {
        let retry_after = reply
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.seen.lock().unwrap().answers.push((
            what.into(),
            reply.status,
            reply.body["id"].clone(),
            retry_after,
        ));
    }

    fn take_create(&self) -> bool {
        let taken = self
            .creates
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if taken {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
        }
        taken
    }

    /// One client: lists, and creates when a create is handed out. A create answered 503 is
    /// sent again with the same body, as pydo does, until it is answered otherwise.
    async fn client(self: Arc<Self>) {
        while !self.stop.load(Ordering::SeqCst) {
            let listed = self
                .sys
                .call(
                    Method::GET,
                    "/v2/dedicated-inferences?per_page=200",
                    &self.token,
                    None,
                )
                .await;
            self.record("list", &listed);
            if !self.take_create() {
                // A pace, not a wait: the clients list about 50 times a second between creates.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let n = self.names.fetch_add(1, Ordering::SeqCst);
            let (name, region) = (format!("restart-{n}"), REGIONS[n % REGIONS.len()]);
            let mut body = create_body(&name, region);
            body["spec"]["model_deployments"][0]["accelerators"][0]["scale"] = json!(1);
            let reply = loop {
                let reply = self
                    .sys
                    .call(
                        Method::POST,
                        "/v2/dedicated-inferences",
                        &self.token,
                        Some(body.clone()),
                    )
                    .await;
                self.record("create", &reply);
                if reply.status != 503 {
                    break reply;
                }
                // A client's retry pace after a 503 (pydo's), not a wait for a condition.
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            let mut seen = self.seen.lock().unwrap();
            match reply.body["dedicated_inference"]["id"].as_str() {
                Some(id) if reply.status == 202 => seen.accepted.push((id.into(), region.into())),
                _ => seen.refused.push((name, reply.status, reply.body)),
            }
            drop(seen);
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Hands out `n` creates and waits until every create handed out has been answered.
    async fn creates(&self, n: usize) {
        self.creates.fetch_add(n, Ordering::SeqCst);
        self.all_answered().await;
    }

    async fn all_answered(&self) {
        until(
            Duration::from_secs(120),
            "every create handed out answered",
            || async {
                self.creates.load(Ordering::SeqCst) == 0
                    && self.in_flight.load(Ordering::SeqCst) == 0
            },
        )
        .await;
    }
}

fn seen_accepted(load: &Load) -> Vec<(String, String)> {
    load.seen.lock().unwrap().accepted.clone()
}

fn assert_unavailable(reply: &Reply) {
    reply.assert_error(503, "service_unavailable");
    assert!(
        reply.headers.contains_key("retry-after"),
        "a 503 without Retry-After: {:?}",
        reply.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_is_503_with_retry_after_and_loses_no_create() {
    let pg = OwnPostgres::start().await;
    let sys = Arc::new(
        System::start_with(Options {
            cloud: Some(CloudOptions::default()),
            database: Some(pg.url()),
            ..Options::default()
        })
        .await,
    );
    let team = Uuid::new_v4();
    let token = sys.token(team, &[]).await;
    let load = Arc::new(Load {
        sys: sys.clone(),
        token: token.clone(),
        seen: Mutex::default(),
        creates: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        names: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let clients: Vec<_> = (0..3)
        .map(|_| tokio::spawn(load.clone().client()))
        .collect();

    // Before: creates land.
    load.creates(3).await;
    // During a restart: creates and lists race with it.
    load.creates.fetch_add(3, Ordering::SeqCst);
    pg.restart().await;
    load.all_answered().await;
    // After it: the services reconnected by themselves.
    load.creates(2).await;

    // While the server is down, every call that needs it is a 503 with Retry-After (central's
    // database for the list and the create), and a create sent meanwhile is retried until it lands.
    pg.stop().await;
    let list = sys
        .call(Method::GET, "/v2/dedicated-inferences", &token, None)
        .await;
    assert_unavailable(&list);
    let create = sys
        .call(
            Method::POST,
            "/v2/dedicated-inferences",
            &token,
            Some(create_body("while-down", "atl1")),
        )
        .await;
    assert_unavailable(&create);
    // The regional service answers central alike: 503 with Retry-After, which central takes as
    // "outcome unknown" (never as a refusal that changed nothing).
    let (id, region) = seen_accepted(&load)[0].clone();
    let direct = sys.region_record(&region, &id, team).await;
    assert_eq!(direct.status, 503, "{}", direct.body);
    assert_eq!(direct.body["id"], "service_unavailable", "{}", direct.body);
    assert!(
        direct.headers.contains_key("retry-after"),
        "{:?}",
        direct.headers
    );
    load.creates.fetch_add(2, Ordering::SeqCst);
    pg.start_again().await;
    load.all_answered().await;
    load.stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("a client ends");
    }

    let seen = std::mem::take(&mut *load.seen.lock().unwrap());
    for (what, status, id, retry_after) in &seen.answers {
        assert!(
            *status < 500
                || (*status == 503 && *id == "service_unavailable" && retry_after.is_some()),
            "{what} answered {status} ({id}, Retry-After {retry_after:?})"
        );
    }
    assert!(
        seen.refused.is_empty(),
        "creates refused: {:?}",
        seen.refused
    );
    assert_eq!(
        seen.accepted.len(),
        10,
        "every create handed out was accepted"
    );
    for (id, region) in &seen.accepted {
        wait_active(&sys, &token, region, id, 1).await;
    }
    // Nothing more: a create retried after a 503 found the one it had started, if any.
    let listed = sys
        .call(
            Method::GET,
            "/v2/dedicated-inferences?per_page=200",
            &token,
            None,
        )
        .await;
    let ids: BTreeSet<&str> = listed.body["dedicated_inferences"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|di| di["id"].as_str())
        .collect();
    let accepted: BTreeSet<&str> = seen.accepted.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, accepted);
}
