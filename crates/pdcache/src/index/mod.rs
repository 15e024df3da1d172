//! The cache index of one model: which endpoint holds which block key, and for a request's keys
//! the longest consecutive prefix each endpoint holds.
//!
//! Entries come in three kinds:
//! - **precise**, from the endpoint's KV events (`BlockStored` / `BlockRemoved`); they carry the
//!   engine's hash, so removals and parents find them; they never expire;
//! - **approximate**, inserted per routing decision for endpoints without events; they expire
//!   after [`IndexConfig::approximate_ttl`] (about 120 s, as Dynamo's approximate router);
//! - **speculative**, inserted per routing decision for endpoints with events, to cover the lag
//!   until the confirming `BlockStored` arrives; they expire after
//!   [`IndexConfig::speculative_ttl`], and the event turns them precise.
//!
//! Each endpoint is bounded by [`IndexConfig::capacity_per_endpoint`] entries (or fewer, its
//! engine's size: [`CacheIndex::set_capacity`]), evicted least recently used first
//! (speculative, then approximate, then precise: guesses go before facts).
//!
//! # Layout
//! Built for matching a 256-block prompt against 1,000 endpoints and a million entries within a
//! few microseconds, and for staying under 64 bytes per entry:
//! - entries live in a chunked slab (40 bytes each, no doubling overhead), linked into
//!   per-endpoint, per-kind LRU lists by `u32` index;
//! - the *posting* table maps a key to the endpoints holding it: a short chain through the
//!   entries while few endpoints hold it, a bitmap of endpoint ids once more than [`WIDE_AT`] do
//!   (a shared system prompt on every endpoint), so a match step is one table probe plus either a
//!   few entry reads or a handful of 64-bit ANDs;
//! - matching walks the prompt's keys while the candidate set shrinks and stops when it is
//!   empty, instead of asking each endpoint; while few candidates remain it follows each one's
//!   entries through the slab (a prompt's entries for one endpoint are written together, at a
//!   fixed stride), looking a key up in the posting table only where that guess misses;
//! - the hash tables (`hashbrown::HashTable`) store only `u32` entry indices (4 bytes plus one
//!   control byte per slot) and compare through the slab, instead of duplicating keys;
//! - engine hash -> entry is one table per model keyed by (engine hash, endpoint).
//!
//! Time is passed in (`Instant`), so expiry is testable without sleeping; entries keep it as
//! 10 ms ticks in a `u32`, compared with wrapping arithmetic.

use std::time::{Duration, Instant};

use hashbrown::HashTable;

use crate::events::{BlockStored, EventBatch, ExtraKeys, KvEvent, MEDIUM_GPU};
use crate::keys::{BlockKey, Space, chain_token_block};

/// A key held by more than this many endpoints is tracked by a bitmap of endpoint ids.
pub const WIDE_AT: usize = 8;

const NIL: u32 = u32::MAX;
const WIDE_BIT: u32 = 1 << 31;
const CHUNK_SHIFT: u32 = 12;
const CHUNK: usize = 1 << CHUNK_SHIFT;
const TICK: Duration = Duration::from_millis(10);
/// Expiry sweeps run at most this often (ticks); between sweeps a match may still see entries
/// expired less than this long ago.
const SWEEP_EVERY: u32 = 10;

/// An endpoint of this index (dense, reused after [`CacheIndex::remove_endpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u16);

/// An index holds at most 65,536 endpoints at once (ids are `u16` to keep bitmaps and entries
/// small).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a model's cache index holds at most 65536 endpoints")]
pub struct TooManyEndpoints;

/// How an entry got into the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// Confirmed by the endpoint's KV events.
    Precise,
    /// Inserted by a routing decision, for an endpoint without events.
    Approximate,
    /// Inserted by a routing decision, until the endpoint's event confirms it.
    Speculative,
}

impl EntryKind {
    const ALL: [EntryKind; 3] = [
        EntryKind::Speculative,
        EntryKind::Approximate,
        EntryKind::Precise,
    ];

    fn slot(self) -> usize {
        match self {
            EntryKind::Speculative => 0,
            EntryKind::Approximate => 1,
            EntryKind::Precise => 2,
        }
    }

    fn from_slot(slot: u8) -> Self {
        match slot {
            0 => EntryKind::Speculative,
            1 => EntryKind::Approximate,
            _ => EntryKind::Precise,
        }
    }
}

/// Tunables of one model's index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexConfig {
    /// Most entries per endpoint; beyond it the least recently used go.
    pub capacity_per_endpoint: usize,
    /// Lifetime of approximate entries (refreshed when a decision inserts them again).
    pub approximate_ttl: Duration,
    /// Lifetime of speculative entries: longer than the event lag (p99 ~120 ms on busy vLLM).
    pub speculative_ttl: Duration,
    /// The KV cache group whose events count (hybrid models publish one per group; the prefix
    /// is decided by the full-attention group, 0 in vLLM's single-group models).
    pub group_idx: i64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            capacity_per_endpoint: 1 << 20,
            approximate_ttl: Duration::from_secs(120),
            speculative_ttl: Duration::from_secs(2),
            group_idx: 0,
        }
    }
}

/// One endpoint's consecutive-prefix match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// How many of the request's leading blocks it holds.
    pub blocks: u32,
}

/// Sizes for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Entries, all kinds.
    pub entries: usize,
    /// Entries confirmed by events.
    pub precise: usize,
    /// Entries from decisions, for endpoints without events.
    pub approximate: usize,
    /// Entries from decisions, not yet confirmed.
    pub speculative: usize,
    /// Distinct keys.
    pub keys: usize,
    /// Keys held by more than [`WIDE_AT`] endpoints.
    pub wide_keys: usize,
    /// Bytes allocated by the index (slab chunks, tables, bitmaps, endpoint records).
    pub bytes: usize,
}

/// What applying events did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Blocks stored (new or confirmed).
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Store events skipped because their parent block is unknown (evicted, or stored before
    /// this index started listening): their keys cannot be chained.
    pub orphaned: u64,
    /// Events for other groups or media, or malformed (tokens not matching hashes x size).
    pub ignored: u64,
    /// Whole-cache resets.
    pub cleared: u64,
}

impl ApplyStats {
    fn add(&mut self, o: ApplyStats) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.orphaned += o.orphaned;
        self.ignored += o.ignored;
        self.cleared += o.cleared;
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    /// Engine hash identity (`BlockHash::as_u64`); meaningful for precise entries only.
    engine: u64,
    prev: u32,
    /// LRU successor, or the free-list link of a free slot.
    next: u32,
    /// The next entry with the same key while the key is narrow.
    key_next: u32,
    /// Approximate and speculative entries: the tick they expire at. Precise entries: the tick
    /// they were last marked used (they never expire; see [`REFRESH_DIVISOR`]).
    expires: u32,
    endpoint: u16,
    /// [`EntryKind::slot`], or [`FREE_KIND`] for a free slot.
    kind: u8,
}

/// The kind of a free slot: no entry, whatever its other fields hold.
const FREE_KIND: u8 = u8::MAX;

const FREE_ENTRY: Entry = Entry {
    key: 0,
    engine: 0,
    prev: NIL,
    next: NIL,
    key_next: NIL,
    expires: 0,
    endpoint: 0,
    kind: FREE_KIND,
};

#[derive(Debug)]
struct Wide {
    key: u64,
    bits: Vec<u64>,
    count: u32,
}

#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: u32,
}

const EMPTY_LIST: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

#[derive(Debug, Clone, Copy)]
struct Endpoint {
    live: bool,
    lists: [List; 3],
    /// Entries removed so far (wrapping): a decision's memo of what it wrote holds while this
    /// is unchanged.
    removals: u32,
    /// Its cache is full: the engine evicted a block (`BlockRemoved`) or its entries reached
    /// its capacity, since it was added or last cleared.
    full: bool,
    /// Entries kept for it: `capacity_per_endpoint`, or less where its engine's size is known
    /// ([`CacheIndex::set_capacity`]).
    capacity: usize,
}

/// Where a key's endpoints are.
#[derive(Clone, Copy)]
enum Posting<'a> {
    Narrow(u32),
    Wide(&'a Wide),
}

/// Where a key's posting stands, as a caller inserting entries of the key knows it.
#[derive(Clone, Copy)]
enum Link {
    /// The key has no posting.
    New,
    /// A narrow chain with this head (new entries go right after it).
    After(u32),
    /// Unknown, or a bitmap: look it up.
    Lookup,
}

impl Link {
    fn of(p: Posting<'_>) -> Self {
        match p {
            Posting::Narrow(head) => Link::After(head),
            Posting::Wide(_) => Link::Lookup,
        }
    }
}

/// The cache index of one model.
#[derive(Debug)]
pub struct CacheIndex {
    config: IndexConfig,
    /// The approximate and speculative TTLs in ticks (a `Duration` to ticks is a 128-bit
    /// division, per entry written otherwise).
    ttls: [u32; 2],
    epoch: Instant,
    seed: u64,
    slab: Slab,
    posting: HashTable<u32>,
    wides: Vec<Wide>,
    free_wides: Vec<u32>,
    /// (key, endpoint) -> entry, for entries of wide keys (narrow ones are found on the chain).
    wide_entries: HashTable<u32>,
    /// (engine hash, endpoint) -> precise entry.
    engine: HashTable<u32>,
    endpoints: Vec<Endpoint>,
    /// By endpoint id: what its last decision wrote (see `decisions.rs`).
    written: Vec<Written>,
    free_endpoints: Vec<u16>,
    counts: [usize; 3],
    last_sweep: u32,
    scratch: Vec<u8>,
}

fn folded(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

fn bit(bits: &[u64], ep: u16) -> bool {
    bits.get(usize::from(ep) / 64)
        .is_some_and(|w| (w >> (ep % 64)) & 1 == 1)
}

fn expired(expires: u32, now: u32) -> bool {
    (now.wrapping_sub(expires) as i32) >= 0
}

impl CacheIndex {
    /// An empty index; `epoch` is any instant not after the first `now` passed in.
    pub fn new(config: IndexConfig, epoch: Instant) -> Self {
        // Keys are public functions of prompt text; a per-process seed in the table hash keeps
        // crafted prompts from piling into one bucket. It never leaves the process, so replicas
        // still agree on keys.
        let seed = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0x5eed);
            h.finish() | 1
        };
        Self {
            ttls: [
                Self::ttl_ticks(config.approximate_ttl),
                Self::ttl_ticks(config.speculative_ttl),
            ],
            config,
            epoch,
            seed,
            slab: Slab::new(),
            posting: HashTable::new(),
            wides: Vec::new(),
            free_wides: Vec::new(),
            wide_entries: HashTable::new(),
            engine: HashTable::new(),
            endpoints: Vec::new(),
            written: Vec::new(),
            free_endpoints: Vec::new(),
            counts: [0; 3],
            last_sweep: 0,
            scratch: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    fn ticks(&self, now: Instant) -> u32 {
        // Milliseconds / 10 without the 128-bit division of `as_millis`.
        const PER_SEC: u64 = 1000 / TICK.as_millis() as u64;
        let d = now.saturating_duration_since(self.epoch);
        (d.as_secs().wrapping_mul(PER_SEC)
            + u64::from(d.subsec_millis()) / (TICK.as_millis() as u64)) as u32
    }

    fn ttl_ticks(d: Duration) -> u32 {
        u32::try_from(d.as_millis() / TICK.as_millis())
            .unwrap_or(u32::MAX / 2)
            .min(u32::MAX / 2)
    }

    fn h1(&self, key: u64) -> u64 {
        folded(key ^ self.seed, 0x9e37_79b9_7f4a_7c15)
    }

    fn h2(&self, key: u64, ep: u16) -> u64 {
        folded(
            key ^ self.seed,
            0x9e37_79b9_7f4a_7c15 ^ (u64::from(ep) << 1),
        )
    }

    // --- endpoints ----------------------------------------------------------------------------

    /// Registers an endpoint; ids of removed endpoints are reused.
    pub fn add_endpoint(&mut self) -> Result<EndpointId, TooManyEndpoints> {
        let fresh = Endpoint {
            live: true,
            lists: [EMPTY_LIST; 3],
            removals: 0,
            full: false,
            capacity: self.config.capacity_per_endpoint,
        };
        if let Some(id) = self.free_endpoints.pop() {
            self.endpoints[usize::from(id)] = fresh;
            self.written[usize::from(id)] = Written::NONE;
            return Ok(EndpointId(id));
        }
        let id = u16::try_from(self.endpoints.len()).map_err(|_| TooManyEndpoints)?;
        self.endpoints.push(fresh);
        self.written.push(Written::NONE);
        Ok(EndpointId(id))
    }

    /// Forgets an endpoint (it left discovery): its entries go, its id may be reused.
    pub fn remove_endpoint(&mut self, ep: EndpointId) {
        if self.live(ep) {
            self.clear_endpoint(ep);
            self.endpoints[usize::from(ep.0)].live = false;
            self.free_endpoints.push(ep.0);
        }
    }

    fn live(&self, ep: EndpointId) -> bool {
        self.endpoints
            .get(usize::from(ep.0))
            .is_some_and(|e| e.live)
    }

    /// Drops every entry of an endpoint (its cache is gone or unknown: sequence restart,
    /// `AllBlocksCleared`, a gap that could not be replayed).
    pub fn clear_endpoint(&mut self, ep: EndpointId) {
        if !self.live(ep) {
            return;
        }
        for kind in EntryKind::ALL {
            while let Some(i) = self.tail(ep, kind) {
                self.remove_entry(i);
            }
        }
        self.endpoints[usize::from(ep.0)].full = false;
    }

    /// Bounds an endpoint's entries by its engine's size, `entries` (at least 1): the lower of
    /// that and `capacity_per_endpoint`. Approximate mode then models the engine's capacity
    /// without the configuration naming it: where the bound is lowered below what the endpoint
    /// holds, its least recently used entries go now and it counts as full.
    pub fn set_capacity(&mut self, ep: EndpointId, entries: usize) {
        if !self.live(ep) {
            return;
        }
        let capacity = entries.clamp(1, self.config.capacity_per_endpoint);
        let e = &mut self.endpoints[usize::from(ep.0)];
        if e.capacity != capacity {
            e.capacity = capacity;
            self.evict_over_capacity(ep.0);
        }
    }

    /// An endpoint's bound on entries (see [`CacheIndex::set_capacity`]).
    pub fn capacity(&self, ep: EndpointId) -> usize {
        self.endpoints
            .get(usize::from(ep.0))
            .map_or(self.config.capacity_per_endpoint, |e| e.capacity)
    }

    /// Evicts `ep`'s least recently used entries (speculative, then approximate, then precise)
    /// until it holds no more than its capacity; whether any went.
    fn evict_over_capacity(&mut self, ep: u16) -> bool {
        let mut evicted = false;
        while self.endpoint_len(EndpointId(ep)) > self.endpoints[usize::from(ep)].capacity {
            let victim = EntryKind::ALL
                .iter()
                .find_map(|&k| self.tail(EndpointId(ep), k));
            let Some(v) = victim else { break };
            self.remove_entry(v);
            self.endpoints[usize::from(ep)].full = true;
            evicted = true;
        }
        evicted
    }

    /// Whether an endpoint's cache is full, so that storing new blocks there evicts cached
    /// ones: its engine reported an eviction (`BlockRemoved`), or its entries reached its
    /// capacity (approximate mode models an engine's size so: [`CacheIndex::set_capacity`]),
    /// since it was added or last cleared.
    pub fn is_full(&self, ep: EndpointId) -> bool {
        self.endpoints
            .get(usize::from(ep.0))
            .is_some_and(|e| e.live && e.full)
    }

    /// Entries of one endpoint.
    pub fn endpoint_len(&self, ep: EndpointId) -> usize {
        self.endpoints
            .get(usize::from(ep.0))
            .filter(|e| e.live)
            .map_or(0, |e| e.lists.iter().map(|l| l.len as usize).sum())
    }

    fn tail(&self, ep: EndpointId, kind: EntryKind) -> Option<u32> {
        let t = self.endpoints[usize::from(ep.0)].lists[kind.slot()].tail;
        (t != NIL).then_some(t)
    }

    // --- entries ------------------------------------------------------------------------------

    fn remove_entry(&mut self, i: u32) {
        let e = *self.slab.get(i);
        let owner = &mut self.endpoints[usize::from(e.endpoint)];
        owner.removals = owner.removals.wrapping_add(1);
        self.posting_remove(i);
        self.unlink(i);
        if e.kind == EntryKind::Precise.slot() as u8 {
            self.engine_remove(i);
        }
        self.counts[usize::from(e.kind)] -= 1;
        self.slab.release(i);
    }

    fn ttl_of(&self, kind: EntryKind) -> u32 {
        match kind {
            EntryKind::Precise => 0,
            EntryKind::Approximate => self.ttls[0],
            EntryKind::Speculative => self.ttls[1],
        }
    }

    /// Inserts or refreshes (key, endpoint). A kind never downgrades: a decision's insert on a
    /// precise entry only marks it recently used.
    fn upsert(&mut self, ep: u16, key: u64, kind: EntryKind, engine: u64, now: u32) {
        if kind == EntryKind::Precise
            && let Some(old) = self.engine_find(engine, ep)
        {
            if self.slab.get(old).key == key {
                // The same block again: the entry the engine hash names is (key, endpoint).
                self.touch(old, kind, engine, now);
                return;
            }
            // The engine re-used a hash for other tokens (or we missed its removal): the old
            // entry is stale.
            self.remove_entry(old);
        }
        let Some(p) = self.posting(key) else {
            self.insert_new(ep, key, kind, engine, now, Link::New);
            return;
        };
        match self.find_in(p, key, ep) {
            Some(i) => self.touch(i, kind, engine, now),
            None => {
                let link = Link::of(p);
                self.insert_new(ep, key, kind, engine, now, link);
            }
        }
    }

    /// Refreshes entry `i` for a new sighting of `kind` (see [`CacheIndex::upsert`]).
    fn touch(&mut self, i: u32, kind: EntryKind, engine: u64, now: u32) {
        let ttl = self.ttl_of(kind);
        let old = *self.slab.get(i);
        let old_kind = EntryKind::from_slot(old.kind);
        let new_kind = if old_kind == EntryKind::Precise || kind == EntryKind::Precise {
            EntryKind::Precise
        } else if old_kind == EntryKind::Approximate || kind == EntryKind::Approximate {
            EntryKind::Approximate
        } else {
            EntryKind::Speculative
        };
        if new_kind == EntryKind::Approximate && kind == EntryKind::Speculative {
            // A speculative touch on an approximate entry changes nothing: moving it to the
            // front without extending its life would break the list's expiry order.
            return;
        }
        self.unlink(i);
        if old_kind == EntryKind::Precise && kind == EntryKind::Precise && old.engine != engine {
            self.engine_remove(i);
        }
        let e = self.slab.get_mut(i);
        e.kind = new_kind.slot() as u8;
        if new_kind == EntryKind::Precise {
            e.expires = now;
            if kind == EntryKind::Precise {
                e.engine = engine;
            }
        } else {
            e.expires = now.wrapping_add(ttl);
        }
        if new_kind != old_kind {
            self.counts[old_kind.slot()] -= 1;
            self.counts[new_kind.slot()] += 1;
        }
        self.link_front(i);
        if kind == EntryKind::Precise && (old_kind != EntryKind::Precise || old.engine != engine) {
            self.engine_insert(i);
        }
    }

    /// A new entry (key, endpoint), evicting the endpoint's least recently used beyond capacity.
    /// `link`: where the key's posting stands, as the caller just saw it; returns where it
    /// stands now, for another endpoint's new entry of the same key.
    fn insert_new(
        &mut self,
        ep: u16,
        key: u64,
        kind: EntryKind,
        engine: u64,
        now: u32,
        link: Link,
    ) -> Link {
        let ttl = self.ttl_of(kind);
        let i = self.slab.alloc(Entry {
            key,
            engine: if kind == EntryKind::Precise {
                engine
            } else {
                0
            },
            prev: NIL,
            next: NIL,
            key_next: NIL,
            expires: if kind == EntryKind::Precise {
                now
            } else {
                now.wrapping_add(ttl)
            },
            endpoint: ep,
            kind: kind.slot() as u8,
        });
        self.counts[kind.slot()] += 1;
        let mut next = match link {
            Link::New => {
                self.posting_insert_new(i);
                Link::After(i)
            }
            Link::After(head) => {
                if self.posting_after(head, i) {
                    Link::After(head)
                } else {
                    // It just became a bitmap.
                    Link::Lookup
                }
            }
            Link::Lookup => {
                self.posting_add(i);
                Link::Lookup
            }
        };
        self.link_front(i);
        if kind == EntryKind::Precise {
            self.engine_insert(i);
        }
        if self.evict_over_capacity(ep) {
            // The chain's head may be what went.
            next = Link::Lookup;
        }
        next
    }

    /// Records that a routing decision sent `keys` to `ep`, for an endpoint without KV events.
    pub fn insert_approximate(&mut self, ep: EndpointId, keys: &[BlockKey], now: Instant) {
        self.insert_decision(ep, keys, EntryKind::Approximate, now);
    }

    /// Records that a routing decision sent `keys` to `ep`, an endpoint with KV events, until its
    /// events confirm them.
    pub fn insert_speculative(&mut self, ep: EndpointId, keys: &[BlockKey], now: Instant) {
        self.insert_decision(ep, keys, EntryKind::Speculative, now);
    }

    fn insert_decision(
        &mut self,
        ep: EndpointId,
        keys: &[BlockKey],
        kind: EntryKind,
        now: Instant,
    ) {
        self.insert_decisions(&[(ep, kind)], keys, now);
    }

    /// Drops expired approximate and speculative entries. Cheap when nothing expired, and rate
    /// limited; decisions and events call it, a quiet index needs it called now and then.
    pub fn expire(&mut self, now: Instant) {
        let t = self.ticks(now);
        if t.wrapping_sub(self.last_sweep) < SWEEP_EVERY && self.last_sweep != 0 {
            return;
        }
        self.last_sweep = t.max(1);
        for ep in 0..self.endpoints.len() {
            if !self.endpoints[ep].live {
                continue;
            }
            for kind in [EntryKind::Speculative, EntryKind::Approximate] {
                while let Some(i) = self.tail(EndpointId(ep as u16), kind) {
                    if !expired(self.slab.get(i).expires, t) {
                        break;
                    }
                    self.remove_entry(i);
                }
            }
        }
    }

    // --- events -------------------------------------------------------------------------------

    /// Applies one batch of an endpoint's KV events, in order.
    pub fn apply_batch(&mut self, ep: EndpointId, batch: &EventBatch, now: Instant) -> ApplyStats {
        let mut stats = ApplyStats::default();
        if !self.live(ep) {
            stats.ignored += batch.events.len() as u64;
            return stats;
        }
        self.expire(now);
        for event in &batch.events {
            stats.add(self.apply_event(ep, event, now));
        }
        stats
    }

    /// Applies one KV event of an endpoint.
    pub fn apply_event(&mut self, ep: EndpointId, event: &KvEvent, now: Instant) -> ApplyStats {
        let mut stats = ApplyStats::default();
        if !self.live(ep) {
            stats.ignored += 1;
            return stats;
        }
        let group = self.config.group_idx;
        let counts = |g: Option<i64>, medium: Option<&str>| {
            g.unwrap_or(0) == group && medium.is_none_or(|m| m == MEDIUM_GPU)
        };
        match event {
            KvEvent::BlockStored(e) => {
                if !counts(e.group_idx, e.medium.as_deref()) {
                    stats.ignored += 1;
                } else {
                    self.store(ep, e, now, &mut stats);
                }
            }
            KvEvent::BlockRemoved(e) => {
                if !counts(e.group_idx, e.medium.as_deref()) {
                    stats.ignored += 1;
                    return stats;
                }
                // An engine evicts a cached block only when it has no free one left.
                self.endpoints[usize::from(ep.0)].full = true;
                for h in &e.block_hashes {
                    if let Some(i) = self.engine_find(h.as_u64(), ep.0) {
                        self.remove_entry(i);
                        stats.removed += 1;
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                self.clear_endpoint(ep);
                stats.cleared += 1;
            }
        }
        stats
    }

    fn store(&mut self, ep: EndpointId, e: &BlockStored, now: Instant, stats: &mut ApplyStats) {
        let bs = e.block_size as usize;
        if bs == 0 || e.token_ids.len() != e.block_hashes.len() * bs {
            stats.ignored += 1;
            return;
        }
        let mut parent = match &e.parent_block_hash {
            None => None,
            Some(h) => match self.engine_find(h.as_u64(), ep.0) {
                Some(i) => Some(BlockKey(self.slab.get(i).key)),
                None => {
                    stats.orphaned += 1;
                    return;
                }
            },
        };
        let t = self.ticks(now);
        let mut scratch = std::mem::take(&mut self.scratch);
        // An adapter's blocks go to its space; there its name alone in the extra keys is the
        // space itself, so such a block keys like the adapter request's own token keys. Other
        // extra keys (media, salt) still make the block unmatchable by plain text.
        let space = Space::of(e.lora_name.as_deref());
        let lora_only = e.lora_name.as_deref().map(ExtraKeys::lora);
        for (j, (hash, block)) in e
            .block_hashes
            .iter()
            .zip(e.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let extra = e
                .extra_keys
                .as_ref()
                .and_then(|ks| ks.get(j))
                .and_then(Option::as_ref)
                .filter(|x| Some(*x) != lora_only.as_ref());
            let key = chain_token_block(
                space,
                parent,
                block,
                extra.map(|x| x.0.as_slice()),
                &mut scratch,
            );
            self.upsert(ep.0, key.0, EntryKind::Precise, hash.as_u64(), t);
            parent = Some(key);
            stats.stored += 1;
        }
        self.scratch = scratch;
    }

    /// Sizes, for metrics.
    pub fn stats(&self) -> IndexStats {
        let bytes = self.slab.chunks.len() * CHUNK * size_of::<Entry>()
            + self.slab.chunks.capacity() * size_of::<Box<[Entry; CHUNK]>>()
            + self.posting.allocation_size()
            + self.wide_entries.allocation_size()
            + self.engine.allocation_size()
            + self.wides.capacity() * size_of::<Wide>()
            + self
                .wides
                .iter()
                .map(|w| w.bits.capacity() * 8)
                .sum::<usize>()
            + self.endpoints.capacity() * size_of::<Endpoint>()
            + self.written.capacity() * size_of::<Written>()
            + self.free_endpoints.capacity() * 2
            + self.free_wides.capacity() * 4;
        IndexStats {
            entries: self.counts.iter().sum(),
            speculative: self.counts[0],
            approximate: self.counts[1],
            precise: self.counts[2],
            keys: self.posting.len(),
            wide_keys: self.wides.len() - self.free_wides.len(),
            bytes,
        }
    }
}

/// Tokens the engine will report cached for a prompt of `prompt_tokens` whose first
/// `matched_blocks` blocks it holds: vLLM recomputes at least the last token, so a fully cached
/// prompt whose length is a multiple of the block size hits one block less.
pub fn predicted_cached_tokens(matched_blocks: u32, block_size: u32, prompt_tokens: u32) -> u32 {
    let cap = prompt_tokens.saturating_sub(1) / block_size.max(1) * block_size;
    matched_blocks.saturating_mul(block_size).min(cap)
}

mod decisions;
mod matching;
mod store;

pub use decisions::REFRESH_DIVISOR;
use decisions::Written;
use store::Slab;
#[cfg(test)]
mod tests;
