//! Tests of the cache module: model caches, scoring, event watches.

use super::events::{EventWatch, EventsNow};
use super::*;
use bytes::Bytes;

fn ep(name: &str) -> Arc<Endpoint> {
    crate::endpoints::test_endpoint(name, Role::Prefill)
}

/// The completions view of a prompt of 640 bytes of `c` (ten text blocks).
fn prompt_of(mc: &ModelCache, c: &str) -> PrefixView {
    let body = JsonBody::parse(Bytes::from(format!(r#"{{"prompt":"{}"}}"#, c.repeat(640))))
        .expect("a JSON body");
    mc.view(&body, Route::Completions)
}

fn cache() -> Cache {
    let mut registry = prometheus_client::registry::Registry::default();
    Cache::new(
        &CacheConfig::default(),
        &["m".to_string()],
        CacheMetrics::new(&mut registry),
        true,
    )
    .unwrap()
}

#[test]
fn events_that_stop_after_a_decision_switch_it_to_approximate_until_they_resume() {
    let t0 = Instant::now();
    let s = |ms: u64| t0 + Duration::from_millis(ms);
    let timeout = Duration::from_millis(100);
    let mut w = EventWatch::new(Arc::new(SubscriberStats::default()));
    // A decision that stores nothing new expects no event: no wait starts.
    assert_eq!(w.check_with(0, false, s(0), timeout), EventsNow::Flowing);
    assert_eq!(w.check_with(0, false, s(500), timeout), EventsNow::Flowing);
    // One that does, followed by a batch in time: still flowing.
    assert_eq!(w.check_with(0, true, s(600), timeout), EventsNow::Flowing);
    assert_eq!(w.check_with(1, false, s(650), timeout), EventsNow::Flowing);
    // No batch within the timeout of the first unconfirmed decision (at 700): stopped, once.
    assert_eq!(w.check_with(1, true, s(700), timeout), EventsNow::Flowing);
    assert_eq!(w.check_with(1, true, s(750), timeout), EventsNow::Flowing);
    assert_eq!(w.check_with(1, false, s(800), timeout), EventsNow::Flowing);
    assert_eq!(w.check_with(1, true, s(801), timeout), EventsNow::Stopped);
    assert_eq!(
        w.check_with(1, true, s(900), timeout),
        EventsNow::StillStopped
    );
    // A batch arrives: precise again.
    assert_eq!(w.check_with(2, true, s(950), timeout), EventsNow::Flowing);
    // A zero timeout never gives up on events.
    let mut w = EventWatch::new(Arc::new(SubscriberStats::default()));
    assert_eq!(
        w.check_with(0, true, s(0), Duration::ZERO),
        EventsNow::Flowing
    );
    assert_eq!(
        w.check_with(0, true, s(9000), Duration::ZERO),
        EventsNow::Flowing
    );
}

#[test]
fn a_recorded_decision_is_matched_and_purged_with_its_endpoint() {
    let c = cache();
    let snap = Snapshot {
        prefill: vec![ep("a:1"), ep("b:1")],
        models: vec!["m".into()],
        ..Snapshot::default()
    };
    let mc = c.model(Some("m"), &snap);
    assert_eq!(mc.label, "m");
    let view = prompt_of(&mc, "z");
    assert_eq!(view.keys.len(), 10);
    let now = Instant::now();
    {
        let mut s = mc.lock();
        s.prepare(&view);
        assert_eq!(s.facts(&snap.prefill[0]), (0, 0));
        s.record(&[&snap.prefill[0]], &view, now, |_| {});
        s.prepare(&view);
        assert_eq!(s.facts(&snap.prefill[0]), (10, 10));
        assert_eq!(s.facts(&snap.prefill[1]).0, 0);
        // Both endpoints of a decision in one walk.
        s.record(&[&snap.prefill[0], &snap.prefill[1]], &view, now, |_| {});
        s.prepare(&view);
        assert_eq!(s.facts(&snap.prefill[0]), (10, 10));
        assert_eq!(s.facts(&snap.prefill[1]), (10, 10));
    }
    // Unknown models share the default index; no label is minted for them.
    assert_eq!(c.model(Some("nope"), &snap).label, DEFAULT_MODEL);
    c.refresh_gauges();
    let gone = Snapshot {
        prefill: vec![ep("b:1")],
        models: vec!["m".into()],
        ..Snapshot::default()
    };
    c.retain(&gone);
    let mut s = mc.lock();
    s.prepare(&view);
    assert_eq!(s.facts(&snap.prefill[0]).0, 0);
    assert_eq!(s.facts(&snap.prefill[1]).0, 10);
}

#[test]
fn every_candidate_is_scored_by_its_own_blocks_whatever_the_slot_table_holds() {
    // Endpoints outside a load table all have slot 0: the ids by slot hold one of them at a
    // time, and the others must still be scored by their own entries (found by name).
    let c = cache();
    let (a, b, fresh) = (ep("a:1"), ep("b:1"), ep("c:1"));
    let snap = Snapshot {
        prefill: vec![a.clone(), b.clone()],
        models: vec!["m".into()],
        ..Snapshot::default()
    };
    let mc = c.model(Some("m"), &snap);
    let view = prompt_of(&mc, "q");
    let cfg = CacheConfig::default();
    let mut s = mc.lock();
    s.prepare(&view);
    s.record(&[&b], &view, Instant::now(), |_| {});
    s.record(&[&a], &view, Instant::now(), |_| {});
    let other = prompt_of(&mc, "w");
    s.prepare(&other);
    s.record(&[&b], &other, Instant::now(), |_| {});
    // Both hold `view`; only `b` holds `other`.
    s.prepare(&other);
    for order in [[&a, &b, &fresh], [&fresh, &a, &b], [&b, &fresh, &a]] {
        let choice = s
            .choose(&order, &loads_of(&order), &other, &cfg, true)
            .expect("a choice");
        assert!(Arc::ptr_eq(order[choice.index], &b), "{order:?}");
        assert_eq!(choice.cached_tokens, 144);
    }
    // Neither holds a third prompt: the tie goes to the one caching less, whichever holds the
    // slot (`a` holds 10 entries, `fresh`, never recorded, none).
    let third = prompt_of(&mc, "e");
    s.prepare(&third);
    for _ in 0..20 {
        for order in [[&a, &fresh], [&fresh, &a]] {
            let choice = s
                .choose(&order, &loads_of(&order), &third, &cfg, true)
                .expect("a choice");
            assert!(Arc::ptr_eq(order[choice.index], &fresh), "{order:?}");
        }
    }
    // The same name with another counter (a new snapshot outside a load table) is the same
    // endpoint to the index.
    let b_again = ep("b:1");
    s.prepare(&other);
    for order in [[&a, &b_again], [&b_again, &a]] {
        let choice = s
            .choose(&order, &loads_of(&order), &other, &cfg, true)
            .expect("a choice");
        assert!(Arc::ptr_eq(order[choice.index], &b_again));
    }
}

#[test]
fn an_adapter_shares_its_base_index_in_a_key_space_of_its_own() {
    let c = cache();
    let snap = Snapshot {
        prefill: vec![ep("a:1")],
        models: vec!["m".into()],
        adapters: Arc::new([("sql".to_string(), "m".to_string())].into()),
        ..Snapshot::default()
    };
    let base = c.model(Some("m"), &snap);
    assert!(
        Arc::ptr_eq(&base, &c.model(Some("sql"), &snap)),
        "the base model's index"
    );
    let plain = prompt_of(&base, "q");
    let sql = in_adapter_space(plain.clone(), &snap, Some("sql"));
    assert_eq!(sql.keys.len(), plain.keys.len());
    assert!(
        sql.keys.iter().all(|k| !plain.keys.contains(k)),
        "no key of the base prefix"
    );
    let mut back = sql.keys.clone();
    pdcache::keys::Space::adapter("sql").apply(&mut back);
    assert_eq!(back, plain.keys);
    // Neither the base model nor a name that is no adapter moves.
    assert_eq!(
        in_adapter_space(plain.clone(), &snap, Some("m")).keys,
        plain.keys
    );
    assert_eq!(
        in_adapter_space(plain.clone(), &snap, None).keys,
        plain.keys
    );
}

/// The loads of `eps`, in their order (what a decision reads per candidate).
fn loads_of<'a>(eps: &[&'a Arc<Endpoint>]) -> Vec<&'a crate::endpoints::Load> {
    eps.iter().map(|e| &*e.load).collect()
}
