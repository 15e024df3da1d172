//! The result of a run: a JSON-serialisable report and its human table.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::config::{Config, Load};
use crate::metrics::EngineTotals;
use crate::stats::{Percentiles, Shard};
use crate::trace::{Oracle, WorkloadKind};
use crate::workload::{Api, DirectConnector};

/// What was loaded.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum TargetInfo {
    /// A single OpenAI endpoint (gateway or engine).
    Url {
        /// Base URL.
        url: String,
    },
    /// Replicas of a gateway, each request to the next in turn.
    Replicas {
        /// Base URLs.
        urls: Vec<String>,
    },
    /// Direct PD, performed by pdbench itself.
    Direct {
        /// Prefill base URL.
        prefill: String,
        /// Decode base URL.
        decode: String,
        /// Connector used to shape the legs.
        connector: DirectConnector,
    },
}

/// The trace file a replay read.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayInfo {
    /// Its path.
    pub path: String,
    /// Requests in the file.
    pub requests_in_file: usize,
    /// Requests that came due before the run's bound (sent, or counted as overflow).
    pub requests_due: usize,
    /// Seconds from the file's first arrival to its last (trace time).
    pub span_s: f64,
}

/// SLO attainment: shares of all requests (failed ones count as missing every objective).
#[derive(Debug, Clone, Serialize)]
pub struct SloReport {
    /// TTFT objective (ms), if set.
    pub ttft_ms: Option<f64>,
    /// ITL objective (ms) on each request's mean gap between tokens, if set.
    pub itl_ms: Option<f64>,
    /// Share of requests within the TTFT objective.
    pub ttft_attainment: f64,
    /// Share of requests within the ITL objective.
    pub itl_attainment: f64,
    /// Share within both (an unset objective is always met).
    pub attainment: f64,
    /// Requests per second within both.
    pub goodput_rps: f64,
}

/// Everything a run measured. Times are in milliseconds unless the name says otherwise.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Target.
    pub target: TargetInfo,
    /// API called.
    pub api: Api,
    /// Streamed or not.
    pub stream: bool,
    /// `"closed"`, `"open"` or `"replay"`.
    pub load: &'static str,
    /// Closed loop: clients.
    pub concurrency: Option<usize>,
    /// Open loop: requests per second offered.
    pub rate: Option<f64>,
    /// Replay: the speed-up over the recorded times.
    pub rate_factor: Option<f64>,
    /// Simulated seconds per wall second: every time, duration and rate below is in simulated
    /// terms (wall x `time_scale`).
    pub time_scale: f64,
    /// Prompt length distribution (words).
    pub prompt_len: String,
    /// Output length distribution (`max_tokens`).
    pub output_len: String,
    /// Requests finished (ok + errors).
    pub requests: u64,
    /// Successful requests.
    pub ok: u64,
    /// Failed requests.
    pub errors: u64,
    /// Failed requests by class (`connect`, `closed`, `timeout`, `http_4xx`, `http_5xx`, `http_other`,
    /// `stream_error`, `truncated`, `protocol`, `overflow`).
    pub errors_by_class: BTreeMap<String, u64>,
    /// Duration of the measured phase, seconds (simulated: wall x `time_scale`).
    pub elapsed_s: f64,
    /// Wall time of the measured phase, seconds.
    pub wall_s: f64,
    /// Successful requests per second.
    pub throughput_rps: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// End-to-end latency.
    pub latency_ms: Option<Percentiles>,
    /// Time to first token (streams).
    pub ttft_ms: Option<Percentiles>,
    /// Gaps between token events (streams).
    pub itl_ms: Option<Percentiles>,
    /// TTFT CDF: (quantile, ms) at every percent (streams).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ttft_cdf_ms: Vec<(f64, f64)>,
    /// Prefill leg (direct mode).
    pub prefill_ms: Option<Percentiles>,
    /// True when the run was interrupted (Ctrl-C) before its bound.
    pub cancelled: bool,
    /// `model` sent (given, or learnt from the target's `/v1/models`).
    pub model: String,
    /// Workload replayed.
    pub workload: WorkloadKind,
    /// The trace's shape (`shared-prefix 16x8 S=1024 Q=64 interleaved`), empty for synthetic.
    pub trace: String,
    /// `usage.prompt_tokens` summed over successful requests.
    pub usage_prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` summed.
    pub usage_cached_tokens: u64,
    /// `usage_cached_tokens / usage_prompt_tokens`; `None` when no response carried
    /// `cached_tokens` (vLLM needs `--enable-prompt-tokens-details`).
    pub cached_share: Option<f64>,
    /// The trace's oracle hit share (see the README for the definition).
    pub oracle: Option<Oracle>,
    /// The trace file replayed.
    pub replay: Option<ReplayInfo>,
    /// SLO attainment and goodput (`--slo-ttft`, `--slo-itl`).
    pub slo: Option<SloReport>,
    /// Engine counter deltas (`--engine-metrics`).
    pub engines: Option<EngineTotals>,
    /// The first failed response: status and the first 300 bytes of its body.
    pub sample_error: Option<String>,
    /// Things the user should know (model fallback, unreadable engine metrics).
    pub warnings: Vec<String>,
}

impl Report {
    /// Builds the report of a finished run.
    pub fn new(
        cfg: &Config,
        target: TargetInfo,
        total: &Shard,
        elapsed: Duration,
        cancelled: bool,
    ) -> Self {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let (load, concurrency, rate, rate_factor) = match cfg.load {
            Load::Closed { concurrency } => ("closed", Some(concurrency), None, None),
            Load::Open { rate, .. } => ("open", None, Some(rate), None),
            Load::Replay { rate_factor, .. } => ("replay", None, None, Some(rate_factor)),
        };
        Report {
            target,
            api: cfg.api,
            stream: cfg.stream,
            load,
            concurrency,
            rate,
            rate_factor,
            time_scale: cfg.time_scale,
            prompt_len: match cfg.replay {
                Some(_) => "trace".to_owned(),
                None => cfg.prompt_len.to_string(),
            },
            output_len: match cfg.replay {
                Some(_) => "trace".to_owned(),
                None => cfg.output_len.to_string(),
            },
            requests: total.ok() + total.errors_total(),
            ok: total.ok(),
            errors: total.errors_total(),
            errors_by_class: total.errors_by_class(),
            elapsed_s: secs,
            wall_s: secs / cfg.time_scale,
            throughput_rps: total.ok() as f64 / secs,
            output_tokens: total.output_tokens(),
            output_tokens_per_s: total.output_tokens() as f64 / secs,
            latency_ms: total.latency(),
            ttft_ms: total.ttft(),
            itl_ms: total.itl(),
            ttft_cdf_ms: total.ttft_cdf(),
            prefill_ms: total.prefill(),
            cancelled,
            model: cfg.model.clone().unwrap_or_default(),
            workload: cfg.trace.kind,
            trace: trace_text(cfg),
            usage_prompt_tokens: total.usage_prompt_tokens(),
            usage_cached_tokens: total.usage_cached_tokens().0,
            cached_share: (total.usage_cached_tokens().1 > 0).then(|| {
                total.usage_cached_tokens().0 as f64 / total.usage_prompt_tokens().max(1) as f64
            }),
            oracle: None,
            replay: None,
            slo: None,
            engines: None,
            sample_error: None,
            warnings: Vec::new(),
        }
    }
}

fn trace_text(cfg: &Config) -> String {
    let t = &cfg.trace;
    let order = match t.order {
        crate::trace::Order::Interleaved => "interleaved",
        crate::trace::Order::Sequential => "sequential",
    };
    match t.kind {
        WorkloadKind::Synthetic => String::new(),
        WorkloadKind::SharedPrefix => format!(
            "shared-prefix {}x{} S={} Q={} {order}",
            t.groups, t.prompts_per_group, t.system_len, t.question_len
        ),
        WorkloadKind::MultiTurn => format!(
            "multi-turn {}x{} S={} Q={} {order}",
            t.sessions, t.turns, t.system_len, t.question_len
        ),
        WorkloadKind::Random => format!(
            "random {} prompts of {} words",
            t.random_count.unwrap_or(t.groups * t.prompts_per_group),
            t.system_len + t.question_len
        ),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn row(f: &mut fmt::Formatter<'_>, name: &str, p: Option<&Percentiles>) -> fmt::Result {
    match p {
        Some(p) => writeln!(
            f,
            "{name:<9} {:>9} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
            p.count, p.mean, p.p50, p.p90, p.p99, p.max
        ),
        None => Ok(()),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            TargetInfo::Url { url } => write!(f, "target    {url}")?,
            TargetInfo::Replicas { urls } => {
                write!(f, "target    {} (alternating)", urls.join(", "))?
            }
            TargetInfo::Direct {
                prefill,
                decode,
                connector,
            } => write!(
                f,
                "target    direct prefill={prefill} decode={decode} connector={}",
                serde_json::to_value(connector)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            )?,
        }
        writeln!(f)?;
        let api = match self.api {
            Api::Completions => "completions",
            Api::Chat => "chat",
        };
        write!(
            f,
            "workload  api={api} stream={} prompt={} output={} ",
            self.stream, self.prompt_len, self.output_len
        )?;
        match (self.concurrency, self.rate, &self.replay) {
            (Some(c), _, _) => writeln!(f, "closed-loop concurrency={c}")?,
            (_, Some(r), _) => writeln!(f, "open-loop rate={r}/s")?,
            (_, _, Some(t)) => writeln!(
                f,
                "replay {} ({} of {} requests due, {:.1} s recorded) rate-factor={}",
                t.path,
                t.requests_due,
                t.requests_in_file,
                t.span_s,
                self.rate_factor.unwrap_or(1.0)
            )?,
            _ => writeln!(f)?,
        }
        if self.time_scale != 1.0 {
            writeln!(
                f,
                "time      simulated, time-scale {} (wall {:.3} s)",
                self.time_scale, self.wall_s
            )?;
        }
        writeln!(
            f,
            "result    {} ok, {} errors in {:.3} s: {:.1} req/s, {:.1} output tok/s{}",
            self.ok,
            self.errors,
            self.elapsed_s,
            self.throughput_rps,
            self.output_tokens_per_s,
            if self.cancelled { " (interrupted)" } else { "" }
        )?;
        writeln!(
            f,
            "{:<9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "ms", "count", "mean", "p50", "p90", "p99", "max"
        )?;
        row(f, "latency", self.latency_ms.as_ref())?;
        row(f, "ttft", self.ttft_ms.as_ref())?;
        row(f, "itl", self.itl_ms.as_ref())?;
        row(f, "prefill", self.prefill_ms.as_ref())?;
        if self.errors_by_class.is_empty() {
            writeln!(f, "errors    none")?;
        } else {
            let parts: Vec<String> = self
                .errors_by_class
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            writeln!(f, "errors    {}", parts.join(" "))?;
        }
        if let Some(s) = &self.slo {
            let goal = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} ms"));
            writeln!(
                f,
                "slo       ttft<={} {}, itl<={} {}, both {}: goodput {:.2} req/s",
                goal(s.ttft_ms),
                pct(s.ttft_attainment),
                goal(s.itl_ms),
                pct(s.itl_attainment),
                pct(s.attainment),
                s.goodput_rps
            )?;
        }
        if let Some(e) = &self.sample_error {
            writeln!(f, "sample    {e}")?;
        }
        if !self.trace.is_empty() {
            writeln!(f, "trace     {}", self.trace)?;
        }
        match self.cached_share {
            Some(c) => writeln!(
                f,
                "cached    {} of {} prompt tokens ({}) per usage.prompt_tokens_details",
                self.usage_cached_tokens,
                self.usage_prompt_tokens,
                pct(c)
            )?,
            None if self.workload != WorkloadKind::Synthetic => writeln!(
                f,
                "cached    no cached_tokens in usage (vLLM: --enable-prompt-tokens-details)"
            )?,
            None => {}
        }
        if let Some(o) = &self.oracle {
            write!(
                f,
                "oracle    {} of {} tokens ({}) reusable, infinite cache, block {}",
                o.reusable_tokens,
                o.prompt_tokens,
                pct(o.hit_share),
                o.block_size
            )?;
            if let Some(l) = &o.limited {
                write!(
                    f,
                    "; {} with {} engines x {} blocks",
                    pct(l.hit_share),
                    l.engines,
                    l.cache_blocks
                )?;
            }
            writeln!(f)?;
        }
        if let Some(e) = &self.engines {
            writeln!(
                f,
                "engines   prefix-cache hits {:.0} of {:.0} queried tokens ({}), prefill computed {:.0} tokens, {} engines",
                e.prefix_cache_hits,
                e.prefix_cache_queries,
                pct(e.hit_share),
                e.prefill_computed_tokens,
                e.engines.len()
            )?;
            if let Some(p) = e.prefill_hit_share {
                writeln!(
                    f,
                    "prefill   hit share {} (prefill engines' counters)",
                    pct(p)
                )?;
            }
            if e.recomputed > 0.0 {
                writeln!(
                    f,
                    "handoff   {:.0} decodes received no KV and recomputed the prompt",
                    e.recomputed
                )?;
            }
            for b in &e.balance {
                writeln!(
                    f,
                    "busy      {} x{}: max/mean {} ({:.0} / {:.0} {})",
                    b.role,
                    b.engines,
                    b.max_over_mean
                        .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
                    b.max,
                    b.mean,
                    b.measure
                )?;
            }
        }
        Ok(())
    }
}
