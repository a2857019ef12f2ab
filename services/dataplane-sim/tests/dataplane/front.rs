//! The region's front on its own: load balancers (and cluster APIs) at loopback addresses of
//! their own, all on one port, told apart by the address a connection arrived on.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use dataplane_sim::auth::Authentication;
use dataplane_sim::data_plane::{
    token_hash, Backend, Endpoint, EndpointConfig, ModelTiming, Route,
};
use endpoint_auth::TokenHashes;
use region_sim_base::faults::Faults;
use region_sim_base::front::{Front, Site, SiteId};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::data_plane::client;

const TOKEN: &str = "di_front_test_token_0123456789";

/// A CA and a certificate for `ip` it signed, as PEM: (ca, cert, key).
fn pki(ip: Ipv4Addr) -> (String, String, String) {
    crate::data_plane::ca_and_cert("di-ca", vec![ip.to_string()])
}

fn serving(cert: &str, key: &str, pod: &str, model: &str) -> EndpointConfig {
    EndpointConfig {
        overrides: Vec::new(),
        tls: Some((cert.to_string(), key.to_string())),
        auth: Authentication::external(TokenHashes::from_hex([token_hash(TOKEN)])),
        route: Route::Pool {
            paths: vec![],
            endpoints: vec![Backend::new(pod, Some(model))],
            pools: vec![],
        },
    }
}

async fn models(c: &reqwest::Client, ep_url: &str) -> reqwest::Result<(String, Vec<String>)> {
    let r = c
        .get(format!("{ep_url}/v1/models"))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    let backend = r.headers()["x-sim-backend"].to_str().unwrap().to_string();
    let v: Value = r.json().await?;
    let ids = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    Ok((backend, ids))
}

#[tokio::test]
async fn two_load_balancers_on_one_listener_serve_their_own_endpoints() {
    let front = Front::start(0).await.unwrap();
    let timing = Arc::new(RwLock::new(ModelTiming::default()));
    let faults = Arc::new(Faults::default());
    let (ip_a, ip_b) = (front.addresses().allocate(), front.addresses().allocate());
    assert_ne!(ip_a, ip_b);
    let a = Endpoint::start(&front, ip_a, timing.clone(), faults.clone());
    let b = Endpoint::start(&front, ip_b, timing.clone(), faults.clone());
    assert_eq!(a.port(), front.port());
    assert_eq!(b.port(), front.port(), "one port for both");
    assert_eq!(a.url(), format!("https://{ip_a}:{}", front.port()));
    let (ca_a, cert_a, key_a) = pki(ip_a);
    let (ca_b, cert_b, key_b) = pki(ip_b);
    a.update(serving(&cert_a, &key_a, "pod-a", "model-a"))
        .unwrap();
    b.update(serving(&cert_b, &key_b, "pod-b", "model-b"))
        .unwrap();

    // Each address presents its own certificate and serves its own model.
    let (pod, ids) = models(&client(&ca_a), &a.url()).await.unwrap();
    assert_eq!((pod.as_str(), ids), ("pod-a", vec!["model-a".to_string()]));
    let (pod, ids) = models(&client(&ca_b), &b.url()).await.unwrap();
    assert_eq!((pod.as_str(), ids), ("pod-b", vec!["model-b".to_string()]));
    assert!(
        models(&client(&ca_a), &b.url()).await.is_err(),
        "b does not present a's certificate"
    );
    assert_eq!((a.requests(), b.requests()), (1, 1));

    // Nothing at an address no load balancer holds: the connection is closed.
    let unused = front.addresses().allocate();
    assert!(client(&ca_a)
        .get(format!("https://{unused}:{}/v1/models", front.port()))
        .send()
        .await
        .is_err());

    // A load balancer that goes away stops answering; the other one keeps serving.
    a.shutdown();
    assert!(models(&client(&ca_a), &a.url()).await.is_err());
    let (pod, _) = models(&client(&ca_b), &b.url()).await.unwrap();
    assert_eq!(pod, "pod-b");
    assert_eq!(front.sites(), 1);
}

/// A TLS client connection to `ip:port` trusting `ca` (PEM).
async fn tls_connect(
    ca: &str,
    ip: Ipv4Addr,
    port: u16,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    let der = rustls::pki_types::pem::PemObject::from_pem_slice(ca.as_bytes()).unwrap();
    roots.add(CertificateDer::into_owned(der)).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect((ip, port)).await?;
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::IpAddress(IpAddr::V4(ip).into()), tcp)
        .await
}

/// Serves a plain site answering `GET /` with "hello" at `ip`, with a certificate for `ip`,
/// closing idle connections after `idle`: (the CA's PEM, the registration, the site's stop).
fn serve_hello(
    front: &Front,
    ip: Ipv4Addr,
    idle: Duration,
) -> (String, SiteId, watch::Sender<bool>) {
    let (ca, cert, key) = pki(ip);
    let tls = region_sim_base::front::tls_config(&cert, &key).unwrap();
    let (stop, stop_rx) = watch::channel(false);
    let site = Site {
        tls: Arc::new(move || Some(tls.clone())),
        app: Router::new().route("/", get(|| async { "hello" })),
        stop: stop_rx,
        idle_timeout: idle,
    };
    (ca, front.register(ip, site), stop)
}

async fn get_hello(
    conn: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> std::io::Result<String> {
    conn.write_all(b"GET / HTTP/1.1\r\nhost: sim\r\n\r\n")
        .await?;
    let mut buf = vec![0u8; 4096];
    let n = conn.read(&mut buf).await?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Waits for the server to close `conn`: the read ends or fails. The test fails if it is still
/// open after 10 s, far beyond any idle timeout here.
async fn closed_by_server(
    conn: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    what: &str,
) {
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("{what}: still open after 10 s"));
    assert!(matches!(n, Ok(0) | Err(_)), "{what}: {n:?}");
}

#[tokio::test]
async fn idle_connections_are_closed_and_a_stopped_site_closes_its_own() {
    let front = Front::start(0).await.unwrap();
    let ip = front.addresses().allocate();
    let (ca, _, _stop) = serve_hello(&front, ip, Duration::from_secs(1));
    // A site whose connections close sooner: the server closing one shows that its timers ran
    // for longer than that while the other site's connection sat idle.
    let quick_ip = front.addresses().allocate();
    let (quick_ca, _, _quick_stop) = serve_hello(&front, quick_ip, Duration::from_millis(100));

    let mut conn = tls_connect(&ca, ip, front.port()).await.unwrap();
    assert!(get_hello(&mut conn).await.unwrap().ends_with("hello"));
    let mut quick = tls_connect(&quick_ca, quick_ip, front.port())
        .await
        .unwrap();
    assert!(get_hello(&mut quick).await.unwrap().ends_with("hello"));
    closed_by_server(&mut quick, "the quick site's idle connection").await;
    // Kept alive between requests: idle since before the quick one was...
    assert!(get_hello(&mut conn).await.unwrap().ends_with("hello"));
    // ... but not past its idle timeout: the server closes it, and its socket with it.
    closed_by_server(&mut conn, "the idle connection").await;

    // A site that stops closes its open connections, idle or not.
    let ip2 = front.addresses().allocate();
    let (ca2, id2, stop2) = serve_hello(&front, ip2, Duration::from_secs(60));
    let mut conn2 = tls_connect(&ca2, ip2, front.port()).await.unwrap();
    assert!(get_hello(&mut conn2).await.unwrap().ends_with("hello"));
    front.unregister(id2);
    stop2.send(true).unwrap();
    closed_by_server(&mut conn2, "a connection of the stopped site").await;
    assert!(tls_connect(&ca2, ip2, front.port()).await.is_err());
}

/// This machine's address on its default route, if it has one beyond loopback. No packet is
/// sent: connecting a UDP socket only chooses the source address.
fn non_loopback_address() -> Option<Ipv4Addr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    match s.local_addr().ok()? {
        SocketAddr::V4(a) if !a.ip().is_loopback() && !a.ip().is_unspecified() => Some(*a.ip()),
        _ => None,
    }
}

#[tokio::test]
async fn connections_from_beyond_loopback_are_refused() {
    let Some(lan) = non_loopback_address() else {
        eprintln!("no address beyond loopback on this machine; nothing to check");
        return;
    };
    let front = Front::start(0).await.unwrap();
    // The same site at a loopback address and at the machine's own address: only the
    // loopback one answers (a connection to the machine's address comes from that address).
    // Either guard refuses it alone: the listener's binding to `lo` (the kernel never hands it
    // the connection) and the check of the peer's address.
    let (ca, _, _stop) = serve_hello(&front, lan, Duration::from_secs(60));
    assert!(
        tls_connect(&ca, lan, front.port()).await.is_err(),
        "a peer at {lan} is not on loopback"
    );
    let ip = front.addresses().allocate();
    let (ca, _, _stop2) = serve_hello(&front, ip, Duration::from_secs(60));
    let mut conn = tls_connect(&ca, ip, front.port()).await.unwrap();
    assert!(get_hello(&mut conn).await.unwrap().ends_with("hello"));
}

#[tokio::test]
async fn connections_accepted_under_pressure_close_sooner() {
    let front = Front::start(0).await.unwrap();
    // From two open connections on, new ones close after 300 ms idle (the default: from half
    // the process's file limit on, after 5 s).
    front.set_pressure(2, Duration::from_millis(300));
    let ip = front.addresses().allocate();
    let (ca, _, _stop) = serve_hello(&front, ip, Duration::from_secs(60));
    let mut first = tls_connect(&ca, ip, front.port()).await.unwrap();
    assert!(get_hello(&mut first).await.unwrap().ends_with("hello"));
    let mut second = tls_connect(&ca, ip, front.port()).await.unwrap();
    assert!(get_hello(&mut second).await.unwrap().ends_with("hello"));
    assert_eq!(front.open_connections(), 2);

    closed_by_server(
        &mut second,
        "the second connection, accepted under pressure and idle",
    )
    .await;
    // The first, idle since before the second was, keeps its site's timeout.
    assert!(get_hello(&mut first).await.unwrap().ends_with("hello"));
    test_support::until(Duration::from_secs(1), "one connection left", async || {
        front.open_connections() == 1
    })
    .await;
}
