//! AES-256-GCM sealing of secrets at rest (Hugging Face tokens, CA keys, replayable responses).
//!
//! A sealed value is `"DIS2" || key id (8 bytes) || nonce (12 bytes) || ciphertext+tag`. The key
//! id names the key that sealed it, so a [`Sealer`] holds several keys: it seals with the current
//! one and opens with whichever the value names. That is what lets an operator rotate the key:
//! configure the new one as current and the old one as an opening key, re-seal every stored
//! value ([`Sealer::reseal`]), then drop the old key. The associated data binds a value to the
//! row it belongs to, so a sealed value copied onto another row does not open.
//!
//! Values sealed before key ids existed are `nonce || ciphertext+tag`; they still open, with any
//! configured key, until a re-seal rewrites them.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 4] = b"DIS2";
const KEY_ID_LEN: usize = 8;
const NONCE_LEN: usize = 12;
/// What precedes the nonce in a value of the current format.
pub const PREFIX_LEN: usize = MAGIC.len() + KEY_ID_LEN;

#[derive(Clone)]
struct Key {
    id: [u8; KEY_ID_LEN],
    cipher: Aes256Gcm,
}

impl Key {
    fn from_base64(key_b64: &str) -> Result<Key, SealError> {
        let key = base64::engine::general_purpose::STANDARD
            .decode(key_b64.trim())
            .map_err(|_| SealError::BadKey)?;
        if key.len() != 32 {
            return Err(SealError::BadKey);
        }
        // Derived from the key, so that nobody has to name keys and two services given the same
        // key agree on its id. A hash, so the id says nothing about the key.
        let digest = Sha256::new()
            .chain_update(b"dedicated-inference seal key id\0")
            .chain_update(&key)
            .finalize();
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&digest[..KEY_ID_LEN]);
        Ok(Key {
            id,
            cipher: Aes256Gcm::new_from_slice(&key).map_err(|_| SealError::BadKey)?,
        })
    }

    fn open(&self, nonce_and_ciphertext: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        if nonce_and_ciphertext.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ciphertext) = nonce_and_ciphertext.split_at(NONCE_LEN);
        self.cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .ok()
    }
}

/// Seals with its current key; opens with any of its keys.
#[derive(Clone)]
pub struct Sealer {
    current: Key,
    /// Keys that open but never seal: the previous key while a rotation re-seals, or the next
    /// one while it reaches every service before it becomes current.
    others: Vec<Key>,
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("a sealing key must be 32 bytes, base64-encoded")]
    BadKey,
    #[error("sealed value could not be opened (wrong key or tampered)")]
    Open,
}

impl Sealer {
    /// `key_b64` is 32 random bytes in standard base64.
    pub fn from_base64(key_b64: &str) -> Result<Sealer, SealError> {
        Sealer::from_keys(key_b64, &[])
    }

    /// Seals with `current`; opens values sealed with it or with any of `others` (empty entries
    /// are ignored, so an unset list variable is no key).
    pub fn from_keys(current: &str, others: &[String]) -> Result<Sealer, SealError> {
        let current = Key::from_base64(current)?;
        let mut keys: Vec<Key> = Vec::new();
        for other in others.iter().filter(|k| !k.trim().is_empty()) {
            let key = Key::from_base64(other)?;
            if key.id != current.id && keys.iter().all(|k| k.id != key.id) {
                keys.push(key);
            }
        }
        Ok(Sealer {
            current,
            others: keys,
        })
    }

    /// A fresh random key, base64-encoded, for development set-ups and tests.
    pub fn generate_key() -> String {
        let mut key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut key);
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    /// The current key's id, in hex: what operators see in logs and in the re-seal report.
    pub fn key_id(&self) -> String {
        hex::encode(self.current.id)
    }

    /// How every value sealed under the current key begins: a store finds the values a
    /// rotation still has to re-seal by it.
    pub fn current_prefix(&self) -> Vec<u8> {
        [MAGIC.as_slice(), &self.current.id].concat()
    }

    pub fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::thread_rng().fill_bytes(&mut nonce);
        let ciphertext = self
            .current
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad,
                },
            )
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        let mut out = Vec::with_capacity(PREFIX_LEN + NONCE_LEN + ciphertext.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.current.id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ciphertext);
        out
    }

    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        let keys = || std::iter::once(&self.current).chain(&self.others);
        if let Some(rest) = sealed.strip_prefix(MAGIC.as_slice()) {
            if rest.len() >= KEY_ID_LEN {
                let (id, body) = rest.split_at(KEY_ID_LEN);
                if let Some(plain) = keys().find(|k| k.id == id).and_then(|k| k.open(body, aad)) {
                    return Ok(plain);
                }
            }
        }
        // A value from before key ids (whose random nonce may even begin like the current
        // format): whichever key sealed it.
        keys()
            .find_map(|k| k.open(sealed, aad))
            .ok_or(SealError::Open)
    }

    /// The value sealed again under the current key, or `None` when it already is.
    pub fn reseal(&self, sealed: &[u8], aad: &[u8]) -> Result<Option<Vec<u8>>, SealError> {
        if sealed.starts_with(&self.current_prefix()) && self.current_opens(sealed, aad) {
            return Ok(None);
        }
        Ok(Some(self.seal(&self.open(sealed, aad)?, aad)))
    }

    fn current_opens(&self, sealed: &[u8], aad: &[u8]) -> bool {
        self.current.open(&sealed[PREFIX_LEN..], aad).is_some()
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("key_id", &self.key_id())
            .field("opening_keys", &self.others.len())
            .finish()
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
        let good = Sealer::generate_key();
        assert!(Sealer::from_keys(&good, &["c2hvcnQ=".into()]).is_err());
    }

    #[test]
    fn a_sealed_value_names_its_key() {
        let key = Sealer::generate_key();
        let sealer = Sealer::from_base64(&key).unwrap();
        let sealed = sealer.seal(b"hf_secret", b"row-1");
        assert!(sealed.starts_with(&sealer.current_prefix()));
        assert_eq!(sealer.key_id().len(), 2 * KEY_ID_LEN);
        // The id is the key's, whoever derives it.
        assert_eq!(Sealer::from_base64(&key).unwrap().key_id(), sealer.key_id());
        let other = Sealer::from_base64(&Sealer::generate_key()).unwrap();
        assert_ne!(other.key_id(), sealer.key_id());
    }

    #[test]
    fn a_rotation_reseals_under_the_new_key_and_then_the_old_one_can_go() {
        let (old_key, new_key) = (Sealer::generate_key(), Sealer::generate_key());
        let old = Sealer::from_base64(&old_key).unwrap();
        let sealed = old.seal(b"ca-key", b"row-1");
        // Mid-rotation: the new key seals, the old one still opens.
        let rotating = Sealer::from_keys(&new_key, &[old_key.clone(), String::new()]).unwrap();
        assert_eq!(rotating.open(&sealed, b"row-1").unwrap(), b"ca-key");
        let resealed = rotating
            .reseal(&sealed, b"row-1")
            .unwrap()
            .expect("re-sealed");
        assert!(resealed.starts_with(&rotating.current_prefix()));
        assert!(
            rotating.reseal(&resealed, b"row-1").unwrap().is_none(),
            "a value under the current key is left alone: a re-seal can run again"
        );
        // The old key removed: the re-sealed value opens, the old one no longer does.
        let rotated = Sealer::from_base64(&new_key).unwrap();
        assert_eq!(rotated.open(&resealed, b"row-1").unwrap(), b"ca-key");
        assert!(rotated.open(&sealed, b"row-1").is_err());
        // A value the keys cannot open is an error, never silently rewritten.
        assert!(rotated.reseal(&sealed, b"row-1").is_err());
    }

    #[test]
    fn values_sealed_before_key_ids_still_open_and_reseal() {
        let key = Sealer::generate_key();
        let sealer = Sealer::from_base64(&key).unwrap();
        // The old format, as the previous version of this module wrote it.
        let legacy = {
            let mut nonce = [0u8; NONCE_LEN];
            rand::thread_rng().fill_bytes(&mut nonce);
            let mut out = nonce.to_vec();
            out.extend(
                sealer
                    .current
                    .cipher
                    .encrypt(
                        Nonce::from_slice(&nonce),
                        Payload {
                            msg: b"hf_old".as_slice(),
                            aad: b"row-1",
                        },
                    )
                    .unwrap(),
            );
            out
        };
        assert_eq!(sealer.open(&legacy, b"row-1").unwrap(), b"hf_old");
        // After a rotation the old key opens it as an opening key, and a re-seal upgrades it.
        let rotating = Sealer::from_keys(&Sealer::generate_key(), &[key]).unwrap();
        assert_eq!(rotating.open(&legacy, b"row-1").unwrap(), b"hf_old");
        let upgraded = rotating.reseal(&legacy, b"row-1").unwrap().unwrap();
        assert!(upgraded.starts_with(&rotating.current_prefix()));
        assert_eq!(rotating.open(&upgraded, b"row-1").unwrap(), b"hf_old");
    }
}
