//! HTTPS for the regional service's listener: central reaches a region across a network, so in
//! production the shared secret travels inside TLS. With `TLS_CERT_FILE` and `TLS_KEY_FILE` the
//! listener speaks TLS only; with neither, plain HTTP (local runs, the tests). The files are read
//! again every `TLS_RELOAD_SECS` and a changed pair is served from the next handshake on, so a
//! certificate renewed in place (cert-manager, a mounted Secret) needs no restart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use sha2::{Digest, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client may take over its handshake before the connection is closed.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug, Clone)]
pub struct TlsArgs {
    /// PEM certificate chain (leaf first) to serve HTTPS with; needs `TLS_KEY_FILE`. Without
    /// both, the service speaks plain HTTP.
    #[arg(long, env = "TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `TLS_CERT_FILE`.
    #[arg(long, env = "TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,
    /// How often the certificate and key files are read again; a changed pair is served from
    /// then on.
    #[arg(long, env = "TLS_RELOAD_SECS", default_value_t = 60)]
    pub tls_reload_secs: u64,
}

impl Default for TlsArgs {
    fn default() -> Self {
        TlsArgs {
            tls_cert_file: None,
            tls_key_file: None,
            tls_reload_secs: 60,
        }
    }
}

/// The listener's TLS: a server configuration whose certificate can be swapped under it.
#[derive(Clone)]
pub struct Tls {
    acceptor: TlsAcceptor,
    current: Arc<Current>,
    cert_file: PathBuf,
    key_file: PathBuf,
    reload_every: Duration,
}

/// The certificate served now, and the digest of the files it was built from.
struct Current {
    provider: Arc<CryptoProvider>,
    loaded: RwLock<(Arc<CertifiedKey>, [u8; 32])>,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current").finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.loaded.read().expect("tls lock").0.clone())
    }
}

impl Tls {
    /// `None` without certificate and key (plain HTTP); an error with one of them only, or when
    /// they cannot be read or do not make a usable pair.
    pub fn load(args: &TlsArgs) -> anyhow::Result<Option<Tls>> {
        let (cert_file, key_file) = match (&args.tls_cert_file, &args.tls_key_file) {
            (None, None) => return Ok(None),
            (Some(cert), Some(key)) => (cert.clone(), key.clone()),
            (Some(_), None) => bail!(
                "TLS_CERT_FILE is set but TLS_KEY_FILE is not: set both to serve HTTPS, or neither for plain HTTP"
            ),
            (None, Some(_)) => bail!(
                "TLS_KEY_FILE is set but TLS_CERT_FILE is not: set both to serve HTTPS, or neither for plain HTTP"
            ),
        };
        if args.tls_reload_secs == 0 {
            bail!("TLS_RELOAD_SECS must be at least 1");
        }
        // An explicit provider: the process-wide default is ambiguous when several crates enable
        // different rustls backends.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let contents = read_pair(&cert_file, &key_file)?;
        let key = certified_key(&contents, &provider)
            .with_context(|| format!("{} and {}", cert_file.display(), key_file.display()))?;
        let current = Arc::new(Current {
            provider: provider.clone(),
            loaded: RwLock::new((key, contents.digest())),
        });
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            cert_file,
            key_file,
            reload_every: Duration::from_secs(args.tls_reload_secs),
        }))
    }

    /// Reads the files again and serves them if they changed and make a usable pair; else keeps
    /// the certificate served now. Returns whether it changed.
    pub fn reload(&self) -> anyhow::Result<bool> {
        let contents = read_pair(&self.cert_file, &self.key_file)?;
        let digest = contents.digest();
        if self.current.loaded.read().expect("tls lock").1 == digest {
            return Ok(false);
        }
        // A pair caught between the writes of its two files does not match; the next look
        // finds them both written.
        let key = certified_key(&contents, &self.current.provider)?;
        *self.current.loaded.write().expect("tls lock") = (key, digest);
        Ok(true)
    }

    /// Looks for a renewed certificate every `TLS_RELOAD_SECS`, for ever.
    pub async fn watch(self) {
        let mut every = tokio::time::interval(self.reload_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            match self.reload() {
                Ok(true) => tracing::info!(
                    cert_file = %self.cert_file.display(),
                    "serving the renewed TLS certificate"
                ),
                Ok(false) => {}
                Err(error) => tracing::warn!(
                    error = format!("{error:#}"),
                    "TLS certificate not reloaded; still serving the previous one"
                ),
            }
        }
    }

    /// `listener`, accepting only connections that complete a TLS handshake. Handshakes run
    /// concurrently, each in a task of its own, so a slow client holds up nobody else.
    pub fn listener(&self, listener: TcpListener) -> std::io::Result<TlsListener> {
        let local_addr = listener.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(accept(listener, self.acceptor.clone(), tx));
        Ok(TlsListener {
            incoming: rx,
            local_addr,
        })
    }
}

/// Serves `app` on `listener`: HTTPS with `tls`, else plain HTTP. Returns the tasks to abort
/// when the server stops (the server, and the certificate reload).
pub fn serve(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Tls>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    Ok(match tls {
        None => vec![tokio::spawn(async move {
            let serve = axum::serve(common::listener::no_delay(listener), app);
            if let Err(error) = serve.await {
                tracing::error!(%error, "regional server stopped");
            }
        })],
        Some(tls) => {
            tracing::info!(cert_file = %tls.cert_file.display(), "serving HTTPS only");
            let listener = tls.listener(listener)?;
            vec![
                tokio::spawn(async move {
                    if let Err(error) = axum::serve(listener, app).await {
                        tracing::error!(%error, "regional server stopped");
                    }
                }),
                tokio::spawn(tls.watch()),
            ]
        }
    })
}

/// A listener that yields connections whose TLS handshake completed.
pub struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(connection) => connection,
            // The accept loop ends only when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local_addr)
    }
}

/// Accepts TCP connections and hands those that complete a handshake to the server, until the
/// server's listener is dropped (which closes the socket).
async fn accept(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = ready.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // As axum's own listener: out of file descriptors and the like pass.
                    tracing::debug!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "could not set TCP_NODELAY");
        }
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send((tls, peer)).await;
                }
                // A client that does not trust the certificate, speaks plain HTTP, or stalls.
                Ok(Err(error)) => tracing::debug!(%error, %peer, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

/// The certificate and key files' contents.
struct Pair {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Pair {
    /// Tells one pair of files from another without keeping the key around.
    fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [&self.cert, &self.key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        h.finalize().into()
    }
}

fn read_pair(cert_file: &Path, key_file: &Path) -> anyhow::Result<Pair> {
    Ok(Pair {
        cert: std::fs::read(cert_file)
            .with_context(|| format!("reading TLS_CERT_FILE {}", cert_file.display()))?,
        key: std::fs::read(key_file)
            .with_context(|| format!("reading TLS_KEY_FILE {}", key_file.display()))?,
    })
}

/// The certificate chain and key of `pair`, checked to match.
fn certified_key(pair: &Pair, provider: &CryptoProvider) -> anyhow::Result<Arc<CertifiedKey>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pair.cert)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("the certificate file is not valid PEM: {e:?}"))?;
    if certs.is_empty() {
        bail!("the certificate file holds no certificate");
    }
    let key = PrivateKeyDer::from_pem_slice(&pair.key)
        .map_err(|e| anyhow!("the key file holds no usable PEM private key: {e:?}"))?;
    let key = CertifiedKey::from_der(certs, key, provider)
        .map_err(|e| anyhow!("the certificate and the key do not make a pair: {e}"))?;
    Ok(Arc::new(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["regional.test".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_file, key_file) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        (cert_file, key_file, cert.pem())
    }

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("regional-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn args(cert: Option<&Path>, key: Option<&Path>) -> TlsArgs {
        TlsArgs {
            tls_cert_file: cert.map(Path::to_path_buf),
            tls_key_file: key.map(Path::to_path_buf),
            ..TlsArgs::default()
        }
    }

    fn served(tls: &Tls) -> Vec<u8> {
        tls.current.loaded.read().unwrap().0.cert[0].to_vec()
    }

    fn der(pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    #[test]
    fn plain_http_without_files_and_a_clear_refusal_with_one() {
        let dir = temp_dir();
        let (cert, key, _) = write_pair(&dir, "a");
        assert!(Tls::load(&args(None, None)).unwrap().is_none());
        let only_cert = Tls::load(&args(Some(&cert), None))
            .err()
            .unwrap()
            .to_string();
        assert!(
            only_cert.contains("TLS_CERT_FILE is set but TLS_KEY_FILE is not"),
            "{only_cert}"
        );
        let only_key = Tls::load(&args(None, Some(&key)))
            .err()
            .unwrap()
            .to_string();
        assert!(
            only_key.contains("TLS_KEY_FILE is set but TLS_CERT_FILE is not"),
            "{only_key}"
        );
        let missing = Tls::load(&args(Some(&dir.join("nope.crt")), Some(&key)))
            .err()
            .unwrap();
        assert!(
            format!("{missing:#}").contains("reading TLS_CERT_FILE"),
            "{missing:#}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_renewed_pair_is_served_and_a_mismatched_one_is_not() {
        let dir = temp_dir();
        let (cert, key, first) = write_pair(&dir, "a");
        let tls = Tls::load(&args(Some(&cert), Some(&key))).unwrap().unwrap();
        assert_eq!(served(&tls), der(&first));
        assert!(!tls.reload().unwrap(), "unchanged files are not reloaded");

        // The certificate renewed but its key not yet written: keep serving the old pair.
        let (other_cert, other_key, renewed) = write_pair(&dir, "b");
        std::fs::copy(&other_cert, &cert).unwrap();
        let refused = tls.reload().err().unwrap().to_string();
        assert!(refused.contains("do not make a pair"), "{refused}");
        assert_eq!(served(&tls), der(&first));

        std::fs::copy(&other_key, &key).unwrap();
        assert!(tls.reload().unwrap());
        assert_eq!(served(&tls), der(&renewed));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
