//! Longest-consecutive-prefix matching: walk the request's keys while the candidate set shrinks.

use super::{CacheIndex, EndpointId, Match, NIL, Posting, WIDE_AT, bit};
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
    fn walk(&self, keys: &[BlockKey], emit: &mut impl Emit) {
        let Some((first, rest)) = keys.split_first() else {
            return;
        };
        let mut list: Vec<u16> = Vec::new();
        let mut bits: Vec<u64> = Vec::new();
        let mut wide = false;
        match self.posting(first.0) {
            None => return,
            Some(Posting::Narrow(mut i)) => {
                while i != NIL {
                    let e = self.slab.get(i);
                    list.push(e.endpoint);
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
        'walk: for chunk in rest.chunks(AHEAD) {
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
                        list.retain(|&ep| {
                            let keep = bit(&w.bits, ep);
                            if !keep {
                                emit.one(ep, depth);
                            }
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
                                list.push(e.endpoint);
                                let ep = usize::from(e.endpoint);
                                bits[ep / 64] &= !(1 << (ep % 64));
                            }
                            i = e.key_next;
                        }
                        emit_bits(&bits, depth, emit);
                        wide = false;
                        if list.is_empty() {
                            return;
                        }
                    }
                    (Posting::Narrow(head), false) => {
                        // The key's holders, read once (a narrow posting holds at most WIDE_AT;
                        // a longer chain falls back to walking it per candidate).
                        let mut held = [0u16; WIDE_AT];
                        let mut n = 0;
                        let mut i = head;
                        while i != NIL && n < WIDE_AT {
                            let e = self.slab.get(i);
                            held[n] = e.endpoint;
                            n += 1;
                            i = e.key_next;
                        }
                        let holds = |ep: u16| {
                            if held[..n].contains(&ep) {
                                return true;
                            }
                            let mut i = i;
                            while i != NIL {
                                let e = self.slab.get(i);
                                if e.endpoint == ep {
                                    return true;
                                }
                                i = e.key_next;
                            }
                            false
                        };
                        // Usually every candidate holds the next key too.
                        if list.iter().all(|&ep| holds(ep)) {
                            depth += 1;
                            continue;
                        }
                        list.retain(|&ep| {
                            let keep = holds(ep);
                            if !keep {
                                emit.one(ep, depth);
                            }
                            keep
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
            for &ep in &list {
                emit.one(ep, depth);
            }
        }
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
