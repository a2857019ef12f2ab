//! Each dedicated inference gets its own certificate authority at create time: `GET …/ca` returns
//! its certificate, and the workers issue the endpoints' TLS certificates from it. Customers
//! install that CA as a trust root, so it is made to be worth little to anyone who stole its key:
//!
//! - **Name constraints**: it may only sign for loopback (`127.0.0.0/8`, `localhost`: the worker's
//!   endpoint certificates name them for port-forwarded clients, and the simulator's load
//!   balancers are loopback addresses) and for the ranges and domains the region's load balancer
//!   addresses fall in (`CA_PERMITTED_NAMES`). A certificate it signs for any other name fails
//!   verification in every client that enforces RFC 5280 (rustls/webpki, OpenSSL, Go).
//! - **Bounded validity** (`CA_VALIDITY_DAYS`, default three years) with **renewal**: once a
//!   DI's newest CA has less than `CA_RENEW_BEFORE_DAYS` (default a year) left, a successor is
//!   made and `GET …/ca` returns both; the workers keep signing with the old one while it can
//!   still cover a whole endpoint certificate (90 days) and then switch, so a customer has the
//!   window less 90 days to fetch the bundle. An expired CA is then deleted, key and all.

use std::net::IpAddr;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CidrSubnet, DnType, GeneralSubtree, IsCa, KeyPair,
    KeyUsagePurpose, NameConstraints,
};
use region_store::{NewCa, Store};
use uuid::Uuid;

/// How long the workers' endpoint certificates last (the worker's `plan::certificates::VALIDITY`):
/// the renewal window must exceed it, or the endpoints would switch to a new CA the moment it
/// is made, before any customer could fetch it.
const ENDPOINT_CERTIFICATE_DAYS: u32 = 90;
/// The least time customers get to fetch a renewed CA before the endpoints use it.
const LEAST_NOTICE_DAYS: u32 = 30;
const DAY: Duration = Duration::from_secs(24 * 3600);

#[derive(clap::Args, Debug, Clone)]
pub struct CaPolicy {
    /// How long each DI's CA is valid.
    #[arg(
        long = "ca-validity-days",
        env = "CA_VALIDITY_DAYS",
        default_value_t = 1095
    )]
    pub validity_days: u32,
    /// A DI gets a successor CA once its newest has less than this left (at least 120 days:
    /// the endpoints switch 90 days before the old one expires, and customers need time to
    /// fetch the new one before that).
    #[arg(
        long = "ca-renew-before-days",
        env = "CA_RENEW_BEFORE_DAYS",
        default_value_t = 365
    )]
    pub renew_before_days: u32,
    /// What the DIs' CAs may sign besides loopback: the IP ranges (CIDR) and DNS domains the
    /// region's load balancers' addresses fall in, comma-separated. Empty (the default) is
    /// enough for the simulator, whose load balancers are loopback addresses.
    #[arg(
        long = "ca-permitted-names",
        env = "CA_PERMITTED_NAMES",
        value_delimiter = ','
    )]
    pub permitted_names: Vec<String>,
}

impl Default for CaPolicy {
    fn default() -> Self {
        CaPolicy {
            validity_days: 1095,
            renew_before_days: 365,
            permitted_names: Vec::new(),
        }
    }
}

impl CaPolicy {
    /// Refuses a configuration that would make unusable CAs or no notice before a switch.
    pub fn check(&self) -> anyhow::Result<()> {
        let least = ENDPOINT_CERTIFICATE_DAYS + LEAST_NOTICE_DAYS;
        if self.renew_before_days < least {
            anyhow::bail!("CA_RENEW_BEFORE_DAYS must be at least {least}");
        }
        if self.validity_days <= self.renew_before_days {
            anyhow::bail!("CA_VALIDITY_DAYS must exceed CA_RENEW_BEFORE_DAYS");
        }
        self.permitted_subtrees().map(|_| ())
    }

    pub fn renew_before(&self) -> Duration {
        DAY * self.renew_before_days
    }

    fn permitted_subtrees(&self) -> anyhow::Result<Vec<GeneralSubtree>> {
        let loopback = [
            GeneralSubtree::IpAddress(CidrSubnet::from_v4_prefix([127, 0, 0, 0], 8)),
            GeneralSubtree::DnsName("localhost".into()),
        ];
        let configured = self
            .permitted_names
            .iter()
            .map(|n| n.trim())
            .filter(|n| !n.is_empty())
            .map(subtree);
        loopback.into_iter().map(Ok).chain(configured).collect()
    }
}

/// One `CA_PERMITTED_NAMES` entry: `10.0.0.0/8`, `203.0.113.7` (that address alone) or a domain
/// (`endpoints.example.com`: it and every name below it).
fn subtree(name: &str) -> anyhow::Result<GeneralSubtree> {
    let bad = || {
        anyhow::anyhow!(
            "CA_PERMITTED_NAMES: {name:?} is not a CIDR range, an IP address or a domain"
        )
    };
    if let Some((addr, prefix)) = name.split_once('/') {
        let addr = IpAddr::from_str(addr).map_err(|_| bad())?;
        let prefix = u8::from_str(prefix).map_err(|_| bad())?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > bits {
            return Err(bad());
        }
        return Ok(GeneralSubtree::IpAddress(CidrSubnet::from_addr_prefix(
            addr, prefix,
        )));
    }
    if let Ok(addr) = IpAddr::from_str(name) {
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        return Ok(GeneralSubtree::IpAddress(CidrSubnet::from_addr_prefix(
            addr, bits,
        )));
    }
    let domain = name.trim_start_matches('.').to_ascii_lowercase();
    let valid = !domain.is_empty()
        && domain.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err(bad());
    }
    Ok(GeneralSubtree::DnsName(domain))
}

/// A CA for DI `id` under the default policy, valid from now.
pub fn generate(id: Uuid) -> anyhow::Result<NewCa> {
    generate_with(id, &CaPolicy::default(), SystemTime::now())
}

/// A CA for DI `id` under `policy`, valid from an hour before `now` (clocks disagree) for the
/// policy's validity.
pub fn generate_with(id: Uuid, policy: &CaPolicy, now: SystemTime) -> anyhow::Result<NewCa> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, format!("Dedicated Inference {id} CA"));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.name_constraints = Some(NameConstraints {
        permitted_subtrees: policy.permitted_subtrees()?,
        excluded_subtrees: Vec::new(),
    });
    let not_after = now + DAY * policy.validity_days;
    params.not_before = (now - Duration::from_secs(3600)).into();
    params.not_after = not_after.into();
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(NewCa {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after: not_after.into(),
    })
}

/// Gives every DI whose newest CA expires within the policy's window a successor, and deletes
/// expired CAs that have one; returns how many were made. Safe on several replicas at once: the
/// store adds a successor only to a DI that still needs one.
pub async fn renew_due(store: &Store, policy: &CaPolicy) -> anyhow::Result<usize> {
    store.certificate_authorities_retire().await?;
    let mut renewed = 0;
    loop {
        let due = store
            .certificate_authorities_due(policy.renew_before(), 100)
            .await?;
        let mut progress = false;
        for id in &due {
            let ca = generate_with(*id, policy, SystemTime::now())?;
            match store
                .certificate_authority_renew(*id, &ca, policy.renew_before())
                .await
            {
                Ok(true) => {
                    renewed += 1;
                    progress = true;
                }
                Ok(false) | Err(region_store::StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // A batch that renewed nothing (others did) ends the round: the next one looks again.
        if due.len() < 100 || !progress {
            return Ok(renewed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rcgen::{ExtendedKeyUsagePurpose, SanType};
    use rustls::client::danger::ServerCertVerifier;
    use rustls::client::WebPkiServerVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    use super::*;

    /// An endpoint certificate for `name` from `ca`.
    fn leaf(ca: &NewCa, name: &str) -> CertificateDer<'static> {
        let ca_key = KeyPair::from_pem(&ca.key_pem).unwrap();
        let issuer = CertificateParams::from_ca_cert_pem(&ca.cert_pem)
            .unwrap()
            .self_signed(&ca_key)
            .unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![match name.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(name.try_into().unwrap()),
        }];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        params
            .signed_by(&key, &issuer, &ca_key)
            .unwrap()
            .der()
            .clone()
    }

    /// Verifies `name`'s certificate from `ca` as a rustls client trusting only `ca` would.
    fn verify(ca: &NewCa, name: &str) -> Result<(), String> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap())
            .unwrap();
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        verifier
            .verify_server_cert(
                &leaf(ca, name),
                &[],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn policy(names: &[&str]) -> CaPolicy {
        CaPolicy {
            permitted_names: names.iter().map(|n| n.to_string()).collect(),
            ..CaPolicy::default()
        }
    }

    #[test]
    fn the_ca_signs_only_for_the_endpoints_addresses() {
        let ca = generate_with(
            Uuid::new_v4(),
            &policy(&["10.0.0.0/8", "203.0.113.7", "endpoints.example.test"]),
            SystemTime::now(),
        )
        .unwrap();
        for permitted in [
            "127.0.0.1",
            "127.9.8.7",
            "localhost",
            "10.1.2.3",
            "203.0.113.7",
            "endpoints.example.test",
            "abc.endpoints.example.test",
        ] {
            assert_eq!(verify(&ca, permitted), Ok(()), "{permitted}");
        }
        for outside in [
            "8.8.8.8",
            "203.0.113.8",
            "example.com",
            "api.digitalocean.com",
            "endpoints.example.test.evil.test",
        ] {
            let refused = verify(&ca, outside).expect_err(outside);
            assert!(
                refused.to_lowercase().contains("name constraint")
                    || refused.to_lowercase().contains("nameconstraint"),
                "{outside}: {refused}"
            );
        }
    }

    #[test]
    fn the_ca_expires_after_its_validity() {
        let now = SystemTime::now();
        let policy = CaPolicy {
            validity_days: 400,
            ..CaPolicy::default()
        };
        let ca = generate_with(Uuid::new_v4(), &policy, now).unwrap();
        let end = SystemTime::from(ca.not_after);
        assert_eq!(end, now + DAY * 400);
        // What the certificate says (rustls does not check a trust anchor's validity, OpenSSL
        // does; the worker keeps endpoint certificates inside it either way).
        let cert = CertificateParams::from_ca_cert_pem(&ca.cert_pem).unwrap();
        let seconds =
            |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
        assert_eq!(cert.not_after.unix_timestamp(), seconds(end));
        assert!(cert.not_before.unix_timestamp() <= seconds(now));
    }

    #[test]
    fn a_policy_is_checked() {
        assert!(CaPolicy::default().check().is_ok());
        assert!(
            policy(&["10.0.0.0/8", "::1/128", "203.0.113.7", "a.example"])
                .check()
                .is_ok()
        );
        for bad in ["10.0.0.0/33", "not a name", "a..b", "10.0.0.0/x"] {
            assert!(policy(&[bad]).check().is_err(), "{bad}");
        }
        let short_window = CaPolicy {
            renew_before_days: 100,
            ..CaPolicy::default()
        };
        assert!(short_window.check().is_err());
        let shorter_than_window = CaPolicy {
            validity_days: 300,
            ..CaPolicy::default()
        };
        assert!(shorter_than_window.check().is_err());
    }
}
