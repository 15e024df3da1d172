//! Choosing one endpoint by cache and load: pure, so every rule has a unit test.
//!
//! cost = `cache_weight` x uncached prompt tokens + `load_weight` x in-flight requests; the
//! cheapest wins, ties go to the least loaded, then to the one caching least (then at random).
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
    /// Requests it holds now (saturated).
    pub(crate) in_flight: u32,
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

/// Among the `tied` candidates (equal on everything before), the one whose index holds the
/// fewest entries (`entries(i)`: a tie-break, so the endpoint caching less takes a new prefix
/// and distinct prefixes spread over the fleet instead of piling up), then one at random.
fn fewest_entries(
    tied: impl Iterator<Item = usize> + Clone,
    mut entries: impl FnMut(usize) -> usize,
) -> usize {
    let mut best = usize::MAX;
    let mut first = 0;
    let mut ties = 0usize;
    for i in tied.clone() {
        let n = entries(i);
        if n < best {
            (best, first, ties) = (n, i, 1);
        } else if n == best {
            ties += 1;
        }
    }
    if ties <= 1 {
        return first;
    }
    let nth = rand::rng().random_range(0..ties);
    // From the first of them on: the entry counts before it are not read again.
    tied.skip_while(|&i| i != first)
        .filter(|&i| entries(i) == best)
        .nth(nth)
        .unwrap_or(first)
}

/// Chooses among `facts` (one per candidate; none: `None`) for `view`; `entries(i)` is how
/// many entries the index holds for candidate `i`, asked only to break a tie.
///
/// Each pass over the candidates is a tight loop over their facts: the load spread for the
/// imbalance guard, then the cheapest (cost, then load) and how many tie; only when several do
/// are their entry counts read (then one of the cheapest is taken at random). Everything per
/// view (the cap on predicted hits) is computed once, so a candidate costs a few arithmetic
/// operations. (Reading each candidate once in one fused pass measured slower: 14.6 against
/// 12.5 us for the decision bench.)
pub(crate) fn choose(
    facts: &[Facts],
    view: &PrefixView,
    cfg: &CacheConfig,
    entries: impl FnMut(usize) -> usize,
) -> Option<Choice> {
    if facts.is_empty() {
        return None;
    }
    // As `predicted_cached_tokens`, with its division done once.
    let cap = predicted_cached_tokens(u32::MAX, view.block_size, view.prompt_tokens);
    let cached = |f: &Facts| f.blocks.saturating_mul(view.block_size).min(cap);
    let choice = |index: usize, kind: DecisionKind| {
        let cached_tokens = cached(&facts[index]);
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
    };
    if facts.len() == 1 {
        // Nothing to weigh (and no spread for the guard): the one candidate, with its facts.
        return Some(choice(0, DecisionKind::Miss));
    }
    let (min, max) = facts.iter().fold((u32::MAX, 0), |(lo, hi), f| {
        (lo.min(f.in_flight), hi.max(f.in_flight))
    });
    if (max - min) as usize > cfg.balance_abs && f64::from(max) > cfg.balance_rel * f64::from(min) {
        let best_by_cache = facts.iter().map(|f| f.blocks).max().unwrap_or(0);
        let idlest = (0..facts.len()).filter(|&i| facts[i].in_flight == min);
        let i = fewest_entries(idlest, entries);
        // Only an override when the cache would have sent it elsewhere.
        let kind = if best_by_cache > facts[i].blocks {
            DecisionKind::Imbalance
        } else {
            DecisionKind::Miss
        };
        return Some(choice(i, kind));
    }
    let prompt = f64::from(view.prompt_tokens);
    // (cost, load) as one integer: the cost is finite and not negative (the weights are
    // validated so, and a candidate never caches more than the prompt), and such floats order
    // as their bits do.
    let key = |f: &Facts| {
        let cost = cfg.cache_weight * (prompt - f64::from(cached(f)))
            + cfg.load_weight * f64::from(f.in_flight);
        (u128::from(cost.to_bits()) << 32) | u128::from(f.in_flight)
    };
    let (mut best, mut first, mut ties) = (u128::MAX, 0, 0usize);
    for (i, f) in facts.iter().enumerate() {
        let k = key(f);
        if k < best {
            (best, first, ties) = (k, i, 1);
        } else if k == best {
            ties += 1;
        }
    }
    let index = if ties > 1 {
        let tied = (first..facts.len()).filter(|&i| key(&facts[i]) == best);
        fewest_entries(tied, entries)
    } else {
        first
    };
    Some(choice(index, DecisionKind::Miss))
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
        Facts { blocks, in_flight }
    }

    /// `choose` with no entries anywhere.
    fn pick(facts: &[Facts], view: &PrefixView, cfg: &CacheConfig) -> Option<Choice> {
        choose(facts, view, cfg, |_| 0)
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
        // Then the one caching less; entries are read for the tied candidates only.
        let entries = [10, 0, 0];
        let mut asked = Vec::new();
        let facts = [f(0, 0), f(0, 0), f(0, 1)];
        let choice = choose(&facts, &view(100), &cfg, |i| {
            asked.push(i);
            entries[i]
        });
        assert_eq!(choice.unwrap().index, 1);
        assert_eq!(asked, [0, 1]);
        // A unique cheapest candidate needs no entry count.
        let choice = choose(&[f(0, 0), f(1, 0)], &view(100), &cfg, |_| unreachable!());
        assert_eq!(choice.unwrap().index, 1);
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
