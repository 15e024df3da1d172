//! The `[reliability]` section: how the gateway blames, retries and probes (see the health model
//! in docs/operations.md).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The `[reliability]` section of the configuration.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReliabilityConfig {
    /// Bound on the prefill leg of a concurrent connector (mooncake, sglang), at most
    /// `prefill_timeout`. Kept below the engines' own KV-wait (vLLM's and SGLang's decode give up
    /// on a transfer after their handoff timeout), so that the gateway, not the decode, notices a
    /// stuck prefill first, blames it and retries the request on another pair.
    #[serde(with = "crate::durations::text")]
    pub concurrent_prefill_timeout: Duration,
    /// A decode answering 5xx at least this long after it was sent, while its concurrent prefill
    /// has not answered, failed waiting for KV: the failure counts against the prefill (not the
    /// decode) and the request is retried on another pair. A quicker 5xx is the decode's own.
    #[serde(with = "crate::durations::text")]
    pub kv_wait_evidence: Duration,
    /// An ejected endpoint coming back half-open takes one probe request; it returns to full
    /// traffic only when that request succeeds (false: all traffic at once).
    pub half_open_probe: bool,
    /// Requests still waiting for an endpoint's answer when it is ejected give up on it at once
    /// instead of waiting out their leg's timeout: a prefill leg is retried on another prefill
    /// (or falls back), a decode leg waiting for its head on another decode (both legs again,
    /// or the same plain request for a decode-only request or a fallback).
    pub retry_on_ejection: bool,
    /// A prefill whose median time-to-answer is above this many times its peers' is ejected
    /// like a failing one (0 disables).
    pub latency_outlier_ratio: f64,
    /// How far back answer times count for `latency_outlier_ratio`.
    #[serde(with = "crate::durations::text")]
    pub latency_outlier_window: Duration,
    /// Answers within the window needed (the prefill's own and its peers') before it is judged.
    pub latency_outlier_min_requests: u32,
    /// An outlier's median must also be at least this much above its peers' (so that 3 ms
    /// against 1 ms is no outlier).
    #[serde(with = "crate::durations::text")]
    pub latency_outlier_min_excess: Duration,
}

impl ReliabilityConfig {
    /// The latency outlier rule of these knobs.
    pub fn latency_rule(&self) -> crate::endpoints::health::LatencyRule {
        crate::endpoints::health::LatencyRule {
            ratio: self.latency_outlier_ratio,
            window: self.latency_outlier_window,
            min_requests: self.latency_outlier_min_requests,
            min_excess: self.latency_outlier_min_excess,
        }
    }

    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), crate::error::ConfigError> {
        let ratio = self.latency_outlier_ratio;
        if !(ratio.is_finite() && (ratio == 0.0 || ratio >= 1.0)) {
            return Err(crate::error::field_error(
                "reliability.latency_outlier_ratio",
                "must be 0 (off) or at least 1",
            ));
        }
        if self.latency_outlier_window.is_zero() {
            return Err(crate::error::field_error(
                "reliability.latency_outlier_window",
                "must be greater than zero",
            ));
        }
        Ok(())
    }
}

impl Default for ReliabilityConfig {
    fn default() -> Self {
        ReliabilityConfig {
            concurrent_prefill_timeout: Duration::from_secs(8),
            kv_wait_evidence: Duration::from_secs(1),
            half_open_probe: true,
            retry_on_ejection: true,
            latency_outlier_ratio: 3.0,
            latency_outlier_window: Duration::from_secs(30),
            latency_outlier_min_requests: 10,
            latency_outlier_min_excess: Duration::from_millis(500),
        }
    }
}
