//! `/ready`: 503 until a health round has found, for every model, a prefill/decode pair that
//! passed its checks; back to 503 (with the reason) when none is left.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;
use pdsim::{Connector, Role};
use serde_json::Value;

async fn ready(fleet: &Fleet) -> (u16, Value) {
    let r = fleet.http.get(fleet.url("/ready")).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A shfs pair checked every 100 ms; `unreachable`: its URLs name closed ports.
async fn checked_pair(unreachable: bool) -> Fleet {
    start_unready(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            c.health.health_check_interval = Duration::from_millis(100);
            c.health.health_check_timeout = Duration::from_millis(200);
            if unreachable {
                for ep in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
                    ep.url = format!("http://127.0.0.1:{}", closed_port());
                }
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_engines_are_not_ready_from_the_first_check() {
    let fleet = checked_pair(true).await;
    // Not ready at any point, although the failures are below the unhealthy threshold (3) for
    // the first checks.
    for _ in 0..10 {
        let (status, body) = ready(&fleet).await;
        assert_eq!(status, 503, "{body}");
        assert!(body["reason"].as_str().unwrap().contains(MODEL), "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_once_checks_pass_and_not_when_the_last_decode_goes() {
    let fleet = checked_pair(false).await;
    fleet.wait_ready(true).await;
    let (_, body) = ready(&fleet).await;
    assert!(body["reason"].is_null(), "{body}");
    // The decode stops answering its health checks: the next failed check takes readiness away.
    fleet.decode[0].set_faults(pdsim::Faults {
        dead: true,
        ..pdsim::Faults::default()
    });
    fleet.wait_ready(false).await;
    let (_, body) = ready(&fleet).await;
    assert!(body["reason"].as_str().unwrap().contains(MODEL), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_model_configured_v1_models_lists_what_the_engines_serve() {
    let fleet = start_unready(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            c.health.health_check_interval = Duration::from_millis(100);
            c.models.clear();
            for ep in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
                ep.model = None;
            }
        },
    )
    .await;
    fleet.wait_ready(true).await;
    let mut ids = Vec::new();
    for _ in 0..100 {
        let v: Value = fleet
            .http
            .get(fleet.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ids = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect();
        if !ids.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ids, [MODEL], "learned from the engines' /v1/models");
    // And requests for it are served.
    let r = fleet
        .post_bounded("/v1/completions", &completion(false))
        .await;
    assert_eq!(r.status(), 200);
}
