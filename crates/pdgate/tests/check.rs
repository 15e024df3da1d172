//! `pdgate check` against pdsim engines on loopback: a healthy mixed fleet passes with every
//! endpoint checked; a decode that ignores the KV, and a prefill whose side channel is advertised
//! on the wrong port, are caught although their answers look right.

mod common;

use std::time::Duration;

use common::{engines as fleet, sim};
use pdgate::check::{CheckOptions, CheckReport, Kv};
use pdgate::config::Config;
use pdsim::{Connector, Faults, Role};

fn options() -> CheckOptions {
    CheckOptions {
        timeout: Duration::from_secs(20),
        ..CheckOptions::default()
    }
}

async fn check(config: Config) -> CheckReport {
    let pods = config.pods().expect("pods");
    let options = options();
    let run = pdgate::check::run(
        config,
        kvtransfer::Registry::with_builtins(),
        pods,
        &options,
    );
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the check ends")
        .expect("the configuration makes a gateway")
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_mixed_fleet_passes_with_every_endpoint_checked() {
    let (config, prefills, decodes) = fleet(
        vec![
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Mooncake),
        ],
        vec![
            sim(Role::Decode, Connector::Shfs),
            sim(Role::Decode, Connector::Mooncake),
        ],
    )
    .await;
    let report = check(config).await;
    println!("{}", report.render());
    assert!(report.ok(), "{}", report.render());
    // Both shfs prefills with the shfs decode, the mooncake prefill with the mooncake decode.
    assert_eq!(report.pairs.len(), 3, "{}", report.render());
    assert!(report.unpaired.is_empty());
    for pair in &report.pairs {
        assert_eq!(pair.status, 200);
        assert_eq!(pair.kv, Kv::Received, "{}", pair.evidence);
        assert_eq!(pair.matches_decode_only, Some(true));
        assert!(pair.prefill_ms.is_some(), "the prefill leg is timed");
    }
    let connectors: Vec<&str> = report.pairs.iter().map(|p| p.connector.as_str()).collect();
    assert_eq!(connectors, ["shfs", "shfs", "mooncake"]);
    // The engines agree: each decode pulled one KV per canary and recomputed only the
    // decode-only baselines (one per pair).
    assert_eq!(decodes[0].stats().transfers_pulled, 2);
    assert_eq!(decodes[0].stats().recomputed, 2);
    assert_eq!(decodes[1].stats().transfers_pulled, 1);
    for p in &prefills {
        assert_eq!(
            p.stats().transfers_served,
            1,
            "every prefill served its canary's KV"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_ignores_the_kv_is_caught() {
    let (config, _p, decodes) = fleet(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
    )
    .await;
    decodes[0].set_faults(Faults {
        ignore_kv: true,
        ..Faults::default()
    });
    let report = check(config).await;
    println!("{}", report.render());
    assert!(!report.ok());
    let pair = &report.pairs[0];
    // The answer is right: only the counters show that nothing moved.
    assert_eq!(pair.status, 200);
    assert_eq!(pair.matches_decode_only, Some(true));
    assert_eq!(pair.kv, Kv::Recomputed, "{}", pair.evidence);
    assert!(
        pair.problem
            .as_deref()
            .is_some_and(|p| p.contains("recomputed"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_side_channel_advertised_on_the_wrong_port_is_caught() {
    let (config, prefills, decodes) = fleet(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
    )
    .await;
    prefills[0].set_faults(Faults {
        advertise_side_channel_port: Some(closed_port()),
        ..Faults::default()
    });
    // A decode that recovers from the failed load by computing the prompt (vLLM's
    // kv_load_failure_policy "recompute") answers 200: caught by its counters.
    decodes[0].set_faults(Faults {
        recompute_on_kv_failure: true,
        ..Faults::default()
    });
    let report = check(config.clone()).await;
    println!("{}", report.render());
    assert!(!report.ok());
    assert_eq!(report.pairs[0].status, 200);
    assert_eq!(
        report.pairs[0].kv,
        Kv::Failed,
        "{}",
        report.pairs[0].evidence
    );
    assert_eq!(report.pairs[0].matches_decode_only, Some(true));

    // A decode that fails the request instead: caught by the answer.
    decodes[0].set_faults(Faults::default());
    let report = check(config).await;
    println!("{}", report.render());
    assert!(!report.ok());
    assert!(report.pairs[0].status >= 500, "{}", report.render());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_exits_non_zero_on_a_pair_that_recomputes() {
    let (config, _p, decodes) = fleet(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
    )
    .await;
    let args = [
        "check".to_string(),
        "--prefill".into(),
        config.prefill[0].url.clone(),
        "--decode".into(),
        config.decode[0].url.clone(),
        "--kv-connector".into(),
        "shfs".into(),
        "--timeout".into(),
        "20s".into(),
        "--json".into(),
    ];
    let run = |args: [String; 10]| async move {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pdgate"))
            .args(args)
            .kill_on_drop(true)
            .output();
        tokio::time::timeout(Duration::from_secs(120), out)
            .await
            .expect("pdgate check ends")
            .expect("pdgate runs")
    };
    let healthy = run(args.clone()).await;
    let stdout = String::from_utf8_lossy(&healthy.stdout);
    assert_eq!(healthy.status.code(), Some(0), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(report["pairs"][0]["kv"], "received", "{stdout}");

    decodes[0].set_faults(Faults {
        ignore_kv: true,
        ..Faults::default()
    });
    let broken = run(args).await;
    let stdout = String::from_utf8_lossy(&broken.stdout);
    assert_eq!(broken.status.code(), Some(1), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(report["pairs"][0]["kv"], "recomputed", "{stdout}");
}
