//! Certificates for the regional services when the system runs with [`crate::Options::region_tls`]:
//! a test CA, and per region a server certificate it signs, written to files the way a mounted
//! Secret holds them (`<region>.crt`, `<region>.key`), and the CA's PEM for central's
//! `REGION_CA_FILE`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// How often the regional services look for renewed certificates in the tests.
pub const RELOAD: Duration = Duration::from_secs(1);

/// A certificate authority that signs server certificates.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        TestCa { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A server certificate for the loopback address (the harness reaches regions at
    /// `https://127.0.0.1:<port>`) and `localhost`: (certificate PEM, key PEM).
    pub fn issue(&self) -> (String, String) {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
            .expect("server params");
        params
            .distinguished_name
            .push(DnType::CommonName, "regional");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().expect("server key");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("server certificate");
        (cert.pem(), key.serialize_pem())
    }
}

/// The regions' certificate files and the CA central trusts.
pub struct RegionTls {
    pub dir: PathBuf,
    pub ca: TestCa,
    /// The CA's PEM: central's `REGION_CA_FILE`.
    pub ca_file: PathBuf,
}

impl RegionTls {
    pub fn new() -> RegionTls {
        let dir = std::env::temp_dir().join(format!("region-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("TLS directory");
        let ca = TestCa::new("Test regions CA");
        let ca_file = dir.join("ca.crt");
        std::fs::write(&ca_file, ca.pem()).expect("write the CA");
        RegionTls { dir, ca, ca_file }
    }

    /// The files `region`'s certificate and key live in.
    pub fn files(&self, region: &str) -> (PathBuf, PathBuf) {
        (
            self.dir.join(format!("{region}.crt")),
            self.dir.join(format!("{region}.key")),
        )
    }

    /// Issues `region` a certificate from the CA and writes it; returns its PEM.
    pub fn issue(&self, region: &str) -> String {
        let (cert, key) = self.ca.issue();
        self.install(region, &cert, &key);
        cert
    }

    /// Replaces `region`'s files, each in one step (as a renewal does), the key first.
    pub fn install(&self, region: &str, cert_pem: &str, key_pem: &str) {
        let (cert_file, key_file) = self.files(region);
        replace(&key_file, key_pem);
        replace(&cert_file, cert_pem);
    }

    /// The regional service's TLS settings for `region`.
    pub fn args(&self, region: &str) -> regional::tls::TlsArgs {
        let (cert, key) = self.files(region);
        regional::tls::TlsArgs {
            tls_cert_file: Some(cert),
            tls_key_file: Some(key),
            tls_reload_secs: RELOAD.as_secs(),
        }
    }
}

impl Default for RegionTls {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for RegionTls {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn replace(path: &Path, contents: &str) {
    let staged = PathBuf::from(format!("{}.new", path.display()));
    std::fs::write(&staged, contents).expect("write a certificate file");
    std::fs::rename(&staged, path).expect("replace a certificate file");
}

/// The DER of the first certificate in `pem`.
pub fn der(pem: &str) -> Vec<u8> {
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE-----"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .expect("PEM body is base64")
}
