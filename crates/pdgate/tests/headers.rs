//! What reaches the engines besides the body: W3C trace context and credentials on both legs,
//! one request id on both legs, nothing hop-by-hop or client-forged.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use pdgate::config::{Config, EndpointConfig};
use pdgate::{Gateway, RunningGateway};
use serde_json::{Value, json};
use tokio::net::TcpListener;

type Seen = Arc<Mutex<Vec<(HeaderMap, Value)>>>;

/// A recording engine: answers a prefill leg with shfs parameters and anything else with text.
async fn engine(State(seen): State<Seen>, headers: HeaderMap, body: String) -> axum::Json<Value> {
    let body: Value = serde_json::from_str(&body).unwrap();
    let prefill = body["kv_transfer_params"]["do_remote_decode"] == json!(true);
    seen.lock().unwrap().push((headers, body));
    if prefill {
        axum::Json(
            json!({"id": "cmpl-x", "choices": [{"text": "a"}], "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1]],
            "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "localhost", "remote_port": 1}}),
        )
    } else {
        axum::Json(json!({"id": "cmpl-y", "choices": [{"text": "hello"}]}))
    }
}

async fn spawn_engine(seen: Seen) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route("/v1/completions", post(engine))
        .with_state(seen);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_credentials_and_request_id_reach_both_legs() {
    let prefill_seen = Seen::default();
    let decode_seen = Seen::default();
    let (p_url, p_task) = spawn_engine(prefill_seen.clone()).await;
    let (d_url, d_task) = spawn_engine(decode_seen.clone()).await;
    let config = Config {
        prefill: vec![EndpointConfig {
            url: p_url,
            ..Default::default()
        }],
        decode: vec![EndpointConfig {
            url: d_url,
            ..Default::default()
        }],
        ..Config::default()
    };
    let gw = Gateway::new(config, kvtransfer::Registry::with_builtins()).unwrap();
    let pods = gw.config.pods().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let running = RunningGateway::start(gw, listener, pods).await.unwrap();

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", running.base_url()))
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=1")
        .header("authorization", "Bearer engine-key")
        .header("x-data-parallel-rank", "3")
        .header("x-request-id", "client-chosen-id")
        .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "client-chosen-id");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["choices"][0]["text"], "hello");

    for (leg, seen) in [("prefill", &prefill_seen), ("decode", &decode_seen)] {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1, "{leg}");
        let (h, _) = &seen[0];
        assert_eq!(h["traceparent"], traceparent, "{leg}");
        assert_eq!(h["tracestate"], "vendor=1", "{leg}");
        assert_eq!(h["authorization"], "Bearer engine-key", "{leg}");
        assert_eq!(h["x-request-id"], "client-chosen-id", "{leg}");
        assert!(
            h.get("x-data-parallel-rank").is_none(),
            "{leg}: client-forged header forwarded"
        );
    }
    // The decode got the prefill's parameters with the pod IP as remote_host.
    let decode_body = &decode_seen.lock().unwrap()[0].1;
    assert_eq!(
        decode_body["kv_transfer_params"]["remote_host"],
        "127.0.0.1"
    );
    assert_eq!(decode_body["max_tokens"], 4);
    p_task.abort();
    d_task.abort();
}
