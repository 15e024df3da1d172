//! The engine: state shared by every request and listener of one engine.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::{Connector, Faults, SimConfig};
use crate::error::ApiError;
use crate::kv_pull::PullClient;
use crate::kv_store::KvStore;
use crate::plan::PlanInput;
use crate::stats::{Counters, Recent, SimStats};

/// vLLM's KV block size; used for block ids and prefix-cache granularity.
pub(crate) const BLOCK_SIZE: u32 = 16;
/// Context window of the simulated model.
pub(crate) const MAX_MODEL_LEN: u32 = 32_768;
const PREFIX_CACHE_CAPACITY: usize = 4096;

/// State shared by every request and listener of one engine.
pub(crate) struct Engine {
    pub cfg: SimConfig,
    pub engine_id: String,
    pub faults: ArcSwap<Faults>,
    pub counters: Counters,
    pub recent: Recent,
    pub kv: KvStore,
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
    prefix_cache: Mutex<HashSet<u64>>,
    pub next_block: AtomicU64,
}

impl Engine {
    pub fn new(
        cfg: SimConfig,
        engine_id: String,
        side_channel_port: Option<u16>,
        bootstrap_port: Option<u16>,
    ) -> Self {
        let slots = (cfg.latency.slots > 0).then(|| Arc::new(Semaphore::new(cfg.latency.slots)));
        Engine {
            engine_id,
            faults: ArcSwap::from_pointee(cfg.faults.clone()),
            counters: Counters::default(),
            recent: Recent::default(),
            kv: KvStore::new(cfg.kv_lease),
            slots,
            shutdown: CancellationToken::new(),
            client: PullClient::new(),
            side_channel_port,
            bootstrap_port,
            model_json: crate::respond::json_str(&cfg.model),
            aborts: Mutex::new(HashMap::new()),
            dead: CancellationToken::new(),
            last_kv_error: Mutex::new(None),
            prefix_cache: Mutex::new(HashSet::new()),
            next_block: AtomicU64::new(1),
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

    /// Prefix-cache hit for a prompt computed here: whole blocks, never the last token.
    pub fn cached_tokens(&self, digest: u64, count: u32) -> u32 {
        let Ok(mut seen) = self.prefix_cache.lock() else {
            return 0;
        };
        if seen.contains(&digest) {
            return count.saturating_sub(1) / BLOCK_SIZE * BLOCK_SIZE;
        }
        if seen.len() >= PREFIX_CACHE_CAPACITY {
            seen.clear();
        }
        seen.insert(digest);
        0
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
        s.engine_dead = self.is_dead();
        s
    }
}
