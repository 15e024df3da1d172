//! The engine's prefix cache, shaped like vLLM's block pool.
//!
//! Full blocks of `block_size` tokens are keyed by vLLM's chained `sha256_cbor`
//! hash (the u64 a KV event carries). A request pins the blocks it uses; when it
//! ends they join an LRU queue of unreferenced blocks, released in reverse so a
//! prompt's deepest block is evicted first (vLLM frees `reversed(blocks)`).
//! `capacity` bounds the cached blocks; inserting into a full cache evicts from
//! the LRU head and reports each evicted hash, and when every block is pinned
//! the new blocks are simply not cached. Lookup and insert are O(blocks).
//!
//! Under the step-loop engine model the cache is also the engine's KV memory: a running
//! request reserves the blocks it will fill ([`PrefixCache::reserve`]); pinned blocks plus
//! reservations never exceed `capacity`, unreferenced cached blocks are evicted to make room,
//! and the blocks it then caches draw from its reservation.

use std::collections::HashMap;

use pdcache::events::{BlockHash, BlockRemoved, BlockStored, KvEvent};
use pdcache::vllm_hash::{BlockDigest, BlockHasher, event_value, lora_key, none_hash};

use crate::lora::{Lora, Served};

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    hash: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// The full-block hashes of one token sequence, chained from the start.
#[derive(Debug, Default, Clone)]
pub(crate) struct BlockChain {
    digests: Vec<BlockDigest>,
    pub values: Vec<u64>,
    /// The adapter that salts every block, as vLLM's extra keys `(("lora", name, path),)`.
    lora: Served,
}

impl BlockChain {
    /// Hashes every full block of `tokens` (base model).
    #[cfg(test)]
    pub fn of(tokens: &[u32], block_size: usize) -> Self {
        Self::for_model(None, tokens, block_size)
    }

    /// Hashes every full block of `tokens` for the base model or adapter `lora`.
    pub fn for_model(lora: Served, tokens: &[u32], block_size: usize) -> Self {
        let mut c = BlockChain {
            lora,
            ..BlockChain::default()
        };
        c.extend(tokens, block_size);
        c
    }

    /// The adapter the blocks are hashed for.
    pub fn lora(&self) -> Option<&Lora> {
        self.lora.as_deref()
    }

    /// Hashes the full blocks of `tokens` beyond those already hashed.
    pub fn extend(&mut self, tokens: &[u32], block_size: usize) {
        if block_size == 0 {
            return;
        }
        let done = self.digests.len();
        let parent = self.digests.last().copied().unwrap_or_else(none_hash);
        let rest = tokens.get(done * block_size..).unwrap_or_default();
        let mut h = BlockHasher::default();
        let before = self.digests.len();
        let key = self.lora.as_ref().map(|l| lora_key(&l.name, &l.path));
        let extra = key.as_ref().map(|k| k.as_slice());
        h.extend_with(
            &parent,
            rest,
            block_size,
            extra.as_slice(),
            &mut self.digests,
        );
        self.values
            .extend(self.digests[before..].iter().map(event_value));
    }
}

/// One engine's cached blocks.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    pub block_size: usize,
    capacity: usize,
    map: HashMap<u64, u32>,
    nodes: Vec<Node>,
    vacant: Vec<u32>,
    head: u32,
    tail: u32,
    /// Bumped by [`PrefixCache::clear`].
    generation: u64,
    /// Blocks with at least one reference.
    pinned: usize,
    /// Blocks reserved by running requests and not yet cached.
    reserved: usize,
}

/// Blocks a request holds; give them back with [`PrefixCache::release`]. Tagged with the
/// cache generation, so pins taken before a reset are dropped, not released.
#[derive(Debug, Default)]
pub(crate) struct Pins {
    generation: u64,
    nodes: Vec<u32>,
    /// Blocks reserved for this request and not yet cached.
    reserved: usize,
}

impl PrefixCache {
    pub fn new(block_size: usize, capacity: usize) -> Self {
        PrefixCache {
            block_size,
            capacity,
            map: HashMap::with_capacity(capacity.min(1 << 20)),
            nodes: Vec::new(),
            vacant: Vec::new(),
            head: NIL,
            tail: NIL,
            generation: 0,
            pinned: 0,
            reserved: 0,
        }
    }

    /// Cached blocks now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = NIL;
    }

    fn push_tail(&mut self, i: u32) {
        let old = self.tail;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = old;
            n.next = NIL;
        }
        match old {
            NIL => self.head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.tail = i;
    }

    fn pin(&mut self, i: u32, pins: &mut Pins) {
        self.adopt(pins);
        if self.nodes[i as usize].refs == 0 {
            self.unlink(i);
            self.pinned += 1;
        }
        self.nodes[i as usize].refs += 1;
        pins.nodes.push(i);
    }

    fn adopt(&self, pins: &mut Pins) {
        if pins.generation != self.generation {
            pins.nodes.clear();
            pins.generation = self.generation;
        }
    }

    /// The longest cached prefix of `chain`, at most `max_blocks`, pinned into `pins`.
    pub fn lookup(&mut self, chain: &[u64], max_blocks: usize, pins: &mut Pins) -> usize {
        let mut hit = 0;
        for h in chain.iter().take(max_blocks) {
            let Some(&i) = self.map.get(h) else { break };
            self.pin(i, pins);
            hit += 1;
        }
        hit
    }

    /// Evicts the least recently used unreferenced block; its hash, or `None` if all are pinned.
    fn evict(&mut self) -> Option<u64> {
        let i = self.head;
        if i == NIL {
            return None;
        }
        self.unlink(i);
        let hash = self.nodes[i as usize].hash;
        self.map.remove(&hash);
        self.vacant.push(i);
        Some(hash)
    }

    /// Caches blocks `from..` of `chain` (tokens in `tokens`), pinning them; appends the
    /// events vLLM would publish: a `BlockRemoved` per eviction, then one `BlockStored` per
    /// run of new blocks.
    pub fn insert(
        &mut self,
        chain: &[u64],
        tokens: &[u32],
        from: usize,
        pins: &mut Pins,
        events: &mut Vec<KvEvent>,
    ) {
        let bs = self.block_size;
        let mut run: Option<usize> = None;
        let mut stores: Vec<(usize, usize)> = Vec::new();
        let mut end = chain.len();
        for (b, &h) in chain.iter().enumerate().skip(from) {
            if let Some(&i) = self.map.get(&h) {
                if let Some(s) = run.take() {
                    stores.push((s, b));
                }
                self.pin(i, pins);
                continue;
            }
            if pins.reserved > 0 {
                pins.reserved -= 1;
                self.reserved -= 1;
            }
            if self.map.len() + self.reserved >= self.capacity {
                match self.evict() {
                    Some(gone) => events.push(KvEvent::BlockRemoved(BlockRemoved::new(vec![
                        BlockHash::Uint(gone),
                    ]))),
                    None => {
                        // Every block is in use: the rest of this prompt stays uncached.
                        end = b;
                        break;
                    }
                }
            }
            let node = Node {
                hash: h,
                refs: 0,
                prev: NIL,
                next: NIL,
            };
            let i = match self.vacant.pop() {
                Some(i) => {
                    self.nodes[i as usize] = node;
                    i
                }
                None => {
                    self.nodes.push(node);
                    (self.nodes.len() - 1) as u32
                }
            };
            self.map.insert(h, i);
            self.nodes[i as usize].refs = 1;
            self.pinned += 1;
            self.adopt(pins);
            pins.nodes.push(i);
            run.get_or_insert(b);
        }
        if let Some(s) = run {
            stores.push((s, end));
        }
        for (s, e) in stores {
            let parent = s.checked_sub(1).map(|p| BlockHash::Uint(chain[p]));
            let hashes = chain[s..e].iter().map(|&h| BlockHash::Uint(h)).collect();
            let ids = tokens[s * bs..e * bs].to_vec();
            events.push(KvEvent::BlockStored(BlockStored::new(
                hashes, parent, ids, bs as u32,
            )));
        }
    }

    /// Unpins a request's blocks; unreferenced ones become evictable, deepest first.
    pub fn release(&mut self, pins: &mut Pins) {
        self.reserved -= pins.reserved.min(self.reserved);
        pins.reserved = 0;
        if pins.generation != self.generation {
            pins.nodes.clear();
            return;
        }
        for i in pins.nodes.drain(..).rev() {
            let n = &mut self.nodes[i as usize];
            n.refs = n.refs.saturating_sub(1);
            if n.refs == 0 {
                self.pinned -= 1;
                self.push_tail(i);
            }
        }
    }

    /// Reserves `n` more blocks for the request holding `pins`, evicting unreferenced blocks
    /// as needed; false (nothing reserved) when pinned and reserved blocks leave no room.
    /// Evictions are appended to `events` as `BlockRemoved`.
    pub fn reserve(&mut self, n: usize, pins: &mut Pins, events: &mut Vec<KvEvent>) -> bool {
        if self.pinned + self.reserved + n > self.capacity {
            return false;
        }
        while self.map.len() + self.reserved + n > self.capacity {
            match self.evict() {
                Some(gone) => events.push(KvEvent::BlockRemoved(BlockRemoved::new(vec![
                    BlockHash::Uint(gone),
                ]))),
                None => return false,
            }
        }
        self.reserved += n;
        pins.reserved += n;
        true
    }

    /// Blocks a request could still reserve (capacity minus pinned and reserved blocks).
    pub fn free(&self) -> usize {
        self.capacity.saturating_sub(self.pinned + self.reserved)
    }

    /// Drops every block (pins included: their requests' blocks are gone too). Reservations
    /// stay: their requests still run.
    pub fn clear(&mut self) {
        self.pinned = 0;
        self.map.clear();
        self.nodes.clear();
        self.vacant.clear();
        self.head = NIL;
        self.tail = NIL;
        self.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(ev: &[KvEvent]) -> Vec<Vec<u64>> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => {
                    Some(s.block_hashes.iter().map(BlockHash::as_u64).collect())
                }
                _ => None,
            })
            .collect()
    }

    fn removed(ev: &[KvEvent]) -> Vec<u64> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.block_hashes[0].as_u64()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hits_the_longest_prefix_and_stores_only_new_blocks() {
        let mut c = PrefixCache::new(4, 100);
        let t: Vec<u32> = (0..12).collect();
        let chain = BlockChain::of(&t, 4).values;
        let (mut p, mut ev) = (Pins::default(), Vec::new());
        assert_eq!(c.lookup(&chain, 2, &mut p), 0);
        c.insert(&chain, &t, 0, &mut p, &mut ev);
        assert_eq!(stored(&ev), vec![chain.clone()]);
        c.release(&mut p);
        let mut t2 = t[..8].to_vec();
        t2.extend([99, 98, 97, 96]);
        let chain2 = BlockChain::of(&t2, 4).values;
        assert_eq!(&chain2[..2], &chain[..2]);
        let (mut p, mut ev) = (Pins::default(), Vec::new());
        assert_eq!(c.lookup(&chain2, 2, &mut p), 2);
        c.insert(&chain2, &t2, 2, &mut p, &mut ev);
        match &ev[..] {
            [KvEvent::BlockStored(s)] => {
                assert_eq!(s.parent_block_hash, Some(BlockHash::Uint(chain[1])));
                assert_eq!(s.token_ids, [99, 98, 97, 96]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn evicts_unreferenced_deepest_first_and_never_pinned_blocks() {
        let mut c = PrefixCache::new(1, 3);
        let a = [1, 2, 3];
        let ca = BlockChain::of(&a, 1).values;
        let (mut p, mut ev) = (Pins::default(), Vec::new());
        c.insert(&ca, &a, 0, &mut p, &mut ev);
        c.release(&mut p);
        let b = [7, 8];
        let cb = BlockChain::of(&b, 1).values;
        let (mut p, mut ev) = (Pins::default(), Vec::new());
        c.insert(&cb, &b, 0, &mut p, &mut ev);
        // The deepest block of `a` goes first, then the next deepest.
        assert_eq!(removed(&ev), vec![ca[2], ca[1]]);
        assert_eq!(stored(&ev), vec![cb.clone()]);
        // b is pinned and only a[0] is free: a third prompt caches one block and stops.
        let d = [5, 6];
        let cd = BlockChain::of(&d, 1).values;
        let (mut p2, mut ev) = (Pins::default(), Vec::new());
        c.insert(&cd, &d, 0, &mut p2, &mut ev);
        assert_eq!(removed(&ev), vec![ca[0]]);
        assert_eq!(stored(&ev), vec![vec![cd[0]]]);
        assert_eq!(c.len(), 3);
        c.release(&mut p);
        c.release(&mut p2);
        let mut p3 = Pins::default();
        assert_eq!(c.lookup(&cb, 2, &mut p3), 2);
        c.clear();
        c.release(&mut p3);
        assert_eq!(c.lookup(&cb, 2, &mut p3), 0);
    }

    #[test]
    fn reservations_bound_pinned_blocks_and_evict_unreferenced_ones() {
        let mut c = PrefixCache::new(1, 4);
        let a = [1, 2];
        let ca = BlockChain::of(&a, 1).values;
        let (mut p, mut ev) = (Pins::default(), Vec::new());
        c.insert(&ca, &a, 0, &mut p, &mut ev);
        c.release(&mut p);
        // Two unreferenced cached blocks: a reservation of 3 evicts one of them.
        let (mut r, mut ev) = (Pins::default(), Vec::new());
        assert!(c.reserve(3, &mut r, &mut ev));
        assert_eq!(removed(&ev), vec![ca[1]]);
        assert_eq!(c.free(), 1);
        let (mut q, mut ev) = (Pins::default(), Vec::new());
        assert!(!c.reserve(2, &mut q, &mut ev), "3 reserved + 2 > 4");
        // Caching draws from the reservation: still one block free, nothing evicted.
        let b = [7, 8];
        let cb = BlockChain::of(&b, 1).values;
        let mut ev = Vec::new();
        c.insert(&cb, &b, 0, &mut r, &mut ev);
        assert!(removed(&ev).is_empty(), "{ev:?}");
        assert_eq!(c.free(), 1);
        c.release(&mut r);
        assert_eq!(c.free(), 4, "released: every block evictable again");
        assert!(c.reserve(4, &mut q, &mut ev));
        assert_eq!(c.len(), 0);
    }
}
