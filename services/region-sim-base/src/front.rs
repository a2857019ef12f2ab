//! The region's loopback "network": one listener for every load balancer and every cluster's
//! Kubernetes API, each on an address of its own.
//!
//! Real load balancers and DOKS API servers have IP addresses of their own. Here each gets one
//! from `127.0.0.0/8` (Linux routes the whole block to `lo`, so nothing needs configuring), and
//! all of them share one TCP port: the front listens on `0.0.0.0:<port>` and tells them apart by
//! the address a connection arrived on (the accepted socket's local address). A region therefore
//! holds one listening socket however many load balancers and clusters it has, and an open
//! socket per connection a client actually keeps open; nothing per thing that merely exists.
//!
//! Binding every address in use (`127.x.y.z:<port>`) instead would also work, but costs a
//! listening socket (a file descriptor and about 4 KB of kernel memory) and an accept loop per
//! load balancer and cluster: 12,000 of them at 10,000 DIs, against one. The wildcard listener
//! is kept on loopback by binding it to the `lo` device where the kernel allows that
//! (`SO_BINDTODEVICE`), and, always, by closing every connection whose peer is not a loopback
//! address: the simulator must not serve anything beyond this machine.
//!
//! Addresses come from [`Addresses`], which hands them out in turn over `127.1.0.1` ..
//! `127.254.255.254` (never `127.0.x.x`, where `127.0.0.1` and Debian's `127.0.1.1` live) and
//! takes them back when their load balancer or cluster goes: what is allocated is what exists,
//! and a released address comes round again only after every other one has been used, as a
//! cloud does not hand a just-released IP to the next customer.
//!
//! Each address serves one [`Site`]: HTTPS (HTTP/1.1) with the site's certificate, an axum
//! router, and a stop signal that closes the site's open connections when it goes away. A
//! connection to an address without a site, or to a site without a usable certificate, is closed
//! at once (the client sees a failed handshake). Connections idle between requests for longer
//! than the site's idle timeout are closed, as DigitalOcean's load balancers
//! (`http_idle_timeout_seconds`, 60 s) and the Kubernetes API server (90 s) close theirs.
//!
//! One process stands in for thousands of servers, each of which would have a file table of its
//! own, so the front watches its share: once its open connections reach half of the process's
//! file limit, connections it accepts close after [`PRESSURED_IDLE_TIMEOUT`] idle instead (as
//! proxies under load shorten their idle timeouts, e.g. Envoy's overload manager). A client
//! that pools a connection per concurrent request for every cluster it talks to (the workers'
//! Kubernetes clients keep about 14 per cluster) then holds what it used in the last seconds,
//! not what it used in the last minute and a half.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::NoServerSessionStorage;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

/// How long a client may take for its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The idle timeout of connections accepted while the front is short of file descriptors.
pub const PRESSURED_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The first and last addresses handed out (`127.1.0.1` .. `127.254.255.254`).
const FIRST: u32 = u32::from_be_bytes([127, 1, 0, 1]);
const LAST: u32 = u32::from_be_bytes([127, 254, 255, 254]);

/// Loopback addresses for load balancers and clusters, handed out in turn.
#[derive(Debug)]
pub struct Addresses {
    state: Mutex<AddrState>,
}

#[derive(Debug)]
struct AddrState {
    /// The next address to try.
    next: u32,
    in_use: HashSet<u32>,
}

impl Default for Addresses {
    fn default() -> Self {
        Self::new()
    }
}

impl Addresses {
    pub fn new() -> Self {
        Addresses {
            state: Mutex::new(AddrState {
                next: FIRST,
                in_use: HashSet::new(),
            }),
        }
    }

    /// A free address: the next one after the last handed out, skipping those in use and those
    /// ending in `.0` or `.255`.
    pub fn allocate(&self) -> Ipv4Addr {
        let mut st = self.state.lock().expect("addresses lock");
        loop {
            let a = st.next;
            st.next = if a >= LAST { FIRST } else { a + 1 };
            let last_octet = a & 0xff;
            if last_octet == 0 || last_octet == 255 || st.in_use.contains(&a) {
                continue;
            }
            st.in_use.insert(a);
            return Ipv4Addr::from(a);
        }
    }

    /// Gives `ip` back; it comes round again once every other address has been handed out.
    pub fn release(&self, ip: Ipv4Addr) {
        self.state
            .lock()
            .expect("addresses lock")
            .in_use
            .remove(&u32::from(ip));
    }

    /// How many addresses are allocated now.
    pub fn in_use(&self) -> usize {
        self.state.lock().expect("addresses lock").in_use.len()
    }
}

/// Where a site's certificate comes from, asked on every new connection: a load balancer's
/// changes with its gateway's Secret, and it may have none.
pub type TlsSource = Arc<dyn Fn() -> Option<Arc<ServerConfig>> + Send + Sync>;

/// What one address serves.
#[derive(Clone)]
pub struct Site {
    pub tls: TlsSource,
    pub app: Router,
    /// Changes when the site goes away: its open connections are closed.
    pub stop: watch::Receiver<bool>,
    /// Connections idle (between requests) for this long are closed.
    pub idle_timeout: Duration,
}

/// Builds a rustls server configuration from PEM, as a gateway does from a `kubernetes.io/tls` Secret.
pub fn tls_config(cert_pem: &str, key_pem: &str) -> anyhow::Result<Arc<ServerConfig>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("tls.crt is not valid PEM: {e:?}"))?;
    if certs.is_empty() {
        bail!("tls.crt holds no certificate");
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| anyhow!("tls.key is not a valid PEM private key: {e:?}"))?;
    // An explicit provider: the process-wide default is ambiguous when several crates enable
    // different rustls backends. One for every site: it is a table of algorithms.
    static PROVIDER: LazyLock<Arc<CryptoProvider>> =
        LazyLock::new(|| Arc::new(rustls::crypto::ring::default_provider()));
    let mut cfg = ServerConfig::builder_with_provider(PROVIDER.clone())
        .with_safe_default_protocol_versions()
        .context("tls protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    // No session resumption. rustls's default keeps a cache of 256 sessions per configuration,
    // allocated up front (about 30 KB): with a configuration per load balancer and per API
    // server, that was 60 KB per DI, 0.6 GB of a 10,000-DI region (heaptrack). Clients fall back
    // to a full handshake, as they do with any server that does not resume.
    cfg.session_storage = Arc::new(NoServerSessionStorage {});
    Ok(Arc::new(cfg))
}

/// As [`tls_config`], for a Kubernetes API server: it offers HTTP/2 first, as kube-apiserver
/// (Go's `net/http`) does through ALPN, so that a client's requests and watches share one
/// connection.
pub fn api_server_tls_config(cert_pem: &str, key_pem: &str) -> anyhow::Result<Arc<ServerConfig>> {
    let mut cfg = Arc::unwrap_or_clone(tls_config(cert_pem, key_pem)?);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

struct Registered {
    id: u64,
    site: Site,
}

struct Inner {
    port: u16,
    sites: RwLock<HashMap<Ipv4Addr, Registered>>,
    next_id: AtomicU64,
    addresses: Arc<Addresses>,
    /// Connections being served now.
    open: Arc<AtomicUsize>,
    /// From this many open connections on, new ones get the pressured idle timeout; and that
    /// timeout.
    pressure: RwLock<(usize, Duration)>,
}

/// Half the process's limit on open files (`RLIMIT_NOFILE`, from `/proc/self/limits`), or
/// 10,000 where it cannot be read.
fn pressure_threshold() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|soft| soft.parse::<usize>().ok())
        })
        .map_or(10_000, |limit| limit / 2)
}

/// Counts a connection as open until it is dropped.
struct OpenGuard(Arc<AtomicUsize>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The shared listener and its sites. Dropping it (every clone) stops accepting; open
/// connections end with their sites.
#[derive(Clone)]
pub struct Front {
    inner: Arc<Inner>,
    stop: Arc<watch::Sender<bool>>,
}

/// Registration of a site at an address; [`Front::unregister`] takes it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SiteId {
    pub ip: Ipv4Addr,
    id: u64,
}

impl Front {
    /// Listens on `0.0.0.0:port` (0: a free port), kept to loopback (see the module doc).
    pub async fn start(port: u16) -> anyhow::Result<Front> {
        Self::start_with(port, Arc::new(Addresses::new())).await
    }

    /// As [`Front::start`], handing out addresses from `addresses`.
    pub async fn start_with(port: u16, addresses: Arc<Addresses>) -> anyhow::Result<Front> {
        let socket = TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        // Only packets that arrive on the loopback interface reach this socket; needs
        // CAP_NET_RAW on kernels before 5.7. The peer check below holds either way.
        #[cfg(target_os = "linux")]
        if let Err(e) = socket.bind_device(Some(b"lo")) {
            tracing::debug!(error = %e, "front listener not bound to lo; refusing non-loopback peers instead");
        }
        socket
            .bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
            .map_err(|e| anyhow::anyhow!("binding the front listener to 0.0.0.0:{port}: {e}"))?;
        let listener = socket.listen(4096)?;
        let port = listener.local_addr()?.port();
        let inner = Arc::new(Inner {
            port,
            sites: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            addresses,
            open: Arc::new(AtomicUsize::new(0)),
            pressure: RwLock::new((pressure_threshold(), PRESSURED_IDLE_TIMEOUT)),
        });
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(accept_loop(listener, Arc::downgrade(&inner), stop_rx));
        Ok(Front {
            inner,
            stop: Arc::new(stop),
        })
    }

    /// The port every site shares.
    pub fn port(&self) -> u16 {
        self.inner.port
    }

    /// The address pool sites take their addresses from.
    pub fn addresses(&self) -> &Arc<Addresses> {
        &self.inner.addresses
    }

    /// Serves `site` at `ip` (replacing what was there).
    pub fn register(&self, ip: Ipv4Addr, site: Site) -> SiteId {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.inner
            .sites
            .write()
            .expect("sites lock")
            .insert(ip, Registered { id, site });
        SiteId { ip, id }
    }

    /// Stops serving the site `id` registered (new connections to its address are closed at
    /// once); a site registered at that address since is left alone. The address is not
    /// released: whoever allocated it does that.
    pub fn unregister(&self, id: SiteId) {
        let mut sites = self.inner.sites.write().expect("sites lock");
        if sites.get(&id.ip).is_some_and(|r| r.id == id.id) {
            sites.remove(&id.ip);
        }
    }

    /// How many addresses serve a site now.
    pub fn sites(&self) -> usize {
        self.inner.sites.read().expect("sites lock").len()
    }

    /// Connections being served now (TLS handshakes included).
    pub fn open_connections(&self) -> usize {
        self.inner.open.load(Ordering::Relaxed)
    }

    /// From `threshold` open connections on, connections accepted close after `idle` idle
    /// (instead of their site's timeout, if that is longer). Defaults: half the process's file
    /// limit, [`PRESSURED_IDLE_TIMEOUT`].
    pub fn set_pressure(&self, threshold: usize, idle: Duration) {
        *self.inner.pressure.write().expect("pressure lock") = (threshold, idle);
    }

    /// Stops accepting connections (sites close their open ones when they stop).
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    inner: std::sync::Weak<Inner>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors, most likely: wait a little rather than spin.
                    tracing::warn!(error = %e, "front listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(inner) = inner.upgrade() else { return };
        if !is_loopback(peer.ip()) {
            tracing::warn!(%peer, "front listener: refused a connection from beyond loopback");
            continue;
        }
        let local = match stream.local_addr() {
            Ok(SocketAddr::V4(a)) => *a.ip(),
            _ => continue,
        };
        let site = inner
            .sites
            .read()
            .expect("sites lock")
            .get(&local)
            .map(|r| r.site.clone());
        // Nothing at that address, or no usable certificate: the client's handshake fails.
        let Some(mut site) = site else { continue };
        let Some(cfg) = (site.tls)() else { continue };
        let _ = stream.set_nodelay(true);
        let open = inner.open.fetch_add(1, Ordering::Relaxed) + 1;
        let guard = OpenGuard(inner.open.clone());
        let (threshold, pressured) = *inner.pressure.read().expect("pressure lock");
        if open >= threshold {
            site.idle_timeout = site.idle_timeout.min(pressured);
        }
        tokio::spawn(async move {
            serve_connection(stream, cfg, site).await;
            drop(guard);
        });
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, cfg: Arc<ServerConfig>, site: Site) {
    let Site {
        app,
        mut stop,
        idle_timeout,
        ..
    } = site;
    if *stop.borrow_and_update() {
        return;
    }
    let acceptor = TlsAcceptor::from(cfg);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(t)) => t,
        _ => return,
    };
    let svc = TowerToHyperService::new(app);
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let io = TokioIo::new(tls);
    let served = async move {
        if h2 {
            // Pings are answered by the connection itself: a quiet watch keeps it open.
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .timer(TokioTimer::new())
                .max_concurrent_streams(H2_MAX_STREAMS)
                .serve_connection(io, svc)
                .await;
        } else {
            // The header read timeout starts when the connection waits for a request, so it
            // is the idle timeout of a kept-alive connection too.
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(idle_timeout)
                .serve_connection(io, svc)
                .await;
        }
    };
    tokio::select! {
        _ = served => {}
        // The site went away (a load balancer, a cluster): its connections go with it.
        _ = stop.changed() => {}
    }
}

/// Streams one HTTP/2 connection may carry at once. kube-apiserver leaves it to Go
/// (`--http2-max-streams-per-connection` 0), whose default versions differ on (250, or 100
/// since the rapid-reset fixes): the lower one, so that a client that opens more streams than
/// that (16 watches and a few passes' lists on one cluster) is seen to wait here as it would.
const H2_MAX_STREAMS: u32 = 100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_come_in_turn_skip_what_is_taken_and_wrap() {
        let a = Addresses::new();
        let x = a.allocate();
        let y = a.allocate();
        assert_eq!(x, Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(y, Ipv4Addr::new(127, 1, 0, 2));
        a.release(x);
        assert_eq!(
            a.allocate(),
            Ipv4Addr::new(127, 1, 0, 3),
            "x does not come round at once"
        );
        assert_eq!(a.in_use(), 2);
        // Near the end of the block: .255 and .0 are skipped, then it wraps past what is taken.
        a.state.lock().unwrap().next = u32::from(Ipv4Addr::new(127, 1, 0, 254));
        assert_eq!(a.allocate(), Ipv4Addr::new(127, 1, 0, 254));
        assert_eq!(a.allocate(), Ipv4Addr::new(127, 1, 1, 1));
        a.state.lock().unwrap().next = LAST;
        assert_eq!(a.allocate(), Ipv4Addr::new(127, 254, 255, 254));
        assert_eq!(a.allocate(), x, "wrapped; 127.1.0.1 is free again");
        assert_eq!(
            a.allocate(),
            Ipv4Addr::new(127, 1, 0, 4),
            "y and 127.1.0.3 are taken"
        );
    }
}
