//! Edge cases beyond the upstream suite: IPv6, labels, stripping, unicode,
//! big bodies, per-agent error paths, registries.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use kvtransfer::{
    AgentError, BodyError, CONNECTOR_TYPE_IDENTIFIER, Dispatch, JsonBody, KvTransferAgent,
    MergeOutcome, MooncakeBootstrap, MooncakeRank, Pod, PrefillRequest, Registry, RegistryError,
    RoutingContext, labels, strip_client_transfer_fields,
};
use serde_json::Value;

fn json(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap()
}

fn body(s: &str) -> JsonBody {
    JsonBody::parse(Bytes::copy_from_slice(s.as_bytes())).unwrap()
}

fn agent(name: &str) -> Arc<dyn KvTransferAgent> {
    Registry::with_builtins().resolve(name).unwrap()
}

fn mooncake_bootstrap(ranks: &[(u32, &str)]) -> MooncakeBootstrap {
    MooncakeBootstrap {
        port: 8998,
        ranks: ranks
            .iter()
            .map(|(r, id)| {
                (
                    *r,
                    MooncakeRank {
                        engine_id: (*id).to_owned(),
                        worker_addr: BTreeMap::new(),
                    },
                )
            })
            .collect(),
    }
}

/// Runs augment then merge (with `response`) and returns (prefill leg, decode body).
fn both_legs(
    connector: &str,
    pod: &Pod,
    client: &str,
    response: &[u8],
) -> (PrefillRequest, Bytes, MergeOutcome) {
    let a = agent(connector);
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("req-1", b.clone());
    let leg = a.augment_prefill_request(&mut ctx, pod, &b).unwrap();
    let outcome = a.merge_prefill_response(&mut ctx, response, pod).unwrap();
    (leg, ctx.req_body, outcome)
}

#[test]
fn label_whitespace_and_case_are_normalised() {
    let r = Registry::with_builtins();
    assert_eq!(r.resolve_connector_type("  NIXL\t", "shfs"), "nixl");
    assert_eq!(r.resolve_connector_type("   ", "shfs"), "shfs");
    assert_eq!(r.resolve_connector_type("", " MoonCake "), "mooncake");
    let pod = Pod::new("p", "1.1.1.1", 8000).with_label(CONNECTOR_TYPE_IDENTIFIER, "");
    assert_eq!(
        r.resolve_agent_for_pod(Some(&pod), "sglang")
            .unwrap()
            .connector_type(),
        "sglang"
    );
    assert_eq!(labels::KV_CONNECTOR_TYPE, CONNECTOR_TYPE_IDENTIFIER);
}

#[test]
fn bad_default_fails_validation_and_resolution() {
    let r = Registry::with_builtins();
    assert_eq!(r.validate_default(" SHFS ").unwrap(), "shfs");
    let err = r.validate_default("nope").unwrap_err();
    assert!(
        err.to_string()
            .contains("(valid: [mooncake moriio moriio-read nixl p2pnccl sglang shfs trtllm])"),
        "{err}"
    );
    let pod = Pod::new("p", "1.1.1.1", 8000);
    assert!(matches!(
        r.resolve_agent_for_pod(Some(&pod), "nope"),
        Err(RegistryError::Unknown { .. })
    ));
    assert!(Registry::with_builtins().validate_default("nope").is_err());
}

#[test]
fn empty_registry_lists_nothing() {
    let r = Registry::empty();
    assert!(r.valid_agent_names().is_empty());
    let err = r.resolve("shfs").unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"unknown KV transfer connector type "shfs" (valid: [])"#
    );
}

#[test]
fn owned_registry_is_independent_of_global() {
    #[derive(Debug)]
    struct Custom;
    impl KvTransferAgent for Custom {
        fn connector_type(&self) -> &'static str {
            "custom-owned"
        }
        fn augment_prefill_request(
            &self,
            _: &mut RoutingContext,
            _: &Pod,
            request: &JsonBody,
        ) -> Result<PrefillRequest, AgentError> {
            Ok(PrefillRequest::new(request.to_bytes()))
        }
        fn merge_prefill_response(
            &self,
            _: &mut RoutingContext,
            _: &[u8],
            _: &Pod,
        ) -> Result<MergeOutcome, AgentError> {
            Ok(MergeOutcome::Recompute)
        }
    }
    let mut owned = Registry::with_builtins();
    owned.register(
        "custom-owned",
        kvtransfer::registry::shared_factory(Arc::new(Custom)),
    );
    assert!(owned.resolve("custom-owned").is_ok());
    // Registries are owned: registering in one leaves every other unchanged.
    assert!(Registry::with_builtins().resolve("custom-owned").is_err());
    owned.register("custom-factory", Arc::new(|| Arc::new(Custom)));
    assert_eq!(
        owned.resolve("custom-factory").unwrap().connector_type(),
        "custom-owned"
    );
    assert!(
        owned
            .valid_agent_names()
            .iter()
            .any(|n| n == "custom-factory")
    );
}

#[test]
fn dispatch_and_batch_flags() {
    let r = Registry::with_builtins();
    let flags = |n: &str| {
        let a = r.resolve(n).unwrap();
        (a.dispatch(), a.supports_batch())
    };
    assert_eq!(flags("shfs"), (Dispatch::Sequential, false));
    assert_eq!(flags("nixl"), (Dispatch::Sequential, false));
    assert_eq!(flags("mooncake"), (Dispatch::Concurrent, false));
    assert_eq!(flags("sglang"), (Dispatch::Concurrent, true));
}

#[test]
fn client_transfer_fields_never_reach_either_leg() {
    let client = r#"{"model":"m","prompt":"p","kv_transfer_params":{"remote_host":"169.254.169.254","remote_port":80},"bootstrap_host":"evil","bootstrap_room":7,"transfer_id":"t","disagg_prefill_resp":{"x":1}}"#;
    let ip_pod = Pod::new("p", "10.0.0.9", 8000);
    let moon = ip_pod
        .clone()
        .with_mooncake_bootstrap(mooncake_bootstrap(&[(0, "e0")]));
    for (name, pod, resp) in [
        (
            "shfs",
            &ip_pod,
            &br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#[..],
        ),
        ("shfs", &ip_pod, &br#"{"id":"no-params"}"#[..]),
        ("nixl", &ip_pod, &br#"{"id":"x"}"#[..]),
        ("mooncake", &moon, &b""[..]),
        ("sglang", &ip_pod, &b""[..]),
    ] {
        let (leg, decode, _) = both_legs(name, pod, client, resp);
        for (which, bytes) in [("prefill", &leg.body), ("decode", &decode)] {
            let text = std::str::from_utf8(bytes).unwrap();
            assert!(!text.contains("169.254"), "{name} {which}: {text}");
            assert!(!text.contains("evil"), "{name} {which}: {text}");
            assert!(!text.contains(r#""transfer_id":"t""#), "{name} {which}");
            let v = json(bytes);
            if name != "nixl" || which == "prefill" {
                assert!(v.get("disagg_prefill_resp").is_none(), "{name} {which}");
            }
            if name != "sglang" {
                assert!(v.get("bootstrap_room").is_none(), "{name} {which}");
            }
        }
    }
}

#[test]
fn shfs_keeps_ipv6_raw_in_remote_host() {
    // vLLM brackets IPv6 itself when it builds the side-channel address.
    let pod = Pod::new("p", "fd00::1", 8000);
    let (_, decode, _) = both_legs(
        "shfs",
        &pod,
        r#"{"prompt":"x"}"#,
        br#"{"kv_transfer_params":{"remote_engine_id":"e","remote_port":5600}}"#,
    );
    assert_eq!(
        json(&decode)["kv_transfer_params"]["remote_host"],
        "fd00::1"
    );
}

#[test]
fn mooncake_ipv6_bootstrap_addr_has_brackets() {
    let pod = Pod::new("p", "fd00::7", 8000).with_mooncake_bootstrap(MooncakeBootstrap {
        port: 9000,
        ..mooncake_bootstrap(&[(0, "e0")])
    });
    let (leg, decode, _) = both_legs("mooncake", &pod, r#"{"prompt":"x"}"#, b"");
    assert_eq!(
        json(&decode)["kv_transfer_params"]["remote_bootstrap_addr"],
        "http://[fd00::7]:9000"
    );
    assert_eq!(leg.headers[0].0, "x-data-parallel-rank");
}

#[test]
fn mooncake_rank_choice_matches_engine_and_header() {
    let pod = Pod::new("p", "10.0.0.1", 8000).with_mooncake_bootstrap(mooncake_bootstrap(&[
        (0, "e0"),
        (1, "e1"),
        (5, "e5"),
    ]));
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..48 {
        let a = agent("mooncake");
        let b = body(r#"{"prompt":"x"}"#);
        let mut ctx = RoutingContext::from_parsed(format!("req-{i}"), b.clone());
        let leg = a.augment_prefill_request(&mut ctx, &pod, &b).unwrap();
        a.merge_prefill_response(&mut ctx, b"", &pod).unwrap();
        let rank = leg.headers[0].1.to_str().unwrap().to_owned();
        let engine = json(&ctx.req_body)["kv_transfer_params"]["remote_engine_id"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(engine, format!("e{rank}"));
        assert_eq!(ctx.transfer.dp_rank.unwrap().to_string(), rank);
        seen.insert(rank);
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
}

#[test]
fn mooncake_merge_without_augment_derives_same_ids() {
    let pod = Pod::new("p", "10.0.0.1", 8000)
        .with_mooncake_bootstrap(mooncake_bootstrap(&[(0, "e0"), (1, "e1")]));
    let (leg, decode, _) = both_legs("mooncake", &pod, r#"{"prompt":"x"}"#, b"");
    let mut fresh = RoutingContext::new("req-1", Bytes::from_static(br#"{"prompt":"x"}"#));
    agent("mooncake")
        .merge_prefill_response(&mut fresh, b"", &pod)
        .unwrap();
    assert_eq!(fresh.req_body, decode);
    assert_eq!(
        json(&leg.body)["kv_transfer_params"]["transfer_id"],
        "xfer-req-1"
    );
}

#[test]
fn mooncake_transfer_ids_follow_the_transfer_key_not_the_request_id() {
    let pod =
        Pod::new("p", "10.0.0.1", 8000).with_mooncake_bootstrap(mooncake_bootstrap(&[(0, "e0")]));
    let b = body(r#"{"prompt":"x"}"#);
    let mut ids = Vec::new();
    for key in ["k1", "k2"] {
        let mut ctx = RoutingContext::from_parsed("same-client-id", b.clone());
        ctx.transfer_key = key.to_string();
        let leg = agent("mooncake")
            .augment_prefill_request(&mut ctx, &pod, &b)
            .unwrap();
        agent("mooncake")
            .merge_prefill_response(&mut ctx, b"", &pod)
            .unwrap();
        let prefill_id = json(&leg.body)["kv_transfer_params"]["transfer_id"].clone();
        assert_eq!(
            json(&ctx.req_body)["kv_transfer_params"]["transfer_id"],
            prefill_id
        );
        ids.push(prefill_id);
    }
    assert_eq!(ids, ["xfer-k1", "xfer-k2"]);
}

#[test]
fn the_request_check_hook_is_vllm_by_default_and_off_for_sglang() {
    let bad = body(r#"{"prompt":"x","max_tokens":0}"#);
    let ep = kvtransfer::checks::Endpoint::Completions;
    for name in ["shfs", "nixl", "mooncake"] {
        let err = agent(name).check_request(&bad, ep).unwrap_err();
        assert_eq!(err.param, Some("max_tokens"), "{name}");
    }
    assert!(agent("sglang").check_request(&bad, ep).is_ok());
}

#[test]
fn mooncake_without_bootstrap_info_is_clear_error() {
    let pod = Pod::new("prefill-9", "10.0.0.1", 8000);
    let b = body(r#"{"prompt":"x"}"#);
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    let err = agent("mooncake")
        .augment_prefill_request(&mut ctx, &pod, &b)
        .unwrap_err();
    assert!(matches!(err, AgentError::NoBootstrap { .. }));
    assert!(err.to_string().contains("prefill-9"), "{err}");
    let empty = pod.with_mooncake_bootstrap(mooncake_bootstrap(&[]));
    assert!(
        agent("mooncake")
            .merge_prefill_response(&mut ctx, b"", &empty)
            .is_err()
    );
}

#[test]
fn mooncake_prefill_leg_follows_common_rules() {
    let pod =
        Pod::new("p", "10.0.0.1", 8000).with_mooncake_bootstrap(mooncake_bootstrap(&[(0, "e0")]));
    let client = r#"{"model":"m","prompt":"x","max_tokens":50,"stream":true,"stream_options":{"include_usage":true},"stop":["\n"]}"#;
    let (leg, decode, _) = both_legs("mooncake", &pod, client, b"");
    let p = json(&leg.body);
    assert_eq!(p["max_tokens"], 1);
    assert_eq!(p["stream"], false);
    assert_eq!(p["ignore_eos"], true);
    assert!(p.get("stream_options").is_none() && p.get("stop").is_none());
    let d = json(&decode);
    assert_eq!(d["max_tokens"], 50);
    assert_eq!(d["stream"], true);
    assert_eq!(d["stream_options"]["include_usage"], true);
    assert_eq!(d["stop"][0], "\n");
}

#[test]
fn sglang_legs_are_identical_and_carry_bootstrap() {
    let pod =
        Pod::new("p", "10.3.3.3", 30000).with_annotation(labels::SGLANG_BOOTSTRAP_PORT, "30001");
    let client =
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":9,"stream":true}"#;
    let a = agent("sglang");
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    let leg = a.augment_prefill_request(&mut ctx, &pod, &b).unwrap();
    assert_eq!(
        a.merge_prefill_response(&mut ctx, b"", &pod).unwrap(),
        MergeOutcome::KvAttached
    );
    assert_eq!(leg.body, ctx.req_body);
    let v = json(&leg.body);
    assert_eq!(v["bootstrap_host"], "10.3.3.3");
    assert_eq!(v["bootstrap_port"], 30001);
    assert_eq!(v["bootstrap_room"], ctx.transfer.bootstrap_room.unwrap());
    assert!(ctx.transfer.bootstrap_room.unwrap() <= i64::MAX as u64);
    // No prefill-leg rules for SGLang.
    assert_eq!(v["max_tokens"], 9);
    assert_eq!(v["stream"], true);
    assert!(leg.body.starts_with(
        br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":9,"stream":true,"#
    ));
}

#[test]
fn sglang_batch_gets_arrays_and_ipv6_brackets() {
    let pod = Pod::new("p", "fd00::3", 30000);
    let (leg, decode, _) = both_legs("sglang", &pod, r#"{"prompt":["a","b","c"]}"#, b"");
    assert_eq!(leg.body, decode);
    let v = json(&decode);
    let rooms = v["bootstrap_room"].as_array().unwrap();
    assert_eq!(rooms.len(), 3);
    assert_eq!(
        v["bootstrap_host"],
        serde_json::json!(["[fd00::3]", "[fd00::3]", "[fd00::3]"])
    );
    assert_eq!(v["bootstrap_port"], serde_json::json!([8998, 8998, 8998]));
    let distinct: std::collections::BTreeSet<_> =
        rooms.iter().map(|r| r.as_u64().unwrap()).collect();
    assert_eq!(distinct.len(), 3);
    // SGLang repeats list fields `n` times itself: one entry per prompt.
    let (_, decode, _) = both_legs("sglang", &pod, r#"{"prompt":["a","b"],"n":3}"#, b"");
    assert_eq!(json(&decode)["bootstrap_room"].as_array().unwrap().len(), 2);
    let (_, decode, _) = both_legs("sglang", &pod, r#"{"prompt":"a","n":2}"#, b"");
    assert!(json(&decode)["bootstrap_room"].is_u64());
    assert_eq!(json(&decode)["bootstrap_host"], "[fd00::3]");
}

#[test]
fn sglang_merge_before_augment_is_an_error() {
    let pod = Pod::new("p", "10.3.3.3", 30000);
    let mut ctx = RoutingContext::new("r", Bytes::from_static(b"{}"));
    let err = agent("sglang")
        .merge_prefill_response(&mut ctx, b"", &pod)
        .unwrap_err();
    assert!(matches!(err, AgentError::MissingState(_)));
}

#[test]
fn nixl_rejects_non_object_and_garbage_responses() {
    let pod = Pod::new("p", "10.1.1.1", 8000);
    for bad in [&b""[..], b"  ", b"[1]", b"\"s\"", b"{\"a\":", b"{} x"] {
        let mut ctx = RoutingContext::new("r", Bytes::from_static(b"{\"prompt\":\"x\"}"));
        let err = agent("nixl")
            .merge_prefill_response(&mut ctx, bad, &pod)
            .unwrap_err();
        assert!(
            matches!(err, AgentError::PrefillResponse { .. }),
            "{bad:?}: {err}"
        );
        assert_eq!(&ctx.req_body[..], b"{\"prompt\":\"x\"}");
    }
}

#[test]
fn shfs_response_edge_cases() {
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let client = r#"{"prompt":"x"}"#;
    // null params: recompute with the original body.
    let (_, decode, outcome) = both_legs("shfs", &pod, client, br#"{"kv_transfer_params":null}"#);
    assert_eq!(outcome, MergeOutcome::Recompute);
    assert_eq!(&decode[..], client.as_bytes());
    // Array / number params: unexpected type.
    for bad in [
        &br#"{"kv_transfer_params":[1]}"#[..],
        br#"{"kv_transfer_params":5}"#,
    ] {
        let mut ctx = RoutingContext::new("r", Bytes::copy_from_slice(client.as_bytes()));
        let err = agent("shfs")
            .merge_prefill_response(&mut ctx, bad, &pod)
            .unwrap_err();
        assert!(err.to_string().contains("unexpected type"), "{err}");
    }
    // Unparsable response.
    let mut ctx = RoutingContext::new("r", Bytes::copy_from_slice(client.as_bytes()));
    let err = agent("shfs")
        .merge_prefill_response(&mut ctx, b"<html>", &pod)
        .unwrap_err();
    assert!(matches!(err, AgentError::PrefillResponse { .. }));
    // Params without remote_host: appended; big ints and nesting kept.
    let (_, decode, _) = both_legs(
        "shfs",
        &pod,
        client,
        br#"{"kv_transfer_params":{"remote_block_ids":[[1, 2],[3]],"remote_request_id":"r","x":18446744073709551617}}"#,
    );
    let d = JsonBody::parse(decode).unwrap();
    assert_eq!(
        d.get_raw("kv_transfer_params").unwrap(),
        r#"{"remote_block_ids":[[1, 2],[3]],"remote_request_id":"r","x":18446744073709551617,"remote_host":"10.1.1.1"}"#
    );
}

#[test]
fn unicode_and_escaped_keys_survive_edits() {
    let client = "{\"mod\\u0065l\":\"m\",\"\u{1F600}\":\"emoji \u{00e9}\",\"k\\\"q\":1,\"stream\":true,\"max_tokens\":7}";
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let (leg, decode, _) = both_legs(
        "shfs",
        &pod,
        client,
        br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#,
    );
    let p = std::str::from_utf8(&leg.body).unwrap();
    assert!(
        p.starts_with("{\"mod\\u0065l\":\"m\",\"\u{1F600}\":\"emoji \u{00e9}\",\"k\\\"q\":1,\"stream\":false,\"max_tokens\":1"),
        "{p}"
    );
    let d = std::str::from_utf8(&decode).unwrap();
    assert!(d.starts_with(client.strip_suffix('}').unwrap()), "{d}");
    // The escaped spelling is a lookup by its unescaped name.
    let b = body(client);
    assert_eq!(b.get::<String>("model").unwrap().unwrap(), "m");
    assert!(b.contains_key("k\"q"));
}

#[test]
fn duplicate_keys_are_client_errors() {
    let dup = r#"{"prompt":"a","prompt":"b"}"#;
    assert!(matches!(
        JsonBody::parse(Bytes::from_static(dup.as_bytes())),
        Err(BodyError::DuplicateKey(k)) if k == "prompt"
    ));
    let mut ctx = RoutingContext::new("r", Bytes::from_static(dup.as_bytes()));
    let err = agent("nixl")
        .merge_prefill_response(&mut ctx, b"{}", &Pod::new("p", "1.1.1.1", 8000))
        .unwrap_err();
    assert!(err.is_client_error(), "{err}");
}

#[test]
fn ten_megabyte_body_round_trips() {
    let content = "lorem ipsum \\\"quoted\\\" \\u00e9 ".repeat(10 * 1024 * 1024 / 30);
    let client = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}],"stream":true,"max_tokens":128}}"#
    );
    assert!(client.len() > 10_000_000);
    let mut b = JsonBody::parse(Bytes::from(client.clone())).unwrap();
    assert!(strip_client_transfer_fields(&mut b).is_empty());
    assert_eq!(
        b.to_bytes().as_ptr(),
        b.raw().as_ptr(),
        "unedited => zero copy"
    );
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let (leg, decode, _) = both_legs(
        "shfs",
        &pod,
        &client,
        br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#,
    );
    let messages = b.get_raw("messages").unwrap();
    assert_eq!(
        JsonBody::parse(leg.body)
            .unwrap()
            .get_raw("messages")
            .unwrap(),
        messages
    );
    assert!(decode.starts_with(client.strip_suffix('}').unwrap().as_bytes()));
}

#[test]
fn context_original_body_after_merge_is_client_body() {
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let mut ctx = RoutingContext::new("r", Bytes::from_static(br#"{"prompt":"x"}"#));
    agent("nixl")
        .merge_prefill_response(&mut ctx, b"{\"id\":1}", &pod)
        .unwrap();
    assert!(
        ctx.original_body()
            .unwrap()
            .get_raw("disagg_prefill_resp")
            .is_none()
    );
    assert!(
        JsonBody::parse(ctx.req_body.clone())
            .unwrap()
            .contains_key("disagg_prefill_resp")
    );
}
