//! A `pdsim fleet` and the pdgate configuration it writes: the file loads and routes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::time::Duration;

use pdgate::{Gateway, RunArgs, RunningGateway};
use pdsim::Connector;
use pdsim::fleet::FleetSpec;
use serde_json::json;
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_a_fleet_writes_loads_and_routes_through_every_engine_kind() {
    let mut spec = FleetSpec::new(2, 2, Connector::Shfs);
    spec.prefill_profile = pdsim::Profile::named("llama-3.1-8b-h100");
    spec.decode_profile = spec.prefill_profile.clone();
    spec.time_scale = 10.0;
    spec.kv_events = true;
    let fleet = pdsim::fleet::start(&spec).await.unwrap();
    let dir = std::env::temp_dir().join(format!("pdgate-sim-fleet-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("pdgate.toml");
    std::fs::write(&file, fleet.gateway_toml()).unwrap();
    let args = RunArgs {
        config: Some(file),
        ..RunArgs::default()
    };
    let gw = Gateway::new(
        args.load().expect("the written config loads"),
        kvtransfer::Registry::with_builtins(),
    )
    .expect("and validates");
    let pods = gw.config.pods().unwrap();
    assert_eq!(pods.len(), 4);
    for p in &pods {
        assert!(
            p.annotations
                .get("pdgate.io/kv-events")
                .is_some_and(|e| e.starts_with("tcp://127.0.0.1:")),
            "{p:?}"
        );
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let running = RunningGateway::start(gw, listener, pods).await.unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = format!("{}/v1/completions", running.base_url());
    for i in 0..8 {
        let r = http
            .post(&url)
            .json(&json!({"model": "pdsim", "prompt": format!("request {i} through the fleet"), "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let pulled: u64 = fleet
        .decode
        .iter()
        .map(|d| d.stats().transfers_pulled)
        .sum();
    assert_eq!(
        pulled, 8,
        "every request's KV went from a prefill to a decode"
    );
    for e in &fleet.prefill {
        assert_eq!(e.stats().responses_ok, 4, "{}: round robin", e.engine_id());
    }
    running.shutdown(Duration::from_secs(5)).await;
    fleet.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
