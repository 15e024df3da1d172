//! Command-line flags (which override the config file) and the config-file watcher.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kvtransfer::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{
    Config, ConfigError, DiscoveryKind, EndpointConfig, PrefillFailurePolicy, parse_duration,
};
use crate::gateway::PodSet;

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Flags of `pdgate` (serve). Every flag overrides the same field of `--config`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RunArgs {
    /// TOML configuration file; watched, and its endpoint set reloaded on change.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to serve on [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// A prefill engine base URL (repeatable). Replaces the file's [[prefill]] list.
    #[arg(long = "prefill", value_name = "URL")]
    pub prefill: Vec<String>,
    /// A decode engine base URL (repeatable). Replaces the file's [[decode]] list.
    #[arg(long = "decode", value_name = "URL")]
    pub decode: Vec<String>,
    /// Global default KV connector for endpoints without a `model.aibrix.ai/kv-connector-type`
    /// label (shfs, nixl, mooncake, sglang) [default: shfs].
    #[arg(long, env = "AIBRIX_KV_CONNECTOR_TYPE", value_name = "NAME")]
    pub kv_connector: Option<String>,
    /// Model served by endpoints that declare none (repeatable).
    #[arg(long = "model", value_name = "NAME")]
    pub models: Vec<String>,
    /// Prefill policy: round_robin, random, least_request, power_of_two [default: round_robin].
    #[arg(long, value_name = "POLICY")]
    pub prefill_policy: Option<String>,
    /// Decode policy: round_robin, random, least_request, power_of_two [default: least_request].
    #[arg(long, value_name = "POLICY")]
    pub decode_policy: Option<String>,
    /// Bound on the whole prefill leg [default: 30s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub prefill_timeout: Option<Duration>,
    /// Bound on waiting for the decode response head [default: 300s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub decode_timeout: Option<Duration>,
    /// Bound on silence between two relayed chunks [default: 120s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub stream_idle_timeout: Option<Duration>,
    /// Bound on connecting to an engine [default: 5s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub connect_timeout: Option<Duration>,
    /// When the prefill fails (5xx, transport error, timeout): `fallback` sends the request to
    /// the decode alone and marks the response `x-pdgate-fallback`; `fail` answers the error
    /// [default: fallback].
    #[arg(long, value_enum, value_name = "POLICY")]
    pub on_prefill_failure: Option<PrefillFailurePolicy>,
    /// Largest accepted request body in bytes [default: 33554432].
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Endpoint discovery [default: static].
    #[arg(long, value_enum, value_name = "KIND")]
    pub discovery: Option<DiscoveryKind>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

fn endpoints(urls: &[String]) -> Vec<EndpointConfig> {
    urls.iter()
        .map(|url| EndpointConfig {
            url: url.clone(),
            ..EndpointConfig::default()
        })
        .collect()
}

impl RunArgs {
    /// The file (if any) with every given flag applied on top.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        self.apply(&mut config);
        Ok(config)
    }

    fn apply(&self, c: &mut Config) {
        if let Some(v) = self.listen {
            c.listen = v;
        }
        if !self.prefill.is_empty() {
            c.prefill = endpoints(&self.prefill);
        }
        if !self.decode.is_empty() {
            c.decode = endpoints(&self.decode);
        }
        if let Some(v) = &self.kv_connector {
            c.kv_connector = v.clone();
        }
        if !self.models.is_empty() {
            c.models = self.models.clone();
        }
        if let Some(v) = &self.prefill_policy {
            c.prefill_policy = v.clone();
        }
        if let Some(v) = &self.decode_policy {
            c.decode_policy = v.clone();
        }
        if let Some(v) = self.prefill_timeout {
            c.prefill_timeout = v;
        }
        if let Some(v) = self.decode_timeout {
            c.decode_timeout = v;
        }
        if let Some(v) = self.stream_idle_timeout {
            c.stream_idle_timeout = v;
        }
        if let Some(v) = self.connect_timeout {
            c.connect_timeout = v;
        }
        if let Some(v) = self.on_prefill_failure {
            c.on_prefill_failure = v;
        }
        if let Some(v) = self.max_body_bytes {
            c.max_body_bytes = v;
        }
        if let Some(v) = self.discovery {
            c.discovery = v;
        }
    }
}

fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Polls the config file and publishes its endpoint set whenever it changes and validates.
/// A bad edit is logged and ignored: the last good set keeps serving. Ends on `cancel`.
pub async fn watch_config_file(
    args: RunArgs,
    registry: Registry,
    tx: watch::Sender<PodSet>,
    cancel: CancellationToken,
    interval: Duration,
) {
    let Some(path) = args.config.clone() else {
        return;
    };
    let mut last = stamp(&path);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let now = stamp(&path);
        if now == last {
            continue;
        }
        last = now;
        let loaded = args
            .load()
            .and_then(|c| c.validate(&registry).map(|_| c))
            .and_then(|c| c.pods());
        match loaded {
            Ok(pods) => {
                let changed = tx.send_if_modified(|current| {
                    if current.as_slice() == pods.as_slice() {
                        false
                    } else {
                        *current = Arc::new(pods);
                        true
                    }
                });
                if changed {
                    info!(file = %path.display(), "config reloaded: endpoint set changed");
                }
            }
            Err(e) => {
                warn!(file = %path.display(), error = %e, "config reload rejected; keeping the last good endpoint set")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn flags_override_the_file() {
        let dir = std::env::temp_dir().join(format!("pdgate-cli-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pdgate.toml");
        std::fs::write(
            &file,
            "kv_connector = \"nixl\"\nprefill_timeout = \"9s\"\n[[prefill]]\nurl = \"http://10.0.0.1:8000\"\n[[decode]]\nurl = \"http://10.0.0.2:8000\"\n",
        )
        .unwrap();
        let cli = Cli::parse_from([
            "pdgate",
            "--config",
            file.to_str().unwrap(),
            "--prefill",
            "http://127.0.0.1:1",
            "--prefill",
            "http://127.0.0.1:2",
            "--prefill-timeout",
            "250ms",
        ]);
        let c = cli.run.load().unwrap();
        assert_eq!(c.prefill.len(), 2);
        assert_eq!(c.decode[0].url, "http://10.0.0.2:8000");
        assert_eq!(c.prefill_timeout, Duration::from_millis(250));
        assert_eq!(c.kv_connector, "nixl");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
