//! `/v1/responses` and `/v1/messages` through PD: the prefill leg bounded by the route's own
//! output field, the decode leg loading the prefill's KV, the client's answer the same as one
//! engine's; connectors that cannot hand these routes over send them to a decode alone; the
//! pass-through routes still pass.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use common::*;
use pdsim::{Connector, Role};
use serde_json::{Value, json};

fn responses(stream: bool) -> Value {
    json!({"model": MODEL, "instructions": "Answer briefly", "input": "Tell me a story about a fox",
           "max_output_tokens": 9, "stream": stream, "stop": ["never"]})
}

fn messages(stream: bool) -> Value {
    json!({"model": MODEL, "system": "Answer briefly",
           "messages": [{"role": "user", "content": "Tell me a story about a fox"}],
           "max_tokens": 9, "stream": stream, "stop_sequences": ["never"]})
}

/// The generated text of a Responses or Messages answer, JSON or SSE (named events).
fn api_text(body: &str) -> String {
    if !body.starts_with("event:") {
        let v: Value = serde_json::from_str(body).expect("json body");
        return v["output"][0]["content"][0]["text"]
            .as_str()
            .or_else(|| v["content"][0]["text"].as_str())
            .unwrap_or_else(|| panic!("no text in {body}"))
            .to_string();
    }
    let mut out = String::new();
    let mut ended = false;
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let (name, data) = event.split_once('\n').expect("event and data lines");
        let v: Value = serde_json::from_str(data.strip_prefix("data: ").expect("data")).unwrap();
        match name.strip_prefix("event: ").expect("event name") {
            "response.output_text.delta" => out.push_str(v["delta"].as_str().unwrap()),
            "content_block_delta" => out.push_str(v["delta"]["text"].as_str().unwrap()),
            "response.completed" | "message_stop" => ended = true,
            "error" => panic!("error event: {data}"),
            _ => {}
        }
    }
    assert!(ended, "stream without its last event: {body}");
    out
}

async fn one_engine_text(path: &str, body: &Value) -> String {
    api_text(&one_engine_answer(path, body).await)
}

fn body_of(recent: &pdsim::stats::RecentRequest) -> Value {
    serde_json::from_str(&recent.body).unwrap()
}

async fn through_pd(connector: Connector) {
    let fleet = pair(connector, |_| {}).await;
    let cases = [
        ("/v1/responses", responses(false)),
        ("/v1/responses", responses(true)),
        ("/v1/messages", messages(false)),
        ("/v1/messages", messages(true)),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let r = fleet.post_bounded(path, body).await;
        assert_eq!(r.status(), 200, "{connector:?} {path} {body}");
        let h = r.headers().clone();
        assert_eq!(h["x-pdgate-connector"], connector.as_str());
        assert_eq!(h["prefill-target-pod"], fleet.prefill[0].addr().to_string());
        assert!(h.get("x-pdgate-decode-only").is_none());
        assert!(h.get("x-pdgate-fallback").is_none());
        let text = api_text(&r.text().await.unwrap());
        assert!(!text.is_empty());
        assert_eq!(
            text,
            one_engine_text(path, body).await,
            "{connector:?} {path}"
        );
        let p = fleet.prefill[0].stats();
        let leg = body_of(p.recent_requests.last().unwrap());
        assert_eq!(p.recent_requests.last().unwrap().path, *path);
        assert_eq!(leg["stream"], false, "{leg}");
        if *path == "/v1/responses" {
            assert_eq!(leg["max_output_tokens"], 1, "{leg}");
            assert_eq!(leg["store"], false, "{leg}");
            assert!(leg.get("stop").is_none(), "{leg}");
        } else {
            assert_eq!(leg["max_tokens"], 1, "{leg}");
            assert!(leg.get("stop_sequences").is_none(), "{leg}");
        }
        // One token per prefill: the route's own bound was honoured.
        assert_eq!(p.generation_tokens, (i + 1) as u64, "{connector:?} {path}");
        let d = fleet.decode[0].stats();
        let leg = body_of(d.recent_requests.last().unwrap());
        assert_eq!(leg["stream"], body["stream"], "{leg}");
        let bound = if *path == "/v1/responses" {
            "max_output_tokens"
        } else {
            "max_tokens"
        };
        assert_eq!(leg[bound], 9, "{leg}");
        assert!(leg.get("kv_transfer_params").is_some(), "{leg}");
    }
    let d = fleet.decode[0].stats();
    assert_eq!(
        d.recomputed, 0,
        "{connector:?}: the decode recomputed instead of loading KV"
    );
    assert_eq!(d.transfers_failed, 0, "{connector:?}");
    assert_eq!(
        d.transfers_pulled,
        cases.len() as u64,
        "{connector:?}: {d:?}"
    );
    assert_eq!(d.requests.responses, 2);
    assert_eq!(d.requests.messages, 2);
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shfs_runs_responses_and_messages_through_pd() {
    through_pd(Connector::Shfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_runs_responses_and_messages_through_pd() {
    through_pd(Connector::Mooncake).await;
}

/// The engine fails a handoff the gateway got wrong: a decode leg whose transfer parameters
/// do not come from a prefill is refused, on these routes as on chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdsim_fails_a_wrong_handoff_on_both_routes() {
    let decode = pdsim::spawn(sim(Role::Decode, Connector::Shfs))
        .await
        .expect("engine");
    let http = reqwest::Client::new();
    for (path, mut body) in [
        ("/v1/responses", responses(false)),
        ("/v1/messages", messages(false)),
    ] {
        body["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_block_ids": [[1]]});
        let r = http
            .post(format!("{}{}", decode.base_url(), path))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(!r.status().is_success(), "{path}: {}", r.status());
    }
    assert_eq!(decode.stats().transfers_pulled, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connectors_without_a_handoff_on_these_routes_send_them_to_the_decode_alone() {
    for connector in [Connector::Sglang, Connector::Nixl] {
        let fleet = pair(connector, |_| {}).await;
        for (path, body) in [
            ("/v1/responses", responses(true)),
            ("/v1/messages", messages(false)),
        ] {
            let r = fleet.post_bounded(path, &body).await;
            assert_eq!(r.status(), 200, "{connector:?} {path}");
            assert_eq!(r.headers()["x-pdgate-decode-only"], "route");
            assert!(r.headers().get("prefill-target-pod").is_none());
            assert!(!api_text(&r.text().await.unwrap()).is_empty());
            let leg = body_of(fleet.decode[0].stats().recent_requests.last().unwrap());
            assert!(leg.get("kv_transfer_params").is_none(), "{leg}");
        }
        let p = fleet.prefill[0].stats();
        assert_eq!(
            p.requests.responses + p.requests.messages,
            0,
            "{connector:?}"
        );
        fleet.wait_idle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_bound_to_stored_state_goes_to_the_decode_alone() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let mut body = responses(false);
    body["previous_response_id"] = json!("resp_0123");
    let r = fleet.post_bounded("/v1/responses", &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-pdgate-decode-only"], "route");
    assert_eq!(fleet.prefill[0].stats().requests.responses, 0);
    // Null means absent: this one runs through PD.
    body["previous_response_id"] = Value::Null;
    let r = fleet.post_bounded("/v1/responses", &body).await;
    assert!(r.headers().get("x-pdgate-decode-only").is_none());
    assert_eq!(fleet.prefill[0].stats().requests.responses, 1);
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_still_passes_through_to_a_decode() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let r = fleet
        .post("/tokenize", &json!({"model": MODEL, "prompt": "a b c"}))
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["tokens"].as_array().is_some_and(|t| !t.is_empty()), "{v}");
    fleet.wait_idle().await;
}
