//! The step-loop engine model: queueing from compute, KV-bounded admission, simulated time.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Instant;

use common::{completions, engine_with, post};
use pdsim::{Connector, Profile, Role, SimConfig, SimHandle, StepModel};
use serde_json::json;

fn stepped(profile: &str, time_scale: f64) -> impl FnOnce(&mut SimConfig) {
    let profile = Profile::named(profile).unwrap();
    move |c: &mut SimConfig| {
        c.cache.kv_cache_blocks = profile.kv_cache_blocks;
        c.step = Some(StepModel::new(profile));
        c.time_scale = time_scale;
    }
}

/// A prompt of `n` word tokens (plus BOS) that shares no block with prompts of another `tag`.
fn prompt(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Simulated seconds until the response of a `max_tokens`-token request arrived.
async fn timed(h: &SimHandle, text: String, max_tokens: u32) -> (f64, serde_json::Value) {
    let t = Instant::now();
    let (status, _, v) = post(
        completions(h),
        &json!({"model": "pdsim", "prompt": text, "max_tokens": max_tokens, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    (t.elapsed().as_secs_f64() * h.config().time_scale, v)
}

#[tokio::test]
async fn two_concurrent_8k_prompts_the_second_waits_for_the_first_prefill() {
    // Half speed: each 8k prefill step lasts about half a wall second, so scheduling noise
    // is small against it.
    let h = engine_with(
        Role::Both,
        Connector::None,
        stepped("llama-3.1-8b-h100", 0.5),
    )
    .await;
    let (a, b) = tokio::join!(
        timed(&h, prompt("a", 8000), 1),
        timed(&h, prompt("b", 8000), 1)
    );
    let (first, second) = if a.0 <= b.0 { (a.0, b.0) } else { (b.0, a.0) };
    let ratio = second / first;
    assert!(
        (1.6..=2.4).contains(&ratio),
        "first {first:.3}s second {second:.3}s ratio {ratio:.2}"
    );
    // The engine's own (simulated) account: two steps of about one 8k prefill each.
    let s = h.stats();
    let one = h
        .config()
        .step
        .as_ref()
        .unwrap()
        .profile
        .prefill_seconds(8001, 8192);
    assert_eq!(s.steps, 2, "{s:?}");
    assert!(
        (s.busy_seconds / one - 2.0).abs() < 0.1,
        "busy {} one prefill {one}",
        s.busy_seconds
    );
    assert_eq!(a.1["usage"]["prompt_tokens"], 8001);
    h.shutdown().await;
}

#[tokio::test]
async fn a_full_kv_cache_makes_requests_wait_for_blocks() {
    // Room for one request's blocks (1001 prompt + 200 output tokens = 76 blocks) at a time.
    let h = engine_with(Role::Both, Connector::None, |c| {
        stepped("llama-3.1-8b-h100", 1.0)(c);
        c.cache.kv_cache_blocks = 100;
    })
    .await;
    let long = async {
        timed(&h, prompt("a", 1000), 200).await;
        Instant::now()
    };
    let short = async {
        common::wait_stats(&h, |s| s.running == 1 && s.steps > 0).await;
        timed(&h, prompt("b", 1000), 1).await;
        Instant::now()
    };
    let watch = async {
        // The one-token request waits in the queue while the long one decodes.
        common::wait_stats(&h, |s| s.waiting == 1 && s.running == 1).await
    };
    let (long_done, short_done, seen) = tokio::join!(long, short, watch);
    assert!(seen.kv_cache_free_blocks < 63, "{seen:?}");
    // Without the cache bound the one-token request would finish 200 decode steps earlier.
    assert!(
        short_done >= long_done,
        "the short request ran beside the long one"
    );
    // A request that can never fit is refused, not queued forever.
    let (status, _, v) = post(
        completions(&h),
        &json!({"model": "pdsim", "prompt": prompt("c", 2000), "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV-cache blocks"),
        "{v}"
    );
    let s = h.stats();
    assert_eq!((s.running, s.waiting), (0, 0));
    assert_eq!(s.kv_cache_free_blocks, 100);
    h.shutdown().await;
}

#[tokio::test]
async fn streamed_tokens_come_one_per_step_and_reported_times_are_simulated() {
    let h = engine_with(
        Role::Both,
        Connector::None,
        stepped("llama-3.1-70b-h100-tp8", 1e4),
    )
    .await;
    // 0.2 s of wall time is 2000 s of simulated time.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (status, events) = common::post_sse(
        completions(&h),
        &json!({"model": "pdsim", "prompt": prompt("s", 100), "max_tokens": 5, "ignore_eos": true, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    let tokens: Vec<serde_json::Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(tokens.len(), 5, "{events:?}");
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let created = tokens[0]["created"].as_f64().unwrap();
    assert!(created - wall > 1000.0, "created {created} wall {wall}");
    // One prefill step, then one decode step per further token.
    let s = h.stats();
    assert_eq!(s.steps, 5, "{s:?}");
    let metrics = common::client()
        .get(format!("{}/metrics", h.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("pdsim_steps_total{model_name=\"pdsim\"} 5"),
        "{metrics}"
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_cached_prefix_is_not_computed_again() {
    let h = engine_with(Role::Both, Connector::None, |c| {
        stepped("llama-3.1-8b-h100", 1.0)(c);
        c.cache.enable_prompt_tokens_details = true;
    })
    .await;
    let (_, cold) = timed(&h, prompt("p", 1000), 1).await;
    let first = h.stats().busy_seconds;
    let (_, warm) = timed(&h, prompt("p", 1000), 1).await;
    let second = h.stats().busy_seconds - first;
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // 1001 tokens: 62 full blocks may hit (the last token is always computed).
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"], 992,
        "{warm}"
    );
    assert!(
        second < first / 4.0,
        "cold step {first} s, warm step {second} s"
    );
    let s = h.stats();
    assert_eq!(
        s.kv_cache_free_blocks, 26_000,
        "nothing pinned or reserved once idle"
    );
    h.shutdown().await;
}
