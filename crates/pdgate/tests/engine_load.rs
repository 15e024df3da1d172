//! Engine load from the engines' metrics (`cache.engine_load_interval`): load this gateway did
//! not send (another replica's, or, here, requests sent to an engine directly) counts in the
//! cache-aware cost when the scrape is on, and does not when it is off.

mod common;

use std::time::{Duration, Instant};

use common::{MODEL, metric, sim, start};
use pdsim::{Connector, LatencyModel, Role};
use serde_json::json;

/// Requests held open on the busy decode, sent around the gateway.
const HELD: usize = 6;

/// Which decodes served `n` requests with distinct prompts through a cache-aware gateway while
/// the first decode runs [`HELD`] requests the gateway did not send; and the first decode's
/// load beyond the gateway (`Load::others`) at the end.
async fn served_while_one_decode_is_busy(interval: Duration, n: usize) -> (Vec<bool>, (u32, u32)) {
    let decode = || {
        let mut c = sim(Role::Decode, Connector::Shfs);
        // Slow tokens, so that the requests held open below stay open.
        c.latency = LatencyModel {
            itl: Duration::from_millis(50),
            ..LatencyModel::default()
        };
        c
    };
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![decode(), decode()],
        |c| {
            c.policy.prefill_policy = "cache_aware".into();
            c.policy.decode_policy = "cache_aware".into();
            c.cache.engine_load_interval = interval;
        },
    )
    .await;
    let busy = fleet.decode[0].base_url();
    let busy_name = busy.trim_start_matches("http://").to_string();
    // Streams of 400 tokens (20 s) straight to the first decode, kept open until the end.
    let mut held = Vec::new();
    for i in 0..HELD {
        let body = json!({"model": MODEL, "prompt": format!("held {i}"), "max_tokens": 400, "stream": true});
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            fleet
                .http
                .post(format!("{busy}/v1/completions"))
                .json(&body)
                .send(),
        )
        .await
        .expect("the engine answered the head in time")
        .expect("direct request");
        assert_eq!(r.status(), 200);
        held.push(r);
    }
    // The engine reports them (bounded wait), then the gateway has had several intervals.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = fleet
            .http
            .get(format!("{busy}/metrics"))
            .send()
            .await
            .expect("engine metrics")
            .text()
            .await
            .expect("metrics body");
        if metric(&text, "vllm:num_requests_running{model_name=\"m\"}") >= HELD as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine never reported: {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(interval.max(Duration::from_millis(50)) * 4).await;
    let mut on_busy = Vec::new();
    for i in 0..n {
        let body = json!({"model": MODEL, "prompt": format!("request {i}: what is {i} squared?"), "max_tokens": 2});
        let r = fleet.post_bounded("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        let served = r.headers()["target-pod"].to_str().expect("target-pod");
        on_busy.push(served == busy_name);
        r.text().await.expect("answer");
    }
    let snap = fleet.gateway.gateway().store.load();
    let load = snap
        .decode
        .iter()
        .find(|e| e.name == busy_name)
        .expect("the busy decode is routable")
        .load
        .clone();
    let others = load.others();
    drop(held);
    if !interval.is_zero() {
        // The engine's load went with the requests: so does the estimate (bounded wait).
        let deadline = Instant::now() + Duration::from_secs(10);
        while load.others() != (0, 0) {
            assert!(
                Instant::now() < deadline,
                "others stayed {:?}",
                load.others()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    (on_busy, others)
}

#[tokio::test]
async fn a_scraping_gateway_routes_away_from_load_it_did_not_send() {
    let (on_busy, others) = served_while_one_decode_is_busy(Duration::from_millis(50), 6).await;
    assert_eq!(
        others.0, HELD as u32,
        "the engine's requests beyond this gateway"
    );
    assert_eq!(others.1, 0, "a decode computes no prompt tokens for them");
    assert!(
        on_busy.iter().all(|b| !b),
        "a request went to the busy decode: {on_busy:?}"
    );
}

#[tokio::test]
async fn without_the_scrape_the_gateway_sees_only_its_own_load() {
    let (on_busy, others) = served_while_one_decode_is_busy(Duration::ZERO, 20).await;
    assert_eq!(others, (0, 0));
    // Both decodes look idle: each request's decode is one of two tied on load, taken at
    // random, so the busy one serves some (none of 20 has odds of one in a million).
    assert!(
        on_busy.iter().any(|b| *b),
        "the busy decode served none: {on_busy:?}"
    );
}

/// The entries a cache-aware gateway's index holds for model `m` after six distinct prompts of
/// about ten blocks each on one prefill whose engine holds 16 KV blocks, and the engine size
/// the gateway learned, in tokens (0: none).
async fn entries_after_six_prompts(interval: Duration) -> (f64, u64) {
    let mut prefill = sim(Role::Prefill, Connector::Shfs);
    prefill.cache.kv_cache_blocks = 16;
    let fleet = start(
        vec![prefill],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            c.policy.prefill_policy = "cache_aware".into();
            c.policy.decode_policy = "cache_aware".into();
            c.cache.engine_load_interval = interval;
        },
    )
    .await;
    let load = fleet.gateway.gateway().store.load().prefill[0].load.clone();
    if !interval.is_zero() {
        // The first scrape (bounded wait).
        let deadline = Instant::now() + Duration::from_secs(10);
        while load.cache_tokens() == 0 {
            assert!(
                Instant::now() < deadline,
                "the engine's size was never read"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for i in 0..6 {
        let words: Vec<String> = (0..120).map(|w| format!("p{i}w{w}")).collect();
        let body = json!({"model": MODEL, "prompt": words.join(" "), "max_tokens": 2});
        let r = fleet.post_bounded("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        r.text().await.expect("answer");
    }
    let entries = metric(
        &fleet.metrics().await,
        "pdgate_cache_index_entries{model=\"m\"}",
    );
    (entries, load.cache_tokens())
}

#[tokio::test]
async fn approximate_mode_bounds_an_engine_by_the_size_its_metrics_report() {
    let (entries, learned) = entries_after_six_prompts(Duration::from_millis(50)).await;
    assert_eq!(
        learned,
        16 * 16,
        "vllm:cache_config_info's blocks of 16 tokens"
    );
    // A quarter above the engine's blocks (approximate keys assume 4-byte tokens).
    assert!(
        (1.0..=20.0).contains(&entries),
        "{entries} entries for an engine of 16 blocks"
    );
    // Without the scrape nothing bounds it but `capacity_per_endpoint`.
    let (blind, learned) = entries_after_six_prompts(Duration::ZERO).await;
    assert_eq!(learned, 0);
    assert!(
        blind > 40.0,
        "{blind} entries for six prompts of about ten blocks"
    );
}
