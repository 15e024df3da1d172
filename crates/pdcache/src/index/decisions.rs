//! Writing a routing decision's keys for the chosen endpoints, cheaply when they hold them.
//!
//! A decision writes every key of the prompt for each chosen endpoint (approximate or
//! speculative entries; a refresh where the entry exists). Most of those keys are usually held
//! already and were refreshed moments ago (a shared system prompt, a conversation's earlier
//! turns), so two shortcuts skip what would change almost nothing:
//! - a refresh of an entry refreshed less than `1 / REFRESH_DIVISOR` of its TTL ago is skipped
//!   (no LRU relink, no new expiry);
//! - each endpoint keeps a memo of the last keys it was written ([`Written`]: a few of them, as
//!   checkpoints); the keys a new decision shares with it are skipped without a lookup, while the
//!   memo's oldest refresh is within that window and the endpoint lost no entry since.
//!
//! Both apply only while the endpoint holds at most half its capacity (counting the keys being
//! written): far from evicting, an entry's LRU position matters only for expiry, and a skipped
//! refresh keeps position and expiry consistent.

use std::time::Instant;

use super::{CacheIndex, EndpointId, EntryKind, Link, NIL};
use crate::keys::BlockKey;

/// Decision targets whose keys are written in one walk.
const GROUP: usize = 4;
/// A decision's refresh of an entry refreshed less than `1 / REFRESH_DIVISOR` of its TTL ago is
/// skipped while its endpoint holds at most half its capacity (see
/// [`CacheIndex::insert_decisions`]).
pub const REFRESH_DIVISOR: u32 = 8;
/// Checkpoints of a [`Written`] memo.
const MARKS: usize = 16;

/// What the last decision wrote for an endpoint: its keys at up to `MARKS` evenly spaced
/// positions (the last key included). Keys are chained (a key names its block and every block
/// before it), so a new prompt with the same key at a checkpoint has the same keys up to it,
/// which were written then.
#[derive(Debug, Clone, Copy)]
pub(super) struct Written {
    marks: [u64; MARKS],
    /// Keys between checkpoints: checkpoint `i` covers keys `..min((i + 1) x step, len)`.
    step: u32,
    /// Keys written (0: no memo).
    len: u32,
    /// The kind written.
    kind: u8,
    /// The oldest refresh (tick) of the entries written.
    floor: u32,
    /// The endpoint's removal count just after the write.
    removals: u32,
}

/// The keys of `keys` that end each checkpoint of `step` keys, into `out` (as many as fit).
/// (A digest chained over every key cost a multiply per key, one after the other, which a key
/// chained by construction makes unnecessary.)
fn checkpoints(keys: &[BlockKey], step: usize, out: &mut [u64]) -> usize {
    let mut n = 0;
    for (chunk, o) in keys.chunks(step.max(1)).zip(out.iter_mut()) {
        if let Some(last) = chunk.last() {
            *o = last.0;
            n += 1;
        }
    }
    n
}

impl Written {
    pub(super) const NONE: Written = Written {
        marks: [0; MARKS],
        step: 1,
        len: 0,
        kind: 0,
        floor: 0,
        removals: 0,
    };

    fn new(keys: &[BlockKey], kind: EntryKind, floor: u32, removals: u32) -> Self {
        let len = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let step = len.div_ceil(MARKS as u32).max(1);
        let mut marks = [0; MARKS];
        checkpoints(keys, step as usize, &mut marks);
        Written {
            marks,
            step,
            len,
            kind: kind.slot() as u8,
            floor,
            removals,
        }
    }

    /// How many leading `keys` this memo covers: up to the last checkpoint whose key agrees.
    /// Checkpoints are compared in order and the first that differs ends it (a new prompt
    /// usually differs at the first: one compare).
    fn shared(&self, keys: &[BlockKey]) -> usize {
        let step = self.step as usize;
        let len = (self.len as usize).min(keys.len());
        // Only whole checkpoints of the memo count.
        let whole = if len == self.len as usize {
            len.div_ceil(step)
        } else {
            len / step
        };
        let agree = self
            .marks
            .iter()
            .take(whole)
            .enumerate()
            .take_while(|&(c, &mark)| keys[((c + 1) * step).min(len) - 1].0 == mark)
            .count();
        (agree * step).min(len)
    }
}

impl CacheIndex {
    /// Records that a routing decision sent `keys` to each of `targets` (an endpoint and the kind
    /// its entries get: [`EntryKind::Approximate`] or [`EntryKind::Speculative`]; precise entries
    /// are the events' to make, so a precise target is skipped), in one walk of the keys: each
    /// key's posting is looked up once for all targets (a PD decision writes its prefill and its
    /// decode). `keys` are chained, as every [`BlockKey`] of [`crate::keys`] is (a key names
    /// its block and everything before it): the memo of the last decision relies on it.
    ///
    /// A refresh is skipped when the entry was refreshed (or, if precise, marked used) less than
    /// `1 / REFRESH_DIVISOR` of the target kind's TTL ago and its endpoint holds at most half its
    /// capacity, counting these keys: the entry keeps its place in the LRU order and its expiry.
    /// So an approximate or speculative entry lives at least `(1 - 1/REFRESH_DIVISOR)` of its
    /// TTL after its last refresh (at most its TTL, as before), and while an endpoint is that far
    /// from evicting, its LRU order is exact up to that window. Keys shared with the endpoint's
    /// previous decision are skipped on the same terms without being looked up.
    pub fn insert_decisions(
        &mut self,
        targets: &[(EndpointId, EntryKind)],
        keys: &[BlockKey],
        now: Instant,
    ) {
        let mut group = [(0u16, EntryKind::Approximate); GROUP];
        let mut n = 0;
        let mut swept = false;
        for (i, &(ep, kind)) in targets.iter().enumerate() {
            // The first of duplicate targets counts.
            if kind != EntryKind::Precise
                && self.live(ep)
                && !targets[..i].iter().any(|&(e, _)| e == ep)
            {
                group[n] = (ep.0, kind);
                n += 1;
            }
            if n == GROUP || (i + 1 == targets.len() && n > 0) {
                if !swept {
                    self.expire(now);
                    swept = true;
                }
                self.insert_group(&group[..n], keys, self.ticks(now));
                n = 0;
            }
        }
    }

    /// Writes `keys` for up to [`GROUP`] distinct live endpoints.
    fn insert_group(&mut self, group: &[(u16, EntryKind)], keys: &[BlockKey], t: u32) {
        // Per target: the window within which a refresh is skipped (0: never), the leading keys
        // its memo covers, the oldest refresh of what it skips, its removals before the write.
        let mut window = [0u32; GROUP];
        let mut skip = [0usize; GROUP];
        let mut floor = [t; GROUP];
        let mut removals = [0u32; GROUP];
        for (j, &(ep, kind)) in group.iter().enumerate() {
            let e = usize::from(ep);
            removals[j] = self.endpoints[e].removals;
            // Far from its capacity an endpoint evicts nothing soon, so the LRU position of an
            // entry refreshed moments ago need not move.
            let room = self.endpoints[e].capacity / 2;
            if self.endpoint_len(EndpointId(ep)).saturating_add(keys.len()) > room {
                continue;
            }
            window[j] = self.ttl_of(kind) / REFRESH_DIVISOR;
            let w = &self.written[e];
            if w.len > 0
                && w.kind == kind.slot() as u8
                && w.removals == removals[j]
                && t.wrapping_sub(w.floor) < window[j]
            {
                skip[j] = w.shared(keys);
                if skip[j] > 0 {
                    floor[j] = w.floor;
                }
            }
        }
        let skip_all = skip[..group.len()].iter().copied().min().unwrap_or(0);
        // Last key first, so the prompt's leading blocks end up the most recently used: an
        // engine frees a finished request's blocks tail first (vLLM frees them in reverse), so
        // at capacity it evicts a prompt's own tail before the prefix others share, and the
        // index's LRU order models that.
        for (at, k) in keys.iter().enumerate().skip(skip_all).rev() {
            let mut found = [NIL; GROUP];
            let mut link = Link::New;
            if let Some(p) = self.posting(k.0) {
                link = Link::of(p);
                for ((f, &(ep, _)), &s) in found.iter_mut().zip(group).zip(&skip) {
                    if at >= s {
                        *f = self.find_in(p, k.0, ep).unwrap_or(NIL);
                    }
                }
            }
            for (j, (&i, &(ep, kind))) in found.iter().zip(group).enumerate() {
                if at < skip[j] {
                    continue;
                }
                if i == NIL {
                    link = self.insert_new(ep, k.0, kind, 0, t, link);
                    continue;
                }
                match self.recent(i, kind, t, window[j]) {
                    Some(r) => {
                        if t.wrapping_sub(r) > t.wrapping_sub(floor[j]) {
                            floor[j] = r;
                        }
                    }
                    None => self.touch(i, kind, 0, t),
                }
            }
        }
        for (j, &(ep, kind)) in group.iter().enumerate() {
            let e = usize::from(ep);
            let now_removed = self.endpoints[e].removals;
            self.written[e] = if now_removed == removals[j] {
                Written::new(keys, kind, floor[j], now_removed)
            } else {
                // Something it wrote may be gone already (evicted at capacity).
                Written::NONE
            };
        }
    }

    /// Whether a decision's `kind` refresh of entry `i` at tick `now` may be skipped, because it
    /// would change neither the entry's kind nor its life by more than `window` ticks: then the
    /// tick the entry was last refreshed (or marked used).
    fn recent(&self, i: u32, kind: EntryKind, now: u32, window: u32) -> Option<u32> {
        let e = self.slab.get(i);
        let within = |tick: u32| (now.wrapping_sub(tick) < window).then_some(tick);
        match (EntryKind::from_slot(e.kind), kind) {
            // Marks a precise entry used: `expires` holds when it last was.
            (EntryKind::Precise, _) => within(e.expires),
            (old, new) if old == new => within(e.expires.wrapping_sub(self.ttl_of(new))),
            // A speculative touch on an approximate entry changes nothing at all.
            (EntryKind::Approximate, EntryKind::Speculative) => Some(now),
            _ => None,
        }
    }
}
