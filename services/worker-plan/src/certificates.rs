//! The endpoint's TLS certificate, issued from the DI's own CA (the one `GET …/ca` returns), and
//! the check that keeps an unchanged spec from reissuing it.
//!
//! Subject alternative names: the names given (DNS names or IP addresses) plus `localhost` and
//! `127.0.0.1`, so local clients can verify the endpoint too (the CA's name constraints always
//! permit them). Valid for [`VALIDITY`], never beyond its CA; reissued once less than
//! [`RENEW_BEFORE`] remains.
//!
//! While a DI's CA is renewed it has two; [`signing_ca`] picks the issuer so that customers get
//! notice: the old CA signs while it can still cover a whole certificate, then the new one.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;
use x509_parser::extensions::GeneralName;

use super::manifests::TlsPair;
use super::model::PlanError;

pub const VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum San {
    Dns(String),
    Ip(IpAddr),
}

fn wanted(names: &[String]) -> BTreeSet<San> {
    names
        .iter()
        .map(String::as_str)
        .chain(["localhost", "127.0.0.1"])
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => San::Ip(ip),
            Err(_) => San::Dns(n.trim_end_matches('.').to_ascii_lowercase()),
        })
        .collect()
}

fn err(e: impl std::fmt::Display) -> PlanError {
    PlanError::Certificate(e.to_string())
}

/// Which of a DI's CAs (given by when each ends, as the store lists them) signs its endpoint
/// certificate at `now`: the one that ends first among those that outlast a whole [`VALIDITY`]
/// from now, else the one that ends last. So during a renewal the old CA, which customers
/// already trust, keeps signing until 90 days before its end, and the new one (in `GET …/ca`
/// since the renewal) takes over then. `None` without CAs.
pub fn signing_ca(ends: &[SystemTime], now: SystemTime) -> Option<usize> {
    let covering = ends
        .iter()
        .enumerate()
        .filter(|(_, end)| **end >= now + VALIDITY)
        .min_by_key(|(_, end)| **end);
    covering
        .or_else(|| ends.iter().enumerate().max_by_key(|(_, end)| **end))
        .map(|(i, _)| i)
}

/// Issues a server certificate for `names` signed by the CA (`ca_cert_pem`, `ca_key_pem`), valid
/// from an hour before `now` for [`VALIDITY`] or until the CA expires, whichever comes first (a
/// certificate must not outlive its issuer). Generates a fresh key pair.
pub fn issue(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    names: &[String],
    now: SystemTime,
) -> Result<TlsPair, PlanError> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(err)?;
    let ca_params = CertificateParams::from_ca_cert_pem(ca_cert_pem).map_err(err)?;
    let ca_not_after = ca_params.not_after;
    let ca = ca_params.self_signed(&ca_key).map_err(err)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    params.subject_alt_names = wanted(names)
        .into_iter()
        .map(|s| match s {
            San::Ip(ip) => Ok(SanType::IpAddress(ip)),
            San::Dns(d) => d.try_into().map(SanType::DnsName).map_err(err),
        })
        .collect::<Result<_, _>>()?;
    params
        .distinguished_name
        .push(DnType::CommonName, "Dedicated Inference endpoint");
    params.is_ca = IsCa::NoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let now = OffsetDateTime::from(now);
    params.not_before = now - Duration::from_secs(3600);
    params.not_after = (now + VALIDITY).min(ca_not_after);
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, &ca, &ca_key).map_err(err)?;
    Ok(TlsPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// True when `existing_cert_pem` must be replaced: it does not parse, was not signed by the CA,
/// covers other names than `names` (plus the local ones), or has less than [`RENEW_BEFORE`]
/// left at `now`. False for a certificate [`issue`] made with the same CA and names, so a
/// second pass writes nothing.
pub fn needs_reissue(
    existing_cert_pem: &str,
    ca_cert_pem: &str,
    names: &[String],
    now: SystemTime,
) -> bool {
    !still_good(existing_cert_pem, ca_cert_pem, names, now).unwrap_or(false)
}

fn still_good(existing: &str, ca: &str, names: &[String], now: SystemTime) -> Option<bool> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(existing.as_bytes()).ok()?;
    let cert = pem.parse_x509().ok()?;
    let (_, ca_pem) = x509_parser::pem::parse_x509_pem(ca.as_bytes()).ok()?;
    let ca = ca_pem.parse_x509().ok()?;
    if cert.issuer() != ca.subject() || cert.verify_signature(Some(ca.public_key())).is_err() {
        return Some(false);
    }
    let mut have = BTreeSet::new();
    if let Some(ext) = cert.subject_alternative_name().ok()? {
        for n in &ext.value.general_names {
            match n {
                GeneralName::DNSName(d) => {
                    have.insert(San::Dns(d.to_ascii_lowercase()));
                }
                GeneralName::IPAddress(b) => {
                    let ip = match b.len() {
                        4 => IpAddr::from(<[u8; 4]>::try_from(*b).ok()?),
                        16 => IpAddr::from(<[u8; 16]>::try_from(*b).ok()?),
                        _ => return Some(false),
                    };
                    have.insert(San::Ip(ip));
                }
                _ => return Some(false),
            }
        }
    }
    if have != wanted(names) {
        return Some(false);
    }
    let not_after = cert.validity().not_after.timestamp();
    let renew_at = OffsetDateTime::from(now + RENEW_BEFORE).unix_timestamp();
    let not_before = cert.validity().not_before.timestamp();
    let now = OffsetDateTime::from(now).unix_timestamp();
    // One that ends with its CA is as good as a new one would be: reissuing it on every pass
    // would change nothing.
    let ends_with_ca = not_after >= ca.validity().not_after.timestamp();
    Some((not_after > renew_at || ends_with_ca) && not_before <= now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::BasicConstraints;

    fn ca() -> (String, String) {
        ca_until(None)
    }

    /// A CA valid until `not_after` (rcgen's default, the year 4096, without).
    fn ca_until(not_after: Option<SystemTime>) -> (String, String) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        if let Some(end) = not_after {
            params.not_after = end.into();
        }
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params
            .distinguished_name
            .push(DnType::CommonName, "Test DI CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn names() -> Vec<String> {
        vec!["abc-private.example.test".into(), "10.0.0.7".into()]
    }

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    #[test]
    fn issued_certificate_chains_to_the_ca_with_local_names() {
        let (ca_cert, ca_key) = ca();
        let tls = issue(&ca_cert, &ca_key, &names(), t0()).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(tls.cert_pem.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        let (_, ca_pem) = x509_parser::pem::parse_x509_pem(ca_cert.as_bytes()).unwrap();
        let ca = ca_pem.parse_x509().unwrap();
        assert!(cert.verify_signature(Some(ca.public_key())).is_ok());
        assert_eq!(cert.issuer(), ca.subject());
        let sans = format!(
            "{:?}",
            cert.subject_alternative_name().unwrap().unwrap().value
        );
        for n in ["localhost", "abc-private.example.test"] {
            assert!(sans.contains(n), "{sans}");
        }
        assert!(sans.contains("[127, 0, 0, 1]"), "{sans}");
        assert!(sans.contains("[10, 0, 0, 7]"), "{sans}");
        assert!(KeyPair::from_pem(&tls.key_pem).is_ok());
    }

    #[test]
    fn unchanged_input_needs_no_reissue() {
        let (ca_cert, ca_key) = ca();
        let tls = issue(&ca_cert, &ca_key, &names(), t0()).unwrap();
        assert!(!needs_reissue(&tls.cert_pem, &ca_cert, &names(), t0()));
        // Order, case and the local names given explicitly make no difference.
        let mut same = names();
        same.reverse();
        same.push("LOCALHOST".into());
        same.push("127.0.0.1".into());
        assert!(!needs_reissue(&tls.cert_pem, &ca_cert, &same, t0()));
    }

    #[test]
    fn new_names_other_ca_garbage_or_expiry_reissue() {
        let (ca_cert, ca_key) = ca();
        let tls = issue(&ca_cert, &ca_key, &names(), t0()).unwrap();
        let mut more = names();
        more.push("203.0.113.9".into());
        assert!(needs_reissue(&tls.cert_pem, &ca_cert, &more, t0()));
        assert!(needs_reissue(&tls.cert_pem, &ca_cert, &names()[..1], t0()));
        let (other_ca, _) = ca();
        assert!(needs_reissue(&tls.cert_pem, &other_ca, &names(), t0()));
        assert!(needs_reissue("not a certificate", &ca_cert, &names(), t0()));
        let later = t0() + VALIDITY - RENEW_BEFORE + Duration::from_secs(1);
        assert!(needs_reissue(&tls.cert_pem, &ca_cert, &names(), later));
        let earlier = t0() + VALIDITY - RENEW_BEFORE - Duration::from_secs(3600);
        assert!(!needs_reissue(&tls.cert_pem, &ca_cert, &names(), earlier));
    }

    #[test]
    fn a_certificate_never_outlives_its_ca() {
        let end = t0() + Duration::from_secs(10 * 24 * 3600);
        let (ca_cert, ca_key) = ca_until(Some(end));
        let tls = issue(&ca_cert, &ca_key, &names(), t0()).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(tls.cert_pem.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        assert_eq!(
            cert.validity().not_after.timestamp(),
            OffsetDateTime::from(end).unix_timestamp()
        );
        // It cannot get any better, so it is not reissued on every pass.
        assert!(!needs_reissue(&tls.cert_pem, &ca_cert, &names(), t0()));
    }

    #[test]
    fn the_old_ca_signs_while_it_can_cover_a_whole_certificate() {
        let day = Duration::from_secs(24 * 3600);
        let (old, new) = (t0() + 200 * day, t0() + 1000 * day);
        // During the overlap the old one, which customers trust already, in either order.
        assert_eq!(signing_ca(&[old, new], t0()), Some(0));
        assert_eq!(signing_ca(&[new, old], t0()), Some(1));
        // Once less than a whole certificate's validity is left, the new one.
        assert_eq!(signing_ca(&[old, new], old - VALIDITY + day), Some(1));
        // Alone and ending soon (renewal has not run yet), it still signs.
        assert_eq!(signing_ca(&[old], old - day), Some(0));
        assert_eq!(signing_ca(&[], t0()), None);
    }

    #[test]
    fn bad_ca_is_an_error() {
        assert!(matches!(
            issue("nope", "nope", &names(), t0()),
            Err(PlanError::Certificate(_))
        ));
    }
}
