//! Bearer token values: high-entropy random strings, stored only as SHA-256 (a slow hash buys
//! nothing for 190+ bits of entropy, and lookups stay one indexed query).

use rand::distributions::Alphanumeric;
use rand::Rng;
use sha2::{Digest, Sha256};

/// Access tokens for dedicated inference endpoints: `di_` + 40 base62 characters.
pub const ENDPOINT_TOKEN_PREFIX: &str = "di_";
/// API tokens for the control plane itself.
pub const API_TOKEN_PREFIX: &str = "dia_v1_";

pub fn mint(prefix: &str) -> String {
    let body: String = rand::thread_rng()
        .sample_iter(&Alphanumeric)
        .take(40)
        .map(char::from)
        .collect();
    format!("{prefix}{body}")
}

pub fn sha256(value: &str) -> [u8; 32] {
    Sha256::digest(value.as_bytes()).into()
}

pub fn sha256_hex(value: &str) -> String {
    hex::encode(sha256(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_tokens_have_the_documented_shape() {
        let a = mint(ENDPOINT_TOKEN_PREFIX);
        let b = mint(ENDPOINT_TOKEN_PREFIX);
        assert_ne!(a, b);
        assert!(a.starts_with("di_"));
        assert_eq!(a.len(), 43);
        assert!(a[3..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_eq!(sha256_hex(&a).len(), 64);
    }
}
