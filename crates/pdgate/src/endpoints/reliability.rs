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
    /// Requests still waiting for a prefill's answer when it is ejected are retried elsewhere (or
    /// fall back) at once instead of waiting out `prefill_timeout`.
    pub retry_on_ejection: bool,
}

impl Default for ReliabilityConfig {
    fn default() -> Self {
        ReliabilityConfig {
            concurrent_prefill_timeout: Duration::from_secs(8),
            kv_wait_evidence: Duration::from_secs(1),
            half_open_probe: true,
            retry_on_ejection: true,
        }
    }
}
