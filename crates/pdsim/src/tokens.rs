//! A tiny deterministic tokenizer and text generator.
//!
//! Every role uses the same functions, so a decode recomputes exactly the
//! prompt token count and digest its prefill saw.

/// Running digest and length of a token sequence (FNV-1a over token bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PromptTokens {
    /// Number of tokens, including one begin-of-sequence token.
    pub count: u32,
    /// Digest of the token sequence; stands in for the prompt's KV.
    pub digest: u64,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Accumulates tokens from text pieces or token ids.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tokenizer {
    count: u32,
    digest: u64,
}

impl Tokenizer {
    /// A sequence holding only the begin-of-sequence token.
    pub fn new() -> Self {
        let mut t = Tokenizer {
            count: 0,
            digest: FNV_OFFSET,
        };
        t.push_bytes(b"<s>");
        t
    }

    fn push_bytes(&mut self, token: &[u8]) {
        let mut h = self.digest;
        for &b in token {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
        // Separator so that "ab" "c" and "a" "bc" differ.
        h ^= 0xff;
        self.digest = h.wrapping_mul(FNV_PRIME);
        self.count = self.count.saturating_add(1);
    }

    /// Whitespace-separated words are tokens.
    pub fn push_text(&mut self, text: &str) {
        for word in text.split_ascii_whitespace() {
            self.push_bytes(word.as_bytes());
        }
    }

    /// A token id is one token.
    pub fn push_id(&mut self, id: u64) {
        self.push_bytes(&id.to_le_bytes());
    }

    /// The finished sequence.
    pub fn finish(self) -> PromptTokens {
        PromptTokens {
            count: self.count,
            digest: self.digest,
        }
    }
}

const WORDS: [&str; 32] = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs",
    "far", "away", "into", "green", "hills", "where", "rivers", "meet", "under", "bright", "blue",
    "skies", "while", "birds", "sing", "soft", "songs", "of", "summer", "end",
];

/// The generated word at position `index` of choice `choice` for a prompt digest.
pub(crate) fn word(digest: u64, choice: u32, index: u32) -> &'static str {
    let mix = digest
        .wrapping_add(u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(u64::from(choice).wrapping_mul(0xc2b2_ae3d_27d4_eb4f));
    let mix = (mix ^ (mix >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mix = mix ^ (mix >> 32);
    // The modulo keeps the value below WORDS.len(), so the cast cannot truncate.
    WORDS[(mix % WORDS.len() as u64) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> PromptTokens {
        let mut t = Tokenizer::new();
        t.push_text(s);
        t.finish()
    }

    #[test]
    fn counts_words_plus_bos() {
        assert_eq!(text("").count, 1);
        assert_eq!(text("hello   world\n").count, 3);
    }

    #[test]
    fn digest_depends_on_boundaries_and_order() {
        assert_eq!(text("a b").digest, text(" a  b ").digest);
        assert_ne!(text("ab c").digest, text("a bc").digest);
        assert_ne!(text("a b").digest, text("b a").digest);
    }

    #[test]
    fn words_are_deterministic_and_varied() {
        let d = text("x").digest;
        assert_eq!(word(d, 0, 3), word(d, 0, 3));
        let distinct: std::collections::HashSet<_> = (0..64).map(|i| word(d, 0, i)).collect();
        assert!(distinct.len() > 8);
    }
}
