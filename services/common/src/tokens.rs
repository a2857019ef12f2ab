//! Bearer token values: high-entropy random strings, stored only as SHA-256 (a slow hash buys
//! nothing for 190+ bits of entropy, and lookups stay one indexed query).
//!
//! An endpoint token is a prefix, 40 random base62 characters and 6 base62 characters of the
//! CRC32 of those 40, as GitHub's token format has it: no secret, it lets a secret scanner
//! recognise a real token and a typo be refused without a lookup.
//!
//! An API token ([`ApiTokenKey`]) carries a MAC instead: 14 base62 characters of an HMAC-SHA256
//! of the prefix and the random part under central's own key. Only central mints and checks
//! them, so a value it did not mint is refused without a database query, however well it is
//! shaped (a CRC anyone can compute; a MAC nobody can without the key).

use base64::Engine;
use hmac::{Hmac, Mac};
use rand::distributions::Alphanumeric;
use rand::Rng;
use sha2::{Digest, Sha256};

/// Access tokens for dedicated inference endpoints.
pub const ENDPOINT_TOKEN_PREFIX: &str = "di_";
/// API tokens for the control plane itself (see [`ApiTokenKey`]).
pub const API_TOKEN_PREFIX: &str = "dia_v3_";
/// API tokens minted before the MAC: `dia_v1_` and 40 base62 characters, nothing else. Still
/// accepted, so they are looked up (within budgets); nothing mints them any more.
pub const LEGACY_API_TOKEN_PREFIX: &str = "dia_v1_";

const RANDOM_LEN: usize = 40;
const CHECKSUM_LEN: usize = 6;
/// Base62 digits of the MAC: 10 bytes (80 bits) of it.
const MAC_LEN: usize = 14;
const MAC_BYTES: usize = 10;
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// CRC-32/ISO-HDLC, the CRC32 of zlib and Ethernet (Python's `zlib.crc32`).
const CRC32: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);

fn random_part() -> String {
    rand::thread_rng()
        .sample_iter(&Alphanumeric)
        .take(RANDOM_LEN)
        .map(char::from)
        .collect()
}

/// A value of `prefix` with a CRC32 checksum (endpoint tokens).
pub fn mint(prefix: &str) -> String {
    let random = random_part();
    let checksum = checksum(&random);
    format!("{prefix}{random}{checksum}")
}

/// Whether `value` is `prefix`, 40 base62 characters and their checksum, as [`mint`] makes them.
pub fn well_formed(prefix: &str, value: &str) -> bool {
    let Some(rest) = value.strip_prefix(prefix) else {
        return false;
    };
    rest.len() == RANDOM_LEN + CHECKSUM_LEN
        && rest.bytes().all(|b| b.is_ascii_alphanumeric())
        && checksum(&rest[..RANDOM_LEN]) == rest[RANDOM_LEN..]
}

/// Whether `value` has exactly the shape of an API token minted before the MAC.
pub fn legacy_api_token_shape(value: &str) -> bool {
    value
        .strip_prefix(LEGACY_API_TOKEN_PREFIX)
        .is_some_and(|rest| {
            rest.len() == RANDOM_LEN && rest.bytes().all(|b| b.is_ascii_alphanumeric())
        })
}

/// The CRC32 of `random` in base62, most significant digit first, padded with `0` to 6 (62^6 >
/// 2^32).
fn checksum(random: &str) -> String {
    base62(u128::from(CRC32.checksum(random.as_bytes())), CHECKSUM_LEN)
}

/// `n` in `len` base62 digits, most significant first, padded with `0`.
fn base62(mut n: u128, len: usize) -> String {
    let mut digits = vec![b'0'; len];
    for digit in digits.iter_mut().rev() {
        *digit = BASE62[(n % 62) as usize];
        n /= 62;
    }
    String::from_utf8(digits).expect("base62 is ASCII")
}

/// Central's key for minting and checking API tokens (`API_TOKEN_KEY`, 32 random bytes in
/// base64). Changing it invalidates every API token it minted.
#[derive(Clone)]
pub struct ApiTokenKey([u8; 32]);

impl ApiTokenKey {
    pub fn from_base64(key: &str) -> anyhow::Result<ApiTokenKey> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(key.trim())
            .map_err(|_| anyhow::anyhow!("the API token key is not base64"))?;
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|_| anyhow::anyhow!("the API token key is not 32 bytes"))?;
        Ok(ApiTokenKey(key))
    }

    /// A new random key, in the form [`ApiTokenKey::from_base64`] reads.
    pub fn generate() -> String {
        let key: [u8; 32] = rand::thread_rng().gen();
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    fn mac(&self, prefix_and_random: &str) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key size");
        mac.update(prefix_and_random.as_bytes());
        mac
    }

    /// A new API token: [`API_TOKEN_PREFIX`], 40 random base62 characters, and their MAC.
    pub fn mint(&self) -> String {
        let body = format!("{API_TOKEN_PREFIX}{}", random_part());
        let tag = self.mac(&body).finalize().into_bytes();
        format!("{body}{}", base62(mac_number(&tag[..MAC_BYTES]), MAC_LEN))
    }

    /// Whether `value` is an API token this key minted (compared in constant time).
    pub fn minted(&self, value: &str) -> bool {
        let Some(rest) = value.strip_prefix(API_TOKEN_PREFIX) else {
            return false;
        };
        if rest.len() != RANDOM_LEN + MAC_LEN || !rest.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return false;
        }
        let (body, shown) = value.split_at(API_TOKEN_PREFIX.len() + RANDOM_LEN);
        let Some(shown) = from_base62(shown).filter(|n| *n < 1u128 << (8 * MAC_BYTES)) else {
            return false;
        };
        let shown = shown.to_be_bytes();
        self.mac(body)
            .verify_truncated_left(&shown[16 - MAC_BYTES..])
            .is_ok()
    }
}

fn mac_number(bytes: &[u8]) -> u128 {
    bytes.iter().fold(0u128, |n, b| (n << 8) | u128::from(*b))
}

fn from_base62(digits: &str) -> Option<u128> {
    digits.bytes().try_fold(0u128, |n, d| {
        let v = BASE62.iter().position(|b| *b == d)? as u128;
        n.checked_mul(62)?.checked_add(v)
    })
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
    fn minted_endpoint_tokens_have_the_documented_shape() {
        let a = mint(ENDPOINT_TOKEN_PREFIX);
        let b = mint(ENDPOINT_TOKEN_PREFIX);
        assert_ne!(a, b);
        assert!(a.starts_with("di_"));
        assert_eq!(a.len(), 3 + 40 + 6);
        assert!(a[3..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert!(well_formed(ENDPOINT_TOKEN_PREFIX, &a));
        assert_eq!(sha256_hex(&a).len(), 64);
    }

    #[test]
    fn the_checksum_is_the_crc32_of_the_random_part_in_base62() {
        // zlib.crc32(b"123456789") == 0xCBF43926 == 3421780262 == "3jZRME" in base62.
        assert_eq!(checksum("123456789"), "3jZRME");
        assert_eq!(checksum(""), "000000");
    }

    #[test]
    fn a_changed_character_breaks_the_checksum() {
        let token = mint(ENDPOINT_TOKEN_PREFIX);
        let mut forged = token.clone().into_bytes();
        let i = ENDPOINT_TOKEN_PREFIX.len() + 5;
        forged[i] = if forged[i] == b'a' { b'b' } else { b'a' };
        let forged = String::from_utf8(forged).unwrap();
        assert!(!well_formed(ENDPOINT_TOKEN_PREFIX, &forged));
        assert!(!well_formed(
            ENDPOINT_TOKEN_PREFIX,
            &token[..token.len() - 1]
        ));
        assert!(!well_formed(ENDPOINT_TOKEN_PREFIX, &format!("{token}x")));
    }

    #[test]
    fn api_tokens_carry_a_mac_only_their_key_makes() {
        let key = ApiTokenKey::from_base64(&ApiTokenKey::generate()).unwrap();
        let token = key.mint();
        assert!(token.starts_with(API_TOKEN_PREFIX));
        assert_eq!(token.len(), API_TOKEN_PREFIX.len() + 40 + 14);
        assert!(key.minted(&token));
        // Another key, a changed character anywhere, a cut or an extra one: not minted here.
        let other = ApiTokenKey::from_base64(&ApiTokenKey::generate()).unwrap();
        assert!(!other.minted(&token));
        for i in API_TOKEN_PREFIX.len()..token.len() {
            let mut forged = token.clone().into_bytes();
            forged[i] = if forged[i] == b'a' { b'b' } else { b'a' };
            assert!(!key.minted(&String::from_utf8(forged).unwrap()), "at {i}");
        }
        assert!(!key.minted(&token[..token.len() - 1]));
        assert!(!key.minted(&format!("{token}a")));
        assert!(!key.minted("dia_v3_"));
        assert!(!key.minted("dia_v3_\u{e9}\u{e9}"));
        // A MAC of the right shape but too large a number, and the legacy shape: no.
        assert!(!key.minted(&format!("{}{}", &token[..token.len() - 14], "z".repeat(14))));
        assert!(!legacy_api_token_shape(&token));
    }

    #[test]
    fn legacy_api_tokens_are_recognised_by_their_exact_shape() {
        let legacy = format!("{LEGACY_API_TOKEN_PREFIX}{}", "aZ09".repeat(10));
        assert!(legacy_api_token_shape(&legacy));
        assert!(!legacy_api_token_shape(&legacy[..legacy.len() - 1]));
        assert!(!legacy_api_token_shape(&format!("{legacy}a")));
    }
}
