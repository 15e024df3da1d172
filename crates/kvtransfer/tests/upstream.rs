//! The upstream acceptance cases of contracts.md §9 (and §1), one named test each.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use bytes::Bytes;
use kvtransfer::{
    AgentError, CONNECTOR_TYPE_IDENTIFIER, JsonBody, KvTransferAgent, MergeOutcome, Pod, Registry,
    RegistryError, RoutingContext, parse_mooncake_bootstrap,
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

/// Runs augment for `client` through `connector` and returns the prefill body.
fn prefill_payload(connector: &str, client: &str) -> Value {
    let pod = Pod::new("p", "10.0.0.1", 8000);
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("req-1", b.clone());
    let leg = agent(connector)
        .augment_prefill_request(&mut ctx, &pod, &b)
        .unwrap();
    json(&leg.body)
}

/// Runs a merge for `client` and `response` through `connector`.
fn merge(
    connector: &str,
    client: &'static str,
    response: &[u8],
    pod: &Pod,
) -> (Result<MergeOutcome, AgentError>, RoutingContext) {
    let mut ctx = RoutingContext::new("req-1", Bytes::from_static(client.as_bytes()));
    let r = agent(connector).merge_prefill_response(&mut ctx, response, pod);
    (r, ctx)
}

#[test]
fn upstream_resolve_connector_type_cases() {
    let cases = [
        ("", "shfs"),
        ("nixl", "nixl"),
        ("shfs", "shfs"),
        ("ShFs", "shfs"),
        ("invalid", "shfs"),
        ("MOONCAKE", "mooncake"),
    ];
    let registry = Registry::with_builtins();
    for (label, want) in cases {
        assert_eq!(
            registry.resolve_connector_type(label, "shfs"),
            want,
            "label {label:?}"
        );
        assert_eq!(
            Registry::with_builtins().resolve_connector_type(label, "shfs"),
            want,
            "global, label {label:?}"
        );
    }
}

#[test]
fn upstream_valid_agent_names_sorted() {
    assert_eq!(
        Registry::with_builtins().valid_agent_names(),
        [
            "mooncake",
            "moriio",
            "moriio-read",
            "nixl",
            "p2pnccl",
            "sglang",
            "shfs",
            "trtllm"
        ]
    );
    let names = Registry::with_builtins().valid_agent_names();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
    for builtin in ["mooncake", "nixl", "sglang", "shfs"] {
        assert!(names.iter().any(|n| n == builtin), "{builtin} missing");
    }
}

#[test]
fn upstream_resolve_unknown_type_error_text() {
    let err = Registry::with_builtins().resolve("foo").unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"unknown KV transfer connector type "foo" (valid: [mooncake moriio moriio-read nixl p2pnccl sglang shfs trtllm])"#
    );
}

#[test]
fn upstream_resolve_returns_agent_of_that_type() {
    let registry = Registry::with_builtins();
    for name in registry.valid_agent_names() {
        assert_eq!(registry.resolve(&name).unwrap().connector_type(), name);
    }
    assert_eq!(
        Registry::with_builtins()
            .resolve("NIXL")
            .unwrap()
            .connector_type(),
        "nixl"
    );
}

#[test]
fn upstream_resolve_agent_for_pod_nil() {
    let err = Registry::with_builtins()
        .resolve_agent_for_pod(None, "shfs")
        .unwrap_err();
    assert_eq!(err, RegistryError::PodNil);
    assert_eq!(
        err.to_string(),
        "cannot resolve KV transfer agent: pod is nil"
    );
    assert!(
        Registry::with_builtins()
            .resolve_agent_for_pod(None, "shfs")
            .is_err()
    );
}

#[test]
fn upstream_resolve_agent_for_pod_label_then_default() {
    let registry = Registry::with_builtins();
    let labelled = Pod::new("p", "1.1.1.1", 8000).with_label(CONNECTOR_TYPE_IDENTIFIER, "nixl");
    let unlabelled = Pod::new("p", "1.1.1.1", 8000);
    let bogus = Pod::new("p", "1.1.1.1", 8000).with_label(CONNECTOR_TYPE_IDENTIFIER, "bogus");
    let get = |pod: &Pod, default: &str| {
        registry
            .resolve_agent_for_pod(Some(pod), default)
            .unwrap()
            .connector_type()
    };
    assert_eq!(get(&labelled, "shfs"), "nixl");
    assert_eq!(get(&unlabelled, "shfs"), "shfs");
    assert_eq!(get(&unlabelled, "mooncake"), "mooncake");
    assert_eq!(get(&bogus, "shfs"), "shfs");
}

#[test]
fn upstream_register_overwrites_and_adds() {
    let mut registry = Registry::with_builtins();
    let nixl: kvtransfer::AgentFactory = Arc::new(|| Arc::new(kvtransfer::NixlAgent));
    registry.register("shfs", nixl.clone());
    assert_eq!(registry.resolve("shfs").unwrap().connector_type(), "nixl");
    registry.register(" Custom ", nixl);
    assert!(registry.valid_agent_names().contains(&"custom".to_owned()));
    assert_eq!(registry.resolve("CUSTOM").unwrap().connector_type(), "nixl");
}

const CHAT: &str = r#"{"messages":[{"role":"user","content":"test"}],"stream":true}"#;

#[test]
fn upstream_prefill_payload_vllm_shfs() {
    let v = prefill_payload("shfs", CHAT);
    assert_eq!(v["max_tokens"], 1);
    assert_eq!(v["max_completion_tokens"], 1);
    assert_eq!(v["stream"], false);
    assert!(v.get("stream_options").is_none());
    assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
    assert_eq!(
        v["messages"],
        json(br#"[{"role":"user","content":"test"}]"#)
    );
}

#[test]
fn upstream_prefill_payload_shfs_exact_params() {
    let pod = Pod::new("p", "10.0.0.1", 8000);
    let b = body(CHAT);
    let mut ctx = RoutingContext::from_parsed("r", b.clone());
    let leg = agent("shfs")
        .augment_prefill_request(&mut ctx, &pod, &b)
        .unwrap();
    let out = JsonBody::parse(leg.body).unwrap();
    assert_eq!(
        out.get_raw("kv_transfer_params").unwrap(),
        r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#
    );
    assert!(leg.headers.is_empty());
}

#[test]
fn upstream_prefill_payload_vllm_nixl() {
    let v = prefill_payload("nixl", CHAT);
    assert_eq!(v["max_tokens"], 1);
    assert_eq!(v["max_completion_tokens"], 1);
    assert_eq!(v["stream"], false);
    assert!(v.get("stream_options").is_none());
    assert!(v.get("kv_transfer_params").is_none());
}

#[test]
fn upstream_shfs_merge_sets_remote_host() {
    let pod = Pod::new("p", "192.168.1.100", 8000);
    let (r, ctx) = merge(
        "shfs",
        CHAT,
        br#"{"kv_transfer_params":{"remote_engine_id":"engine123","remote_block_ids":["block1","block2"]}}"#,
        &pod,
    );
    assert_eq!(r.unwrap(), MergeOutcome::KvAttached);
    let v = json(&ctx.req_body);
    assert_eq!(v["kv_transfer_params"]["remote_host"], "192.168.1.100");
    assert_eq!(v["kv_transfer_params"]["remote_engine_id"], "engine123");
    assert_eq!(v["stream"], true);
}

#[test]
fn upstream_shfs_merge_without_params_leaves_body_unchanged() {
    let pod = Pod::new("p", "192.168.1.100", 8000);
    let (r, ctx) = merge("shfs", CHAT, br#"{"other":"data"}"#, &pod);
    assert_eq!(r.unwrap(), MergeOutcome::Recompute);
    assert_eq!(&ctx.req_body[..], CHAT.as_bytes());
}

#[test]
fn upstream_shfs_merge_invalid_original_body_errors() {
    let pod = Pod::new("p", "192.168.1.100", 8000);
    let (r, ctx) = merge(
        "shfs",
        "invalid json",
        br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#,
        &pod,
    );
    let err = r.unwrap_err();
    assert!(matches!(err, AgentError::Body(_)), "{err}");
    assert!(err.is_client_error());
    assert_eq!(&ctx.req_body[..], b"invalid json");
}

#[test]
fn upstream_shfs_merge_verbatim_overwrites_only_remote_host() {
    const CLIENT: &str = r#"{"model":"m", "messages":[{"role":"user","content":"a  b"}],"temperature":0.70,"seed":12345678901234567890,"stream":true}"#;
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let (r, ctx) = merge(
        "shfs",
        CLIENT,
        br#"{"id":"x","kv_transfer_params":{"remote_block_ids":[3,1,2],"remote_engine_id":"e","remote_host":"stale","remote_port":9}}"#,
        &pod,
    );
    assert_eq!(r.unwrap(), MergeOutcome::KvAttached);
    let out = JsonBody::parse(ctx.req_body.clone()).unwrap();
    let params = JsonBody::parse(out.get_raw_bytes("kv_transfer_params").unwrap()).unwrap();
    assert_eq!(
        params.get::<String>("remote_host").unwrap().unwrap(),
        "10.1.1.1"
    );
    assert_eq!(params.get_raw("remote_block_ids").unwrap(), "[3,1,2]");
    assert_eq!(params.get::<u16>("remote_port").unwrap().unwrap(), 9);
    assert_eq!(params.get_raw("remote_engine_id").unwrap(), r#""e""#);
    // Every byte of the client body survives, the params are appended.
    let expected = format!(
        "{},\"kv_transfer_params\":{{\"remote_block_ids\":[3,1,2],\"remote_engine_id\":\"e\",\"remote_host\":\"10.1.1.1\",\"remote_port\":9}}}}",
        CLIENT.strip_suffix('}').unwrap()
    );
    assert_eq!(std::str::from_utf8(&ctx.req_body).unwrap(), expected);
}

#[test]
fn upstream_shfs_merge_non_object_params_unexpected_type() {
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let (r, ctx) = merge("shfs", CHAT, br#"{"kv_transfer_params":"str"}"#, &pod);
    let err = r.unwrap_err();
    assert!(err.to_string().contains("unexpected type"), "{err}");
    assert!(!err.is_client_error());
    assert_eq!(&ctx.req_body[..], CHAT.as_bytes());
}

#[test]
fn upstream_nixl_merge_embeds_raw_response() {
    let pod = Pod::new("p", "10.1.1.1", 8000);
    let (r, ctx) = merge(
        "nixl",
        CHAT,
        b" {\"kv_transfer_params\":{\"remote_block_ids\":[3,1,2],\"remote_engine_id\":\"e\"},\"id\":9007199254740993}\n",
        &pod,
    );
    assert_eq!(r.unwrap(), MergeOutcome::KvAttached);
    let out = JsonBody::parse(ctx.req_body.clone()).unwrap();
    assert_eq!(
        out.get_raw("disagg_prefill_resp").unwrap(),
        r#"{"kv_transfer_params":{"remote_block_ids":[3,1,2],"remote_engine_id":"e"},"id":9007199254740993}"#
    );
    assert!(!out.contains_key("kv_transfer_params"));
    assert!(out.get::<bool>("stream").unwrap().unwrap());
}

const QUERY_OK: &[u8] =
    br#"{"0":{"engine_id":"engine-mooncake-01","worker_addr":{"0":{"0":"tcp://127.0.0.1:9000"}}}}"#;

fn mooncake_pod() -> Pod {
    let bootstrap = parse_mooncake_bootstrap(8998, 200, QUERY_OK).unwrap();
    Pod::new("prefill-0", "10.2.2.2", 8000).with_mooncake_bootstrap(bootstrap)
}

#[test]
fn upstream_mooncake_augment_sets_transfer_id() {
    let client = r#"{"model":"m","max_tokens":64,"prompt":"hi"}"#;
    let b = body(client);
    let mut ctx = RoutingContext::from_parsed("req-abc", b.clone());
    let leg = agent("mooncake")
        .augment_prefill_request(&mut ctx, &mooncake_pod(), &b)
        .unwrap();
    let v = json(&leg.body);
    let tid = v["kv_transfer_params"]["transfer_id"].as_str().unwrap();
    assert!(tid.starts_with("xfer-"), "{tid}");
    assert!(tid.contains("req-abc"), "{tid}");
    assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
    assert_eq!(v["model"], "m");
    assert!(v.get("max_tokens").is_some());
    assert_eq!(ctx.transfer.transfer_id.as_deref(), Some(tid));
    assert_eq!(leg.headers.len(), 1);
    assert_eq!(leg.headers[0].0, "x-data-parallel-rank");
    assert_eq!(leg.headers[0].1, "0");
    assert_eq!(ctx.transfer.dp_rank, Some(0));
}

#[test]
fn upstream_mooncake_merge_with_bootstrap_query() {
    let client = r#"{"model":"m","max_tokens":64,"prompt":"hi","stream":true}"#;
    let b = body(client);
    let pod = mooncake_pod();
    let a = agent("mooncake");
    let mut ctx = RoutingContext::from_parsed("req-abc", b.clone());
    let leg = a.augment_prefill_request(&mut ctx, &pod, &b).unwrap();
    let outcome = a.merge_prefill_response(&mut ctx, b"", &pod).unwrap();
    assert_eq!(outcome, MergeOutcome::KvAttached);
    let prefill = json(&leg.body);
    let decode = json(&ctx.req_body);
    let p = &decode["kv_transfer_params"];
    assert_eq!(p["do_remote_prefill"], true);
    assert_eq!(p["do_remote_decode"], false);
    assert_eq!(p["remote_engine_id"], "engine-mooncake-01");
    let addr = p["remote_bootstrap_addr"].as_str().unwrap();
    assert!(addr.starts_with("http://"), "{addr}");
    assert_eq!(addr, "http://10.2.2.2:8998");
    assert_eq!(
        p["transfer_id"],
        prefill["kv_transfer_params"]["transfer_id"]
    );
    // Decode keeps the client's own generation settings.
    assert_eq!(decode["max_tokens"], 64);
    assert_eq!(decode["stream"], true);
}

#[test]
fn upstream_mooncake_bootstrap_empty_is_no_engine_id() {
    let err = parse_mooncake_bootstrap(8998, 200, b"{}").unwrap_err();
    assert!(err.to_string().contains("no engine_id"), "{err}");
}

#[test]
fn upstream_mooncake_bootstrap_500_is_returned_status() {
    let err = parse_mooncake_bootstrap(8998, 500, b"internal error").unwrap_err();
    assert!(err.to_string().contains("returned status"), "{err}");
}

#[test]
fn upstream_mooncake_bootstrap_invalid_json_is_clear() {
    let err = parse_mooncake_bootstrap(8998, 200, b"not json").unwrap_err();
    assert!(err.to_string().contains("not valid JSON"), "{err}");
}

#[test]
fn upstream_mooncake_no_pod_ip() {
    let bootstrap = parse_mooncake_bootstrap(8998, 200, QUERY_OK).unwrap();
    let pod = Pod {
        name: "prefill-0".into(),
        ip: None,
        mooncake_bootstrap: Some(bootstrap),
        ..Pod::default()
    };
    let b = body(CHAT);
    let a = agent("mooncake");
    let mut ctx = RoutingContext::from_parsed("req-abc", b.clone());
    let err = a.merge_prefill_response(&mut ctx, b"", &pod).unwrap_err();
    assert!(err.to_string().contains("no PodIP"), "{err}");
    let err = a.augment_prefill_request(&mut ctx, &pod, &b).unwrap_err();
    assert!(err.to_string().contains("no PodIP"), "{err}");
}

#[test]
fn upstream_shfs_merge_no_pod_ip() {
    let pod = Pod {
        name: "p".into(),
        ..Pod::default()
    };
    let (r, _) = merge(
        "shfs",
        CHAT,
        br#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#,
        &pod,
    );
    assert!(r.unwrap_err().to_string().contains("no PodIP"));
}
