//! Bearer token values: high-entropy random strings, stored only as SHA-256 (a slow hash buys
//! nothing for 190+ bits of entropy, and lookups stay one indexed query).
//!
//! A minted value is a prefix, 40 random base62 characters and 6 base62 characters of the
//! CRC32 of those 40, as GitHub's token format has it. The checksum is no secret: it lets a
//! service refuse a made-up or mistyped value without a lookup, and a secret scanner recognise
//! a real token.

use rand::distributions::Alphanumeric;
use rand::Rng;
use sha2::{Digest, Sha256};

/// Access tokens for dedicated inference endpoints.
pub const ENDPOINT_TOKEN_PREFIX: &str = "di_";
/// API tokens for the control plane itself.
pub const API_TOKEN_PREFIX: &str = "dia_v2_";
/// API tokens minted before the checksum: `dia_v1_` and 40 base62 characters, nothing else.
/// Still accepted, so they are looked up; nothing mints them any more.
pub const LEGACY_API_TOKEN_PREFIX: &str = "dia_v1_";

const RANDOM_LEN: usize = 40;
const CHECKSUM_LEN: usize = 6;
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// CRC-32/ISO-HDLC, the CRC32 of zlib and Ethernet (Python's `zlib.crc32`).
const CRC32: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);

pub fn mint(prefix: &str) -> String {
    let random: String = rand::thread_rng()
        .sample_iter(&Alphanumeric)
        .take(RANDOM_LEN)
        .map(char::from)
        .collect();
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

/// Whether `value` has exactly the shape of an API token minted before the checksum.
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
    let mut n = CRC32.checksum(random.as_bytes());
    let mut digits = [b'0'; CHECKSUM_LEN];
    for digit in digits.iter_mut().rev() {
        *digit = BASE62[(n % 62) as usize];
        n /= 62;
    }
    String::from_utf8(digits.to_vec()).expect("base62 is ASCII")
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
        assert_eq!(a.len(), 3 + 40 + 6);
        assert!(a[3..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert!(well_formed(ENDPOINT_TOKEN_PREFIX, &a));
        assert!(well_formed(API_TOKEN_PREFIX, &mint(API_TOKEN_PREFIX)));
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
        let token = mint(API_TOKEN_PREFIX);
        let mut forged = token.clone().into_bytes();
        let i = API_TOKEN_PREFIX.len() + 5;
        forged[i] = if forged[i] == b'a' { b'b' } else { b'a' };
        let forged = String::from_utf8(forged).unwrap();
        assert!(!well_formed(API_TOKEN_PREFIX, &forged));
        // Another prefix, a missing or an extra character: not this format either.
        assert!(!well_formed(ENDPOINT_TOKEN_PREFIX, &token));
        assert!(!well_formed(API_TOKEN_PREFIX, &token[..token.len() - 1]));
        assert!(!well_formed(API_TOKEN_PREFIX, &format!("{token}x")));
        assert!(!legacy_api_token_shape(&token));
    }

    #[test]
    fn legacy_api_tokens_are_recognised_by_their_exact_shape() {
        let legacy = format!("{LEGACY_API_TOKEN_PREFIX}{}", "aZ09".repeat(10));
        assert!(legacy_api_token_shape(&legacy));
        assert!(!legacy_api_token_shape(&legacy[..legacy.len() - 1]));
        assert!(!legacy_api_token_shape(&format!("{legacy}a")));
        assert!(!legacy_api_token_shape(&legacy.replace('Z', "-")));
        assert!(!well_formed(API_TOKEN_PREFIX, &legacy));
    }
}
