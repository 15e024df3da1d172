//! Block keys: the 64-bit names under which the index stores cached prefix blocks.
//!
//! Every key is chained: `key_i = xxh3_64(block_i, seed = key_{i-1})`, with `key_{-1}` a fixed
//! seed per key kind, so a key names a block *and everything before it*, and two prompts share
//! key `i` exactly when they share blocks `0..=i`. Only full blocks get keys: engines cache only
//! full blocks, and a partial block would change with every extra character.
//!
//! Two kinds, with different seeds so they can never collide in one index:
//! - **Token keys** ([`token_keys`]) over blocks of `block_size` token ids (as little-endian
//!   `u32`s). The same function keys the `token_ids` of vLLM's `BlockStored` events
//!   ([`chain_token_block`]), so the gateway scores requests with its own keys and never depends
//!   on the engine's hash algorithm or seed ("dual key"; the engine's hashes are only mapped to
//!   these for parents and removals).
//! - **Approximate keys** ([`TextKeys`]) over blocks of bytes of the prompt text, or of the chat
//!   messages serialized in order (the whole conversation), for endpoints without events or a
//!   tokenizer. The byte block is [`BYTES_PER_TOKEN`] x the token block size: English BPE text
//!   averages about 4 bytes per token, so one byte block covers about one engine block, and a
//!   byte-block match predicts roughly the tokens the engine will find cached.
//!
//! Keys are deterministic (no per-process randomness): every gateway replica computes the same
//! keys for the same prompt, which is what lets replicas agree without talking to each other.
//!
//! Keys live in a [`Space`]: the base model's, or one LoRA adapter's. An engine never reuses a
//! base block for an adapter request or one adapter's block for another (vLLM puts the adapter
//! name into every block's hash), so prefixes in different spaces must never match. A space is
//! a 64-bit mask XORed onto every key of the base chain: the same prefix gets a different key
//! per space, a key maps back to its chain by the same mask (events chain onto a stored
//! parent), and a view computed in the base space moves to an adapter's with [`Space::apply`].

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A chained block key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// Seed of the first token block ("pdcache/tokens" folded to 64 bits; any fixed value would do,
/// but it must never change: replicas and restarts must agree).
pub const TOKEN_SEED: u64 = 0x7064_6361_6368_6574;
/// Seed of the first text block ("pdcache/text").
pub const TEXT_SEED: u64 = 0x7064_6361_6368_7478;

/// Seed of an adapter's mask ("pdcache/lora").
const LORA_SEED: u64 = 0x7064_6361_6368_6c6f;

/// The key space of the base model or of one LoRA adapter: a mask XORed onto each key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Space {
    mask: u64,
}

impl Space {
    /// The base model's space (keys as chained).
    pub const BASE: Space = Space { mask: 0 };

    /// The space of LoRA adapter `name` (the name the engine serves it under, which is what
    /// vLLM hashes; two engines loading the same weights under different names share nothing).
    pub fn adapter(name: &str) -> Space {
        // Never the base mask, however unlikely a zero hash is.
        Space {
            mask: xxh3_64_with_seed(name.as_bytes(), LORA_SEED).max(1),
        }
    }

    /// The adapter's space, or the base space for `None`.
    pub fn of(adapter: Option<&str>) -> Space {
        adapter.map_or(Space::BASE, Space::adapter)
    }

    /// Moves base-space keys into this space (or this space's keys back to the base: the
    /// mask is its own inverse).
    pub fn apply(self, keys: &mut [BlockKey]) {
        if self.mask != 0 {
            for k in keys {
                k.0 ^= self.mask;
            }
        }
    }

    fn key(self, k: u64) -> BlockKey {
        BlockKey(k ^ self.mask)
    }
}

/// Bytes of text per token assumed when sizing approximate blocks.
pub const BYTES_PER_TOKEN: usize = 4;

/// The approximate block size in bytes for an engine block of `token_block_size` tokens.
pub fn text_block_bytes(token_block_size: usize) -> usize {
    token_block_size.max(1) * BYTES_PER_TOKEN
}

/// Key in `space` of one block of tokens chained onto `parent`, a key of the same space (`None`
/// for the first block). `extra` is the
/// block's extra hash keys as the engine sent them (LoRA, multimodal, cache salt): mixing them in
/// makes such a block unmatchable by a plain request with the same tokens, which is right, since
/// the engine will not reuse it for one either.
pub fn chain_token_block(
    space: Space,
    parent: Option<BlockKey>,
    block: &[u32],
    extra: Option<&[u8]>,
    scratch: &mut Vec<u8>,
) -> BlockKey {
    scratch.clear();
    scratch.reserve(block.len() * 4 + extra.map_or(0, <[u8]>::len));
    // Sized first, then filled in place: one copy the compiler can vectorize.
    scratch.resize(block.len() * 4, 0);
    for (b, t) in scratch.chunks_exact_mut(4).zip(block) {
        b.copy_from_slice(&t.to_le_bytes());
    }
    if let Some(extra) = extra {
        // A separator nobody can produce with whole u32 tokens: the byte length mod 4 differs.
        scratch.push(0xff);
        scratch.extend_from_slice(extra);
    }
    let seed = parent.map_or(TOKEN_SEED, |p| p.0 ^ space.mask);
    space.key(xxh3_64_with_seed(scratch, seed))
}

/// Keys in `space` of the full blocks of `tokens`, appended to `out`. `block_size` 0 yields
/// nothing.
pub fn token_keys_into(space: Space, tokens: &[u32], block_size: usize, out: &mut Vec<BlockKey>) {
    if block_size == 0 {
        return;
    }
    let mut scratch = Vec::with_capacity(block_size * 4);
    let mut parent = None;
    out.reserve(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let key = chain_token_block(space, parent, block, None, &mut scratch);
        out.push(key);
        parent = Some(key);
    }
}

/// Keys of the full blocks of `tokens` in the base space.
pub fn token_keys(tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    token_keys_in(Space::BASE, tokens, block_size)
}

/// Keys of the full blocks of `tokens` in `space`.
pub fn token_keys_in(space: Space, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut out = Vec::new();
    token_keys_into(space, tokens, block_size, &mut out);
    out
}

/// Approximate keys over a byte stream fed in pieces: the prompt text, or a conversation's
/// messages one after another ([`TextKeys::push_message`]). Only full blocks produce keys.
#[derive(Debug, Clone)]
pub struct TextKeys {
    space: Space,
    block_bytes: usize,
    partial: Vec<u8>,
    parent: u64,
    keys: Vec<BlockKey>,
}

impl TextKeys {
    /// Base-space keys for an engine whose blocks hold `token_block_size` tokens.
    pub fn new(token_block_size: usize) -> Self {
        Self::in_space(Space::BASE, token_block_size)
    }

    /// Keys in `space` for an engine whose blocks hold `token_block_size` tokens.
    pub fn in_space(space: Space, token_block_size: usize) -> Self {
        let block_bytes = text_block_bytes(token_block_size);
        Self {
            space,
            block_bytes,
            // Allocated when a piece straddles a block.
            partial: Vec::new(),
            parent: TEXT_SEED,
            keys: Vec::new(),
        }
    }

    /// Appends bytes to the stream.
    pub fn push(&mut self, mut bytes: &[u8]) {
        // Hash whole blocks straight from the input; copy only the pieces that straddle blocks.
        if !self.partial.is_empty() {
            let need = self.block_bytes - self.partial.len();
            let take = need.min(bytes.len());
            self.partial.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.partial.len() < self.block_bytes {
                return;
            }
            self.parent =
                chain_text_blocks(self.space, self.parent, [&self.partial[..]], &mut self.keys);
            self.partial.clear();
        }
        let mut blocks = bytes.chunks_exact(self.block_bytes);
        self.parent = chain_text_blocks(self.space, self.parent, &mut blocks, &mut self.keys);
        self.partial.extend_from_slice(blocks.remainder());
    }

    /// Appends one chat message: role, a unit separator, the content, a record separator. The
    /// separators keep `("ab", "c")` and `("a", "bc")` apart; the gateway passes the content as
    /// text (or, for structured content, its JSON as received).
    pub fn push_message(&mut self, role: &str, content: &[u8]) {
        self.push(role.as_bytes());
        self.push(&[0x1f]);
        self.push(content);
        self.push(&[0x1e]);
    }

    /// The keys of the full blocks so far.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// The keys of the full blocks; the trailing partial block is dropped.
    pub fn finish(self) -> Vec<BlockKey> {
        self.keys
    }
}

/// Base-space approximate keys of a plain prompt ([`text_keys_in`]).
pub fn text_keys(text: &[u8], token_block_size: usize) -> Vec<BlockKey> {
    text_keys_in(Space::BASE, text, token_block_size)
}

/// Approximate keys in `space` of a plain prompt: [`TextKeys`] fed `text` at once, without its
/// buffer.
pub fn text_keys_in(space: Space, text: &[u8], token_block_size: usize) -> Vec<BlockKey> {
    let blocks = text.chunks_exact(text_block_bytes(token_block_size));
    let mut keys = Vec::with_capacity(blocks.len());
    chain_text_blocks(space, TEXT_SEED, blocks, &mut keys);
    keys
}

/// Chains each of `blocks` (whole text blocks) onto `parent` (a base-space key), appending
/// their keys in `space` to `keys`; returns the last base-space key (`parent` when there are
/// none).
fn chain_text_blocks<'a>(
    space: Space,
    mut parent: u64,
    blocks: impl IntoIterator<Item = &'a [u8]>,
    keys: &mut Vec<BlockKey>,
) -> u64 {
    for block in blocks {
        parent = xxh3_64_with_seed(block, parent);
        keys.push(space.key(parent));
    }
    parent
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_get_keys() {
        assert_eq!(token_keys(&[1, 2, 3], 4), []);
        assert_eq!(token_keys(&[1, 2, 3, 4, 5], 4).len(), 1);
        assert_eq!(token_keys(&[1, 2, 3, 4], 0), []);
        assert_eq!(text_keys(&[b'x'; 63], 16), []);
        assert_eq!(text_keys(&[b'x'; 64 * 3 + 5], 16).len(), 3);
    }

    #[test]
    fn keys_chain_so_a_shared_key_means_a_shared_prefix() {
        let a = token_keys(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = token_keys(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[0], b[0]);
        assert_ne!(
            a[1], b[1],
            "the same second block after a different first one"
        );
        let c = token_keys(&[1, 2, 3, 4, 5, 6, 7, 9], 4);
        assert_eq!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn event_chaining_equals_request_keys() {
        // An event carrying blocks 1..3 with its parent's key yields the request's keys.
        let tokens: Vec<u32> = (0..12).collect();
        let all = token_keys(&tokens, 4);
        let mut scratch = Vec::new();
        let base = Space::BASE;
        let k1 = chain_token_block(base, Some(all[0]), &tokens[4..8], None, &mut scratch);
        let k2 = chain_token_block(base, Some(k1), &tokens[8..12], None, &mut scratch);
        assert_eq!([all[1], all[2]], [k1, k2]);
        let salted = chain_token_block(
            base,
            Some(all[0]),
            &tokens[4..8],
            Some(&[0x91, 0xc0]),
            &mut scratch,
        );
        assert_ne!(salted, k1, "extra keys make a different block");
    }

    #[test]
    fn text_is_independent_of_how_it_is_pushed() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let whole = text_keys(&text, 16);
        let mut pieces = TextKeys::new(16);
        for chunk in text.chunks(7) {
            pieces.push(chunk);
        }
        assert_eq!(pieces.finish(), whole);
        assert_eq!(whole.len(), 1000 / 64);
    }

    #[test]
    fn messages_are_separated_and_ordered() {
        let keys = |msgs: &[(&str, &str)]| {
            let mut k = TextKeys::new(1);
            for (role, content) in msgs {
                k.push_message(role, content.as_bytes());
            }
            k.finish()
        };
        let a = keys(&[("user", "hello there"), ("assistant", "hi")]);
        assert_ne!(a, keys(&[("user", "hello ther"), ("assistant", "ehi")]));
        assert_ne!(a, keys(&[("assistant", "hi"), ("user", "hello there")]));
        // A longer conversation extends the shorter one's keys.
        let longer = keys(&[
            ("user", "hello there"),
            ("assistant", "hi"),
            ("user", "more"),
        ]);
        assert_eq!(&longer[..a.len()], &a[..]);
    }

    #[test]
    fn adapter_spaces_share_no_prefix_with_the_base_or_each_other() {
        let tokens: Vec<u32> = (0..8).collect();
        let base = token_keys(&tokens, 4);
        let a = token_keys_in(Space::adapter("a"), &tokens, 4);
        let b = token_keys_in(Space::adapter("b"), &tokens, 4);
        assert_ne!(base[0], a[0]);
        assert_ne!(a[0], b[0]);
        assert_eq!(token_keys_in(Space::of(None), &tokens, 4), base);
        assert_eq!(token_keys_in(Space::of(Some("a")), &tokens, 4), a);
        let text = [b'x'; 64];
        assert_ne!(
            text_keys(&text, 4),
            text_keys_in(Space::adapter("a"), &text, 4)
        );
        let mut pushed = TextKeys::in_space(Space::adapter("a"), 4);
        pushed.push(&text);
        assert_eq!(pushed.finish(), text_keys_in(Space::adapter("a"), &text, 4));
        // Chained onto its own first key, an adapter's later block stays in its space.
        let mut moved = base.clone();
        Space::adapter("a").apply(&mut moved);
        assert_eq!(moved, a, "apply moves a base view into the space");
        let mut scratch = Vec::new();
        let k1 = chain_token_block(
            Space::adapter("a"),
            Some(a[0]),
            &tokens[4..8],
            None,
            &mut scratch,
        );
        assert_eq!(k1, a[1]);
    }

    #[test]
    fn token_and_text_keys_never_share_a_seed() {
        assert_ne!(TOKEN_SEED, TEXT_SEED);
        let bytes: Vec<u8> = [1u32, 2, 3, 4]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        assert_ne!(token_keys(&[1, 2, 3, 4], 4), text_keys(&bytes, 4));
    }
}
