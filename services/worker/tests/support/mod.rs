//! Scaffolding shared by the worker's end-to-end test binaries: a fresh regional database, the
//! region simulator, the store used directly (as the regional service would) and in-process
//! workers. Needs DATABASE_URL (a Postgres the tests may create databases in).

// Each test binary uses only some of these helpers.
#![allow(dead_code)]

use common::clock::Clock;
use std::collections::BTreeMap;
use std::time::Duration;

pub use api_types::lifecycle::Status;
use api_types::regional::{CreateRequest, NewToken, Record};
use api_types::spec::{AcceleratorGroup, ModelDeployment, Spec};
use cloud_clients::{DoClient, DoClientOptions, KubeClientOptions, RetryConfig};
use common::seal::Sealer;
use region_sim::{Delays, RegionSim, SimConfig};
use region_store::{sqlx, Store};
use uuid::Uuid;
use worker::reconcile::Reconciler;
use worker::runtime::{Config, Worker, WorkerHandle};

pub const MODEL: &str = "qwen/qwen2.5-7b-instruct";
pub const GPU: &str = "gpu-h100x1-80gb";
pub const SIM_TOKEN: &str = "sim-token";

pub fn init_logs() {
    init_logs_with("worker=info,warn");
}

/// As [`init_logs`] with another filter when `RUST_LOG` is not set; the first call in a test
/// binary decides.
pub fn init_logs_with(default_filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| default_filter.to_string()))
        .with_test_writer()
        .try_init();
}

pub async fn fresh_database() -> String {
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

pub struct Env {
    pub sim: RegionSim,
    pub store: Store,
    pub database_url: String,
    pub seal_key: String,
    pub vpc: Uuid,
    pub team: Uuid,
    /// The clock the simulated cloud and the worker's cluster clients share: a test advances
    /// it to let credentials come due or expire without waiting for them.
    pub clock: Clock,
}

pub fn small_delays() -> Delays {
    Delays {
        cluster_provision_ms: 300,
        node_provision_ms: 200,
        deletion_ms: 100,
        lb_provision_ms: 100,
        model_load_ms: 200,
        gateway_address_ms: 50,
    }
}

pub async fn env_with(capacity: Option<BTreeMap<String, u32>>) -> Env {
    env_with_delays(capacity, small_delays()).await
}

pub async fn env_with_delays(capacity: Option<BTreeMap<String, u32>>, delays: Delays) -> Env {
    env_with_sim(|cfg| {
        cfg.delays = delays;
        if let Some(c) = capacity {
            cfg.gpu_capacity = c;
        }
    })
    .await
}

/// An environment whose simulator is configured by `configure` (small delays unless it says
/// otherwise).
pub async fn env_with_sim(configure: impl FnOnce(&mut SimConfig)) -> Env {
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
    let clock = Clock::system();
    let mut cfg = SimConfig::new("atl1", SIM_TOKEN);
    cfg.delays = small_delays();
    cfg.clock = clock.clone();
    configure(&mut cfg);
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
        clock,
    }
}

impl Env {
    pub fn config(&self) -> Config {
        let mut c = Config::new(
            "atl1",
            &self.database_url,
            &self.seal_key,
            &self.sim.base_url(),
            SIM_TOKEN,
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
        c.settings.clock = self.clock.clone();
        c
    }

    /// A DigitalOcean client for the simulator, as a test's own (not a worker's).
    pub fn cloud(&self) -> cloud_clients::DoClient {
        cloud_clients::DoClient::new(&self.sim.base_url(), SIM_TOKEN).unwrap()
    }

    /// Deletes DI `di`'s private load balancer Service behind the workers' back (the test has
    /// one cluster); the one a worker applies again gets another address.
    pub async fn delete_private_service(&self, di: Uuid) {
        let kube = self.cluster_kube().await;
        let ns = worker::plan::names::namespace(&di);
        kube.delete(
            "v1",
            "Service",
            Some(&ns),
            worker::plan::names::PRIVATE_SERVICE,
        )
        .await
        .unwrap();
    }

    /// A Kubernetes client of the test's own for the region's one cluster.
    pub async fn cluster_kube(&self) -> cloud_clients::KubeClient {
        let cloud = self.cloud();
        let cluster = cloud.cluster_list().await.unwrap().remove(0);
        let kubeconfig = cloud.kubeconfig(&cluster.id).await.unwrap();
        cloud_clients::KubeClient::from_kubeconfig_yaml(&kubeconfig, "a-test")
            .await
            .unwrap()
    }

    /// A reconciler of its own, as a worker builds it, whose DigitalOcean and Kubernetes
    /// clients retry as `retry` says: for tests that drive passes one by one.
    pub fn reconciler(&self, retry: RetryConfig) -> Reconciler {
        self.reconciler_with(retry, self.config().settings)
    }

    /// As [`Env::reconciler`], with `settings`.
    pub fn reconciler_with(
        &self,
        retry: RetryConfig,
        settings: worker::reconcile::Settings,
    ) -> Reconciler {
        let options = DoClientOptions {
            retry: retry.clone(),
            ..DoClientOptions::default()
        };
        let cloud = DoClient::with_options(&self.sim.base_url(), SIM_TOKEN, options).unwrap();
        Reconciler::new(self.store.clone(), cloud, settings).with_kube_options(KubeClientOptions {
            retry,
            ..KubeClientOptions::default()
        })
    }

    pub async fn worker(&self) -> WorkerHandle {
        Worker::start(self.config()).await.unwrap()
    }

    pub fn spec(&self, scale: i32, model_id: Option<Uuid>) -> Spec {
        Spec {
            version: 1,
            name: "e2e".into(),
            region: "atl1".into(),
            vpc_uuid: Some(self.vpc),
            enable_public_endpoint: true,
            model_deployments: vec![ModelDeployment {
                model_id,
                model_slug: MODEL.into(),
                model_provider: "hugging_face".into(),
                provider_model_id: String::new(),
                source: api_types::spec::ModelSource::default(),
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
    pub async fn create(&self, scale: i32) -> (Record, String) {
        self.create_in(self.vpc, scale).await
    }

    /// A new VPC of the simulated region (`POST /v2/vpcs`).
    pub async fn new_vpc(&self, name: &str) -> Uuid {
        let v: serde_json::Value = reqwest::Client::new()
            .post(format!("{}/v2/vpcs", self.sim.base_url()))
            .bearer_auth(SIM_TOKEN)
            .json(&serde_json::json!({"name": name, "region": "atl1"}))
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap()
            .json()
            .await
            .unwrap();
        v["vpc"]["id"].as_str().unwrap().parse().unwrap()
    }

    /// Creates a DI in VPC `vpc`; returns it and its managed token's value.
    pub async fn create_in(&self, vpc: Uuid, scale: i32) -> (Record, String) {
        let id = Uuid::new_v4();
        let token = common::tokens::mint("di_");
        let req = CreateRequest {
            id,
            team_id: self.team,
            spec: Spec {
                vpc_uuid: Some(vpc),
                ..self.spec(scale, None)
            },
            hugging_face_token: None,
            managed_token: NewToken {
                id: Uuid::new_v4(),
                name: "managed".into(),
                sha256_hex: common::tokens::sha256_hex(&token),
            },
        };
        let rec = self
            .store
            .dedicated_inference_create(&req, &regional::ca::generate(id).expect("CA"))
            .await
            .unwrap();
        (rec, token)
    }

    /// Creates DIs of scale 1 (in the test VPC: they share its cluster) and waits until every
    /// one is active; each with what a client needs to call it.
    pub async fn create_active(&self, n: usize) -> Vec<Serving> {
        let mut created = Vec::new();
        for _ in 0..n {
            created.push(self.create(1).await);
        }
        let mut serving = Vec::new();
        for (rec, token) in created {
            let active = self.wait_active(rec.id, 1).await;
            serving.push(Serving {
                client: ca_client(&self.store.ca_certificate(rec.id, self.team).await.unwrap()),
                url: active
                    .public_endpoint_fqdn
                    .clone()
                    .expect("a public endpoint"),
                record: active,
                token,
            });
        }
        serving
    }

    /// Stores `spec` as DI `id`'s next spec (`spec.version` is the latest one, as in a PATCH).
    pub async fn patch(&self, id: Uuid, spec: &Spec) -> Record {
        self.store
            .dedicated_inference_patch(id, self.team, Some(spec), None, false)
            .await
            .unwrap()
    }

    pub async fn wait_for(
        &self,
        id: Uuid,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Record) -> bool,
    ) -> Record {
        let done = &done;
        let found = test_support::within(timeout, move || async move {
            let r = self.store.dedicated_inference_any(id).await.unwrap();
            done(&r).then_some(r)
        })
        .await;
        if let Some(r) = found {
            return r;
        }
        let r = self.store.dedicated_inference_any(id).await.unwrap();
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

    pub async fn wait_active(&self, id: Uuid, version: i32) -> Record {
        self.wait_for(
            id,
            &format!("active v{version}"),
            Duration::from_secs(60),
            |r| {
                r.status == Status::Active
                    && r.pending_spec.is_none()
                    && r.spec.as_ref().map(|s| s.version) == Some(version)
            },
        )
        .await
    }

    /// Deletes DI `id` and waits until it is gone (other DIs may still use the region).
    pub async fn delete_until_gone(&self, id: Uuid) {
        self.store
            .dedicated_inference_delete(id, self.team)
            .await
            .unwrap();
        self.wait_for(id, "gone", Duration::from_secs(60), |r| r.gone)
            .await;
    }

    /// Moves DI `id`'s work item `by` into the past (when its lease ends, when it is next due,
    /// since when it has made no progress), as queue.rs's `age` does: what time would do to it,
    /// without waiting for the database's clock to get there.
    pub async fn age(&self, id: Uuid, by: Duration) {
        sqlx::query(
            "UPDATE work_items SET expires_at = expires_at - $2 * interval '1 millisecond',
                    next_check_after = next_check_after - $2 * interval '1 millisecond',
                    progress_since = progress_since - $2 * interval '1 millisecond'
              WHERE di_id = $1",
        )
        .bind(id)
        .bind(by.as_millis() as f64)
        .execute(self.store.pool())
        .await
        .unwrap();
    }

    /// A new access token of DI `id`, created as a customer does; its value.
    pub async fn token_create(&self, id: Uuid, name: &str) -> String {
        let value = common::tokens::mint("di_");
        let token = NewToken {
            id: Uuid::new_v4(),
            name: name.into(),
            sha256_hex: common::tokens::sha256_hex(&value),
        };
        self.store
            .token_create(id, self.team, &token)
            .await
            .unwrap();
        value
    }

    /// Turns the simulated serving model on (real time), so that a model server's metrics show
    /// the requests it runs and serves.
    pub fn serving_model_on(&self) {
        self.sim.set_model_timing(region_sim::ModelTiming {
            serving: region_sim::ServingConfig {
                time_scale: 1.0,
                ..Default::default()
            },
            ..Default::default()
        });
    }

    pub async fn wait_gone(&self, id: Uuid) {
        self.wait_for(id, "gone", Duration::from_secs(60), |r| r.gone)
            .await;
        let clean = test_support::within(Duration::from_secs(10), || async {
            self.sim.inventory().leftovers().is_empty().then_some(())
        })
        .await;
        let left = self.sim.inventory().leftovers();
        assert!(clean.is_some(), "leftovers after gone: {left:#?}");
    }
}

/// An active DI: its record, its managed token, a client trusting its CA and its public URL.
pub struct Serving {
    pub record: Record,
    pub token: String,
    pub client: reqwest::Client,
    pub url: String,
}

pub fn ca_client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

pub async fn chat(client: &reqwest::Client, endpoint: &str, token: &str) -> reqwest::StatusCode {
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
