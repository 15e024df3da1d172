//! Cache-sensitive workloads (`shared-prefix`, `multi-turn`, `random`), their scheduling, and
//! the trace's oracle hit share.
//!
//! Prompts are plain text made of common English words drawn from a seeded RNG, so the same
//! trace runs against pdsim and a real vLLM. Lengths are in words: pdsim's default tokenizer
//! gives one token per whitespace-separated word (plus BOS, plus one marker per chat message
//! and one for the assistant turn); a real tokenizer gives roughly one token per word for this
//! vocabulary. Every group (or session, or random prompt) starts with a unique tag word
//! (`g3`, `s5`, `r17`), so distinct groups never share even their first block.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, PoisonError};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::Notify;

use crate::api::Api;

/// Which trace a run replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// The classic generator: `r<id>` then `x` words of `--prompt-len` (no shared prefixes).
    Synthetic,
    /// G groups x P prompts: a group's system prompt (S words) then a question (Q words).
    SharedPrefix,
    /// N sessions x T turns on the chat API: each turn sends the whole history plus a new
    /// user message of Q words (the first one preceded by a session system prompt of S words).
    MultiTurn,
    /// Unique prompts of S + Q words (the control: nothing to reuse).
    Random,
}

/// Order in which groups (or sessions) are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// Round robin over groups (g0p0, g1p0, ..., g0p1, ...); multi-turn: a session's next turn
    /// joins the back of the queue. Stresses caches most.
    Interleaved,
    /// One group after the other; multi-turn: a session's next turn goes first.
    Sequential,
}

/// Shape of a cache-sensitive trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSpec {
    /// Which workload.
    pub kind: WorkloadKind,
    /// shared-prefix: groups.
    pub groups: usize,
    /// shared-prefix: prompts per group.
    pub prompts_per_group: usize,
    /// multi-turn: sessions.
    pub sessions: usize,
    /// multi-turn: turns per session.
    pub turns: usize,
    /// System prompt words (S).
    pub system_len: u32,
    /// Question / user message words (Q).
    pub question_len: u32,
    /// random: number of prompts (default groups x prompts per group).
    pub random_count: Option<usize>,
    /// Send order.
    pub order: Order,
    /// Seed of the text.
    pub seed: u64,
}

impl TraceSpec {
    /// The defaults of the cache-aware measurement plan: 16 x 8, S=1024, Q=64; 8 sessions x 5.
    pub fn new(kind: WorkloadKind) -> Self {
        TraceSpec {
            kind,
            groups: 16,
            prompts_per_group: 8,
            sessions: 8,
            turns: 5,
            system_len: 1024,
            question_len: 64,
            random_count: None,
            order: Order::Interleaved,
            seed: 1,
        }
    }
}

/// Short common words: one token each in usual BPE vocabularies (with their leading space).
pub(crate) const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are",
    "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when",
    "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if",
    "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her",
    "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go",
    "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
    "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new",
    "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little",
    "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under",
    "name", "very", "through", "just", "form", "much", "great", "think", "say", "help", "low",
];

/// `tag` then `words - 1` seeded words (`words` >= 1 whitespace-separated words in all).
fn text(rng: &mut SmallRng, tag: &str, words: u32) -> String {
    let mut s = String::with_capacity(words as usize * 6);
    s.push_str(tag);
    for _ in 1..words {
        s.push(' ');
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// What one request of the trace sends.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// `/v1/completions` prompt text.
    Text(String),
    /// `/v1/chat/completions` messages: (role, content).
    Chat(Vec<(&'static str, String)>),
}

impl Prompt {
    /// Token ids in pdsim's word-tokenizer model (BOS, role markers, one per word), hashed.
    pub fn tokens(&self) -> Vec<u64> {
        let mut t = vec![word_hash("<s>")];
        match self {
            Prompt::Text(s) => t.extend(s.split_whitespace().map(word_hash)),
            Prompt::Chat(msgs) => {
                for (role, content) in msgs {
                    t.push(word_hash(&format!("<|{role}|>")));
                    t.extend(content.split_whitespace().map(word_hash));
                }
                t.push(word_hash("<|assistant|>"));
            }
        }
        t
    }
}

fn word_hash(w: &str) -> u64 {
    // FNV-1a: stable across runs and platforms, enough to tell words apart.
    w.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One request to send: which session/group, which turn, and its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceItem {
    /// Group (shared-prefix), session (multi-turn) or prompt number (random).
    pub group: usize,
    /// Turn within the session (0 outside multi-turn).
    pub turn: usize,
    /// What to send.
    pub prompt: Prompt,
}

struct Session {
    system: Option<String>,
    questions: Vec<String>,
    history: Vec<(&'static str, String)>,
}

struct State {
    ready: VecDeque<(usize, usize)>,
    in_flight: usize,
    /// Fixed prompts (shared-prefix, random), by group then index.
    fixed: Vec<Vec<Prompt>>,
    sessions: Vec<Session>,
    sent: Vec<OracleRequest>,
}

/// The trace being replayed: hands out ready requests, holds multi-turn histories, and
/// records what was sent (in order) for the oracle.
pub struct TraceQueue {
    kind: WorkloadKind,
    order: Order,
    turns: usize,
    total: usize,
    state: Mutex<State>,
    notify: Notify,
}

impl std::fmt::Debug for TraceQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceQueue")
            .field("kind", &self.kind)
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl TraceQueue {
    /// Builds the trace of `spec` for `api` (multi-turn always uses chat).
    pub fn new(spec: &TraceSpec, api: Api) -> Self {
        let mut rng = SmallRng::seed_from_u64(spec.seed);
        let (s, q) = (spec.system_len.max(1), spec.question_len.max(1));
        let mut fixed = Vec::new();
        let mut sessions = Vec::new();
        let mut ready = VecDeque::new();
        let mut turns = 1;
        match spec.kind {
            WorkloadKind::SharedPrefix | WorkloadKind::Synthetic => {
                for g in 0..spec.groups {
                    let system = text(&mut rng, &format!("g{g}"), s);
                    let group = (0..spec.prompts_per_group)
                        .map(|p| {
                            let question = text(&mut rng, &format!("q{p}"), q);
                            match api {
                                Api::Completions => Prompt::Text(format!("{system} {question}")),
                                Api::Chat => Prompt::Chat(vec![
                                    ("system", system.clone()),
                                    ("user", question),
                                ]),
                            }
                        })
                        .collect();
                    fixed.push(group);
                }
                match spec.order {
                    Order::Interleaved => {
                        for p in 0..spec.prompts_per_group {
                            ready.extend((0..spec.groups).map(|g| (g, p)));
                        }
                    }
                    Order::Sequential => {
                        for g in 0..spec.groups {
                            ready.extend((0..spec.prompts_per_group).map(|p| (g, p)));
                        }
                    }
                }
            }
            WorkloadKind::Random => {
                let n = spec
                    .random_count
                    .unwrap_or(spec.groups * spec.prompts_per_group);
                for i in 0..n {
                    let body = text(&mut rng, &format!("r{i}"), s + q);
                    let p = match api {
                        Api::Completions => Prompt::Text(body),
                        Api::Chat => Prompt::Chat(vec![("user", body)]),
                    };
                    fixed.push(vec![p]);
                    ready.push_back((i, 0));
                }
            }
            WorkloadKind::MultiTurn => {
                turns = spec.turns.max(1);
                for i in 0..spec.sessions {
                    let system = (spec.system_len > 0).then(|| text(&mut rng, &format!("s{i}"), s));
                    let questions = (0..turns)
                        .map(|t| text(&mut rng, &format!("u{t}"), q))
                        .collect();
                    sessions.push(Session {
                        system,
                        questions,
                        history: Vec::new(),
                    });
                    ready.push_back((i, 0));
                }
            }
        }
        let total = match spec.kind {
            WorkloadKind::MultiTurn => sessions.len() * turns,
            _ => ready.len(),
        };
        TraceQueue {
            kind: spec.kind,
            order: spec.order,
            turns,
            total,
            state: Mutex::new(State {
                ready,
                in_flight: 0,
                fixed,
                sessions,
                sent: Vec::new(),
            }),
            notify: Notify::new(),
        }
    }

    /// Requests in the whole trace.
    pub fn len(&self) -> usize {
        self.total
    }

    /// True for an empty trace.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// True when answers must be read back (multi-turn appends them to the history).
    pub fn needs_answers(&self) -> bool {
        self.kind == WorkloadKind::MultiTurn
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A ready request without waiting: `Ok(Some)`, `Ok(None)` when none is ready yet, or
    /// `Err(())` when the trace is finished.
    #[allow(clippy::result_unit_err)]
    pub fn try_next(&self) -> Result<Option<TraceItem>, ()> {
        let mut st = self.lock();
        let Some((group, turn)) = st.ready.pop_front() else {
            return if st.in_flight == 0 { Err(()) } else { Ok(None) };
        };
        st.in_flight += 1;
        let prompt = match self.kind {
            WorkloadKind::MultiTurn => {
                let s = &mut st.sessions[group];
                if turn == 0
                    && let Some(sys) = s.system.take()
                {
                    s.history.push(("system", sys));
                }
                let mut msgs = s.history.clone();
                msgs.push(("user", s.questions[turn].clone()));
                Prompt::Chat(msgs)
            }
            _ => st.fixed[group][turn].clone(),
        };
        st.sent.push(OracleRequest {
            group,
            tokens: prompt.tokens(),
        });
        Ok(Some(TraceItem {
            group,
            turn,
            prompt,
        }))
    }

    /// The next ready request, waiting for an earlier turn to answer if needed; `None` when
    /// the trace is finished.
    pub async fn next(&self) -> Option<TraceItem> {
        loop {
            let notified = self.notify.notified();
            match self.try_next() {
                Ok(Some(item)) => return Some(item),
                Err(()) => return None,
                Ok(None) => notified.await,
            }
        }
    }

    /// Marks `item` answered (`answer` is the generated text, `None` on failure: a failed turn
    /// ends its session) and releases the session's next turn.
    pub fn done(&self, item: &TraceItem, answer: Option<String>) {
        {
            let mut st = self.lock();
            st.in_flight = st.in_flight.saturating_sub(1);
            if self.kind == WorkloadKind::MultiTurn
                && let Some(answer) = answer
            {
                let s = &mut st.sessions[item.group];
                s.history.push(("user", s.questions[item.turn].clone()));
                s.history.push(("assistant", answer));
                if item.turn + 1 < self.turns {
                    let next = (item.group, item.turn + 1);
                    match self.order {
                        Order::Interleaved => st.ready.push_back(next),
                        Order::Sequential => st.ready.push_front(next),
                    }
                }
            }
        }
        self.notify.notify_waiters();
    }

    /// Stops handing out requests (the run's bound was reached).
    pub fn close(&self) {
        self.lock().ready.clear();
        self.notify.notify_waiters();
    }

    /// What was sent, in order.
    pub fn sent(&self) -> Vec<OracleRequest> {
        self.lock().sent.clone()
    }
}

/// One sent request as the oracle sees it: its group and its prompt's token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct OracleRequest {
    /// Group / session / prompt number: the unit a router pins to one engine.
    pub group: usize,
    /// Prompt token ids (any stable ids).
    pub tokens: Vec<u64>,
}

/// Chained block hashes of the full blocks of `tokens`.
fn block_hashes(tokens: &[u64], block: usize) -> Vec<u64> {
    let mut parent = 0x9e37_79b9_7f4a_7c15_u64;
    tokens
        .chunks_exact(block)
        .map(|c| {
            parent = c.iter().fold(parent.rotate_left(17) ^ 0xa5a5, |h, &t| {
                (h ^ t).wrapping_mul(0x0100_0000_01b3).rotate_left(29)
            });
            parent
        })
        .collect()
}

/// vLLM's cap on a hit: never the whole prompt (the last token is always computed).
fn max_hit_blocks(n_tokens: usize, block: usize) -> usize {
    n_tokens.saturating_sub(1) / block
}

/// The oracle result of a trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Oracle {
    /// Block size (tokens).
    pub block_size: usize,
    /// Prompt tokens of the trace (the oracle's token model).
    pub prompt_tokens: u64,
    /// Reusable tokens with an infinite cache.
    pub reusable_tokens: u64,
    /// `reusable_tokens / prompt_tokens`.
    pub hit_share: f64,
    /// The capacity-limited variant, when an engine count and cache size were given.
    pub limited: Option<LimitedOracle>,
}

/// The capacity-limited oracle.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LimitedOracle {
    /// Engines.
    pub engines: usize,
    /// Blocks per engine.
    pub cache_blocks: usize,
    /// Reusable tokens.
    pub reusable_tokens: u64,
    /// `reusable_tokens / prompt_tokens`.
    pub hit_share: f64,
}

fn share(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The oracle hit share of `trace` (in send order) with blocks of `block` tokens.
///
/// Infinite cache: a request's reusable tokens are `B` x the length of the longest run of its
/// leading full blocks (capped at `floor((n-1)/B)` blocks, like vLLM) whose chained hashes were
/// produced by any earlier prompt of the trace; every request's full prompt blocks are then
/// cached. Limited (`engines`, `cache_blocks`): groups are pinned to engines by a greedy
/// static assignment (largest working set first, onto the engine with the fewest blocks), and
/// each engine is an LRU of `cache_blocks` blocks (a request's blocks are touched deepest
/// first, so the deepest are evicted first, as in vLLM's free queue).
pub fn oracle(trace: &[OracleRequest], block: usize, limit: Option<(usize, usize)>) -> Oracle {
    let block = block.max(1);
    let hashes: Vec<Vec<u64>> = trace
        .iter()
        .map(|r| block_hashes(&r.tokens, block))
        .collect();
    let prompt_tokens: u64 = trace.iter().map(|r| r.tokens.len() as u64).sum();
    let mut seen = HashSet::new();
    let mut reusable = 0u64;
    for (r, h) in trace.iter().zip(&hashes) {
        let cap = max_hit_blocks(r.tokens.len(), block).min(h.len());
        let k = h[..cap].iter().take_while(|x| seen.contains(*x)).count();
        reusable += (k * block) as u64;
        seen.extend(h.iter().copied());
    }
    let limited = limit.map(|(engines, cache_blocks)| {
        let engines = engines.max(1);
        let reusable_tokens = limited_oracle(trace, &hashes, block, engines, cache_blocks);
        LimitedOracle {
            engines,
            cache_blocks,
            reusable_tokens,
            hit_share: share(reusable_tokens, prompt_tokens),
        }
    });
    Oracle {
        block_size: block,
        prompt_tokens,
        reusable_tokens: reusable,
        hit_share: share(reusable, prompt_tokens),
        limited,
    }
}

fn limited_oracle(
    trace: &[OracleRequest],
    hashes: &[Vec<u64>],
    block: usize,
    engines: usize,
    cache_blocks: usize,
) -> u64 {
    let groups: Vec<u64> = trace.iter().map(|r| r.group as u64).collect();
    pinned_lru_reuse(
        &groups,
        hashes,
        engines,
        cache_blocks,
        |i| max_hit_blocks(trace[i].tokens.len(), block).min(hashes[i].len()),
        |_, k| (k * block) as u64,
    )
}

/// Reusable tokens when requests are pinned to `engines` by group (greedy static assignment:
/// groups by working set, largest first, each onto the engine with the fewest blocks so far)
/// and each engine is an LRU of `cache_blocks` blocks. Request `i` may hit at most `cap(i)` of
/// its leading blocks; `reuse(i, k)` is what `k` hit blocks are worth in tokens. A request's
/// blocks are touched deepest first, so the deepest are evicted first, as in vLLM's free queue.
pub(crate) fn pinned_lru_reuse(
    groups: &[u64],
    hashes: &[Vec<u64>],
    engines: usize,
    cache_blocks: usize,
    cap: impl Fn(usize) -> usize,
    reuse: impl Fn(usize, usize) -> u64,
) -> u64 {
    let engines = engines.max(1);
    // Working set of each group: its distinct blocks.
    let mut sets: HashMap<u64, HashSet<u64>> = HashMap::new();
    for (g, h) in groups.iter().zip(hashes) {
        sets.entry(*g).or_default().extend(h.iter().copied());
    }
    let mut by_size: Vec<(u64, usize)> = sets.iter().map(|(g, s)| (*g, s.len())).collect();
    by_size.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut load = vec![0usize; engines];
    let mut engine_of = HashMap::new();
    for (g, size) in by_size {
        let (e, _) = load
            .iter()
            .enumerate()
            .min_by_key(|(i, l)| (**l, *i))
            .unwrap_or((0, &0));
        load[e] += size;
        engine_of.insert(g, e);
    }
    let mut caches: Vec<Lru> = (0..engines).map(|_| Lru::default()).collect();
    let mut reusable = 0u64;
    for (i, (g, h)) in groups.iter().zip(hashes).enumerate() {
        let cache = &mut caches[engine_of.get(g).copied().unwrap_or(0)];
        let cap = cap(i).min(h.len());
        let k = h[..cap].iter().take_while(|x| cache.contains(**x)).count();
        reusable += reuse(i, k);
        for &x in h.iter().rev() {
            cache.touch(x);
        }
        cache.evict_to(cache_blocks);
    }
    reusable
}

/// An LRU set of block hashes.
#[derive(Default)]
struct Lru {
    tick: u64,
    at: HashMap<u64, u64>,
    by_tick: std::collections::BTreeMap<u64, u64>,
}

impl Lru {
    fn contains(&self, h: u64) -> bool {
        self.at.contains_key(&h)
    }

    fn touch(&mut self, h: u64) {
        self.tick += 1;
        if let Some(old) = self.at.insert(h, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, h);
    }

    fn evict_to(&mut self, cap: usize) {
        while self.at.len() > cap {
            let Some((_, h)) = self.by_tick.pop_first() else {
                break;
            };
            self.at.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(group: usize, tokens: &[u64]) -> OracleRequest {
        OracleRequest {
            group,
            tokens: tokens.to_vec(),
        }
    }

    #[test]
    fn oracle_by_hand_infinite_cache() {
        // B = 2. r0 = [1 2 3 4 5]: nothing before it. r1 = [1 2 3 4 9]: blocks [1 2][3 4]
        // seen, cap floor(4/2) = 2 -> 4 tokens. r2 = [1 2 3 4]: cap floor(3/2) = 1 block -> 2.
        // r3 = [7 2 3 4]: first block new -> 0. Total 13 + 4 + 2 + 0 = 6 of 18 tokens.
        let t = [
            req(0, &[1, 2, 3, 4, 5]),
            req(0, &[1, 2, 3, 4, 9]),
            req(0, &[1, 2, 3, 4]),
            req(1, &[7, 2, 3, 4]),
        ];
        let o = oracle(&t, 2, None);
        assert_eq!(o.prompt_tokens, 18);
        assert_eq!(o.reusable_tokens, 6);
        assert!((o.hit_share - 6.0 / 18.0).abs() < 1e-12);
        assert!(o.limited.is_none());
    }

    #[test]
    fn oracle_by_hand_limited_cache() {
        // B = 2, two groups of 2 blocks each, alternating: a0 b0 a1 b1 (each prompt 5 tokens).
        let a = [1, 2, 3, 4, 5];
        let b = [6, 7, 8, 9, 10];
        let t = [req(0, &a), req(1, &b), req(0, &a), req(1, &b)];
        // Infinite: a1 and b1 reuse 4 each.
        assert_eq!(oracle(&t, 2, None).reusable_tokens, 8);
        // Two engines of 2 blocks: each group alone on one engine, fits: 8.
        let two = oracle(&t, 2, Some((2, 2))).limited.expect("limited");
        assert_eq!(two.reusable_tokens, 8);
        // One engine of 2 blocks: the other group evicts everything in between: 0.
        let one = oracle(&t, 2, Some((1, 2))).limited.expect("limited");
        assert_eq!(one.reusable_tokens, 0);
        // One engine of 3 blocks: b0 evicts a's deepest block [3 4], so a1 reuses [1 2] (2
        // tokens); a1 then evicts b's deepest [8 9], so b1 reuses [6 7] (2 tokens).
        let three = oracle(&t, 2, Some((1, 3))).limited.expect("limited");
        assert_eq!(three.reusable_tokens, 4);
        assert!((three.hit_share - 4.0 / 20.0).abs() < 1e-12);
    }

    #[test]
    fn shared_prefix_trace_shape_and_order() {
        let mut spec = TraceSpec::new(WorkloadKind::SharedPrefix);
        spec.groups = 3;
        spec.prompts_per_group = 2;
        spec.system_len = 10;
        spec.question_len = 4;
        let q = TraceQueue::new(&spec, Api::Completions);
        assert_eq!(q.len(), 6);
        let mut order = Vec::new();
        while let Ok(Some(item)) = q.try_next() {
            let Prompt::Text(t) = &item.prompt else {
                panic!("text prompt")
            };
            assert_eq!(t.split_whitespace().count(), 14);
            assert_eq!(item.prompt.tokens().len(), 15, "BOS + words");
            order.push(item.group);
            q.done(&item, None);
        }
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
        // Same seed, same text; the oracle: 3 groups x 1 reuse of the 10-word system prompt
        // plus BOS = 11 tokens -> 8 tokens at B = 4 (two full blocks).
        let o = oracle(&q.sent(), 4, None);
        assert_eq!(o.reusable_tokens, 3 * 8);
        spec.order = Order::Sequential;
        let s = TraceQueue::new(&spec, Api::Chat);
        let first = s.try_next().expect("open").expect("ready");
        let second = s.try_next().expect("open").expect("ready");
        assert_eq!((first.group, second.group), (0, 0));
        let again = TraceQueue::new(&spec, Api::Chat);
        assert_eq!(
            again.try_next().expect("open").expect("ready").prompt,
            first.prompt
        );
    }

    #[test]
    fn multi_turn_waits_for_answers_and_grows_history() {
        let mut spec = TraceSpec::new(WorkloadKind::MultiTurn);
        spec.sessions = 2;
        spec.turns = 2;
        spec.system_len = 3;
        spec.question_len = 2;
        let q = TraceQueue::new(&spec, Api::Completions);
        assert_eq!(q.len(), 4);
        let a = q.try_next().expect("open").expect("s0");
        let b = q.try_next().expect("open").expect("s1");
        assert_eq!(q.try_next(), Ok(None), "turn 2 waits for turn 1");
        q.done(&a, Some("fine thanks".into()));
        let a2 = q.try_next().expect("open").expect("s0 t1");
        let Prompt::Chat(m) = &a2.prompt else {
            panic!("chat")
        };
        let roles: Vec<&str> = m.iter().map(|(r, _)| *r).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(m[2].1, "fine thanks");
        q.done(&b, None);
        q.done(&a2, Some("ok".into()));
        assert_eq!(q.try_next(), Err(()), "failed session ends, trace done");
    }
}
