//! A tiny deterministic tokenizer and text generator, or a Hugging Face one.
//!
//! Every role uses the same functions, so a decode recomputes exactly the
//! prompt token ids, count and digest its prefill saw.

use std::sync::Arc;

use pdcache::tokenizer::HfTokenizer;

/// The token ids, length and digest of a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PromptTokens {
    /// Number of tokens, including one begin-of-sequence token.
    pub count: u32,
    /// Digest of the token sequence; stands in for the prompt's KV.
    pub digest: u64,
    /// The token ids (what the prefix cache hashes).
    pub ids: Vec<u32>,
}

/// The begin-of-sequence id of the deterministic tokenizer.
const BOS_ID: u32 = 1;
/// Ids below this are reserved for special tokens.
const FIRST_WORD_ID: u32 = 16;
/// Vocabulary size of the deterministic tokenizer (word ids are hashed into it).
const VOCAB: u32 = 65_536;

/// The deterministic tokenizer's id for a word: a hash into the vocabulary, so the same word
/// always gets the same id and generated text re-tokenizes to the ids it was made from.
pub(crate) fn word_id(word: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in word {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    FIRST_WORD_ID + h % (VOCAB - FIRST_WORD_ID)
}

/// Which tokenizer an engine uses.
#[derive(Debug, Clone)]
pub(crate) enum Tok {
    /// Whitespace-separated words, one id each (the default).
    Words,
    /// A Hugging Face `tokenizer.json` with its chat template.
    Hf(Arc<HfTokenizer>),
}

impl Tok {
    /// Token ids of generated words (the text a response carries, re-tokenized).
    pub fn generated_ids(&self, words: &[&str]) -> Vec<u32> {
        match self {
            Tok::Words => words.iter().map(|w| word_id(w.as_bytes())).collect(),
            Tok::Hf(t) => {
                let text: String = words.iter().flat_map(|w| [" ", w]).collect();
                t.encode_text(&text).unwrap_or_default()
            }
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Accumulates tokens from text pieces or token ids.
#[derive(Debug, Clone)]
pub(crate) struct Tokenizer {
    count: u32,
    digest: u64,
    ids: Vec<u32>,
}

impl Tokenizer {
    /// A sequence holding only the begin-of-sequence token.
    pub fn new() -> Self {
        let mut t = Tokenizer::empty();
        t.push_bytes(b"<s>");
        t.ids.push(BOS_ID);
        t
    }

    /// A sequence with no tokens at all (a Hugging Face tokenizer adds its own BOS).
    pub fn empty() -> Self {
        Tokenizer {
            count: 0,
            digest: FNV_OFFSET,
            ids: Vec::new(),
        }
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
            self.ids.push(word_id(word.as_bytes()));
        }
    }

    /// A token id is one token.
    pub fn push_id(&mut self, id: u64) {
        self.push_bytes(&id.to_le_bytes());
        self.ids.push(u32::try_from(id).unwrap_or(u32::MAX));
    }

    /// The finished sequence.
    pub fn finish(self) -> PromptTokens {
        PromptTokens {
            count: self.count,
            digest: self.digest,
            ids: self.ids,
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
    fn ids_follow_words_and_generated_text_retokenizes() {
        let p = text("hello world hello");
        assert_eq!(p.ids.len(), 4);
        assert_eq!(p.ids[0], BOS_ID);
        assert_eq!(p.ids[1], p.ids[3]);
        assert_ne!(p.ids[1], p.ids[2]);
        assert!(
            p.ids[1..]
                .iter()
                .all(|&i| (FIRST_WORD_ID..VOCAB).contains(&i))
        );
        assert_eq!(Tok::Words.generated_ids(&["hello", "world"]), p.ids[1..3]);
    }

    #[test]
    fn words_are_deterministic_and_varied() {
        let d = text("x").digest;
        assert_eq!(word(d, 0, 3), word(d, 0, 3));
        let distinct: std::collections::HashSet<_> = (0..64).map(|i| word(d, 0, i)).collect();
        assert!(distinct.len() > 8);
    }
}
