//! The prompts of the scale benchmarks (pdcache's `index` bench and pdgate's `decision` bench):
//! deterministic tokens, so that runs compare, shaped like a fleet whose every owner holds one
//! shared system prompt followed by a few continuations of its own. Not part of the API.

/// Tokens per block.
pub const BLOCK: usize = 16;
/// Blocks of the system prompt every owner shares.
pub const SHARED_BLOCKS: usize = 64;
/// Continuations per owner.
pub const CONTINUATIONS: usize = 5;
/// Blocks of a whole prompt (4k tokens).
pub const PROMPT_BLOCKS: usize = 256;

/// SplitMix64's finaliser: a well-mixed 64-bit value of `z`.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` pseudo-random tokens from `seed` (splitmix64), below 50,000.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            (mix(x) % 50_000) as u32
        })
        .collect()
}

/// The shared system prompt.
pub fn system_prompt() -> Vec<u32> {
    tokens(1, SHARED_BLOCKS * BLOCK)
}

/// Continuation `c` of `owner`: the rest of a whole prompt after the system prompt.
pub fn continuation(owner: usize, c: usize) -> Vec<u32> {
    tokens(
        1000 + (owner * CONTINUATIONS + c) as u64,
        (PROMPT_BLOCKS - SHARED_BLOCKS) * BLOCK,
    )
}

/// The whole prompt `c` of `owner`: the system prompt, then its continuation.
pub fn prompt(owner: usize, c: usize) -> Vec<u32> {
    let mut t = system_prompt();
    t.extend(continuation(owner, c));
    t
}
