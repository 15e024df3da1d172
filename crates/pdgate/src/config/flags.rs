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
use crate::error::field_error;

pub use crate::telemetry::LogFormat;

mod keys;

pub use keys::{KEYS, Key};

/// Environment variables that set a key (as the flag would; a flag wins).
const ENV: &[(&str, &str)] = &[
    ("kv_connector", "AIBRIX_KV_CONNECTOR_TYPE"),
    ("engine_api_key", "PDGATE_ENGINE_API_KEY"),
    ("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ("otlp_service_name", "OTEL_SERVICE_NAME"),
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
    /// An encoder engine base URL (repeatable; encoder disaggregation: multimodal chat requests
    /// are encoded there before their prefill). Replaces the file's [[encode]] list.
    #[arg(long = "encode", value_name = "URL")]
    pub encode: Vec<String>,
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
            && self.encode.is_empty()
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
        if !self.encode.is_empty() {
            table.insert("encode".into(), endpoints(&self.encode));
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
