//! The fake model's text: a deterministic completion derived only from the model, the prompt
//! and the length limits ([`generate`]), the word count that stands in for a tokenizer, and the
//! hash under which access tokens are stored. Pure functions, apart from the HTTP around them.

use sha2::{Digest, Sha256};

/// Whitespace-separated words: a stable stand-in for a tokenizer.
pub fn count_tokens(text: &str) -> u32 {
    text.split_whitespace().count() as u32
}

/// A deterministic completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Token texts; concatenated they form the completion.
    pub tokens: Vec<String>,
    /// `stop` when the "model" finished on its own, `length` when `max_tokens` cut it.
    pub finish_reason: &'static str,
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "answers",
    "with",
    "a",
    "simulated",
    "sentence",
    "about",
    "gpus",
    "and",
    "tokens",
    "streaming",
    "quickly",
    "from",
    "this",
    "region",
    "while",
    "prompts",
    "shape",
    "every",
    "reply",
    "deterministically",
    "so",
    "tests",
    "can",
    "compare",
    "outputs",
    "across",
    "runs",
    "inference",
    "gateway",
    "routes",
    "requests",
    "to",
    "ready",
    "pods",
    "behind",
    "an",
    "pool",
    "of",
    "accelerators",
    "serving",
    "language",
    "kernels",
    "cache",
    "prefix",
    "memory",
    "batch",
    "latency",
    "throughput",
    "cluster",
    "node",
    "load",
    "balancer",
    "endpoint",
    "secure",
    "private",
    "public",
    "control",
    "plane",
    "reconciles",
    "desired",
    "state",
    "today",
];

/// Output derived only from (model, prompt, max_tokens): same input, same output.
pub fn generate(model: &str, prompt: &str, max_tokens: Option<u32>) -> Generation {
    generate_at_least(model, prompt, max_tokens, 0)
}

/// As [`generate`], continuing the same word sequence up to `min_tokens` (vLLM's `min_tokens`,
/// or `max_tokens` with `ignore_eos`) when the answer would stop earlier.
pub fn generate_at_least(
    model: &str,
    prompt: &str,
    max_tokens: Option<u32>,
    min_tokens: u32,
) -> Generation {
    let digest = Sha256::digest(format!("{model}\n{prompt}").as_bytes());
    let mut seed = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    let natural = 8 + (seed % 25) as u32;
    let n = max_tokens.map_or(natural.max(min_tokens), |m| m.min(natural.max(min_tokens)));
    let mut tokens = Vec::with_capacity(n as usize);
    for i in 0..n {
        // splitmix64: cheap, stable across platforms and versions.
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let w = WORDS[(z % WORDS.len() as u64) as usize];
        tokens.push(if i == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        });
    }
    Generation {
        tokens,
        // Cut by max_tokens, or forced on to it.
        finish_reason: if n < natural || (n > natural && max_tokens == Some(n)) {
            "length"
        } else {
            "stop"
        },
    }
}

/// The lowercase hex SHA-256 of a token, as stored in the access-token Secret.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_bounded() {
        let a = generate("m", "hello world", None);
        assert_eq!(a, generate("m", "hello world", None));
        assert_ne!(a, generate("m", "hello there", None));
        assert_eq!(a.finish_reason, "stop");
        let b = generate("m", "hello world", Some(3));
        assert_eq!(b.tokens.len(), 3);
        assert_eq!(b.finish_reason, "length");
        assert_eq!(b.tokens[..], a.tokens[..3]);
    }
}
