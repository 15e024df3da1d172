//! Command-line flags and environment variables, which override the config file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{
    Config, ConfigError, DiscoveryKind, EndpointConfig, PrefillFailurePolicy, parse_duration,
};

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
    /// A client connection without a request head for this long is closed [default: 620s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub client_idle_timeout: Option<Duration>,
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
    /// Kubernetes discovery: namespace to watch ('*' for all) [default: the gateway's own].
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Kubernetes discovery: label selector, e.g. `model.aibrix.ai/name=llama,app=engine`.
    #[arg(long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// Active health checks of every endpoint: true or false [default: true].
    #[arg(long, value_name = "VALUE")]
    pub health_checks: Option<bool>,
    /// Time between two active checks of one endpoint [default: 5s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub health_check_interval: Option<Duration>,
    /// Bound on one active check [default: 2s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub health_check_timeout: Option<Duration>,
    /// Consecutive failed checks that make an endpoint unhealthy [default: 3].
    #[arg(long, value_name = "N")]
    pub unhealthy_threshold: Option<u32>,
    /// Consecutive passed checks that make it healthy again [default: 2].
    #[arg(long, value_name = "N")]
    pub healthy_threshold: Option<u32>,
    /// Consecutive failures on real traffic that eject an endpoint; 0 disables [default: 5].
    #[arg(long, value_name = "N")]
    pub outlier_consecutive_failures: Option<u32>,
    /// Share of failed requests within one outlier interval that ejects an endpoint; 0 disables [default: 0.5].
    #[arg(long, value_name = "RATIO")]
    pub outlier_error_rate: Option<f64>,
    /// Requests needed within the interval before the error rate counts [default: 20].
    #[arg(long, value_name = "N")]
    pub outlier_min_requests: Option<u32>,
    /// Window of the error-rate detection [default: 10s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub outlier_interval: Option<Duration>,
    /// First ejection period, doubled on each repeat [default: 10s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub outlier_base_ejection: Option<Duration>,
    /// Longest ejection period [default: 300s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub outlier_max_ejection: Option<Duration>,
    /// Retries of a failed leg on another endpoint; 0 disables [default: 1].
    #[arg(long, value_name = "N")]
    pub max_retries: Option<u32>,
    /// Retries per request allowed on average [default: 0.2].
    #[arg(long, value_name = "RATIO")]
    pub retry_budget_ratio: Option<f64>,
    /// Retry tokens available at start and minimum bucket size [default: 10].
    #[arg(long, value_name = "N")]
    pub retry_budget_min: Option<u32>,
    /// Requests served at once; 0 means unlimited [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Requests waiting beyond max-in-flight; more are refused with 429 [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_queue: Option<usize>,
    /// Longest wait in the queue before a 429 [default: 5s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub queue_timeout: Option<Duration>,
    /// Requests one endpoint holds at once; 0 means unlimited [default: 0].
    #[arg(long, value_name = "N")]
    pub max_in_flight_per_endpoint: Option<usize>,
    /// After SIGTERM, time /ready answers 503 before the listener closes [default: 5s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub drain_delay: Option<Duration>,
    /// Bound on waiting for in-flight requests after the listener closes [default: 30s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub shutdown_timeout: Option<Duration>,
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
        if let Some(v) = self.client_idle_timeout {
            c.client_idle_timeout = v;
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
        if let Some(v) = &self.namespace {
            c.kubernetes.namespace = Some(v.clone());
        }
        if let Some(v) = &self.selector {
            c.kubernetes.selector = Some(v.clone());
        }
        if let Some(v) = self.health_checks {
            c.health_checks = v;
        }
        if let Some(v) = self.health_check_interval {
            c.health_check_interval = v;
        }
        if let Some(v) = self.health_check_timeout {
            c.health_check_timeout = v;
        }
        if let Some(v) = self.unhealthy_threshold {
            c.unhealthy_threshold = v;
        }
        if let Some(v) = self.healthy_threshold {
            c.healthy_threshold = v;
        }
        if let Some(v) = self.outlier_consecutive_failures {
            c.outlier_consecutive_failures = v;
        }
        if let Some(v) = self.outlier_error_rate {
            c.outlier_error_rate = v;
        }
        if let Some(v) = self.outlier_min_requests {
            c.outlier_min_requests = v;
        }
        if let Some(v) = self.outlier_interval {
            c.outlier_interval = v;
        }
        if let Some(v) = self.outlier_base_ejection {
            c.outlier_base_ejection = v;
        }
        if let Some(v) = self.outlier_max_ejection {
            c.outlier_max_ejection = v;
        }
        if let Some(v) = self.max_retries {
            c.max_retries = v;
        }
        if let Some(v) = self.retry_budget_ratio {
            c.retry_budget_ratio = v;
        }
        if let Some(v) = self.retry_budget_min {
            c.retry_budget_min = v;
        }
        if let Some(v) = self.max_in_flight {
            c.max_in_flight = v;
        }
        if let Some(v) = self.max_queue {
            c.max_queue = v;
        }
        if let Some(v) = self.queue_timeout {
            c.queue_timeout = v;
        }
        if let Some(v) = self.max_in_flight_per_endpoint {
            c.max_in_flight_per_endpoint = v;
        }
        if let Some(v) = self.drain_delay {
            c.drain_delay = v;
        }
        if let Some(v) = self.shutdown_timeout {
            c.shutdown_timeout = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use kvtransfer::Registry;

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

    #[test]
    fn operation_flags_reach_the_config() {
        let cli = Cli::parse_from([
            "pdgate",
            "--health-checks",
            "false",
            "--health-check-interval",
            "250ms",
            "--outlier-consecutive-failures",
            "0",
            "--outlier-error-rate",
            "0.25",
            "--max-retries",
            "2",
            "--retry-budget-ratio",
            "0.1",
            "--max-in-flight",
            "8",
            "--max-queue",
            "0",
            "--queue-timeout",
            "1s",
            "--max-in-flight-per-endpoint",
            "3",
            "--drain-delay",
            "0",
            "--shutdown-timeout",
            "9s",
        ]);
        let c = cli.run.load().unwrap();
        assert!(!c.health_checks);
        assert_eq!(c.health_check_interval, Duration::from_millis(250));
        assert_eq!(c.outlier_consecutive_failures, 0);
        assert_eq!(c.outlier_error_rate, 0.25);
        assert_eq!(c.max_retries, 2);
        assert_eq!(c.retry_budget_ratio, 0.1);
        assert_eq!((c.max_in_flight, c.max_queue), (8, 0));
        assert_eq!(c.queue_timeout, Duration::from_secs(1));
        assert_eq!(c.max_in_flight_per_endpoint, 3);
        assert_eq!(c.drain_delay, Duration::ZERO);
        assert_eq!(c.shutdown_timeout, Duration::from_secs(9));
        c.validate(&Registry::with_builtins()).unwrap();
        for (toml, field) in [
            ("health_check_interval = 0", "health_check_interval"),
            ("unhealthy_threshold = 0", "unhealthy_threshold"),
            ("outlier_error_rate = 1.5", "outlier_error_rate"),
            ("retry_budget_ratio = -1", "retry_budget_ratio"),
            ("outlier_max_ejection = \"1s\"", "outlier_max_ejection"),
            ("queue_timeout = 0", "queue_timeout"),
        ] {
            let err = Config::from_toml(toml)
                .unwrap()
                .validate(&Registry::with_builtins())
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{toml}: {err}");
        }
    }
}
