//! The engine: state shared by every request and listener of one engine.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::clock::SimClock;
use crate::config::{Connector, Faults, SimConfig};
use crate::dp::DpRank;
use crate::ec_store::EcStore;
use crate::error::ApiError;
use crate::kv_pull::PullClient;
use crate::kv_store::KvStore;
use crate::lora::Adapters;
use crate::plan::PlanInput;
use crate::prefix_cache::PrefixCache;
use crate::stats::{Counters, Recent, SimStats};
use crate::tokens::Tok;

/// State shared by every request and listener of one engine.
pub(crate) struct Engine {
    pub cfg: SimConfig,
    pub engine_id: String,
    pub faults: Arc<ArcSwap<Faults>>,
    pub counters: Counters,
    pub recent: Recent,
    pub kv: KvStore,
    /// An encoder's encoded items (`--role encode`); empty otherwise.
    pub ec: EcStore,
    pub shutdown: CancellationToken,
    pub client: PullClient,
    pub side_channel_port: Option<u16>,
    pub bootstrap_port: Option<u16>,
    /// JSON-escaped model name, with quotes.
    pub model_json: String,
    pub aborts: Mutex<HashMap<String, CancellationToken>>,
    /// Cancelled when the engine core dies (fault `crash_on_bad_kv_params`); never reset.
    pub dead: CancellationToken,
    last_kv_error: Mutex<Option<String>>,
    pub next_block: AtomicU64,
    /// The tokenizer prompts go through.
    pub tok: Tok,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The data-parallel ranks (one unless `--data-parallel-size`): each its own prefix cache,
    /// queue and KV-event publisher.
    pub ranks: Vec<DpRank>,
    /// Where the balancer starts its scan for an unpinned request (ties rotate).
    pub rank_turn: AtomicUsize,
    /// Simulated time (`--time-scale`).
    pub clock: SimClock,
    /// The LoRA adapters served now.
    pub adapters: Adapters,
}

impl Engine {
    pub fn new(
        cfg: SimConfig,
        engine_id: String,
        ports: (Option<u16>, Option<u16>),
        faults: Arc<ArcSwap<Faults>>,
        tok: Tok,
    ) -> Self {
        let (side_channel_port, bootstrap_port) = ports;
        let block_size = cfg.cache.block_size.max(1);
        let ranks = (0..cfg.data_parallel_size.max(1))
            .map(|_| {
                let cache = cfg
                    .cache
                    .enable_prefix_caching
                    .then(|| PrefixCache::new(block_size as usize, cfg.cache.kv_cache_blocks));
                DpRank::new(cache, cfg.latency.slots, cfg.step.is_some())
            })
            .collect();
        Engine {
            engine_id,
            faults,
            tok,
            block_size,
            ranks,
            rank_turn: AtomicUsize::new(0),
            counters: Counters {
                step_model: cfg.step.is_some(),
                ..Counters::default()
            },
            recent: Recent::default(),
            kv: KvStore::new(cfg.kv_lease),
            ec: EcStore::new(cfg.kv_lease),
            shutdown: CancellationToken::new(),
            client: PullClient::new(),
            side_channel_port,
            bootstrap_port,
            model_json: crate::respond::json_str(&cfg.model),
            aborts: Mutex::new(HashMap::new()),
            dead: CancellationToken::new(),
            last_kv_error: Mutex::new(None),
            next_block: AtomicU64::new(1),
            clock: SimClock::new(cfg.time_scale),
            adapters: Adapters::new(&cfg.lora_modules),
            cfg,
        }
    }

    /// The engine id of data-parallel rank `rank` (rank 0's is the engine's own).
    pub fn rank_engine_id(&self, rank: usize) -> String {
        match rank {
            0 => self.engine_id.clone(),
            r => format!("{}-dp{r}", self.engine_id),
        }
    }

    /// Whether `id` is the engine id of one of this engine's ranks.
    pub fn serves_engine_id(&self, id: &str) -> bool {
        id == self.engine_id
            || id
                .strip_prefix(self.engine_id.as_str())
                .and_then(|rest| rest.strip_prefix("-dp"))
                .and_then(|r| r.parse::<usize>().ok())
                .is_some_and(|r| r > 0 && r < self.ranks.len())
    }

    /// Cancels every in-flight request registered under `rid`; true if one was found.
    pub fn abort(&self, rid: &str) -> bool {
        let token = self.aborts.lock().ok().and_then(|m| m.get(rid).cloned());
        token.map(|t| t.cancel()).is_some()
    }

    /// Whether the engine core died; `/health` answers 503 and generation requests fail.
    pub fn is_dead(&self) -> bool {
        self.dead.is_cancelled()
    }

    /// Why the last KV load failed, if one did.
    pub fn last_kv_error(&self) -> Option<String> {
        self.last_kv_error.lock().ok().and_then(|e| e.clone())
    }

    /// Counts a failed KV load and keeps its reason. vLLM connectors answer a bare
    /// 500 "Internal server error"; SGLang keeps its own message and status.
    pub fn kv_load_failed(&self, request_id: &str, e: ApiError) -> ApiError {
        self.counters.transfers_failed.fetch_add(1, Relaxed);
        let reason = e.to_string();
        tracing::warn!(%request_id, error = %reason, "KV load failed");
        let public = match (&e, self.cfg.connector) {
            (_, Connector::Sglang) | (ApiError::Aborted(_) | ApiError::EngineDead, _) => e,
            _ => ApiError::KvLoad(reason.clone()),
        };
        if let Ok(mut last) = self.last_kv_error.lock() {
            *last = Some(reason);
        }
        public
    }

    /// The engine core dies: this request and every later one fail, `/health` turns 503.
    pub fn die(&self, request_id: &str, e: &ApiError) -> ApiError {
        self.counters.transfers_failed.fetch_add(1, Relaxed);
        tracing::error!(%request_id, error = %e, "engine core died on invalid KV transfer params (injected crash_on_bad_kv_params)");
        if let Ok(mut last) = self.last_kv_error.lock() {
            *last = Some(e.to_string());
        }
        self.dead.cancel();
        ApiError::EngineDead
    }

    /// `POST /reset_prefix_cache`: every block of every rank goes; subscribers get
    /// `AllBlocksCleared` from each rank.
    pub fn reset_prefix_cache(&self) {
        for rank in &self.ranks {
            if let Some(cache) = &rank.cache
                && let Ok(mut c) = cache.lock()
            {
                c.clear();
            }
            rank.publish(vec![pdcache::events::KvEvent::AllBlocksCleared]);
        }
        self.counters.cache_resets.fetch_add(1, Relaxed);
    }

    /// As after an engine crash and restart: caches empty and event sequences back to 0,
    /// without `AllBlocksCleared` (a crashed engine sends nothing).
    pub fn restart(&self) {
        for rank in &self.ranks {
            if let Some(cache) = &rank.cache
                && let Ok(mut c) = cache.lock()
            {
                c.clear();
            }
            if let Some(sink) = &rank.events {
                sink.restart();
            }
        }
    }

    /// What requests may name: the base model and the adapters loaded now.
    pub fn served(&self) -> (&str, &Adapters) {
        (&self.cfg.model, &self.adapters)
    }

    /// The engine facts a request's plan depends on.
    pub fn plan_input(&self) -> PlanInput {
        PlanInput {
            role: self.cfg.role,
            connector: self.cfg.connector,
            crash_on_bad_kv_params: self.faults.load().crash_on_bad_kv_params,
            handoff_timeout: self.cfg.handoff_timeout,
        }
    }

    /// The same data as `GET /sim/stats`.
    pub fn snapshot(&self) -> SimStats {
        let mut s = self.counters.snapshot(
            self.cfg.role.as_str(),
            self.cfg.connector.as_str(),
            &self.engine_id,
            &self.recent,
        );
        s.last_kv_error = self.last_kv_error();
        s.ec.last_error = self.ec.last_error();
        s.time_scale = self.cfg.time_scale;
        s.engine_dead = self.is_dead();
        for rank in &self.ranks {
            if let Some(cache) = &rank.cache
                && let Ok(c) = cache.lock()
            {
                s.cached_blocks += c.len() as u64;
                s.kv_cache_free_blocks += c.free() as u64;
            }
            if let Some(sink) = &rank.events {
                let e = &sink.counters;
                s.kv_event_batches_published += e.batches_published.load(Relaxed);
                s.kv_event_batches_dropped += e.batches_dropped.load(Relaxed);
                s.kv_events_published += e.events_published.load(Relaxed);
            }
            s.data_parallel_ranks.push(rank.stats());
        }
        s.lora_requests = self
            .adapters
            .list()
            .iter()
            .map(|l| (l.name.clone(), l.requests.load(Relaxed)))
            .collect();
        s
    }
}
