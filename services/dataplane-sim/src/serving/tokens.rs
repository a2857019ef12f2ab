//! Tokens and blocks: the fake tokenizer (one token per whitespace-separated word), the
//! chained hashes of full KV blocks (vLLM's automatic prefix caching) and stable pseudo-random
//! draws. Shared by the engine and the endpoint picker, which hashes prompts the same way.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Token ids of a text: one per whitespace-separated word.
pub fn tokenize(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|w| fnv(FNV_OFFSET, w.as_bytes()))
        .collect()
}

/// The tokens of a rendered chat prompt (`role: content` lines) with the generation prompt.
pub fn chat_tokens(rendered: &str) -> Vec<u64> {
    let mut t = tokenize(rendered);
    t.extend(tokenize("assistant:"));
    t
}

/// Hashes of the full `block`-token blocks of `tokens`, each chained over its prefix.
pub fn block_hashes(tokens: &[u64], block: usize) -> Vec<u64> {
    let block = block.max(1);
    let mut prev = FNV_OFFSET;
    tokens
        .chunks_exact(block)
        .map(|c| {
            let mut h = fnv(FNV_OFFSET, &prev.to_le_bytes());
            for t in c {
                h = fnv(h, &t.to_le_bytes());
            }
            prev = h;
            h
        })
        .collect()
}

/// A number in [0, 1) from `seed` (splitmix64): stable draws for the simulation.
pub fn unit_draw(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_chain_over_their_prefix() {
        let a = tokenize("one two three four five six seven eight");
        let b = tokenize("one two three four nine six seven eight");
        let ha = block_hashes(&a, 4);
        let hb = block_hashes(&b, 4);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "same block, other prefix");
        assert_eq!(block_hashes(&a[..7], 4).len(), 1, "only full blocks");
    }
}
