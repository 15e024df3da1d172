//! The one configuration type: read from TOML, overridden by flags and environment
//! ([`flags`]), validated once.

mod endpoint;
mod flags;
mod sections;

pub use crate::durations::parse_duration;
pub use crate::endpoints::health::HealthConfig;
pub use crate::endpoints::policy::PolicyConfig;
pub use crate::engine::pool::PoolConfig;
pub use crate::error::ConfigError;
pub use crate::limits::LimitsConfig;
pub use crate::security::auth::{ClientConfig, Secret};
pub use crate::security::guard::SecurityConfig;
pub use flags::{LogFormat, RunArgs};
pub use sections::{
    DiscoveryConfig, DiscoveryKind, HttpConfig, LegsConfig, PrefillFailurePolicy, ShutdownConfig,
};

use std::collections::BTreeMap;
use std::path::Path;

use kvtransfer::{Pod, Registry};
use serde::{Deserialize, Serialize};

use crate::error::field_error;

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
    /// Data-parallel ranks the engine serves (vLLM `--data-parallel-size`), each routed to as its
    /// own target with `X-data-parallel-rank` (shortcut for the `pdgate.io/data-parallel-size`
    /// annotation). Unset or 1: one target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
}

/// The whole gateway configuration, in sections owned by the rooms that read them. The file
/// keeps its flat keys (`prefill_timeout = "30s"` is `legs.prefill_timeout`): [`Config::from_toml`]
/// files each key into its section by [`KEYS`](flags::KEYS), [`Config::to_table`] writes them
/// back flat. Defaults live in each section's `Default`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The edge: listen address, client idle timeout, access log, body size.
    pub http: HttpConfig,
    /// Default connector, discovery kind, bootstrap port and refresh.
    pub discovery: DiscoveryConfig,
    /// Models served by endpoints that declare none.
    pub models: Vec<String>,
    /// Prefill engines.
    pub prefill: Vec<EndpointConfig>,
    /// Decode engines.
    pub decode: Vec<EndpointConfig>,
    /// Encoder engines (encoder disaggregation, `[[encode]]`): a multimodal chat request's
    /// items are encoded there before its prefill.
    pub encode: Vec<EndpointConfig>,
    /// The selection policy of each role.
    pub policy: PolicyConfig,
    /// Leg timeouts, prefill failure, retries.
    pub legs: LegsConfig,
    /// Engine connections.
    pub pool: PoolConfig,
    /// Active checks and passive ejection.
    pub health: HealthConfig,
    /// Admission, per-endpoint cap, retry budget.
    pub limits: LimitsConfig,
    /// Drain and shutdown bounds.
    pub shutdown: ShutdownConfig,
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
    /// OpenTelemetry trace export (`[telemetry]`), off by default.
    pub telemetry: crate::telemetry::TelemetryConfig,
}

/// Whether `name` is a section whose keys the file writes at the top level.
fn is_flat_section(name: &str) -> bool {
    flags::KEYS.iter().any(|k| !k.in_table && k.section == name)
}

/// The file's table with every top-level key filed into its section (a `[legs]`-style table of
/// such a section is accepted too). Unknown top-level keys are errors naming them.
fn into_sections(table: toml::Table, path: &str) -> Result<toml::Table, ConfigError> {
    let parse_error = |message: String| ConfigError::Parse {
        path: path.to_string(),
        message,
    };
    let mut out = toml::Table::new();
    for (name, value) in table {
        let key = flags::KEYS.iter().find(|k| !k.in_table && k.name == name);
        let (section, entries) = match (key, value) {
            (Some(k), value) if !(is_flat_section(&name) && value.is_table()) => {
                (k.section.to_string(), vec![(name, value)])
            }
            // A section written as its own table: the table's name is the section's.
            (_, toml::Value::Table(t)) if is_flat_section(&name) => (name, t.into_iter().collect()),
            (_, value) if Config::TABLES.contains(&name.as_str()) => {
                out.insert(name, value);
                continue;
            }
            _ => return Err(parse_error(format!("unknown key `{name}`"))),
        };
        let slot = out
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(slot) = slot else {
            return Err(parse_error(format!("`{section}` is not a table")));
        };
        for (k, v) in entries {
            if slot.insert(k.clone(), v).is_some() {
                return Err(parse_error(format!("`{k}` is given twice")));
            }
        }
    }
    Ok(out)
}

/// serde's message about a sectioned key, naming the key as the file writes it.
fn file_key_message(message: &str) -> String {
    let mut message = message.to_string();
    for k in flags::KEYS.iter().filter(|k| !k.in_table) {
        message = message.replace(
            &format!("`{}.{}`", k.section, k.name),
            &format!("`{}`", k.name),
        );
    }
    message
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
        let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<inline>".into(),
            message: e.to_string(),
        })?;
        Config::from_table(table, "<inline>")
    }

    /// The top-level keys that are tables or lists of their own rather than a section's keys.
    const TABLES: &[&str] = &[
        "models",
        "prefill",
        "decode",
        "encode",
        "kubernetes",
        "cache",
        "security",
        "reliability",
        "telemetry",
    ];

    /// Parses a table written as the file is (flat keys; with flag overrides merged in). Errors
    /// name the key as the file writes it.
    pub(crate) fn from_table(table: toml::Table, path: &str) -> Result<Config, ConfigError> {
        let sections = into_sections(table, path)?;
        Config::deserialize(toml::Value::Table(sections)).map_err(|e| ConfigError::Parse {
            path: path.to_string(),
            message: file_key_message(&e.to_string()),
        })
    }

    /// Every key as it is written in a file, with its value (without the `[kubernetes]` and
    /// `[cache]` tables).
    pub(crate) fn to_table(&self) -> toml::Table {
        let sectioned = toml::Table::try_from(self).unwrap_or_default();
        let mut flat = toml::Table::new();
        for (name, value) in sectioned {
            match value {
                toml::Value::Table(t) if is_flat_section(&name) => flat.extend(t),
                other => {
                    flat.insert(name, other);
                }
            }
        }
        flat
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
        self.http.validate()?;
        self.policy.validate()?;
        self.legs.validate()?;
        self.pool.validate()?;
        self.health.validate()?;
        self.limits.validate()?;
        self.reliability.validate()?;
        self.shutdown.validate()?;
        self.security
            .validate()
            .map_err(|(field, message)| field_error(field, message))?;
        self.cache.validate()?;
        self.telemetry
            .validate()
            .map_err(|(field, message)| field_error(field, message))?;
        registry
            .validate_default(&self.discovery.kv_connector)
            .map_err(|e| field_error("kv_connector", e.to_string()))?;
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
        if self.discovery.kind == DiscoveryKind::Kubernetes {
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

    /// The statically configured endpoints as pods, with roles, models and connectors as labels.
    pub fn pods(&self) -> Result<Vec<Pod>, ConfigError> {
        let mut pods =
            Vec::with_capacity(self.prefill.len() + self.decode.len() + self.encode.len());
        for (role, list) in [
            ("prefill", &self.prefill),
            ("decode", &self.decode),
            ("encode", &self.encode),
        ] {
            for (i, ep) in list.iter().enumerate() {
                pods.push(endpoint::endpoint_pod(
                    role,
                    i,
                    ep,
                    self.discovery.bootstrap_port,
                )?);
            }
        }
        Ok(pods)
    }
}

#[cfg(test)]
mod tests;
