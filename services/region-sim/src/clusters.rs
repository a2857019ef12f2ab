//! The cloud's part inside each simulated Kubernetes cluster: one API server per DOKS cluster,
//! Nodes for running droplets, and the cloud controller's work for LoadBalancer Services (a DO
//! load balancer, an address on the Service, and a data-plane endpoint behind that address).
//!
//! Every cluster's API and every load balancer is a site of the region's [`Front`] at a loopback
//! address of its own. The API servers run in process (`sim-kube` without a listener): the
//! front's HTTPS handler calls them directly, and so does the cloud controller, so the region
//! opens no connection to itself.

use common::clock::Clock;
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use dataplane_sim::data_plane::{Endpoint, Route};
use dataplane_sim::objects::Objects;
use dataplane_sim::routing;
use region_sim_base::front::{Front, SiteId};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::inventory::EndpointInfo;
use crate::world::{Delays, Effect, ServiceLb};
use crate::Shared;

mod kube {
    //! The only place that talks to the `sim-kube` crate.

    use std::sync::Arc;

    use serde_json::{json, Value};
    use tokio::sync::broadcast;

    use crate::world::Delays;

    /// Field manager of the simulated DigitalOcean cloud controller's writes.
    const CCM_MANAGER: &str = "digitalocean-cloud-controller-manager";

    fn config(d: &Delays, loader: &Arc<dyn sim_kube::ModelLoader>) -> sim_kube::ClusterConfig {
        sim_kube::ClusterConfig {
            model_load_delay: std::time::Duration::from_millis(d.model_load_ms),
            // The region simulator is the cloud controller: it assigns load balancer addresses
            // itself (pointing at the data plane), so sim-kube's placeholder addresses must not
            // appear first.
            lb_address_delay: std::time::Duration::from_secs(365 * 24 * 3600),
            gateway_address_delay: std::time::Duration::from_millis(d.gateway_address_ms),
            bearer_token: None,
            // Pods load their model as vLLM does: from the Hub their environment names.
            model_loader: Some(loader.clone()),
            // Pods answer `pods/proxy` with their metrics (vLLM's, or the endpoint picker's).
            pod_proxy: Some(Arc::new(dataplane_sim::pod_proxy::PodMetrics)),
        }
    }

    #[derive(Clone)]
    pub struct Handle {
        cluster: sim_kube::Cluster,
        loader: Arc<dyn sim_kube::ModelLoader>,
    }

    impl Handle {
        /// An API server in this process, without a listener of its own (the front serves it).
        pub fn start(
            name: &str,
            d: &Delays,
            loader: Arc<dyn sim_kube::ModelLoader>,
        ) -> anyhow::Result<Handle> {
            Ok(Handle {
                cluster: sim_kube::Cluster::start_in_process(name, config(d, &loader))?,
                loader,
            })
        }
        /// One API request, served in process.
        pub async fn call(
            &self,
            req: http::Request<axum::body::Body>,
        ) -> http::Response<axum::body::Body> {
            self.cluster.call(req).await
        }
        pub fn upsert_node(&self, node: Value) {
            self.cluster.upsert_node(node);
        }
        pub fn delete_node(&self, name: &str) {
            self.cluster.delete_node(name);
        }
        pub fn list_all(&self) -> Vec<Value> {
            self.cluster.list_all()
        }
        pub fn snapshot(&self) -> Vec<std::sync::Arc<Value>> {
            self.cluster.snapshot()
        }
        pub fn subscribe(&self) -> broadcast::Receiver<u64> {
            self.cluster.subscribe()
        }
        pub fn resource_version(&self) -> u64 {
            self.cluster.resource_version()
        }
        pub fn set_delays(&self, d: &Delays) {
            let mut c = config(d, &self.loader);
            c.bearer_token = self.cluster.config().bearer_token;
            self.cluster.set_config(c);
        }
        /// Writes the Service's load balancer ingress through the `/status` subresource, as the
        /// DigitalOcean cloud controller does: the same request it would send, served in process.
        pub async fn set_service_ingress(
            &self,
            ns: &str,
            name: &str,
            ingress: Value,
        ) -> anyhow::Result<()> {
            let body = json!({"status": {"loadBalancer": {"ingress": ingress}}});
            let req = http::Request::patch(format!(
                "/api/v1/namespaces/{ns}/services/{name}/status?fieldManager={CCM_MANAGER}"
            ))
            .header("content-type", "application/merge-patch+json")
            .body(axum::body::Body::from(serde_json::to_vec(&body)?))?;
            let resp = self.cluster.call(req).await;
            if !resp.status().is_success() {
                let status = resp.status();
                let text = axum::body::to_bytes(resp.into_body(), 64 * 1024)
                    .await
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                anyhow::bail!("patching {ns}/{name} status: {status} {text}");
            }
            Ok(())
        }
        pub async fn shutdown(&self) {
            self.cluster.shutdown().await;
        }
    }
}

mod pki {
    //! A cluster's certificate authority and its API server's certificate, as DOKS gives every
    //! cluster its own CA (handed out as the kubeconfig's `certificate-authority-data`).

    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Arc;

    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose, SanType,
    };
    use rustls::ServerConfig;

    pub struct ClusterPki {
        /// The CA certificate, PEM.
        pub ca_pem: String,
        /// The API server's TLS configuration: a certificate for its own address, `127.0.0.1`
        /// and `localhost`, signed by the CA.
        pub server: Arc<ServerConfig>,
    }

    /// The cluster's CA and a server certificate for `ip` (the API server's address).
    pub fn generate(cluster_name: &str, ip: Ipv4Addr) -> anyhow::Result<ClusterPki> {
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.distinguished_name.push(
            DnType::CommonName,
            format!("k8saas Cluster CA {cluster_name}"),
        );
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let mut server = CertificateParams::new(vec!["localhost".to_string()])?;
        for addr in [ip, Ipv4Addr::LOCALHOST] {
            server
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(addr)));
        }
        server
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        server.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        server.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = server.signed_by(&key, &ca_cert, &ca_key)?;
        Ok(ClusterPki {
            ca_pem: ca_cert.pem(),
            server: region_sim_base::front::api_server_tls_config(
                &cert.pem(),
                &key.serialize_pem(),
            )?,
        })
    }
}

mod proxy {
    //! The address the kubeconfig points at: the cluster's site on the region's front, serving
    //! HTTPS with a certificate from the cluster's CA. It checks the bearer token against the
    //! cluster's live credentials (see [`super::Tokens`]), counts the call, injects the `kube`
    //! faults and hands the request to the cluster's simulated API server in process.

    use std::sync::Arc;
    use std::time::Duration;

    use axum::extract::{Request, State};
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::Router;
    use region_sim_base::faults::{Api, CallVerdict, Faults, Verdict};
    use region_sim_base::front::Site;
    use serde_json::json;
    use tokio::sync::watch;

    use super::{kube, Tokens};
    use crate::Stats;

    /// How long a connection may stay idle between requests: the Kubernetes API server's
    /// `IdleTimeout`.
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

    struct Proxy {
        kube: kube::Handle,
        tokens: Arc<Tokens>,
        faults: Arc<Faults>,
        stats: Arc<Stats>,
    }

    /// A Kubernetes `Status` error, which is what clients parse on failures.
    fn status(code: StatusCode, reason: &str, message: &str) -> Response {
        (
            code,
            axum::Json(json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code.as_u16(),
            })),
        )
            .into_response()
    }

    async fn forward(State(p): State<Arc<Proxy>>, mut req: Request) -> Response {
        let authorized = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| p.tokens.valid(t));
        // An expired token is refused exactly like an unknown one, as the real API server does.
        if !authorized {
            return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        }
        // Counted once authenticated, faulted or not (the client did send it).
        let kind = p.stats.record_kube(
            req.method(),
            req.uri().path(),
            req.uri().query().unwrap_or(""),
            req.headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
        );
        let is_write = crate::is_mutating(req.method());
        let lose_response = match p.faults.apply_call(Api::Kube, is_write, &kind).await {
            CallVerdict::Now(Verdict::Pass) => false,
            CallVerdict::LoseResponse => true,
            CallVerdict::Now(Verdict::Error) => {
                return status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "Internal error occurred: injected fault",
                )
            }
            CallVerdict::Now(Verdict::RateLimited(secs)) => {
                let mut r = status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "TooManyRequests",
                    "Too many requests, please try again later.",
                );
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                return r;
            }
        };
        // The API server behind the front authenticates nothing itself.
        req.headers_mut().remove(header::AUTHORIZATION);
        let resp = p.kube.call(req).await;
        if lose_response {
            // The API server has answered, so the call took effect; the client never learns
            // how. The body is not read: a watch's would never end.
            return status(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                "Timeout: the server did not answer in time",
            );
        }
        // Streamed as the API server produces it, so that watches flow through as they happen.
        resp
    }

    /// The cluster API's site: HTTPS with `tls`, closed (open watches too, as a deleted
    /// cluster's would be) when `stop` changes.
    pub fn site(
        kube: kube::Handle,
        tls: Arc<rustls::ServerConfig>,
        tokens: Arc<Tokens>,
        faults: Arc<Faults>,
        stats: Arc<Stats>,
        stop: watch::Receiver<bool>,
    ) -> Site {
        let app = Router::new().fallback(forward).with_state(Arc::new(Proxy {
            kube,
            tokens,
            faults,
            stats,
        }));
        Site {
            tls: Arc::new(move || Some(tls.clone())),
            app,
            stop,
            idle_timeout: IDLE_TIMEOUT,
        }
    }
}

struct EndpointSlot {
    endpoint: Endpoint,
    problems: Vec<String>,
}

/// Live bearer tokens of one cluster's API. Every kubeconfig or credentials request issues a new
/// one, valid for its own lifetime (as DOKS does); the proxy accepts a token until it expires.
pub(crate) struct Tokens {
    live: Mutex<HashMap<String, Instant>>,
    /// The clock tokens expire by: the simulator's (see [`crate::SimConfig::clock`]).
    clock: Clock,
}

impl Tokens {
    /// At most this many live tokens per cluster: a client fetching credentials in a loop with
    /// long lifetimes must not grow the simulator without bound. Past it, the token closest to
    /// expiring goes first.
    const MAX_LIVE: usize = 1024;

    fn new(clock: Clock) -> Self {
        Self {
            live: Mutex::new(HashMap::new()),
            clock,
        }
    }

    /// A new token valid for `ttl` from now. Expired tokens are pruned here, so memory is bounded
    /// by what is live (and by [`Tokens::MAX_LIVE`]).
    fn issue(&self, ttl: Duration) -> String {
        let token = format!(
            "{:x}{:x}",
            uuid::Uuid::new_v4().as_u128(),
            uuid::Uuid::new_v4().as_u128()
        );
        let now = self.clock.instant();
        let mut live = self.live.lock().expect("tokens lock");
        live.retain(|_, expires| *expires > now);
        while live.len() >= Self::MAX_LIVE {
            let soonest = live
                .iter()
                .min_by_key(|(_, expires)| **expires)
                .map(|(t, _)| t.clone());
            match soonest {
                Some(t) => live.remove(&t),
                None => break,
            };
        }
        live.insert(token.clone(), now + ttl);
        token
    }

    /// Every token issued so far stops working.
    fn revoke_all(&self) {
        self.live.lock().expect("tokens lock").clear();
    }

    /// Whether `token` was issued for this cluster and has not expired.
    pub(crate) fn valid(&self, token: &str) -> bool {
        self.live
            .lock()
            .expect("tokens lock")
            .get(token)
            .is_some_and(|expires| *expires > self.clock.instant())
    }
}

/// A longest credential lifetime the simulator grants (a year), so that an absurd
/// `expiry_seconds` cannot overflow the clock.
const MAX_CREDENTIAL_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Credentials for one cluster's API, as the credentials endpoint returns them.
pub(crate) struct Credentials {
    /// `do-<region>-<name>`: the kubeconfig's cluster, context and user names.
    context: String,
    pub(crate) server: String,
    /// Base64 of the cluster CA's PEM certificate.
    pub(crate) certificate_authority_data: String,
    pub(crate) token: String,
    /// When the token stops being accepted.
    pub(crate) expires_at: chrono::DateTime<chrono::Utc>,
}

struct ClusterSide {
    kube: kube::Handle,
    /// `do-<region>-<name>`: the kubeconfig's cluster, context and user names.
    context: String,
    /// `https://<ip>:<front port>`.
    server: String,
    /// The API server's address, and its site there.
    ip: Ipv4Addr,
    site: SiteId,
    /// Base64 of the cluster CA's PEM certificate, as credentials carry it.
    ca_data: String,
    tokens: Arc<Tokens>,
    stop: watch::Sender<bool>,
    endpoints: Mutex<BTreeMap<(String, String), EndpointSlot>>,
}

/// All simulated clusters' Kubernetes sides, by DO cluster id.
pub(crate) struct Clusters {
    map: Mutex<HashMap<String, Arc<ClusterSide>>>,
    delays: RwLock<Delays>,
    /// How often a settled cluster is re-derived without a change (see `watch_cluster`).
    idle: Duration,
    /// How long issued credentials stay valid when the request does not say (`expiry_seconds`
    /// absent or 0).
    credential_ttl: Duration,
    /// The clock credentials expire by.
    clock: Clock,
    /// Serialises starts so two calls for one cluster do not start two API servers.
    start_lock: tokio::sync::Mutex<()>,
    /// Decides every cluster's model loads (see [`crate::hub_loader`]).
    loader: Arc<dyn sim_kube::ModelLoader>,
    /// Serves every cluster's API and every load balancer.
    front: Front,
}

impl Clusters {
    pub(crate) fn new(
        delays: Delays,
        idle: Duration,
        credential_ttl: Duration,
        clock: Clock,
        loader: Arc<dyn sim_kube::ModelLoader>,
        front: Front,
    ) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            delays: RwLock::new(delays),
            idle,
            credential_ttl,
            clock,
            start_lock: tokio::sync::Mutex::new(()),
            loader,
            front,
        }
    }

    pub(crate) fn front(&self) -> &Front {
        &self.front
    }

    fn get(&self, id: &str) -> Option<Arc<ClusterSide>> {
        self.map.lock().expect("clusters lock").get(id).cloned()
    }

    /// Starts the cluster's API server if it is not running yet.
    pub(crate) async fn ensure(
        &self,
        shared: &Arc<Shared>,
        id: &str,
        name: &str,
    ) -> anyhow::Result<()> {
        let _g = self.start_lock.lock().await;
        if self.get(id).is_some() || !shared.world.cluster_exists(id) {
            return Ok(());
        }
        let delays = self.delays.read().expect("delays lock").clone();
        let ip = self.front.addresses().allocate();
        let started = pki::generate(name, ip).and_then(|pki| {
            Ok((
                pki,
                kube::Handle::start(name, &delays, self.loader.clone())?,
            ))
        });
        let (pki, handle) = match started {
            Ok(s) => s,
            Err(e) => {
                self.front.addresses().release(ip);
                return Err(e);
            }
        };
        let (stop, stop_rx) = watch::channel(false);
        let tokens = Arc::new(Tokens::new(self.clock.clone()));
        let site = self.front.register(
            ip,
            proxy::site(
                handle.clone(),
                pki.server,
                tokens.clone(),
                shared.faults.clone(),
                shared.stats.clone(),
                stop_rx.clone(),
            ),
        );
        let url = format!("https://{ip}:{}", self.front.port());
        shared.world.set_cluster_endpoint(id, &url, ip);
        let side = Arc::new(ClusterSide {
            context: format!("do-{}-{name}", shared.world.region()),
            server: url,
            ip,
            site,
            ca_data: base64::engine::general_purpose::STANDARD.encode(&pki.ca_pem),
            tokens,
            kube: handle,
            stop,
            endpoints: Mutex::new(BTreeMap::new()),
        });
        self.map
            .lock()
            .expect("clusters lock")
            .insert(id.to_string(), side.clone());
        tokio::spawn(watch_cluster(
            Arc::downgrade(shared),
            id.to_string(),
            side,
            stop_rx,
        ));
        Ok(())
    }

    /// New credentials for the cluster's API, valid for `expiry_seconds` (absent or 0: the
    /// default lifetime, 7 days unless configured otherwise).
    pub(crate) fn credentials(&self, id: &str, expiry_seconds: Option<u64>) -> Option<Credentials> {
        let side = self.get(id)?;
        let ttl = match expiry_seconds {
            None | Some(0) => self.credential_ttl,
            Some(secs) => Duration::from_secs(secs),
        }
        .min(MAX_CREDENTIAL_TTL);
        let token = side.tokens.issue(ttl);
        let expires_at = chrono::DateTime::<chrono::Utc>::from(self.clock.now())
            + chrono::Duration::from_std(ttl).unwrap_or_else(|_| chrono::Duration::days(365));
        Some(Credentials {
            context: side.context.clone(),
            server: side.server.clone(),
            certificate_authority_data: side.ca_data.clone(),
            token,
            expires_at,
        })
    }

    /// Revokes every credential issued so far for every cluster, as revoking the DigitalOcean
    /// API token they were issued with does; new ones can be fetched at once.
    pub(crate) fn revoke_credentials(&self) {
        for side in self.map.lock().expect("clusters lock").values() {
            side.tokens.revoke_all();
        }
    }

    pub(crate) fn set_delays(&self, d: &Delays) {
        *self.delays.write().expect("delays lock") = d.clone();
        for side in self.map.lock().expect("clusters lock").values() {
            side.kube.set_delays(d);
        }
    }

    pub(crate) async fn apply(&self, shared: &Arc<Shared>, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::ClusterCreated { cluster_id, name } => {
                    if let Err(err) = self.ensure(shared, &cluster_id, &name).await {
                        tracing::error!(error = %err, %cluster_id, "starting simulated Kubernetes API failed");
                    }
                }
                Effect::UpsertNode { cluster_id, node } => {
                    if let Some(side) = self.get(&cluster_id) {
                        side.kube.upsert_node(node);
                    }
                }
                Effect::DeleteNode { cluster_id, name } => {
                    if let Some(side) = self.get(&cluster_id) {
                        side.kube.delete_node(&name);
                    }
                }
                Effect::ClusterGone { cluster_id } => {
                    let side = self.map.lock().expect("clusters lock").remove(&cluster_id);
                    if let Some(side) = side {
                        self.stop_side(&side).await;
                    }
                }
            }
        }
    }

    pub(crate) async fn shutdown_all(&self) {
        let sides: Vec<_> = self
            .map
            .lock()
            .expect("clusters lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in sides {
            self.stop_side(&s).await;
        }
    }

    /// Stops a cluster's API (its site, open watches included), its endpoints and its
    /// controllers, and gives its address back.
    async fn stop_side(&self, side: &ClusterSide) {
        let _ = side.stop.send(true);
        self.front.unregister(side.site);
        self.front.addresses().release(side.ip);
        let slots = std::mem::take(&mut *side.endpoints.lock().expect("endpoints lock"));
        for (_, slot) in slots {
            slot.endpoint.shutdown();
        }
        side.kube.shutdown().await;
    }

    pub(crate) fn objects(&self) -> BTreeMap<String, Vec<Value>> {
        self.map
            .lock()
            .expect("clusters lock")
            .iter()
            .map(|(id, s)| (id.clone(), s.kube.list_all()))
            .collect()
    }

    /// Requests served so far by every data-plane endpoint that exists now.
    pub(crate) fn data_plane_requests(&self) -> u64 {
        let sides: Vec<Arc<ClusterSide>> = self
            .map
            .lock()
            .expect("clusters lock")
            .values()
            .cloned()
            .collect();
        sides
            .iter()
            .map(|side| {
                side.endpoints
                    .lock()
                    .expect("endpoints lock")
                    .values()
                    .map(|slot| slot.endpoint.requests())
                    .sum::<u64>()
            })
            .sum()
    }

    pub(crate) fn endpoints(&self) -> Vec<EndpointInfo> {
        let sides: Vec<(String, Arc<ClusterSide>)> = self
            .map
            .lock()
            .expect("clusters lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut out = Vec::new();
        for (id, side) in sides {
            for ((ns, svc), slot) in side.endpoints.lock().expect("endpoints lock").iter() {
                let cfg = slot.endpoint.config();
                let (route, models, ready) = match &cfg.route {
                    Route::None => ("none".to_string(), Vec::new(), Vec::new()),
                    Route::Pool { endpoints, .. } => {
                        let mut models: Vec<String> =
                            endpoints.iter().filter_map(|b| b.model.clone()).collect();
                        models.sort();
                        models.dedup();
                        let pods = endpoints.iter().map(|b| b.pod.clone()).collect();
                        ("pool".to_string(), models, pods)
                    }
                };
                out.push(EndpointInfo {
                    cluster_id: id.clone(),
                    namespace: ns.clone(),
                    service: svc.clone(),
                    url: slot.endpoint.url(),
                    port: slot.endpoint.port(),
                    tls: cfg.tls.is_some() && !slot.problems.iter().any(|p| p.contains("TLS")),
                    route,
                    models,
                    ready_endpoints: ready,
                    problems: slot.problems.clone(),
                    requests: slot.endpoint.requests(),
                });
            }
        }
        out
    }
}

impl Credentials {
    /// A kubeconfig in the shape DigitalOcean returns (`do-<region>-<name>` names, token user).
    pub(crate) fn kubeconfig_yaml(&self) -> String {
        let (ctx, server, token) = (&self.context, &self.server, &self.token);
        let ca = &self.certificate_authority_data;
        format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {ca}\n    server: {server}\n  name: {ctx}\ncontexts:\n- context:\n    cluster: {ctx}\n    user: {ctx}-admin\n  name: {ctx}\ncurrent-context: {ctx}\nkind: Config\npreferences: {{}}\nusers:\n- name: {ctx}-admin\n  user:\n    token: {token}\n"
        )
    }
}

/// Re-derives the cloud controller's view whenever the cluster's objects change, and every 100 ms
/// while a load balancer is not active yet (a timed transition the objects do not show). A
/// settled cluster is looked at every `Clusters::idle`, and only re-derived if its objects
/// changed since it settled (a change is normally seen at once; this is the safety net): what
/// the cloud controller derives is a function of the objects once every load balancer is
/// active, so thousands of settled clusters cost nothing.
async fn watch_cluster(
    shared: std::sync::Weak<Shared>,
    id: String,
    side: Arc<ClusterSide>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = side.kube.subscribe();
    // The resourceVersion at which the cluster was last found settled, and whether this
    // wake-up is the idle one rather than a change.
    let mut settled_at: Option<u64> = None;
    let mut idle_wake = false;
    loop {
        let Some(s) = shared.upgrade() else { return };
        if *stop.borrow() {
            return;
        }
        let rv = side.kube.resource_version();
        let pause = if idle_wake && settled_at == Some(rv) {
            s.clusters.idle
        } else {
            settled_at = None;
            match reconcile(&s, &id, &side).await {
                Ok(true) => {
                    // Settled: nothing was written, so `rv` is still what it derived from.
                    settled_at = Some(rv);
                    s.clusters.idle
                }
                Ok(false) => Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!(error = %e, cluster_id = %id, "cloud controller pass failed");
                    Duration::from_millis(100)
                }
            }
        };
        drop(s);
        idle_wake = false;
        tokio::select! {
            _ = stop.changed() => return,
            r = changes.recv() => {
                if let Err(tokio::sync::broadcast::error::RecvError::Closed) = r {
                    return;
                }
                // Let a burst of writes (a worker applies a DI's objects at once) land, and
                // look once for all of them.
                tokio::time::sleep(Duration::from_millis(5)).await;
                use tokio::sync::broadcast::error::TryRecvError;
                while !matches!(
                    changes.try_recv(),
                    Err(TryRecvError::Empty | TryRecvError::Closed)
                ) {}
            }
            _ = tokio::time::sleep(pause) => idle_wake = true,
        }
    }
}

fn is_lb_service(o: &Value) -> bool {
    o["kind"] == "Service"
        && o["apiVersion"] == "v1"
        && o.pointer("/spec/type").and_then(Value::as_str) == Some("LoadBalancer")
        && o.pointer("/metadata/deletionTimestamp")
            .is_none_or(Value::is_null)
}

fn service_lb(o: &Value) -> ServiceLb {
    let str_map = |v: Option<&Value>| -> BTreeMap<String, String> {
        v.and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let ns = o
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_string();
    let name = o
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let uid = o
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("{ns}/{name}"));
    ServiceLb {
        namespace: ns,
        name,
        uid,
        annotations: str_map(o.pointer("/metadata/annotations")),
        ports: o
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        (
                            p["port"].as_i64().unwrap_or(0),
                            p["protocol"].as_str().unwrap_or("TCP").to_string(),
                            p["nodePort"].as_i64(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// One cloud-controller pass over a cluster. True when it is settled: every load balancer is
/// active and its Service already shows the address.
async fn reconcile(shared: &Arc<Shared>, id: &str, side: &ClusterSide) -> anyhow::Result<bool> {
    let objs = side.kube.snapshot();
    let services: Vec<&Value> = objs
        .iter()
        .map(std::sync::Arc::as_ref)
        .filter(|o| is_lb_service(o))
        .collect();
    let lbs: Vec<ServiceLb> = services.iter().map(|o| service_lb(o)).collect();
    let statuses = shared.world.lb_sync(id, &lbs);
    // Filed by namespace once for all the Services' wirings, each of which reads its own
    // namespace: a cluster holds many DIs.
    let filed = Objects::new(&objs);

    // Each load balancer's endpoint serves at the load balancer's address; endpoints for
    // services that are gone go away with their load balancer.
    let wanted: HashMap<(String, String), Ipv4Addr> = statuses
        .iter()
        .map(|st| ((st.namespace.clone(), st.name.clone()), st.ip))
        .collect();
    let front = shared.clusters.front();
    let mut publish = Vec::new();
    {
        let mut eps = side.endpoints.lock().expect("endpoints lock");
        eps.retain(|k, slot| {
            // A Service replaced under the same name has a new load balancer, at a new address.
            let keep = wanted.get(k) == Some(&slot.endpoint.ip());
            if !keep {
                slot.endpoint.shutdown();
            }
            keep
        });
        for (key, ip) in &wanted {
            if !eps.contains_key(key) {
                let ep = Endpoint::start(front, *ip, shared.model.clone(), shared.faults.clone());
                eps.insert(
                    key.clone(),
                    EndpointSlot {
                        endpoint: ep,
                        problems: Vec::new(),
                    },
                );
            }
        }
        for (svc, st) in services.iter().zip(&statuses) {
            let key = (st.namespace.clone(), st.name.clone());
            let Some(slot) = eps.get_mut(&key) else {
                continue;
            };
            let wiring = routing::wire(svc, &filed);
            let mut problems = wiring.problems;
            if let Err(e) = slot.endpoint.update(wiring.config) {
                problems.push(format!("TLS certificate rejected: {e}"));
            }
            slot.problems = problems;
            if !st.active {
                continue;
            }
            let ingress = json!([{
                "ip": st.ip.to_string(),
                "ports": [{"port": slot.endpoint.port(), "protocol": "TCP"}],
            }]);
            // Write only on change, so a settled cluster sees no writes from the cloud side.
            if svc.pointer("/status/loadBalancer/ingress") != Some(&ingress) {
                publish.push((key, ingress));
            }
        }
    }
    let settled = publish.is_empty() && statuses.iter().all(|st| st.active);
    for ((ns, name), ingress) in publish {
        side.kube.set_service_ingress(&ns, &name, ingress).await?;
    }
    Ok(settled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expired_tokens_are_pruned_and_live_ones_are_bounded() {
        let clock = Clock::system();
        let tokens = Tokens::new(clock.clone());
        let short = tokens.issue(Duration::from_millis(30));
        assert!(tokens.valid(&short));
        clock.advance(Duration::from_millis(60));
        assert!(!tokens.valid(&short), "an expired token is refused");
        let long = tokens.issue(Duration::from_secs(600));
        assert_eq!(
            tokens.live.lock().unwrap().len(),
            1,
            "the expired one is gone"
        );
        let mut last = long.clone();
        for _ in 0..Tokens::MAX_LIVE + 10 {
            last = tokens.issue(Duration::from_secs(3600));
        }
        assert_eq!(tokens.live.lock().unwrap().len(), Tokens::MAX_LIVE);
        assert!(tokens.valid(&last), "the newest token is live");
        assert!(
            !tokens.valid(&long),
            "the one closest to expiry made room first"
        );
        assert!(!tokens.valid("never-issued"));
    }
}
