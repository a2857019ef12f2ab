//! Each dedicated inference gets its own certificate authority at create time: `GET …/ca` returns
//! its certificate, and the workers issue the endpoints' TLS certificates from it.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use region_store::NewCa;
use uuid::Uuid;

pub fn generate(id: Uuid) -> Result<NewCa, rcgen::Error> {
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
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(NewCa {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}
