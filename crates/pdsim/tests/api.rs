//! The vLLM-like HTTP surface, faults and stats, over real loopback HTTP.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdsim::{Connector, Faults, LatencyModel, Role};
use serde_json::{Value, json};

#[tokio::test]
async fn completion_shape_usage_and_request_id() {
    let e = engine(Role::Both, Connector::None).await;
    let (s, rid, v) = post_h(
        completions(&e),
        &json!({"model":"pdsim","prompt":"one two three","max_tokens":4}),
        &[("X-Request-Id", "req-42")],
    )
    .await;
    assert_eq!(s, 200);
    // vLLM does not echo X-Request-Id: the id is only in the body.
    assert_eq!(rid, None);
    assert_eq!(v["id"], "cmpl-req-42");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "pdsim");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 8);
    assert!(v["kv_transfer_params"].is_null());
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 4);
    // Deterministic: the same prompt gives the same text on another engine.
    let other = engine(Role::Decode, Connector::Shfs).await;
    let (_, _, v2) = post(
        completions(&other),
        &json!({"prompt":"one two three","max_tokens":4}),
    )
    .await;
    assert_eq!(v2["choices"][0]["text"], text);
    // Without a header vLLM 0.32 generates `cmpl-<16 hex>`.
    let (_, rid, v3) = post(completions(&e), &json!({"prompt":"x"})).await;
    assert_eq!(rid, None);
    let id = v3["id"].as_str().unwrap().strip_prefix("cmpl-").unwrap();
    assert_eq!(id.len(), 16, "{id}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    assert!(v3["service_tier"].is_null() && v3.get("service_tier").is_some());
    assert!(v3.get("system_fingerprint").is_some());
    e.shutdown().await;
    other.shutdown().await;
}

#[tokio::test]
async fn chat_stream_with_usage_and_done() {
    let e = engine(Role::Both, Connector::None).await;
    let (s, ev) = post_sse(chat(&e),
        &json!({"messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    let fin: Vec<&Value> = chunks
        .iter()
        .filter(|c| {
            !c["choices"][0]["finish_reason"].is_null()
                && c["choices"].as_array().is_some_and(|a| !a.is_empty())
        })
        .collect();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0]["choices"][0]["finish_reason"], "length");
    assert!(fin[0].get("kv_transfer_params").is_some());
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert!(chunks.iter().all(|c| c["id"] == id));
    // Non-streaming chat.
    let (s, _, v) = post(
        chat(&e),
        &json!({"messages":[{"role":"user","content":"hello there"}],"max_completion_tokens":3}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    e.shutdown().await;
}

#[tokio::test]
async fn vllm_validation_errors() {
    let e = engine(Role::Both, Connector::None).await;
    let url = completions(&e);
    let (s, _, v) = post(
        &url,
        &json!({"prompt":"x","stream":false,"stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(
        v,
        json!({"error":{"message":"Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "type":"BadRequestError","param":"stream_options","code":400}})
    );
    let (s, _, v) = post(
        &url,
        &json!({"prompt":"x","stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    let (s, _, v) = post(&url, &json!({"prompt":"x","max_tokens":1,"min_tokens":5})).await;
    assert_eq!(s, 400);
    assert_eq!(
        error_of(&v, 400)["message"],
        "min_tokens must be less than or equal to max_tokens=1, got 5."
    );
    let (s, _, v) = post(&url, &json!({"model":"nope","prompt":"x"})).await;
    assert_eq!(s, 404);
    assert_eq!(
        v,
        json!({"error":{"message":"The model `nope` does not exist. Valid aliases: pdsim.",
            "type":"NotFoundError","param":"model","code":404}})
    );
    // Prompt plus max_tokens above the context window.
    let (s, _, v) = post(&url, &json!({"prompt":"x y","max_tokens":32767})).await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&v, 400)["param"], "input_tokens");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .ends_with("(parameter=input_tokens, value=3)"),
        "{v}"
    );
    let (s, _, v) = post(chat(&e), &json!({"model":"pdsim"})).await;
    assert_eq!(s, 400);
    error_of(&v, 400);
    let r = client().post(&url).body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(e.stats().responses_error, 7);
    e.shutdown().await;
}

#[tokio::test]
async fn stop_strings_finish_with_stop() {
    let e = engine(Role::Both, Connector::None).await;
    let (_, _, v) = post(completions(&e), &json!({"prompt":"a b","max_tokens":8})).await;
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let third = text.split_whitespace().nth(2).unwrap().to_owned();
    let (_, _, v) = post(
        completions(&e),
        &json!({"prompt":"a b","max_tokens":8,"stop":[third.clone()]}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], third.as_str());
    let words = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(words <= 2, "{v}");
    e.shutdown().await;
}

#[tokio::test]
async fn models_health_metrics_and_faults_endpoint() {
    let e = engine(Role::Prefill, Connector::Shfs).await;
    let base = e.base_url();
    let m = get_json(&format!("{base}/v1/models")).await;
    assert_eq!(m["data"][0]["id"], "pdsim");
    let c = client();
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = c
        .post(format!("{base}/sim/faults"))
        .json(&json!({"dead":true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    let f = get_json(&format!("{base}/sim/faults")).await;
    assert_eq!(f["dead"], true);
    let r = c
        .post(format!("{base}/sim/faults"))
        .json(&json!({"nope":1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    e.set_faults(Faults::default());
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let _ = post(completions(&e), &json!({"prompt":"x"})).await;
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("vllm:num_requests_running{model_name=\"pdsim\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("vllm:generation_tokens_total{model_name=\"pdsim\"} 16"),
        "{text}"
    );
    let s = e.stats();
    assert_eq!(s.requests.health, 3);
    assert_eq!(s.requests.metrics, 1);
    assert_eq!(s.requests.models, 1);
    e.shutdown().await;
}

#[tokio::test]
async fn injected_error_status() {
    let e = engine(Role::Decode, Connector::Shfs).await;
    e.set_faults(Faults {
        error_rate: 1.0,
        error_status: 503,
        ..Faults::default()
    });
    let (s, _, v) = post(completions(&e), &json!({"prompt":"x"})).await;
    assert_eq!(s, 503);
    error_of(&v, 503);
    assert_eq!(e.stats().faults_injected, 1);
    e.shutdown().await;
}

#[tokio::test]
async fn hang_until_client_leaves_counts_disconnect() {
    let e = engine(Role::Decode, Connector::Shfs).await;
    e.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
        .post(completions(&e))
        .json(&json!({"prompt":"x"}))
        .send()
        .await;
    assert!(r.is_err());
    let s = wait_stats(&e, |s| s.client_disconnects == 1 && s.in_flight == 0).await;
    assert_eq!(s.responses_ok, 0);
    e.shutdown().await;
}

#[tokio::test]
async fn client_leaving_mid_stream_stops_generation() {
    let e = engine_with(Role::Decode, Connector::Shfs, |c| {
        c.latency = LatencyModel {
            itl: Duration::from_millis(20),
            ..LatencyModel::default()
        };
    })
    .await;
    let mut r = client()
        .post(completions(&e))
        .json(&json!({"prompt":"x","max_tokens":2000,"stream":true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(r);
    let s = wait_stats(&e, |s| s.client_disconnects == 1 && s.in_flight == 0).await;
    assert_eq!(
        s.generation_tokens, 0,
        "generation stopped before finishing"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn drop_connection_after_chunks() {
    let e = engine(Role::Both, Connector::None).await;
    e.set_faults(Faults {
        drop_after_chunks: Some(2),
        ..Faults::default()
    });
    let r = client()
        .post(completions(&e))
        .json(&json!({"prompt":"x","max_tokens":10,"stream":true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await;
    match body {
        Err(_) => {}
        Ok(t) => panic!("stream should break, got {t:?}"),
    }
    // Non-streaming bodies are cut too (before or after the head reaches the client).
    let r = client()
        .post(completions(&e))
        .json(&json!({"prompt":"x"}))
        .send()
        .await;
    if let Ok(r) = r {
        assert!(r.text().await.is_err());
    }
    assert_eq!(e.stats().faults_injected, 2);
    e.shutdown().await;
}

#[tokio::test]
async fn first_byte_delay_still_answers() {
    let e = engine(Role::Both, Connector::None).await;
    e.set_faults(Faults {
        first_byte_delay_ms: 50,
        ..Faults::default()
    });
    let (s, _, _) = post(completions(&e), &json!({"prompt":"x"})).await;
    assert_eq!(s, 200);
    assert_eq!(e.stats().faults_injected, 1);
    e.shutdown().await;
}

#[tokio::test]
async fn stats_ring_records_bodies_and_headers() {
    let e = engine(Role::Prefill, Connector::Mooncake).await;
    let body = json!({"prompt":"ring","max_tokens":1});
    let _ = post_h(
        completions(&e),
        &body,
        &[("x-request-id", "r-1"), ("X-data-parallel-rank", "0")],
    )
    .await;
    let s: pdsim::SimStats =
        serde_json::from_value(get_json(&format!("{}/sim/stats", e.base_url())).await).unwrap();
    assert_eq!(s.requests.completions, 1);
    let last = s.recent_requests.last().unwrap();
    assert_eq!(last.path, "/v1/completions");
    assert_eq!(last.request_id.as_deref(), Some("r-1"));
    assert_eq!(last.data_parallel_rank.as_deref(), Some("0"));
    assert_eq!(serde_json::from_str::<Value>(&last.body).unwrap(), body);
    for i in 0..40 {
        let _ = post(completions(&e), &json!({"prompt": format!("p{i}")})).await;
    }
    assert_eq!(
        e.stats().recent_requests.len(),
        pdsim::stats::RECENT_CAPACITY
    );
    e.shutdown().await;
}

#[tokio::test]
async fn slots_queue_requests() {
    let e = engine_with(Role::Both, Connector::None, |c| {
        c.latency = LatencyModel {
            ttft: Duration::from_millis(500),
            slots: 1,
            ..LatencyModel::default()
        };
    })
    .await;
    let url = completions(&e);
    let a = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &json!({"prompt":"a"})).await.0 }
    });
    let b = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &json!({"prompt":"b"})).await.0 }
    });
    wait_stats(&e, |s| s.waiting == 1).await;
    assert_eq!(a.await.unwrap(), 200);
    assert_eq!(b.await.unwrap(), 200);
    assert_eq!(e.stats().waiting, 0);
    e.shutdown().await;
}

#[tokio::test]
async fn shutdown_ends_hanging_requests() {
    let e = engine(Role::Decode, Connector::Shfs).await;
    e.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let pending = tokio::spawn({
        let url = completions(&e);
        async move { post(url, &json!({"prompt":"x"})).await.0 }
    });
    wait_stats(&e, |s| s.in_flight == 1).await;
    e.shutdown().await;
    assert_eq!(pending.await.unwrap(), 503);
}

#[tokio::test]
async fn dropping_the_handle_frees_the_port() {
    let e = engine(Role::Prefill, Connector::Sglang).await;
    let addr = e.addr();
    let boot = e.bootstrap_port().unwrap();
    drop(e);
    // Listeners are gone: connecting fails once the tasks are aborted.
    let mut refused = false;
    for _ in 0..100 {
        if std::net::TcpStream::connect(addr).is_err()
            && std::net::TcpStream::connect(("127.0.0.1", boot)).is_err()
        {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused);
}

#[tokio::test]
async fn binary_help_and_serving() {
    let bin = env!("CARGO_BIN_EXE_pdsim");
    let help = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8(help.stdout).unwrap();
    for flag in [
        "--role",
        "--connector",
        "--listen",
        "--model",
        "--side-channel-listen",
        "--bootstrap-listen",
        "--advertise-host",
        "--kv-lease-secs",
        "--handoff-timeout-secs",
        "--zero-delay",
        "--ttft-ms",
        "--itl-ms",
        "--prefill-ms-per-token",
        "--slots",
        "--fault-error-rate",
        "--fault-hang",
        "--fault-drop-after-chunks",
        "--fault-dead",
        "--fault-refuse-kv",
        "--fault-first-byte-delay-ms",
        "/sim/faults",
        "/sim/stats",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}");
    }
    let mut child = std::process::Command::new(bin)
        .args([
            "--role",
            "prefill",
            "--connector",
            "mooncake",
            "--listen",
            "127.0.0.1:0",
            "--side-channel-listen",
            "127.0.0.1:0",
            "--bootstrap-listen",
            "127.0.0.1:0",
            "--zero-delay",
            "--fault-dead",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .to_owned();
    let status = client()
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap()
        .status();
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(status, 503, "--fault-dead makes /health 503");
}
