//! The step-loop engine model: one scheduler task per engine, shaped like vLLM v1's.
//!
//! A request that reaches compute is submitted as a [`Seq`]; the scheduler keeps a FCFS
//! waiting queue and a running set. Each step it gives every running request its next tokens
//! (one decode token, or the next prefill chunk) within `max_num_batched_tokens`, then admits
//! waiting requests while fewer than `max_num_seqs` run, the token budget lasts and their KV
//! blocks can be reserved in the prefix cache (the head of the queue waits otherwise: no
//! request overtakes it). The step lasts what the profile's roofline gives for the batch, in
//! simulated time; afterwards each request that produced a token gets it on its channel, and a
//! request whose prefill completed has its prompt blocks cached (and published as KV events).
//!
//! Requests pin their cached prefix and reserve the blocks of the rest of their sequence
//! (prompt plus `max_tokens`) on admission, not before, so a running request never needs more
//! and nothing is preempted. An engine with nothing to run waits on its queue: idle engines take
//! no CPU. The scheduler task itself is [`crate::scheduler`]; this file holds what requests and
//! the engine share with it.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::prefix_cache::{BlockChain, Pins};

/// What a request gets back for each token it produces.
pub(crate) enum Tick {
    /// A token (the first one ends the prefill).
    Token,
    /// The last token, with the request's cache blocks back for its finish.
    Last(Box<Held>),
}

/// The cache state a request hands to the scheduler while it runs.
#[derive(Default)]
pub(crate) struct Held {
    pub chain: BlockChain,
    pub pins: Pins,
}

/// One request as the scheduler sees it.
pub(crate) struct Seq {
    /// Prompt tokens still to compute (at least one: the step that yields the first token).
    pub prefill_left: u32,
    /// Tokens already in KV (cache hits, received KV, computed chunks, generated tokens).
    pub context: u32,
    /// Tokens to generate after the first.
    pub decode_left: u32,
    /// KV blocks of the whole sequence (prompt plus output).
    pub total_blocks: usize,
    /// Prompt blocks a cache hit may cover (vLLM recomputes at least the last token).
    pub lookup_max: usize,
    /// Prompt blocks found cached on arrival (what `prefill_left` assumes).
    pub hit_blocks: usize,
    /// The prompt is computed here (not received from a prefill): blocks evicted while it
    /// waited are computed too.
    pub local: bool,
    /// The prompt (for caching its blocks when the prefill completes).
    pub prompt: Arc<[u32]>,
    /// The first prompt block not yet cached (set on admission).
    pub cache_from: usize,
    pub held: Held,
    pub ticks: mpsc::UnboundedSender<Tick>,
}

/// The engine's handle on its scheduler.
pub(crate) struct StepLoop {
    tx: mpsc::UnboundedSender<Seq>,
}

impl StepLoop {
    /// A handle and the queue its scheduler task reads ([`run`]).
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Seq>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (StepLoop { tx }, rx)
    }

    /// Queues a request; false when the scheduler has stopped.
    pub fn submit(&self, seq: Seq) -> bool {
        self.tx.send(seq).is_ok()
    }
}

/// Blocks a request needs for `tokens` tokens.
pub(crate) fn blocks_for(tokens: u64, block_size: u32) -> usize {
    tokens.div_ceil(u64::from(block_size.max(1))) as usize
}
