//! Per-request hot path of the shfs connector next to a `serde_json::Value`
//! round trip of the same chat bodies (4 KB and 1 MB).
//!
//! Run: `cargo bench -p kvtransfer --bench body_edit -- --warm-up-time 1 --measurement-time 3`
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvtransfer::{
    JsonBody, KvTransferAgent, Pod, RoutingContext, ShfsAgent, strip_client_transfer_fields,
};
use serde_json::{Value, json};

/// A chat body of about `target` bytes: a system prompt and alternating
/// turns with escapes and non-ASCII text, plus the usual sampling fields.
fn chat_body(target: usize) -> Bytes {
    let turn = "Explain the \"prefill\" phase of LLM serving, step by step:\n\
                1. tokenize; 2. run attention over the prompt — caché les clés/valeurs. ";
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut size = 300;
    let mut i = 0;
    while size < target {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let content = turn.repeat(8);
        size += content.len() + 40;
        messages.push(json!({"role": role, "content": content}));
        i += 1;
    }
    let body = json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": messages,
        "max_tokens": 512,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": true,
        "stream_options": {"include_usage": true},
        "seed": 12345678901234567_u64,
        "user": "bench",
    });
    Bytes::from(serde_json::to_vec(&body).unwrap())
}

/// A vLLM 0.33 prefill response for a prompt of `body_len` bytes (about 4
/// bytes per token, 16 tokens per block, one KV-cache group).
fn prefill_response(body_len: usize) -> Vec<u8> {
    let tokens = body_len / 4;
    let blocks: Vec<u64> = (0..tokens.div_ceil(16) as u64)
        .map(|b| 1000 + b * 7)
        .collect();
    serde_json::to_vec(&json!({
        "id": "chatcmpl-0b7d6c1e5f7a4b3c9d2e1f0a",
        "object": "chat.completion",
        "created": 1764450000,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "1"},
                     "logprobs": null, "finish_reason": "length", "stop_reason": null}],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens + 1, "completion_tokens": 1,
                  "prompt_tokens_details": null},
        "prompt_logprobs": null,
        "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [blocks],
            "remote_engine_id": "2f4c6a8e-1b3d-4f5a-9c7e-0d2b4f6a8c0e",
            "remote_request_id": "cmpl-req-1-0",
            "remote_host": "10.0.0.7", "remote_port": 5600,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": 1764450030.25,
            "remote_registration_generation": 3,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0
        }
    }))
    .unwrap()
}

/// pdgate's path: one parse, strip, shfs augment (prefill leg bytes), merge
/// (decode leg bytes).
fn kvtransfer_path(
    agent: &ShfsAgent,
    pod: &Pod,
    client: &Bytes,
    response: &[u8],
) -> (Bytes, Bytes) {
    let mut body = JsonBody::parse(client.clone()).unwrap();
    strip_client_transfer_fields(&mut body);
    let mut ctx = RoutingContext::from_parsed("req-1", body.clone());
    let leg = agent.augment_prefill_request(&mut ctx, pod, &body).unwrap();
    agent
        .merge_prefill_response(&mut ctx, response, pod)
        .unwrap();
    (leg.body, ctx.req_body)
}

/// The same two legs through `serde_json::Value` (what upstream did before
/// its issue 2724: reorders keys in general and loses big integers).
fn value_path(client: &Bytes, response: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let original: Value = serde_json::from_slice(client).unwrap();
    let mut prefill = original.clone();
    let p = prefill.as_object_mut().unwrap();
    for k in ["kv_transfer_params", "transfer_id", "disagg_prefill_resp"] {
        p.remove(k);
    }
    p.insert("max_tokens".into(), json!(1));
    p.insert("max_completion_tokens".into(), json!(1));
    p.insert("stream".into(), json!(false));
    p.remove("stream_options");
    p.insert("ignore_eos".into(), json!(true));
    p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,
               "remote_block_ids":null,"remote_host":null,"remote_port":null}),
    );
    let prefill_bytes = serde_json::to_vec(&prefill).unwrap();
    let resp: Value = serde_json::from_slice(response).unwrap();
    let mut params = resp["kv_transfer_params"].clone();
    params["remote_host"] = json!("10.0.0.7");
    let mut decode = original;
    decode
        .as_object_mut()
        .unwrap()
        .insert("kv_transfer_params".into(), params);
    (prefill_bytes, serde_json::to_vec(&decode).unwrap())
}

fn bench(c: &mut Criterion) {
    let agent = ShfsAgent;
    let pod = Pod::new("prefill-0", "10.0.0.7", 8000);
    for (label, size) in [("4KB", 4 * 1024), ("1MB", 1024 * 1024)] {
        let client = chat_body(size);
        let response = prefill_response(client.len());
        // Both paths must build the same legs (as JSON values) before timing them.
        let (ours_p, ours_d) = kvtransfer_path(&agent, &pod, &client, &response);
        let (theirs_p, theirs_d) = value_path(&client, &response);
        let value = |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap();
        assert_eq!(value(&ours_p), value(&theirs_p));
        assert_eq!(value(&ours_d), value(&theirs_d));
        let mut group = c.benchmark_group("pd_body_edit");
        group.throughput(Throughput::Bytes(client.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("kvtransfer_shfs", label),
            &client,
            |b, client| b.iter(|| black_box(kvtransfer_path(&agent, &pod, client, &response))),
        );
        group.bench_with_input(
            BenchmarkId::new("serde_value_shfs", label),
            &client,
            |b, client| b.iter(|| black_box(value_path(client, &response))),
        );
        group.bench_with_input(
            BenchmarkId::new("serde_value_roundtrip", label),
            &client,
            |b, client| {
                b.iter(|| {
                    let v: Value = serde_json::from_slice(client).unwrap();
                    black_box(serde_json::to_vec(&v).unwrap())
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("jsonbody_parse", label),
            &client,
            |b, client| b.iter(|| black_box(JsonBody::parse(client.clone()).unwrap())),
        );
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
