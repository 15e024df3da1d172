//! Each connector's handoff through real HTTP on loopback: the right handoff
//! succeeds, each wrong one fails the way the real engine does.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdsim::{Connector, Faults, Role, SimHandle};
use serde_json::{Value, json};

const PROMPT: &str = "the prompt for a disaggregated request";

/// Sends the shfs prefill leg and returns the prefill's `kv_transfer_params`.
async fn shfs_prefill(p: &SimHandle, prompt: &str) -> Value {
    let (s, _, v) = post_h(
        completions(p),
        &json!({"prompt":prompt,"max_tokens":1,"stream":false,"kv_transfer_params":shfs_augment()}),
        &[("X-Request-Id", "pd-1")],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["kv_transfer_params"].clone()
}

/// The gateway's merge: params verbatim, `remote_host` overwritten with the pod IP.
fn merged(params: &Value, prompt: &str, stream: bool) -> Value {
    let mut kv = params.clone();
    kv["remote_host"] = json!("127.0.0.1");
    json!({"prompt":prompt,"max_tokens":5,"stream":stream,"kv_transfer_params":kv})
}

#[tokio::test]
async fn shfs_happy_path_returns_full_params_and_pulls_once() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let kv = shfs_prefill(&p, PROMPT).await;
    for key in common::NIXL_PARAM_KEYS {
        assert!(kv.get(key).is_some(), "missing {key} in {kv}");
    }
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert!(
        kv["remote_block_ids"][0].is_array(),
        "array of arrays: {kv}"
    );
    assert_eq!(kv["remote_engine_id"], p.engine_id());
    assert_eq!(kv["remote_host"], "localhost");
    assert_eq!(kv["remote_port"], p.side_channel_port().unwrap());
    assert!(
        kv["remote_request_id"]
            .as_str()
            .unwrap()
            .starts_with("cmpl-pd-1")
    );
    assert_eq!(kv["remote_num_tokens"], 7);
    assert_eq!(p.stats().transfers_stored, 1);

    let (s, _, v) = post(completions(&d), &merged(&kv, PROMPT, false)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(d.stats().transfers_pulled, 1);
    assert_eq!(d.stats().recomputed, 0);
    assert_eq!(p.stats().transfers_served, 1);

    // A transfer is consumed once.
    let (s, _, v) = post(completions(&d), &merged(&kv, PROMPT, false)).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("no KV"), "{v}");
    assert_eq!(d.stats().transfers_failed, 1);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn shfs_streaming_decode_and_stream_failure_event() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let kv = shfs_prefill(&p, PROMPT).await;
    let (s, ev) = post_sse(completions(&d), &merged(&kv, PROMPT, true)).await;
    assert_eq!(s, 200);
    assert_eq!(ev.len(), 6, "{ev:?}");
    assert_eq!(ev[5], "[DONE]");
    let last: Value = serde_json::from_str(&ev[4]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // Failure on a stream: 200, then an error event, then [DONE].
    let (s, ev) = post_sse(completions(&d), &merged(&kv, PROMPT, true)).await;
    assert_eq!(s, 200);
    let err: Value = serde_json::from_str(&ev[0]).unwrap();
    error_of(&err, 500);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn shfs_wrong_handoffs_fail_like_vllm() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let url = completions(&d);

    // Each required field missing.
    for key in [
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
    ] {
        let kv = shfs_prefill(&p, PROMPT).await;
        let mut body = merged(&kv, PROMPT, false);
        body["kv_transfer_params"]
            .as_object_mut()
            .unwrap()
            .remove(key);
        let (s, _, v) = post(&url, &body).await;
        assert_eq!(s, 500, "without {key}: {v}");
        assert!(kv_error(&v, &d).contains(key), "{v}");
    }
    // Wrong engine id.
    let kv = shfs_prefill(&p, PROMPT).await;
    let mut body = merged(&kv, PROMPT, false);
    body["kv_transfer_params"]["remote_engine_id"] = json!("someone-else");
    let (s, _, v) = post(&url, &body).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("engine id mismatch"), "{v}");
    // A different prompt: the digest does not match.
    let kv = shfs_prefill(&p, PROMPT).await;
    let (s, _, v) = post(&url, &merged(&kv, "some other prompt entirely", false)).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("does not match"), "{v}");
    // Unreachable host: a port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let kv = shfs_prefill(&p, PROMPT).await;
    let mut body = merged(&kv, PROMPT, false);
    body["kv_transfer_params"]["remote_port"] = json!(port);
    let (s, _, v) = post(&url, &body).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("cannot reach"), "{v}");
    // The decode leg sent to the prefill engine's params unchanged (do_remote_decode) recomputes.
    let (s, _, _) = post(
        &url,
        &json!({"prompt":PROMPT,"kv_transfer_params":shfs_augment()}),
    )
    .await;
    assert_eq!(s, 200);
    // No params at all: recompute, counted.
    let (s, _, _) = post(&url, &json!({"prompt":PROMPT})).await;
    assert_eq!(s, 200);
    let st = d.stats();
    assert_eq!(st.recomputed, 2);
    assert_eq!(st.transfers_failed, 8);
    assert_eq!(st.transfers_pulled, 0);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn shfs_expired_lease_and_refused_handoff() {
    let p = engine_with(Role::Prefill, Connector::Shfs, |c| {
        c.kv_lease = Duration::from_millis(50);
        c.advertise_host = "127.0.0.1".into();
    })
    .await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let kv = shfs_prefill(&p, PROMPT).await;
    assert_eq!(kv["remote_host"], "127.0.0.1");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (s, _, v) = post(completions(&d), &merged(&kv, PROMPT, false)).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("expired"), "{v}");

    let p2 = engine(Role::Prefill, Connector::Shfs).await;
    let kv = shfs_prefill(&p2, PROMPT).await;
    p2.set_faults(Faults {
        refuse_kv: true,
        ..Faults::default()
    });
    let (s, _, v) = post(completions(&d), &merged(&kv, PROMPT, false)).await;
    assert_eq!(s, 500, "{v}");
    assert_eq!(p2.stats().transfers_refused, 1);
    p.shutdown().await;
    p2.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn shfs_cached_tokens_reach_decode_usage() {
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine(Role::Decode, Connector::Shfs).await;
    let long: String = (0..40).map(|i| format!("w{i} ")).collect();
    let _ = shfs_prefill(&p, &long).await;
    let kv = shfs_prefill(&p, &long).await;
    assert_eq!(kv["remote_prefill_cached_tokens"], 32);
    let (s, _, v) = post(completions(&d), &merged(&kv, &long, false)).await;
    assert_eq!(s, 200);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn nixl_happy_path_and_wrong_shapes() {
    let p = engine(Role::Prefill, Connector::Nixl).await;
    let d = engine(Role::Decode, Connector::Nixl).await;
    let prefill_body =
        json!({"messages":[{"role":"user","content":PROMPT}],"max_tokens":1,"stream":false});
    let r = client()
        .post(chat(&p))
        .json(&prefill_body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let resp: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        resp["kv_transfer_params"]["remote_engine_id"],
        p.engine_id()
    );
    // Merge: the whole prefill response under disagg_prefill_resp.
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":4,"disagg_prefill_resp":{}}}"#,
        raw.trim()
    );
    let r = client()
        .post(chat(&d))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(d.stats().transfers_pulled, 1);

    // shfs-style merge against a nixl decode: refused.
    let r = client()
        .post(chat(&p))
        .json(&prefill_body)
        .send()
        .await
        .unwrap();
    let resp: Value = r.json().await.unwrap();
    let (s, _, v) = post(chat(&d),
        &json!({"messages":[{"role":"user","content":PROMPT}],"kv_transfer_params":resp["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("disagg_prefill_resp"), "{v}");
    // disagg_prefill_resp without params, or not an object.
    for bad in [json!({"id":"x"}), json!("text")] {
        let (s, _, v) = post(
            chat(&d),
            &json!({"messages":[{"role":"user","content":PROMPT}],"disagg_prefill_resp":bad}),
        )
        .await;
        assert_eq!(s, 500, "{v}");
    }
    assert_eq!(d.stats().transfers_failed, 3);
    p.shutdown().await;
    d.shutdown().await;
}

fn mooncake_prefill_body(transfer_id: Option<&str>) -> Value {
    let mut kv = json!({"do_remote_decode":true,"do_remote_prefill":false});
    if let Some(t) = transfer_id {
        kv["transfer_id"] = json!(t);
    }
    json!({"prompt":PROMPT,"max_tokens":1,"ignore_eos":true,"kv_transfer_params":kv})
}

fn mooncake_decode_body(p: &SimHandle, transfer_id: &str) -> Value {
    json!({"prompt":PROMPT,"max_tokens":3,"kv_transfer_params":{
        "do_remote_decode":false,"do_remote_prefill":true,
        "remote_bootstrap_addr": format!("http://127.0.0.1:{}", p.bootstrap_port().unwrap()),
        "remote_engine_id": p.engine_id(),
        "transfer_id": transfer_id}})
}

#[tokio::test]
async fn mooncake_concurrent_legs_decode_first() {
    let p = engine(Role::Prefill, Connector::Mooncake).await;
    let d = engine(Role::Decode, Connector::Mooncake).await;
    let q = get_json(&format!(
        "http://127.0.0.1:{}/query",
        p.bootstrap_port().unwrap()
    ))
    .await;
    assert_eq!(q["0"]["engine_id"], p.engine_id());
    assert!(
        q["0"]["worker_addr"]["0"]["0"]
            .as_str()
            .unwrap()
            .starts_with("tcp://")
    );

    let decode = tokio::spawn({
        let url = completions(&d);
        let body = mooncake_decode_body(&p, "xfer-1");
        async move { post(&url, &body).await }
    });
    // The decode arrives first and waits for the transfer.
    wait_stats(&d, |s| s.in_flight == 1).await;
    let (s, _, v) = post_h(
        completions(&p),
        &mooncake_prefill_body(Some("xfer-1")),
        &[("X-data-parallel-rank", "0")],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert!(v["kv_transfer_params"].is_null());
    let (s, _, v) = decode.await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(d.stats().transfers_pulled, 1);
    assert_eq!(p.stats().transfers_served, 1);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn mooncake_wrong_handoffs() {
    let p = engine_with(Role::Prefill, Connector::Mooncake, |c| {
        c.handoff_timeout = Duration::from_millis(300);
    })
    .await;
    let d = engine_with(Role::Decode, Connector::Mooncake, |c| {
        c.handoff_timeout = Duration::from_millis(300);
    })
    .await;
    // Prefill without transfer_id.
    let (s, _, v) = post(completions(&p), &mooncake_prefill_body(None)).await;
    assert_eq!(s, 500);
    assert!(
        error_of(&v, 500)["message"]
            .as_str()
            .unwrap()
            .contains("transfer_id")
    );
    // Prefill with a data-parallel rank that does not exist.
    let (s, _, _) = post_h(
        completions(&p),
        &mooncake_prefill_body(Some("x")),
        &[("X-data-parallel-rank", "3")],
    )
    .await;
    assert_eq!(s, 400);
    // Decode missing each required field.
    for key in ["remote_bootstrap_addr", "remote_engine_id", "transfer_id"] {
        let mut body = mooncake_decode_body(&p, "xfer-2");
        body["kv_transfer_params"]
            .as_object_mut()
            .unwrap()
            .remove(key);
        let (s, _, v) = post(completions(&d), &body).await;
        assert_eq!(s, 500, "{key}: {v}");
        assert!(kv_error(&v, &d).contains(key));
    }
    // Bootstrap address without http://.
    let mut body = mooncake_decode_body(&p, "xfer-2");
    body["kv_transfer_params"]["remote_bootstrap_addr"] =
        json!(format!("127.0.0.1:{}", p.bootstrap_port().unwrap()));
    let (s, _, v) = post(completions(&d), &body).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("http://"));
    // Wrong engine id.
    let mut body = mooncake_decode_body(&p, "xfer-2");
    body["kv_transfer_params"]["remote_engine_id"] = json!("engine-x");
    let (s, _, _) = post(completions(&d), &body).await;
    assert_eq!(s, 500);
    // Prefill finished by stop (stop kept on the prefill leg): nothing shipped, decode times out.
    let (_, _, plain) = post(completions(&d), &json!({"prompt":PROMPT,"max_tokens":1})).await;
    let first = plain["choices"][0]["text"]
        .as_str()
        .unwrap()
        .trim()
        .to_owned();
    let mut pb = mooncake_prefill_body(Some("xfer-3"));
    pb["stop"] = json!([first]);
    let (s, _, v) = post(completions(&p), &pb).await;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (s, _, v) = post(completions(&d), &mooncake_decode_body(&p, "xfer-3")).await;
    assert_eq!(s, 500);
    assert!(kv_error(&v, &d).contains("timed out"), "{v}");
    // Mismatched transfer ids.
    let (s, _, _) = post(completions(&p), &mooncake_prefill_body(Some("xfer-4"))).await;
    assert_eq!(s, 200);
    let (s, _, _) = post(completions(&d), &mooncake_decode_body(&p, "xfer-5")).await;
    assert_eq!(s, 500);
    assert_eq!(p.stats().transfers_stored, 1);
    assert_eq!(d.stats().transfers_pulled, 0);
    p.shutdown().await;
    d.shutdown().await;
}

fn sglang_body(p: &SimHandle, room: u64, stream: bool) -> Value {
    json!({"prompt":PROMPT,"max_tokens":4,"stream":stream,
        "bootstrap_host":"127.0.0.1","bootstrap_port":p.bootstrap_port().unwrap(),"bootstrap_room":room})
}

#[tokio::test]
async fn sglang_both_legs_rendezvous() {
    let p = engine(Role::Prefill, Connector::Sglang).await;
    let d = engine(Role::Decode, Connector::Sglang).await;
    let body = sglang_body(&p, 4242, false);
    let (pr, dr) = tokio::join!(post(completions(&p), &body), post(completions(&d), &body));
    assert_eq!(pr.0, 200, "{}", pr.2);
    assert_eq!(dr.0, 200, "{}", dr.2);
    assert_eq!(d.stats().transfers_pulled, 1);
    // Streaming decode, prefill first this time.
    let body = sglang_body(&p, 7, true);
    let mut pbody = body.clone();
    pbody["stream"] = json!(false);
    let (pr, dr) = tokio::join!(
        post(completions(&p), &pbody),
        post_sse(completions(&d), &body)
    );
    assert_eq!(pr.0, 200);
    assert_eq!(dr.0, 200);
    assert_eq!(dr.1.last().unwrap(), "[DONE]");
    assert_eq!(d.stats().transfers_pulled, 2);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn sglang_wrong_handoffs_and_abort() {
    let p = engine_with(Role::Prefill, Connector::Sglang, |c| {
        c.handoff_timeout = Duration::from_millis(300);
    })
    .await;
    let d = engine_with(Role::Decode, Connector::Sglang, |c| {
        c.handoff_timeout = Duration::from_millis(300);
    })
    .await;
    // Prefill alone: its decode never comes.
    let (s, _, v) = post(completions(&p), &sglang_body(&p, 1, false)).await;
    assert_eq!(s, 500, "{v}");
    // Decode without a room.
    let mut body = sglang_body(&p, 2, false);
    body.as_object_mut().unwrap().remove("bootstrap_room");
    let (s, _, v) = post(completions(&d), &body).await;
    assert_eq!(s, 400);
    error_of(&v, 400);
    // Prefill without a room.
    let (s, _, _) = post(completions(&p), &body).await;
    assert_eq!(s, 400);
    // Different rooms on the two legs: both fail.
    let (b10, b11) = (sglang_body(&p, 10, false), sglang_body(&p, 11, false));
    let (pr, dr) = tokio::join!(post(completions(&p), &b10), post(completions(&d), &b11));
    assert_eq!(pr.0, 500);
    assert_eq!(dr.0, 500);
    // Abort a prefill waiting for its decode.
    let p2 = engine(Role::Prefill, Connector::Sglang).await;
    let waiting = tokio::spawn({
        let url = completions(&p2);
        let body = sglang_body(&p2, 99, false);
        async move { post_h(&url, &body, &[("X-Request-Id", "rid-9")]).await }
    });
    wait_stats(&p2, |s| s.in_flight == 1).await;
    let r = client()
        .post(format!("{}/abort_request", p2.base_url()))
        .json(&json!({"rid":"rid-9"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, _, v) = waiting.await.unwrap();
    assert_eq!(s, 400, "{v}");
    assert!(
        error_of(&v, 400)["message"]
            .as_str()
            .unwrap()
            .contains("aborted")
    );
    let st = p2.stats();
    assert_eq!(st.aborted, 1);
    assert_eq!(st.requests.abort_requests, 1);
    p.shutdown().await;
    p2.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn decode_without_params_recomputes_for_every_connector() {
    for c in [
        Connector::Shfs,
        Connector::Nixl,
        Connector::Mooncake,
        Connector::Sglang,
        Connector::None,
    ] {
        let d = engine(Role::Decode, c).await;
        let (s, _, v) = post(completions(&d), &json!({"prompt":PROMPT})).await;
        assert_eq!(s, 200, "{c}: {v}");
        assert_eq!(d.stats().recomputed, 1, "{c}");
        d.shutdown().await;
    }
    // A combined engine computing its own prompt is not a recompute.
    let b = engine(Role::Both, Connector::Shfs).await;
    let (s, _, v) = post(completions(&b), &json!({"prompt":PROMPT})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 7, "{v}");
    assert_eq!(b.stats().responses_ok, 1);
    assert_eq!(b.stats().recomputed, 0);
    b.shutdown().await;
}
