//! The cloud's part inside each simulated Kubernetes cluster: one API server per DOKS cluster,
//! Nodes for running droplets, and the cloud controller's work for LoadBalancer Services (a DO
//! load balancer, an address on the Service, and a data-plane endpoint behind that address).
//!
//! Every cluster's API and every load balancer is a site of the region's [`Front`] at a loopback
//! address of its own. The API servers run in process (`sim-kube` without a listener): the
//! front's HTTPS handler calls them directly, and so does the cloud controller, so the region
//! opens no connection to itself.
//!
//! Here: the clusters, their tokens and credentials. Beside it: each cluster's API server
//! (`kube`), its certificates (`pki`), the front's handler in front of it (`proxy`), and the
//! cloud controller's LoadBalancer work (`cloud_controller`).

use common::clock::Clock;
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use dataplane_sim::data_plane::{Endpoint, Route};
use region_sim_base::front::{Front, SiteId};
use serde_json::Value;
use tokio::sync::watch;

use crate::inventory::EndpointInfo;
use crate::world::{Delays, Effect};
use crate::Shared;

mod cloud_controller;
mod kube;
mod pki;
mod proxy;

use cloud_controller::watch_cluster;

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
