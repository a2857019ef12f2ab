//! The worker's Kubernetes clients, one per cluster, made from the cluster's credentials and
//! kept until those are due for renewal or refused.
//!
//! DOKS credentials expire (7 days by default). The worker reads them from the credentials
//! endpoint rather than the kubeconfig because its answer says when the token expires
//! (`expires_at`): that is the server's word, right even if it caps or ignores a lifetime we
//! might have asked for with `expiry_seconds`, and it needs no YAML to be read. A client is
//! renewed two thirds into its credentials' life (after about 4.7 of DOKS's 7 days), which leaves
//! a third for passes already using it and for DigitalOcean being unavailable at that moment; a
//! client whose credentials the cluster refused (401: revoked, or expired early) is never handed
//! out again.
//!
//! Each client's cluster is watched ([`crate::watch_cache`]) from the first resync that reads it
//! until the client is replaced or forgotten: the watches use the client's credentials.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::clock::Clock;

use cloud_clients::{DoClient, DoError, KubeClient, KubeClientOptions, KubeError};

use crate::watch_cache::{ClusterCache, Wakes, Watched};

/// A cluster no pass has used for this long is forgotten, its watches stopped and its connection
/// closed: the cluster is gone (deleted by another worker) or its DIs are another worker's now
/// (see `Store::work_claim`), while every live DI is resynced every few minutes. So a worker's
/// connections follow the clusters it serves, not every cluster it ever reached.
const CLUSTER_UNUSED: Duration = Duration::from_secs(15 * 60);

/// When credentials that do not say when they expire are renewed.
const RENEW_UNDATED: Duration = Duration::from_secs(3600);

/// How long to use credentials with `expires_in` left before fetching new ones.
pub fn renew_after(expires_in: Option<Duration>) -> Duration {
    match expires_in {
        Some(left) => left * 2 / 3,
        None => RENEW_UNDATED,
    }
}

#[derive(Clone)]
struct Entry {
    kube: KubeClient,
    /// From then on, fresh credentials are fetched before the client is used.
    renew_at: Instant,
    /// When the server stops accepting them, if it said.
    expires_at: Option<Instant>,
    /// The cluster's watches through this client, once a pass asked for them.
    cache: Option<Arc<ClusterCache>>,
    /// When a pass last asked for the client or its watches.
    used: Instant,
}

impl Entry {
    /// Still accepted, as far as the worker knows (not refused, not past the expiry).
    fn usable(&self, now: Instant) -> bool {
        !self.kube.credentials_rejected() && self.expires_at.is_none_or(|t| t > now)
    }
}

/// Why no client could be made.
#[derive(Debug)]
pub enum Error {
    /// Fetching the credentials failed.
    Cloud(DoError),
    /// The credentials did not make a client.
    Kube(KubeError),
}

/// Clients by DigitalOcean cluster id.
pub struct ClusterClients {
    cache: Mutex<HashMap<String, Entry>>,
    /// One lock per cluster that serialises its credential fetches, so that when a cluster's
    /// credentials come due, the passes of its many DIs make one request for new ones rather
    /// than one each. Per cluster: a fetch also asks the new client's API server its version,
    /// and a worker starting on a full region fetches for thousands of clusters at once; one
    /// lock for all made them wait in line, each behind any cluster slow to answer.
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    field_manager: String,
    options: KubeClientOptions,
    /// The clock credentials expire by (the system's outside tests).
    clock: Clock,
    /// Where every cluster's watches report DIs whose objects changed.
    wakes: Arc<Wakes>,
    /// When unused clusters were last looked for.
    swept: Mutex<Instant>,
    /// A cluster no pass used for this long is forgotten: [`CLUSTER_UNUSED`], or three resyncs
    /// if those are further apart (a cluster whose DIs all rest is used at every resync).
    unused_after: Duration,
}

impl ClusterClients {
    /// Clients for a worker that resyncs each DI every `resync`.
    pub fn new(
        field_manager: &str,
        options: KubeClientOptions,
        clock: Clock,
        resync: Duration,
    ) -> Self {
        ClusterClients {
            unused_after: CLUSTER_UNUSED.max(resync.saturating_mul(3)),
            cache: Mutex::new(HashMap::new()),
            fetching: Mutex::new(HashMap::new()),
            field_manager: field_manager.to_string(),
            options,
            wakes: Arc::new(Wakes::default()),
            swept: Mutex::new(clock.instant()),
            clock,
        }
    }

    /// The DIs that the clusters' watches saw change.
    pub fn wakes(&self) -> Arc<Wakes> {
        self.wakes.clone()
    }

    /// The watch cache of cluster `id`, through its current client while that is fresh
    /// (see [`ClusterClients::fresh`]), started now watching `kinds` if it was not yet.
    pub fn cache(
        &self,
        id: &str,
        kinds: impl FnOnce() -> Vec<Watched>,
    ) -> Option<Arc<ClusterCache>> {
        let now = self.clock.instant();
        let mut cache = self.cache.lock().expect("cluster clients");
        self.stop_unused(&mut cache, now);
        let e = cache.get_mut(id)?;
        e.used = now;
        if !(e.renew_at > now && e.usable(now)) {
            return None;
        }
        let kube = &e.kube;
        let started = e.cache.get_or_insert_with(|| {
            Arc::new(ClusterCache::start(kube, kinds(), self.wakes.clone()))
        });
        Some(started.clone())
    }

    pub fn set_options(&mut self, options: KubeClientOptions) {
        self.options = options;
    }

    /// The cached client of cluster `id`, unless its credentials are due for renewal or were
    /// refused. Asks nothing of anyone.
    pub fn fresh(&self, id: &str) -> Option<KubeClient> {
        let now = self.clock.instant();
        let mut cache = self.cache.lock().expect("cluster clients");
        self.stop_unused(&mut cache, now);
        let e = cache.get_mut(id)?;
        e.used = now;
        (e.renew_at > now && e.usable(now)).then(|| e.kube.clone())
    }

    /// A client of cluster `id` with credentials that are not due for renewal: the cached one,
    /// or one made from credentials fetched now. Should that fetch fail for a passing reason
    /// while the cached credentials are still accepted, those are used for now.
    pub async fn get(&self, cloud: &DoClient, id: &str) -> Result<KubeClient, Error> {
        if let Some(k) = self.fresh(id) {
            return Ok(k);
        }
        let lock = {
            let mut fetching = self.fetching.lock().expect("fetching");
            fetching.entry(id.to_string()).or_default().clone()
        };
        let _one = lock.lock().await;
        // Another pass may have renewed them while this one waited.
        if let Some(k) = self.fresh(id) {
            return Ok(k);
        }
        match self.fetch(cloud, id).await {
            Ok(k) => Ok(k),
            Err(Error::Cloud(e)) if e.is_transient() => {
                let now = self.clock.instant();
                let cache = self.cache.lock().expect("cluster clients");
                match cache.get(id).filter(|e| e.usable(now)) {
                    Some(old) => {
                        tracing::warn!(cluster_id = id, error = %e, "renewing cluster credentials failed; using the current ones meanwhile");
                        Ok(old.kube.clone())
                    }
                    None => Err(Error::Cloud(e)),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Forgets the clusters no pass used in `unused_after` (looked for once a minute).
    fn stop_unused(&self, cache: &mut HashMap<String, Entry>, now: Instant) {
        let mut swept = self.swept.lock().expect("swept");
        if now.saturating_duration_since(*swept) < Duration::from_secs(60) {
            return;
        }
        *swept = now;
        let unused: Vec<String> = cache
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.used) >= self.unused_after)
            .map(|(id, _)| id.clone())
            .collect();
        if unused.is_empty() {
            return;
        }
        let mut fetching = self.fetching.lock().expect("fetching");
        for id in &unused {
            cache.remove(id);
            fetching.remove(id);
        }
        tracing::debug!(clusters = unused.len(), "forgot clusters no pass used");
    }

    async fn fetch(&self, cloud: &DoClient, id: &str) -> Result<KubeClient, Error> {
        let creds = cloud.cluster_credentials(id).await.map_err(Error::Cloud)?;
        let kube = KubeClient::from_credentials(&creds, &self.field_manager, self.options.clone())
            .await
            .map_err(Error::Kube)?;
        let expires_in = creds.expires_in(self.clock.now());
        let now = self.clock.instant();
        let renew = renew_after(expires_in);
        tracing::debug!(
            cluster_id = id,
            renew_in_secs = renew.as_secs(),
            "cluster credentials fetched"
        );
        self.cache.lock().expect("cluster clients").insert(
            id.to_string(),
            Entry {
                kube: kube.clone(),
                renew_at: now + renew,
                expires_at: expires_in.map(|left| now + left),
                cache: None,
                used: now,
            },
        );
        Ok(kube)
    }

    /// Forgets cluster `id`'s client (the cluster is gone, or no longer trusted).
    pub fn forget(&self, id: &str) {
        self.cache.lock().expect("cluster clients").remove(id);
        // A fetch holding the lock keeps its own handle; the next one makes a new lock.
        self.fetching.lock().expect("fetching").remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DigitalOcean API whose credentials for cluster `stuck` name an API server that takes
    /// connections and never answers, and for any other cluster one that answers `/version`.
    async fn clouds_and_clusters() -> (DoClient, tokio::sync::mpsc::Receiver<()>) {
        use axum::{extract::Path, routing::get, Json, Router};
        let listen = || async { tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap() };
        let (mute, api) = (listen().await, listen().await);
        let (accepted, accepted_rx) = tokio::sync::mpsc::channel(16);
        let mute_url = format!("http://{}", mute.local_addr().unwrap());
        let api_url = format!("http://{}", api.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = mute.accept().await {
                held.push(conn);
                let _ = accepted.send(()).await;
            }
        });
        let cloud = DoClient::new(&api_url, "do-token").unwrap();
        let credentials = move |Path(id): Path<String>| {
            let server = if id == "stuck" { &mute_url } else { &api_url };
            let body = serde_json::json!({"server": server, "certificate_authority_data": "",
                                         "token": "t", "expires_at": null});
            async move { Json(body) }
        };
        let app = Router::new()
            .route("/v2/kubernetes/clusters/{id}/credentials", get(credentials))
            .route(
                "/version",
                get(|| async { Json(serde_json::json!({"major": "1"})) }),
            );
        tokio::spawn(async move { axum::serve(api, app).await });
        (cloud, accepted_rx)
    }

    /// A cluster whose API server does not answer holds up only its own client: another
    /// cluster's is made meanwhile.
    #[tokio::test]
    async fn a_cluster_slow_to_answer_keeps_no_other_waiting() {
        let (cloud, mut accepted) = clouds_and_clusters().await;
        let options = KubeClientOptions {
            read_timeout: Duration::from_secs(600),
            ..KubeClientOptions::default()
        };
        let clients = Arc::new(ClusterClients::new(
            "test",
            options,
            Clock::system(),
            Duration::from_secs(300),
        ));
        let stuck = tokio::spawn({
            let (clients, cloud) = (clients.clone(), cloud.clone());
            async move { clients.get(&cloud, "stuck").await.map(|_| ()) }
        });
        accepted
            .recv()
            .await
            .expect("the stuck cluster's server reached");
        let other = tokio::time::timeout(Duration::from_secs(60), clients.get(&cloud, "other"));
        assert!(
            matches!(other.await, Ok(Ok(_))),
            "the other cluster's client waited"
        );
        assert!(!stuck.is_finished());
        stuck.abort();
    }

    /// A cluster that passes keep using stays; one no pass used for [`CLUSTER_UNUSED`] (its DIs
    /// moved to another worker) is forgotten with its connection.
    #[tokio::test]
    async fn a_cluster_no_pass_uses_is_forgotten_and_one_in_use_kept() {
        let (cloud, _accepted) = clouds_and_clusters().await;
        let clock = Clock::system();
        let resync = Duration::from_secs(300);
        let clients =
            ClusterClients::new("test", KubeClientOptions::default(), clock.clone(), resync);
        clients.get(&cloud, "kept").await.unwrap();
        clients.get(&cloud, "moved").await.unwrap();
        for _ in 0..4 {
            clock.advance(CLUSTER_UNUSED / 4 + Duration::from_secs(1));
            assert!(clients.fresh("kept").is_some());
        }
        assert!(clients.fresh("moved").is_none(), "forgotten");
        assert!(!clients.cache.lock().unwrap().contains_key("moved"));
        assert!(clients.fresh("kept").is_some());
    }

    #[test]
    fn credentials_are_renewed_two_thirds_into_their_life() {
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(renew_after(Some(week)), week * 2 / 3);
        assert_eq!(
            renew_after(Some(Duration::from_secs(3))),
            Duration::from_secs(2)
        );
        // Already expired (or a clock behind the server's): renewed at the next use.
        assert_eq!(renew_after(Some(Duration::ZERO)), Duration::ZERO);
        assert_eq!(renew_after(None), RENEW_UNDATED);
    }
}
