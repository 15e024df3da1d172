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
    let mut keys: Vec<String> = Config::default().to_table().keys().cloned().collect();
    keys.retain(|k| !["prefill", "decode", "models"].contains(&k.as_str()));
    keys.sort();
    let mut flagged: Vec<String> = KEYS.iter().map(|k| k.name.to_string()).collect();
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
    ]);
    let c = cli.run.load().unwrap();
    assert_eq!(c.cache.block_size, 32);
    assert_eq!(c.cache.decode_only_below_tokens, 128);
    assert_eq!(c.cache.approximate_ttl, Duration::from_secs(30));
    assert_eq!(c.cache.load_weight, 64.0);
    let cli = Cli::parse_from(["pdgate", "--set", "cache.block_sise=3"]);
    assert!(cli.run.load().is_err());
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
    assert_eq!(c.max_in_flight, 0, "--set is applied after the flags");
    assert_eq!(c.pool_idle_timeout, Duration::from_secs(2));
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
