//! Choosing one endpoint by cache and load: pure, so every rule has a unit test.
//!
//! cost = `cache_weight` x uncached prompt tokens (x (1 + `eviction_weight`) where its cache is
//! full), plus `queued_weight` x prompt tokens the endpoint is still computing for earlier
//! requests, plus `load_weight` x in-flight requests (for a prefill, `prefill_load_weight`:
//! see `Cache::prefill_config`); the cheapest wins, ties go to the least loaded, then to the one
//! caching least, then to the first in a walk of the candidates from a random one.
//! The imbalance guard: when the busiest candidate is more than `balance_abs` requests *and*
//! `balance_rel` times above the idlest, the cache is ignored and the least loaded wins, so one
//! hot prefix cannot pile all traffic onto one endpoint.

use pdcache::index::predicted_cached_tokens;
use rand::Rng;

use super::config::CacheConfig;
use super::view::PrefixView;

/// What decided a choice (a metrics label: a closed set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecisionKind {
    /// The chosen endpoint holds part of the prompt.
    Hit,
    /// No candidate (chosen) holds any of it.
    Miss,
    /// The imbalance guard overrode the cache.
    Imbalance,
}

impl DecisionKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            DecisionKind::Hit => "hit",
            DecisionKind::Miss => "miss",
            DecisionKind::Imbalance => "imbalance_override",
        }
    }
}

/// One candidate's facts (what every candidate needs; the entry count that breaks ties is
/// asked for only where a tie needs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Leading blocks of the prompt it holds.
    pub(crate) blocks: u32,
    /// Requests it holds now: this gateway's, plus others' where its metrics are scraped
    /// (`Load::with_others`).
    pub(crate) in_flight: u32,
    /// Prompt tokens it is computing for them (a decode: whose KV it holds for them), where
    /// known (see `Load::held`), plus the estimate for others' requests
    /// (`endpoints::engine_load`).
    pub(crate) computing: u32,
    /// Its cache is full: what it stores evicts (`CacheIndex::is_full`).
    pub(crate) full: bool,
}

/// The choice among candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Choice {
    pub(crate) index: usize,
    pub(crate) kind: DecisionKind,
    /// Prompt tokens the chosen endpoint is predicted to find cached.
    pub(crate) cached_tokens: u32,
    /// Prompt tokens it will compute.
    pub(crate) uncached_tokens: u32,
}

impl Choice {
    /// Candidate `index`, predicted to find `cached_tokens` of `view` cached: a hit or a miss by
    /// that, unless the imbalance guard chose it (`kind`).
    fn of(index: usize, kind: DecisionKind, cached_tokens: u32, view: &PrefixView) -> Choice {
        let kind = match kind {
            DecisionKind::Imbalance => kind,
            _ if cached_tokens > 0 => DecisionKind::Hit,
            _ => DecisionKind::Miss,
        };
        Choice {
            index,
            kind,
            cached_tokens,
            uncached_tokens: view.prompt_tokens - cached_tokens,
        }
    }

    /// The same choice, its endpoint holding `blocks` leading blocks of `view` (for a choice
    /// made without reading what candidates hold: the cache weighed nothing).
    pub(crate) fn holding(self, blocks: u32, view: &PrefixView) -> Choice {
        let cached_tokens = predicted_cached_tokens(blocks, view.block_size, view.prompt_tokens);
        Choice::of(self.index, self.kind, cached_tokens, view)
    }
}

/// Where a decision's walk of the candidates starts: drawn once per decision, so that among
/// candidates equal on everything (the first in walk order wins) every one of a contiguous run
/// is as likely, and replicas deciding at once do not all pick the same idle endpoint. (A
/// random rank per tied candidate, a hash of its index under a per-decision seed, was uniform
/// over any tied set but cost 7 k of a 133 k-instruction decision where nearly all of 1,000
/// candidates tie: docs/benchmarks.md.)
fn first_of(n: usize) -> usize {
    // One candidate (a role with one endpoint) needs no draw.
    if n < 2 {
        return 0;
    }
    rand::rng().random_range(0..n)
}

/// `0..n` from `start`, wrapping: a decision's walk of its candidates.
fn walk(n: usize, start: usize) -> impl Iterator<Item = usize> + Clone {
    (start..n).chain(0..start)
}

/// Among the `tied` candidates (equal on everything before), the first with the fewest entries.
fn fewest_entries(
    mut tied: impl Iterator<Item = usize>,
    mut entries: impl FnMut(usize) -> usize,
) -> usize {
    let Some(mut held) = tied.next() else {
        return 0;
    };
    let mut least = entries(held);
    for i in tied {
        let e = entries(i);
        if e < least {
            (held, least) = (i, e);
        }
    }
    held
}

/// Chooses among `n` candidates (none: `None`), whose facts are `facts(i)`, for `view`;
/// `entries(i)` breaks a tie on cost and load, the fewest winning (asked only then): how many
/// entries the index holds for candidate `i`, or what its caller counts instead (see
/// `Scorer::choose`). A tie on that too goes to the first in a walk of the candidates from a
/// random one ([`first_of`]).
///
/// One walk of the candidates finds the load spread for the imbalance guard and the cheapest
/// (cost, then load, then entries): a candidate costs a few arithmetic operations, with
/// everything per view (the cap on predicted hits) computed once, and entry counts are read
/// only for candidates that tie. The candidates are walked again only where the guard
/// overrides. (Writing the facts out and then making a pass for the spread and one for the
/// cheapest cost more than twice as much: docs/benchmarks.md.)
pub(crate) fn choose(
    n: usize,
    facts: impl Fn(usize) -> Facts,
    view: &PrefixView,
    cfg: &CacheConfig,
    entries: impl FnMut(usize) -> usize,
) -> Option<Choice> {
    if n == 0 {
        return None;
    }
    // As `predicted_cached_tokens`, with its division done once. Everything the loop reads is
    // copied into locals first: the candidates' loads are atomic, which made the compiler read
    // each of these again per candidate through its reference.
    let cap = predicted_cached_tokens(u32::MAX, view.block_size, view.prompt_tokens);
    let (block_size, cap64) = (u64::from(view.block_size), u64::from(cap));
    // The product fits in 64 bits, and the minimum in 32.
    let cached = move |f: &Facts| (u64::from(f.blocks) * block_size).min(cap64) as u32;
    let (prompt, cache_weight, full_weight, queued_weight, load_weight) = (
        f64::from(view.prompt_tokens),
        cfg.cache_weight,
        cfg.cache_weight * (1.0 + cfg.eviction_weight),
        cfg.queued_weight,
        cfg.load_weight,
    );
    let start = first_of(n);
    // Weights that are whole quarters up to 2^18 (the defaults are 1, 2, 1 and 256), scaled by
    // 4 (exactly: a power of two), make every cost a whole number (each term below 2^52),
    // computed exactly in integers: the same order as the float sum below wherever that sum is
    // exact (below 2^53, far above any real fleet's costs), and cheaper than converting the
    // terms to floats.
    // (Whole by a round trip through an integer, not `fract`: that is a libm call per weight
    // on baseline x86-64, 136 instructions of a PD request.)
    let whole = |w: f64| {
        let w = w * 4.0;
        ((0.0..=1_048_576.0).contains(&w) && (w as u64) as f64 == w).then_some(w as u64)
    };
    if let (Some(cache_weight), Some(full_weight), Some(queued_weight), Some(load_weight)) = (
        whole(cache_weight),
        whole(full_weight),
        whole(queued_weight),
        whole(load_weight),
    ) {
        let prompt = view.prompt_tokens;
        let cost = move |f: &Facts| {
            let miss = if f.full { full_weight } else { cache_weight };
            miss * u64::from(prompt - cached(f))
                + queued_weight * u64::from(f.computing)
                + load_weight * u64::from(f.in_flight)
        };
        return choose_by((n, start), facts, view, cfg, entries, cached, cost);
    }
    // The cost's bits: it is finite and not negative (the weights are validated so, and a
    // candidate never caches more than the prompt), and such floats order as their bits do.
    // (Cheaper than comparing them as floats.)
    let cost = move |f: &Facts| {
        let miss = if f.full { full_weight } else { cache_weight };
        let c = miss * (prompt - f64::from(cached(f)))
            + queued_weight * f64::from(f.computing)
            + load_weight * f64::from(f.in_flight);
        c.to_bits()
    };
    choose_by((n, start), facts, view, cfg, entries, cached, cost)
}

/// [`choose`] over the `n` candidates walked from `start`, with `cached(f)`, the tokens
/// candidate `f` is predicted to find cached, and `cost(f)`, a number that orders candidates as
/// their costs do.
fn choose_by(
    (n, start): (usize, usize),
    facts: impl Fn(usize) -> Facts,
    view: &PrefixView,
    cfg: &CacheConfig,
    mut entries: impl FnMut(usize) -> usize,
    cached: impl Fn(&Facts) -> u32,
    cost: impl Fn(&Facts) -> u64,
) -> Option<Choice> {
    let choice =
        |f: &Facts, index: usize, kind: DecisionKind| Choice::of(index, kind, cached(f), view);
    let head = facts(start);
    let (mut lo, mut hi) = (head.in_flight, head.in_flight);
    let (mut best, mut best_cost, mut held) = (head, cost(&head), start);
    // Ties on cost and load are broken in the same walk: the fewest entries win, the held
    // candidate's read once while it is held.
    let mut least: Option<usize> = None;
    let mut step = |i: usize| {
        let f = facts(i);
        lo = lo.min(f.in_flight);
        hi = hi.max(f.in_flight);
        let c = cost(&f);
        // Usually dearer: one compare.
        if c <= best_cost {
            if c < best_cost || f.in_flight < best.in_flight {
                (best, best_cost, held) = (f, c, i);
                least = None;
            } else if f.in_flight == best.in_flight {
                let held_entries = *least.get_or_insert_with(|| entries(held));
                let e = entries(i);
                if e < held_entries {
                    (best, held) = (f, i);
                    least = Some(e);
                }
            }
        }
    };
    // Two plain loops: a chain of the two ranges cost a few instructions per candidate, and one
    // loop wrapping the index in it 10% more per decision (docs/benchmarks.md).
    (start + 1..n).for_each(&mut step);
    (0..start).for_each(&mut step);
    if (hi - lo) as usize > cfg.balance_abs && f64::from(hi) > cfg.balance_rel * f64::from(lo) {
        let best_by_cache = (0..n).map(|i| facts(i).blocks).max().unwrap_or(0);
        let idlest = walk(n, start).filter(|&i| facts(i).in_flight == lo);
        let i = fewest_entries(idlest, entries);
        let f = facts(i);
        // Only an override when the cache would have sent it elsewhere.
        let kind = if best_by_cache > f.blocks {
            DecisionKind::Imbalance
        } else {
            DecisionKind::Miss
        };
        return Some(choice(&f, i, kind));
    }
    Some(choice(&best, held, DecisionKind::Miss))
}

#[cfg(test)]
mod tests {
    use super::super::view::KeyKind;
    use super::*;

    fn view(prompt_tokens: u32) -> PrefixView {
        PrefixView {
            keys: Vec::new(),
            kind: KeyKind::Tokens,
            prompt_tokens,
            block_size: 16,
        }
    }

    fn f(blocks: u32, in_flight: u32) -> Facts {
        Facts {
            blocks,
            in_flight,
            computing: 0,
            full: false,
        }
    }

    /// A candidate computing `computing` prompt tokens for the requests it holds.
    fn busy(blocks: u32, in_flight: u32, computing: u32) -> Facts {
        Facts {
            computing,
            ..f(blocks, in_flight)
        }
    }

    /// `choose` with no entries anywhere.
    fn pick(facts: &[Facts], view: &PrefixView, cfg: &CacheConfig) -> Option<Choice> {
        choose(facts.len(), |i| facts[i], view, cfg, |_| 0)
    }

    #[test]
    fn the_cached_endpoint_wins_unless_its_load_costs_more() {
        let cfg = CacheConfig::default();
        let v = view(1100);
        let c = pick(&[f(0, 0), f(64, 1)], &v, &cfg).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.kind, DecisionKind::Hit);
        assert_eq!(c.cached_tokens, 1024);
        assert_eq!(c.uncached_tokens, 76);
        // 1024 cached tokens are worth 4 in-flight requests at the default load weight.
        assert_eq!(pick(&[f(0, 0), f(64, 5)], &v, &cfg).unwrap().index, 0);
        assert_eq!(pick(&[], &v, &cfg), None);
    }

    #[test]
    fn a_lone_candidate_gets_the_choice_it_would_win_among_many() {
        let cfg = CacheConfig::default();
        let v = view(1100);
        for (blocks, in_flight) in [(0, 0), (64, 1), (70, 300), (3, 0)] {
            let alone = pick(&[f(blocks, in_flight)], &v, &cfg).unwrap();
            // The same candidate beside one that can only lose to it (it holds nothing and is
            // busier), so that the general path picks it.
            let among = pick(&[f(blocks, in_flight), f(0, in_flight + 1)], &v, &cfg).unwrap();
            assert_eq!(among.index, 0);
            assert_eq!(alone, Choice { index: 0, ..among });
        }
    }

    #[test]
    fn prompt_tokens_queued_ahead_cost_as_uncached_ones() {
        let cfg = CacheConfig {
            queued_weight: 1.0,
            ..CacheConfig::default()
        };
        let v = view(1100);
        // Both hold one request; the one holding 1024 of the prompt is computing a 2,000-token
        // prompt for it, the other a 100-token one: 76 + 2000 against 1100 + 100.
        let c = pick(&[busy(64, 1, 2000), busy(0, 1, 100)], &v, &cfg).unwrap();
        assert_eq!(
            (c.index, c.kind, c.uncached_tokens),
            (1, DecisionKind::Miss, 1100)
        );
        // Less queued work than it saves: the cache wins.
        assert_eq!(
            pick(&[busy(64, 1, 900), busy(0, 1, 0)], &v, &cfg)
                .unwrap()
                .index,
            0
        );
        // At half an uncached token, 76 + 1000 against 1100 + 50 keeps the holder that 1 left;
        // twice the saving queued ahead (76 + 1500 against 1100) still leaves it.
        let half = CacheConfig {
            queued_weight: 0.5,
            ..CacheConfig::default()
        };
        let at = |facts: &[Facts]| pick(facts, &v, &half).unwrap().index;
        assert_eq!(at(&[busy(64, 1, 2000), busy(0, 1, 100)]), 0);
        assert_eq!(at(&[busy(64, 1, 900), busy(0, 1, 0)]), 0);
        assert_eq!(at(&[busy(64, 1, 3000), busy(0, 1, 0)]), 1);
        // `queued_weight = 0` leaves only the request count.
        let blind = CacheConfig {
            queued_weight: 0.0,
            ..CacheConfig::default()
        };
        assert_eq!(
            pick(&[busy(64, 1, 2000), busy(0, 1, 100)], &v, &blind)
                .unwrap()
                .index,
            0
        );
    }

    #[test]
    fn a_full_cache_pays_for_what_storing_the_prompt_evicts() {
        let cfg = CacheConfig {
            load_weight: 0.0,
            queued_weight: 1.0,
            ..CacheConfig::default()
        };
        let full = |f: Facts| Facts { full: true, ..f };
        let v = view(1100);
        // The holder (1024 cached) computes 1,500 tokens for earlier requests: 76 + 1500
        // against 1100 where the other has room, against 2 x 1100 where it is full too.
        let queued = busy(64, 1, 1500);
        assert_eq!(pick(&[queued, f(0, 0)], &v, &cfg).unwrap().index, 1);
        let both_full = [full(queued), full(f(0, 0))];
        assert_eq!(pick(&both_full, &v, &cfg).unwrap().index, 0);
        // A prefix nobody holds goes where it evicts nothing, even behind a short queue.
        let fresh = [f(0, 0), busy(0, 1, 500)];
        assert_eq!(
            pick(&[full(fresh[0]), fresh[1]], &v, &cfg).unwrap().index,
            1
        );
        // `eviction_weight = 0` ignores capacity; a fractional one takes the float path.
        let blind = CacheConfig {
            eviction_weight: 0.0,
            ..cfg.clone()
        };
        assert_eq!(pick(&both_full, &v, &blind).unwrap().index, 1);
        let half = CacheConfig {
            eviction_weight: 0.5,
            ..cfg
        };
        // 1.5 x 76 + 1500 against 1.5 x 1100.
        assert_eq!(pick(&both_full, &v, &half).unwrap().index, 0);
    }

    #[test]
    fn predicted_hits_are_capped_below_the_whole_prompt() {
        let cfg = CacheConfig::default();
        let c = pick(&[f(4, 0)], &view(64), &cfg).unwrap();
        assert_eq!(c.cached_tokens, 48);
        assert_eq!(c.uncached_tokens, 16);
    }

    #[test]
    fn ties_go_to_the_least_loaded() {
        let cfg = CacheConfig::default();
        for _ in 0..20 {
            let c = pick(&[f(0, 3), f(0, 1), f(0, 2)], &view(100), &cfg).unwrap();
            assert_eq!(c.index, 1);
            assert_eq!(c.kind, DecisionKind::Miss);
        }
        // Equal ties spread.
        let picks: std::collections::BTreeSet<usize> = (0..64)
            .map(|_| pick(&[f(0, 0), f(0, 0)], &view(100), &cfg).unwrap().index)
            .collect();
        assert_eq!(picks.len(), 2);
        // Evenly: each of three tied candidates about a third of the time.
        let mut counts = [0u32; 3];
        for _ in 0..3000 {
            counts[pick(&[f(0, 0); 3], &view(100), &cfg).unwrap().index] += 1;
        }
        assert!(
            counts.iter().all(|&n| (800..1200).contains(&n)),
            "{counts:?}"
        );
        // Then the one caching less; entries are read for the tied candidates only.
        let entries = [10, 0, 0];
        let mut asked = Vec::new();
        let facts = [f(0, 0), f(0, 0), f(0, 1)];
        let choice = choose(
            facts.len(),
            |i| facts[i],
            &view(100),
            &cfg,
            |i| {
                asked.push(i);
                entries[i]
            },
        );
        assert_eq!(choice.unwrap().index, 1);
        asked.sort_unstable();
        assert_eq!(asked, [0, 1]);
        // A unique cheapest candidate needs no entry count.
        let unique = [f(0, 0), f(1, 0)];
        let choice = choose(
            unique.len(),
            |i| unique[i],
            &view(100),
            &cfg,
            |_| unreachable!(),
        );
        assert_eq!(choice.unwrap().index, 1);
    }

    #[test]
    fn whole_and_fractional_weights_choose_as_the_float_cost_does() {
        // A naive reference: the float cost of every candidate, the cheapest by (cost, load).
        let reference = |facts: &[Facts], v: &PrefixView, cfg: &CacheConfig| {
            let cap = predicted_cached_tokens(u32::MAX, v.block_size, v.prompt_tokens);
            let key = |f: &Facts| {
                let cached = (f.blocks * v.block_size).min(cap);
                let cost = cfg.cache_weight * f64::from(v.prompt_tokens - cached)
                    + cfg.queued_weight * f64::from(f.computing)
                    + cfg.load_weight * f64::from(f.in_flight);
                (cost, f.in_flight)
            };
            let best = facts
                .iter()
                .map(key)
                .min_by(|a, b| a.partial_cmp(b).unwrap())
                .unwrap();
            let cheapest: Vec<usize> = (0..facts.len())
                .filter(|&i| key(&facts[i]) == best)
                .collect();
            (cheapest.len() == 1).then(|| cheapest[0])
        };
        let mut x = 7u64;
        let mut next = |n: u64| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((x >> 33) % n) as u32
        };
        let v = view(4000);
        let mut unique = 0;
        let weights = [
            (1.0, 1.0, 256.0),
            (1.0, 0.5, 256.0),
            (3.0, 2.0, 7.0),
            (0.5, 1.0, 100.25),
            (1.0, 0.25, 0.0),
            (1.0, 0.0, 3.0),
            // Not whole quarters: the float path.
            (1.0, 0.3, 2.5),
            (0.1, 1.0, 256.0),
        ];
        for (cache_weight, queued_weight, load_weight) in weights {
            let cfg = CacheConfig {
                cache_weight,
                queued_weight,
                load_weight,
                balance_abs: usize::MAX,
                ..CacheConfig::default()
            };
            for _ in 0..500 {
                let n = 1 + next(12) as usize;
                let facts: Vec<Facts> = (0..n)
                    .map(|_| busy(next(260), next(6), next(3) * next(2000)))
                    .collect();
                if let Some(want) = reference(&facts, &v, &cfg) {
                    unique += 1;
                    let got = pick(&facts, &v, &cfg).unwrap();
                    let w = (cache_weight, queued_weight, load_weight);
                    assert_eq!(got.index, want, "{facts:?} at {w:?}");
                }
            }
        }
        assert!(unique > 1000, "{unique} unique choices");
    }

    #[test]
    fn the_imbalance_guard_overrides_the_cache() {
        let cfg = CacheConfig {
            load_weight: 0.0,
            ..CacheConfig::default()
        };
        let v = view(4000);
        // Not imbalanced enough (33 - 0 > 32 needed, and relative).
        assert_eq!(pick(&[f(200, 32), f(0, 0)], &v, &cfg).unwrap().index, 0);
        let c = pick(&[f(200, 40), f(0, 2)], &v, &cfg).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.kind, DecisionKind::Imbalance);
        // Relative threshold: 100 vs 70 is within 1.5x.
        assert_eq!(pick(&[f(200, 100), f(0, 70)], &v, &cfg).unwrap().index, 0);
    }
}
