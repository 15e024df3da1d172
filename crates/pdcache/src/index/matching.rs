//! Longest-consecutive-prefix matching: walk the request's keys while the candidate set shrinks.

use super::{CacheIndex, EndpointId, FREE_KIND, Match, NIL, Posting, WIDE_AT, bit};
use crate::keys::BlockKey;

impl CacheIndex {
    /// For each endpoint holding at least the first of `keys`, how many leading keys it holds
    /// consecutively (endpoints absent from the result hold none). Order is unspecified.
    pub fn match_prefix(&self, keys: &[BlockKey], out: &mut Vec<Match>) {
        out.clear();
        self.walk(keys, &mut List(out));
    }

    /// [`CacheIndex::match_prefix`] into a dense table: `blocks[id]` is set to the leading keys
    /// endpoint `id` holds, 0 for those holding none. `blocks` is resized to
    /// [`CacheIndex::endpoint_slots`].
    pub fn match_blocks(&self, keys: &[BlockKey], blocks: &mut Vec<u32>) {
        blocks.clear();
        blocks.resize(self.endpoints.len(), 0);
        self.walk(keys, &mut Dense(blocks));
    }

    /// Endpoint ids in use or free: every [`EndpointId`] of this index is below it.
    pub fn endpoint_slots(&self) -> usize {
        self.endpoints.len()
    }

    /// Walks `keys` while the candidate set shrinks; `emit` gets each endpoint holding at least
    /// the first key once, with the leading keys it holds.
    ///
    /// While few endpoints remain (a list, not a bitmap), each is followed through the slab: a
    /// prompt's entries for one endpoint are written in one walk of its keys, so they mostly sit
    /// at a fixed stride from each other (-1 for a decision, which writes the last key first;
    /// +1 for a batch of events), and the entry of the next key is usually where the last one's
    /// stride points. Found there (a live entry of that key and endpoint), the endpoint holds
    /// the key, exactly as its posting would say, with one read of a slot next to the last one
    /// instead of a hash-table probe (a random read of a table of several megabytes per key,
    /// most of a decision on a cold prompt: docs/benchmarks.md). Where any guess misses, the
    /// keys are looked up in the posting table as before, and the strides learnt from what
    /// they find.
    fn walk(&self, keys: &[BlockKey], emit: &mut impl Emit) {
        let Some((first, rest)) = keys.split_first() else {
            return;
        };
        let mut list: Vec<Held> = Vec::new();
        let mut bits: Vec<u64> = Vec::new();
        let mut wide = false;
        match self.posting(first.0) {
            None => return,
            Some(Posting::Narrow(mut i)) => {
                while i != NIL {
                    let e = self.slab.get(i);
                    list.push(Held::at(e.endpoint, i));
                    i = e.key_next;
                }
            }
            Some(Posting::Wide(w)) => {
                bits.extend_from_slice(&w.bits);
                wide = true;
            }
        }
        let mut depth = 1u32;
        // Probe a few keys ahead before walking them: the probes are independent, so their
        // cache misses overlap instead of queueing (about one DRAM latency per block on a
        // cold index instead of several). At most AHEAD - 1 probes are wasted.
        // (The stored values, not the postings: moving an array of those through an iterator
        // cost more per key.)
        const AHEAD: usize = 8;
        let mut pos = 0;
        // Whether to guess where the next entries are: at first (a decision's stride, an
        // adjacent slot: a miss there costs little), and again once the last key looked up
        // confirmed every candidate's stride. Where a prompt's entries lie at no fixed stride
        // (written a block at a time among other writes), a guess would be one far read more
        // per chunk of keys looked up, so none is tried.
        let mut follow = true;
        'walk: while pos < rest.len() {
            if !wide && follow {
                while let Some(k) = rest.get(pos) {
                    if !list.iter().all(|c| self.follows(c, k.0)) {
                        break;
                    }
                    for c in &mut list {
                        c.at = c.at.wrapping_add(c.stride);
                    }
                    depth += 1;
                    pos += 1;
                }
            }
            let chunk = &rest[pos..rest.len().min(pos + AHEAD)];
            pos += chunk.len();
            let mut found = [None; AHEAD];
            for (slot, k) in found.iter_mut().zip(chunk) {
                *slot = self.posting_value(k.0);
            }
            for &v in &found[..chunk.len()] {
                let Some(v) = v else { break 'walk };
                match (self.posting_of(v), wide) {
                    (Posting::Wide(w), true) => {
                        // Words past the shorter bitmap hold no endpoint of this key.
                        let common = bits.len().min(w.bits.len());
                        let (head, tail) = bits.split_at_mut(common);
                        // Usually every candidate holds the next key too (a shared prompt held
                        // by all): one branch-free pass finds that nothing drops.
                        let lost = head
                            .iter()
                            .zip(&w.bits)
                            .fold(0u64, |a, (&word, &other)| a | (word & !other))
                            | tail.iter().fold(0u64, |a, &word| a | word);
                        if lost == 0 {
                            depth += 1;
                            continue;
                        }
                        let mut any = 0u64;
                        for (wi, (word, &other)) in head.iter_mut().zip(&w.bits).enumerate() {
                            let keep = *word & other;
                            let dropped = *word ^ keep;
                            if dropped != 0 {
                                emit.word(wi, dropped, depth);
                            }
                            *word = keep;
                            any |= keep;
                        }
                        for (wi, word) in tail.iter_mut().enumerate() {
                            if *word != 0 {
                                emit.word(common + wi, *word, depth);
                                *word = 0;
                            }
                        }
                        if any == 0 {
                            return;
                        }
                    }
                    (Posting::Wide(w), false) => {
                        list.retain_mut(|c| {
                            let keep = bit(&w.bits, c.ep);
                            if !keep {
                                emit.one(c.ep, depth);
                            }
                            // Where its entry is is not read from a bitmap.
                            c.at = NIL;
                            keep
                        });
                        if list.is_empty() {
                            return;
                        }
                    }
                    (Posting::Narrow(mut i), true) => {
                        // At most WIDE_AT endpoints go on; the rest of the bitmap stops here.
                        list.clear();
                        while i != NIL {
                            let e = self.slab.get(i);
                            if bit(&bits, e.endpoint) {
                                list.push(Held::at(e.endpoint, i));
                                let ep = usize::from(e.endpoint);
                                bits[ep / 64] &= !(1 << (ep % 64));
                            }
                            i = e.key_next;
                        }
                        emit_bits(&bits, depth, emit);
                        wide = false;
                        follow = true;
                        if list.is_empty() {
                            return;
                        }
                    }
                    (Posting::Narrow(head), false) => {
                        // The key's holders, read once (a narrow posting holds at most WIDE_AT;
                        // a longer chain falls back to walking it per candidate).
                        let mut held = [(0u16, NIL); WIDE_AT];
                        let mut n = 0;
                        let mut i = head;
                        while i != NIL && n < WIDE_AT {
                            let e = self.slab.get(i);
                            held[n] = (e.endpoint, i);
                            n += 1;
                            i = e.key_next;
                        }
                        let entry_of = |ep: u16| {
                            if let Some(&(_, at)) = held[..n].iter().find(|h| h.0 == ep) {
                                return Some(at);
                            }
                            let mut i = i;
                            while i != NIL {
                                let e = self.slab.get(i);
                                if e.endpoint == ep {
                                    return Some(i);
                                }
                                i = e.key_next;
                            }
                            None
                        };
                        follow = true;
                        list.retain_mut(|c| match entry_of(c.ep) {
                            Some(at) => {
                                follow &= c.moved_to(at);
                                true
                            }
                            None => {
                                emit.one(c.ep, depth);
                                false
                            }
                        });
                        if list.is_empty() {
                            return;
                        }
                    }
                }
                depth += 1;
            }
        }
        if wide {
            emit_bits(&bits, depth, emit);
        } else {
            for c in &list {
                emit.one(c.ep, depth);
            }
        }
    }

    /// Whether candidate `c` holds `key` by the entry its stride points at (a live entry of that
    /// key and endpoint; a miss says nothing).
    #[inline]
    fn follows(&self, c: &Held, key: u64) -> bool {
        c.at != NIL
            && self
                .slab
                .try_get(c.at.wrapping_add(c.stride))
                .is_some_and(|e| e.key == key && e.endpoint == c.ep && e.kind != FREE_KIND)
    }
}

/// A candidate of a walk while few remain: an endpoint holding every key so far, and where it
/// holds the last of them.
#[derive(Clone, Copy)]
struct Held {
    ep: u16,
    /// Its entry of the last key walked (`NIL`: not known).
    at: u32,
    /// Where its next entry is guessed, from `at` (wrapping: -1 is `u32::MAX`).
    stride: u32,
}

impl Held {
    /// Endpoint `ep`, its entry of the last key at `at`, its stride not known yet: a decision's
    /// (-1) until an entry is found elsewhere.
    fn at(ep: u16, at: u32) -> Self {
        Held {
            ep,
            at,
            stride: u32::MAX,
        }
    }

    /// Its entry of the next key was found at `at`: the stride is learnt from that. Returns
    /// whether it was the stride already known.
    fn moved_to(&mut self, at: u32) -> bool {
        let mut kept = true;
        if self.at != NIL {
            let stride = at.wrapping_sub(self.at);
            kept = stride == self.stride;
            self.stride = stride;
        }
        self.at = at;
        kept
    }
}

/// Where a walk's matches go.
trait Emit {
    /// Endpoint `ep` holds the first `blocks` keys.
    fn one(&mut self, ep: u16, blocks: u32);

    /// Every endpoint of word `wi` of a bitmap holds the first `blocks` keys.
    fn word(&mut self, wi: usize, word: u64, blocks: u32) {
        let base = (wi * 64) as u16;
        let mut w = word;
        while w != 0 {
            self.one(base + w.trailing_zeros() as u16, blocks);
            w &= w - 1;
        }
    }
}

/// Matches as a list.
struct List<'a>(&'a mut Vec<Match>);

impl Emit for List<'_> {
    fn one(&mut self, ep: u16, blocks: u32) {
        self.0.push(Match {
            endpoint: EndpointId(ep),
            blocks,
        });
    }
}

/// Matches into a table by endpoint id.
struct Dense<'a>(&'a mut [u32]);

impl Emit for Dense<'_> {
    fn one(&mut self, ep: u16, blocks: u32) {
        if let Some(b) = self.0.get_mut(usize::from(ep)) {
            *b = blocks;
        }
    }

    /// A full word (a prefix every endpoint holds, as a shared system prompt) is one fill of
    /// 64 entries, far cheaper than one endpoint at a time.
    fn word(&mut self, wi: usize, word: u64, blocks: u32) {
        let base = wi * 64;
        if word == u64::MAX
            && let Some(run) = self.0.get_mut(base..base + 64)
        {
            run.fill(blocks);
            return;
        }
        let mut w = word;
        while w != 0 {
            self.one((base + w.trailing_zeros() as usize) as u16, blocks);
            w &= w - 1;
        }
    }
}

/// Emits every endpoint of `bits` at `depth`.
fn emit_bits(bits: &[u64], depth: u32, emit: &mut impl Emit) {
    for (wi, &word) in bits.iter().enumerate() {
        if word != 0 {
            emit.word(wi, word, depth);
        }
    }
}
