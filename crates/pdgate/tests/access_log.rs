//! The access log: one JSON line per finished request (target `pdgate::access`), with the
//! fields operators filter on, for a success, a client error and a client that left.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;
use pdsim::{Connector, Role};
use serde_json::{Value, json};

impl Captured {
    fn access_lines(&self) -> Vec<Value> {
        self.json_lines()
            .into_iter()
            .filter(|v| v["target"] == "pdgate::access")
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_finished_request_writes_one_access_line() {
    let captured = Captured::default();
    let writer = captured.clone();
    // The only test in this binary: the global subscriber sees every runtime thread.
    tracing_subscriber::fmt()
        .json()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::INFO)
        .init();
    // Tokens 5 ms apart: the long stream below lasts 2.5 s, so the client always leaves in
    // the middle of it (with zero delays a loaded machine could relay all of it first).
    let mut decode = sim(Role::Decode, Connector::Shfs);
    decode.latency.itl = Duration::from_millis(5);
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![decode],
        |_| {},
    )
    .await;
    let ok = fleet
        .http
        .post(fleet.url("/v1/completions"))
        .header("x-request-id", "req-ok-1")
        .json(&completion(false))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let _ = ok.bytes().await.unwrap();
    let bad = fleet
        .http
        .post(fleet.url("/v1/completions"))
        .header("x-request-id", "req-bad-1")
        .json(&json!({"model": MODEL, "prompt": "x", "max_tokens": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // A client that leaves in the middle of a stream.
    let long = json!({"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": true});
    let left = fleet
        .http
        .post(fleet.url("/v1/completions"))
        .header("x-request-id", "req-left-1")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(left.status(), 200);
    drop(left);
    let mut lines = Vec::new();
    for _ in 0..200 {
        lines = captured.access_lines();
        if lines.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let by_id = |id: &str| {
        let found: Vec<&Value> = lines
            .iter()
            .filter(|l| l["fields"]["request_id"] == id)
            .collect();
        assert_eq!(found.len(), 1, "one line for {id}: {lines:?}");
        found[0]["fields"].clone()
    };
    let ok = by_id("req-ok-1");
    assert_eq!(ok["status"], 200);
    assert_eq!(ok["outcome"], "success");
    assert_eq!(ok["route"], "completions");
    assert_eq!(ok["connector"], "shfs");
    assert_eq!(ok["model"], MODEL);
    assert_eq!(ok["prefill"], fleet.prefill[0].addr().to_string());
    assert_eq!(ok["decode"], fleet.decode[0].addr().to_string());
    assert!(ok["total_ms"].as_f64().unwrap() > 0.0);
    assert!(ok["ttft_ms"].as_f64().unwrap() > 0.0);
    let bad = by_id("req-bad-1");
    assert_eq!(bad["status"], 400);
    assert_eq!(bad["outcome"], "client_error");
    let left = by_id("req-left-1");
    assert_eq!(left["status"], 499);
    assert_eq!(left["outcome"], "cancelled");
}
