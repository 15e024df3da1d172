//! Behaviour recorded from real vLLM 0.32.0 CPU engines with NixlConnector
//! (tests/e2e of this workspace) that pdsim reproduces: wire shapes, headers,
//! error texts, KV-load failures and the engine crash on bad KV params.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use pdsim::{Connector, Faults, Role, SimHandle};
use serde_json::{Value, json};

const PROMPT: &str = "a prompt that the prefill computes for the decode";

/// vLLM's answer to a failed KV load (non-streaming).
fn internal_error() -> Value {
    json!({"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}})
}

/// vLLM's mid-stream error event payload: Python `json.dumps` spacing.
const STREAM_ERROR: &str = r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#;

const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// POSTs `body` and returns status, headers and the raw body text.
async fn raw(
    url: &str,
    body: &Value,
    request_id: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut rb = client().post(url).json(body);
    if let Some(id) = request_id {
        rb = rb.header("X-Request-Id", id);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

fn events(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect()
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The prefill leg as pdgate sends it; returns the raw body text.
async fn prefill(p: &SimHandle, url: &str, body: Value, id: &str) -> String {
    let mut body = body;
    body["max_tokens"] = json!(1);
    body["kv_transfer_params"] = shfs_augment();
    let (s, h, text) = raw(url, &body, Some(id)).await;
    assert_eq!(s, 200, "{text}");
    assert!(
        h.get("x-request-id").is_none(),
        "vLLM echoes no x-request-id"
    );
    assert!(p.stats().transfers_stored > 0);
    text
}

#[tokio::test]
async fn prefill_params_match_vllm_in_order_and_values() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let text = prefill(
        &p,
        &completions(&p),
        json!({"model":"pdsim","prompt":PROMPT}),
        "pd-1",
    )
    .await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let kv = &v["kv_transfer_params"];
    let order = common::NIXL_PARAM_KEYS;
    let params = &text[text.find("\"kv_transfer_params\"").unwrap()..];
    let at: Vec<usize> = order
        .iter()
        .map(|k| {
            params
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k} missing: {params}"))
        })
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "order: {params}");
    assert_eq!(kv.as_object().unwrap().len(), order.len(), "{kv}");
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert!(kv["remote_block_ids"][0][0].is_u64(), "nested: {kv}");
    let engine_id = kv["remote_engine_id"].as_str().unwrap();
    assert!(uuid::Uuid::parse_str(engine_id).is_ok(), "{engine_id}");
    assert_eq!(engine_id.len(), 36, "hyphenated uuid: {engine_id}");
    let rid = kv["remote_request_id"].as_str().unwrap();
    let suffix = rid
        .strip_prefix("cmpl-pd-1-0-")
        .unwrap_or_else(|| panic!("{rid}"));
    assert!(is_hex(suffix, 8), "{rid}");
    assert_eq!(kv["remote_host"], "localhost");
    assert_eq!(kv["remote_port"], p.side_channel_port().unwrap());
    assert_eq!(
        (
            kv["tp_size"].clone(),
            kv["dcp_size"].clone(),
            kv["pp_size"].clone()
        ),
        (json!(1), json!(1), json!(1))
    );
    assert_eq!(kv["remote_num_tokens"], v["usage"]["prompt_tokens"]);
    assert!(kv["remote_blocks_expiry_time"].is_null());
    assert_eq!(kv["transfer_mode"], "pull");
    assert_eq!(kv["remote_prefill_cached_tokens"], 0);
    assert_eq!(v["id"], "cmpl-pd-1");

    // Chat: the internal id has no prompt index.
    let text = prefill(
        &p,
        &chat(&p),
        json!({"messages":[{"role":"user","content":PROMPT}]}),
        "pd-2",
    )
    .await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["id"], "chatcmpl-pd-2");
    let rid = v["kv_transfer_params"]["remote_request_id"]
        .as_str()
        .unwrap();
    let suffix = rid
        .strip_prefix("chatcmpl-pd-2-")
        .unwrap_or_else(|| panic!("{rid}"));
    assert!(is_hex(suffix, 8), "{rid}");
    p.shutdown().await;
}

#[tokio::test]
async fn decode_answers_like_vllm_and_streams_its_shape() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let body = json!({"messages":[{"role":"user","content":PROMPT}]});
    let text = prefill(&p, &chat(&p), body.clone(), "pd-3").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut decode = body;
    decode["kv_transfer_params"] = v["kv_transfer_params"].clone();
    decode["max_tokens"] = json!(3);
    decode["stream"] = json!(true);
    decode["stream_options"] = json!({"include_usage":true});
    let (s, h, text) = raw(&chat(&d), &decode, Some("pd-3")).await;
    assert_eq!(s, 200, "{text}");
    assert_eq!(h["content-type"], "text/event-stream; charset=utf-8");
    assert!(h.get("x-request-id").is_none());
    let ev = events(&text);
    // role chunk, 3 content chunks, usage chunk, [DONE]
    assert_eq!(ev.len(), 6, "{ev:?}");
    let first: Value = serde_json::from_str(ev[0]).unwrap();
    assert_eq!(first["id"], "chatcmpl-pd-3");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role":"assistant","content":""})
    );
    assert!(first["choices"][0]["finish_reason"].is_null());
    let last: Value = serde_json::from_str(ev[3]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last["choices"][0]["stop_reason"].is_null());
    assert!(last["choices"][0].get("stop_reason").is_some());
    let usage: Value = serde_json::from_str(ev[4]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(ev[5], "[DONE]");
    assert_eq!(d.stats().transfers_pulled, 1);

    // Non-streaming decode: kv_transfer_params null, service_tier / system_fingerprint present.
    let body = json!({"prompt":PROMPT});
    let text = prefill(&p, &completions(&p), body.clone(), "pd-4").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut decode = body;
    decode["kv_transfer_params"] = v["kv_transfer_params"].clone();
    let (s, h, text) = raw(&completions(&d), &decode, Some("pd-4")).await;
    assert_eq!(s, 200, "{text}");
    assert!(h.get("x-request-id").is_none());
    let v: Value = serde_json::from_str(&text).unwrap();
    let o = v.as_object().unwrap();
    assert!(o["kv_transfer_params"].is_null());
    assert!(o["service_tier"].is_null());
    assert!(o.contains_key("system_fingerprint"));
    assert_eq!(v["id"], "cmpl-pd-4");
    assert_eq!(d.stats().transfers_pulled, 2);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn kv_load_failure_is_a_bare_500_or_an_error_event() {
    // A prefill that goes away: its side channel refuses connections.
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let text = prefill(&p, &completions(&p), json!({"prompt":PROMPT}), "pd-5").await;
    let kv = serde_json::from_str::<Value>(&text).unwrap()["kv_transfer_params"].clone();
    p.shutdown().await;

    let body = json!({"prompt":PROMPT,"kv_transfer_params":kv});
    let (s, _, v) = post(completions(&d), &body).await;
    assert_eq!(s, 500);
    assert_eq!(v, internal_error());
    let reason = d.stats().last_kv_error.unwrap();
    assert!(reason.contains("cannot reach"), "{reason}");

    // Streaming completion: 200, the spaced error event, [DONE].
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let (s, _, text) = raw(&completions(&d), &stream, None).await;
    assert_eq!(s, 200);
    assert_eq!(events(&text), vec![STREAM_ERROR, "[DONE]"]);

    // Streaming chat: the role chunk comes before the error.
    let chat_body = json!({"messages":[{"role":"user","content":PROMPT}],"stream":true,"kv_transfer_params":kv});
    let (s, _, text) = raw(&chat(&d), &chat_body, Some("pd-6")).await;
    assert_eq!(s, 200);
    let ev = events(&text);
    assert_eq!(ev.len(), 3, "{ev:?}");
    let role: Value = serde_json::from_str(ev[0]).unwrap();
    assert_eq!(role["id"], "chatcmpl-pd-6");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(&ev[1..], &[STREAM_ERROR, "[DONE]"]);
    assert_eq!(d.stats().transfers_failed, 3);
    // A failed load does not make the engine unhealthy.
    let r = client()
        .get(format!("{}/health", d.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    d.shutdown().await;
}

#[tokio::test]
async fn bad_kv_params_crash_the_engine_only_when_asked() {
    let bad = json!({"prompt":PROMPT,"kv_transfer_params":{"do_remote_prefill":true}});
    let health = |h: &SimHandle| format!("{}/health", h.base_url());

    // Default: that request fails alone, like any unusable params.
    let d = engine(Role::Decode, Connector::Shfs).await;
    let (s, _, v) = post(completions(&d), &bad).await;
    assert_eq!((s, v), (500, internal_error()));
    let (s, _, _) = post(completions(&d), &json!({"prompt":PROMPT})).await;
    assert_eq!(s, 200);
    assert!(!d.stats().engine_dead);
    d.shutdown().await;

    // With the fault: 500 from the engine core, then the engine is dead for good.
    let d = engine(Role::Decode, Connector::Shfs).await;
    d.set_faults(Faults {
        crash_on_bad_kv_params: true,
        ..Faults::default()
    });
    let (s, _, v) = post(completions(&d), &bad).await;
    assert_eq!(s, 500);
    assert_eq!(
        v,
        json!({"error":{"message":ENGINE_DEAD,"type":"InternalServerError","param":null,"code":500}})
    );
    let r = client().get(health(&d)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().is_empty());
    let (s, _, v) = post(completions(&d), &json!({"prompt":PROMPT})).await;
    assert_eq!(s, 500);
    assert_eq!(v["error"]["message"], ENGINE_DEAD);
    let stream = json!({"messages":[{"role":"user","content":PROMPT}],"stream":true});
    let (s, _, _) = raw(&chat(&d), &stream, None).await;
    assert_eq!(s, 500);
    // Clearing the faults does not revive it.
    d.set_faults(Faults::default());
    let r = client().get(health(&d)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let st = d.stats();
    assert!(st.engine_dead);
    assert_eq!(st.transfers_failed, 1);
    assert!(st.last_kv_error.unwrap().contains("remote_block_ids"));
    assert_eq!(st.in_flight, 0);
    d.shutdown().await;
}

#[tokio::test]
async fn crash_fails_requests_already_in_flight() {
    let d = engine_with(Role::Decode, Connector::Shfs, |c| {
        c.latency.itl = std::time::Duration::from_millis(20);
    })
    .await;
    d.set_faults(Faults {
        crash_on_bad_kv_params: true,
        ..Faults::default()
    });
    // A long stream is running when the engine dies.
    let url = completions(&d);
    let long = tokio::spawn({
        let url = url.clone();
        async move {
            raw(
                &url,
                &json!({"prompt":PROMPT,"max_tokens":2000,"stream":true}),
                None,
            )
            .await
        }
    });
    wait_stats(&d, |s| s.in_flight == 1).await;
    let (s, _, _) = post(
        &url,
        &json!({"prompt":PROMPT,"kv_transfer_params":{"do_remote_prefill":true}}),
    )
    .await;
    assert_eq!(s, 500);
    let (s, _, text) = long.await.unwrap();
    assert_eq!(s, 200);
    let ev = events(&text);
    assert_eq!(ev.last().copied(), Some("[DONE]"));
    let err: Value = serde_json::from_str(ev[ev.len() - 2]).unwrap();
    assert_eq!(err["error"]["message"], ENGINE_DEAD);
    assert!(
        ev.len() < 100,
        "the stream ended early: {} events",
        ev.len()
    );
    d.shutdown().await;
}

#[tokio::test]
async fn n2_prefill_gives_one_set_of_params_and_prompt_arrays_are_refused() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let body = json!({"prompt":PROMPT,"n":2,"max_tokens":1,"kv_transfer_params":shfs_augment()});
    let (s, _, v) = post(completions(&p), &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(p.stats().transfers_stored, 1);
    // vLLM serves a prompt array (params cover the first prompt only); pdsim refuses it.
    let body = json!({"prompt":[PROMPT, "another prompt"],"max_tokens":1,"kv_transfer_params":shfs_augment()});
    let (s, _, v) = post(completions(&p), &body).await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&v, 400)["param"], "prompt");
    p.shutdown().await;
}

#[tokio::test]
async fn health_is_an_empty_200_without_content_type() {
    let e = engine(Role::Both, Connector::None).await;
    let r = client()
        .get(format!("{}/health", e.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("content-type").is_none(),
        "{:?}",
        r.headers()
    );
    assert!(r.text().await.unwrap().is_empty());
    e.shutdown().await;
}
