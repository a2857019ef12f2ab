//! AES-256-GCM sealing of secrets at rest (Hugging Face tokens, CA keys, replayable responses).
//! A sealed value is `nonce (12 bytes) || ciphertext+tag`; the associated data binds it to the row
//! it belongs to, so a sealed value copied onto another row does not open.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use rand::RngCore;

#[derive(Clone)]
pub struct Sealer {
    cipher: Aes256Gcm,
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("the sealing key must be 32 bytes, base64-encoded")]
    BadKey,
    #[error("sealed value could not be opened (wrong key or tampered)")]
    Open,
}

impl Sealer {
    /// `key_b64` is 32 random bytes in standard base64.
    pub fn from_base64(key_b64: &str) -> Result<Sealer, SealError> {
        let key = base64::engine::general_purpose::STANDARD
            .decode(key_b64.trim())
            .map_err(|_| SealError::BadKey)?;
        if key.len() != 32 {
            return Err(SealError::BadKey);
        }
        Ok(Sealer {
            cipher: Aes256Gcm::new_from_slice(&key).map_err(|_| SealError::BadKey)?,
        })
    }

    /// A fresh random key, base64-encoded, for development set-ups and tests.
    pub fn generate_key() -> String {
        let mut key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut key);
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    pub fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; 12];
        rand::thread_rng().fill_bytes(&mut nonce);
        let ciphertext = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad,
                },
            )
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        let mut out = Vec::with_capacity(12 + ciphertext.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ciphertext);
        out
    }

    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < 12 {
            return Err(SealError::Open);
        }
        let (nonce, ciphertext) = sealed.split_at(12);
        self.cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .map_err(|_| SealError::Open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_binding() {
        let sealer = Sealer::from_base64(&Sealer::generate_key()).unwrap();
        let sealed = sealer.seal(b"hf_secret", b"row-1");
        assert!(
            !sealed.windows(9).any(|w| w == b"hf_secret"),
            "plaintext must not appear"
        );
        assert_eq!(sealer.open(&sealed, b"row-1").unwrap(), b"hf_secret");
        assert!(sealer.open(&sealed, b"row-2").is_err(), "bound to its row");
        let other = Sealer::from_base64(&Sealer::generate_key()).unwrap();
        assert!(other.open(&sealed, b"row-1").is_err(), "bound to its key");
    }

    #[test]
    fn rejects_short_keys() {
        assert!(Sealer::from_base64("c2hvcnQ=").is_err());
    }
}
