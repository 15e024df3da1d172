//! Data-parallel ranks as routing targets: pdsim engines of 4 ranks each (a prefix cache, a
//! queue and a KV-event publisher per rank, `X-data-parallel-rank` honoured) behind the real
//! HTTP gateway. With `data_parallel_size` declared, cache-aware routing predicts each rank's
//! hits exactly and keeps a group's requests on the rank that holds its prefix; without it, the
//! engines place requests themselves and most prefixes are found on another rank.

mod common;

use std::time::Duration;

use common::MODEL;
use pdgate::Config;
use pdsim::{Role, SimConfig, SimHandle};
use serde_json::json;

const RANKS: u32 = 4;
const GROUPS: u32 = 32;
const QUESTIONS: u32 = 3;
const PREFIX: u32 = 256;
const BLOCK: u32 = 16;

/// An engine of [`RANKS`] ranks with a prefix cache (blocks of 16) per rank, publishing each
/// rank's KV events (with replay) on ipc sockets moved by the rank as vLLM moves them.
fn engine(role: Role, tokenizer: &common::WordTokenizer) -> SimConfig {
    let mut c = common::event_engine(role, BLOCK, 4096, tokenizer);
    c.data_parallel_size = RANKS;
    c
}

/// A prompt of token ids: the group's 256-token prefix, then 40 tokens of its own.
fn tokens(group: u32, question: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..PREFIX).map(|i| 1000 + group * 997 + i).collect();
    t.extend((0..40).map(|i| 50_000 + group * 1009 + question * 41 + i));
    t
}

/// The workload: every group's questions in a fixed pseudo-random order (a seeded
/// Fisher-Yates shuffle), as requests of many groups arrive interleaved.
fn workload() -> Vec<(u32, u32)> {
    let order: Vec<(u32, u32)> = (0..GROUPS)
        .flat_map(|g| (0..QUESTIONS).map(move |q| (g, q)))
        .collect();
    common::shuffled(order, 0x9e37_79b9_7f4a_7c15)
}

/// 2 prefills and 2 decodes of [`RANKS`] ranks each, and a cache-aware gateway subscribed to
/// their events; `ranked`: the gateway is told the engines' data-parallel size.
async fn start(ranked: bool, tok: &common::WordTokenizer) -> common::Fleet {
    let prefill: Vec<SimConfig> = (0..2).map(|_| engine(Role::Prefill, tok)).collect();
    let decode: Vec<SimConfig> = (0..2).map(|_| engine(Role::Decode, tok)).collect();
    common::start_subscribed(prefill, decode, BLOCK as usize, move |c: &mut Config| {
        // Every request takes both legs: the prefill's prediction is checked on each.
        c.cache.decode_only_below_tokens = 0;
        for ep in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
            ep.data_parallel_size = ranked.then_some(RANKS);
        }
    })
    .await
}

/// Per engine, per rank: the prefix-cache hits so far.
fn hits(engines: &[SimHandle]) -> Vec<Vec<u64>> {
    engines
        .iter()
        .map(|e| {
            e.stats()
                .data_parallel_ranks
                .iter()
                .map(|r| r.prefix_cache_hits)
                .collect()
        })
        .collect()
}

/// Per engine, per rank: the requests placed there so far.
fn requests(engines: &[SimHandle]) -> Vec<u64> {
    engines
        .iter()
        .flat_map(|e| {
            e.stats()
                .data_parallel_ranks
                .into_iter()
                .map(|r| r.requests)
        })
        .collect()
}

/// What one run measured.
struct Run {
    /// Prompt tokens the prefills found cached.
    hit_tokens: u64,
    /// Requests whose prediction differed from the serving rank's hits.
    mispredicted: Vec<String>,
    /// Requests per prefill rank, then per decode rank.
    prefill_ranks: Vec<u64>,
    decode_ranks: Vec<u64>,
}

/// Sends the workload one request at a time through the gateway; compares each prediction
/// with the prefill rank's own hits.
async fn run(fleet: &common::Fleet, ranked: bool) -> Run {
    let before_p = requests(&fleet.prefill);
    let before_d = requests(&fleet.decode);
    let mut out = Run {
        hit_tokens: 0,
        mispredicted: Vec::new(),
        prefill_ranks: Vec::new(),
        decode_ranks: Vec::new(),
    };
    for (g, q) in workload() {
        let before = hits(&fleet.prefill);
        let body = json!({"model": MODEL, "prompt": tokens(g, q), "max_tokens": 2});
        let r = fleet.post_bounded("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        let header = |name: &str| r.headers()[name].to_str().expect("ascii").to_string();
        let predicted: u64 = header("x-pdgate-predicted-cached-tokens")
            .parse()
            .expect("a number");
        let target = header("prefill-target-pod");
        let decode_target = header("target-pod");
        r.text().await.expect("body");
        let after = hits(&fleet.prefill);
        let mut moved = Vec::new();
        for (e, (b, a)) in before.iter().zip(&after).enumerate() {
            for (rank, (x, y)) in b.iter().zip(a).enumerate() {
                if y > x {
                    moved.push((e, rank, y - x));
                }
            }
        }
        let actual: u64 = moved.iter().map(|m| m.2).sum();
        out.hit_tokens += actual;
        if ranked {
            // The serving rank is the one named, on both legs.
            assert!(target.contains("#dp"), "{target}");
            assert!(decode_target.contains("#dp"), "{decode_target}");
            let (engine, rank) = target.split_once("#dp").expect("a rank");
            let e = fleet
                .prefill
                .iter()
                .position(|p| p.addr().to_string() == engine)
                .expect("a prefill");
            let rank: usize = rank.parse().expect("rank");
            assert!(
                moved.iter().all(|m| (m.0, m.1) == (e, rank)),
                "hits on {moved:?}, routed to {target}"
            );
            let sent = fleet.prefill[e].stats().recent_requests;
            let last = sent.last().expect("the prefill leg");
            assert_eq!(
                last.data_parallel_rank.as_deref(),
                Some(rank.to_string().as_str())
            );
        } else {
            assert!(!target.contains("#dp"), "{target}");
        }
        if predicted != actual {
            out.mispredicted.push(format!(
                "group {g} question {q} on {target}: predicted {predicted}, hit {actual}"
            ));
        }
    }
    let delta = |now: Vec<u64>, then: &[u64]| -> Vec<u64> {
        now.iter().zip(then).map(|(a, b)| a - b).collect()
    };
    out.prefill_ranks = delta(requests(&fleet.prefill), &before_p);
    out.decode_ranks = delta(requests(&fleet.decode), &before_d);
    out
}

/// Largest count over the mean.
fn spread(counts: &[u64]) -> f64 {
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    counts.iter().copied().max().unwrap_or(0) as f64 / mean
}

async fn stop(fleet: common::Fleet) {
    fleet.gateway.shutdown(Duration::from_secs(5)).await;
    for e in fleet.prefill.into_iter().chain(fleet.decode) {
        e.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_are_routing_targets_and_predictions_equal_each_ranks_hits() {
    let tok = common::WordTokenizer::new(["hello", "world"]);
    // The oracle: every request after its group's first finds the whole prefix (the rest of a
    // prompt is its own).
    let oracle = u64::from(GROUPS * (QUESTIONS - 1) * PREFIX);

    let fleet = start(true, &tok).await;
    common::warm_subscriptions(&fleet, RANKS).await;
    let ranked = run(&fleet, true).await;
    stop(fleet).await;

    let fleet = start(false, &tok).await;
    common::warm_subscriptions(&fleet, RANKS).await;
    let blind = run(&fleet, false).await;
    stop(fleet).await;

    let share = ranked.hit_tokens as f64 / oracle as f64;
    let blind_share = blind.hit_tokens as f64 / oracle as f64;
    let (p_spread, d_spread) = (spread(&ranked.prefill_ranks), spread(&ranked.decode_ranks));
    println!(
        "rank-aware: hit share {share:.3} of the oracle ({} of {oracle} tokens), {} mispredicted; \
         rank-blind: hit share {blind_share:.3}; requests per prefill rank {:?} (max/mean \
         {p_spread:.2}), per decode rank {:?} (max/mean {d_spread:.2})",
        ranked.hit_tokens,
        ranked.mispredicted.len(),
        ranked.prefill_ranks,
        ranked.decode_ranks,
    );
    assert!(
        ranked.mispredicted.is_empty(),
        "predictions differ from the ranks' hits: {:#?}",
        ranked.mispredicted
    );
    assert!(share >= 0.9, "hit share {share:.3} of the oracle");
    assert!(
        blind_share < 0.5,
        "rank-blind routing found {blind_share:.3} of the oracle"
    );
    assert!(share >= 1.8 * blind_share, "{share:.3} vs {blind_share:.3}");
    assert_eq!(ranked.prefill_ranks.len(), 8);
    assert_eq!(ranked.decode_ranks.len(), 8);
    assert!(p_spread <= 1.5, "prefill ranks {:?}", ranked.prefill_ranks);
    assert!(d_spread <= 1.5, "decode ranks {:?}", ranked.decode_ranks);
}
