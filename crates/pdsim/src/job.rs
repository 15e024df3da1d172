//! The job that runs one generation request from plan to last byte.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use pdcache::events::KvEvent;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::addressed::Answer;
use crate::config::Connector;
use crate::dp::{DpRank, OnRank};
use crate::engine::Engine;
use crate::error::ApiError;
use crate::kv_pull::{PullError, mooncake_worker, seg};
use crate::kv_store::KvWire;
use crate::plan::{Consume, Plan, Produce, kv_fail};
use crate::prefix_cache::{BlockChain, Pins};
use crate::request::{Endpoint, GenRequest};
use crate::respond::ChoiceOut;
use crate::step_loop::{Held, Seq, StepLoop, Tick, blocks_for};
use crate::tokens::word;

/// vLLM 0.33 NixlConnector `kv_transfer_params` of a prefill response, in vLLM's key order.
#[derive(serde::Serialize)]
struct KvParams<'a> {
    do_remote_prefill: bool,
    do_remote_decode: bool,
    remote_block_ids: [Vec<u64>; 1],
    remote_engine_id: &'a str,
    remote_request_id: &'a str,
    remote_host: &'a str,
    remote_port: u16,
    tp_size: u32,
    dcp_size: u32,
    pp_size: u32,
    remote_num_tokens: u32,
    /// vLLM 0.32 answers `null` here; the lease is enforced by the store, not advertised.
    remote_blocks_expiry_time: Option<f64>,
    remote_registration_generation: u64,
    transfer_mode: &'static str,
    remote_prefill_cached_tokens: u32,
}

/// Marks a request finished; when dropped unfinished the client went away.
pub(crate) struct InFlight {
    engine: Arc<Engine>,
    done: bool,
}

impl InFlight {
    pub fn new(engine: Arc<Engine>) -> Self {
        engine.counters.in_flight.fetch_add(1, Relaxed);
        InFlight {
            engine,
            done: false,
        }
    }

    pub fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let c = &self.engine.counters;
        c.in_flight.fetch_sub(1, Relaxed);
        if !self.done {
            c.client_disconnects.fetch_add(1, Relaxed);
            c.finished_abort.fetch_add(1, Relaxed);
        }
    }
}

/// Registration in the abort table (sglang `/abort_request`), removed on drop.
struct AbortReg {
    engine: Arc<Engine>,
    keys: Vec<String>,
    token: CancellationToken,
}

impl Drop for AbortReg {
    fn drop(&mut self) {
        if let Ok(mut m) = self.engine.aborts.lock() {
            for k in &self.keys {
                m.remove(k);
            }
        }
    }
}

/// Caches the full blocks of `tokens` from block `from` on in `rank`'s cache (pinned for the
/// request) and publishes the change.
pub(crate) fn store(
    rank: &DpRank,
    block_size: u32,
    chain: &mut BlockChain,
    pins: &mut Pins,
    tokens: &[u32],
    from: usize,
) {
    let Some(cache) = &rank.cache else { return };
    chain.extend(tokens, block_size as usize);
    let mut events = Vec::new();
    if let Ok(mut c) = cache.lock() {
        c.insert(&chain.values, tokens, from, pins, &mut events);
    }
    if let Some(lora) = chain.lora() {
        for e in &mut events {
            if let KvEvent::BlockStored(s) = e {
                s.set_lora(&lora.name, lora.id);
            }
        }
    }
    rank.publish(events);
}

/// One generation request from plan to last byte.
pub(crate) struct Job {
    pub engine: Arc<Engine>,
    pub endpoint: Endpoint,
    pub req: GenRequest,
    /// JSON-escaped response id, with quotes.
    pub id_json: String,
    /// JSON-escaped model name answered (the adapter's for an adapter request), with quotes.
    pub model_json: String,
    pub id: String,
    pub created: u64,
    pub guard: InFlight,
    /// The data-parallel rank it runs on (counted there while it lives).
    rank: OnRank,
    plan: Plan,
    abort: Option<AbortReg>,
    permit: Option<OwnedSemaphorePermit>,
    /// Cached tokens reported in usage.
    pub cached: u32,
    sglang_published: bool,
    /// The prompt's full-block hashes (empty without prefix caching).
    chain: BlockChain,
    /// Cache blocks this request holds until it ends.
    pins: Pins,
    /// The step loop's tokens for this request, once submitted to it.
    ticks: Option<mpsc::UnboundedReceiver<Tick>>,
    /// Choices generated before they are asked for (the step loop needs their length).
    generated: Option<Vec<ChoiceOut>>,
    /// TensorRT-LLM context phase: the `disaggregated_params` its answer carries.
    pub trtllm_context: Option<serde_json::Value>,
}

impl Job {
    pub fn new(
        engine: Arc<Engine>,
        endpoint: Endpoint,
        req: GenRequest,
        base_id: &str,
        plan: Plan,
        guard: InFlight,
        rank: OnRank,
    ) -> Self {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl-",
            Endpoint::Chat | Endpoint::Messages => "chatcmpl-",
            Endpoint::Responses => "resp_",
        };
        let id = format!("{prefix}{base_id}");
        let abort = (engine.cfg.connector == Connector::Sglang).then(|| {
            let token = CancellationToken::new();
            let mut keys = vec![base_id.to_owned(), id.clone()];
            if let Some(rid) = &req.rid {
                keys.push(rid.clone());
            }
            if let Ok(mut m) = engine.aborts.lock() {
                for k in &keys {
                    m.insert(k.clone(), token.clone());
                }
            }
            AbortReg {
                engine: engine.clone(),
                keys,
                token,
            }
        });
        // vLLM answers an adapter request under the adapter's name.
        let lora = req.lora.clone();
        let model_json = match &lora {
            Some(l) => {
                l.requests.fetch_add(1, Relaxed);
                crate::respond::json_str(&l.name)
            }
            None => engine.model_json.clone(),
        };
        Job {
            model_json,
            id_json: crate::respond::json_str(&id),
            id,
            created: engine.clock.now_unix() as u64,
            engine,
            endpoint,
            req,
            guard,
            rank,
            plan,
            abort,
            permit: None,
            cached: 0,
            sglang_published: false,
            chain: BlockChain::for_model(lora, &[], 0),
            pins: Pins::default(),
            ticks: None,
            generated: None,
            trtllm_context: None,
        }
    }

    /// Runs `fut` unless the engine shuts down or the request is aborted first.
    async fn guarded<F: Future>(&self, fut: F) -> Result<F::Output, ApiError> {
        let abort = self.abort.as_ref().map(|a| a.token.clone());
        let aborted = async move {
            match abort {
                Some(t) => t.cancelled_owned().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = self.engine.shutdown.cancelled() => Err(ApiError::Aborted("engine is shutting down".into())),
            () = self.engine.dead.cancelled() => Err(ApiError::EngineDead),
            () = aborted => {
                self.engine.counters.aborted.fetch_add(1, Relaxed);
                Err(ApiError::Aborted(format!("Request {} was aborted.", self.id)))
            }
            out = fut => Ok(out),
        }
    }

    /// Sleeps simulated time `d` (no timer at all when zero), abortable.
    pub async fn delay(&self, d: Duration) -> Result<(), ApiError> {
        if d.is_zero() {
            return Ok(());
        }
        self.guarded(tokio::time::sleep(self.engine.clock.wall(d)))
            .await
    }

    /// Waits for the next generated token: the step loop's, or one inter-token latency.
    pub async fn next_token(&mut self) -> Result<(), ApiError> {
        let Some(mut rx) = self.ticks.take() else {
            return self.delay(self.engine.cfg.latency.itl).await;
        };
        let tick = self.guarded(rx.recv()).await;
        self.ticks = Some(rx);
        match tick? {
            Some(Tick::Token) => Ok(()),
            Some(Tick::Last(held)) => {
                let Held { chain, pins } = *held;
                self.chain = chain;
                self.pins = pins;
                Ok(())
            }
            None => Err(ApiError::Aborted("engine is shutting down".into())),
        }
    }

    /// Waits for `n` more generated tokens.
    pub async fn tokens(&mut self, n: u32) -> Result<(), ApiError> {
        if self.ticks.is_none() {
            return self.delay(self.engine.cfg.latency.itl * n).await;
        }
        for _ in 0..n {
            self.next_token().await?;
        }
        Ok(())
    }

    /// Hands the request to the step loop and waits for its first token. `compute` prompt
    /// tokens are computed here; `local_hit` are cached and pinned.
    async fn step(
        &mut self,
        steps: &StepLoop,
        compute: u32,
        local_hit: u32,
    ) -> Result<(), ApiError> {
        let engine = self.engine.clone();
        let bs = engine.block_size;
        let count = self.req.prompt.count;
        let choices = self.generate();
        let outputs = choices
            .iter()
            .map(|c| c.words.len())
            .max()
            .unwrap_or(0)
            .max(1) as u32;
        self.generated = Some(choices);
        // At least the last prompt token runs through the model: its step yields the first token.
        let prefill = compute.clamp(1, count.max(1));
        let hit_blocks = (local_hit / bs) as usize;
        let total_blocks = blocks_for(u64::from(count) + u64::from(outputs), bs);
        let capacity = engine.cfg.cache.kv_cache_blocks;
        if total_blocks > capacity {
            return Err(ApiError::bad(format!(
                "The request needs {total_blocks} KV-cache blocks of {bs} tokens and the engine has {capacity}."
            )));
        }
        // The scheduler pins the cached prefix again on admission; a waiting request holds none.
        if let Some(cache) = &engine.ranks[self.rank.rank()].cache
            && let Ok(mut c) = cache.lock()
        {
            c.release(&mut self.pins);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let seq = Seq {
            prefill_left: prefill,
            context: count.saturating_sub(prefill),
            decode_left: outputs - 1,
            total_blocks,
            lookup_max: (count.saturating_sub(1) / bs) as usize,
            hit_blocks,
            local: compute + local_hit == count,
            prompt: Arc::from(self.req.prompt.ids.as_slice()),
            cache_from: hit_blocks,
            held: Held {
                chain: std::mem::take(&mut self.chain),
                pins: std::mem::take(&mut self.pins),
            },
            ticks: tx,
        };
        if !steps.submit(seq) {
            return Err(ApiError::Aborted("engine is shutting down".into()));
        }
        self.ticks = Some(rx);
        self.next_token().await
    }

    /// Slot, handoff and prefill compute: everything before the first token.
    pub async fn prepare(&mut self) -> Result<(), ApiError> {
        let engine = self.engine.clone();
        let dp = &engine.ranks[self.rank.rank()];
        if let Some(sem) = &dp.slots {
            engine.counters.waiting.fetch_add(1, Relaxed);
            dp.counters.waiting.fetch_add(1, Relaxed);
            let r = self.guarded(sem.clone().acquire_owned()).await;
            engine.counters.waiting.fetch_sub(1, Relaxed);
            dp.counters.waiting.fetch_sub(1, Relaxed);
            self.permit =
                Some(r?.map_err(|_| ApiError::Aborted("engine is shutting down".into()))?);
        }
        match std::mem::replace(&mut self.plan.produce, Produce::Nothing) {
            Produce::Fail(e) => return Err(e),
            // A key still holding another request's KV: the engines would mix the two transfers.
            Produce::Keep { key, .. } if engine.kv.transfer_pending(&key) => {
                return Err(kv_fail(format!(
                    "request id {key} is already in use by a transfer in flight"
                )));
            }
            Produce::Sglang(room) => {
                let deadline = Instant::now() + engine.cfg.handoff_timeout;
                let r = self
                    .guarded(
                        engine
                            .kv
                            .room_await_decode(&engine.shutdown, room, deadline),
                    )
                    .await;
                if !matches!(r, Ok(Ok(()))) {
                    engine
                        .kv
                        .room_fail(room, "prefill failed before the transfer");
                }
                r?.map_err(|e| kv_fail(format!("KV transfer failed: {e}")))?;
                self.plan.produce = Produce::Sglang(room);
            }
            p => self.plan.produce = p,
        }
        let count = self.req.prompt.count;
        let local_hit = self.lookup();
        let (compute, cached) = match std::mem::replace(&mut self.plan.consume, Consume::Local) {
            Consume::Local => (count - local_hit, local_hit),
            Consume::Recompute => {
                engine.counters.recomputed.fetch_add(1, Relaxed);
                tracing::debug!(request_id = %self.id, "decode without KV params: recomputing the prompt");
                (count - local_hit, local_hit)
            }
            Consume::Fail(e) => return Err(engine.kv_load_failed(&self.id, e)),
            Consume::Crash(e) => return Err(engine.die(&self.id, &e)),
            _ if engine.faults.load().ignore_kv => {
                engine.counters.faults_injected.fetch_add(1, Relaxed);
                engine.counters.recomputed.fetch_add(1, Relaxed);
                tracing::debug!(request_id = %self.id, "KV params ignored (injected ignore_kv): recomputing the prompt");
                (count - local_hit, local_hit)
            }
            remote => match self.pull(remote).await {
                Ok(wire) => {
                    engine.counters.transfers_pulled.fetch_add(1, Relaxed);
                    // The prefill's own hits travel with its KV; a local hit is reported when larger.
                    (0, wire.cached_tokens.max(local_hit))
                }
                Err(e) if engine.faults.load().recompute_on_kv_failure => {
                    // Counted and logged as a failed load, then served like vLLM's recovery.
                    let _ = engine.kv_load_failed(&self.id, e);
                    engine.counters.recomputed.fetch_add(1, Relaxed);
                    (count - local_hit, local_hit)
                }
                Err(e) => return Err(engine.kv_load_failed(&self.id, e)),
            },
        };
        self.cached = cached;
        engine
            .counters
            .record_prompt(count, local_hit, count - compute);
        dp.counters
            .prompt_tokens
            .fetch_add(u64::from(count), Relaxed);
        dp.counters
            .prefix_cache_hits
            .fetch_add(u64::from(local_hit), Relaxed);
        if let Some(steps) = &dp.steps {
            return self.step(steps, compute, local_hit).await;
        }
        let lat = &engine.cfg.latency;
        self.delay(lat.prefill_per_token * compute + lat.ttft)
            .await?;
        // The prompt's KV now exists here, computed or received: cache its full blocks.
        let from = local_hit as usize / self.engine.block_size as usize;
        store(
            dp,
            engine.block_size,
            &mut self.chain,
            &mut self.pins,
            &self.req.prompt.ids,
            from,
        );
        Ok(())
    }

    /// Looks the prompt up in the prefix cache and pins the hit; the hit in tokens, capped
    /// at `prompt_tokens - 1` like vLLM (a whole cached prompt recomputes its last block).
    fn lookup(&mut self) -> u32 {
        let engine = self.engine.clone();
        let bs = engine.block_size;
        let Some(cache) = &engine.ranks[self.rank.rank()].cache else {
            return 0;
        };
        self.chain =
            BlockChain::for_model(self.req.lora.clone(), &self.req.prompt.ids, bs as usize);
        let max = (self.req.prompt.count.saturating_sub(1) / bs) as usize;
        let Ok(mut c) = cache.lock() else { return 0 };
        let hit = c.lookup(&self.chain.values, max, &mut self.pins);
        hit as u32 * bs
    }

    async fn pull(&self, consume: Consume) -> Result<KvWire, ApiError> {
        let engine = &self.engine;
        let fail = |e: String| kv_fail(format!("KV transfer failed for request {}: {e}", self.id));
        if engine.faults.load().refuse_kv {
            engine.counters.faults_injected.fetch_add(1, Relaxed);
            return Err(fail("KV handoff refused (injected fault)".into()));
        }
        let timeout = engine.cfg.handoff_timeout + Duration::from_secs(1);
        let body = match consume {
            Consume::Pull(url) | Consume::Sglang(url) | Consume::Wait(url) => self
                .guarded(engine.client.get(url, timeout))
                .await?
                .map_err(|e| fail(e.to_string()))?,
            Consume::Mooncake {
                bootstrap,
                engine_id,
                transfer_id,
            } => {
                let q = self
                    .guarded(engine.client.get(format!("{bootstrap}/query"), timeout))
                    .await?
                    .map_err(|e| fail(e.to_string()))?;
                let worker = mooncake_worker(&q, &engine_id).map_err(fail)?;
                let ms = engine.cfg.handoff_timeout.as_millis();
                let url = format!(
                    "http://{worker}/mooncake/{}?engine_id={}&timeout_ms={ms}",
                    seg(&transfer_id),
                    seg(&engine_id)
                );
                self.guarded(engine.client.get(url, timeout))
                    .await?
                    .map_err(|e| fail(e.to_string()))?
            }
            Consume::Local | Consume::Recompute | Consume::Fail(_) | Consume::Crash(_) => {
                return Err(fail("internal: nothing to pull".into()));
            }
        };
        let wire: KvWire = serde_json::from_slice(&body)
            .map_err(|_| fail(PullError::Malformed("side channel".into()).to_string()))?;
        let own = format!("{:016x}", self.req.prompt.digest);
        if wire.digest != own || wire.num_tokens != self.req.prompt.count {
            return Err(fail(format!(
                "KV does not match this prompt (remote {} tokens digest {}, local {} tokens digest {own})",
                wire.num_tokens, wire.digest, self.req.prompt.count
            )));
        }
        Ok(wire)
    }

    /// Every choice, generated up front (deterministic, cheap).
    pub fn choices(&mut self) -> Vec<ChoiceOut> {
        self.generated.take().unwrap_or_else(|| self.generate())
    }

    fn generate(&self) -> Vec<ChoiceOut> {
        let r = &self.req;
        (0..r.n)
            .map(|c| {
                let mut words = Vec::with_capacity(r.max_tokens.min(4096) as usize);
                for i in 0..r.max_tokens {
                    let w = word(r.prompt.digest, c, i);
                    if i >= r.min_tokens
                        && let Some(s) = r.stop.iter().find(|s| s.trim() == w)
                    {
                        return ChoiceOut {
                            words,
                            finish: "stop",
                            stop_reason: Some(s.clone()),
                        };
                    }
                    words.push(w);
                }
                ChoiceOut {
                    words,
                    finish: "length",
                    stop_reason: None,
                }
            })
            .collect()
    }

    /// Hands the KV over as the connector does; returns `kv_transfer_params` JSON.
    pub fn finish(&mut self, choices: &[ChoiceOut]) -> Option<String> {
        let engine = self.engine.clone();
        let c = &engine.counters;
        c.prompt_tokens
            .fetch_add(u64::from(self.req.prompt.count), Relaxed);
        for ch in choices {
            c.generation_tokens
                .fetch_add(ch.words.len() as u64, Relaxed);
            match ch.finish {
                "stop" => c.finished_stop.fetch_add(1, Relaxed),
                _ => c.finished_length.fetch_add(1, Relaxed),
            };
        }
        let dp = &engine.ranks[self.rank.rank()];
        if dp.cache.is_some()
            && let Some(first) = choices.first()
            && first.words.len() > 1
        {
            // The KV of every generated token but the last exists now (vLLM caches it too).
            let mut tokens = self.req.prompt.ids.clone();
            tokens.extend(
                engine
                    .tok
                    .generated_ids(&first.words[..first.words.len() - 1]),
            );
            let from = self.chain.values.len();
            store(
                dp,
                engine.block_size,
                &mut self.chain,
                &mut self.pins,
                &tokens,
                from,
            );
        }
        let prompt = &self.req.prompt;
        let entry = || engine.kv.entry(prompt.digest, prompt.count, self.cached);
        match std::mem::replace(&mut self.plan.produce, Produce::Nothing) {
            Produce::Params => {
                // vLLM's internal id: `cmpl-<X-Request-Id>-<prompt index>` (chat has no
                // index), plus the engine's 8-hex random suffix.
                let request_id = match self.endpoint {
                    Endpoint::Completions => {
                        format!("{}-0-{:08x}", self.id, rand::random::<u32>())
                    }
                    Endpoint::Chat | Endpoint::Messages => {
                        format!("{}-{:08x}", self.id, rand::random::<u32>())
                    }
                    Endpoint::Responses => {
                        format!("{}_0-{:08x}", self.id, rand::random::<u32>())
                    }
                };
                let blocks = prompt.count.div_ceil(engine.block_size);
                let first = engine
                    .next_block
                    .fetch_add(u64::from(blocks), Ordering::Relaxed);
                let block_ids: Vec<u64> = (first..first + u64::from(blocks)).collect();
                let params = KvParams {
                    do_remote_prefill: true,
                    do_remote_decode: false,
                    remote_block_ids: [block_ids],
                    remote_engine_id: &engine.engine_id,
                    remote_request_id: &request_id,
                    remote_host: &engine.cfg.advertise_host,
                    remote_port: engine
                        .faults
                        .load()
                        .advertise_side_channel_port
                        .or(engine.side_channel_port)
                        .unwrap_or(0),
                    tp_size: 1,
                    dcp_size: 1,
                    pp_size: 1,
                    remote_num_tokens: prompt.count,
                    remote_blocks_expiry_time: None,
                    remote_registration_generation: 0,
                    transfer_mode: "pull",
                    remote_prefill_cached_tokens: self.cached,
                };
                let params = serde_json::to_string(&params).ok();
                engine.kv.put_request(request_id, entry());
                c.transfers_stored.fetch_add(1, Relaxed);
                params
            }
            Produce::Mooncake(transfer_id) => {
                if choices.first().is_some_and(|ch| ch.finish == "length") {
                    engine.kv.put_transfer(transfer_id, entry());
                    c.transfers_stored.fetch_add(1, Relaxed);
                }
                None
            }
            Produce::Sglang(room) => {
                engine.kv.room_publish(room, entry());
                self.sglang_published = true;
                c.transfers_stored.fetch_add(1, Relaxed);
                None
            }
            Produce::Keep { key, answer } => {
                engine.kv.put_transfer(key.clone(), entry());
                c.transfers_stored.fetch_add(1, Relaxed);
                let side = engine.side_channel_port.unwrap_or(0);
                match answer {
                    Answer::Nothing => None,
                    Answer::MoriioRead => {
                        let blocks = prompt.count.div_ceil(engine.block_size);
                        let first = engine
                            .next_block
                            .fetch_add(u64::from(blocks), Ordering::Relaxed);
                        let ids: Vec<u64> = (first..first + u64::from(blocks)).collect();
                        let params = serde_json::json!({
                            "do_remote_prefill": true,
                            "do_remote_decode": false,
                            "remote_engine_id": engine.engine_id,
                            "remote_block_ids": ids,
                            "remote_host": engine.cfg.advertise_host,
                            "remote_handshake_port": side,
                        });
                        serde_json::to_string(&params).ok()
                    }
                    Answer::Trtllm { disagg_request_id } => {
                        let first = choices
                            .first()
                            .and_then(|ch| ch.words.first())
                            .map(|w| engine.tok.generated_ids(std::slice::from_ref(w)))
                            .unwrap_or_default();
                        self.trtllm_context = Some(serde_json::json!({
                            "request_type": "context_only",
                            "first_gen_tokens": first,
                            "ctx_request_id": key.parse::<u64>().unwrap_or(0),
                            "opaque_state": crate::addressed::opaque_state(&engine.cfg.advertise_host, side),
                            "draft_tokens": null,
                            "disagg_request_id": disagg_request_id,
                        }));
                        None
                    }
                }
            }
            Produce::Nothing | Produce::Fail(_) => None,
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(cache) = &self.engine.ranks[self.rank.rank()].cache
            && let Ok(mut c) = cache.lock()
        {
            c.release(&mut self.pins);
        }
        if let Produce::Sglang(room) = self.plan.produce
            && !self.sglang_published
        {
            self.engine
                .kv
                .room_fail(room, "prefill request ended before the transfer");
        }
    }
}
