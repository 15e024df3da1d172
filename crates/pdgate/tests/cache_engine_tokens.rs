//! Token keys without a local tokenizer: with `cache.engine_tokenize` the gateway asks an
//! engine's `/tokenize` once per prompt, so its predictions count the engine's tokens; without
//! it they are estimated from bytes (unset, it is on only for models with KV events:
//! `cache_precise.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use common::{MODEL, pair};
use pdsim::Connector;
use serde_json::{Value, json};

const BLOCK: u64 = 16;

/// Predicted cached tokens of the second of two identical requests.
async fn predicted_on_repeat(engine_tokenize: Option<bool>) -> (u64, u64) {
    let fleet = pair(Connector::Shfs, |c| {
        c.policy.prefill_policy = "cache_aware".into();
        c.policy.decode_policy = "cache_aware".into();
        c.cache.block_size = BLOCK as usize;
        c.cache.engine_tokenize = engine_tokenize;
    })
    .await;
    // 100 words of 5 bytes: 101 engine tokens (words and the start token), ~150 by bytes.
    let prompt = "alpha ".repeat(100);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let tokenized: Value = reqwest::Client::new()
        .post(format!("{}/tokenize", fleet.prefill[0].base_url()))
        .json(&json!({"model": MODEL, "prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let count = tokenized["count"].as_u64().unwrap();
    let mut predicted = 0;
    for _ in 0..2 {
        let r = fleet.post_bounded("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        predicted = r.headers()["x-pdgate-predicted-cached-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        r.text().await.unwrap();
    }
    fleet.wait_idle().await;
    (predicted, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_tokens_make_predictions_count_the_engines_blocks() {
    let (predicted, count) = predicted_on_repeat(Some(true)).await;
    assert_eq!(predicted, count / BLOCK * BLOCK, "engine tokens: {count}");
    let (approximate, _) = predicted_on_repeat(Some(false)).await;
    assert_ne!(
        approximate, predicted,
        "byte estimates differ from engine tokens"
    );
    // Unset: on only where KV events need token keys; these engines publish none.
    let (unset, _) = predicted_on_repeat(None).await;
    assert_eq!(unset, approximate, "no events: approximate keys");
}
