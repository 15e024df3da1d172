//! Longest-consecutive-prefix matching: walk the request's keys while the candidate set shrinks.

use super::{CacheIndex, EndpointId, Match, NIL, Posting, bit};
use crate::keys::BlockKey;

impl CacheIndex {
    /// For each endpoint holding at least the first of `keys`, how many leading keys it holds
    /// consecutively (endpoints absent from the result hold none). Order is unspecified.
    pub fn match_prefix(&self, keys: &[BlockKey], out: &mut Vec<Match>) {
        out.clear();
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
        let emit_bits = |bits: &[u64], depth: u32, out: &mut Vec<Match>| {
            for (wi, &word) in bits.iter().enumerate() {
                let mut w = word;
                while w != 0 {
                    let b = w.trailing_zeros();
                    out.push(Match {
                        endpoint: EndpointId((wi * 64) as u16 + b as u16),
                        blocks: depth,
                    });
                    w &= w - 1;
                }
            }
        };
        let mut depth = 1u32;
        // Probe a few keys ahead before walking them: the probes are independent, so their
        // cache misses overlap instead of queueing (the difference between ~3 and ~1 DRAM
        // latencies per block on a cold index). At most AHEAD - 1 probes are wasted.
        const AHEAD: usize = 8;
        'walk: for chunk in rest.chunks(AHEAD) {
            let mut found: [Option<Posting<'_>>; AHEAD] = [None; AHEAD];
            for (slot, k) in found.iter_mut().zip(chunk) {
                *slot = self.posting(k.0);
            }
            for p in found.into_iter().take(chunk.len()) {
                let Some(p) = p else { break 'walk };
                match (p, wide) {
                    (Posting::Wide(w), true) => {
                        let mut any = false;
                        for (wi, word) in bits.iter_mut().enumerate() {
                            let keep = *word & w.bits.get(wi).copied().unwrap_or(0);
                            let mut dropped = *word & !keep;
                            while dropped != 0 {
                                let b = dropped.trailing_zeros();
                                out.push(Match {
                                    endpoint: EndpointId((wi * 64) as u16 + b as u16),
                                    blocks: depth,
                                });
                                dropped &= dropped - 1;
                            }
                            *word = keep;
                            any |= keep != 0;
                        }
                        if !any {
                            return;
                        }
                    }
                    (Posting::Wide(w), false) => {
                        list.retain(|&ep| {
                            let keep = bit(&w.bits, ep);
                            if !keep {
                                out.push(Match {
                                    endpoint: EndpointId(ep),
                                    blocks: depth,
                                });
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
                        emit_bits(&bits, depth, out);
                        wide = false;
                        if list.is_empty() {
                            return;
                        }
                    }
                    (Posting::Narrow(head), false) => {
                        list.retain(|&ep| {
                            let mut i = head;
                            while i != NIL {
                                let e = self.slab.get(i);
                                if e.endpoint == ep {
                                    return true;
                                }
                                i = e.key_next;
                            }
                            out.push(Match {
                                endpoint: EndpointId(ep),
                                blocks: depth,
                            });
                            false
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
            emit_bits(&bits, depth, out);
        } else {
            out.extend(list.iter().map(|&ep| Match {
                endpoint: EndpointId(ep),
                blocks: depth,
            }));
        }
    }
}
