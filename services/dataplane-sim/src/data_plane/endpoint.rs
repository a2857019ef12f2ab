//! The HTTPS server at a load balancer's address: an [`Endpoint`] registered on the region's
//! front, its shared state, and how a new configuration (certificate, route) is applied. The
//! server's lifecycle, apart from what it answers.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use region_sim_base::faults::Faults;
use region_sim_base::front::{tls_config, Front, Site, SiteId};
use rustls::ServerConfig;
use tokio::sync::watch;

use super::openai::router;
use super::{EndpointConfig, ModelTiming};

/// How long a connection may stay idle between requests, as on DigitalOcean's load balancers
/// (`http_idle_timeout_seconds`, 60 by default).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

pub(super) struct Inner {
    pub(super) config: RwLock<EndpointConfig>,
    tls: RwLock<Option<Arc<ServerConfig>>>,
    pub(super) timing: Arc<RwLock<ModelTiming>>,
    pub(super) faults: Arc<Faults>,
    pub(super) next_backend: AtomicUsize,
    pub(super) requests: AtomicU64,
    /// Bumped on every configuration update: held requests wake on it.
    pub(super) updates: watch::Sender<u64>,
    /// True once the endpoint shuts down: held requests are released.
    pub(super) stopped: watch::Receiver<bool>,
}

/// One OpenAI-compatible HTTPS server at a loopback address of its own.
pub struct Endpoint {
    addr: SocketAddr,
    inner: Arc<Inner>,
    shutdown: watch::Sender<bool>,
    front: Front,
    site: SiteId,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Endpoint {
    /// Starts serving at `ip` on `front` (the address is the caller's: a load balancer's). Until
    /// a certificate is configured every TLS handshake fails, as on a gateway whose listener has
    /// no valid certificate.
    pub fn start(
        front: &Front,
        ip: Ipv4Addr,
        timing: Arc<RwLock<ModelTiming>>,
        faults: Arc<Faults>,
    ) -> Endpoint {
        let (tx, rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            config: RwLock::new(EndpointConfig::default()),
            tls: RwLock::new(None),
            timing,
            faults,
            next_backend: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            updates: watch::channel(0).0,
            stopped: rx.clone(),
        });
        let tls_of = inner.clone();
        let site = front.register(
            ip,
            Site {
                tls: Arc::new(move || tls_of.tls.read().expect("tls lock").clone()),
                app: router(inner.clone()),
                stop: rx,
                idle_timeout: IDLE_TIMEOUT,
            },
        );
        Endpoint {
            addr: SocketAddr::from((ip, front.port())),
            inner,
            shutdown: tx,
            front: front.clone(),
            site,
        }
    }

    /// The load balancer's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.site.ip
    }

    /// The port every endpoint of the region shares.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Requests that reached the HTTP layer (after a successful handshake).
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    pub fn config(&self) -> EndpointConfig {
        self.inner.config.read().expect("endpoint lock").clone()
    }

    /// Applies a new configuration. The certificate is reloaded only when it changed; an invalid
    /// one leaves the listener without a certificate (handshakes fail) and is reported.
    pub fn update(&self, mut cfg: EndpointConfig) -> Result<(), String> {
        crate::serving::attach(&mut cfg, Arc::as_ptr(&self.inner) as usize);
        let mut current = self.inner.config.write().expect("endpoint lock");
        let mut result = Ok(());
        if current.tls != cfg.tls || self.inner.tls.read().expect("tls lock").is_none() {
            let built = match &cfg.tls {
                Some((c, k)) => match tls_config(c, k) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        result = Err(format!("{e:#}"));
                        None
                    }
                },
                None => None,
            };
            *self.inner.tls.write().expect("tls lock") = built;
        }
        *current = cfg;
        drop(current);
        // Held requests look again (a ready backend may have appeared).
        self.inner.updates.send_modify(|n| *n += 1);
        result
    }

    /// Stops serving: new connections to the address are closed at once, open ones too.
    pub fn shutdown(&self) {
        self.front.unregister(self.site);
        let _ = self.shutdown.send(true);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}
