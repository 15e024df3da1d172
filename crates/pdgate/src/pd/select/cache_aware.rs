//! Cache-aware pairing: candidates weighed by the prefix each endpoint holds and its load
//! (`cache::score`), the decision recorded in the cache metrics, and the choice to let a decode
//! that holds (almost) all of the prompt serve it alone. Plain pairing is the parent module's.

use std::sync::Arc;

use crate::cache::config::CacheConfig;
use crate::cache::score::Choice;
use crate::cache::{Cache, PrefixView, Scorer};
use crate::endpoints::policy::Policy;
use crate::endpoints::{Endpoint, Load, Role, Snapshot};
use crate::error::GatewayError;
use crate::limits::under_cap;
use crate::metrics::Metrics;
use crate::pd::select::{Pair, decode_for, no_pair};
use crate::state::Routing;

/// One role's candidates for a decision, with their loads in the same order.
enum Candidates<'a> {
    /// The snapshot's whole list: every endpoint in it qualifies (the usual fleet, see
    /// [`Snapshot::all_serve`]). Copying the references out of a large list cost as much as
    /// scoring it.
    Whole(&'a [Arc<Endpoint>], &'a [Arc<Load>]),
    /// The endpoints that qualify.
    Chosen(Vec<&'a Arc<Endpoint>>, Vec<&'a Load>),
}

impl<'a> Candidates<'a> {
    /// `all` (one of `snap`'s lists) if `whole`, else those of `all` that `keep` allows, under
    /// the per-endpoint cap and without a half-open endpoint being probed.
    fn of(
        routing: &Routing,
        snap: &'a Snapshot,
        whole: bool,
        all: &'a [Arc<Endpoint>],
        keep: impl FnMut(&&'a Arc<Endpoint>) -> bool,
    ) -> Result<Self, GatewayError> {
        if whole && let Some(loads) = snap.loads_of(all) {
            return Ok(Candidates::Whole(all, loads));
        }
        let chosen: Vec<&'a Arc<Endpoint>> = if whole {
            all.iter().collect()
        } else {
            let mut chosen = Vec::with_capacity(all.len());
            chosen.extend(all.iter().filter(keep));
            under_cap(
                routing.max_in_flight_per_endpoint,
                &routing.metrics,
                routing.health.hold_back_probed(chosen),
            )?
        };
        let loads = chosen.iter().map(|e| &*e.load).collect();
        Ok(Candidates::Chosen(chosen, loads))
    }

    fn get(&self, i: usize) -> &'a Arc<Endpoint> {
        match self {
            Candidates::Whole(all, _) => &all[i],
            Candidates::Chosen(chosen, _) => chosen[i],
        }
    }
}

/// Picks among `candidates` by cache and load, weighed by `cfg`, when `policy` is cache-aware,
/// else by the policy; the prediction is `None` then. `holds`: whether the index may hold
/// anything for them (see `Scorer::choose`).
fn pick_by(
    policy: &dyn Policy,
    scorer: &mut Scorer<'_>,
    cfg: &CacheConfig,
    holds: bool,
    candidates: &Candidates<'_>,
    view: &PrefixView,
) -> Option<(Arc<Endpoint>, Option<Choice>)> {
    if !policy.cache_aware() {
        let i = match candidates {
            Candidates::Whole(all, _) => policy.pick(all)?,
            Candidates::Chosen(chosen, _) => {
                let owned: Vec<Arc<Endpoint>> = chosen.iter().map(|&e| e.clone()).collect();
                policy.pick(&owned)?
            }
        };
        return Some((Arc::clone(candidates.get(i)), None));
    }
    let choice = match candidates {
        Candidates::Whole(all, loads) => scorer.choose(all, loads, view, cfg, holds),
        Candidates::Chosen(chosen, loads) => scorer.choose(chosen, loads, view, cfg, holds),
    }?;
    Some((Arc::clone(candidates.get(choice.index)), Some(choice)))
}

/// Records a role's cache-aware decision in the cache metrics.
fn note(cache: &Cache, role: Role, choice: Option<Choice>, view: &PrefixView) {
    if let Some(c) = choice {
        cache.metrics.decision(
            role.as_str(),
            c.kind.label(),
            c.cached_tokens,
            view.prompt_tokens,
        );
    }
}

/// Cache-aware selection. With a `cache_aware` decode policy the decode is chosen first (by its
/// cache and load); if it would compute at most `decode_only_below_tokens` of the prompt (and
/// less than `decode_only_max_uncached_ratio` of it) and its connector allows it, it serves the
/// request alone. Otherwise the prefill is chosen among those that pair with it. With only the
/// prefill policy cache-aware, the prefill is chosen first, as without a cache.
pub(super) fn pair(
    routing: &Routing,
    cache: &Cache,
    snap: &Snapshot,
    model: Option<&str>,
    view: &PrefixView,
) -> Result<Pair, GatewayError> {
    let mc = cache.model(model, snap);
    let mut scorer = mc.lock();
    scorer.prepare(view);
    // Candidates are borrowed from the snapshot (a decision over a large fleet would otherwise
    // spend more on reference counts than on scoring), or are its whole lists when every
    // endpoint qualifies: no cap, no probe held back, and all serve the model and pair.
    let whole = routing.max_in_flight_per_endpoint == 0
        && snap.all_serve(model)
        && routing.health.holds_back_none();
    let serving_prefills = || snap.prefill.iter().filter(|p| p.serves(model));
    let pick_prefill = |prefills: Candidates<'_>, scorer: &mut Scorer<'_>| {
        let (prefill, choice) = pick_by(
            routing.prefill_policy.as_ref(),
            scorer,
            &cache.prefill_config,
            true,
            &prefills,
            view,
        )
        .ok_or_else(|| no_pair(snap, model))?;
        note(cache, Role::Prefill, choice, view);
        Ok::<_, GatewayError>((prefill, choice))
    };
    // The prefill's prediction (cached, uncached), or the decode's when it serves alone.
    let (prefill, decode, decode_only, predicted) = if routing.decode_policy.cache_aware() {
        let decodes = Candidates::of(routing, snap, whole, &snap.decode, |d| {
            d.serves(model) && serving_prefills().any(|p| snap.pairs(p, d))
        })?;
        let pick_decode = |scorer: &mut Scorer<'_>, cfg: &CacheConfig| {
            let policy = routing.decode_policy.as_ref();
            pick_by(policy, scorer, cfg, cache.decodes_read, &decodes, view)
                .ok_or_else(|| no_pair(snap, model))
        };
        let pairing = |p: &Endpoint, decode: &Endpoint| p.serves(model) && snap.pairs(p, decode);
        // A decode that may serve alone is weighed as a prefill is, by what it would compute.
        let alone = if cache.config.decode_only_below_tokens > 0 {
            let (decode, choice) = pick_decode(&mut scorer, &cache.config)?;
            let fits = choice.is_some_and(|c| decode_only_fits(&cache.config, c, view));
            let mut pairing_prefills = snap.prefill.iter().filter(|p| pairing(p, &decode));
            let first = pairing_prefills.clone().next().cloned();
            let allowed =
                pairing_prefills.all(|p| p.agent.as_ref().is_some_and(|a| a.allows_decode_only()));
            // The prefill only names the connector; no leg goes to it.
            first
                .filter(|_| fits && allowed)
                .map(|first| (first, decode, choice))
        } else {
            None
        };
        if let Some((first, decode, choice)) = alone {
            note(cache, Role::Decode, choice, view);
            (first, decode, true, choice)
        } else {
            // One that receives the prompt's KV computes none of it: chosen by its load (the KV
            // it holds and its requests), its cache weighing only `decode_cache_weight`, so a
            // hot family does not pile onto the decode that holds its prefix.
            let (decode, choice) = pick_decode(&mut scorer, &cache.decode_config)?;
            note(cache, Role::Decode, choice, view);
            let prefills =
                Candidates::of(routing, snap, whole, &snap.prefill, |p| pairing(p, &decode))?;
            let (prefill, p_choice) = pick_prefill(prefills, &mut scorer)?;
            (prefill, decode, false, p_choice)
        }
    } else {
        let prefills = Candidates::of(routing, snap, whole, &snap.prefill, |p| {
            p.serves(model)
                && snap
                    .decode
                    .iter()
                    .any(|d| d.serves(model) && snap.pairs(p, d))
        })?;
        let (prefill, p_choice) = pick_prefill(prefills, &mut scorer)?;
        let decode = decode_for(routing, snap, model, Some(&prefill))?;
        (prefill, decode, false, p_choice)
    };
    if !decode_only && predicted.is_some() {
        admit(&routing.metrics, &cache.config, &prefill)?;
    }
    // Both engines will hold the prompt's blocks: the prefill computed them, the decode
    // received (or computed) them and caches them too. One walk of the keys writes both (where
    // the decode's are read).
    let now = std::time::Instant::now();
    if decode_only {
        cache.metrics.decode_only();
    }
    // What a decode caches is read only where its cache may decide (`Cache::decodes_read`):
    // elsewhere its entries would be written on every decision and never read.
    let decode_read = cache.decodes_read;
    let both: [&Endpoint; 2] = [&decode, &prefill];
    let chosen = match (decode_only, decode_read) {
        (true, _) => &both[..1],
        (false, true) => &both[..],
        (false, false) => &both[1..],
    };
    scorer.record(chosen, view, now, |ep| {
        cache.metrics.events_stopped(ep.role.as_str());
    });
    Ok(Pair {
        prefill,
        decode,
        decode_only,
        predicted_cached: predicted.map(|c| c.cached_tokens),
        prefill_tokens: match predicted {
            Some(c) if !decode_only => c.uncached_tokens,
            _ => 0,
        },
        decode_tokens: view.prompt_tokens,
    })
}

/// `max_queued_prefill_tokens`: the chosen prefill (the cheapest) already has more than the
/// bound of predicted prompt tokens to compute ahead of this request, so every other one is
/// at least as far behind: shed it. An idle prefill takes any prompt, however long. Where the
/// engines' load is scraped (`engine_load_interval`), the estimate for others' requests counts
/// too, as it does in the cost.
fn admit(metrics: &Metrics, cfg: &CacheConfig, prefill: &Endpoint) -> Result<(), GatewayError> {
    let bound = cfg.max_queued_prefill_tokens as usize;
    if bound == 0 {
        return Ok(());
    }
    let (_, queued) = if cfg.engine_load_interval.is_zero() {
        prefill.load.held()
    } else {
        prefill.load.with_others()
    };
    if queued as usize <= bound {
        return Ok(());
    }
    metrics.count_rejected("queued_prefill_tokens");
    Err(GatewayError::Overloaded {
        retry_after_secs: crate::limits::RETRY_AFTER_SECS,
    })
}

/// Whether a decode choice is cheap enough to serve without a prefill leg: few uncached tokens
/// *and* a small uncached share (a short prompt that nobody cached still goes through PD,
/// unless the ratio is 1.0).
fn decode_only_fits(cfg: &CacheConfig, c: Choice, view: &PrefixView) -> bool {
    if cfg.decode_only_below_tokens == 0
        || view.prompt_tokens == 0
        || c.uncached_tokens > cfg.decode_only_below_tokens
    {
        return false;
    }
    let share = f64::from(c.uncached_tokens) / f64::from(view.prompt_tokens);
    cfg.decode_only_max_uncached_ratio >= 1.0 || share < cfg.decode_only_max_uncached_ratio
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::score::DecisionKind;
    use crate::cache::view::KeyKind;
    use crate::pd::select::pair;
    use crate::state::Gateway;

    /// A gateway with `cache_aware` on both roles over `toml`'s endpoints (and `cache`'s lines
    /// in its `[cache]`), its snapshot, and the view of a 4-block token prompt.
    fn cache_fleet(toml: &str, cache: &str) -> (Arc<Gateway>, Arc<Snapshot>, PrefixView) {
        let toml = format!(
            "kv_connector = \"shfs\"\nprefill_policy = \"cache_aware\"\n\
             decode_policy = \"cache_aware\"\n{toml}[cache]\nblock_size = 16\n{cache}"
        );
        let config = crate::config::Config::from_toml(&toml).expect("config");
        let pods = config.pods().expect("pods");
        let gw = Gateway::new(config, kvtransfer::Registry::with_builtins()).expect("gateway");
        let snap = gw.publish(&pods, &std::collections::BTreeSet::new());
        let cache = gw.routing.cache.clone().expect("a cache");
        let tokens: Vec<u32> = (0..64).collect();
        let view = cache.model(Some("b"), &snap).token_view(&tokens);
        (gw, snap, view)
    }

    /// Records that the decode named `name` and the first prefill hold `view` (model "b").
    fn seed(gw: &Gateway, snap: &Snapshot, name: &str, view: &PrefixView) {
        let cache = gw.routing.cache.as_ref().expect("a cache");
        let d = snap
            .decode
            .iter()
            .find(|d| d.name.contains(name))
            .expect(name);
        let mc = cache.model(Some("b"), snap);
        let mut scorer = mc.lock();
        scorer.prepare(view);
        scorer.record(
            &[&**d, &*snap.prefill[0]],
            view,
            std::time::Instant::now(),
            |_| {},
        );
    }

    /// A decode's cache weighed as a prefill's is.
    const AFFINE: &str = "decode_cache_weight = 1.0\n";

    #[test]
    fn a_disaggregated_decode_is_chosen_by_its_load_and_the_kv_it_holds() {
        let fleet = "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.2:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.3:8000\"\n";
        // A light request weight, so that the 64-token prompt's cache could outweigh it.
        for (cache, holder_wins) in [
            ("load_weight = 1.0\n", false),
            ("load_weight = 1.0\ndecode_cache_weight = 1.0\n", true),
        ] {
            let (gw, snap, view) = cache_fleet(fleet, cache);
            let (holder, other) = (&snap.decode[1], &snap.decode[0]);
            seed(&gw, &snap, &holder.name, &view);
            // The holder already holds the KV of a 10-token prompt: 11 against the other's 0,
            // and with its cache weighed 16 (its uncached block) + 11 against 64.
            let held = crate::endpoints::LoadGuard::computing(&holder.load, 10);
            let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
            let expected = if holder_wins { holder } else { other };
            assert_eq!(chosen.decode.name, expected.name, "{cache}");
            // The decode leg counts the whole prompt's KV in its load.
            assert_eq!(chosen.decode_tokens, 64);
            drop(held);
        }
        // Under the default weights, each request's KV steers the next one away.
        let (gw, snap, view) = cache_fleet(fleet, "");
        let mut legs = Vec::new();
        let mut chosen = Vec::new();
        for _ in 0..4 {
            let p = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
            legs.push(crate::endpoints::LoadGuard::computing(
                &p.decode.load,
                p.decode_tokens,
            ));
            chosen.push(p.decode.name.clone());
        }
        for d in snap.decode.iter() {
            assert_eq!(d.load.held(), (2, 128), "{chosen:?}");
        }
        drop(legs);
    }

    #[test]
    fn admission_counts_others_queued_tokens_where_the_engines_are_scraped() {
        let fleet = "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.2:8000\"\n";
        // Scraped by default; off, the others' load is not counted.
        let off = "engine_load_interval = \"0s\"\n";
        for (scraped, shed) in [
            (off, false),
            ("", true),
            ("engine_load_interval = \"1s\"\n", true),
        ] {
            let cache = format!("max_queued_prefill_tokens = 100\n{scraped}");
            let (gw, snap, view) = cache_fleet(fleet, &cache);
            // Another replica's requests: 2, with 500 prompt tokens to compute between them.
            snap.prefill[0].load.set_others(2, 500);
            let result = pair(&gw.routing, &snap, Some("b"), Some(&view));
            assert_eq!(
                matches!(result, Err(GatewayError::Overloaded { .. })),
                shed,
                "{cache}"
            );
        }
    }

    #[test]
    fn cache_aware_candidates_are_the_qualifying_endpoints_only() {
        let ep = |role: &str, i: usize, models: &str| {
            format!("[[{role}]]\nurl = \"http://10.0.0.{i}:8000\"\n{models}")
        };
        // Every endpoint serves every model: the whole lists are the candidates, and the decode
        // holding the prompt wins.
        let uniform: String = [
            ep("prefill", 1, ""),
            ep("decode", 2, ""),
            ep("decode", 3, ""),
        ]
        .concat();
        let (gw, snap, view) = cache_fleet(&uniform, AFFINE);
        assert!(snap.all_serve(Some("b")));
        let holder = snap.decode[1].name.clone();
        seed(&gw, &snap, &holder, &view);
        let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
        assert_eq!(chosen.decode.name, holder);
        assert_eq!(chosen.predicted_cached, Some(48));
        // A decode that serves another model only is no candidate, though it holds the prompt.
        let mixed: String = [
            ep("prefill", 1, ""),
            ep("decode", 2, "model = \"a\"\n"),
            ep("decode", 3, ""),
        ]
        .concat();
        let (gw, snap, view) = cache_fleet(&mixed, AFFINE);
        assert!(!snap.all_serve(Some("b")));
        let only_a = snap.decode[0].name.clone();
        seed(&gw, &snap, &only_a, &view);
        for _ in 0..20 {
            let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
            assert_eq!(chosen.decode.name, snap.decode[1].name);
        }
        // At the per-endpoint cap the holder is left out; all at the cap is an overload.
        let capped = format!("max_in_flight_per_endpoint = 1\n{uniform}");
        let (gw, snap, view) = cache_fleet(&capped, AFFINE);
        let holder = snap.decode[1].name.clone();
        seed(&gw, &snap, &holder, &view);
        let busy = crate::endpoints::LoadGuard::acquire(&snap.decode[1].load);
        let pair1 = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
        assert_eq!(pair1.decode.name, snap.decode[0].name);
        let also = crate::endpoints::LoadGuard::acquire(&snap.decode[0].load);
        assert!(matches!(
            pair(&gw.routing, &snap, Some("b"), Some(&view)),
            Err(GatewayError::Overloaded { .. })
        ));
        drop((busy, also));
    }

    #[test]
    fn a_prefill_computing_long_prompts_loses_a_prefix_it_holds() {
        let (gw, snap, view) = cache_fleet(
            "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n\
             [[prefill]]\nurl = \"http://10.0.0.2:8000\"\n\
             [[decode]]\nurl = \"http://10.0.0.3:8000\"\n",
            "",
        );
        let (holder, other) = (&snap.prefill[0], &snap.prefill[1]);
        seed(&gw, &snap, &snap.decode[0].name, &view);
        let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
        assert_eq!(chosen.prefill.name, holder.name);
        // 48 of the 64 tokens cached there: it computes the last block.
        assert_eq!(
            (chosen.predicted_cached, chosen.prefill_tokens),
            (Some(48), 16)
        );
        // Both hold a request; the holder's computes 1,000 prompt tokens: 16 + 1000 > 64 + 0.
        let long = crate::endpoints::LoadGuard::computing(&holder.load, 1000);
        let short = crate::endpoints::LoadGuard::acquire(&other.load);
        assert_eq!(holder.load.held(), (1, 1000));
        assert_eq!(other.load.held(), (1, 0));
        let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
        assert_eq!(chosen.prefill.name, other.name);
        assert_eq!(
            (chosen.predicted_cached, chosen.prefill_tokens),
            (Some(0), 64)
        );
        drop((long, short));
        assert_eq!(
            (holder.load.in_flight(), holder.load.computing_tokens()),
            (0, 0)
        );
    }

    #[test]
    fn a_prefill_is_weighed_by_the_time_its_queue_takes_not_its_request_count() {
        let fleet = "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n\
                     [[prefill]]\nurl = \"http://10.0.0.2:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.3:8000\"\n";
        // The holder has two requests in flight with 20 tokens left to compute; the other is
        // idle. Predicted time: 16 (its tail) + 20 queued against 64. Counting each request
        // at `load_weight` (256) as well sends the prompt away from its prefix.
        for (cache, holder_wins) in [("", true), ("prefill_load_weight = 256.0\n", false)] {
            let (gw, snap, view) = cache_fleet(fleet, cache);
            let (holder, other) = (&snap.prefill[0], &snap.prefill[1]);
            seed(&gw, &snap, &snap.decode[0].name, &view);
            let queued = [
                crate::endpoints::LoadGuard::computing(&holder.load, 10),
                crate::endpoints::LoadGuard::computing(&holder.load, 10),
            ];
            let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
            let expected = if holder_wins { holder } else { other };
            assert_eq!(chosen.prefill.name, expected.name, "{cache:?}");
            drop(queued);
        }
        // The in-flight count still breaks a tie of predicted time: neither holds the prompt,
        // both have 30 tokens queued, the first in one request, the second in three.
        let (gw, snap, view) = cache_fleet(fleet, "");
        let (one, three) = (&snap.prefill[0], &snap.prefill[1]);
        let mut held = vec![crate::endpoints::LoadGuard::computing(&one.load, 30)];
        held.extend((0..3).map(|_| crate::endpoints::LoadGuard::computing(&three.load, 10)));
        let chosen = pair(&gw.routing, &snap, Some("b"), Some(&view)).expect("a pair");
        assert_eq!(chosen.prefill.name, one.name);
        drop(held);
    }

    #[test]
    fn a_decode_chosen_by_its_load_is_reported_with_the_prefix_it_holds() {
        let fleet = "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.2:8000\"\n\
                     [[decode]]\nurl = \"http://10.0.0.3:8000\"\n";
        let (gw, snap, view) = cache_fleet(fleet, "");
        let cache = gw.routing.cache.as_ref().expect("a cache");
        assert_eq!(cache.decode_config.cache_weight, 0.0);
        let holder = snap.decode[1].name.clone();
        seed(&gw, &snap, &holder, &view);
        let mc = cache.model(Some("b"), &snap);
        let mut scorer = mc.lock();
        scorer.prepare(&view);
        // What a candidate holds weighs nothing, so both are chosen (taking turns); the chosen
        // one's prediction is still what it holds.
        let mut seen = std::collections::BTreeMap::new();
        for _ in 0..64 {
            let c = scorer
                .choose(
                    &snap.decode,
                    snap.loads_of(&snap.decode)
                        .expect("the snapshot's own list"),
                    &view,
                    &cache.decode_config,
                    true,
                )
                .expect("a choice");
            let name = snap.decode[c.index].name.clone();
            let expected = if name == holder {
                (DecisionKind::Hit, 48, 16)
            } else {
                (DecisionKind::Miss, 0, 64)
            };
            assert_eq!((c.kind, c.cached_tokens, c.uncached_tokens), expected);
            *seen.entry(name).or_insert(0) += 1;
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
        // Where the index holds nothing for decodes (their keys are written only where read),
        // what the chosen one holds is not looked up: every choice a miss, the holder too.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..64 {
            let loads = snap
                .loads_of(&snap.decode)
                .expect("the snapshot's own list");
            let c = scorer
                .choose(&snap.decode, loads, &view, &cache.decode_config, false)
                .expect("a choice");
            assert_eq!((c.kind, c.cached_tokens), (DecisionKind::Miss, 0));
            seen.insert(c.index);
        }
        assert_eq!(seen.len(), 2, "{seen:?}");
    }

    #[test]
    fn decode_only_needs_both_thresholds() {
        let view = PrefixView {
            keys: Vec::new(),
            kind: KeyKind::Tokens,
            prompt_tokens: 1000,
            block_size: 16,
        };
        let c = |uncached| Choice {
            index: 0,
            kind: DecisionKind::Hit,
            cached_tokens: 1000 - uncached,
            uncached_tokens: uncached,
        };
        let mut cfg = CacheConfig::default();
        assert!(!decode_only_fits(&cfg, c(10), &view), "0 disables");
        cfg.decode_only_below_tokens = 256;
        assert!(decode_only_fits(&cfg, c(100), &view));
        assert!(!decode_only_fits(&cfg, c(300), &view));
        let short = PrefixView {
            prompt_tokens: 100,
            ..view.clone()
        };
        let miss = Choice {
            cached_tokens: 0,
            uncached_tokens: 100,
            ..c(0)
        };
        assert!(!decode_only_fits(&cfg, miss, &short), "ratio 1.0 >= 0.7");
        cfg.decode_only_max_uncached_ratio = 1.0;
        assert!(decode_only_fits(&cfg, miss, &short));
        let empty = PrefixView {
            prompt_tokens: 0,
            ..view
        };
        assert!(!decode_only_fits(&cfg, c(0), &empty));
    }
}
