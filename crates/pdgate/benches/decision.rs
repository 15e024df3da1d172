//! A whole cache-aware routing decision at scale: 500 prefills and 500 decodes, a million
//! indexed blocks, a 4k-token prompt (256 blocks of 16 tokens). One decision matches the prompt,
//! scores the decodes, then the prefills that pair with the chosen one, and writes the prompt's
//! keys for both (the same code a request runs, `select::pair`). Three cases: one hot prompt,
//! prompts rotating through the index (each cold), and the rotating prompts again over an index
//! written a block at a time (each prompt's entries scattered over the slab: the match's worst
//! case).
//!
//! `cargo bench -p pdgate --bench decision [-- ROUNDS]`: prints, per case, the fastest of ROUNDS
//! (default 20) rounds of 2,000 decisions each, per decision (the minimum is the figure a busy
//! machine blurs least; instruction counts: run the binary under `valgrind --tool=callgrind`).
//! A plain harness: no statistics crate in the gateway's dependencies.

use std::hint::black_box;
use std::time::{Duration, Instant};

use pdcache::bench_prompts::{BLOCK, CONTINUATIONS, PROMPT_BLOCKS, SHARED_BLOCKS, mix, prompt};
use pdgate::cache_bench::DecisionBench;

const PER_ROLE: usize = 500;

/// The fastest per-decision time over `rounds` rounds of `per_round` calls of `f`.
fn fastest(rounds: usize, per_round: usize, mut f: impl FnMut(usize) -> bool) -> Duration {
    let mut best = Duration::MAX;
    let mut n = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..per_round {
            n += 1;
            black_box(f(n));
        }
        best = best.min(t.elapsed() / per_round as u32);
    }
    best
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(20);
    let mut fleet = DecisionBench::new(PER_ROLE, PER_ROLE, BLOCK).expect("fleet");
    // Prefill p and decode p hold the prompts of pair p (each decision then refreshes entries
    // instead of growing the index).
    for p in 0..PER_ROLE {
        for k in 0..CONTINUATIONS {
            let t = prompt(p, k);
            fleet.seed(p, &t);
            fleet.seed(PER_ROLE + p, &t);
        }
    }
    let sizes = fleet.sizes();
    println!(
        "decision fleet: {} endpoints, {} index entries, {} bytes = {:.1} bytes/entry",
        fleet.endpoints(),
        sizes.entries,
        sizes.bytes,
        sizes.bytes as f64 / sizes.entries as f64
    );
    let prompts: Vec<usize> = (0..PER_ROLE)
        .map(|p| fleet.prompt(&prompt(p, p % CONTINUATIONS)))
        .collect();
    let hot = prompts[250];
    let t = fastest(rounds, 2000, |_| fleet.decide(black_box(hot)));
    println!(
        "decision_4k_prompt_1000_endpoints_1M_blocks/hot_same_prompt: {t:?} (fastest of {rounds} rounds)"
    );
    let t = fastest(rounds, 2000, |n| {
        fleet.decide(black_box(prompts[(n * 7) % prompts.len()]))
    });
    println!(
        "decision_4k_prompt_1000_endpoints_1M_blocks/cold_rotating_prompts: {t:?} (fastest of {rounds} rounds)"
    );
    drop(fleet);
    // The worst case for following an endpoint's entries through the slab: the same index,
    // written a block at a time with the owners in a new order each time, so a prompt's
    // entries for one endpoint lie at no fixed stride and every key is looked up.
    let mut fleet = DecisionBench::new(PER_ROLE, PER_ROLE, BLOCK).expect("fleet");
    let prompts: Vec<usize> = (0..PER_ROLE)
        .flat_map(|p| (0..CONTINUATIONS).map(move |k| (p, k)))
        .map(|(p, k)| fleet.prompt(&prompt(p, k)))
        .collect();
    let mut order: Vec<usize> = (0..PER_ROLE).collect();
    for k in 0..CONTINUATIONS {
        for b in SHARED_BLOCKS..=PROMPT_BLOCKS {
            let round = ((b * CONTINUATIONS + k) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            order.sort_by_key(|&p| mix(round ^ p as u64));
            for &p in &order {
                let v = prompts[p * CONTINUATIONS + k];
                fleet.seed_prefix(p, v, b);
                fleet.seed_prefix(PER_ROLE + p, v, b);
            }
        }
    }
    let sizes = fleet.sizes();
    println!(
        "scattered fleet: {} index entries, {} bytes",
        sizes.entries, sizes.bytes
    );
    let t = fastest(rounds, 2000, |n| {
        let p = (n * 7) % PER_ROLE;
        fleet.decide(black_box(prompts[p * CONTINUATIONS + p % CONTINUATIONS]))
    });
    println!(
        "decision_4k_prompt_1000_endpoints_1M_blocks/cold_rotating_prompts_scattered_entries: {t:?} (fastest of {rounds} rounds)"
    );
}
