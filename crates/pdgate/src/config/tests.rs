//! Tests of the configuration type: parsing, validation, conversions.

use super::*;

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
    assert_eq!(cfg.prefill_timeout, Duration::from_secs(2));
    assert_eq!(cfg.decode_timeout, Duration::from_secs(10));
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
    bad.kv_connector = "nope".into();
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
    b.max_in_flight = 1;
    b.prefill_timeout = Duration::from_secs(1);
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
