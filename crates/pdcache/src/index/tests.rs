use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::events::{BlockHash, BlockRemoved};
use crate::keys::token_keys;

fn index(capacity: usize) -> (CacheIndex, Instant) {
    let t0 = Instant::now();
    let config = IndexConfig {
        capacity_per_endpoint: capacity,
        ..IndexConfig::default()
    };
    (CacheIndex::new(config, t0), t0)
}

fn keys(ids: &[u64]) -> Vec<BlockKey> {
    ids.iter().map(|&k| BlockKey(k)).collect()
}

fn matches(idx: &CacheIndex, ks: &[BlockKey]) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    idx.match_prefix(ks, &mut out);
    let mut v: Vec<(u16, u32)> = out.iter().map(|m| (m.endpoint.0, m.blocks)).collect();
    v.sort_unstable();
    v
}

fn ep(idx: &mut CacheIndex) -> EndpointId {
    idx.add_endpoint().expect("room")
}

#[test]
fn longest_consecutive_prefix_per_endpoint() {
    let (mut idx, t0) = index(100);
    let (a, b, c) = (ep(&mut idx), ep(&mut idx), ep(&mut idx));
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4]), t0);
    idx.insert_approximate(b, &keys(&[1, 2]), t0);
    // c holds blocks 0 and 2 but not 1: only the first counts.
    idx.insert_approximate(c, &keys(&[1, 3]), t0);
    assert_eq!(
        matches(&idx, &keys(&[1, 2, 3, 9])),
        [(a.0, 3), (b.0, 2), (c.0, 1)]
    );
    assert_eq!(
        matches(&idx, &keys(&[2, 3])),
        [(a.0, 2), (b.0, 1)],
        "keys name prefixes; a mid-prompt key matches only where it was stored"
    );
    assert_eq!(matches(&idx, &keys(&[7])), []);
    assert_eq!(matches(&idx, &[]), []);
}

#[test]
fn keys_on_many_endpoints_switch_to_bitmaps_and_back() {
    let (mut idx, t0) = index(100);
    let eps: Vec<EndpointId> = (0..100).map(|_| ep(&mut idx)).collect();
    for (n, &e) in eps.iter().enumerate() {
        // Everyone shares [10, 11]; endpoint n continues with its own blocks, n % 5 of them.
        let mut ks = vec![10, 11];
        ks.extend((0..(n % 5) as u64).map(|j| 1000 + 10 * n as u64 + j));
        idx.insert_approximate(e, &keys(&ks), t0);
    }
    let s = idx.stats();
    assert_eq!(s.wide_keys, 2);
    let probe = keys(&[10, 11, 1000 + 10 * 7, 1000 + 10 * 7 + 1]);
    let got = matches(&idx, &probe);
    assert_eq!(got.len(), 100);
    for (e, blocks) in got {
        let expect = if e == 7 { 4 } else { 2 };
        assert_eq!(blocks, expect, "endpoint {e}");
    }
    // A narrow key after a wide one, and a wide one after a narrow one.
    idx.insert_approximate(eps[3], &keys(&[5, 10]), t0);
    assert_eq!(matches(&idx, &keys(&[5, 10, 11])), [(3, 3)]);
    for &e in &eps[..95] {
        idx.clear_endpoint(e);
    }
    assert_eq!(matches(&idx, &keys(&[10, 11])).len(), 5);
    for &e in &eps[95..] {
        idx.remove_endpoint(e);
    }
    let s = idx.stats();
    assert_eq!((s.entries, s.keys, s.wide_keys), (0, 0, 0));
}

#[test]
fn lru_evicts_the_least_recently_used_and_guesses_before_facts() {
    let (mut idx, t0) = index(4);
    let a = ep(&mut idx);
    // A prompt's keys are used tail first, as an engine frees them: 4, 3, 2, 1.
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4]), t0);
    idx.insert_approximate(a, &keys(&[4]), t0); // 4 is now the most recent
    idx.insert_approximate(a, &keys(&[5]), t0);
    assert_eq!(idx.endpoint_len(a), 4);
    assert_eq!(
        matches(&idx, &keys(&[3])),
        [],
        "3 was the least recently used"
    );
    assert_eq!(matches(&idx, &keys(&[4])), [(a.0, 1)]);
    assert_eq!(matches(&idx, &keys(&[1, 2])), [(a.0, 2)]);
    // Precise entries outlive guesses under pressure.
    let (mut idx, t0) = index(2);
    let b = ep(&mut idx);
    let stored = BlockStored::new(vec![BlockHash::Uint(1)], None, vec![7, 7], 2);
    idx.apply_event(b, &KvEvent::BlockStored(stored), t0);
    idx.insert_speculative(b, &keys(&[50, 51]), t0);
    assert_eq!(idx.stats().precise, 1);
    assert_eq!(matches(&idx, &token_keys(&[7, 7], 2)), [(b.0, 1)]);
}

#[test]
fn approximate_and_speculative_entries_expire_on_the_injected_clock() {
    let (mut idx, t0) = index(100);
    let (a, b) = (ep(&mut idx), ep(&mut idx));
    idx.insert_approximate(a, &keys(&[1, 2]), t0);
    idx.insert_speculative(b, &keys(&[1, 2]), t0);
    idx.expire(t0 + Duration::from_secs(1));
    assert_eq!(matches(&idx, &keys(&[1, 2])), [(a.0, 2), (b.0, 2)]);
    idx.expire(t0 + Duration::from_secs(3));
    assert_eq!(
        matches(&idx, &keys(&[1, 2])),
        [(a.0, 2)],
        "speculative gone after 2 s"
    );
    // A refresh extends the approximate life.
    idx.insert_approximate(a, &keys(&[1]), t0 + Duration::from_secs(100));
    idx.expire(t0 + Duration::from_secs(150));
    assert_eq!(matches(&idx, &keys(&[1, 2])), [(a.0, 1)]);
    idx.expire(t0 + Duration::from_secs(221));
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn events_confirm_speculation_chain_parents_and_remove_by_engine_hash() {
    let (mut idx, t0) = index(100);
    let a = ep(&mut idx);
    let tokens: Vec<u32> = (0..12).collect();
    let ks = token_keys(&tokens, 4);
    idx.insert_speculative(a, &ks, t0);
    let first = BlockStored::new(vec![BlockHash::Uint(100)], None, tokens[..4].to_vec(), 4);
    let rest = BlockStored::new(
        vec![200.into(), 300.into()],
        Some(100.into()),
        tokens[4..].to_vec(),
        4,
    );
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(first), KvEvent::BlockStored(rest)],
        data_parallel_rank: Some(0),
    };
    let st = idx.apply_batch(a, &batch, t0);
    assert_eq!((st.stored, st.orphaned), (3, 0));
    assert_eq!(idx.stats().precise, 3);
    idx.expire(t0 + Duration::from_secs(10));
    assert_eq!(
        matches(&idx, &ks),
        [(a.0, 3)],
        "confirmed entries do not expire"
    );
    // Removing the middle block cuts the prefix at 1.
    let st = idx.apply_event(
        a,
        &KvEvent::BlockRemoved(BlockRemoved::new(vec![200.into(), 999.into()])),
        t0,
    );
    assert_eq!(st.removed, 1);
    assert_eq!(matches(&idx, &ks), [(a.0, 1)]);
    // A store whose parent is unknown cannot be keyed.
    let orphan = BlockStored::new(vec![400.into()], Some(12345.into()), vec![1, 2, 3, 4], 4);
    assert_eq!(
        idx.apply_event(a, &KvEvent::BlockStored(orphan), t0)
            .orphaned,
        1
    );
    // Other groups, other media and malformed stores are ignored.
    let mut other = BlockStored::new(vec![500.into()], None, tokens[..4].to_vec(), 4);
    other.group_idx = Some(1);
    let mut cpu = other.clone();
    cpu.group_idx = Some(0);
    cpu.medium = Some("CPU".into());
    let bad = BlockStored::new(vec![600.into()], None, vec![1, 2, 3], 4);
    for e in [other, cpu, bad] {
        assert_eq!(idx.apply_event(a, &KvEvent::BlockStored(e), t0).ignored, 1);
    }
    assert_eq!(
        idx.apply_event(a, &KvEvent::AllBlocksCleared, t0).cleared,
        1
    );
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn endpoint_ids_are_reused_without_stale_entries() {
    let (mut idx, t0) = index(100);
    let a = ep(&mut idx);
    idx.insert_approximate(a, &keys(&[1]), t0);
    idx.remove_endpoint(a);
    let b = ep(&mut idx);
    assert_eq!(a, b);
    assert_eq!(matches(&idx, &keys(&[1])), []);
    idx.remove_endpoint(EndpointId(999));
    idx.insert_approximate(EndpointId(999), &keys(&[1]), t0);
    assert_eq!(idx.stats().entries, 0, "unknown endpoints are ignored");
}

#[test]
fn predicted_cached_tokens_follows_vllm() {
    // 140 tokens, block 32, 4 blocks cached: 128.
    assert_eq!(predicted_cached_tokens(4, 32, 140), 128);
    // A fully cached prompt of exactly 4 blocks recomputes the last block.
    assert_eq!(predicted_cached_tokens(4, 32, 128), 96);
    assert_eq!(predicted_cached_tokens(0, 32, 128), 0);
    assert_eq!(predicted_cached_tokens(3, 0, 0), 0);
}

#[derive(Debug, Clone)]
enum Op {
    Store(u16, u8, u64),
    Remove(u16, u64),
    Clear(u16),
    Approx(u16, Vec<u8>),
    Match(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..12u16, 0..6u8, 0..40u64).prop_map(|(e, k, h)| Op::Store(e, k, h)),
        (0..12u16, 0..40u64).prop_map(|(e, h)| Op::Remove(e, h)),
        (0..12u16).prop_map(Op::Clear),
        (0..12u16, proptest::collection::vec(0..6u8, 0..4)).prop_map(|(e, k)| Op::Approx(e, k)),
        proptest::collection::vec(0..6u8, 0..12).prop_map(Op::Match),
    ]
}

proptest! {
    /// The index against a naive model (a set of keys per endpoint), with few keys and up to 12
    /// endpoints so keys cross the narrow/wide threshold both ways.
    #[test]
    fn agrees_with_a_naive_model(ops in proptest::collection::vec(op(), 1..200)) {
        let (mut idx, t0) = index(1 << 20);
        let eps: Vec<EndpointId> = (0..12).map(|_| ep(&mut idx)).collect();
        let mut model: HashMap<u16, HashSet<u64>> = HashMap::new();
        // Precise entries by engine hash, per endpoint, as the model sees them.
        let mut engine: HashMap<(u16, u64), u64> = HashMap::new();
        let key_of = |k: u8| token_keys(&[u32::from(k)], 1)[0].0;
        for op in ops {
            match op {
                Op::Store(e, k, h) => {
                    let s = BlockStored::new(vec![h.into()], None, vec![u32::from(k)], 1);
                    idx.apply_event(eps[usize::from(e)], &KvEvent::BlockStored(s), t0);
                    if let Some(old) = engine.insert((e, h), key_of(k))
                        && old != key_of(k)
                    {
                        model.entry(e).or_default().remove(&old);
                    }
                    // The same key stored under a new engine hash: the old hash maps no more.
                    engine.retain(|&(e2, h2), v| !(e2 == e && h2 != h && *v == key_of(k)));
                    model.entry(e).or_default().insert(key_of(k));
                }
                Op::Remove(e, h) => {
                    let r = BlockRemoved::new(vec![h.into()]);
                    idx.apply_event(eps[usize::from(e)], &KvEvent::BlockRemoved(r), t0);
                    if let Some(k) = engine.remove(&(e, h)) {
                        model.entry(e).or_default().remove(&k);
                    }
                }
                Op::Clear(e) => {
                    idx.clear_endpoint(eps[usize::from(e)]);
                    model.remove(&e);
                    engine.retain(|&(e2, _), _| e2 != e);
                }
                Op::Approx(e, ks) => {
                    let ks: Vec<BlockKey> = ks.iter().map(|&k| BlockKey(key_of(k))).collect();
                    idx.insert_approximate(eps[usize::from(e)], &ks, t0);
                    model.entry(e).or_default().extend(ks.iter().map(|k| k.0));
                }
                Op::Match(ks) => {
                    let ks: Vec<BlockKey> = ks.iter().map(|&k| BlockKey(key_of(k))).collect();
                    let mut want: Vec<(u16, u32)> = model
                        .iter()
                        .map(|(&e, set)| (e, ks.iter().take_while(|k| set.contains(&k.0)).count() as u32))
                        .filter(|&(_, n)| n > 0)
                        .collect();
                    want.sort_unstable();
                    prop_assert_eq!(matches(&idx, &ks), want);
                }
            }
        }
        let total: usize = model.values().map(HashSet::len).sum();
        prop_assert_eq!(idx.stats().entries, total);
    }
}

/// The tokens of prompt `variant` of family `family`, `len` blocks of one token: its first 10
/// blocks are the family's, the rest its own.
fn family_tokens(family: u8, variant: u8, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            let own = if i < 10 { 0 } else { u32::from(variant) + 1 };
            u32::from(family) * 10_000 + own * 100 + i
        })
        .collect()
}

/// The keys of [`family_tokens`].
fn family_prompt(family: u8, variant: u8, len: usize) -> Vec<BlockKey> {
    token_keys(&family_tokens(family, variant, len), 1)
}

#[derive(Debug, Clone)]
enum PromptOp {
    /// A decision wrote prompt (family, variant, len) for these endpoints, speculatively or not.
    Decide(Vec<u16>, (u8, u8, usize), bool),
    /// Endpoint `e`'s engine stored prompt (family, variant, len) in one event, forwards.
    Stored(u16, (u8, u8, usize)),
    Clear(u16),
    Match((u8, u8, usize)),
}

fn prompt_op() -> impl Strategy<Value = PromptOp> {
    let prompt = (0..3u8, 0..3u8, 1..40usize);
    prop_oneof![
        (
            proptest::collection::vec(0..10u16, 1..4),
            prompt.clone(),
            any::<bool>()
        )
            .prop_map(|(t, p, s)| PromptOp::Decide(t, p, s)),
        (0..10u16, prompt.clone()).prop_map(|(e, p)| PromptOp::Stored(e, p)),
        (0..10u16).prop_map(PromptOp::Clear),
        prompt.prop_map(PromptOp::Match),
    ]
}

proptest! {
    /// A walk following each endpoint's entries through the slab finds what looking each key
    /// up for each endpoint finds, over long chained prompts written by decisions (last key
    /// first, several targets interleaved) and by events (first key first), with endpoints
    /// evicting at a small capacity and slots freed and reused.
    #[test]
    fn walks_agree_with_lookups_per_endpoint(ops in proptest::collection::vec(prompt_op(), 1..80)) {
        let (mut idx, t0) = index(64);
        let eps: Vec<EndpointId> = (0..10).map(|_| ep(&mut idx)).collect();
        let mut hash = 0u64;
        for op in ops {
            match op {
                PromptOp::Decide(targets, (f, v, len), speculative) => {
                    let kind = if speculative {
                        EntryKind::Speculative
                    } else {
                        EntryKind::Approximate
                    };
                    let targets: Vec<(EndpointId, EntryKind)> =
                        targets.iter().map(|&e| (eps[usize::from(e)], kind)).collect();
                    idx.insert_decisions(&targets, &family_prompt(f, v, len), t0);
                }
                PromptOp::Stored(e, (f, v, len)) => {
                    let hashes: Vec<BlockHash> = (0..len)
                        .map(|_| {
                            hash += 1;
                            BlockHash::Uint(hash)
                        })
                        .collect();
                    let s = BlockStored::new(hashes, None, family_tokens(f, v, len), 1);
                    idx.apply_event(eps[usize::from(e)], &KvEvent::BlockStored(s), t0);
                }
                PromptOp::Clear(e) => idx.clear_endpoint(eps[usize::from(e)]),
                PromptOp::Match((f, v, len)) => {
                    let ks = family_prompt(f, v, len);
                    let mut want: Vec<(u16, u32)> = eps
                        .iter()
                        .map(|&e| {
                            let held = ks
                                .iter()
                                .take_while(|k| {
                                    idx.posting(k.0)
                                        .and_then(|p| idx.find_in(p, k.0, e.0))
                                        .is_some()
                                })
                                .count();
                            (e.0, held as u32)
                        })
                        .filter(|&(_, n)| n > 0)
                        .collect();
                    want.sort_unstable();
                    prop_assert_eq!(matches(&idx, &ks), want);
                }
            }
        }
    }
}

#[test]
fn one_walk_writes_every_target_of_a_decision() {
    let (mut idx, t0) = index(6);
    let eps: Vec<EndpointId> = (0..12).map(|_| ep(&mut idx)).collect();
    // Ten endpoints already hold [1, 2] (a wide key), one holds [1] precisely.
    for &e in &eps[..10] {
        idx.insert_approximate(e, &keys(&[1, 2]), t0);
    }
    let stored = BlockStored::new(vec![BlockHash::Uint(7)], None, (0..4).collect(), 4);
    idx.apply_event(eps[10], &KvEvent::BlockStored(stored), t0);
    let precise = token_keys(&(0..4).collect::<Vec<u32>>(), 4);
    let prompt = [precise[0], BlockKey(2), BlockKey(3)];
    let targets = [
        (eps[0], EntryKind::Approximate),
        (eps[10], EntryKind::Speculative),
        (eps[11], EntryKind::Speculative),
        (eps[0], EntryKind::Speculative),
        (eps[1], EntryKind::Precise),
    ];
    idx.insert_decisions(&targets, &prompt, t0);
    let mut blocks = Vec::new();
    idx.match_blocks(&prompt, &mut blocks);
    assert_eq!(blocks.len(), 12);
    assert_eq!(
        blocks[usize::from(eps[0].0)],
        3,
        "the first of duplicate targets counts"
    );
    assert_eq!(blocks[usize::from(eps[10].0)], 3);
    assert_eq!(blocks[usize::from(eps[11].0)], 3);
    assert_eq!(
        blocks[usize::from(eps[1].0)],
        0,
        "a precise target is skipped"
    );
    // The precise entry stays precise; the new ones are what their target asked for.
    let s = idx.stats();
    assert_eq!(s.precise, 1);
    assert_eq!(s.speculative, 5);
    assert_eq!(s.approximate, 20 + 2);
    // The same as one insert per target, key for key.
    let mut one_by_one = Vec::new();
    idx.match_prefix(&keys(&[1, 2]), &mut one_by_one);
    assert_eq!(one_by_one.len(), 10);
    // Capacity still holds per endpoint (6), evicting the oldest: the prompt's tail, as an
    // engine would.
    let long: Vec<BlockKey> = (100..110).map(BlockKey).collect();
    idx.insert_decisions(
        &[
            (eps[2], EntryKind::Approximate),
            (eps[3], EntryKind::Approximate),
        ],
        &long,
        t0,
    );
    assert_eq!(idx.endpoint_len(eps[2]), 6);
    assert_eq!(idx.endpoint_len(eps[3]), 6);
    idx.match_blocks(&long, &mut blocks);
    assert_eq!(blocks[usize::from(eps[2].0)], 6);
    assert_eq!(blocks[usize::from(eps[3].0)], 6);
}

#[test]
fn a_refresh_within_a_fraction_of_the_ttl_changes_nothing() {
    let (mut idx, t0) = index(100);
    let a = ep(&mut idx);
    let ttl = IndexConfig::default().approximate_ttl;
    let window = ttl / REFRESH_DIVISOR;
    let at = |d: Duration| t0 + d;
    idx.insert_approximate(a, &keys(&[1, 2]), t0);
    // Within the window: skipped, so the entries still expire one TTL after the insert.
    idx.insert_approximate(a, &keys(&[1, 2]), at(window / 2));
    idx.expire(at(ttl + Duration::from_millis(200)));
    assert_eq!(matches(&idx, &keys(&[1, 2])), [], "expired on time");
    // Past the window a refresh extends the life.
    let t1 = ttl * 2;
    idx.insert_approximate(a, &keys(&[1, 2]), at(t1));
    let t2 = t1 + window * 2;
    idx.insert_approximate(a, &keys(&[1, 2]), at(t2));
    idx.expire(at(t1 + ttl + window / 2));
    assert_eq!(matches(&idx, &keys(&[1, 2])), [(a.0, 2)]);
    // Within the window, a longer prompt: the shared keys are skipped, the new one written.
    idx.insert_approximate(a, &keys(&[1, 2, 3]), at(t2 + window / 2));
    assert_eq!(matches(&idx, &keys(&[1, 2, 3])), [(a.0, 3)]);
    idx.expire(at(t2 + ttl + Duration::from_millis(200)));
    assert_eq!(
        matches(&idx, &keys(&[1, 2, 3])),
        [],
        "1 and 2 expired on time"
    );
    assert_eq!(matches(&idx, &keys(&[3])), [(a.0, 1)]);
    idx.expire(at(t2 + window / 2 + ttl + Duration::from_millis(200)));
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn skipped_keys_are_written_again_once_the_endpoint_lost_any() {
    let (mut idx, t0) = index(100);
    let a = ep(&mut idx);
    let tokens: Vec<u32> = (0..12).collect();
    let ks = token_keys(&tokens, 4);
    // Precise entries for the first two blocks, then decisions shortly after each other.
    let stored = BlockStored::new(vec![1.into(), 2.into()], None, tokens[..8].to_vec(), 4);
    idx.apply_event(a, &KvEvent::BlockStored(stored), t0);
    idx.insert_speculative(a, &ks, t0);
    assert_eq!(matches(&idx, &ks), [(a.0, 3)]);
    let removed = BlockRemoved::new(vec![1.into()]);
    idx.apply_event(a, &KvEvent::BlockRemoved(removed), t0);
    assert_eq!(matches(&idx, &ks), []);
    // The same prompt again within the window: the removed block is speculated again.
    idx.insert_speculative(a, &ks, t0 + Duration::from_millis(20));
    assert_eq!(matches(&idx, &ks), [(a.0, 3)]);
    let s = idx.stats();
    assert_eq!((s.precise, s.speculative), (1, 2));
    // Expiry is a loss too: after the speculative TTL the guesses are gone and written anew.
    idx.expire(t0 + Duration::from_secs(3));
    assert_eq!(matches(&idx, &ks), []);
    idx.insert_speculative(a, &ks, t0 + Duration::from_secs(3));
    assert_eq!(matches(&idx, &ks), [(a.0, 3)]);
    // A cleared endpoint, and a reused id, start without a memo.
    idx.clear_endpoint(a);
    idx.insert_speculative(a, &ks, t0 + Duration::from_secs(3));
    assert_eq!(matches(&idx, &ks), [(a.0, 3)]);
    idx.remove_endpoint(a);
    let b = ep(&mut idx);
    idx.insert_speculative(b, &ks, t0 + Duration::from_secs(3));
    assert_eq!(matches(&idx, &ks), [(b.0, 3)]);
}

#[test]
fn near_capacity_every_refresh_moves_the_entry() {
    // At more than half the capacity a refresh within the window still counts as a use.
    let (mut idx, t0) = index(6);
    let a = ep(&mut idx);
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4]), t0);
    idx.insert_approximate(a, &keys(&[4]), t0 + Duration::from_millis(10));
    idx.insert_approximate(a, &keys(&[5, 6, 7]), t0 + Duration::from_millis(20));
    assert_eq!(matches(&idx, &keys(&[4])), [(a.0, 1)]);
    assert_eq!(
        matches(&idx, &keys(&[3])),
        [],
        "3 was the least recently used"
    );
}

#[test]
fn a_prompt_that_diverges_from_the_last_one_writes_its_own_keys() {
    // The memo of the last decision compares chained keys at checkpoints: a prompt that shares
    // only a prefix with the last one skips that prefix and writes the rest.
    let (mut idx, t0) = index(1000);
    let a = ep(&mut idx);
    let first: Vec<u32> = (0..256).collect();
    let mut second = first.clone();
    for t in &mut second[100..] {
        *t += 1000;
    }
    let (k1, k2) = (token_keys(&first, 4), token_keys(&second, 4));
    assert_eq!(k1.len(), 64);
    assert_eq!(k1[..25], k2[..25]);
    assert_ne!(k1[25], k2[25]);
    idx.insert_approximate(a, &k1, t0);
    idx.insert_approximate(a, &k2, t0 + Duration::from_millis(5));
    assert_eq!(matches(&idx, &k1), [(a.0, 64)]);
    assert_eq!(matches(&idx, &k2), [(a.0, 64)]);
    assert_eq!(idx.stats().entries, 64 + 39);
    // The same prompt again writes nothing new.
    idx.insert_approximate(a, &k2, t0 + Duration::from_millis(10));
    assert_eq!(idx.stats().entries, 64 + 39);
}

#[test]
fn whole_bitmap_words_match_as_single_endpoints_do() {
    // 150 endpoints: bitmap words 0 and 1 full, word 2 partial. Keys 1 and 2 are held by all,
    // key 3 by words 0 and 2 (word 1 drops whole at key 3), key 4 by endpoint 5 alone.
    let (mut idx, t0) = index(100);
    let eps: Vec<EndpointId> = (0..150).map(|_| ep(&mut idx)).collect();
    let holds = |e: usize, k: u64| match k {
        1 | 2 => true,
        3 => !(64..128).contains(&e),
        _ => e == 5,
    };
    for (e, &id) in eps.iter().enumerate() {
        let held: Vec<u64> = (1..=4).filter(|&k| holds(e, k)).collect();
        idx.insert_approximate(id, &keys(&held), t0);
    }
    for prompt in [&[1, 2, 3][..], &[1, 2, 3, 4], &[1, 2], &[2, 3]] {
        let ks = keys(prompt);
        let want: Vec<(u16, u32)> = (0..150)
            .map(|e| {
                (
                    e as u16,
                    ks.iter().take_while(|k| holds(e, k.0)).count() as u32,
                )
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(matches(&idx, &ks), want, "list, prompt {prompt:?}");
        let mut blocks = Vec::new();
        idx.match_blocks(&ks, &mut blocks);
        let dense: Vec<(u16, u32)> = blocks
            .iter()
            .enumerate()
            .map(|(e, &n)| (e as u16, n))
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(dense, want, "table, prompt {prompt:?}");
    }
}

#[test]
fn adapter_events_land_in_the_adapter_space_only() {
    use crate::events::ExtraKeys;
    use crate::keys::{Space, token_keys_in};
    let (mut idx, t0) = index(100);
    let a = ep(&mut idx);
    let tokens: Vec<u32> = (0..8).collect();
    let mut first = BlockStored::new(vec![BlockHash::Uint(11)], None, tokens[..4].to_vec(), 4);
    first.set_lora("sql", 1);
    let mut second = BlockStored::new(
        vec![BlockHash::Uint(12)],
        Some(BlockHash::Uint(11)),
        tokens[4..].to_vec(),
        4,
    );
    second.set_lora("sql", 1);
    idx.apply_event(a, &KvEvent::BlockStored(first), t0);
    idx.apply_event(a, &KvEvent::BlockStored(second), t0);
    let sql = token_keys_in(Space::adapter("sql"), &tokens, 4);
    assert_eq!(matches(&idx, &sql), [(a.0, 2)]);
    assert_eq!(
        matches(&idx, &token_keys(&tokens, 4)),
        [],
        "not the base prefix"
    );
    let other = token_keys_in(Space::adapter("chat"), &tokens, 4);
    assert_eq!(matches(&idx, &other), [], "not another adapter's");
    // An adapter block with more than its name in the extra keys (a salt) stays apart.
    let mut salted = BlockStored::new(vec![BlockHash::Uint(21)], None, tokens[..4].to_vec(), 4);
    salted.set_lora("chat", 2);
    salted.extra_keys = Some(vec![Some(ExtraKeys(vec![
        0x92, 0xa4, b'c', b'h', b'a', b't', 0xa1, b's',
    ]))]);
    idx.apply_event(a, &KvEvent::BlockStored(salted), t0);
    assert_eq!(matches(&idx, &other), []);
}

#[test]
fn an_endpoint_is_full_once_it_evicts_until_its_cache_is_cleared() {
    // Approximate mode: full once its entries reach the capacity and one is evicted.
    let (mut idx, t0) = index(4);
    let (a, b) = (ep(&mut idx), ep(&mut idx));
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4]), t0);
    assert!(!idx.is_full(a), "at capacity, nothing evicted yet");
    idx.insert_approximate(a, &keys(&[5]), t0);
    assert!(idx.is_full(a));
    assert!(!idx.is_full(b));
    idx.clear_endpoint(a);
    assert!(!idx.is_full(a));
    // Precise mode: the engine's eviction says so, whatever the index holds.
    let stored = BlockStored::new(vec![BlockHash::Uint(9)], None, vec![7, 7], 2);
    idx.apply_event(b, &KvEvent::BlockStored(stored), t0);
    let removed = BlockRemoved::new(vec![9.into()]);
    idx.apply_event(b, &KvEvent::BlockRemoved(removed), t0);
    assert!(idx.is_full(b));
    idx.apply_event(b, &KvEvent::AllBlocksCleared, t0);
    assert!(!idx.is_full(b));
    // An id reused after its endpoint left starts empty.
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4, 5]), t0);
    idx.remove_endpoint(a);
    let c = ep(&mut idx);
    assert_eq!(c, a);
    assert!(!idx.is_full(c));
}

#[test]
fn an_engines_size_bounds_its_entries_below_the_configured_capacity() {
    let (mut idx, t0) = index(10);
    let (a, b) = (ep(&mut idx), ep(&mut idx));
    idx.insert_approximate(a, &keys(&[1, 2, 3, 4, 5, 6]), t0);
    idx.insert_approximate(b, &keys(&[1, 2, 3, 4, 5, 6]), t0);
    assert_eq!(idx.capacity(a), 10);
    // Learned smaller: the least recently used go at once (a prompt's tail first, as
    // decisions use their keys) and the endpoint counts as full; the other is untouched.
    idx.set_capacity(a, 4);
    assert_eq!((idx.capacity(a), idx.endpoint_len(a)), (4, 4));
    assert!(idx.is_full(a) && !idx.is_full(b));
    assert_eq!(
        matches(&idx, &keys(&[1, 2, 3, 4, 5, 6])),
        [(a.0, 4), (b.0, 6)]
    );
    // New entries keep to the bound.
    idx.insert_approximate(a, &keys(&[7, 8, 9]), t0);
    assert_eq!(idx.endpoint_len(a), 4);
    // Never above the configured capacity, never below one entry.
    idx.set_capacity(a, 1_000);
    assert_eq!(idx.capacity(a), 10);
    idx.set_capacity(a, 0);
    assert_eq!((idx.capacity(a), idx.endpoint_len(a)), (1, 1));
    // A new endpoint in a freed slot starts from the configured capacity.
    idx.remove_endpoint(a);
    let c = ep(&mut idx);
    assert_eq!(c, a);
    assert_eq!(idx.capacity(c), 10);
}
