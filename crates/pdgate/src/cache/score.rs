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

/// One candidate's facts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Leading blocks of the prompt it holds.
    pub(crate) blocks: u32,
    /// Requests it holds now.
    pub(crate) in_flight: usize,
    /// Entries the index holds for it (a tie-break: the endpoint caching less takes a new
    /// prefix, so distinct prefixes spread over the fleet instead of piling up at random).
    pub(crate) entries: usize,
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

fn least_loaded(facts: &[Facts], among: impl Iterator<Item = usize> + Clone) -> usize {
    let rank = |i: usize| (facts[i].in_flight, facts[i].entries);
    let min = among.clone().map(rank).min().unwrap_or((0, 0));
    let ties = among.clone().filter(|&i| rank(i) == min).count();
    let nth = if ties > 1 {
        rand::rng().random_range(0..ties)
    } else {
        0
    };
    among.filter(|&i| rank(i) == min).nth(nth).unwrap_or(0)
}

/// Chooses among `facts` (one per candidate, non-empty) for `view`.
///
/// One pass over the candidates finds the cheapest (cost, then load, then entries) and how many
/// tie; a second picks one of the ties at random. Everything per view (the cap on predicted
/// hits) is computed once, so a candidate costs a few arithmetic operations.
pub(crate) fn choose(facts: &[Facts], view: &PrefixView, cfg: &CacheConfig) -> Option<Choice> {
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
    let (min, max) = facts.iter().fold((usize::MAX, 0), |(lo, hi), f| {
        (lo.min(f.in_flight), hi.max(f.in_flight))
    });
    if max - min > cfg.balance_abs && max as f64 > cfg.balance_rel * min as f64 {
        let best_by_cache = facts.iter().map(|f| f.blocks).max().unwrap_or(0);
        let i = least_loaded(facts, 0..facts.len());
        // Only an override when the cache would have sent it elsewhere.
        let kind = if best_by_cache > facts[i].blocks {
            DecisionKind::Imbalance
        } else {
            DecisionKind::Miss
        };
        return Some(choice(i, kind));
    }
    let prompt = f64::from(view.prompt_tokens);
    let cost = |f: &Facts| {
        cfg.cache_weight * (prompt - f64::from(cached(f))) + cfg.load_weight * f.in_flight as f64
    };
    let mut best = (f64::INFINITY, usize::MAX, usize::MAX);
    let mut ties = 0usize;
    let mut first = 0;
    for (i, f) in facts.iter().enumerate() {
        let key = (cost(f), f.in_flight, f.entries);
        if key.0 < best.0 || (key.0 == best.0 && (key.1, key.2) < (best.1, best.2)) {
            best = key;
            ties = 1;
            first = i;
        } else if key == best {
            ties += 1;
        }
    }
    let index = if ties > 1 {
        let nth = rand::rng().random_range(0..ties);
        facts
            .iter()
            .enumerate()
            .skip(first)
            .filter(|(_, f)| (cost(f), f.in_flight, f.entries) == best)
            .nth(nth)
            .map_or(first, |(i, _)| i)
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

    fn f(blocks: u32, in_flight: usize) -> Facts {
        Facts {
            blocks,
            in_flight,
            entries: 0,
        }
    }

    #[test]
    fn the_cached_endpoint_wins_unless_its_load_costs_more() {
        let cfg = CacheConfig::default();
        let v = view(1100);
        let c = choose(&[f(0, 0), f(64, 1)], &v, &cfg).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.kind, DecisionKind::Hit);
        assert_eq!(c.cached_tokens, 1024);
        assert_eq!(c.uncached_tokens, 76);
        // 1024 cached tokens are worth 4 in-flight requests at the default load weight.
        assert_eq!(choose(&[f(0, 0), f(64, 5)], &v, &cfg).unwrap().index, 0);
        assert_eq!(choose(&[], &v, &cfg), None);
    }

    #[test]
    fn predicted_hits_are_capped_below_the_whole_prompt() {
        let cfg = CacheConfig::default();
        let c = choose(&[f(4, 0)], &view(64), &cfg).unwrap();
        assert_eq!(c.cached_tokens, 48);
        assert_eq!(c.uncached_tokens, 16);
    }

    #[test]
    fn ties_go_to_the_least_loaded() {
        let cfg = CacheConfig::default();
        for _ in 0..20 {
            let c = choose(&[f(0, 3), f(0, 1), f(0, 2)], &view(100), &cfg).unwrap();
            assert_eq!(c.index, 1);
            assert_eq!(c.kind, DecisionKind::Miss);
        }
        // Equal ties spread.
        let picks: std::collections::BTreeSet<usize> = (0..64)
            .map(|_| choose(&[f(0, 0), f(0, 0)], &view(100), &cfg).unwrap().index)
            .collect();
        assert_eq!(picks.len(), 2);
        // Then the one caching less.
        let mut facts = [f(0, 0), f(0, 0)];
        facts[0].entries = 10;
        assert_eq!(choose(&facts, &view(100), &cfg).unwrap().index, 1);
    }

    #[test]
    fn the_imbalance_guard_overrides_the_cache() {
        let cfg = CacheConfig {
            load_weight: 0.0,
            ..CacheConfig::default()
        };
        let v = view(4000);
        // Not imbalanced enough (33 - 0 > 32 needed, and relative).
        assert_eq!(choose(&[f(200, 32), f(0, 0)], &v, &cfg).unwrap().index, 0);
        let c = choose(&[f(200, 40), f(0, 2)], &v, &cfg).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.kind, DecisionKind::Imbalance);
        // Relative threshold: 100 vs 70 is within 1.5x.
        assert_eq!(choose(&[f(200, 100), f(0, 70)], &v, &cfg).unwrap().index, 0);
    }
}
