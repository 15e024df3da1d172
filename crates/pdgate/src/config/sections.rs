//! The sections read by the rooms above the shared state (`http`, `pd`, `discovery`, `run`).
//! A section read by a room below the state lives in that room (`engine::pool::PoolConfig`,
//! `endpoints::health::HealthConfig`, `endpoints::policy::PolicyConfig`,
//! `limits::LimitsConfig`, `cache::CacheConfig`, `security::guard::SecurityConfig`); these four
//! cannot, because the state that carries them sits below their readers. In the file, their keys
//! are top-level (`prefill_timeout = "30s"`), as they always were; `[legs]`-style tables and
//! `--set legs.prefill_timeout=...` are accepted too.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, field_error};

/// What to do when the prefill leg (`on_prefill_failure`) or every encoder of an item
/// (`on_encode_failure`) fails with a 5xx, a transport error or a timeout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillFailurePolicy {
    /// Send the original request to the decode engine alone (it recomputes the prompt) and mark the response.
    #[default]
    Fallback,
    /// Fail the request.
    Fail,
}

/// Where endpoints come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryKind {
    /// The `--prefill`/`--decode` flags and the config file's `[[prefill]]`/`[[decode]]` tables
    /// (the file is watched and reloaded on change).
    #[default]
    Static,
    /// Pods from the Kubernetes API server.
    Kubernetes,
}

/// The `http` section, read by the edge (`http`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address to serve the OpenAI API on.
    pub listen: SocketAddr,
    /// A client connection that sends no (complete) request head for this long is closed: a new
    /// one before its first request, a kept-alive one between requests.
    #[serde(with = "crate::durations::text")]
    pub client_idle_timeout: Duration,
    /// One log line per finished request at `info` (target `pdgate::access`).
    pub access_log: bool,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            // Longer than load balancers keep idle connections to backends (AWS ALB 60 s, Google
            // Cloud 600 s), so that they, not pdgate, close them: no request races a close.
            client_idle_timeout: Duration::from_secs(620),
            access_log: true,
            max_body_bytes: 32 * 1024 * 1024,
        }
    }
}

/// The `discovery` section, read by `discovery` (and `state` for the default connector).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Global default KV connector for endpoints without a connector label.
    pub kv_connector: String,
    /// Where endpoints come from (the file's key `discovery`).
    #[serde(rename = "discovery")]
    pub kind: DiscoveryKind,
    /// Bootstrap port of prefill endpoints that set none (Mooncake `/query`, SGLang bootstrap):
    /// so that any connector runs from flags alone (`--bootstrap-port`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// How often Mooncake bootstrap information is refreshed.
    #[serde(with = "crate::durations::text")]
    pub bootstrap_refresh: Duration,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            kv_connector: kvtransfer::CONNECTOR_TYPE_SHFS.to_string(),
            kind: DiscoveryKind::Static,
            bootstrap_port: None,
            bootstrap_refresh: Duration::from_secs(30),
        }
    }
}

/// The `legs` section, read by the PD exchange (`pd`) and pass-through.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LegsConfig {
    /// Bound on the whole prefill leg.
    #[serde(with = "crate::durations::text")]
    pub prefill_timeout: Duration,
    /// Bound on waiting for the decode engine's response head.
    #[serde(with = "crate::durations::text")]
    pub decode_timeout: Duration,
    /// Bound on the silence between two chunks of a relayed body.
    #[serde(with = "crate::durations::text")]
    pub stream_idle_timeout: Duration,
    /// What to do when the prefill leg fails.
    pub on_prefill_failure: PrefillFailurePolicy,
    /// Retries of a failed leg on another endpoint (0 disables retries).
    pub max_retries: u32,
    /// Bound on each encoder leg (encoder disaggregation), answer included.
    #[serde(with = "crate::durations::text")]
    pub encode_timeout: Duration,
    /// Most multimodal items of one request sent to encoders; a request with more is refused
    /// (400) when the fleet has encoders.
    pub encode_max_items: usize,
    /// What to do when no encoder could encode an item (5xx, transport error, timeout):
    /// `fail` the request (502/504), or `fallback`: send the prefill the request without
    /// encoder parameters, so it encodes the items itself.
    pub on_encode_failure: PrefillFailurePolicy,
}

impl Default for LegsConfig {
    fn default() -> Self {
        LegsConfig {
            prefill_timeout: Duration::from_secs(30),
            decode_timeout: Duration::from_secs(300),
            stream_idle_timeout: Duration::from_secs(120),
            on_prefill_failure: PrefillFailurePolicy::Fallback,
            max_retries: 1,
            encode_timeout: Duration::from_secs(30),
            encode_max_items: 32,
            on_encode_failure: PrefillFailurePolicy::Fail,
        }
    }
}

/// The `shutdown` section, read by `run`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// After SIGTERM, time `/ready` answers 503 while still serving, before the listener closes.
    #[serde(with = "crate::durations::text")]
    pub drain_delay: Duration,
    /// After the listener closes, bound on waiting for in-flight requests to finish.
    #[serde(with = "crate::durations::text")]
    pub shutdown_timeout: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            drain_delay: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

fn nonzero(fields: &[(&str, Duration)]) -> Result<(), ConfigError> {
    match fields.iter().find(|(_, d)| d.is_zero()) {
        Some((field, _)) => Err(field_error(*field, "must be greater than zero")),
        None => Ok(()),
    }
}

impl HttpConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        nonzero(&[("client_idle_timeout", self.client_idle_timeout)])?;
        if self.max_body_bytes == 0 {
            return Err(field_error("max_body_bytes", "must be greater than zero"));
        }
        Ok(())
    }
}

impl LegsConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        nonzero(&[
            ("prefill_timeout", self.prefill_timeout),
            ("decode_timeout", self.decode_timeout),
            ("stream_idle_timeout", self.stream_idle_timeout),
            ("encode_timeout", self.encode_timeout),
        ])?;
        if self.max_retries > 10 {
            return Err(field_error("max_retries", "must be at most 10"));
        }
        if self.encode_max_items == 0 {
            return Err(field_error("encode_max_items", "must be greater than zero"));
        }
        Ok(())
    }
}

impl ShutdownConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        nonzero(&[("shutdown_timeout", self.shutdown_timeout)])
    }
}
