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
        server: region_sim_base::front::api_server_tls_config(&cert.pem(), &key.serialize_pem())?,
    })
}
