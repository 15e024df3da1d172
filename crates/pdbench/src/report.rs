//! The result of a run: a JSON-serialisable report and its human table.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::runner::{Config, Load};
use crate::stats::{Percentiles, Shard};
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

/// Everything a run measured. Times are in milliseconds unless the name says otherwise.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Target.
    pub target: TargetInfo,
    /// API called.
    pub api: Api,
    /// Streamed or not.
    pub stream: bool,
    /// `"closed"` or `"open"`.
    pub load: &'static str,
    /// Closed loop: clients.
    pub concurrency: Option<usize>,
    /// Open loop: requests per second offered.
    pub rate: Option<f64>,
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
    /// Wall time of the measured phase, seconds.
    pub elapsed_s: f64,
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
    /// Prefill leg (direct mode).
    pub prefill_ms: Option<Percentiles>,
    /// True when the run was interrupted (Ctrl-C) before its bound.
    pub cancelled: bool,
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
        let (load, concurrency, rate) = match cfg.load {
            Load::Closed { concurrency } => ("closed", Some(concurrency), None),
            Load::Open { rate, .. } => ("open", None, Some(rate)),
        };
        Report {
            target,
            api: cfg.api,
            stream: cfg.stream,
            load,
            concurrency,
            rate,
            prompt_len: cfg.prompt_len.to_string(),
            output_len: cfg.output_len.to_string(),
            requests: total.ok() + total.errors_total(),
            ok: total.ok(),
            errors: total.errors_total(),
            errors_by_class: total.errors_by_class(),
            elapsed_s: secs,
            throughput_rps: total.ok() as f64 / secs,
            output_tokens: total.output_tokens(),
            output_tokens_per_s: total.output_tokens() as f64 / secs,
            latency_ms: total.latency(),
            ttft_ms: total.ttft(),
            itl_ms: total.itl(),
            prefill_ms: total.prefill(),
            cancelled,
        }
    }
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
        match (self.concurrency, self.rate) {
            (Some(c), _) => writeln!(f, "closed-loop concurrency={c}")?,
            (_, Some(r)) => writeln!(f, "open-loop rate={r}/s")?,
            _ => writeln!(f)?,
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
            writeln!(f, "errors    none")
        } else {
            let parts: Vec<String> = self
                .errors_by_class
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            writeln!(f, "errors    {}", parts.join(" "))
        }
    }
}
