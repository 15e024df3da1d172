//! Tests of the configuration type: parsing, validation, conversions.

use super::*;
use std::time::Duration;

#[test]
fn parses_a_full_file_and_names_bad_fields() {
    let cfg = Config::from_toml(
        r#"
        listen = "127.0.0.1:9000"
        kv_connector = "mooncake"
        prefill_timeout = "2s"
        decode_timeout = 10
        [[prefill]]
        url = "http://10.0.0.1:8000"
        bootstrap_port = 9998
        labels = { "model.aibrix.ai/kv-connector-type" = "mooncake", "model.aibrix.ai/name" = "llama" }
        [[decode]]
        url = "http://[fd00::2]:8001"
        model = "llama"
        "#,
    )
    .unwrap();
    assert_eq!(cfg.legs.prefill_timeout, Duration::from_secs(2));
    assert_eq!(cfg.legs.decode_timeout, Duration::from_secs(10));
    let reg = Registry::with_builtins();
    cfg.validate(&reg).unwrap();
    let pods = cfg.pods().unwrap();
    assert_eq!(pods[1].ip.as_deref(), Some("fd00::2"));
    assert_eq!(pods[1].name, "[fd00::2]:8001");
    assert_eq!(pods[1].label("model.aibrix.ai/name"), Some("llama"));
    assert_eq!(pods[0].label("role-name"), Some("prefill"));

    let err = Config::from_toml("prefil = []").unwrap_err().to_string();
    assert!(err.contains("prefil"), "{err}");
    let mut bad = cfg.clone();
    bad.discovery.kv_connector = "nope".into();
    let err = bad.validate(&reg).unwrap_err().to_string();
    assert!(
        err.contains("kv_connector") && err.contains("shfs"),
        "{err}"
    );
    let mut bad = cfg.clone();
    bad.decode[0].url = "10.0.0.3:8000".into();
    let err = bad.validate(&reg).unwrap_err().to_string();
    assert!(err.contains("decode[0].url"), "{err}");
    let err = Config::from_toml("prefill_timeout = \"soon\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefill_timeout"), "{err}");
}

#[test]
fn operations_doc_lists_every_key_with_its_default() {
    let doc = include_str!("../../../../docs/operations.md");
    let defaults = Config::default().to_table();
    for key in flags::KEYS {
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `{}`", key.path())))
            .unwrap_or_else(|| panic!("docs/operations.md has no row for `{}`", key.name));
        let default = flags::default_text(&defaults, &key.path());
        assert!(
            row.contains(&format!("| `{default}`")),
            "docs/operations.md: `{}` should default to `{default}`: {row}",
            key.name
        );
    }
}

#[test]
fn reload_names_the_keys_that_changed() {
    let a = Config::default();
    let mut b = a.clone();
    b.limits.max_in_flight = 1;
    b.legs.prefill_timeout = Duration::from_secs(1);
    b.kubernetes.roleset_pairing = !b.kubernetes.roleset_pairing;
    assert_eq!(
        a.changed_keys(&b),
        ["kubernetes", "max_in_flight", "prefill_timeout"]
    );
    assert!(a.changed_keys(&a).is_empty());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
    assert!(parse_duration("-1").is_err());
    assert!(parse_duration("later").is_err());
}

#[test]
fn an_unknown_connector_label_in_the_file_is_a_start_up_error() {
    let text = "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\nlabels = { \"model.aibrix.ai/kv-connector-type\" = \"moon\" }\n[[decode]]\nurl = \"http://10.0.0.2:8000\"\n";
    let config = Config::from_toml(text).unwrap();
    let err = config
        .validate(&kvtransfer::Registry::with_builtins())
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefill[0].labels"), "{err}");
    assert!(
        err.contains("\"moon\"") && err.contains("mooncake"),
        "{err}"
    );
}

#[test]
fn flat_keys_are_filed_into_their_sections_and_written_back_flat() {
    let text = "prefill_timeout = \"2s\"\nmax_in_flight = 7\noutlier_interval = \"3s\"\ndiscovery = \"static\"\npool_idle_timeout = \"9s\"\n";
    let cfg = Config::from_toml(text).unwrap();
    assert_eq!(cfg.legs.prefill_timeout, Duration::from_secs(2));
    assert_eq!(cfg.limits.max_in_flight, 7);
    assert_eq!(cfg.health.interval, Duration::from_secs(3));
    assert_eq!(cfg.pool.idle_timeout, Duration::from_secs(9));
    let table = cfg.to_table();
    assert_eq!(table["prefill_timeout"].as_str(), Some("2s"));
    assert_eq!(table["max_in_flight"].as_integer(), Some(7));
    assert!(!table.contains_key("legs") && !table.contains_key("limits"));
    // Written back flat, it reads as the same configuration.
    assert_eq!(Config::from_table(table, "<test>").unwrap(), cfg);
    assert_eq!(
        Config::from_table(Config::default().to_table(), "<test>").unwrap(),
        Config::default()
    );
}

#[test]
fn a_section_table_is_accepted_and_a_key_given_twice_is_an_error() {
    let cfg = Config::from_toml("[limits]\nmax_in_flight = 3\n[legs]\nmax_retries = 2\n").unwrap();
    assert_eq!(cfg.limits.max_in_flight, 3);
    assert_eq!(cfg.legs.max_retries, 2);
    let err = Config::from_toml("max_in_flight = 1\n[limits]\nmax_in_flight = 3\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("max_in_flight") && err.contains("twice"),
        "{err}"
    );
    let err = Config::from_toml("[limits]\nmax_inflight = 3\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("max_inflight"), "{err}");
}

#[test]
fn errors_name_the_key_as_the_file_writes_it() {
    for (text, key) in [
        ("prefill_timeout = \"soon\"", "`prefill_timeout`"),
        ("max_in_flight = \"many\"", "`max_in_flight`"),
        ("outlier_error_rate = \"high\"", "`outlier_error_rate`"),
        ("pool_idle_timeout = true", "`pool_idle_timeout`"),
        ("no_such_key = 1", "`no_such_key`"),
    ] {
        let err = Config::from_toml(text).unwrap_err().to_string();
        assert!(err.contains(key), "{text}: {err}");
        for section in ["legs.", "limits.", "health.", "pool."] {
            assert!(!err.contains(&format!("`{section}")), "{text}: {err}");
        }
    }
}

#[test]
fn operations_doc_names_each_top_level_key_in_its_section() {
    let doc = include_str!("../../../../docs/operations.md");
    for key in flags::KEYS.iter().filter(|k| !k.in_table) {
        let line = doc
            .lines()
            .find(|l| l.starts_with(&format!("- `{}`: ", key.section)))
            .unwrap_or_else(|| panic!("docs/operations.md lists no section `{}`", key.section));
        assert!(
            line.contains(&format!("`{}`", key.name)),
            "docs/operations.md: section `{}` should list `{}`",
            key.section,
            key.name
        );
    }
}

#[test]
fn a_data_parallel_size_becomes_the_annotation_and_zero_is_refused() {
    let text = |size: u32| {
        format!(
            "[[prefill]]\nurl = \"http://10.0.0.1:8000\"\ndata_parallel_size = {size}\n\
             [[decode]]\nurl = \"http://10.0.0.2:8000\"\n"
        )
    };
    let config = Config::from_toml(&text(8)).unwrap();
    let pods = config.pods().unwrap();
    assert_eq!(
        pods[0].annotation(crate::endpoints::ranks::DATA_PARALLEL_SIZE_ANNOTATION),
        Some("8")
    );
    for bad in [0, 5000] {
        let config = Config::from_toml(&text(bad)).unwrap();
        let err = config
            .validate(&kvtransfer::Registry::with_builtins())
            .unwrap_err()
            .to_string();
        assert!(err.contains("prefill[0].data_parallel_size"), "{err}");
    }
}
