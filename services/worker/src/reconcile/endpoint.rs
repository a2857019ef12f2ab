//! The DI's endpoint as a customer meets it: the tokens its gateway accepts, and the probe
//! that shows a customer's request would succeed.

use region_store::NewCa;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{Reconciler, Result};
use crate::plan::AccessTokenHash;

/// The entry of DI `di_id`'s probe token `value` among its access-token hashes.
///
/// Why a token of the DI's own rather than an unauthenticated health path: the probe must show
/// that a customer's request would succeed, through the load balancer, TLS, the token check,
/// the route and the endpoint picker to a model server, and a path that skips the token check
/// is a hole in every endpoint. Why not a key derived from the DI id with a region-wide secret
/// (as before): whoever holds that secret can mint the probe token of every DI, and no DI's can
/// be revoked without changing all of them. So each DI gets a random token, sealed in the
/// regional store (`Store::probe_token`), whose hash only that DI's gateway accepts; it is
/// rotated with `Store::probe_token_rotate` and deleted with the DI.
///
/// Its key in the Secret is fixed per DI (derived from the DI id), so a rotation replaces the
/// value in place and the customer's token ids never collide with it.
pub fn probe_token_hash(di_id: Uuid, value: &str) -> AccessTokenHash {
    let digest = Sha256::new()
        .chain_update(b"probe-token-id:")
        .chain_update(di_id.as_bytes())
        .finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    AccessTokenHash::from_value(uuid::Builder::from_random_bytes(b).into_uuid(), value)
}

/// The tokens the gateway must accept: the DI's live access tokens and the worker's probe token
/// of this DI.
pub(super) fn access_tokens(
    id: Uuid,
    hashes: Vec<(Uuid, String)>,
    probe_value: &str,
) -> Result<Vec<AccessTokenHash>> {
    let mut tokens: Vec<AccessTokenHash> = hashes
        .into_iter()
        .map(|(tid, hash)| AccessTokenHash::new(tid, &hash))
        .collect::<std::result::Result<_, _>>()?;
    tokens.push(probe_token_hash(id, probe_value));
    Ok(tokens)
}

impl Reconciler {
    /// The endpoint as a customer and an attacker meet it, trusting only the DI's CAs (as
    /// customers do with `GET …/ca`): `GET {url}/v1/models` answers 200 with the probe token,
    /// and 401 with no token, with a token nobody was given, and with the retired probe token
    /// (one it accepted before, if there is one). An endpoint that admits anyone is not
    /// serving as declared, whichever gateway runs it. Ok, or why not.
    pub(super) async fn probe(
        &self,
        url: &str,
        cas: &[NewCa],
        token: &str,
        retired: Option<&str>,
    ) -> std::result::Result<(), String> {
        let mut client = reqwest::Client::builder().tls_built_in_root_certs(false);
        for ca in cas {
            client = client.add_root_certificate(
                reqwest::Certificate::from_pem(ca.cert_pem.as_bytes())
                    .map_err(|e| e.to_string())?,
            );
        }
        let client = client
            .timeout(self.settings.probe_timeout)
            .build()
            .map_err(|e| e.to_string())?;
        let models = format!("{}/v1/models", url.trim_end_matches('/'));
        let status = |token: Option<String>| {
            let mut req = client.get(&models);
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            async move {
                req.send()
                    .await
                    .map(|r| r.status())
                    .map_err(|e| format!("not answering ({e})"))
            }
        };
        match status(Some(token.to_string())).await? {
            reqwest::StatusCode::OK => {}
            other => return Err(format!("answered {other}")),
        }
        // (what the request carries, the token if any); the retired one only if there is one.
        let refused = [
            Some(("no token", None)),
            Some(("a made-up token", Some(common::tokens::mint("di_")))),
            retired.map(|t| ("the retired probe token", Some(t.to_string()))),
        ];
        for (what, token) in refused.into_iter().flatten() {
            match status(token).await? {
                reqwest::StatusCode::UNAUTHORIZED => {}
                other => return Err(format!("answered {other} to a request with {what}")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_token_keeps_its_key_across_rotations_and_differs_per_di() {
        let di = Uuid::new_v4();
        let (old, new) = (
            probe_token_hash(di, "di_old"),
            probe_token_hash(di, "di_new"),
        );
        assert_eq!(old.id(), new.id(), "a rotation replaces the value in place");
        assert_ne!(old.sha256_hex(), new.sha256_hex());
        assert_eq!(old, AccessTokenHash::from_value(old.id(), "di_old"));
        assert_ne!(probe_token_hash(Uuid::new_v4(), "di_old").id(), old.id());
    }
}
