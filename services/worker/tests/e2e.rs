//! The worker end to end against the region simulator: a fresh regional database, the store
//! used directly (as the regional service would), one or two in-process workers.
//!
//! Needs DATABASE_URL (a Postgres the tests may create databases in).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use api_types::regional::{CreateRequest, NewToken, Record};
use api_types::spec::{AcceleratorGroup, ModelDeployment, Spec};
use common::seal::Sealer;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use region_sim::{Delays, RegionSim, SimConfig};
use region_store::{sqlx, NewCa, Store};
use uuid::Uuid;
use worker::reconcile::{Reconciler, Settings};
use worker::runtime::{Config, Worker, WorkerHandle};

const MODEL: &str = "qwen/qwen2.5-7b-instruct";
const GPU: &str = "gpu-h100x1-80gb";
const SIM_TOKEN: &str = "sim-token";
const PROBE_SECRET: &[u8] = b"probe-secret-for-tests";

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "worker=info,warn".to_string()),
        )
        .with_test_writer()
        .try_init();
}

async fn fresh_database() -> String {
    use sqlx::Connection;
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL must point at a Postgres");
    let name = format!("worker_e2e_{}", Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .expect("connect to DATABASE_URL");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .expect("create database");
    let mut url = reqwest::Url::parse(&admin).expect("DATABASE_URL is a URL");
    url.set_path(&name);
    url.to_string()
}

fn generate_ca(id: Uuid) -> NewCa {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, format!("Dedicated Inference {id} CA"));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    NewCa {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

struct Env {
    sim: RegionSim,
    store: Store,
    database_url: String,
    seal_key: String,
    vpc: Uuid,
    team: Uuid,
}

fn small_delays() -> Delays {
    Delays {
        cluster_provision_ms: 300,
        node_provision_ms: 200,
        deletion_ms: 100,
        lb_provision_ms: 100,
        model_load_ms: 200,
        gateway_address_ms: 50,
    }
}

async fn env_with(capacity: Option<BTreeMap<String, u32>>) -> Env {
    init_logs();
    let database_url = fresh_database().await;
    let seal_key = Sealer::generate_key();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .connect(&database_url)
        .await
        .unwrap();
    let store = Store::new(pool, Sealer::from_base64(&seal_key).unwrap());
    store.migrate().await.unwrap();
    let mut cfg = SimConfig::new("atl1", SIM_TOKEN);
    cfg.delays = small_delays();
    if let Some(c) = capacity {
        cfg.gpu_capacity = c;
    }
    let sim = RegionSim::start(cfg).await.unwrap();
    let cloud = cloud_clients::DoClient::new(&sim.base_url(), SIM_TOKEN).unwrap();
    let vpc = cloud
        .vpc_list()
        .await
        .unwrap()
        .into_iter()
        .find(|v| v.default)
        .expect("the default VPC")
        .id
        .parse()
        .unwrap();
    Env {
        sim,
        store,
        database_url,
        seal_key,
        vpc,
        team: Uuid::new_v4(),
    }
}

impl Env {
    fn config(&self) -> Config {
        let mut c = Config::new(
            "atl1",
            &self.database_url,
            &self.seal_key,
            &self.sim.base_url(),
            SIM_TOKEN,
            PROBE_SECRET,
        );
        c.concurrency = 4;
        c.lease = Duration::from_secs(5);
        c.tick = Duration::from_millis(200);
        c.backoff_base = Duration::from_millis(100);
        c.backoff_max = Duration::from_secs(1);
        c.db_max_connections = 4;
        c.settings.poll = Duration::from_millis(150);
        c.settings.resync = Duration::from_secs(60);
        c.settings.system_pool_size = "s-2vcpu-4gb".into();
        c.settings.system_pool_count = 1;
        c
    }

    async fn worker(&self) -> WorkerHandle {
        Worker::start(self.config()).await.unwrap()
    }

    fn spec(&self, scale: i32, model_id: Option<Uuid>) -> Spec {
        Spec {
            version: 1,
            name: "e2e".into(),
            region: "atl1".into(),
            vpc_uuid: self.vpc,
            enable_public_endpoint: true,
            model_deployments: vec![ModelDeployment {
                model_id,
                model_slug: MODEL.into(),
                model_provider: "hugging_face".into(),
                workload_config: serde_json::json!({}),
                accelerators: vec![AcceleratorGroup {
                    accelerator_slug: GPU.into(),
                    role: "prefill_decode".into(),
                    scale,
                }],
            }],
        }
    }

    /// Creates a DI; returns it and its managed token's value.
    async fn create(&self, scale: i32) -> (Record, String) {
        let id = Uuid::new_v4();
        let token = common::tokens::mint("di_");
        let req = CreateRequest {
            id,
            team_id: self.team,
            spec: self.spec(scale, None),
            hugging_face_token: None,
            managed_token: NewToken {
                id: Uuid::new_v4(),
                name: "managed".into(),
                sha256_hex: common::tokens::sha256_hex(&token),
            },
        };
        let rec = self
            .store
            .dedicated_inference_create(&req, &generate_ca(id))
            .await
            .unwrap();
        (rec, token)
    }

    async fn wait_for(
        &self,
        id: Uuid,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Record) -> bool,
    ) -> Record {
        let start = Instant::now();
        loop {
            let r = self.store.dedicated_inference_any(id).await.unwrap();
            if done(&r) {
                return r;
            }
            if start.elapsed() > timeout {
                let events = self
                    .store
                    .events_list(id, self.team, 1, 50)
                    .await
                    .map(|p| {
                        p.items
                            .into_iter()
                            .map(|e| format!("{} {}: {}", e.phase, e.reason, e.message))
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default();
                panic!(
                    "timed out waiting for {what}: status {} reason {:?} pending {:?}\nevents: {events:#?}\nleftovers: {:#?}",
                    r.status,
                    r.status_reason,
                    r.pending_spec.as_ref().map(|s| s.version),
                    self.sim.inventory().leftovers()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_active(&self, id: Uuid, version: i32) -> Record {
        self.wait_for(
            id,
            &format!("active v{version}"),
            Duration::from_secs(60),
            |r| {
                r.status == "active"
                    && r.pending_spec.is_none()
                    && r.spec.as_ref().map(|s| s.version) == Some(version)
            },
        )
        .await
    }

    async fn wait_gone(&self, id: Uuid) {
        self.wait_for(id, "gone", Duration::from_secs(60), |r| r.gone)
            .await;
        let start = Instant::now();
        loop {
            let left = self.sim.inventory().leftovers();
            if left.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "leftovers after gone: {left:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn ca_client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn chat(client: &reqwest::Client, endpoint: &str, token: &str) -> reqwest::StatusCode {
    client
        .post(format!("{endpoint}/v1/chat/completions"))
        .bearer_auth(token)
        .json(&serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
        }))
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_serve_scale_and_delete() {
    let env = env_with(None).await;
    let w1 = env.worker().await;
    let w2 = env.worker().await;
    let (rec, token) = env.create(1).await;
    let id = rec.id;

    // Active, with its endpoint answering the customer's token through the data plane.
    let active = env.wait_active(id, 1).await;
    assert_eq!(active.status_reason, None);
    let fqdn = active
        .public_endpoint_fqdn
        .clone()
        .expect("a public endpoint");
    assert!(
        fqdn.starts_with("https://127.0.0.1:"),
        "recorded as a URL: {fqdn}"
    );
    assert!(active.private_endpoint_fqdn.is_some());
    let accelerators = env
        .store
        .accelerators_list(id, env.team, None, 1, 20)
        .await
        .unwrap();
    assert_eq!(accelerators.total, 1, "{:?}", accelerators.items);
    assert_eq!(accelerators.items[0].slug, GPU);
    let ca = env.store.ca_certificate(id, env.team).await.unwrap();
    let client = ca_client(&ca);
    assert_eq!(chat(&client, &fqdn, &token).await, reqwest::StatusCode::OK);
    assert_eq!(
        chat(&client, &fqdn, "di_not-a-real-token").await,
        reqwest::StatusCode::UNAUTHORIZED
    );

    // Scale to 2: updating, then active v2.
    let model_id = active.spec.as_ref().unwrap().model_deployments[0].model_id;
    let mut spec = env.spec(2, model_id);
    spec.version = 1;
    env.store
        .dedicated_inference_patch(id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    let v2 = env.wait_active(id, 2).await;
    assert_eq!(
        v2.spec.as_ref().unwrap().model_deployments[0].accelerators[0].scale,
        2
    );
    let start = Instant::now();
    loop {
        let a = env
            .store
            .accelerators_list(id, env.team, None, 1, 20)
            .await
            .unwrap();
        if a.total == 2 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{:?}", a.items);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fqdn = v2.public_endpoint_fqdn.clone().unwrap();
    assert_eq!(chat(&client, &fqdn, &token).await, reqwest::StatusCode::OK);

    // Delete: gone, and nothing left in the region.
    env.store
        .dedicated_inference_delete(id, env.team)
        .await
        .unwrap();
    env.wait_gone(id).await;
    assert!(w1.stats().passes + w2.stats().passes > 0);
    w1.shutdown().await;
    w2.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pass_over_an_active_di_writes_nothing() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;
    w.shutdown().await;

    // A fresh reconciler, as another worker would be.
    let cloud = cloud_clients::DoClient::new(&env.sim.base_url(), SIM_TOKEN).unwrap();
    let r = Reconciler::new(env.store.clone(), cloud, env.config().settings);
    let do_before = env.sim.do_mutations();
    for _ in 0..2 {
        let pass = r.reconcile(rec.id).await.unwrap();
        assert_eq!(pass.waiting, None, "{pass:?}");
        assert_eq!((pass.do_writes, pass.kube_writes), (0, 0), "{pass:?}");
    }
    assert_eq!(
        env.sim.do_mutations(),
        do_before,
        "{:?}",
        env.sim.stats().mutation_log
    );
    assert_eq!(r.kube_writes(), 0);
    assert_eq!(r.do_mutations(), 0);
    let after = env.store.dedicated_inference_any(rec.id).await.unwrap();
    assert_eq!(after.status, "active");
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_gpu_capacity_is_an_error_with_a_reason_until_the_spec_changes() {
    let env = env_with(Some(BTreeMap::from([(GPU.to_string(), 1)]))).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(2).await;
    let failed = env
        .wait_for(rec.id, "error", Duration::from_secs(30), |r| {
            r.status == "error"
        })
        .await;
    assert_eq!(failed.status_reason.as_deref(), Some("CapacityExhausted"));
    // Not retried: it stays in error.
    let passes = w.stats().passes + w.stats().permanent_failures;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        w.stats().passes + w.stats().permanent_failures,
        passes,
        "an error DI is not retried"
    );
    // A spec that fits: it recovers.
    let model_id = failed.pending_spec.as_ref().unwrap().model_deployments[0].model_id;
    let spec = env.spec(1, model_id);
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    env.wait_active(rec.id, 2).await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_lease_expires_and_another_finishes() {
    let env = env_with(None).await;
    let mut cfg = env.config();
    cfg.lease = Duration::from_secs(1);
    let w1 = Worker::start(cfg).await.unwrap();
    let (rec, token) = env.create(1).await;
    // Let w1 start provisioning, then kill it mid-way.
    env.wait_for(rec.id, "provisioning", Duration::from_secs(20), |r| {
        r.status == "provisioning"
    })
    .await;
    w1.kill();
    let w2 = env.worker().await;
    let active = env.wait_active(rec.id, 1).await;
    let inv = env.sim.inventory();
    let gpu_pools = inv
        .cloud
        .node_pools
        .iter()
        .filter(|p| p["size"] == GPU)
        .count();
    assert_eq!(gpu_pools, 1, "no duplicate node pool");
    assert_eq!(inv.cloud.clusters.len(), 1, "no duplicate cluster");
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    assert_eq!(
        chat(
            &client,
            active.public_endpoint_fqdn.as_deref().unwrap(),
            &token
        )
        .await,
        reqwest::StatusCode::OK
    );
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w2.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_during_provisioning_leaves_nothing() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_for(rec.id, "provisioning", Duration::from_secs(20), |r| {
        r.status == "provisioning"
    })
    .await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

/// Silences "unused" for the settings constructor used by other test files.
#[allow(dead_code)]
fn _settings() -> Settings {
    Settings::new("atl1", PROBE_SECRET)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_with_faults_injected_on_every_api() {
    let env = env_with(None).await;
    env.sim.set_faults(region_sim::FaultConfig {
        do_api: region_sim::ApiFaults {
            error_rate: 0.2,
            rate_limit_rate: 0.1,
            retry_after_secs: 0,
            latency_ms: 0,
        },
        kube: region_sim::ApiFaults {
            error_rate: 0.1,
            rate_limit_rate: 0.05,
            retry_after_secs: 0,
            latency_ms: 0,
        },
        data_plane: region_sim::ApiFaults {
            error_rate: 0.2,
            ..Default::default()
        },
    });
    let w = env.worker().await;
    let (rec, _token) = env.create(1).await;
    env.wait_active(rec.id, 1).await;
    let model_id = env
        .store
        .dedicated_inference_any(rec.id)
        .await
        .unwrap()
        .spec
        .unwrap()
        .model_deployments[0]
        .model_id;
    let mut spec = env.spec(2, model_id);
    spec.version = 1;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&spec), None, false)
        .await
        .unwrap();
    env.wait_active(rec.id, 2).await;
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_mid_rollout_supersedes_the_spec_rolling_out() {
    let env = env_with(None).await;
    let w = env.worker().await;
    let (rec, token) = env.create(1).await;
    let active = env.wait_active(rec.id, 1).await;
    let model_id = active.spec.unwrap().model_deployments[0].model_id;
    let mut v2 = env.spec(3, model_id);
    v2.version = 1;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&v2), None, false)
        .await
        .unwrap();
    let mut v3 = env.spec(2, model_id);
    v3.version = 2;
    env.store
        .dedicated_inference_patch(rec.id, env.team, Some(&v3), None, false)
        .await
        .unwrap();
    let done = env.wait_active(rec.id, 3).await;
    assert_eq!(
        done.spec.unwrap().model_deployments[0].accelerators[0].scale,
        2
    );
    let start = Instant::now();
    loop {
        let a = env
            .store
            .accelerators_list(rec.id, env.team, None, 1, 20)
            .await
            .unwrap();
        if a.total == 2 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{:?}", a.items);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = ca_client(&env.store.ca_certificate(rec.id, env.team).await.unwrap());
    assert_eq!(
        chat(
            &client,
            done.public_endpoint_fqdn.as_deref().unwrap(),
            &token
        )
        .await,
        reqwest::StatusCode::OK
    );
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase_without_progress_becomes_an_event_then_an_error() {
    let env = env_with(None).await;
    // Model servers that never finish loading.
    let mut d = small_delays();
    d.model_load_ms = 3_600_000;
    env.sim.set_delays(d);
    let mut cfg = env.config();
    cfg.stall_timeout = Duration::from_secs(2);
    let w = Worker::start(cfg).await.unwrap();
    let (rec, _token) = env.create(1).await;
    let failed = env
        .wait_for(rec.id, "stalled", Duration::from_secs(30), |r| {
            r.status == "error"
        })
        .await;
    assert_eq!(failed.status_reason.as_deref(), Some("Stalled"));
    let events = env
        .store
        .events_list(rec.id, env.team, 1, 100)
        .await
        .unwrap();
    let reasons: Vec<&str> = events.items.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"Slow"), "{reasons:?}");
    assert!(reasons.contains(&"Stalled"), "{reasons:?}");
    // Delete still cleans up.
    env.sim.set_delays(small_delays());
    env.store
        .dedicated_inference_delete(rec.id, env.team)
        .await
        .unwrap();
    env.wait_gone(rec.id).await;
    w.shutdown().await;
    env.sim.shutdown().await;
}
