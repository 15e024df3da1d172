//! LoRA adapters: `--lora-modules`, load and unload with vLLM's statuses, adapters listed in
//! `/v1/models`, requests served under an adapter, block hashes salted with its name and
//! `lora_name` in the KV events.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdcache::events::{BlockStored, KvEvent, decode_batch};
use pdcache::vllm_hash::{BlockHasher, event_value, none_hash};
use pdsim::{Connector, KvEventsConfig, Role, SimHandle};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv};

fn words(n: usize, tag: &str) -> String {
    (0..n).map(|i| format!("{tag}{i} ")).collect()
}

async fn lora_engine(modules: &[(&str, &str)]) -> SimHandle {
    let modules: Vec<(String, String)> = modules
        .iter()
        .map(|(n, p)| ((*n).to_owned(), (*p).to_owned()))
        .collect();
    engine_with(Role::Both, Connector::None, |c| c.lora_modules = modules).await
}

async fn complete(h: &SimHandle, model: &str, prompt: &str) -> (u16, Value) {
    let (s, _, v) = post(
        completions(h),
        &json!({"model": model, "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    (s, v)
}

#[tokio::test]
async fn adapters_load_unload_and_list_like_vllm() {
    let h = lora_engine(&[("sql", "/adapters/sql")]).await;
    let url = |p: &str| format!("{}{p}", h.base_url());
    let models = get_json(&url("/v1/models")).await;
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{models}");
    assert_eq!(data[0]["id"], "pdsim");
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[1]["id"], "sql");
    assert_eq!(data[1]["parent"], "pdsim");
    assert_eq!(data[1]["root"], "/adapters/sql");

    // Load at run time: vLLM's plain-text success, then 400 InvalidUserInput for a duplicate.
    let load = |name: &str| json!({"lora_name": name, "lora_path": format!("/adapters/{name}")});
    let r = client()
        .post(url("/v1/load_lora_adapter"))
        .json(&load("chat"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        "Success: LoRA adapter 'chat' added successfully."
    );
    let (s, _, v) = post(url("/v1/load_lora_adapter"), &load("chat")).await;
    assert_eq!(s, 400);
    let e = error_of(&v, 400);
    assert_eq!(e["type"], "InvalidUserInput");
    assert_eq!(
        e["message"],
        "The lora adapter 'chat' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
    );
    let (s, _, v) = post(url("/v1/load_lora_adapter"), &json!({"lora_name": "x"})).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        error_of(&v, 400)["message"],
        "Both 'lora_name' and 'lora_path' must be provided."
    );
    let ids: Vec<Value> = get_json(&url("/v1/models")).await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(
        ids,
        [json!("pdsim"), json!("sql"), json!("chat")],
        "in load order"
    );

    // Requests under an adapter answer with its name; an unknown model is vLLM's 404.
    let (s, v) = complete(&h, "chat", "hello there").await;
    assert_eq!((s, v["model"].clone()), (200, json!("chat")), "{v}");
    let (s, v) = complete(&h, "nope", "hello there").await;
    assert_eq!(s, 404);
    let e = error_of(&v, 404);
    assert_eq!(e["type"], "NotFoundError");
    assert_eq!(e["param"], "model");
    assert_eq!(h.stats().model_not_found, 1);
    assert_eq!(h.stats().lora_requests["chat"], 1);

    // Unload: 200, then 404 NotFoundError for a name not loaded; requests for it are refused.
    let unload = json!({"lora_name": "chat"});
    let r = client()
        .post(url("/v1/unload_lora_adapter"))
        .json(&unload)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, _, v) = post(url("/v1/unload_lora_adapter"), &unload).await;
    assert_eq!(s, 404);
    assert_eq!(
        error_of(&v, 404)["message"],
        "The lora adapter 'chat' cannot be found."
    );
    let (s, _) = complete(&h, "chat", "hello there").await;
    assert_eq!(s, 404);
    assert_eq!(h.stats().model_not_found, 2);
    h.shutdown().await;
}

#[tokio::test]
async fn adapter_prefixes_are_cached_apart_from_the_base_and_each_other() {
    let h = lora_engine(&[("sql", "/a/sql"), ("chat", "/a/chat")]).await;
    let p = words(40, "w");
    // 40 words + BOS = 41 tokens: two full blocks of 16 each time it is cached.
    let (_, v) = complete(&h, "sql", &p).await;
    assert_eq!(cached(&v), 0);
    let (_, v) = complete(&h, "sql", &p).await;
    assert_eq!(cached(&v), 32, "the adapter's own prefix is reused");
    let (_, v) = complete(&h, "chat", &p).await;
    assert_eq!(cached(&v), 0, "another adapter's blocks are not");
    let (_, v) = complete(&h, "pdsim", &p).await;
    assert_eq!(cached(&v), 0, "nor are the base model's");
    let (_, v) = complete(&h, "chat", &p).await;
    assert_eq!(cached(&v), 32);
    h.shutdown().await;
}

/// The first `BlockStored` of the next batch on `sub`.
async fn next_stored(sub: &mut zeromq::SubSocket) -> BlockStored {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("a KV event batch within 5 s")
            .unwrap();
        let batch = decode_batch(&m.into_vec()[2]).unwrap();
        if let Some(KvEvent::BlockStored(s)) = batch.events.into_iter().next() {
            return s;
        }
    }
}

#[tokio::test]
async fn adapter_events_carry_the_name_and_vllms_salted_hashes() {
    let endpoint = format!(
        "ipc://{}/pdsim-lora-{}.sock",
        std::env::temp_dir().display(),
        uuid::Uuid::new_v4().simple()
    );
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.lora_modules = vec![("sql".into(), "/a/sql".into())];
        c.kv_events = KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: endpoint.clone(),
            ..KvEventsConfig::default()
        };
    })
    .await;
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&endpoint).await.unwrap();
    // The publisher drops batches until a subscriber is attached: retry on fresh prompts.
    for i in 0..50 {
        complete(&h, "sql", &words(40, &format!("e{i}-"))).await;
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            break;
        }
    }
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {}

    let tokens = |p: &str| {
        let url = format!("{}/tokenize", h.base_url());
        let body = json!({ "prompt": p });
        async move {
            let (_, _, v) = post(url, &body).await;
            v["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect::<Vec<u32>>()
        }
    };
    // Independently: vLLM 0.32's chain with extra keys (("lora", "sql", "/a/sql"),) on every
    // block, and without.
    let sql = pdcache::vllm_hash::lora_key("sql", "/a/sql");
    let expect = |ids: &[u32], extra: &[&[&str]]| {
        let mut out = Vec::new();
        BlockHasher::default().extend_with(&none_hash(), ids, 16, extra, &mut out);
        out.iter().map(event_value).collect::<Vec<u64>>()
    };
    let fresh = words(40, "fresh");
    let ids = tokens(&fresh).await;
    complete(&h, "sql", &fresh).await;
    let s = next_stored(&mut sub).await;
    assert_eq!(s.lora_name.as_deref(), Some("sql"));
    assert_eq!(s.lora_id, Some(1));
    let hashes: Vec<u64> = s.block_hashes.iter().map(|b| b.as_u64()).collect();
    assert_eq!(hashes, expect(&ids, &[&sql]));
    assert_ne!(hashes, expect(&ids, &[]));
    let extra = s.extra_keys.as_ref().unwrap();
    assert_eq!(extra.len(), 2);
    assert!(
        extra
            .iter()
            .all(|k| k.as_ref() == Some(&pdcache::events::ExtraKeys::lora("sql")))
    );

    // The same prompt on the base model: unsalted hashes, no adapter fields.
    complete(&h, "pdsim", &fresh).await;
    let s = next_stored(&mut sub).await;
    assert_eq!((s.lora_name, s.lora_id), (None, None));
    let hashes: Vec<u64> = s.block_hashes.iter().map(|b| b.as_u64()).collect();
    assert_eq!(hashes, expect(&ids, &[]));
    let file = endpoint.strip_prefix("ipc://").unwrap().to_owned();
    assert!(std::path::Path::new(&file).exists(), "{file} while bound");
    h.shutdown().await;
    // The engine removes the socket file it bound.
    assert!(!std::path::Path::new(&file).exists(), "{file} left behind");
}
