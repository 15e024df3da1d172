//! vLLM's chained block hash with `--prefix-caching-hash-algo sha256_cbor`.
//!
//! `h_i = SHA-256(CBOR([h_{i-1}, [tokens of block i], null]))`, with `h_{-1}` =
//! `NONE_HASH` = SHA-256 of the CBOR text string `"vllm-none-hash"` (vLLM's seed
//! when `PYTHONHASHSEED` is unset). Only full blocks are hashed. KV events carry
//! the last 8 bytes of each digest read big-endian ([`event_value`]).
//!
//! Blocks of a LoRA request carry extra keys: vLLM's `generate_block_hash_extra_keys` makes
//! them a tuple of tagged keys, the adapter's first: `(("lora", lora_name, lora_path),)` (then
//! multimodal, cache-salt and prompt-embedding keys, which pdsim does not hash), so the third
//! element is a CBOR array of arrays of text instead of null ([`BlockHasher::block_with`],
//! [`lora_key`]). The path is in the key so that a name re-pointed at another adapter reuses no
//! KV. vLLM 0.32.0's `vllm/v1/core/kv_cache_utils.py` (`_gen_lora_extra_hash_keys`), checked
//! against block hashes a real vLLM 0.32.0 engine published
//! (`tests/fixtures/vllm-0.32-kv-events-lora.jsonl`). Its KV events carry the untagged form,
//! the bare name per block (`to_event_extra_keys`); older releases hashed the bare name too.
//!
//! The CBOR is written by hand: the shape is fixed (a 3-array of a 32-byte
//! string, an array of unsigned ints and null), canonical CBOR has one encoding
//! for it, and the hot path of an engine hashes every prompt block, so it should
//! not allocate a value tree per block.

use sha2::{Digest, Sha256};

/// A full 32-byte block digest.
pub type BlockDigest = [u8; 32];

/// The seed vLLM hashes when `PYTHONHASHSEED` is unset.
const NONE_SEED: &str = "vllm-none-hash";

/// Appends the CBOR head of major type `major` with argument `n` (shortest form).
fn head(buf: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    // Each arm's bound makes the narrowing casts exact.
    match n {
        0..=23 => buf.push(m | n as u8),
        24..=0xff => buf.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            buf.push(m | 25);
            buf.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            buf.push(m | 26);
            buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            buf.push(m | 27);
            buf.extend_from_slice(&n.to_be_bytes());
        }
    }
}

/// `NONE_HASH`: the parent of a sequence's first block.
pub fn none_hash() -> BlockDigest {
    let mut buf = Vec::with_capacity(NONE_SEED.len() + 1);
    head(&mut buf, 3, NONE_SEED.len() as u64);
    buf.extend_from_slice(NONE_SEED.as_bytes());
    Sha256::digest(&buf).into()
}

/// Reusable state for hashing many blocks without allocating per block.
#[derive(Debug, Default)]
pub struct BlockHasher {
    buf: Vec<u8>,
}

impl BlockHasher {
    /// The digest of one block of `tokens` chained onto `parent` (no extra keys).
    pub fn block(&mut self, parent: &BlockDigest, tokens: &[u32]) -> BlockDigest {
        self.block_with(parent, tokens, &[])
    }

    /// The digest of one block of `tokens` chained onto `parent`, with the extra keys `extra`
    /// (vLLM's tuple of tagged keys, each a tuple of text; empty = none, hashed as null). A
    /// LoRA block's are `[lora_key(name, path)]`.
    pub fn block_with(
        &mut self,
        parent: &BlockDigest,
        tokens: &[u32],
        extra: &[&[&str]],
    ) -> BlockDigest {
        let buf = &mut self.buf;
        buf.clear();
        head(buf, 4, 3);
        head(buf, 2, 32);
        buf.extend_from_slice(parent);
        head(buf, 4, tokens.len() as u64);
        for &t in tokens {
            head(buf, 0, u64::from(t));
        }
        if extra.is_empty() {
            // CBOR simple value null: vLLM's `extra_keys` of a block without LoRA, media or salt.
            buf.push(0xf6);
        } else {
            head(buf, 4, extra.len() as u64);
            for key in extra {
                head(buf, 4, key.len() as u64);
                for part in *key {
                    head(buf, 3, part.len() as u64);
                    buf.extend_from_slice(part.as_bytes());
                }
            }
        }
        Sha256::digest(buf.as_slice()).into()
    }

    /// The digests of every full block of `tokens`, chained from [`none_hash`].
    pub fn chain(&mut self, tokens: &[u32], block_size: usize) -> Vec<BlockDigest> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend(&none_hash(), tokens, block_size, &mut out);
        out
    }

    /// Appends the digests of every full block of `tokens` chained onto `parent`.
    pub fn extend(
        &mut self,
        parent: &BlockDigest,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<BlockDigest>,
    ) {
        self.extend_with(parent, tokens, block_size, &[], out);
    }

    /// [`BlockHasher::extend`] with the same extra keys on every block (a LoRA request's).
    pub fn extend_with(
        &mut self,
        parent: &BlockDigest,
        tokens: &[u32],
        block_size: usize,
        extra: &[&[&str]],
        out: &mut Vec<BlockDigest>,
    ) {
        if block_size == 0 {
            return;
        }
        let mut parent = *parent;
        for block in tokens.chunks_exact(block_size) {
            parent = self.block_with(&parent, block, extra);
            out.push(parent);
        }
    }
}

/// vLLM 0.32's extra hash key of a LoRA adapter's blocks: `("lora", name, path)`.
pub fn lora_key<'a>(name: &'a str, path: &'a str) -> [&'a str; 3] {
    ["lora", name, path]
}

/// The value a KV event carries for a digest: its last 8 bytes, big-endian.
pub fn event_value(digest: &BlockDigest) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(low)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `sha256_cbor` engine of the captured vLLM 0.32 events (block size 32).
    const FIXTURE: &str = include_str!("../tests/fixtures/vllm-0.32-kv-events.jsonl");

    fn stored(topic: &str) -> Vec<serde_json::Value> {
        FIXTURE
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|m| m["topic"] == topic)
            .flat_map(|m| m["decoded"][1].as_array().unwrap().clone())
            .filter(|e| e["type"] == "BlockStored")
            .collect()
    }

    #[test]
    fn reproduces_vllm_sha256_cbor_hashes() {
        let events = stored("kv@A@tiny");
        assert!(events.len() >= 2, "fixture has the chained stores");
        let mut h = BlockHasher::default();
        // Digests by event value, so a later event's parent can be found.
        let mut known: std::collections::HashMap<u64, BlockDigest> = Default::default();
        let mut checked = 0;
        for e in events {
            let bs = e["block_size"].as_u64().unwrap() as usize;
            let tokens: Vec<u32> = e["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let parent = match e["parent_block_hash"].as_u64() {
                None => none_hash(),
                Some(p) => *known.get(&p).expect("parent stored earlier"),
            };
            let mut got = Vec::new();
            h.extend(&parent, &tokens, bs, &mut got);
            let want: Vec<u64> = e["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            assert_eq!(got.iter().map(event_value).collect::<Vec<_>>(), want);
            for d in got {
                known.insert(event_value(&d), d);
                checked += 1;
            }
        }
        assert_eq!(checked, 5);
    }

    #[test]
    fn chain_hashes_full_blocks_only_and_depends_on_order() {
        let mut h = BlockHasher::default();
        let t: Vec<u32> = (0..40).collect();
        let c = h.chain(&t, 16);
        assert_eq!(c.len(), 2);
        assert_eq!(h.chain(&t[..32], 16), c);
        let mut swapped = t.clone();
        swapped.swap(0, 1);
        assert_ne!(
            h.chain(&swapped, 16)[1],
            c[1],
            "a change in block 0 changes block 1"
        );
        assert!(h.chain(&t[..15], 16).is_empty());
        assert!(h.chain(&t, 0).is_empty());
    }

    #[test]
    fn lora_blocks_hash_the_tagged_key() {
        let mut h = BlockHasher::default();
        let t: Vec<u32> = (0..4).collect();
        let parent = none_hash();
        // CBOR([bytes(32) parent, [0, 1, 2, 3], [["lora", "ad", "/p"]]]) written out independently.
        let mut want = vec![0x83, 0x58, 32];
        want.extend_from_slice(&parent);
        want.extend_from_slice(&[0x84, 0, 1, 2, 3, 0x81, 0x83]);
        want.extend_from_slice(&[
            0x64, b'l', b'o', b'r', b'a', 0x62, b'a', b'd', 0x62, b'/', b'p',
        ]);
        let want: BlockDigest = Sha256::digest(&want).into();
        let key = lora_key("ad", "/p");
        assert_eq!(h.block_with(&parent, &t, &[&key]), want);
        assert_ne!(h.block(&parent, &t), want, "the adapter changes the hash");
        assert_ne!(
            h.block_with(&parent, &t, &[&lora_key("ad", "/q")]),
            want,
            "so does its path"
        );
        assert_eq!(h.block_with(&parent, &t, &[]), h.block(&parent, &t));
        let mut chained = Vec::new();
        h.extend_with(&parent, &[t.clone(), t].concat(), 4, &[&key], &mut chained);
        assert_eq!(chained[0], want);
        assert_eq!(chained[1], h.block_with(&want, &[0, 1, 2, 3], &[&key]));
    }

    #[test]
    fn cbor_heads_use_the_shortest_form() {
        let mut b = Vec::new();
        for n in [0u64, 23, 24, 255, 256, 65535, 65536, 1 << 32] {
            head(&mut b, 0, n);
        }
        assert_eq!(
            b,
            [
                0x00, 0x17, 0x18, 24, 0x18, 255, 0x19, 1, 0, 0x19, 0xff, 0xff, 0x1a, 0, 1, 0, 0,
                0x1b, 0, 0, 0, 1, 0, 0, 0, 0
            ]
        );
    }
}
