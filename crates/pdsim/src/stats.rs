//! Counters behind `GET /sim/stats` and `GET /metrics`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use axum::http::HeaderValue;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// How many request bodies the ring keeps.
pub const RECENT_CAPACITY: usize = 32;

/// Live counters (atomics; cheap on the hot path).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub completions: AtomicU64,
    pub chat_completions: AtomicU64,
    pub responses: AtomicU64,
    pub messages: AtomicU64,
    pub models: AtomicU64,
    pub health: AtomicU64,
    pub metrics: AtomicU64,
    pub abort_requests: AtomicU64,
    pub model_not_found: AtomicU64,
    pub responses_ok: AtomicU64,
    pub responses_error: AtomicU64,
    pub faults_injected: AtomicU64,
    pub transfers_stored: AtomicU64,
    pub transfers_served: AtomicU64,
    pub transfers_refused: AtomicU64,
    pub transfers_pulled: AtomicU64,
    pub transfers_failed: AtomicU64,
    pub recomputed: AtomicU64,
    pub aborted: AtomicU64,
    pub in_flight: AtomicU64,
    pub waiting: AtomicU64,
    pub client_disconnects: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished_length: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_abort: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (vLLM counts every prompt token).
    pub prefix_queries: AtomicU64,
    /// Prompt tokens found in this engine's own prefix cache.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens not computed here: local hits plus KV that arrived from a prefill.
    pub prompt_tokens_cached: AtomicU64,
    /// Prompt tokens computed here.
    pub computed_tokens: AtomicU64,
    /// `vllm:request_prefill_kv_computed_tokens` buckets (cumulative at render time).
    pub computed_hist: [AtomicU64; COMPUTED_BUCKETS.len()],
    /// Requests above the last bucket.
    pub computed_overflow: AtomicU64,
    /// Prefix cache resets (`/reset_prefix_cache`).
    pub cache_resets: AtomicU64,
    /// Step-loop engines: requests in the running set.
    pub running: AtomicU64,
    /// Step-loop engines: steps run.
    pub steps: AtomicU64,
    /// Step-loop engines: simulated time spent in steps, microseconds.
    pub busy_micros: AtomicU64,
    /// The engine runs the step loop (`running` is its running set, not `in_flight`).
    pub step_model: bool,
    /// Encoder: items encoded (one per item of each request).
    pub ec_encoded: AtomicU64,
    /// Encoder: items handed to a consumer over the side channel.
    pub ec_served: AtomicU64,
    /// Encoder: pulls refused (unknown, reused, expired, fault).
    pub ec_refused: AtomicU64,
    /// Consumer: items loaded from an encoder.
    pub ec_pulled: AtomicU64,
    /// Consumer: requests that failed to load an item from an encoder.
    pub ec_failed: AtomicU64,
    /// Consumer: items without encoder parameters, encoded here.
    pub ec_local: AtomicU64,
}

/// Upper bounds of the computed-tokens histogram (vLLM's token-count buckets).
pub(crate) const COMPUTED_BUCKETS: [u64; 11] = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192];

impl Counters {
    /// Records one request's prompt accounting.
    pub fn record_prompt(&self, prompt: u32, local_hit: u32, cached: u32) {
        let computed = u64::from(prompt.saturating_sub(cached));
        self.prefix_queries.fetch_add(u64::from(prompt), Relaxed);
        self.prefix_hits.fetch_add(u64::from(local_hit), Relaxed);
        self.prompt_tokens_cached
            .fetch_add(u64::from(cached), Relaxed);
        self.computed_tokens.fetch_add(computed, Relaxed);
        match COMPUTED_BUCKETS.iter().position(|&b| computed <= b) {
            Some(i) => self.computed_hist[i].fetch_add(1, Relaxed),
            None => self.computed_overflow.fetch_add(1, Relaxed),
        };
    }
}

/// One request as received, kept in a bounded ring.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub path: &'static str,
    pub request_id: Option<HeaderValue>,
    pub data_parallel_rank: Option<HeaderValue>,
    pub traceparent: Option<HeaderValue>,
    pub body: Bytes,
}

fn header_text(v: &HeaderValue) -> String {
    String::from_utf8_lossy(v.as_bytes()).into_owned()
}

/// The last [`RECENT_CAPACITY`] generation requests.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    ring: Mutex<VecDeque<Recorded>>,
}

impl Recent {
    pub fn push(&self, r: Recorded) {
        if let Ok(mut ring) = self.ring.lock() {
            if ring.len() == RECENT_CAPACITY {
                ring.pop_front();
            }
            ring.push_back(r);
        }
    }

    fn snapshot(&self) -> Vec<RecentRequest> {
        let Ok(ring) = self.ring.lock() else {
            return Vec::new();
        };
        ring.iter()
            .map(|r| RecentRequest {
                path: r.path.to_owned(),
                request_id: r.request_id.as_ref().map(header_text),
                data_parallel_rank: r.data_parallel_rank.as_ref().map(header_text),
                traceparent: r.traceparent.as_ref().map(header_text),
                body: String::from_utf8_lossy(&r.body).into_owned(),
            })
            .collect()
    }
}

/// Requests received, by endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointCounts {
    /// `POST /v1/completions`.
    pub completions: u64,
    /// `POST /v1/chat/completions`.
    pub chat_completions: u64,
    /// `POST /v1/responses`.
    #[serde(default)]
    pub responses: u64,
    /// `POST /v1/messages`.
    #[serde(default)]
    pub messages: u64,
    /// `GET /v1/models`.
    pub models: u64,
    /// `GET /health`.
    pub health: u64,
    /// `GET /metrics`.
    pub metrics: u64,
    /// `POST /abort_request`.
    pub abort_requests: u64,
}

/// A request body the engine received (one entry of the bounded ring).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentRequest {
    /// Request path, e.g. `/v1/completions`.
    pub path: String,
    /// The `X-Request-Id` header, if sent.
    pub request_id: Option<String>,
    /// The `X-data-parallel-rank` header, if sent.
    pub data_parallel_rank: Option<String>,
    /// The W3C `traceparent` header, if sent (the trace context the gateway passed on).
    #[serde(default)]
    pub traceparent: Option<String>,
    /// The body as received (lossy UTF-8).
    pub body: String,
}

/// Encoder disaggregation: what an encoder encoded and served, what a consumer (prefill)
/// loaded from encoders or encoded itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EcStats {
    /// Encoder: items encoded (one per multimodal item of each request).
    pub encoded: u64,
    /// Encoder: items handed to a consumer over its side channel.
    pub served: u64,
    /// Encoder: pulls refused (unknown item, already transferred, expired, fault).
    pub refused: u64,
    /// Consumer: items loaded from an encoder (once per distinct item of a request).
    pub pulled: u64,
    /// Consumer: item loads that failed (the request failed with them).
    pub failed: u64,
    /// Consumer: items without encoder parameters, encoded here.
    pub encoded_locally: u64,
    /// Consumer: why the last load failed.
    pub last_error: Option<String>,
}

/// A snapshot of the engine's counters: what `GET /sim/stats` returns.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SimStats {
    /// The engine's role (`prefill`, `decode`, `both`).
    pub role: String,
    /// The engine's connector (`shfs`, ...).
    pub connector: String,
    /// The engine id advertised to decodes.
    pub engine_id: String,
    /// Requests received, by endpoint.
    pub requests: EndpointCounts,
    /// Generation requests answered 200 (streams count when their head is sent).
    pub responses_ok: u64,
    /// Generation requests answered with an error status or a mid-stream error event.
    pub responses_error: u64,
    /// Injected faults that fired (errors, hangs, delays, drops).
    pub faults_injected: u64,
    /// KV entries this prefill stored for a decode.
    pub transfers_stored: u64,
    /// KV entries this prefill handed to a decode over its side channel or bootstrap server.
    pub transfers_served: u64,
    /// KV pulls this prefill refused (unknown, expired, wrong engine, fault).
    pub transfers_refused: u64,
    /// KV entries this decode pulled and verified.
    pub transfers_pulled: u64,
    /// Decode requests that failed their KV handoff.
    pub transfers_failed: u64,
    /// Decode requests that got no KV params and recomputed the prompt.
    pub recomputed: u64,
    /// Requests aborted by `/abort_request`.
    pub aborted: u64,
    /// Generation requests being served now.
    pub in_flight: u64,
    /// Generation requests waiting for a concurrency slot.
    pub waiting: u64,
    /// Requests whose client went away before the response completed.
    pub client_disconnects: u64,
    /// Prompt tokens processed.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// The last few generation request bodies, oldest first.
    pub recent_requests: Vec<RecentRequest>,
    /// Why the last KV load failed (clients only see vLLM's "Internal server error").
    #[serde(default)]
    pub last_kv_error: Option<String>,
    /// The engine core died (fault `crash_on_bad_kv_params`): `/health` is 503, requests fail.
    #[serde(default)]
    pub engine_dead: bool,
    /// Prompt tokens looked up in the prefix cache.
    #[serde(default)]
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in this engine's prefix cache.
    #[serde(default)]
    pub prefix_cache_hits: u64,
    /// Prompt tokens not computed here (local hits plus KV received from a prefill).
    #[serde(default)]
    pub prompt_tokens_cached: u64,
    /// Prompt tokens computed here.
    #[serde(default)]
    pub computed_tokens: u64,
    /// Blocks in the prefix cache now.
    #[serde(default)]
    pub cached_blocks: u64,
    /// KV-event batches sent on the PUB socket.
    #[serde(default)]
    pub kv_event_batches_published: u64,
    /// KV-event batches lost: the queue was full, the socket failed or a fault dropped them.
    #[serde(default)]
    pub kv_event_batches_dropped: u64,
    /// KV events sent (a batch holds one or more).
    #[serde(default)]
    pub kv_events_published: u64,
    /// Prefix cache resets.
    #[serde(default)]
    pub prefix_cache_resets: u64,
    /// Step-loop engines: requests in the running set (the rest of `in_flight` waits).
    #[serde(default)]
    pub running: u64,
    /// Step-loop engines: steps run.
    #[serde(default)]
    pub steps: u64,
    /// Step-loop engines: simulated seconds spent in steps (busy share = this / simulated uptime).
    #[serde(default)]
    pub busy_seconds: f64,
    /// Simulated seconds per wall second.
    #[serde(default)]
    pub time_scale: f64,
    /// KV-cache blocks neither pinned by a request nor reserved for one (step-loop engines:
    /// what admission can still use).
    #[serde(default)]
    pub kv_cache_free_blocks: u64,
    /// Generation requests refused because their `model` is neither the base model nor a
    /// loaded LoRA adapter (vLLM's 404).
    #[serde(default)]
    pub model_not_found: u64,
    /// Generation requests served per LoRA adapter loaded now.
    #[serde(default)]
    pub lora_requests: std::collections::BTreeMap<String, u64>,
    /// Per data-parallel rank (`--data-parallel-size`; one entry for an engine of one rank).
    #[serde(default)]
    pub data_parallel_ranks: Vec<RankStats>,
    /// Encoder disaggregation counters.
    #[serde(default)]
    pub ec: EcStats,
}

/// One data-parallel rank's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankStats {
    /// Generation requests on this rank now.
    pub in_flight: u64,
    /// Of those, waiting for a slot or in the scheduler's queue.
    pub waiting: u64,
    /// Generation requests ever placed on this rank (pinned by the header or balanced).
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// Prompt tokens found in this rank's prefix cache.
    pub prefix_cache_hits: u64,
    /// Blocks in this rank's prefix cache now.
    pub cached_blocks: u64,
}

impl Counters {
    pub fn snapshot(
        &self,
        role: &str,
        connector: &str,
        engine_id: &str,
        recent: &Recent,
    ) -> SimStats {
        SimStats {
            role: role.to_owned(),
            connector: connector.to_owned(),
            engine_id: engine_id.to_owned(),
            requests: EndpointCounts {
                completions: self.completions.load(Relaxed),
                chat_completions: self.chat_completions.load(Relaxed),
                responses: self.responses.load(Relaxed),
                messages: self.messages.load(Relaxed),
                models: self.models.load(Relaxed),
                health: self.health.load(Relaxed),
                metrics: self.metrics.load(Relaxed),
                abort_requests: self.abort_requests.load(Relaxed),
            },
            responses_ok: self.responses_ok.load(Relaxed),
            responses_error: self.responses_error.load(Relaxed),
            faults_injected: self.faults_injected.load(Relaxed),
            transfers_stored: self.transfers_stored.load(Relaxed),
            transfers_served: self.transfers_served.load(Relaxed),
            transfers_refused: self.transfers_refused.load(Relaxed),
            transfers_pulled: self.transfers_pulled.load(Relaxed),
            transfers_failed: self.transfers_failed.load(Relaxed),
            recomputed: self.recomputed.load(Relaxed),
            aborted: self.aborted.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            client_disconnects: self.client_disconnects.load(Relaxed),
            prompt_tokens: self.prompt_tokens.load(Relaxed),
            generation_tokens: self.generation_tokens.load(Relaxed),
            recent_requests: recent.snapshot(),
            last_kv_error: None,
            engine_dead: false,
            prefix_cache_queries: self.prefix_queries.load(Relaxed),
            prefix_cache_hits: self.prefix_hits.load(Relaxed),
            prompt_tokens_cached: self.prompt_tokens_cached.load(Relaxed),
            computed_tokens: self.computed_tokens.load(Relaxed),
            cached_blocks: 0,
            kv_event_batches_published: 0,
            kv_event_batches_dropped: 0,
            kv_events_published: 0,
            prefix_cache_resets: self.cache_resets.load(Relaxed),
            running: self.running.load(Relaxed),
            steps: self.steps.load(Relaxed),
            busy_seconds: self.busy_micros.load(Relaxed) as f64 / 1e6,
            time_scale: 1.0,
            kv_cache_free_blocks: 0,
            model_not_found: self.model_not_found.load(Relaxed),
            lora_requests: Default::default(),
            data_parallel_ranks: Vec::new(),
            ec: EcStats {
                encoded: self.ec_encoded.load(Relaxed),
                served: self.ec_served.load(Relaxed),
                refused: self.ec_refused.load(Relaxed),
                pulled: self.ec_pulled.load(Relaxed),
                failed: self.ec_failed.load(Relaxed),
                encoded_locally: self.ec_local.load(Relaxed),
                last_error: None,
            },
        }
    }

    /// Requests recorded by [`Counters::record_prompt`].
    fn prefix_queries_count(&self) -> u64 {
        self.computed_hist
            .iter()
            .map(|c| c.load(Relaxed))
            .sum::<u64>()
            + self.computed_overflow.load(Relaxed)
    }

    /// Prometheus text exposition with a few vLLM-named series.
    pub fn render_prometheus(&self, model: &str, role: &str, connector: &str) -> String {
        use std::fmt::Write;
        let mut out = String::with_capacity(2048);
        let l = format!("model_name=\"{model}\"");
        let g = |out: &mut String, name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{l}}} {v}"
            );
        };
        g(
            &mut out,
            "vllm:num_requests_running",
            "gauge",
            "Requests in model execution batches.",
            if self.step_model {
                self.running.load(Relaxed)
            } else {
                self.in_flight.load(Relaxed)
            },
        );
        g(
            &mut out,
            "vllm:num_requests_waiting",
            "gauge",
            "Requests waiting to be processed.",
            self.waiting.load(Relaxed),
        );
        g(
            &mut out,
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            self.prompt_tokens.load(Relaxed),
        );
        g(
            &mut out,
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        for (reason, v) in [
            ("length", &self.finished_length),
            ("stop", &self.finished_stop),
            ("abort", &self.finished_abort),
        ] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP pdsim_kv_transfers_total KV handoffs by outcome.\n# TYPE pdsim_kv_transfers_total counter"
        );
        for (outcome, v) in [
            ("stored", &self.transfers_stored),
            ("served", &self.transfers_served),
            ("refused", &self.transfers_refused),
            ("pulled", &self.transfers_pulled),
            ("failed", &self.transfers_failed),
            ("recomputed", &self.recomputed),
        ] {
            let _ = writeln!(
                out,
                "pdsim_kv_transfers_total{{{l},role=\"{role}\",connector=\"{connector}\",outcome=\"{outcome}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP pdsim_ec_items_total Encoder-cache items by outcome (encoder disaggregation).\n# TYPE pdsim_ec_items_total counter"
        );
        for (outcome, v) in [
            ("encoded", &self.ec_encoded),
            ("served", &self.ec_served),
            ("refused", &self.ec_refused),
            ("pulled", &self.ec_pulled),
            ("failed", &self.ec_failed),
            ("encoded_locally", &self.ec_local),
        ] {
            let _ = writeln!(
                out,
                "pdsim_ec_items_total{{{l},role=\"{role}\",outcome=\"{outcome}\"}} {}",
                v.load(Relaxed)
            );
        }
        g(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_queries.load(Relaxed),
        );
        g(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_hits.load(Relaxed),
        );
        g(
            &mut out,
            "vllm:prompt_tokens_cached_total",
            "counter",
            "Number of cached prompt tokens (local prefix cache and KV transfer).",
            self.prompt_tokens_cached.load(Relaxed),
        );
        let name = "vllm:request_prefill_kv_computed_tokens";
        let _ = writeln!(
            out,
            "# HELP {name} Number of prompt tokens computed per request (not cached).\n# TYPE {name} histogram"
        );
        let mut cum = 0;
        for (b, c) in COMPUTED_BUCKETS.iter().zip(&self.computed_hist) {
            cum += c.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{l},le=\"{b}.0\"}} {cum}");
        }
        let count = self.prefix_queries_count();
        let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum{{{l}}} {}",
            self.computed_tokens.load(Relaxed)
        );
        let _ = writeln!(out, "{name}_count{{{l}}} {count}");
        g(
            &mut out,
            "pdsim_steps_total",
            "counter",
            "Engine steps run (step-loop engine model).",
            self.steps.load(Relaxed),
        );
        let name = "pdsim_busy_seconds_total";
        let _ = writeln!(
            out,
            "# HELP {name} Simulated seconds spent in engine steps.\n# TYPE {name} counter\n{name}{{{l}}} {}",
            self.busy_micros.load(Relaxed) as f64 / 1e6
        );
        g(
            &mut out,
            "pdsim_client_disconnects_total",
            "counter",
            "Requests whose client left early.",
            self.client_disconnects.load(Relaxed),
        );
        g(
            &mut out,
            "pdsim_aborted_total",
            "counter",
            "Requests aborted by /abort_request.",
            self.aborted.load(Relaxed),
        );
        out
    }
}
