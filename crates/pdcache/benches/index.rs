//! Cache-index benchmarks at the scale the gateway must handle: 1,000 endpoints, about a
//! million indexed blocks, 4k-token prompts (256 blocks of 16 tokens).
//!
//! `cargo bench -p pdcache --bench index -- --measurement-time 3 --warm-up-time 1`
//!
//! The build prints the index's memory per entry (`IndexStats::bytes / entries`).

use std::hint::black_box;
use std::time::Instant;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use pdcache::bench_prompts::{
    BLOCK, CONTINUATIONS, PROMPT_BLOCKS, SHARED_BLOCKS, continuation, prompt, system_prompt, tokens,
};
use pdcache::events::{BlockHash, BlockStored, EventBatch, KvEvent, decode_batch, encode_batch};
use pdcache::index::{CacheIndex, EndpointId, IndexConfig, Match};
use pdcache::keys::{BlockKey, token_keys};

const ENDPOINTS: usize = 1000;
const CONT_BLOCKS: usize = 187;

/// A BlockStored per prompt, chained onto the shared system prompt's last block, as an engine
/// would publish them; engine hashes are arbitrary (the index never interprets them).
fn build(now: Instant) -> (CacheIndex, Vec<EndpointId>) {
    let mut idx = CacheIndex::new(IndexConfig::default(), now);
    let sys = system_prompt();
    let mut eps = Vec::new();
    let mut next_hash = 1u64;
    let mut hashes = |n: usize| -> Vec<BlockHash> {
        (0..n)
            .map(|_| {
                next_hash += 1;
                BlockHash::Uint(next_hash)
            })
            .collect()
    };
    for e in 0..ENDPOINTS {
        let ep = idx.add_endpoint().expect("room");
        eps.push(ep);
        let sys_hashes = hashes(SHARED_BLOCKS);
        let last_sys = sys_hashes[SHARED_BLOCKS - 1].clone();
        let mut events = vec![KvEvent::BlockStored(BlockStored::new(
            sys_hashes,
            None,
            sys.clone(),
            BLOCK as u32,
        ))];
        for c in 0..CONTINUATIONS {
            let mut t = continuation(e, c);
            t.truncate(CONT_BLOCKS * BLOCK);
            events.push(KvEvent::BlockStored(BlockStored::new(
                hashes(CONT_BLOCKS),
                Some(last_sys.clone()),
                t,
                BLOCK as u32,
            )));
        }
        idx.apply_batch(
            ep,
            &EventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            },
            now,
        );
    }
    let s = idx.stats();
    println!(
        "index: {} endpoints, {} entries ({} precise), {} keys ({} wide), {} bytes = {:.1} bytes/entry",
        ENDPOINTS,
        s.entries,
        s.precise,
        s.keys,
        s.wide_keys,
        s.bytes,
        s.bytes as f64 / s.entries as f64
    );
    (idx, eps)
}

fn prompt_keys(ep: usize, c: usize) -> Vec<BlockKey> {
    token_keys(&prompt(ep, c), BLOCK)
}

fn bench_match(c: &mut Criterion) {
    let now = Instant::now();
    let (idx, _) = build(now);
    let mut out: Vec<Match> = Vec::with_capacity(ENDPOINTS);
    let mut g = c.benchmark_group("match_4k_prompt_1000_endpoints_1M_blocks");

    // The same prompt again and again: its index lines stay in the CPU caches.
    let hot = prompt_keys(500, 2);
    idx.match_prefix(&hot, &mut out);
    assert_eq!(out.len(), ENDPOINTS);
    assert_eq!(
        out.iter().map(|m| m.blocks).max(),
        Some((SHARED_BLOCKS + CONT_BLOCKS) as u32)
    );
    g.bench_function("hot_same_prompt", |b| {
        b.iter(|| idx.match_prefix(black_box(&hot), &mut out))
    });

    // A different endpoint's prompt each time (1,000 prompts, ~1M block lookups' worth of
    // index touched in turn): the realistic, cache-cold case.
    let prompts: Vec<Vec<BlockKey>> = (0..ENDPOINTS)
        .map(|e| prompt_keys(e, e % CONTINUATIONS))
        .collect();
    let mut i = 0;
    g.bench_function("cold_rotating_prompts", |b| {
        b.iter(|| {
            i = (i + 7) % prompts.len();
            idx.match_prefix(black_box(&prompts[i]), &mut out)
        })
    });

    // The gateway's form: matched blocks into a dense table by endpoint id.
    let mut dense: Vec<u32> = Vec::with_capacity(ENDPOINTS);
    g.bench_function("dense_hot_same_prompt", |b| {
        b.iter(|| idx.match_blocks(black_box(&hot), &mut dense))
    });
    let mut j = 0;
    g.bench_function("dense_cold_rotating_prompts", |b| {
        b.iter(|| {
            j = (j + 7) % prompts.len();
            idx.match_blocks(black_box(&prompts[j]), &mut dense)
        })
    });

    // The system prompt, then a question nobody has seen.
    let mut fresh = system_prompt();
    fresh.extend(tokens(42, PROMPT_BLOCKS * BLOCK - SHARED_BLOCKS * BLOCK));
    let fresh = token_keys(&fresh, BLOCK);
    g.bench_function("shared_prefix_then_new", |b| {
        b.iter(|| idx.match_prefix(black_box(&fresh), &mut out))
    });

    let miss = token_keys(&tokens(7, PROMPT_BLOCKS * BLOCK), BLOCK);
    g.bench_function("miss", |b| {
        b.iter(|| idx.match_prefix(black_box(&miss), &mut out))
    });
    g.finish();

    let mut g = c.benchmark_group("decision_insert_256_blocks");
    let mut idx = idx;
    g.throughput(Throughput::Elements(PROMPT_BLOCKS as u64));
    // New keys each time into endpoints at their capacity, so every insert also evicts (a
    // separate, bounded index: the big one would grow by 256 entries per iteration).
    let mut small = CacheIndex::new(
        IndexConfig {
            capacity_per_endpoint: 4096,
            ..IndexConfig::default()
        },
        now,
    );
    let small_eps: Vec<EndpointId> = (0..100)
        .map(|_| small.add_endpoint().expect("room"))
        .collect();
    let mut n = 0u64;
    let mut keys: Vec<BlockKey> = Vec::with_capacity(PROMPT_BLOCKS);
    g.bench_function("speculative_new_keys_with_eviction", |b| {
        b.iter(|| {
            n += 1;
            keys.clear();
            keys.extend((0..PROMPT_BLOCKS as u64).map(|j| BlockKey((n << 20) | j)));
            small.insert_speculative(small_eps[(n % 100) as usize], &keys, now);
        })
    });
    g.bench_function("approximate_refresh", |b| {
        b.iter(|| idx.insert_approximate(EndpointId(500), black_box(&hot), now))
    });
    g.finish();
}

fn ingest_batches() -> (Vec<EventBatch>, u64) {
    // 4,096 events of 16 blocks of 16 tokens, each chained onto the previous event of its
    // endpoint's prompt, across 64 endpoints: 65,536 blocks.
    let mut batches = Vec::new();
    let mut h = 1u64;
    let mut blocks = 0u64;
    for b in 0..256u64 {
        let mut events = Vec::new();
        for e in 0..16u64 {
            let parent = (b % 4 != 0).then(|| BlockHash::Uint(h - 1));
            let hashes: Vec<BlockHash> = (0..16).map(|j| BlockHash::Uint(h + j)).collect();
            h += 16;
            blocks += 16;
            events.push(KvEvent::BlockStored(BlockStored::new(
                hashes,
                parent,
                tokens(b * 16 + e, 256),
                BLOCK as u32,
            )));
        }
        batches.push(EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        });
    }
    (batches, blocks)
}

fn bench_ingest(c: &mut Criterion) {
    let now = Instant::now();
    let (batches, blocks) = ingest_batches();
    let payloads: Vec<Vec<u8>> = batches.iter().map(encode_batch).collect();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(blocks));
    g.sample_size(20);
    let fresh = || {
        let mut idx = CacheIndex::new(IndexConfig::default(), now);
        let ep = idx.add_endpoint().expect("room");
        (idx, ep)
    };
    g.bench_function("apply_block_stored", |b| {
        b.iter_batched(
            fresh,
            |(mut idx, ep)| {
                for batch in &batches {
                    black_box(idx.apply_batch(ep, batch, now));
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("decode_and_apply", |b| {
        b.iter_batched(
            fresh,
            |(mut idx, ep)| {
                for p in &payloads {
                    if let Ok(batch) = decode_batch(p) {
                        black_box(idx.apply_batch(ep, &batch, now));
                    }
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("decode_only", |b| {
        b.iter(|| {
            for p in &payloads {
                let _ = black_box(decode_batch(black_box(p)));
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench_match, bench_ingest);
criterion_main!(benches);
