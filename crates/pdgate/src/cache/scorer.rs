//! One decision's view of a model index: the gateway's side of it ([`IndexState`]: endpoint
//! ids, which publish events, scratch) and the locked pair ([`Scorer`]) a decision matches,
//! scores and records through.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use pdcache::index::{CacheIndex, EndpointId, EntryKind};
use pdcache::subscribe::SubscriberStats;

use super::config::CacheConfig;
use super::events::{EventWatch, EventsNow};
use super::{PrefixView, score, view};
use crate::endpoints::{Endpoint, Load};

/// The gateway's side of a model index: endpoint names to ids, which ids publish events, and
/// scratch space. Locked before the index (the subscribers lock only the index).
#[derive(Debug, Default)]
pub(super) struct IndexState {
    pub(super) ids: HashMap<String, EndpointId>,
    /// The same ids by the slot of the endpoint's [`Load`] (one per name, shared across
    /// snapshots): a decision resolves each candidate with one vector read and one pointer
    /// compare instead of hashing its name (a pointer hash was a large share of a big
    /// decision: docs/benchmarks.md). Holding the `Load` keeps its slot and address
    /// from being reused; [`ModelCache::retain`] clears this.
    pub(super) by_slot: Vec<Option<(Arc<Load>, EndpointId)>>,
    /// By endpoint id: whether its KV events feed the index (precise), so a decision inserts
    /// speculative entries for it (confirmed by the event) instead of approximate ones.
    pub(super) precise: Vec<bool>,
    /// By endpoint id: whether its events still flow (see [`EventWatch`]).
    pub(super) watches: Vec<Option<EventWatch>>,
    /// Matched blocks by endpoint id, for the last [`Scorer::prepare`].
    pub(super) blocks: Vec<u32>,
}

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl IndexState {
    /// `ep`'s id, registering it on first sight.
    #[inline]
    fn id_of(&mut self, index: &mut CacheIndex, ep: &Endpoint) -> Option<EndpointId> {
        match self.known_id(ep) {
            Some(id) => Some(id),
            None => self.register(index, ep),
        }
    }

    /// `ep`'s id if it was seen before.
    #[inline]
    fn known_id(&self, ep: &Endpoint) -> Option<EndpointId> {
        match self.by_slot.get(ep.load.slot()) {
            Some(Some((load, id))) if Arc::ptr_eq(load, &ep.load) => Some(*id),
            _ => None,
        }
    }

    /// `ep`'s id if it was registered: by its slot, else (a slot another endpoint took since,
    /// which only counters outside a load table share) by its name.
    fn registered_id(&self, ep: &Endpoint) -> Option<EndpointId> {
        self.known_id(ep).or_else(|| self.id_by_name(&ep.name))
    }

    /// Kept out of line: inlined, the name lookup slowed every decision in the decision bench
    /// (docs/benchmarks.md), though a decision with a unique cheapest candidate never calls it.
    #[cold]
    #[inline(never)]
    fn id_by_name(&self, name: &str) -> Option<EndpointId> {
        self.ids.get(name).copied()
    }

    #[cold]
    fn register(&mut self, index: &mut CacheIndex, ep: &Endpoint) -> Option<EndpointId> {
        let slot = ep.load.slot();
        let id = self.id(index, &ep.name)?;
        if self.by_slot.len() <= slot {
            self.by_slot.resize_with(slot + 1, || None);
        }
        self.by_slot[slot] = Some((ep.load.clone(), id));
        Some(id)
    }

    pub(super) fn id(&mut self, index: &mut CacheIndex, name: &str) -> Option<EndpointId> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        let id = index.add_endpoint().ok()?;
        self.ids.insert(name.to_string(), id);
        Some(id)
    }

    pub(super) fn is_precise(&self, id: EndpointId) -> bool {
        self.precise
            .get(usize::from(id.0))
            .copied()
            .unwrap_or(false)
    }

    pub(super) fn set_precise(&mut self, id: EndpointId, on: bool) {
        let i = usize::from(id.0);
        if self.precise.len() <= i {
            self.precise.resize(i + 1, false);
        }
        self.precise[i] = on;
        if !on && let Some(w) = self.watches.get_mut(i) {
            *w = None;
        }
    }

    pub(super) fn watch(&mut self, id: EndpointId, stats: Arc<SubscriberStats>) {
        let i = usize::from(id.0);
        if self.watches.len() <= i {
            self.watches.resize_with(i + 1, || None);
        }
        self.watches[i] = Some(EventWatch::new(stats));
    }
}

/// A locked model index, for one decision.
pub(crate) struct Scorer<'a> {
    pub(super) state: MutexGuard<'a, IndexState>,
    pub(super) index: MutexGuard<'a, CacheIndex>,
    pub(super) events_timeout: Duration,
}

impl Scorer<'_> {
    /// Matches `view` against the index; [`Scorer::choose`] then scores candidates by it.
    pub(crate) fn prepare(&mut self, view: &PrefixView) {
        let st = &mut *self.state;
        self.index.match_blocks(&view.keys, &mut st.blocks);
    }

    /// Leading blocks of the prepared view held by an endpoint that `by_slot` does not know
    /// (under the slot of its `Load`): by its name if it was registered, else none (the index
    /// holds nothing for it).
    #[cold]
    fn blocks_by_id(&self, ep: &Endpoint) -> (u32, bool) {
        let st = &*self.state;
        st.registered_id(ep).map_or((0, false), |id| {
            let blocks = st.blocks.get(usize::from(id.0)).copied().unwrap_or(0);
            (blocks, self.index.is_full(id))
        })
    }

    /// Leading blocks of the prepared view that `ep`, chosen without reading what it holds,
    /// holds, registering it on first sight: a decode that is never recorded (its cache is not
    /// read) is then found by its slot in later decisions, not by hashing its name each time.
    fn chosen_blocks(&mut self, ep: &Endpoint) -> u32 {
        self.registered_blocks(ep).map_or(0, |(_, blocks)| blocks)
    }

    /// `ep`'s id (registering it on first sight) and the leading blocks of the prepared view it
    /// holds; `None` where the index has no room for another endpoint.
    fn registered_blocks(&mut self, ep: &Endpoint) -> Option<(EndpointId, u32)> {
        let st = &mut *self.state;
        let id = st.id_of(&mut self.index, ep)?;
        Some((id, st.blocks.get(usize::from(id.0)).copied().unwrap_or(0)))
    }

    /// Leading blocks of the prepared view that `ep` holds, and the entries the index holds for
    /// it (registering `ep` on first sight).
    #[cfg(test)]
    pub(crate) fn facts(&mut self, ep: &Endpoint) -> (u32, usize) {
        self.registered_blocks(ep)
            .map_or((0, 0), |(id, blocks)| (blocks, self.index.endpoint_len(id)))
    }

    /// Chooses among `candidates` (non-empty) by cache and load for the prepared `view`;
    /// `loads[i]` is `candidates[i]`'s load (read for every candidate, the endpoint itself only
    /// where the chosen one or a tie needs it: see `Snapshot::loads_of`). `holds`: whether the
    /// index may hold anything for these candidates (a decode's are written only where read).
    pub(crate) fn choose<E: AsRef<Endpoint>, L: Deref<Target = Load>>(
        &mut self,
        candidates: &[E],
        loads: &[L],
        view: &PrefixView,
        cfg: &CacheConfig,
        holds: bool,
    ) -> Option<score::Choice> {
        debug_assert_eq!(candidates.len(), loads.len());
        // The tables by value: read through the guard, they were read again per candidate. A
        // candidate's id is found by the slot of its `Load` and one pointer compare. (A table of
        // blocks by slot, built per decision from these two, cost more to build than it saved.)
        let this = &*self;
        let (by_slot, blocks): (&[_], &[u32]) = (&this.state.by_slot, &this.state.blocks);
        let index = &*this.index;
        // Others' load is read only where it is scraped: off, a candidate costs one load as
        // before (the branch is the same for every candidate).
        let others = !cfg.engine_load_interval.is_zero();
        let held_by = move |i: usize, load: &Load| match by_slot.get(load.slot()) {
            Some(Some((known, id))) if std::ptr::eq(&**known, load) => (
                blocks.get(usize::from(id.0)).copied().unwrap_or(0),
                index.is_full(*id),
            ),
            _ => this.blocks_by_id(candidates[i].as_ref()),
        };
        let state = &*this.state;
        let n = loads.len();
        // A tie goes to the candidate caching least, so distinct prefixes spread over the
        // fleet; where the cache weighs nothing, to the one sent the fewest requests so far, so
        // idle engines take turns.
        if cfg.cache_weight > 0.0 {
            let entries = |i: usize| {
                state
                    .registered_id(candidates[i].as_ref())
                    .map_or(0, |id| index.endpoint_len(id))
            };
            let facts = facts::<true, _>(loads, held_by, others);
            return score::choose(n, facts, view, cfg, entries);
        }
        // Where the cache weighs nothing (a decode chosen by its load), what a candidate holds
        // changes no cost: it is read for the chosen one only, afterwards, and only where the
        // index holds anything for it (`holds`; a decode's are written only where read,
        // `Cache::decodes_read`). (A scoring pass of its own, where the compiler drops what the
        // cache would have added.)
        let entries = |i: usize| loads[i].total() as usize;
        let facts = facts::<false, _>(loads, held_by, others);
        let choice = score::choose(n, facts, view, cfg, entries)?;
        if !holds {
            return Some(choice);
        }
        let blocks = self.chosen_blocks(candidates[choice.index].as_ref());
        Some(choice.holding(blocks, view))
    }

    /// Records that `view` was sent to each of `eps`: its blocks will be in their caches, all
    /// written in one walk of the keys. Speculative (until the confirming event) where an
    /// endpoint publishes events; approximate (with a TTL) elsewhere, and where its events
    /// stopped arriving. Precise mode needs token keys: text keys never match an event. Calls
    /// `stopped` for each endpoint whose events were found stopped just now.
    pub(crate) fn record(
        &mut self,
        eps: &[&Endpoint],
        view: &PrefixView,
        now: Instant,
        mut stopped: impl FnMut(&Endpoint),
    ) {
        const MOST: usize = 4;
        let mut targets = [(EndpointId(0), EntryKind::Approximate); MOST];
        for chunk in eps.chunks(MOST) {
            let mut n = 0;
            for ep in chunk {
                let Some(id) = self.state.id_of(&mut self.index, ep) else {
                    continue;
                };
                let st = &mut *self.state;
                // Without events the index models the engine's size: its entries bounded by
                // the KV its metrics report, in this model's blocks, where that is known and
                // below `capacity_per_endpoint`. An approximate key covers a block of 4-byte
                // tokens; tokens often run longer (so the engine holds more keys' worth), and an
                // index that forgets a prefix the engine still holds sends its family away from
                // it, which costs more than trusting an entry a while after the engine evicted
                // it: the bound is a quarter above the engine's blocks.
                let precise = st.is_precise(id);
                let tokens = ep.load.cache_tokens();
                if tokens > 0 && !precise {
                    let blocks = tokens.saturating_mul(5) / (4 * u64::from(view.block_size.max(1)));
                    self.index
                        .set_capacity(id, usize::try_from(blocks).unwrap_or(usize::MAX));
                }
                let events = if precise {
                    let held = st.blocks.get(usize::from(id.0)).copied().unwrap_or(0);
                    let expects =
                        view.kind == view::KeyKind::Tokens && saturate(view.keys.len()) > held;
                    st.watches
                        .get_mut(usize::from(id.0))
                        .and_then(Option::as_mut)
                        .map_or(EventsNow::Flowing, |w| {
                            w.check(expects, now, self.events_timeout)
                        })
                } else {
                    EventsNow::StillStopped
                };
                if events == EventsNow::Stopped {
                    stopped(ep);
                }
                let kind = match events {
                    EventsNow::Flowing if view.kind == view::KeyKind::Tokens => {
                        EntryKind::Speculative
                    }
                    EventsNow::Flowing => continue,
                    EventsNow::Stopped | EventsNow::StillStopped => EntryKind::Approximate,
                };
                targets[n] = (id, kind);
                n += 1;
            }
            if n > 0 && !view.keys.is_empty() {
                self.index.insert_decisions(&targets[..n], &view.keys, now);
            }
        }
    }
}

/// The facts of candidate `i` of those whose loads are `loads`, for a decision: what it holds
/// (`held_by(i, load)`, read only where `CACHES`: the cache weighs something) and its whole
/// load (this gateway's, and what its metrics say others sent it where `others`:
/// `cache.engine_load_interval`, so replicas do not all pick the same idle one).
#[inline(always)]
fn facts<'c, const CACHES: bool, L: Deref<Target = Load>>(
    loads: &'c [L],
    held_by: impl Fn(usize, &Load) -> (u32, bool) + 'c,
    others: bool,
) -> impl Fn(usize) -> score::Facts + 'c {
    move |i| {
        let load = &*loads[i];
        let (blocks, full) = if CACHES { held_by(i, load) } else { (0, false) };
        let (in_flight, computing) = if others {
            load.with_others()
        } else {
            load.held()
        };
        score::Facts {
            blocks,
            in_flight,
            computing,
            full,
        }
    }
}
