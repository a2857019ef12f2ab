//! The test harness: throwaway databases on the Postgres named by `DATABASE_URL`, the whole
//! control plane (central + regional services) on real loopback sockets, and a TCP proxy in front
//! of each region that can make it slow or unreachable. Each region has an in-process region
//! simulator (the regional service asks its DigitalOcean API which VPCs a team owns); with
//! [`Options::cloud`] it also gets reconcile workers, so a DI created through the public API
//! really comes up and serves. With [`Options::region_tls`] the regions serve HTTPS only, with
//! certificates of a test CA that central trusts, as deployed.

pub mod postgres;
pub mod proxy;
pub mod python;
pub mod tls;

use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

pub const REGIONS: &[&str] = &["atl1", "nyc2", "tor1"];

/// The Postgres server to create test databases on. Missing is an error, never a skip.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .expect("DATABASE_URL must point at a Postgres server; run the tests with scripts/test, which starts one")
}

/// A fresh, empty database on `DATABASE_URL`'s server; returns its URL.
pub async fn fresh_database(prefix: &str) -> String {
    fresh_database_on(&database_url(), prefix).await
}

/// A fresh, empty database on the server of `admin` (a URL of one of its databases).
pub async fn fresh_database_on(admin: &str, prefix: &str) -> String {
    use sqlx::Connection;
    let name = format!("{prefix}_{}", Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .expect("connect to the test Postgres");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .expect("create database");
    let mut url = reqwest::Url::parse(admin).expect("a Postgres URL");
    url.set_path(&name);
    url.to_string()
}

pub struct RegionHandle {
    pub name: String,
    pub database_url: String,
    pub secret: String,
    pub seal_key: String,
    /// Keys the region's services and workers open sealed values with besides `seal_key` (a
    /// sealing key rotation).
    pub seal_open_keys: Vec<String>,
    pub server: Option<regional::Server>,
    pub proxy: proxy::Proxy,
    /// The region's simulated cloud, and its workers with [`Options::cloud`].
    pub cloud: Cloud,
    /// Its certificate files with [`Options::region_tls`].
    pub tls: regional::tls::TlsArgs,
}

/// The DigitalOcean API token the simulators accept and the workers send.
pub const SIM_TOKEN: &str = "sim-do-token";
/// The customers' Hugging Face token in tests: the simulated Hub knows it, with access to the
/// catalog's gated models.
pub const HF_TOKEN: &str = "hf_system_test_placeholder";
/// How each region's simulated cloud and workers are set up.
#[derive(Clone, Debug)]
pub struct CloudOptions {
    /// Workers started per region.
    pub workers: usize,
    /// The simulators' delays: small, so that a DI comes up in a second or two.
    pub delays: region_sim::Delays,
    /// The workers' lease: how long a killed worker's DI waits before another takes it over.
    pub lease: Duration,
    /// How long the simulators' cluster credentials live (DOKS: 7 days, the default).
    pub credential_ttl: Duration,
    /// How soon the workers look again at a converged DI; `None`: the worker's default.
    pub resync: Option<Duration>,
    /// The autoscaler's look interval and scale-down window; `None`: the worker's defaults.
    pub autoscale_interval: Option<Duration>,
    pub scale_down_window: Option<Duration>,
    /// The simulated model servers' serving model (`region_sim::ServingConfig::time_scale`):
    /// 0, the default, answers at once; 1 is real time.
    pub serving_time_scale: f64,
}

impl CloudOptions {
    /// Delays small enough for quick tests, large enough that each phase (cluster, nodes, model
    /// load, teardown) is a distinct step a test can observe.
    pub fn quick_delays() -> region_sim::Delays {
        region_sim::Delays {
            cluster_provision_ms: 300,
            node_provision_ms: 200,
            deletion_ms: 300,
            lb_provision_ms: 100,
            model_load_ms: 200,
            gateway_address_ms: 50,
        }
    }
}

impl Default for CloudOptions {
    fn default() -> Self {
        CloudOptions {
            workers: 1,
            delays: Self::quick_delays(),
            lease: Duration::from_secs(3),
            credential_ttl: region_sim::DEFAULT_CREDENTIAL_TTL,
            resync: None,
            autoscale_interval: None,
            scale_down_window: None,
            serving_time_scale: 0.0,
        }
    }
}

/// A region's simulated cloud (DigitalOcean API, DOKS clusters, data plane) and its workers.
pub struct Cloud {
    pub sim: region_sim::RegionSim,
    /// The Hugging Face Hub the workers' model servers download from.
    hub_url: String,
    /// Running workers; `None` where one was killed.
    pub workers: Vec<Option<worker::runtime::WorkerHandle>>,
    options: CloudOptions,
}

impl Cloud {
    /// The simulator alone; [`Cloud::start_worker`] adds workers.
    async fn start(region: &str, options: &CloudOptions, hub_url: &str) -> Cloud {
        let mut cfg = region_sim::SimConfig::new(region, SIM_TOKEN);
        cfg.delays = options.delays.clone();
        cfg.credential_ttl = options.credential_ttl;
        cfg.model.serving.time_scale = options.serving_time_scale;
        let sim = region_sim::RegionSim::start(cfg)
            .await
            .expect("region simulator starts");
        Cloud {
            sim,
            hub_url: hub_url.to_string(),
            workers: Vec::new(),
            options: options.clone(),
        }
    }

    /// A VPC of `team` (a DigitalOcean account) made through the simulated DigitalOcean API, as
    /// a customer makes one.
    pub async fn create_vpc(&self, team: Uuid, name: &str) -> Uuid {
        let region = self.sim.inventory().region;
        let reply = reqwest::Client::new()
            .post(format!("{}/v2/vpcs", self.sim.base_url()))
            .bearer_auth(SIM_TOKEN)
            .header("x-acting-account", team.to_string())
            .json(&json!({"name": name, "region": region}))
            .send()
            .await
            .expect("the simulator answers");
        assert_eq!(reply.status(), 201, "VPC create");
        let body: Value = reply.json().await.expect("a VPC");
        Uuid::parse_str(body["vpc"]["id"].as_str().expect("an id")).expect("a UUID")
    }

    /// `team`'s default VPC in this region (made on first use, as DigitalOcean does).
    pub async fn default_vpc(&self, team: Uuid) -> Uuid {
        let reply = reqwest::Client::new()
            .get(format!("{}/v2/vpcs", self.sim.base_url()))
            .bearer_auth(SIM_TOKEN)
            .header("x-acting-account", team.to_string())
            .send()
            .await
            .expect("the simulator answers");
        let body: Value = reply.json().await.expect("VPCs");
        body["vpcs"]
            .as_array()
            .and_then(|vpcs| vpcs.iter().find(|v| v["default"] == true))
            .and_then(|v| v["id"].as_str())
            .and_then(|id| Uuid::parse_str(id).ok())
            .expect("the team has a default VPC")
    }

    async fn start_worker(
        &mut self,
        region: &str,
        database_url: &str,
        seal_key: &str,
        seal_open_keys: &[String],
    ) -> usize {
        let mut c = worker::runtime::Config::new(
            region,
            database_url,
            seal_key,
            &self.sim.base_url(),
            SIM_TOKEN,
        );
        c.seal_open_keys = seal_open_keys.to_vec();
        c.concurrency = 4;
        c.lease = self.options.lease;
        c.tick = Duration::from_millis(200);
        c.backoff_base = Duration::from_millis(100);
        c.backoff_max = Duration::from_secs(1);
        c.db_max_connections = 3;
        c.settings.poll = Duration::from_millis(150);
        c.settings.system_pool_size = "s-2vcpu-4gb".into();
        c.settings.system_pool_count = 1;
        c.settings.hub_endpoint = Some(self.hub_url.clone());
        if let Some(resync) = self.options.resync {
            c.settings.resync = resync;
        }
        if let Some(i) = self.options.autoscale_interval {
            c.settings.autoscale_interval = i;
        }
        if let Some(w) = self.options.scale_down_window {
            c.settings.scale_down_window = w;
        }
        let handle = worker::runtime::Worker::start(c)
            .await
            .expect("worker starts");
        self.workers.push(Some(handle));
        self.workers.len() - 1
    }

    /// Kills worker `index` as a crashed process would: nothing is released, its leases expire.
    pub fn kill_worker(&mut self, index: usize) {
        self.workers[index]
            .take()
            .expect("the worker is running")
            .kill();
    }

    /// Counters summed over the running workers.
    pub fn worker_stats(&self) -> worker::runtime::Stats {
        let mut sum = worker::runtime::Stats::default();
        for s in self.workers.iter().flatten().map(|w| w.stats()) {
            sum.passes += s.passes;
            sum.transient_failures += s.transient_failures;
            sum.permanent_failures += s.permanent_failures;
            sum.leases_lost += s.leases_lost;
        }
        sum
    }
}

impl RegionHandle {
    pub fn cloud(&self) -> &Cloud {
        &self.cloud
    }

    pub fn sim(&self) -> &region_sim::RegionSim {
        &self.cloud().sim
    }

    /// Starts one more worker for this region; returns its index.
    pub async fn start_worker(&mut self) -> usize {
        let (db, key) = (self.database_url.clone(), self.seal_key.clone());
        let name = self.name.clone();
        self.cloud
            .start_worker(&name, &db, &key, &self.seal_open_keys)
            .await
    }

    pub fn kill_worker(&mut self, index: usize) {
        self.cloud.kill_worker(index);
    }

    pub fn store(&self) -> &region_store::Store {
        &self.server.as_ref().expect("region is running").store
    }

    /// Takes the region off the network: its proxy refuses new connections and cuts open ones.
    pub fn go_down(&self) {
        self.proxy.set_mode(proxy::Mode::Down);
    }

    pub fn come_back(&self) {
        self.proxy.set_mode(proxy::Mode::Pass);
    }

    pub async fn start(&mut self) {
        let server = regional::Server::start(region_config(
            &self.name,
            &self.database_url,
            &self.secret,
            &self.seal_key,
            &self.seal_open_keys,
            &self.cloud.sim.base_url(),
            &self.cloud.hub_url,
            self.tls.clone(),
        ))
        .await
        .expect("regional service starts");
        self.proxy.set_upstream(server.addr);
        self.server = Some(server);
    }
}

// One argument per part of the region's configuration a test varies.
#[allow(clippy::too_many_arguments)]
fn region_config(
    name: &str,
    database_url: &str,
    secret: &str,
    seal_key: &str,
    seal_open_keys: &[String],
    sim_url: &str,
    hub_url: &str,
    tls: regional::tls::TlsArgs,
) -> regional::Config {
    regional::Config {
        region: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: "127.0.0.1:0".parse().unwrap(),
        database_url: database_url.into(),
        region_secret: secret.into(),
        region_secret_next: None,
        seal_key: seal_key.into(),
        seal_open_keys: seal_open_keys.to_vec(),
        db_max_connections: 4,
        do_api_url: sim_url.into(),
        do_token: SIM_TOKEN.into(),
        hf_endpoint: hub_url.into(),
        catalog: None,
        tls,
        ca: Default::default(),
        // The service's defaults: tests that need other limits set a team's own.
        quotas: Default::default(),
    }
}

/// Options for `System::start`.
#[derive(Clone)]
pub struct Options {
    pub region_timeout: Duration,
    pub background: bool,
    pub rate_limit_per_hour: u32,
    /// Give every region a simulated cloud and reconcile workers (off: nothing reconciles).
    pub cloud: Option<CloudOptions>,
    /// Regions serve HTTPS with certificates of a test CA that central trusts
    /// ([`System::region_tls`]); off: plain HTTP.
    pub region_tls: bool,
    /// The Postgres server the system's databases are made on (a URL of one of its databases,
    /// e.g. [`postgres::OwnPostgres::url`]); `None`: `DATABASE_URL`'s.
    pub database: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            region_timeout: Duration::from_secs(5),
            background: true,
            rate_limit_per_hour: 100_000,
            cloud: None,
            region_tls: false,
            database: None,
        }
    }
}

/// Central plus three regions, each with its own database.
pub struct System {
    pub central: central::Server,
    pub central_config: central::Config,
    pub regions: Vec<RegionHandle>,
    pub base: String,
    pub http: reqwest::Client,
    /// The Hugging Face Hub every region asks and downloads from.
    pub hub: hub_sim::HubSim,
    /// The regions' certificates and their CA, with [`Options::region_tls`].
    pub region_tls: Option<tls::RegionTls>,
}

impl System {
    pub async fn start() -> System {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(options: Options) -> System {
        init_logs();
        let hub = hub_sim::HubSim::start("127.0.0.1:0".parse().unwrap())
            .await
            .expect("the Hugging Face Hub simulator starts");
        // The tests' Hugging Face token reads the catalog's gated models.
        hub.add_token(HF_TOKEN, "system-tests").expect("a token");
        for repo in hub_sim::seed_repos() {
            if repo.gated.is_gated() {
                hub.grant(&repo.id, HF_TOKEN).expect("a grant");
            }
        }
        let region_tls = options.region_tls.then(tls::RegionTls::new);
        let admin = options.database.clone().unwrap_or_else(database_url);
        let mut regions = Vec::new();
        for name in REGIONS {
            let database_url = fresh_database_on(&admin, &format!("region_{name}")).await;
            let secret = common::tokens::mint("rs_");
            let seal_key = common::seal::Sealer::generate_key();
            let cloud_options = options.cloud.clone().unwrap_or_default();
            let mut cloud = Cloud::start(name, &cloud_options, &hub.url()).await;
            let tls = match &region_tls {
                Some(t) => {
                    t.issue(name);
                    t.args(name)
                }
                None => Default::default(),
            };
            let server = regional::Server::start(region_config(
                name,
                &database_url,
                &secret,
                &seal_key,
                &[],
                &cloud.sim.base_url(),
                &hub.url(),
                tls.clone(),
            ))
            .await
            .expect("regional service starts");
            let proxy = proxy::Proxy::start(server.addr).await;
            // Workers only with a cloud: without, nothing reconciles.
            let workers = options.cloud.as_ref().map_or(0, |o| o.workers);
            for _ in 0..workers {
                cloud
                    .start_worker(name, &database_url, &seal_key, &[])
                    .await;
            }
            regions.push(RegionHandle {
                name: name.to_string(),
                database_url,
                secret,
                seal_key,
                seal_open_keys: Vec::new(),
                server: Some(server),
                proxy,
                cloud,
                tls,
            });
        }
        let scheme = if region_tls.is_some() {
            "https"
        } else {
            "http"
        };
        let central_config = central::Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            metrics_listen: "127.0.0.1:0".parse().unwrap(),
            database_url: fresh_database_on(&admin, "central").await,
            api_token_key: common::tokens::ApiTokenKey::generate(),
            seal_key: common::seal::Sealer::generate_key(),
            seal_open_keys: Vec::new(),
            regions: regions
                .iter()
                .map(|r| format!("{}={}://{}", r.name, scheme, r.proxy.addr))
                .collect(),
            region_secrets: regions
                .iter()
                .map(|r| format!("{}={}", r.name, r.secret))
                .collect(),
            region_ca_file: region_tls.as_ref().map(|t| t.ca_file.clone()),
            public_url: None,
            catalog: None,
            auth_cache_ttl_ms: 200,
            auth_failures_per_minute: 10,
            client_ip_header: None,
            rate_limit_per_hour: options.rate_limit_per_hour,
            region_timeout_ms: options.region_timeout.as_millis() as u64,
            db_max_connections: 8,
            background: options.background,
        };
        let central = central::Server::start(central_config.clone())
            .await
            .expect("central starts");
        let base = format!("http://{}", central.addr);
        System {
            central,
            central_config,
            regions,
            base,
            http: reqwest::Client::new(),
            hub,
            region_tls,
        }
    }

    pub fn region(&mut self, name: &str) -> &mut RegionHandle {
        self.regions
            .iter_mut()
            .find(|r| r.name == name)
            .expect("known region")
    }

    /// Region `name`'s proxy, to make it slow or unreachable while the system is borrowed.
    pub fn proxy(&self, name: &str) -> &proxy::Proxy {
        &self
            .regions
            .iter()
            .find(|r| r.name == name)
            .expect("known region")
            .proxy
    }

    /// Region `name`'s simulated cloud (with [`Options::cloud`]).
    pub fn cloud(&self, name: &str) -> &Cloud {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .expect("known region")
            .cloud()
    }

    /// Mints an API token for `team` with `scopes` (all when empty).
    pub async fn token(&self, team: Uuid, scopes: &[&str]) -> String {
        self.token_with_limit(team, scopes, None).await
    }

    pub async fn token_with_limit(
        &self,
        team: Uuid,
        scopes: &[&str],
        limit: Option<i32>,
    ) -> String {
        let scopes: Vec<String> = if scopes.is_empty() {
            central::auth::SCOPES
                .iter()
                .map(|s| s.to_string())
                .collect()
        } else {
            scopes.iter().map(|s| s.to_string()).collect()
        };
        let value = self.central.app.auth.mint();
        self.central
            .app
            .store
            .api_token_create(
                team,
                "test",
                &common::tokens::sha256(&value),
                &scopes,
                limit,
            )
            .await
            .expect("token stored");
        value
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends a request and returns (status, headers, JSON body or Null).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> Reply {
        let mut req = self.http.request(method, self.url(path)).bearer_auth(token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        Reply::from(req.send().await.expect("central answers")).await
    }

    /// `GET` of DI `id`'s record from region `region`'s internal API, as central asks it (the
    /// region's shared secret), without central in between.
    pub async fn region_record(&self, region: &str, id: &str, team: Uuid) -> Reply {
        let region = self
            .regions
            .iter()
            .find(|r| r.name == region)
            .expect("known region");
        let request = self
            .http
            .get(format!(
                "http://{}/internal/v1/dedicated-inferences/{id}?team_id={team}",
                region.proxy.addr
            ))
            .header(api_types::regional::SECRET_HEADER, &region.secret);
        Reply::from(request.send().await.expect("the region answers")).await
    }

    /// Creates a DI named `name` in `region` through the public API; returns its id and the 202 body.
    pub async fn create_di(&self, token: &str, name: &str, region: &str) -> (String, Value) {
        let reply = self
            .call(
                reqwest::Method::POST,
                "/v2/dedicated-inferences",
                token,
                Some(create_body(name, region)),
            )
            .await;
        assert_eq!(reply.status, 202, "create {name}: {}", reply.body);
        let id = reply.body["dedicated_inference"]["id"]
            .as_str()
            .expect("an id")
            .to_string();
        (id, reply.body)
    }

    /// Starts a new central on the same database with its background work (change feeds,
    /// recovery) on, and points the tests at it; the old one is dropped, as after a crash.
    pub async fn restart_central(&mut self) {
        let mut config = self.central_config.clone();
        config.background = true;
        self.central = central::Server::start(config)
            .await
            .expect("central restarts");
        self.base = format!("http://{}", self.central.addr);
    }

    /// DI `id` as `GET` shows it, once its status is `status`; the test fails at `limit`.
    pub async fn wait_status(
        &self,
        token: &str,
        id: impl std::fmt::Display,
        status: &str,
        limit: Duration,
    ) -> Value {
        test_support::eventually(limit, format!("{id} {status}, as GET shows it"), || async {
            let got = self
                .call(
                    reqwest::Method::GET,
                    &format!("/v2/dedicated-inferences/{id}"),
                    token,
                    None,
                )
                .await;
            let di = &got.body["dedicated_inference"];
            (di["status"] == status).then(|| di.clone())
        })
        .await
    }

    /// Brings the read model up to date with every region now, without waiting for the feed.
    pub async fn settle(&self) {
        for region in REGIONS {
            let _ = central::feed::consume_once(&self.central.app, region, Duration::ZERO).await;
        }
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    pub async fn from(response: reqwest::Response) -> Reply {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
        };
        Reply {
            status,
            headers,
            body,
        }
    }

    /// Asserts the DigitalOcean error shape with `id` and a request id matching the header.
    pub fn assert_error(&self, status: u16, id: &str) {
        assert_eq!(
            self.status, status,
            "unexpected status; body: {}",
            self.body
        );
        assert_eq!(
            self.body["id"], id,
            "unexpected error id; body: {}",
            self.body
        );
        assert!(
            self.body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "error message missing: {}",
            self.body
        );
        let header = self
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .expect("x-request-id header");
        assert_eq!(
            self.body["request_id"], header,
            "request_id must match the header"
        );
    }
}

/// Logs of the services under test (RUST_LOG, default warnings), shown with a failing test's
/// output.
fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A valid create body (pydo's dialect) for an ungated model, without a VPC: the team's default
/// VPC in the region.
pub fn create_body(name: &str, region: &str) -> Value {
    let mut body = create_body_in(name, region, Uuid::nil());
    body["spec"]["vpc"] = Value::Null;
    body
}

/// [`create_body`] in VPC `vpc` (one of the team's: [`Cloud::create_vpc`]).
pub fn create_body_in(name: &str, region: &str, vpc: Uuid) -> Value {
    json!({
        "spec": {
            "version": 1,
            "name": name,
            "region": region,
            "vpc": {"uuid": vpc},
            "enable_public_endpoint": true,
            "model_deployments": [{
                "model_slug": "qwen/qwen2.5-7b-instruct",
                "model_provider": "hugging_face",
                "workload_config": {},
                "accelerators": [{"scale": 2, "type": "prefill_decode", "accelerator_slug": "gpu-h100x1-80gb"}]
            }]
        }
    })
}
