//! Command-line flags and environment variables, which override the config file.
//!
//! Every scalar key of [`Config`] is a flag of the same name with dashes
//! (`health_check_interval` <-> `--health-check-interval`), generated from [`KEYS`] with its
//! default read from [`Config::default`]: nothing is written twice. `--set KEY=VALUE` overrides
//! any key, nested ones too (`--set kubernetes.debounce_ms=500`); a key may be prefixed by its
//! section (`--set limits.max_in_flight=0`). Values are merged into the file's TOML table and
//! parsed once with it, so a bad value names its key whichever way it came.

use std::path::PathBuf;

use clap::{Arg, ArgMatches, Command};

use crate::config::{Config, ConfigError};

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A key of the configuration file: its section (a documentation group, also accepted as a
/// prefix by `--set`), its name, and the help shown by `--help`.
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// `http`, `legs`, `policy`, `health`, `limits`, `pool`, `discovery`, `shutdown`,
    /// `security`.
    pub section: &'static str,
    /// The key, as written in the file (inside `[section]` when `in_table`).
    pub name: &'static str,
    /// One line of help.
    pub help: &'static str,
    /// Whether the key lives in the file's `[section]` table (newer keys) rather than at the
    /// top level (the keys operators' files already use, which keep their place).
    pub in_table: bool,
    /// Whether a flag's value is always text (keys with no default to take the type from:
    /// `engine_api_key = "123"` stays a string).
    pub text: bool,
}

const fn key(section: &'static str, name: &'static str, help: &'static str) -> Key {
    Key {
        section,
        name,
        help,
        in_table: false,
        text: false,
    }
}

/// A key inside the file's `[section]` table.
const fn key_in(section: &'static str, name: &'static str, help: &'static str) -> Key {
    Key {
        in_table: true,
        ..key(section, name, help)
    }
}

impl Key {
    /// The same key, whose flag value is always text.
    const fn text(self) -> Key {
        Key { text: true, ..self }
    }

    /// The key's dotted path in the file: `max_in_flight`, `security.request_body_timeout`.
    pub fn path(&self) -> String {
        if self.in_table {
            format!("{}.{}", self.section, self.name)
        } else {
            self.name.to_string()
        }
    }
}

/// Every scalar key, with a flag each. (`prefill`, `decode`, `models` and `[kubernetes]` have
/// their own flags below.) A test checks this list against [`Config`]'s keys.
pub const KEYS: &[Key] = &[
    key("http", "listen", "Address to serve on"),
    key(
        "http",
        "client_idle_timeout",
        "A client connection without a request head for this long is closed",
    ),
    key(
        "http",
        "access_log",
        "One log line per finished request at info (target pdgate::access): request id, route, status, outcome, model, connector, endpoints, total and first-byte times",
    ),
    key(
        "http",
        "max_body_bytes",
        "Largest accepted request body in bytes",
    ),
    key(
        "discovery",
        "kv_connector",
        "Global default KV connector for endpoints without a `model.aibrix.ai/kv-connector-type` label (shfs, nixl, mooncake, sglang)",
    ),
    key(
        "discovery",
        "discovery",
        "Endpoint discovery: static or kubernetes",
    ),
    key(
        "discovery",
        "bootstrap_port",
        "Bootstrap port of static prefill endpoints that set none (Mooncake /query, SGLang bootstrap server; engines default to 8998)",
    ),
    key(
        "discovery",
        "bootstrap_refresh",
        "How often bootstrap (/query) answers are refreshed",
    ),
    key(
        "policy",
        "prefill_policy",
        "Prefill policy: round_robin, random, least_request, power_of_two, cache_aware",
    ),
    key(
        "policy",
        "decode_policy",
        "Decode policy: round_robin, random, least_request, power_of_two, cache_aware",
    ),
    key("legs", "prefill_timeout", "Bound on the whole prefill leg"),
    key(
        "legs",
        "decode_timeout",
        "Bound on waiting for the decode response head",
    ),
    key(
        "legs",
        "stream_idle_timeout",
        "Bound on silence between two relayed chunks",
    ),
    key(
        "legs",
        "on_prefill_failure",
        "When the prefill fails (5xx, transport error, timeout): `fallback` sends the request to the decode alone and marks the response `x-pdgate-fallback`; `fail` answers the error",
    ),
    key(
        "legs",
        "max_retries",
        "Retries of a failed leg on another endpoint; 0 disables",
    ),
    key(
        "pool",
        "connect_timeout",
        "Bound on connecting to an engine",
    ),
    key(
        "pool",
        "pool_max_idle_per_engine",
        "Idle connections kept per engine for reuse",
    ),
    key(
        "pool",
        "pool_idle_timeout",
        "An idle engine connection older than this is closed",
    ),
    key(
        "health",
        "health_checks",
        "Active health checks of every endpoint: true or false",
    ),
    key(
        "health",
        "health_check_interval",
        "Time between two active checks of one endpoint",
    ),
    key(
        "health",
        "health_check_timeout",
        "Bound on one active check",
    ),
    key(
        "health",
        "unhealthy_threshold",
        "Consecutive failed checks that make an endpoint unhealthy",
    ),
    key(
        "health",
        "healthy_threshold",
        "Consecutive passed checks that make it healthy again",
    ),
    key(
        "health",
        "outlier_consecutive_failures",
        "Consecutive failures on real traffic that eject an endpoint; 0 disables",
    ),
    key(
        "health",
        "outlier_error_rate",
        "Share of failed requests within one outlier interval that ejects an endpoint; 0 disables",
    ),
    key(
        "health",
        "outlier_min_requests",
        "Requests needed within the interval before the error rate counts",
    ),
    key(
        "health",
        "outlier_interval",
        "Window of the error-rate detection",
    ),
    key(
        "health",
        "outlier_base_ejection",
        "First ejection period, doubled on each repeat",
    ),
    key("health", "outlier_max_ejection", "Longest ejection period"),
    key(
        "limits",
        "retry_budget_ratio",
        "Retries per request allowed on average",
    ),
    key(
        "limits",
        "retry_budget_min",
        "Retry tokens available at start and minimum bucket size",
    ),
    key(
        "limits",
        "max_in_flight",
        "Requests served at once; 0 means unlimited",
    ),
    key(
        "limits",
        "max_queue",
        "Requests waiting beyond max-in-flight; more are refused with 429",
    ),
    key(
        "limits",
        "queue_timeout",
        "Longest wait in the queue before a 429",
    ),
    key(
        "limits",
        "max_in_flight_per_endpoint",
        "Requests one endpoint holds at once; 0 means unlimited",
    ),
    key(
        "shutdown",
        "drain_delay",
        "After SIGTERM, time /ready answers 503 before the listener closes",
    ),
    key(
        "shutdown",
        "shutdown_timeout",
        "Bound on waiting for in-flight requests after the listener closes",
    ),
    key_in(
        "security",
        "request_body_timeout",
        "A request body must be read completely within this long of its head (408 otherwise)",
    ),
    key_in(
        "security",
        "max_buffered_body_bytes",
        "Total bytes of request bodies being read at once; 0 means unbounded",
    ),
    key_in(
        "security",
        "body_budget_wait",
        "How long a body waits for room in max-buffered-body-bytes before a 503",
    ),
    key_in(
        "security",
        "max_streams_per_connection",
        "HTTP/2 streams one client connection may have open at once",
    ),
    key_in(
        "security",
        "api_keys_file",
        "A file of client API keys, one per line, re-read when it changes",
    ).text(),
    key_in(
        "security",
        "reload_interval",
        "How often api-keys-file and the TLS files are checked for changes",
    ),
    key_in(
        "security",
        "tls_cert",
        "Serve HTTPS with this certificate chain (PEM; with tls-key), re-read when it changes",
    )
    .text(),
    key_in(
        "security",
        "tls_key",
        "The private key (PEM) of tls-cert, re-read when it changes",
    )
    .text(),
    key_in(
        "security",
        "engine_ca_file",
        "CA certificates (PEM) that https:// engines are verified against (default: the system's roots)",
    )
    .text(),
    key_in(
        "security",
        "engine_client_cert",
        "A client certificate (PEM) presented to https:// engines (mTLS; with engine-client-key)",
    )
    .text(),
    key_in(
        "security",
        "engine_client_key",
        "The private key (PEM) of engine-client-cert",
    )
    .text(),
    key_in(
        "security",
        "engine_api_key",
        "The engines' API key, sent to them as the bearer token",
    ).text(),
    key_in(
        "security",
        "forward_client_authorization",
        "Forward the client's Authorization header to engines (unset: only when neither client keys nor an engine key are configured)",
    ),
    key_in(
        "security",
        "expose_target_headers",
        "Name the serving endpoints in answers (prefill-target-pod, target-pod)",
    ),
    key_in(
        "security",
        "admin_listen",
        "Serve /metrics, /health and /ready on this address; /metrics leaves the API port",
    ).text(),
];

/// Environment variables that set a key (as the flag would; a flag wins).
const ENV: &[(&str, &str)] = &[
    ("kv_connector", "AIBRIX_KV_CONNECTOR_TYPE"),
    ("engine_api_key", "PDGATE_ENGINE_API_KEY"),
];

/// Values given on the command line (or environment) for [`KEYS`], in the order of [`KEYS`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyFlags(pub Vec<(&'static str, String)>);

fn flag_name(key: &str) -> &'static str {
    // clap wants `&'static str` names (its `string` feature is off); the key flags are built
    // once per parse, at start-up.
    Box::leak(key.replace('_', "-").into_boxed_str())
}

/// How the default of `key` (a dotted path) is written in help and docs (`none` for an empty
/// list or an unset option).
pub(crate) fn default_text(defaults: &toml::Table, key: &str) -> String {
    match lookup(defaults, key) {
        Some(toml::Value::String(s)) => s.clone(),
        Some(toml::Value::Array(a)) if a.is_empty() => "none".into(),
        Some(v) => v.to_string(),
        None => "none".into(),
    }
}

/// The value at the dotted `path` of `table`.
fn lookup<'t>(table: &'t toml::Table, path: &str) -> Option<&'t toml::Value> {
    let (parents, last) = match path.rsplit_once('.') {
        Some((parents, last)) => (Some(parents), last),
        None => (None, path),
    };
    let mut at = table;
    for p in parents.into_iter().flat_map(|p| p.split('.')) {
        at = at.get(p)?.as_table()?;
    }
    at.get(last)
}

impl clap::Args for KeyFlags {
    fn augment_args(cmd: Command) -> Command {
        let defaults = Config::default().to_table();
        KEYS.iter().fold(cmd, |cmd, k| {
            let mut arg = Arg::new(k.name)
                .long(flag_name(k.name))
                .value_name("VALUE")
                .help(format!(
                    "{} [default: {}]",
                    k.help,
                    default_text(&defaults, &k.path())
                ));
            if let Some((_, var)) = ENV.iter().find(|(name, _)| *name == k.name) {
                // Some are secrets: `--help` never prints what the environment holds.
                arg = arg.env(*var).hide_env_values(true);
            }
            cmd.arg(arg)
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for KeyFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut given = Vec::new();
        for k in KEYS {
            if let Some(v) = matches.get_one::<String>(k.name) {
                given.push((k.name, v.clone()));
            }
        }
        Ok(KeyFlags(given))
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// Flags of `pdgate` (serve). Every flag overrides the same key of `--config`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RunArgs {
    /// TOML configuration file; watched, and its endpoint set reloaded on change.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A prefill engine base URL (repeatable). Replaces the file's [[prefill]] list.
    #[arg(long = "prefill", value_name = "URL")]
    pub prefill: Vec<String>,
    /// A decode engine base URL (repeatable). Replaces the file's [[decode]] list.
    #[arg(long = "decode", value_name = "URL")]
    pub decode: Vec<String>,
    /// Model served by endpoints that declare none (repeatable).
    #[arg(long = "model", value_name = "NAME")]
    pub models: Vec<String>,
    /// Kubernetes discovery: namespace to watch ('*' for all) [default: the gateway's own].
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Kubernetes discovery: label selector, e.g. `model.aibrix.ai/name=llama,app=engine`.
    #[arg(long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// cache_aware: the engines' KV block size in tokens (`cache.block_size`) [default: 16].
    #[arg(long, value_name = "TOKENS")]
    pub block_size: Option<usize>,
    /// cache_aware: a tokenizer.json (chat template from tokenizer_config.json beside it), so
    /// requests are keyed by token blocks as the engines' caches are (`cache.tokenizer`).
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// cache_aware decode policy: serve on the decode alone when at most this many prompt tokens
    /// are uncached there; 0 disables (`cache.decode_only_below_tokens`) [default: 0].
    #[arg(long, value_name = "TOKENS")]
    pub decode_only_below_tokens: Option<u32>,
    /// A path relayed unchanged to a decode (repeatable; replaces `security.passthrough`).
    #[arg(long = "passthrough", value_name = "PATH")]
    pub passthrough: Vec<String>,
    /// A client API key (repeatable, or comma-separated in the environment; added to
    /// `security.api_keys`).
    #[arg(
        long = "api-key",
        env = "PDGATE_API_KEYS",
        value_delimiter = ',',
        value_name = "KEY",
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Any key, e.g. `--set limits.max_in_flight=0` or `--set kubernetes.debounce_ms=500`
    /// (repeatable; applied after the other flags).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub keys: KeyFlags,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

fn field_error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        message: message.into(),
    }
}

/// `raw` as the TOML value of a key whose default is `like`: a string key takes the text as it
/// is (durations, addresses, names), others parse it as TOML (numbers, booleans, arrays).
fn value_like(
    like: Option<&toml::Value>,
    key: &str,
    raw: &str,
) -> Result<toml::Value, ConfigError> {
    let is_text = KEYS.iter().any(|k| k.text && k.path() == key);
    if is_text || matches!(like, Some(toml::Value::String(_))) {
        return Ok(toml::Value::String(raw.to_string()));
    }
    let doc: toml::Table = toml::from_str(&format!("v = {raw}"))
        .or_else(|_| toml::from_str(&format!("v = {}", toml::Value::String(raw.to_string()))))
        .map_err(|e| field_error(key, format!("{raw:?} is not a value: {e}")))?;
    doc.get("v")
        .cloned()
        .ok_or_else(|| field_error(key, format!("{raw:?} is not a value")))
}

/// Sets the dotted `path` in `table` (creating tables on the way); a leading section name is
/// dropped.
fn set_path(
    table: &mut toml::Table,
    defaults: &toml::Table,
    path: &str,
    raw: &str,
) -> Result<(), ConfigError> {
    let mut parts: Vec<&str> = path.split('.').map(str::trim).collect();
    if parts.len() > 1
        && let Some(k) = KEYS.iter().find(|k| k.name == parts[1] && !k.in_table)
    {
        if k.section != parts[0] {
            return Err(field_error(
                path,
                format!("`{}` is in section `{}`", k.name, k.section),
            ));
        }
        parts.remove(0);
    }
    if parts.len() == 1
        && let Some(k) = KEYS.iter().find(|k| k.name == parts[0] && k.in_table)
    {
        // A key of a `[section]` table named without its section.
        parts.insert(0, k.section);
    }
    let Some((last, parents)) = parts.split_last() else {
        return Err(field_error(path, "empty key"));
    };
    let canonical = parts.join(".");
    let like = lookup(defaults, &canonical);
    let value = value_like(like, &canonical, raw)?;
    let mut at = table;
    for p in parents {
        let next = at
            .entry((*p).to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = match next {
            toml::Value::Table(t) => t,
            _ => return Err(field_error(path, format!("`{p}` is not a table"))),
        };
    }
    at.insert((*last).to_string(), value);
    Ok(())
}

fn endpoints(urls: &[String]) -> toml::Value {
    toml::Value::Array(
        urls.iter()
            .map(|url| {
                let mut t = toml::Table::new();
                t.insert("url".into(), toml::Value::String(url.clone()));
                toml::Value::Table(t)
            })
            .collect(),
    )
}

impl RunArgs {
    /// The file (if any) with every given flag applied on top.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let (text, path) = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
                (text, path.display().to_string())
            }
            None => (String::new(), "<flags>".to_string()),
        };
        if self.is_plain() {
            // Nothing to merge: parse the text itself, so errors point at its lines.
            return Config::from_toml(&text).map_err(|e| e.in_file(&path));
        }
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.clone(),
            message: e.to_string(),
        })?;
        self.apply(&mut table)?;
        Config::from_table(table, &path)
    }

    fn is_plain(&self) -> bool {
        self.prefill.is_empty()
            && self.decode.is_empty()
            && self.models.is_empty()
            && self.namespace.is_none()
            && self.selector.is_none()
            && self.block_size.is_none()
            && self.tokenizer.is_none()
            && self.decode_only_below_tokens.is_none()
            && self.set.is_empty()
            && self.keys.0.is_empty()
            && self.passthrough.is_empty()
            && self.api_keys.is_empty()
    }

    fn apply(&self, table: &mut toml::Table) -> Result<(), ConfigError> {
        let defaults = Config::default().to_table();
        if !self.prefill.is_empty() {
            table.insert("prefill".into(), endpoints(&self.prefill));
        }
        if !self.decode.is_empty() {
            table.insert("decode".into(), endpoints(&self.decode));
        }
        if !self.models.is_empty() {
            let models = self
                .models
                .iter()
                .cloned()
                .map(toml::Value::String)
                .collect();
            table.insert("models".into(), toml::Value::Array(models));
        }
        for (key, v) in [("namespace", &self.namespace), ("selector", &self.selector)] {
            if let Some(v) = v {
                let kube = table
                    .entry("kubernetes")
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                if let toml::Value::Table(kube) = kube {
                    kube.insert(key.into(), toml::Value::String(v.clone()));
                }
            }
        }
        let cache = [
            (
                "block_size",
                self.block_size.map(|v| toml::Value::Integer(v as i64)),
            ),
            (
                "tokenizer",
                self.tokenizer
                    .as_ref()
                    .map(|p| toml::Value::String(p.display().to_string())),
            ),
            (
                "decode_only_below_tokens",
                self.decode_only_below_tokens
                    .map(|v| toml::Value::Integer(i64::from(v))),
            ),
        ];
        for (key, v) in cache {
            if let Some(v) = v {
                let section = table
                    .entry("cache")
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                if let toml::Value::Table(section) = section {
                    section.insert(key.into(), v);
                }
            }
        }
        let security = table
            .entry("security")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(security) = security {
            if !self.passthrough.is_empty() {
                let paths = self.passthrough.iter().cloned().map(toml::Value::String);
                security.insert("passthrough".into(), toml::Value::Array(paths.collect()));
            }
            let keys: Vec<toml::Value> = self
                .api_keys
                .iter()
                .map(|k| k.trim())
                .filter(|k| !k.is_empty())
                .map(|k| toml::Value::String(k.to_string()))
                .collect();
            if !keys.is_empty() {
                let list = security
                    .entry("api_keys")
                    .or_insert_with(|| toml::Value::Array(Vec::new()));
                if let toml::Value::Array(list) = list {
                    list.extend(keys);
                }
            }
        }
        for (name, raw) in &self.keys.0 {
            let path = KEYS
                .iter()
                .find(|k| k.name == *name)
                .map_or_else(|| (*name).to_string(), Key::path);
            set_path(table, &defaults, &path, raw)?;
        }
        for item in &self.set {
            let (path, raw) = item
                .split_once('=')
                .ok_or_else(|| field_error(item.as_str(), "--set wants KEY=VALUE"))?;
            set_path(table, &defaults, path, raw)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
