//! Tests of the flags, environment variables and `--set` overrides.

use super::*;
use clap::Parser;
use kvtransfer::Registry;
use std::time::Duration;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    run: RunArgs,
}

#[test]
fn every_key_has_a_flag_and_a_section() {
    let defaults = Config::default().to_table();
    let mut keys: Vec<String> = defaults.keys().cloned().collect();
    // Lists with flags of their own, and the `[security]` table (its keys are checked below).
    keys.retain(|k| {
        ![
            "prefill",
            "decode",
            "encode",
            "models",
            "security",
            "telemetry",
        ]
        .contains(&k.as_str())
    });
    let telemetry = defaults["telemetry"].as_table().unwrap();
    keys.extend(telemetry.keys().map(|k| format!("telemetry.{k}")));
    assert!(!telemetry.contains_key("otlp_endpoint"));
    keys.push("telemetry.otlp_endpoint".into());
    let security = defaults["security"].as_table().unwrap();
    keys.extend(
        security
            .keys()
            .filter(|k| !["passthrough", "api_keys", "clients"].contains(&k.as_str()))
            .map(|k| format!("security.{k}")),
    );
    // Keys without a default (options) are not in the table: they must have a flag all the same.
    assert!(!defaults.contains_key("bootstrap_port"));
    keys.push("bootstrap_port".into());
    for unset in [
        "api_keys_file",
        "engine_api_key",
        "forward_client_authorization",
        "admin_listen",
        "tls_cert",
        "tls_key",
        "engine_ca_file",
        "engine_client_cert",
        "engine_client_key",
    ] {
        assert!(!security.contains_key(unset), "{unset} has a default now");
        keys.push(format!("security.{unset}"));
    }
    keys.sort();
    let mut flagged: Vec<String> = KEYS.iter().map(Key::path).collect();
    flagged.sort();
    assert_eq!(keys, flagged);
}

#[test]
fn cache_flags_and_set_reach_the_cache_section() {
    let cli = Cli::parse_from([
        "pdgate",
        "--block-size",
        "32",
        "--decode-only-below-tokens",
        "128",
        "--set",
        "cache.approximate_ttl=30s",
        "--set",
        "cache.load_weight=64",
        "--set",
        "cache.engine_load_interval=500ms",
    ]);
    let c = cli.run.load().unwrap();
    assert_eq!(c.cache.engine_load_interval, Duration::from_millis(500));
    assert_eq!(c.cache.block_size, 32);
    assert_eq!(c.cache.decode_only_below_tokens, 128);
    assert_eq!(c.cache.approximate_ttl, Duration::from_secs(30));
    assert_eq!(c.cache.load_weight, 64.0);
    let cli = Cli::parse_from(["pdgate", "--set", "cache.block_sise=3"]);
    assert!(cli.run.load().is_err());
}

#[test]
fn security_keys_come_from_flags_set_and_the_environment_style_lists() {
    let cli = Cli::parse_from([
        "pdgate",
        "--request-body-timeout",
        "3s",
        "--engine-api-key",
        "123",
        "--set",
        "security.max_streams_per_connection=8",
        "--set",
        "expose_target_headers=true",
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--passthrough",
        "/v1/custom",
        "--admin-listen",
        "127.0.0.1:9100",
    ]);
    let c = cli.run.load().unwrap();
    let s = &c.security;
    assert_eq!(s.request_body_timeout, Duration::from_secs(3));
    assert_eq!(s.engine_api_key.as_ref().map(|k| k.0.as_str()), Some("123"));
    assert_eq!(s.max_streams_per_connection, 8);
    assert!(s.expose_target_headers);
    let keys: Vec<&str> = s.api_keys.iter().map(|k| k.0.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(s.passthrough, ["/v1/custom"]);
    assert_eq!(s.admin_listen, Some("127.0.0.1:9100".parse().unwrap()));
    let cli = Cli::parse_from(["pdgate", "--request-body-timeout", "soon"]);
    let err = cli.run.load().unwrap_err().to_string();
    assert!(err.contains("request_body_timeout"), "{err}");
}

#[test]
fn set_overrides_any_key_with_or_without_its_section() {
    let cli = Cli::parse_from([
        "pdgate",
        "--max-in-flight",
        "8",
        "--set",
        "limits.max_in_flight=0",
        "--set",
        "pool_idle_timeout=2s",
        "--set",
        "kubernetes.debounce_ms=500",
        "--namespace",
        "ns",
    ]);
    let c = cli.run.load().unwrap();
    assert_eq!(
        c.limits.max_in_flight, 0,
        "--set is applied after the flags"
    );
    assert_eq!(c.pool.idle_timeout, Duration::from_secs(2));
    assert_eq!(c.kubernetes.namespace.as_deref(), Some("ns"));
    assert_eq!(c.kubernetes.debounce, Duration::from_millis(500));
    for bad in [
        "health.max_in_flight=1",
        "max_in_flight",
        "max_in_flight=lots",
    ] {
        let cli = Cli::parse_from(["pdgate", "--set", bad]);
        let err = cli.run.load().unwrap_err().to_string();
        assert!(err.contains("max_in_flight"), "{bad}: {err}");
    }
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
    assert_eq!(c.legs.prefill_timeout, Duration::from_millis(250));
    assert_eq!(c.discovery.kv_connector, "nixl");
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
    assert!(!c.health.health_checks);
    assert_eq!(c.health.health_check_interval, Duration::from_millis(250));
    assert_eq!(c.health.consecutive_failures, 0);
    assert_eq!(c.health.error_rate, 0.25);
    assert_eq!(c.legs.max_retries, 2);
    assert_eq!(c.limits.retry_budget_ratio, 0.1);
    assert_eq!((c.limits.max_in_flight, c.limits.max_queue), (8, 0));
    assert_eq!(c.limits.queue_timeout, Duration::from_secs(1));
    assert_eq!(c.limits.max_in_flight_per_endpoint, 3);
    assert_eq!(c.shutdown.drain_delay, Duration::ZERO);
    assert_eq!(c.shutdown.shutdown_timeout, Duration::from_secs(9));
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

#[test]
fn a_bootstrap_port_from_flags_reaches_prefills_without_their_own() {
    let cli = Cli::parse_from([
        "pdgate",
        "--prefill",
        "http://10.0.0.1:8000",
        "--decode",
        "http://10.0.0.2:8000",
        "--kv-connector",
        "mooncake",
        "--bootstrap-port",
        "8999",
    ]);
    let c = cli.run.load().unwrap();
    assert_eq!(c.discovery.bootstrap_port, Some(8999));
    let pods = c.pods().unwrap();
    assert_eq!(pods[0].mooncake_bootstrap_port(), 8999);
    assert_eq!(pods[0].sglang_bootstrap_port(), 8999);
}
