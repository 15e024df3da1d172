//! Helpers shared by the integration tests: engines on port 0, a JSON client.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use pdsim::{Connector, Role, SimConfig, SimHandle, SimStats};
use serde_json::Value;

/// The `kv_transfer_params` keys a vLLM NixlConnector prefill answers with, in the order vLLM
/// writes them (0.32's set plus 0.33's `remote_registration_generation`).
pub const NIXL_PARAM_KEYS: [&str; 15] = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "remote_registration_generation",
    "transfer_mode",
    "remote_prefill_cached_tokens",
];

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

pub async fn engine(role: Role, connector: Connector) -> SimHandle {
    pdsim::spawn(SimConfig::new(role, connector)).await.unwrap()
}

pub async fn engine_with(
    role: Role,
    connector: Connector,
    f: impl FnOnce(&mut SimConfig),
) -> SimHandle {
    let mut c = SimConfig::new(role, connector);
    f(&mut c);
    pdsim::spawn(c).await.unwrap()
}

/// POSTs `body` to `url`; returns status, `x-request-id` and the parsed JSON body.
pub async fn post(url: impl AsRef<str>, body: &Value) -> (u16, Option<String>, Value) {
    post_h(url, body, &[]).await
}

pub async fn post_h(
    url: impl AsRef<str>,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Value) {
    let mut rb = client().post(url.as_ref()).json(body);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let rid = r
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = r.text().await.unwrap();
    let v = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    };
    (status, rid, v)
}

/// POSTs a streaming request; returns status and the `data:` payloads (JSON or `[DONE]`).
pub async fn post_sse(url: impl AsRef<str>, body: &Value) -> (u16, Vec<String>) {
    let r = client().post(url.as_ref()).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = r.text().await.unwrap();
    if status == 200 {
        assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
    }
    let events = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad event {e:?}"))
                .to_owned()
        })
        .collect();
    (status, events)
}

pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls `f(stats)` until it holds (bounded: 10 s), returning the last snapshot.
pub async fn wait_stats(h: &SimHandle, f: impl Fn(&SimStats) -> bool) -> SimStats {
    for _ in 0..500 {
        let s = h.stats();
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = h.stats();
    panic!("condition never held; last stats: {s:#?}");
}

/// An answer's `usage.prompt_tokens_details.cached_tokens`.
pub fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

pub fn completions(h: &SimHandle) -> String {
    format!("{}/v1/completions", h.base_url())
}

pub fn chat(h: &SimHandle) -> String {
    format!("{}/v1/chat/completions", h.base_url())
}

/// The shfs augment of contracts §3.
pub fn shfs_augment() -> Value {
    serde_json::json!({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null})
}

/// The error object of a vLLM error body, checking its shape and code.
/// A failed KV load: the body is vLLM's bare 500; returns the reason pdsim kept in its stats.
pub fn kv_error(v: &Value, h: &SimHandle) -> String {
    assert_eq!(
        v,
        &serde_json::json!({"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}),
    );
    h.stats().last_kv_error.expect("a KV load failure reason")
}

pub fn error_of(v: &Value, code: u16) -> &Value {
    let e = &v["error"];
    assert_eq!(e["code"], code, "{v}");
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some(), "{v}");
    e
}
