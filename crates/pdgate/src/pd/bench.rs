//! What `benches/decision.rs` drives: a whole cache-aware routing decision (match, score both
//! roles, record the chosen endpoints' keys) through the same code a request runs, against a
//! fleet and an index of a chosen size. Not an API: hidden from the docs, kept for the bench.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use crate::config::Config;
use crate::endpoints::{Endpoint, Snapshot};
use crate::pd::select;
use crate::state::Gateway;

use crate::cache::{Cache, PrefixView};

/// A gateway with `cache_aware` on both roles over a static fleet, and prepared prompts.
pub struct DecisionBench {
    gw: Arc<Gateway>,
    cache: Arc<Cache>,
    snap: Arc<Snapshot>,
    views: Vec<PrefixView>,
}

impl std::fmt::Debug for DecisionBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionBench")
            .field("prompts", &self.views.len())
            .finish_non_exhaustive()
    }
}

/// Index sizes after seeding.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Index entries.
    pub entries: usize,
    /// Bytes the index allocated.
    pub bytes: usize,
}

impl DecisionBench {
    /// `prefills` and `decodes` endpoints (shfs), block size `block_size`.
    pub fn new(prefills: usize, decodes: usize, block_size: usize) -> Result<Self, String> {
        let mut toml = format!(
            "kv_connector = \"shfs\"\nprefill_policy = \"cache_aware\"\n\
             decode_policy = \"cache_aware\"\n[cache]\nblock_size = {block_size}\n"
        );
        for (role, n) in [("prefill", prefills), ("decode", decodes)] {
            for i in 0..n {
                let port = if role == "prefill" { 8000 } else { 9000 };
                toml.push_str(&format!(
                    "[[{role}]]\nurl = \"http://10.{}.{}.{}:{port}\"\n",
                    i / 65536,
                    (i / 256) % 256,
                    i % 256
                ));
            }
        }
        let config = Config::from_toml(&toml).map_err(|e| e.to_string())?;
        let pods = config.pods().map_err(|e| e.to_string())?;
        let gw = Gateway::new(config, kvtransfer::Registry::with_builtins())
            .map_err(|e| e.to_string())?;
        let snap = gw.publish(&pods, &BTreeSet::new());
        let cache = gw
            .routing
            .cache
            .clone()
            .ok_or("cache_aware policies build the cache")?;
        Ok(DecisionBench {
            gw,
            cache,
            snap,
            views: Vec::new(),
        })
    }

    /// Endpoints: prefills first, then decodes.
    pub fn endpoints(&self) -> usize {
        self.snap.prefill.len() + self.snap.decode.len()
    }

    /// Records that endpoint `i` (prefills first) holds `tokens`' blocks, as a decision would.
    pub fn seed(&self, i: usize, tokens: &[u32]) {
        let mc = self.cache.model(None, &self.snap);
        let view = mc.token_view(tokens);
        let ep = self.endpoint(i);
        let mut scorer = mc.lock();
        scorer.prepare(&view);
        scorer.record(&[&**ep], &view, Instant::now(), |_| {});
    }

    /// Records that endpoint `i` (prefills first) holds the first `blocks` blocks of prompt
    /// `p` (from [`DecisionBench::prompt`]), as a decision would: a prompt written a block at
    /// a time, its entries interleaved with other writes.
    pub fn seed_prefix(&self, i: usize, p: usize, blocks: usize) {
        let Some(whole) = self.views.get(p) else {
            return;
        };
        let keys = whole.keys[..blocks.min(whole.keys.len())].to_vec();
        let view = PrefixView {
            prompt_tokens: (keys.len() as u32).saturating_mul(whole.block_size),
            keys,
            kind: whole.kind,
            block_size: whole.block_size,
        };
        let mc = self.cache.model(None, &self.snap);
        let ep = self.endpoint(i);
        mc.lock().record(&[&**ep], &view, Instant::now(), |_| {});
    }

    /// Endpoint `i`, prefills first.
    fn endpoint(&self, i: usize) -> &Arc<Endpoint> {
        match i.checked_sub(self.snap.prefill.len()) {
            None => &self.snap.prefill[i],
            Some(d) => &self.snap.decode[d],
        }
    }

    /// Adds a prompt to decide on; returns its number.
    pub fn prompt(&mut self, tokens: &[u32]) -> usize {
        let view = self.cache.model(None, &self.snap).token_view(tokens);
        self.views.push(view);
        self.views.len() - 1
    }

    /// One decision for prompt `p`; returns whether the decode serves it alone.
    pub fn decide(&self, p: usize) -> bool {
        let Some(view) = self.views.get(p) else {
            return false;
        };
        select::pair(&self.gw.routing, &self.snap, None, Some(view))
            .is_ok_and(|pair| pair.decode_only)
    }

    /// The index's size.
    pub fn sizes(&self) -> Sizes {
        let s = self.cache.model(None, &self.snap).stats();
        Sizes {
            entries: s.entries,
            bytes: s.bytes,
        }
    }
}
