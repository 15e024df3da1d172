//! The engine: state shared by every request and listener of one engine.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use pdcache::events::KvEvent;

use crate::clock::SimClock;
use crate::config::{Connector, Faults, SimConfig};
use crate::ec_store::EcStore;
use crate::error::ApiError;
use crate::kv_events::EventSink;
use crate::kv_pull::PullClient;
use crate::kv_store::KvStore;
use crate::plan::PlanInput;
use crate::prefix_cache::PrefixCache;
use crate::stats::{Counters, Recent, SimStats};
use crate::step_loop::StepLoop;
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
    pub slots: Option<Arc<Semaphore>>,
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
    /// `None` with `--no-enable-prefix-caching`.
    pub cache: Option<Mutex<PrefixCache>>,
    /// The KV-event publisher, when events are on.
    pub events: Option<EventSink>,
    /// Simulated time (`--time-scale`).
    pub clock: SimClock,
    /// The scheduler of the step-loop engine model, when it is on.
    pub steps: Option<StepLoop>,
}

impl Engine {
    pub fn new(
        cfg: SimConfig,
        engine_id: String,
        ports: (Option<u16>, Option<u16>),
        faults: Arc<ArcSwap<Faults>>,
        tok: Tok,
        events: Option<EventSink>,
    ) -> Self {
        let (side_channel_port, bootstrap_port) = ports;
        // The step loop bounds concurrency itself (`max_num_seqs`, KV blocks).
        let slots = (cfg.latency.slots > 0 && cfg.step.is_none())
            .then(|| Arc::new(Semaphore::new(cfg.latency.slots)));
        let block_size = cfg.cache.block_size.max(1);
        let cache = cfg.cache.enable_prefix_caching.then(|| {
            Mutex::new(PrefixCache::new(
                block_size as usize,
                cfg.cache.kv_cache_blocks,
            ))
        });
        Engine {
            engine_id,
            faults,
            tok,
            block_size,
            cache,
            events,
            counters: Counters {
                step_model: cfg.step.is_some(),
                ..Counters::default()
            },
            recent: Recent::default(),
            kv: KvStore::new(cfg.kv_lease),
            ec: EcStore::new(cfg.kv_lease),
            slots,
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
            steps: None,
            cfg,
        }
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

    /// Hands cache changes to the event publisher (nothing when events are off).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if let Some(sink) = &self.events {
            sink.send(events);
        }
    }

    /// `POST /reset_prefix_cache`: every block goes; subscribers get `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        if let Some(cache) = &self.cache
            && let Ok(mut c) = cache.lock()
        {
            c.clear();
        }
        self.counters.cache_resets.fetch_add(1, Relaxed);
        self.publish(vec![KvEvent::AllBlocksCleared]);
    }

    /// As after an engine crash and restart: cache empty and event sequence back to 0,
    /// without `AllBlocksCleared` (a crashed engine sends nothing).
    pub fn restart(&self) {
        if let Some(cache) = &self.cache
            && let Ok(mut c) = cache.lock()
        {
            c.clear();
        }
        if let Some(sink) = &self.events {
            sink.restart();
        }
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
        if let Some(cache) = &self.cache
            && let Ok(c) = cache.lock()
        {
            s.cached_blocks = c.len() as u64;
            s.kv_cache_free_blocks = c.free() as u64;
        }
        if let Some(sink) = &self.events {
            let e = &sink.counters;
            s.kv_event_batches_published = e.batches_published.load(Relaxed);
            s.kv_event_batches_dropped = e.batches_dropped.load(Relaxed);
            s.kv_events_published = e.events_published.load(Relaxed);
        }
        s
    }
}
