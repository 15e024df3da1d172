//! The one configuration type: read from TOML, overridden by flags and environment
//! ([`flags`]), validated once.

mod endpoint;
mod flags;

pub use crate::http::auth::{ClientConfig, Secret};
pub use crate::http::guard::SecurityConfig;
pub use flags::{LogFormat, RunArgs};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvtransfer::{Pod, Registry};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::endpoints::health::HealthConfig;
use crate::endpoints::policy;
use crate::engine::pool::PoolConfig;

/// What to do when the prefill leg fails with a 5xx, a transport error or a timeout.
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

/// One statically configured engine.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// A name for logs and headers; defaults to `host:port`.
    #[serde(default)]
    pub name: Option<String>,
    /// Model served (shortcut for the `model.aibrix.ai/name` label).
    #[serde(default)]
    pub model: Option<String>,
    /// Labels, with AIBrix keys (`model.aibrix.ai/kv-connector-type`, `model.aibrix.ai/name`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotations (`model.aibrix.ai/sglang-bootstrap-port`, ...).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Bootstrap port of a prefill engine: the Mooncake `/query` server or the SGLang bootstrap
    /// server (default 8998 for both).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Where the engine publishes its vLLM KV events (`tcp://host:port`), for `cache_aware`'s
    /// precise mode (shortcut for the `pdgate.io/kv-events` annotation).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The engine's KV-event replay socket (`pdgate.io/kv-events-replay`).
    #[serde(default)]
    pub kv_events_replay: Option<String>,
    /// This engine's API key, sent as its bearer token (instead of `security.engine_api_key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
}

/// The whole gateway configuration.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address to serve the OpenAI API on.
    pub listen: SocketAddr,
    /// Global default KV connector for endpoints without a connector label.
    pub kv_connector: String,
    /// Models served by endpoints that declare none.
    pub models: Vec<String>,
    /// Prefill engines.
    pub prefill: Vec<EndpointConfig>,
    /// Decode engines.
    pub decode: Vec<EndpointConfig>,
    /// Prefill selection policy.
    pub prefill_policy: String,
    /// Decode selection policy.
    pub decode_policy: String,
    /// Bound on the whole prefill leg.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub prefill_timeout: Duration,
    /// Bound on waiting for the decode engine's response head.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub decode_timeout: Duration,
    /// Bound on the silence between two chunks of a relayed body.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub stream_idle_timeout: Duration,
    /// Bound on establishing a TCP connection to an engine.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub connect_timeout: Duration,
    /// A client connection that sends no (complete) request head for this long is closed: a new
    /// one before its first request, a kept-alive one between requests.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub client_idle_timeout: Duration,
    /// What to do when the prefill leg fails.
    pub on_prefill_failure: PrefillFailurePolicy,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Where endpoints come from.
    pub discovery: DiscoveryKind,
    /// How often Mooncake bootstrap information is refreshed.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub bootstrap_refresh: Duration,
    /// Active health checks (`GET /health`, plus `/query` for Mooncake prefills) on every endpoint.
    pub health_checks: bool,
    /// Time between two active checks of one endpoint.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub health_check_interval: Duration,
    /// Bound on one active check.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub health_check_timeout: Duration,
    /// Consecutive failed checks that make an endpoint unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive passed checks that make an unhealthy endpoint healthy again.
    pub healthy_threshold: u32,
    /// Consecutive failures on real traffic that eject an endpoint (0 disables passive ejection).
    pub outlier_consecutive_failures: u32,
    /// Share of failed requests within one `outlier_interval` that ejects an endpoint (0 disables).
    pub outlier_error_rate: f64,
    /// Requests an endpoint must have served within the interval before its error rate counts.
    pub outlier_min_requests: u32,
    /// Window of the error-rate detection.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub outlier_interval: Duration,
    /// First ejection period; doubled on each repeated ejection, up to `outlier_max_ejection`.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub outlier_base_ejection: Duration,
    /// Longest ejection period.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub outlier_max_ejection: Duration,
    /// Retries of a failed leg on another endpoint (0 disables retries).
    pub max_retries: u32,
    /// Retries allowed per request, on average (a token bucket: each request adds this much).
    pub retry_budget_ratio: f64,
    /// Retry tokens available at start and the bucket's floor capacity.
    pub retry_budget_min: u32,
    /// Requests served at once (PD and pass-through); 0 means unlimited.
    pub max_in_flight: usize,
    /// Requests waiting for a slot beyond `max_in_flight`; more are refused at once.
    pub max_queue: usize,
    /// Longest wait in the queue before a request is refused.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub queue_timeout: Duration,
    /// Requests one endpoint holds at once; 0 means unlimited.
    pub max_in_flight_per_endpoint: usize,
    /// After SIGTERM, time `/ready` answers 503 while still serving, before the listener closes.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub drain_delay: Duration,
    /// After the listener closes, bound on waiting for in-flight requests to finish.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub shutdown_timeout: Duration,
    /// Connections to one engine kept open while idle, for reuse.
    pub pool_max_idle_per_engine: usize,
    /// An idle engine connection older than this is closed instead of reused.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub pool_idle_timeout: Duration,
    /// One log line per finished request at `info` (target `pdgate::access`).
    pub access_log: bool,
    /// Bootstrap port of prefill endpoints that set none (Mooncake `/query`, SGLang bootstrap):
    /// so that any connector runs from flags alone (`--bootstrap-port`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Kubernetes discovery (`discovery = "kubernetes"`): namespace, selector, label keys.
    /// (pdkube's type has no `Serialize`: the table is left out of [`Config::to_table`].)
    #[serde(skip_serializing)]
    pub kubernetes: pdkube::KubeDiscoveryConfig,
    /// Cache-aware routing (`[cache]`): block size, tokenizers, weights, decode-only. (Its own
    /// flags and `--set cache.KEY=VALUE`; left out of [`Config::to_table`].)
    #[serde(skip_serializing)]
    pub cache: crate::cache::CacheConfig,
    /// Edge security: the pass-through allow-list, body-read bounds (`[security]`).
    pub security: SecurityConfig,
    /// Blame, retries on ejection, half-open probes (`[reliability]`; `--set reliability.KEY=V`,
    /// left out of [`Config::to_table`] like `[cache]`).
    #[serde(skip_serializing)]
    pub reliability: crate::endpoints::reliability::ReliabilityConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            kv_connector: kvtransfer::CONNECTOR_TYPE_SHFS.to_string(),
            models: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_policy: "round_robin".into(),
            decode_policy: "least_request".into(),
            prefill_timeout: Duration::from_secs(30),
            decode_timeout: Duration::from_secs(300),
            stream_idle_timeout: Duration::from_secs(120),
            // Longer than load balancers keep idle connections to backends (AWS ALB 60 s, Google
            // Cloud 600 s), so that they, not pdgate, close them: no request races a close.
            client_idle_timeout: Duration::from_secs(620),
            connect_timeout: Duration::from_secs(5),
            on_prefill_failure: PrefillFailurePolicy::Fallback,
            max_body_bytes: 32 * 1024 * 1024,
            discovery: DiscoveryKind::Static,
            bootstrap_refresh: Duration::from_secs(30),
            health_checks: true,
            health_check_interval: Duration::from_secs(5),
            health_check_timeout: Duration::from_secs(2),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            outlier_consecutive_failures: 5,
            outlier_error_rate: 0.5,
            outlier_min_requests: 20,
            outlier_interval: Duration::from_secs(10),
            outlier_base_ejection: Duration::from_secs(10),
            outlier_max_ejection: Duration::from_secs(300),
            max_retries: 1,
            retry_budget_ratio: 0.2,
            retry_budget_min: 10,
            max_in_flight: 1024,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(5),
            max_in_flight_per_endpoint: 0,
            drain_delay: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(30),
            pool_max_idle_per_engine: 4096,
            // The engines' own keep-alive timeouts (vLLM's uvicorn: 5 s) usually close first.
            pool_idle_timeout: Duration::from_secs(60),
            access_log: true,
            bootstrap_port: None,
            kubernetes: pdkube::KubeDiscoveryConfig::default(),
            cache: crate::cache::CacheConfig::default(),
            security: SecurityConfig::default(),
            reliability: crate::endpoints::reliability::ReliabilityConfig::default(),
        }
    }
}

/// A configuration problem, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (the message names the key and line).
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// toml's message, naming the key.
        message: String,
    },
    /// A field has an invalid value.
    #[error("invalid `{field}`: {message}")]
    Field {
        /// Dotted path of the field, e.g. `prefill[1].url`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

impl ConfigError {
    /// The same error, naming `path` as the file parsed.
    pub(crate) fn in_file(self, path: &str) -> ConfigError {
        match self {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_string(),
                message,
            },
            other => other,
        }
    }
}

fn field_error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        message: message.into(),
    }
}

/// Parses durations such as `30s`, `250ms`, `2m` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("{text:?} is not a valid duration"));
    }
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a valid duration: {e}"))
}

/// Writes a duration the way the docs and flags spell it: `250ms`, `30s`.
pub(crate) fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

pub(crate) fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

pub(crate) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Secs(f64),
        Text(String),
    }
    match Raw::deserialize(d)? {
        Raw::Secs(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
        Raw::Secs(s) => Err(serde::de::Error::custom(format!(
            "{s} is not a valid duration"
        ))),
        Raw::Text(t) => parse_duration(&t).map_err(serde::de::Error::custom),
    }
}

impl Config {
    /// Reads and parses a TOML file (without validating it; see [`Config::validate`]).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml(&text).map_err(|e| e.in_file(&path.display().to_string()))
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<inline>".into(),
            message: e.to_string(),
        })
    }

    /// Parses a TOML table (the file with flag overrides merged in). Re-parsed from text so that
    /// errors name the key and show it in context, as for the file itself.
    pub(crate) fn from_table(table: toml::Table, path: &str) -> Result<Config, ConfigError> {
        let text = toml::to_string(&table).map_err(|e| ConfigError::Parse {
            path: path.to_string(),
            message: e.to_string(),
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_string(),
            message: e.to_string(),
        })
    }

    /// Every key as it is written in a file, with its value (without the `[kubernetes]` table).
    pub(crate) fn to_table(&self) -> toml::Table {
        toml::Table::try_from(self).unwrap_or_default()
    }

    /// Keys whose values differ between `self` and `other` (with `kubernetes` for that table).
    pub(crate) fn changed_keys(&self, other: &Config) -> Vec<String> {
        let (a, b) = (self.to_table(), other.to_table());
        let mut keys: Vec<String> = a
            .keys()
            .chain(b.keys())
            .filter(|k| a.get(*k) != b.get(*k))
            .cloned()
            .collect();
        if self.kubernetes != other.kubernetes {
            keys.push("kubernetes".into());
        }
        keys.sort();
        keys.dedup();
        keys
    }

    /// Checks every field once, at start-up (and on each reload), naming the field at fault.
    pub fn validate(&self, registry: &Registry) -> Result<(), ConfigError> {
        self.security
            .validate()
            .map_err(|(field, message)| field_error(field, message))?;
        registry
            .validate_default(&self.kv_connector)
            .map_err(|e| field_error("kv_connector", e.to_string()))?;
        self.cache.validate()?;
        for (role, list) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, ep) in list.iter().enumerate() {
                if let Some(label) = ep.labels.get(kvtransfer::CONNECTOR_TYPE_IDENTIFIER)
                    && !label.trim().is_empty()
                    && !registry.contains(label)
                {
                    let mut names = registry.valid_agent_names();
                    names.sort();
                    return Err(field_error(
                        format!(
                            "{role}[{i}].labels.\"{}\"",
                            kvtransfer::CONNECTOR_TYPE_IDENTIFIER
                        ),
                        format!(
                            "unknown KV connector {label:?} (registered: {})",
                            names.join(", ")
                        ),
                    ));
                }
            }
        }
        for (field, name) in [
            ("prefill_policy", &self.prefill_policy),
            ("decode_policy", &self.decode_policy),
        ] {
            if policy::by_name(name).is_none() {
                return Err(field_error(
                    field,
                    format!(
                        "unknown policy {name:?} (valid: {})",
                        policy::NAMES.join(", ")
                    ),
                ));
            }
        }
        for (field, d) in [
            ("prefill_timeout", self.prefill_timeout),
            ("decode_timeout", self.decode_timeout),
            ("stream_idle_timeout", self.stream_idle_timeout),
            ("client_idle_timeout", self.client_idle_timeout),
            ("connect_timeout", self.connect_timeout),
            ("health_check_interval", self.health_check_interval),
            ("health_check_timeout", self.health_check_timeout),
            ("outlier_base_ejection", self.outlier_base_ejection),
            ("outlier_interval", self.outlier_interval),
            ("queue_timeout", self.queue_timeout),
            ("pool_idle_timeout", self.pool_idle_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
        ] {
            if d.is_zero() {
                return Err(field_error(field, "must be greater than zero"));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(field_error("max_body_bytes", "must be greater than zero"));
        }
        for (field, n) in [
            ("unhealthy_threshold", self.unhealthy_threshold),
            ("healthy_threshold", self.healthy_threshold),
        ] {
            if n == 0 {
                return Err(field_error(field, "must be at least 1"));
            }
        }
        if self.outlier_max_ejection < self.outlier_base_ejection {
            return Err(field_error(
                "outlier_max_ejection",
                "must be at least outlier_base_ejection",
            ));
        }
        if !(self.retry_budget_ratio.is_finite() && (0.0..=10.0).contains(&self.retry_budget_ratio))
        {
            return Err(field_error(
                "retry_budget_ratio",
                "must be between 0 and 10",
            ));
        }
        if !(self.outlier_error_rate.is_finite() && (0.0..=1.0).contains(&self.outlier_error_rate))
        {
            return Err(field_error("outlier_error_rate", "must be between 0 and 1"));
        }
        if self.max_retries > 10 {
            return Err(field_error("max_retries", "must be at most 10"));
        }
        if self.discovery == DiscoveryKind::Kubernetes {
            self.kubernetes.validate().map_err(|e| match e {
                pdkube::KubeDiscoveryError::InvalidConfig { field, reason } => {
                    field_error(format!("kubernetes.{field}"), reason)
                }
                other => field_error("kubernetes", other.to_string()),
            })?;
        }
        self.pods()?;
        Ok(())
    }

    /// The knobs of endpoint health.
    pub(crate) fn health_section(&self) -> HealthConfig {
        HealthConfig {
            health_checks: self.health_checks,
            health_check_interval: self.health_check_interval,
            health_check_timeout: self.health_check_timeout,
            unhealthy_threshold: self.unhealthy_threshold,
            healthy_threshold: self.healthy_threshold,
            consecutive_failures: self.outlier_consecutive_failures,
            error_rate: self.outlier_error_rate,
            min_requests: self.outlier_min_requests,
            interval: self.outlier_interval,
            base_ejection: self.outlier_base_ejection,
            max_ejection: self.outlier_max_ejection,
            half_open_probe: self.reliability.half_open_probe,
        }
    }

    /// The knobs of the engine connection pool.
    pub(crate) fn pool_section(&self) -> PoolConfig {
        PoolConfig {
            connect_timeout: self.connect_timeout,
            idle_timeout: self.pool_idle_timeout,
            max_idle_per_engine: self.pool_max_idle_per_engine,
        }
    }

    /// The statically configured endpoints as pods, with roles, models and connectors as labels.
    pub fn pods(&self) -> Result<Vec<Pod>, ConfigError> {
        let mut pods = Vec::with_capacity(self.prefill.len() + self.decode.len());
        for (role, list) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, ep) in list.iter().enumerate() {
                pods.push(endpoint::endpoint_pod(role, i, ep, self.bootstrap_port)?);
            }
        }
        Ok(pods)
    }
}

#[cfg(test)]
mod tests;
