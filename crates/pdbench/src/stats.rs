//! Latency statistics: sharded HDR histograms, error classes and the run summary.
//!
//! Every value is recorded in microseconds into a fixed-size histogram (3 significant digits,
//! 1 µs to 10 minutes, larger values clamped), so memory stays bounded however long a run is.
//! Requests record into one of several shards, chosen by request number, so that thousands of
//! concurrent requests do not contend on one lock; shards are merged once at the end.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::{CreationError, Histogram};
use serde::Serialize;

/// Largest value a histogram keeps, in microseconds (10 minutes); larger values are clamped.
const HIST_MAX_US: u64 = 600_000_000;

/// Why a request failed. Closed set: reports count by class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorClass {
    /// No connection could be made (refused, unreachable, connect timeout).
    Connect,
    /// A connection was made (or reused) but closed or reset before a response head arrived.
    Closed,
    /// The per-request timeout elapsed.
    Timeout,
    /// A 4xx response.
    Status4xx,
    /// A 5xx response.
    Status5xx,
    /// Any other non-2xx response.
    StatusOther,
    /// A `data: {"error":...}` event inside a 200 stream.
    StreamError,
    /// The body broke off, or a stream ended without `data: [DONE]`.
    Truncated,
    /// A 2xx response we could not use (bad JSON, missing `kv_transfer_params`, oversized).
    Protocol,
    /// Open loop only: the request was due but the in-flight cap was reached; never sent.
    Overflow,
}

impl ErrorClass {
    /// Every class, in report order.
    pub const ALL: [ErrorClass; 10] = [
        ErrorClass::Connect,
        ErrorClass::Closed,
        ErrorClass::Timeout,
        ErrorClass::Status4xx,
        ErrorClass::Status5xx,
        ErrorClass::StatusOther,
        ErrorClass::StreamError,
        ErrorClass::Truncated,
        ErrorClass::Protocol,
        ErrorClass::Overflow,
    ];

    /// Stable snake_case name used in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Connect => "connect",
            ErrorClass::Closed => "closed",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Status4xx => "http_4xx",
            ErrorClass::Status5xx => "http_5xx",
            ErrorClass::StatusOther => "http_other",
            ErrorClass::StreamError => "stream_error",
            ErrorClass::Truncated => "truncated",
            ErrorClass::Protocol => "protocol",
            ErrorClass::Overflow => "overflow",
        }
    }

    /// The class of a non-2xx HTTP status.
    pub fn from_status(status: u16) -> Self {
        match status {
            400..=499 => ErrorClass::Status4xx,
            500..=599 => ErrorClass::Status5xx,
            _ => ErrorClass::StatusOther,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one successful request measured.
#[derive(Debug, Default, Clone)]
pub struct Sample {
    /// From the (intended) start to the last byte.
    pub latency: Duration,
    /// Streams: from the start to the first token event.
    pub ttft: Option<Duration>,
    /// Streams: gaps between consecutive token events, in microseconds.
    pub gaps_us: Vec<u64>,
    /// Output tokens: `usage.completion_tokens` when present, otherwise token events seen.
    pub output_tokens: u64,
    /// Direct mode: the prefill leg's latency.
    pub prefill: Option<Duration>,
    /// `usage.prompt_tokens`, when the response had it.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the response had it.
    pub cached_tokens: Option<u64>,
    /// Generated text (multi-turn only: it joins the session's history).
    pub answer: Option<String>,
}

fn new_hist() -> Result<Histogram<u64>, CreationError> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// One shard of measurements (or a merged total).
#[derive(Debug, Clone)]
pub struct Shard {
    latency: Histogram<u64>,
    ttft: Histogram<u64>,
    itl: Histogram<u64>,
    prefill: Histogram<u64>,
    ok: u64,
    output_tokens: u64,
    usage_prompt_tokens: u64,
    usage_cached_tokens: u64,
    with_cached_tokens: u64,
    errors: [u64; ErrorClass::ALL.len()],
}

impl Shard {
    /// An empty shard. Fails only if the histogram bounds were invalid (they are constants).
    pub fn new() -> Result<Self, CreationError> {
        Ok(Shard {
            latency: new_hist()?,
            ttft: new_hist()?,
            itl: new_hist()?,
            prefill: new_hist()?,
            ok: 0,
            output_tokens: 0,
            usage_prompt_tokens: 0,
            usage_cached_tokens: 0,
            with_cached_tokens: 0,
            errors: [0; ErrorClass::ALL.len()],
        })
    }

    /// Records one successful request.
    pub fn record_ok(&mut self, s: &Sample) {
        self.ok += 1;
        self.output_tokens += s.output_tokens;
        self.usage_prompt_tokens += s.prompt_tokens.unwrap_or(0);
        if let Some(c) = s.cached_tokens {
            self.usage_cached_tokens += c;
            self.with_cached_tokens += 1;
        }
        self.latency.saturating_record(micros(s.latency));
        if let Some(t) = s.ttft {
            self.ttft.saturating_record(micros(t));
        }
        if let Some(p) = s.prefill {
            self.prefill.saturating_record(micros(p));
        }
        for &g in &s.gaps_us {
            self.itl.saturating_record(g.max(1));
        }
    }

    /// Records one failed request.
    pub fn record_err(&mut self, class: ErrorClass) {
        self.errors[class.index()] += 1;
    }

    /// Adds another shard's counts into this one.
    pub fn merge(&mut self, other: &Shard) {
        // Same bounds on both sides, so `add` cannot fail; a failure would only lose samples.
        let _ = self.latency.add(&other.latency);
        let _ = self.ttft.add(&other.ttft);
        let _ = self.itl.add(&other.itl);
        let _ = self.prefill.add(&other.prefill);
        self.ok += other.ok;
        self.output_tokens += other.output_tokens;
        self.usage_prompt_tokens += other.usage_prompt_tokens;
        self.usage_cached_tokens += other.usage_cached_tokens;
        self.with_cached_tokens += other.with_cached_tokens;
        for (a, b) in self.errors.iter_mut().zip(other.errors.iter()) {
            *a += b;
        }
    }

    /// Successful requests.
    pub fn ok(&self) -> u64 {
        self.ok
    }

    /// Failed requests, all classes.
    pub fn errors_total(&self) -> u64 {
        self.errors.iter().sum()
    }

    /// Failed requests by class name; classes with no failures are left out.
    pub fn errors_by_class(&self) -> BTreeMap<String, u64> {
        ErrorClass::ALL
            .iter()
            .filter(|c| self.errors[c.index()] > 0)
            .map(|c| (c.as_str().to_owned(), self.errors[c.index()]))
            .collect()
    }

    /// Output tokens over all successful requests.
    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// `usage.prompt_tokens` summed over successful requests.
    pub fn usage_prompt_tokens(&self) -> u64 {
        self.usage_prompt_tokens
    }

    /// `usage.prompt_tokens_details.cached_tokens` summed, and how many responses carried it.
    pub fn usage_cached_tokens(&self) -> (u64, u64) {
        (self.usage_cached_tokens, self.with_cached_tokens)
    }

    /// End-to-end latency percentiles.
    pub fn latency(&self) -> Option<Percentiles> {
        Percentiles::of(&self.latency)
    }

    /// Time-to-first-token percentiles (streams only).
    pub fn ttft(&self) -> Option<Percentiles> {
        Percentiles::of(&self.ttft)
    }

    /// The TTFT distribution as (quantile, ms) pairs at every percent, 0.01 to 1.0 (streams
    /// only; empty otherwise): enough to draw its CDF.
    pub fn ttft_cdf(&self) -> Vec<(f64, f64)> {
        if self.ttft.is_empty() {
            return Vec::new();
        }
        (1..=100)
            .map(|i| {
                let q = f64::from(i) / 100.0;
                (q, self.ttft.value_at_quantile(q) as f64 / 1000.0)
            })
            .collect()
    }

    /// Inter-token gap percentiles (streams only).
    pub fn itl(&self) -> Option<Percentiles> {
        Percentiles::of(&self.itl)
    }

    /// Prefill-leg latency percentiles (direct mode only).
    pub fn prefill(&self) -> Option<Percentiles> {
        Percentiles::of(&self.prefill)
    }
}

/// A fixed set of shards that concurrent requests record into.
#[derive(Debug)]
pub struct Recorder {
    shards: Vec<Mutex<Shard>>,
}

impl Recorder {
    /// A recorder with `n` shards (at least one).
    pub fn new(n: usize) -> Result<Self, CreationError> {
        let shards = (0..n.max(1))
            .map(|_| Shard::new().map(Mutex::new))
            .collect::<Result<_, _>>()?;
        Ok(Recorder { shards })
    }

    /// Runs `f` on the shard for request number `key`.
    pub fn with_shard<T>(&self, key: u64, f: impl FnOnce(&mut Shard) -> T) -> T {
        let i = usize::try_from(key % self.shards.len() as u64).unwrap_or(0);
        let mut guard = self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }

    /// Merges every shard into one total.
    pub fn total(&self) -> Result<Shard, CreationError> {
        let mut total = Shard::new()?;
        for s in &self.shards {
            total.merge(&s.lock().unwrap_or_else(PoisonError::into_inner));
        }
        Ok(total)
    }
}

/// Summary of one histogram, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Percentiles {
    /// Number of values.
    pub count: u64,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest value.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

impl Percentiles {
    /// Summarises a histogram of microseconds; `None` when it is empty.
    pub fn of(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Some(Percentiles {
            count: h.len(),
            mean: h.mean() / 1000.0,
            min: ms(h.min()),
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p95: ms(h.value_at_quantile(0.95)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_ms(ms: u64) -> Sample {
        Sample {
            latency: Duration::from_millis(ms),
            output_tokens: 2,
            ..Sample::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        // 3 significant digits: relative error at most 0.1 %.
        (a - b).abs() <= b.abs() * 0.001 + 1e-9
    }

    #[test]
    fn percentiles_of_one_to_thousand() {
        let mut s = Shard::new().expect("shard");
        for ms in 1..=1000 {
            s.record_ok(&sample_ms(ms));
        }
        let p = s.latency().expect("non-empty");
        assert_eq!(p.count, 1000);
        assert!(close(p.p50, 500.0), "p50 {}", p.p50);
        assert!(close(p.p90, 900.0), "p90 {}", p.p90);
        assert!(close(p.p99, 990.0), "p99 {}", p.p99);
        assert!(close(p.max, 1000.0), "max {}", p.max);
        assert!(close(p.min, 1.0), "min {}", p.min);
        assert!(close(p.mean, 500.5), "mean {}", p.mean);
        assert_eq!(s.output_tokens(), 2000);
    }

    #[test]
    fn tail_is_visible_in_p99_not_p50() {
        let mut s = Shard::new().expect("shard");
        for _ in 0..980 {
            s.record_ok(&sample_ms(2));
        }
        for _ in 0..20 {
            s.record_ok(&sample_ms(400));
        }
        let p = s.latency().expect("non-empty");
        assert!(close(p.p50, 2.0));
        assert!(close(p.p90, 2.0));
        assert!(close(p.p99, 400.0), "p99 {}", p.p99);
        assert!(close(p.max, 400.0));
    }

    #[test]
    fn empty_histograms_have_no_percentiles() {
        let s = Shard::new().expect("shard");
        assert!(s.latency().is_none());
        assert!(s.ttft().is_none());
        assert_eq!(s.ok(), 0);
        assert_eq!(s.errors_total(), 0);
        assert!(s.errors_by_class().is_empty());
    }

    #[test]
    fn huge_values_are_clamped_not_lost() {
        let mut s = Shard::new().expect("shard");
        s.record_ok(&sample_ms(3_600_000));
        let p = s.latency().expect("non-empty");
        assert_eq!(p.count, 1);
        assert!(p.max >= 599_000.0 && p.max <= 601_000.0, "max {}", p.max);
    }

    #[test]
    fn shards_merge_counts_and_errors() {
        let r = Recorder::new(4).expect("recorder");
        for i in 0..100u64 {
            r.with_shard(i, |s| {
                if i % 10 == 0 {
                    s.record_err(ErrorClass::Status5xx);
                } else {
                    let mut smp = sample_ms(10);
                    smp.ttft = Some(Duration::from_millis(1));
                    smp.gaps_us = vec![100, 200, 300];
                    s.record_ok(&smp);
                }
            });
        }
        r.with_shard(3, |s| s.record_err(ErrorClass::Timeout));
        let t = r.total().expect("total");
        assert_eq!(t.ok(), 90);
        assert_eq!(t.errors_total(), 11);
        let by = t.errors_by_class();
        assert_eq!(by.get("http_5xx"), Some(&10));
        assert_eq!(by.get("timeout"), Some(&1));
        assert_eq!(by.len(), 2);
        let itl = t.itl().expect("gaps recorded");
        assert_eq!(itl.count, 270);
        assert!(close(itl.p50, 0.2), "itl p50 {}", itl.p50);
        assert_eq!(t.ttft().expect("ttft").count, 90);
        let cdf = t.ttft_cdf();
        assert_eq!(cdf.len(), 100);
        assert_eq!(cdf[99].0, 1.0);
        assert!(cdf.iter().all(|&(_, ms)| close(ms, 1.0)), "{cdf:?}");
        assert!(Shard::new().expect("shard").ttft_cdf().is_empty());
    }

    #[test]
    fn status_classes() {
        assert_eq!(ErrorClass::from_status(404), ErrorClass::Status4xx);
        assert_eq!(ErrorClass::from_status(503), ErrorClass::Status5xx);
        assert_eq!(ErrorClass::from_status(302), ErrorClass::StatusOther);
        let names: std::collections::HashSet<_> =
            ErrorClass::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names.len(), ErrorClass::ALL.len());
    }
}
