//! The failure table of the PD flow, disconnects, slow clients and hostile bodies, through real
//! HTTP on loopback against pdsim engines told to fail.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;
use pdgate::config::PrefillFailurePolicy;
use pdsim::{Connector, Faults, LatencyModel, Role};
use serde_json::{Value, json};

fn failing(status: u16) -> Faults {
    Faults {
        error_rate: 1.0,
        error_status: status,
        ..Faults::default()
    }
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let v: Value = r.json().await.expect("JSON error body");
    assert!(v["error"]["message"].is_string(), "{v}");
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_routable_decode_is_a_503_naming_it() {
    let p = pdsim::spawn(sim(Role::Prefill, Connector::Shfs))
        .await
        .unwrap();
    let fleet = start_unready(vec![], vec![], |c| {
        c.prefill.push(endpoint_for(&p, Some(Connector::Shfs)));
    })
    .await;
    fleet.wait_ready(false).await;
    let (status, v) = error_of(fleet.post("/v1/completions", &completion(false)).await).await;
    assert_eq!(status, 503);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("decode"),
        "{v}"
    );
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_4xx_is_relayed_as_is() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    fleet.prefill[0].set_faults(failing(400));
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 400);
    assert!(r.headers().get("x-request-id").is_some());
    assert_eq!(
        fleet.decode[0].stats().requests.completions,
        0,
        "no decode after a client error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_5xx_falls_back_to_decode_alone_by_default() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    fleet.prefill[0].set_faults(failing(503));
    for body in [completion(false), completion(true)] {
        let r = fleet.post("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-pdgate-fallback"], "prefill-failed");
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    let d = fleet.decode[0].stats();
    assert_eq!(d.recomputed, 2, "{d:?}");
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(r#"pdgate_fallbacks_total{connector="shfs"} 2"#),
        "{metrics}"
    );
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_5xx_with_fail_policy_is_relayed() {
    let fleet = pair(Connector::Shfs, |c| {
        c.legs.on_prefill_failure = PrefillFailurePolicy::Fail
    })
    .await;
    fleet.prefill[0].set_faults(failing(500));
    let r = fleet.post("/v1/chat/completions", &chat(false)).await;
    assert_eq!(r.status(), 500);
    assert_eq!(fleet.decode[0].stats().requests.chat_completions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_prefill_is_bounded_by_the_prefill_timeout() {
    let fleet = pair(Connector::Shfs, |c| {
        c.legs.prefill_timeout = Duration::from_millis(300);
        c.legs.on_prefill_failure = PrefillFailurePolicy::Fail;
    })
    .await;
    fleet.prefill[0].set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = fleet
        .post_bounded("/v1/completions", &completion(false))
        .await;
    let (status, v) = error_of(r).await;
    assert_eq!(status, 504, "{v}");
    // The hung prefill saw its connection closed.
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_prefill_falls_back() {
    let d = pdsim::spawn(sim(Role::Decode, Connector::Shfs))
        .await
        .unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    // Not ready (no pair passes its checks): served by fallback all the same.
    let fleet = start_unready(vec![], vec![], |c| {
        c.prefill.push(pdgate::config::EndpointConfig {
            url: dead_url.clone(),
            model: Some(MODEL.into()),
            ..Default::default()
        });
        c.decode.push(endpoint_for(&d, Some(Connector::Shfs)));
    })
    .await;
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-pdgate-fallback"], "prefill-failed");
    assert_eq!(d.stats().recomputed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_errors_pass_through_and_dead_decodes_are_502() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    fleet.decode[0].set_faults(failing(500));
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"].is_object(), "{v}");

    let p = pdsim::spawn(sim(Role::Prefill, Connector::Shfs))
        .await
        .unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let fleet = start_unready(vec![], vec![], |c| {
        c.prefill.push(endpoint_for(&p, Some(Connector::Shfs)));
        c.decode.push(pdgate::config::EndpointConfig {
            url: dead_url.clone(),
            model: Some(MODEL.into()),
            ..Default::default()
        });
    })
    .await;
    let (status, v) = error_of(fleet.post("/v1/completions", &completion(false)).await).await;
    assert_eq!(status, 502, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("decode"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_decode_is_bounded_by_the_decode_timeout() {
    let fleet = pair(Connector::Shfs, |c| {
        c.legs.decode_timeout = Duration::from_millis(300)
    })
    .await;
    fleet.decode[0].set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = fleet
        .post_bounded("/v1/completions", &completion(false))
        .await;
    assert_eq!(error_of(r).await.0, 504);
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dropping_mid_stream_ends_with_an_sse_error_event() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    fleet.decode[0].set_faults(Faults {
        drop_after_chunks: Some(2),
        ..Faults::default()
    });
    let r = fleet.post("/v1/completions", &completion(true)).await;
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap_or_default();
    assert!(!body.contains("[DONE]"), "{body}");
    let last = body.trim_end().rsplit("\n\n").next().unwrap();
    let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).expect(last);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("decode"),
        "{v}"
    );
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_closes_both_legs() {
    let latency = LatencyModel {
        itl: Duration::from_millis(20),
        ..LatencyModel::default()
    };
    let mut p = sim(Role::Prefill, Connector::Mooncake);
    p.latency = latency.clone();
    let mut d = sim(Role::Decode, Connector::Mooncake);
    d.latency = latency;
    let fleet = start(vec![p], vec![d], |_| {}).await;
    let mut body = completion(true);
    body["max_tokens"] = json!(500);
    let mut r = fleet.post("/v1/completions", &body).await;
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    assert!(fleet.gateway_in_flight() > 0);
    drop(r);
    fleet.wait_idle().await;
    let d = fleet.decode[0].stats();
    assert_eq!(d.client_disconnects, 1, "{d:?}");
    assert!(
        d.generation_tokens < 500,
        "decode stopped generating: {d:?}"
    );
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(r#"outcome="cancelled",model="m"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_gets_every_byte() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let mut body = completion(true);
    body["max_tokens"] = json!(300);
    let mut r = fleet.post("/v1/completions", &body).await;
    let mut all = Vec::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        all.extend_from_slice(&chunk);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let text = text_of(std::str::from_utf8(&all).unwrap());
    assert!(!text.is_empty());
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_hostile_bodies_get_clear_400s() {
    let fleet = pair(Connector::Shfs, |c| c.http.max_body_bytes = 64 * 1024).await;
    let cases: &[(&str, &str, u16, Option<&str>)] = &[
        ("/v1/completions", "not json", 400, None),
        ("/v1/completions", "[1,2]", 400, None),
        ("/v1/completions", "", 400, None),
        (
            "/v1/completions",
            r#"{"model":"m","prompt":"a","prompt":"b"}"#,
            400,
            None,
        ),
        (
            "/v1/completions",
            r#"{"model":"m","prompt":["a","b"]}"#,
            400,
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"m","messages":[],"n":3}"#,
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"m","messages":[],"stream":"yes"}"#,
            400,
            Some("stream"),
        ),
        (
            "/v1/completions",
            r#"{"model":["m"],"prompt":"a"}"#,
            400,
            Some("model"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, v) = error_of(fleet.post_raw(path, body.to_string()).await).await;
        assert_eq!(got, *status, "{body}: {v}");
        assert_eq!(v["error"]["code"], *status as u64);
        if let Some(param) = param {
            assert_eq!(v["error"]["param"], *param, "{body}: {v}");
        }
    }
    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(100 * 1024));
    let (got, _) = error_of(fleet.post_raw("/v1/completions", big).await).await;
    assert_eq!(got, 413);
    // None of it reached an engine (neither the prefill nor the decode, on any route); the
    // fleet still serves.
    for engine in fleet.prefill.iter().chain(fleet.decode.iter()) {
        let s = engine.stats();
        assert_eq!(
            s.requests.completions + s.requests.chat_completions,
            0,
            "{}: {:?}",
            s.role,
            s.requests
        );
    }
    assert_eq!(
        fleet
            .post("/v1/completions", &completion(false))
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_concurrent_prefill_cancels_the_decode_and_fails_fast() {
    // A decode that would wait 30 s for KV that never comes.
    let mut d = sim(Role::Decode, Connector::Mooncake);
    d.handoff_timeout = Duration::from_secs(30);
    // Without the decode-alone fallback (which serves these requests: `faults.rs`).
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Mooncake)],
        vec![d],
        |c| c.legs.on_prefill_failure = PrefillFailurePolicy::Fail,
    )
    .await;
    fleet.prefill[0].set_faults(failing(500));
    for stream in [false, true] {
        let answer = async {
            let r = fleet.post("/v1/completions", &completion(stream)).await;
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        };
        let (status, body) = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("failed fast, not after the decode's 30 s handoff wait");
        if status == 200 {
            // A streaming decode sends its head before it waits for KV (as vLLM does): the
            // failure then arrives as the stream's last event, and no [DONE].
            assert!(stream, "{body}");
            assert!(!body.contains("[DONE]"), "{body}");
            let last = body.trim_end().rsplit("\n\n").next().unwrap();
            let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).expect(last);
            assert!(
                v["error"]["message"].as_str().unwrap().contains("prefill"),
                "{v}"
            );
        } else {
            assert_eq!(status, 500, "{body}");
        }
    }
    fleet.wait_idle().await;
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_v1_routes_pass_through_to_a_decode() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let r = fleet
        .http
        .get(fleet.url("/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = fleet
        .http
        .post(fleet.url("/v1/embeddings"))
        .json(&json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("target-pod").is_some());
    let r = fleet.http.get(fleet.url("/nope")).send().await.unwrap();
    assert_eq!(error_of(r).await.0, 404);
}
