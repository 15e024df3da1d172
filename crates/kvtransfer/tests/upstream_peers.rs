//! Acceptance cases for the connectors whose legs name their peer (contracts §10-§12), taken
//! from the upstream examples: vLLM's `disagg_proxy_p2p_nccl_xpyd.py` and P2pNcclConnector's
//! `parse_request_id`, vLLM's `moriio_toy_proxy_server.py` and MoRIIO's `add_new_req`, and
//! TensorRT-LLM's `openai_disagg_service.py` (`_get_ctx_request`, `_get_gen_request`,
//! `_verify_ctx_response`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use bytes::Bytes;
use kvtransfer::{
    AgentError, Dispatch, JsonBody, KvTransferAgent, MergeOutcome, Pod, Registry, RoutingContext,
};
use serde_json::{Value, json};

fn json(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap()
}

fn body(s: &str) -> JsonBody {
    JsonBody::parse(Bytes::copy_from_slice(s.as_bytes())).unwrap()
}

fn agent(name: &str) -> Arc<dyn KvTransferAgent> {
    Registry::with_builtins().resolve(name).unwrap()
}

fn prefill_pod() -> Pod {
    Pod::new("p", "10.0.0.1", 8100)
}

fn decode_pod() -> Pod {
    Pod::new("d", "10.0.0.2", 8200)
}

/// Both legs through `connector`: (prefill body, prefill X-Request-Id, decode body, outcome).
fn legs(
    connector: &str,
    client: &str,
    prefill: &Pod,
    decode: &Pod,
    answer: &[u8],
) -> (
    Value,
    Option<String>,
    Result<MergeOutcome, AgentError>,
    RoutingContext,
) {
    let a = agent(connector);
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("client-id", b.clone());
    a.bind_decode(&mut ctx, decode).unwrap();
    let leg = a.augment_prefill_request(&mut ctx, prefill, &b).unwrap();
    let id = ctx.transfer.leg_request_id.clone();
    let merged = a.merge_prefill_response(&mut ctx, answer, prefill);
    (json(&leg.body), id, merged, ctx)
}

/// `re.search(r"___decode_addr_(.*):(\d+)", id)` and `r"___prefill_addr_(.*):(\d+)___"` as
/// P2pNcclConnector.parse_request_id runs them (greedy `.*`: the last `:digits`).
fn vllm_parse_request_id(id: &str, is_prefill: bool) -> Option<(String, u16)> {
    let (marker, tail) = if is_prefill {
        ("___decode_addr_", None)
    } else {
        ("___prefill_addr_", Some("___"))
    };
    let rest = &id[id.find(marker)? + marker.len()..];
    // Greedy: the last ':' followed by digits (and, for the prefill form, by "___").
    rest.match_indices(':').rev().find_map(|(i, _)| {
        let digits: String = rest[i + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if digits.is_empty() {
            return None;
        }
        if let Some(t) = tail
            && !rest[i + 1 + digits.len()..].starts_with(t)
        {
            return None;
        }
        Some((rest[..i].to_owned(), digits.parse().ok()?))
    })
}

#[test]
fn p2pnccl_proxy_request_id_names_both_zmq_addresses() {
    let p = prefill_pod().with_annotation(kvtransfer::P2P_NCCL_KV_PORT, "21001");
    let d = decode_pod();
    let client = r#"{"model":"m","prompt":"hi","max_tokens":9,"stream":true}"#;
    let (prefill, id, merged, ctx) = legs("p2pnccl", client, &p, &d, br#"{"id":"x"}"#);
    let id = id.unwrap();
    assert_eq!(merged.unwrap(), MergeOutcome::KvAttached);
    // The proxy's form: ___prefill_addr_<P zmq>___decode_addr_<D zmq>_<uuid hex>.
    let prefix = "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:14579_";
    assert!(id.starts_with(prefix), "{id}");
    let hex = &id[prefix.len()..];
    assert_eq!(hex.len(), 32);
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    // What each engine reads out of it.
    assert_eq!(
        vllm_parse_request_id(&id, true),
        Some(("10.0.0.2".into(), 14579))
    );
    assert_eq!(
        vllm_parse_request_id(&id, false),
        Some(("10.0.0.1".into(), 21001))
    );
    // vLLM wraps the header id ("cmpl-<id>-0-<8 hex>"): still parsed the same.
    let wrapped = format!("cmpl-{id}-0-1a2b3c4d");
    assert_eq!(
        vllm_parse_request_id(&wrapped, false),
        Some(("10.0.0.1".into(), 21001))
    );
    // The prefill leg: one token, not streamed, no transfer fields.
    assert_eq!(prefill["max_tokens"], 1);
    assert_eq!(prefill["stream"], false);
    assert!(prefill.get("kv_transfer_params").is_none());
    // The decode leg is the client's body as sent.
    assert_eq!(&ctx.req_body[..], client.as_bytes());
}

#[test]
fn p2pnccl_ipv6_addresses_are_bracketed_and_still_parse() {
    let p = Pod::new("p", "fd00::1", 8000);
    let d = Pod::new("d", "fd00::2", 8000);
    let (_, id, _, _) = legs("p2pnccl", r#"{"prompt":"x"}"#, &p, &d, b"{}");
    let id = id.unwrap();
    assert!(id.starts_with("___prefill_addr_[fd00::1]:14579___decode_addr_[fd00::2]:14579_"));
    assert_eq!(
        vllm_parse_request_id(&id, true),
        Some(("[fd00::2]".into(), 14579))
    );
    let (pa, da) = kvtransfer::parse_addressed_request_id(&id).unwrap();
    assert_eq!(
        kvtransfer::split_zmq_address(pa),
        Some(("[fd00::1]", 14579))
    );
    assert_eq!(
        kvtransfer::split_zmq_address(da),
        Some(("[fd00::2]", 14579))
    );
}

#[test]
fn p2pnccl_ids_are_never_reused() {
    let ids: std::collections::BTreeSet<String> = (0..16)
        .map(|_| {
            legs(
                "p2pnccl",
                r#"{"prompt":"x"}"#,
                &prefill_pod(),
                &decode_pod(),
                b"{}",
            )
            .1
            .unwrap()
        })
        .collect();
    assert_eq!(ids.len(), 16);
}

#[test]
fn p2pnccl_errors() {
    let a = agent("p2pnccl");
    let b = body(r#"{"prompt":"x"}"#);
    // No decode bound: the prefill cannot be told where to send.
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    assert!(matches!(
        a.augment_prefill_request(&mut ctx, &prefill_pod(), &b),
        Err(AgentError::MissingState(_))
    ));
    // A decode without an IP.
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    assert!(matches!(
        a.bind_decode(&mut ctx, &Pod::new("d", "", 8000)),
        Err(AgentError::NoPodIp { .. })
    ));
    // A malformed prefill answer.
    for bad in [&b"[1]"[..], b"not json", b"{\"a\":"] {
        let (_, _, merged, _) = legs(
            "p2pnccl",
            r#"{"prompt":"x"}"#,
            &prefill_pod(),
            &decode_pod(),
            bad,
        );
        assert!(
            matches!(merged, Err(AgentError::PrefillResponse { .. })),
            "{bad:?}: {merged:?}"
        );
    }
    // Merge without augment.
    let mut ctx = RoutingContext::from_parsed("r", b);
    assert!(matches!(
        a.merge_prefill_response(&mut ctx, b"{}", &prefill_pod()),
        Err(AgentError::MissingState(_))
    ));
}

#[test]
fn moriio_toy_proxy_prefill_and_decode_params() {
    let p = prefill_pod()
        .with_annotation(kvtransfer::MORIIO_HANDSHAKE_PORT, "7301")
        .with_annotation(kvtransfer::MORIIO_NOTIFY_PORT, "62005")
        .with_annotation(kvtransfer::MORIIO_DP_SIZE, "2");
    let d = decode_pod().with_annotation(kvtransfer::MORIIO_TP_SIZE, "8");
    let client = r#"{"model":"m","prompt":"hi","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#;
    let (prefill, id, merged, ctx) = legs("moriio", client, &p, &d, b"");
    assert_eq!(merged.unwrap(), MergeOutcome::KvAttached);
    assert_eq!(prefill["stream"], false);
    assert_eq!(prefill["max_tokens"], 1);
    assert!(prefill.get("stream_options").is_none());
    // send_request_to_prefill: the decode's address.
    assert_eq!(
        prefill["kv_transfer_params"],
        json!({"do_remote_decode":true,"do_remote_prefill":false,"remote_handshake_port":6301,
            "remote_notify_port":61005,"remote_engine_id":null,"remote_block_ids":null,
            "remote_host":"10.0.0.2","remote_port":8200,"remote_dp_size":1,"remote_tp_size":8})
    );
    // The decode leg: the prefill's address, the client's stream and limits.
    let decode = json(&ctx.req_body);
    assert_eq!(
        decode["kv_transfer_params"],
        json!({"do_remote_decode":false,"do_remote_prefill":true,"remote_handshake_port":7301,
            "remote_notify_port":62005,"remote_engine_id":null,"remote_block_ids":null,
            "remote_host":"10.0.0.1","remote_port":8100,"remote_dp_size":2,"remote_tp_size":1})
    );
    assert_eq!(decode["stream"], true);
    assert_eq!(decode["max_tokens"], 5);
    // The id newer connectors parse (`_PREFILL_ZMQ_RE`, `_DECODE_ZMQ_RE`).
    let id = id.unwrap();
    let prefix = "___prefill_addr_host:10.0.0.1,handshake:7301,notify:62005___decode_addr_host:10.0.0.2,handshake:6301,notify:61005_";
    assert!(id.starts_with(prefix), "{id}");
    assert_eq!(id.len(), prefix.len() + 32);
}

#[test]
fn moriio_modes_schedule_as_the_connector_needs() {
    assert_eq!(agent("moriio").dispatch(), Dispatch::Concurrent);
    assert_eq!(agent("moriio-read").dispatch(), Dispatch::Sequential);
    assert_eq!(agent("moriio").connector_type(), "moriio");
    assert_eq!(agent("moriio-read").connector_type(), "moriio-read");
}

#[test]
fn moriio_read_mode_copies_the_prefill_blocks() {
    let answer = br#"{"id":"c","kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"eng-1","remote_block_ids":[[3,4,5]],"remote_host":"10.9.9.9"}}"#;
    let (_, _, merged, ctx) = legs(
        "moriio-read",
        r#"{"prompt":"x"}"#,
        &prefill_pod(),
        &decode_pod(),
        answer,
    );
    assert_eq!(merged.unwrap(), MergeOutcome::KvAttached);
    let kvp = &json(&ctx.req_body)["kv_transfer_params"];
    assert_eq!(kvp["remote_engine_id"], "eng-1");
    assert_eq!(kvp["remote_block_ids"], json!([[3, 4, 5]]));
    // Always the prefill pod's own address, never what the engine advertised.
    assert_eq!(kvp["remote_host"], "10.0.0.1");
    // No parameters: the decode recomputes.
    let (_, _, merged, ctx) = legs(
        "moriio-read",
        r#"{"prompt":"x"}"#,
        &prefill_pod(),
        &decode_pod(),
        br#"{"id":"c"}"#,
    );
    assert_eq!(merged.unwrap(), MergeOutcome::Recompute);
    assert!(json(&ctx.req_body).get("kv_transfer_params").is_none());
    // Parameters without what read mode needs, or of the wrong type.
    for bad in [
        &br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#[..],
        br#"{"kv_transfer_params":{"remote_block_ids":[1]}}"#,
        br#"{"kv_transfer_params":{"remote_engine_id":null,"remote_block_ids":[1]}}"#,
    ] {
        let (_, _, merged, _) = legs(
            "moriio-read",
            r#"{"prompt":"x"}"#,
            &prefill_pod(),
            &decode_pod(),
            bad,
        );
        assert!(
            matches!(merged, Err(AgentError::PrefillResponse { .. })),
            "{merged:?}"
        );
    }
    let (_, _, merged, _) = legs(
        "moriio-read",
        r#"{"prompt":"x"}"#,
        &prefill_pod(),
        &decode_pod(),
        br#"{"kv_transfer_params":[1]}"#,
    );
    assert!(matches!(
        merged,
        Err(AgentError::UnexpectedType { found: "array", .. })
    ));
}

#[test]
fn trtllm_context_request_is_context_only_and_not_streamed() {
    let client = r#"{"model":"m","prompt":"hi","max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}"#;
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    let a = agent("trtllm");
    a.bind_decode(&mut ctx, &decode_pod()).unwrap();
    let leg = json(
        &a.augment_prefill_request(&mut ctx, &prefill_pod(), &b)
            .unwrap()
            .body,
    );
    assert_eq!(leg["disaggregated_params"]["request_type"], "context_only");
    let id = leg["disaggregated_params"]["disagg_request_id"]
        .as_u64()
        .unwrap();
    assert!(id >= 1);
    assert_eq!(leg["stream"], false);
    assert!(leg.get("stream_options").is_none());
    // The context server generates its one token itself: the client's limit is untouched.
    assert_eq!(leg["max_tokens"], 7);
    // No address in the id: TensorRT-LLM routes by its own parameters.
    assert!(ctx.transfer.leg_request_id.is_none());
}

/// A context server's answer in `trtllm-serve`'s shape.
const CTX_ANSWER: &str = r#"{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":" a","finish_reason":"length","disaggregated_params":{"request_type":"context_only","first_gen_tokens":[319],"ctx_request_id":12345678901234567,"encoded_opaque_state":"AAEC/w==","draft_tokens":null,"disagg_request_id":1}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"prompt_token_ids":[1,2,3]}"#;

#[test]
fn trtllm_generation_request_carries_the_context_params_back() {
    let (_, _, merged, ctx) = legs(
        "trtllm",
        r#"{"model":"m","prompt":"hi","max_tokens":7,"stream":true}"#,
        &prefill_pod(),
        &decode_pod(),
        CTX_ANSWER.as_bytes(),
    );
    assert_eq!(merged.unwrap(), MergeOutcome::KvAttached);
    let text = std::str::from_utf8(&ctx.req_body).unwrap();
    // The opaque state and the big ctx_request_id travel byte for byte.
    assert!(
        text.contains(r#""ctx_request_id":12345678901234567"#),
        "{text}"
    );
    assert!(
        text.contains(r#""encoded_opaque_state":"AAEC/w==""#),
        "{text}"
    );
    let v = json(&ctx.req_body);
    let d = &v["disaggregated_params"];
    assert_eq!(d["request_type"], "generation_only");
    assert_eq!(d["first_gen_tokens"], json!([319]));
    assert_ne!(
        d["disagg_request_id"], 1,
        "the gateway's id, not the engine's echo"
    );
    // Completions: the prompt becomes the context server's token ids.
    assert_eq!(v["prompt"], json!([1, 2, 3]));
    assert_eq!(v["stream"], true);
    assert_eq!(v["max_tokens"], 7);
    // Chat: the token ids go beside the messages.
    let (_, _, _, ctx) = legs(
        "trtllm",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        &prefill_pod(),
        &decode_pod(),
        CTX_ANSWER.as_bytes(),
    );
    let v = json(&ctx.req_body);
    assert_eq!(v["prompt_token_ids"], json!([1, 2, 3]));
    assert_eq!(v["messages"][0]["content"], "hi");
}

#[test]
fn trtllm_malformed_context_answers_fail_as_the_disagg_server_does() {
    let two = CTX_ANSWER.replace(r#""choices":[{"#, r#""choices":[{"index":1},{"#);
    let none = CTX_ANSWER.replace(r#""disaggregated_params":{"#, r#""other":{"#);
    let null_ctx = CTX_ANSWER.replace(
        r#""ctx_request_id":12345678901234567"#,
        r#""ctx_request_id":null"#,
    );
    type Expect = fn(&AgentError) -> bool;
    let cases: [(&str, Expect); 4] = [
        (&two, |e| matches!(e, AgentError::PrefillResponse { .. })),
        (&none, |e| {
            matches!(
                e,
                AgentError::MissingHandoff {
                    what: "disaggregated_params",
                    ..
                }
            )
        }),
        (&null_ctx, |e| {
            matches!(e, AgentError::MissingHandoff { .. })
        }),
        ("not json", |e| {
            matches!(e, AgentError::PrefillResponse { .. })
        }),
    ];
    for (answer, want) in cases {
        let (_, _, merged, _) = legs(
            "trtllm",
            r#"{"prompt":"x"}"#,
            &prefill_pod(),
            &decode_pod(),
            answer.as_bytes(),
        );
        let err = merged.unwrap_err();
        assert!(want(&err), "{answer}: {err}");
    }
    // Finished in the context phase: nothing to hand over, the plain request goes on.
    let stop = CTX_ANSWER.replace(r#""finish_reason":"length""#, r#""finish_reason":"stop""#);
    let (_, _, merged, ctx) = legs(
        "trtllm",
        r#"{"prompt":"x"}"#,
        &prefill_pod(),
        &decode_pod(),
        stop.as_bytes(),
    );
    assert_eq!(merged.unwrap(), MergeOutcome::Recompute);
    assert_eq!(&ctx.req_body[..], br#"{"prompt":"x"}"#);
}

#[test]
fn client_supplied_peer_fields_never_reach_an_engine() {
    let client = r#"{"prompt":"x","kv_transfer_params":{"remote_host":"169.254.169.254"},"disaggregated_params":{"request_type":"generation_only","opaque_state":"evil"}}"#;
    for name in ["p2pnccl", "moriio", "moriio-read", "trtllm"] {
        let mut b = body(client);
        kvtransfer::strip_client_transfer_fields(&mut b);
        let a = agent(name);
        let mut ctx = RoutingContext::from_parsed("r", b.clone());
        a.bind_decode(&mut ctx, &decode_pod()).unwrap();
        let leg = json(
            &a.augment_prefill_request(&mut ctx, &prefill_pod(), &b)
                .unwrap()
                .body,
        );
        let text = leg.to_string();
        assert!(
            !text.contains("169.254.169.254") && !text.contains("evil"),
            "{name}: {text}"
        );
    }
}

#[test]
fn capabilities_are_properties_of_the_agents() {
    for (name, responses, decode_only) in [
        ("shfs", true, true),
        ("mooncake", true, true),
        ("nixl", false, true),
        ("sglang", false, false),
        ("p2pnccl", false, false),
        ("moriio", false, true),
        ("moriio-read", false, true),
        ("trtllm", false, true),
    ] {
        let a = agent(name);
        assert_eq!(a.carries_responses_and_messages(), responses, "{name}");
        assert_eq!(a.allows_decode_only(), decode_only, "{name}");
        assert!(!a.supports_batch() || name == "sglang", "{name}");
    }
}
