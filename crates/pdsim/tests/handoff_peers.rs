//! The handoffs whose legs name their peer (P2pNccl, MoRIIO, TensorRT-LLM) through real HTTP on
//! loopback: the right handoff loads the prefill's KV, and a wrong one (a missing address, the
//! wrong phase, a reused id) fails the way the real engine would.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use pdsim::{Connector, Role, SimHandle};
use serde_json::{Value, json};

const PROMPT: &str = "the prompt for a peer-addressed request";

fn p2p_id(p: &SimHandle, tag: &str) -> String {
    format!(
        "___prefill_addr_127.0.0.1:{}___decode_addr_127.0.0.1:14579_{tag:0>32}",
        p.side_channel_port().unwrap()
    )
}

#[tokio::test]
async fn p2pnccl_decode_loads_from_the_prefill_the_id_names() {
    let p = engine(Role::Prefill, Connector::P2pNccl).await;
    let d = engine(Role::Decode, Connector::P2pNccl).await;
    let id = p2p_id(&p, "a1");
    let (s, _, v) = post_h(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":1,"stream":false}),
        &[("X-Request-Id", &id)],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = post_h(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"stream":false}),
        &[("X-Request-Id", &id)],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let st = d.stats();
    assert_eq!((st.transfers_pulled, st.recomputed), (1, 0), "{st:?}");
    // The KV is served once: a second decode under the same id finds nothing.
    let (s, _, _) = post_h(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"stream":false}),
        &[("X-Request-Id", &id)],
    )
    .await;
    assert_eq!(s, 500);
}

#[tokio::test]
async fn p2pnccl_ids_without_addresses_fail_on_both_sides() {
    let p = engine(Role::Prefill, Connector::P2pNccl).await;
    let d = engine(Role::Decode, Connector::P2pNccl).await;
    for h in [&p, &d] {
        let (s, _, v) = post_h(
            completions(h),
            &json!({"prompt":PROMPT,"max_tokens":1}),
            &[("X-Request-Id", "plain-id")],
        )
        .await;
        assert_eq!(s, 500, "{v}");
    }
    assert!(
        d.stats()
            .last_kv_error
            .unwrap_or_default()
            .contains("does not contain hostname and port")
    );
}

#[tokio::test]
async fn p2pnccl_a_reused_id_is_refused_while_its_transfer_is_pending() {
    let p = engine(Role::Prefill, Connector::P2pNccl).await;
    let id = p2p_id(&p, "b2");
    let body = json!({"prompt":PROMPT,"max_tokens":1});
    let headers = [("X-Request-Id", id.as_str())];
    assert_eq!(post_h(completions(&p), &body, &headers).await.0, 200);
    let (s, _, v) = post_h(completions(&p), &body, &headers).await;
    assert_eq!(s, 500, "a second prefill under a pending id: {v}");
}

fn moriio_params(prefill_leg: bool, host_port: u16) -> Value {
    json!({"do_remote_decode":prefill_leg,"do_remote_prefill":!prefill_leg,
        "remote_handshake_port":host_port,"remote_notify_port":61005,
        "remote_engine_id":null,"remote_block_ids":null,
        "remote_host":"127.0.0.1","remote_port":8000})
}

#[tokio::test]
async fn moriio_write_mode_legs_run_at_once() {
    let p = engine(Role::Prefill, Connector::Moriio).await;
    let d = engine(Role::Decode, Connector::Moriio).await;
    let side = p.side_channel_port().unwrap();
    let headers = [("X-Request-Id", "moriio-req-1")];
    let decode_body =
        json!({"prompt":PROMPT,"max_tokens":4,"kv_transfer_params":moriio_params(false, side)});
    let prefill_body = json!({"prompt":PROMPT,"max_tokens":1,"stream":false,"kv_transfer_params":moriio_params(true, 6301)});
    // The decode goes first and waits for the prefill's KV.
    let decode = post_h(completions(&d), &decode_body, &headers);
    let prefill = post_h(completions(&p), &prefill_body, &headers);
    let ((ds, _, dv), (ps, _, pv)) = tokio::join!(decode, prefill);
    assert_eq!(ps, 200, "{pv}");
    assert_eq!(ds, 200, "{dv}");
    assert_eq!(d.stats().transfers_pulled, 1);
}

#[tokio::test]
async fn moriio_wrong_phase_and_missing_address_fail() {
    let p = engine(Role::Prefill, Connector::Moriio).await;
    let d = engine(Role::Decode, Connector::Moriio).await;
    let side = p.side_channel_port().unwrap();
    // The decode leg's parameters sent to the prefill, and the other way round.
    let (s, _, _) = post_h(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":1,"kv_transfer_params":moriio_params(false, side)}),
        &[("X-Request-Id", "w1")],
    )
    .await;
    assert_eq!(s, 500);
    let (s, _, _) = post_h(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":1,"kv_transfer_params":moriio_params(true, side)}),
        &[("X-Request-Id", "w2")],
    )
    .await;
    assert_eq!(s, 500);
    // No address for the prefill to write to.
    let mut kvp = moriio_params(true, 6301);
    kvp.as_object_mut().unwrap().remove("remote_host");
    let (s, _, _) = post_h(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":1,"kv_transfer_params":kvp}),
        &[("X-Request-Id", "w3")],
    )
    .await;
    assert_eq!(s, 500);
}

#[tokio::test]
async fn moriio_read_mode_needs_the_prefill_blocks() {
    let p = engine(Role::Prefill, Connector::MoriioRead).await;
    let d = engine(Role::Decode, Connector::MoriioRead).await;
    let side = p.side_channel_port().unwrap();
    let (s, _, v) = post_h(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":1,"stream":false,"kv_transfer_params":moriio_params(true, 6301)}),
        &[("X-Request-Id", "r1")],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let answer = &v["kv_transfer_params"];
    assert!(answer["remote_engine_id"].is_string(), "{v}");
    assert!(answer["remote_block_ids"].is_array(), "{v}");
    // Without the blocks the decode cannot read.
    let (s, _, _) = post_h(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"kv_transfer_params":moriio_params(false, side)}),
        &[("X-Request-Id", "r1")],
    )
    .await;
    assert_eq!(s, 500);
    let mut kvp = moriio_params(false, side);
    kvp["remote_engine_id"] = answer["remote_engine_id"].clone();
    kvp["remote_block_ids"] = answer["remote_block_ids"].clone();
    let (s, _, v) = post_h(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"kv_transfer_params":kvp}),
        &[("X-Request-Id", "r1")],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(d.stats().transfers_pulled, 1);
}

#[tokio::test]
async fn trtllm_context_then_generation() {
    let p = engine(Role::Prefill, Connector::Trtllm).await;
    let d = engine(Role::Decode, Connector::Trtllm).await;
    let (s, _, ctx) = post(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":4,"stream":false,
            "disaggregated_params":{"request_type":"context_only","disagg_request_id":9}}),
    )
    .await;
    assert_eq!(s, 200, "{ctx}");
    let params = ctx["choices"][0]["disaggregated_params"].clone();
    assert_eq!(params["request_type"], "context_only");
    assert_eq!(params["disagg_request_id"], 9);
    assert!(params["ctx_request_id"].is_u64(), "{ctx}");
    assert!(ctx.get("prompt_token_ids").is_some(), "{ctx}");
    // The wrong phase: the context params sent back unchanged.
    let (s, _, _) = post(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"disaggregated_params":params}),
    )
    .await;
    assert_eq!(s, 400);
    // A generation request without the opaque state has no address to load from.
    let mut no_state = params.clone();
    no_state["request_type"] = json!("generation_only");
    no_state.as_object_mut().unwrap().remove("opaque_state");
    let (s, _, _) = post(
        completions(&d),
        &json!({"prompt":PROMPT,"max_tokens":4,"disaggregated_params":no_state}),
    )
    .await;
    assert_eq!(s, 500);
    let mut gen_params = params.clone();
    gen_params["request_type"] = json!("generation_only");
    let gen_req = json!({"prompt":PROMPT,"max_tokens":4,"disaggregated_params":gen_params});
    let (s, _, v) = post(completions(&d), &gen_req).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(d.stats().transfers_pulled, 1);
    // The context's KV is handed over once: the same ctx_request_id again fails.
    let (s, _, _) = post(completions(&d), &gen_req).await;
    assert_eq!(s, 500);
    // A generation request sent to a context server: refused before any work.
    let (s, _, _) = post(
        completions(&p),
        &json!({"prompt":PROMPT,"max_tokens":1,"disaggregated_params":gen_params}),
    )
    .await;
    assert_eq!(s, 400);
}
