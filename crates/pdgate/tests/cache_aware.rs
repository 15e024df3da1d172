//! Cache-aware routing through the real HTTP stack against pdsim engines (approximate mode):
//! prefix affinity on both roles, decode-only serving, and the knobs' validation.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{MODEL, sim, start, two_prefills_one_decode};
use pdsim::{Connector, Role};
use serde_json::json;

fn prompt(group: usize, question: usize) -> String {
    // A 2 KiB shared prefix per group (about 512 tokens at 4 bytes each), then a question.
    let prefix: String = format!("system prompt of group {group}: ").repeat(80);
    format!("{prefix} question {question}: what is {question} times {group}?")
}

fn cache_aware(c: &mut pdgate::Config) {
    c.policy.prefill_policy = "cache_aware".into();
    c.policy.decode_policy = "cache_aware".into();
}

#[tokio::test]
async fn requests_sharing_a_prefix_stick_to_the_endpoints_that_hold_it() {
    let fleet = start(
        vec![
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Shfs),
        ],
        vec![
            sim(Role::Decode, Connector::Shfs),
            sim(Role::Decode, Connector::Shfs),
        ],
        |c| {
            cache_aware(c);
            // Decodes weigh their prefix as prefills do (by default a decode that receives the
            // KV is chosen by its load alone: `a_disaggregated_decode_is_chosen_by_...`).
            c.cache.decode_cache_weight = 1.0;
        },
    )
    .await;
    let mut served: BTreeMap<usize, BTreeSet<(String, String)>> = BTreeMap::new();
    for q in 0..6 {
        for g in 0..4 {
            let body = json!({"model": MODEL, "prompt": prompt(g, q), "max_tokens": 4});
            let r = fleet.post_bounded("/v1/completions", &body).await;
            assert_eq!(r.status(), 200);
            let h = r.headers();
            let pair = (
                h["prefill-target-pod"].to_str().unwrap().to_string(),
                h["target-pod"].to_str().unwrap().to_string(),
            );
            assert!(h.get("x-pdgate-decode-only").is_none());
            served.entry(g).or_default().insert(pair);
            r.text().await.unwrap();
        }
    }
    for (g, pairs) in &served {
        assert_eq!(pairs.len(), 1, "group {g} moved: {pairs:?}");
    }
    // Four groups over two endpoints per role: the misses spread by load, so both serve.
    let prefills: BTreeSet<_> = served.values().flatten().map(|p| p.0.clone()).collect();
    assert_eq!(prefills.len(), 2, "{served:?}");
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(r#"pdgate_cache_decisions_total{role="prefill",kind="hit"} 20"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"pdgate_cache_decisions_total{role="decode",kind="miss"} 4"#));
    assert!(metrics.contains(r#"pdgate_cache_index_entries{model="m"}"#));
}

#[tokio::test]
async fn a_decode_holding_the_prompt_serves_it_alone() {
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![
            sim(Role::Decode, Connector::Shfs),
            sim(Role::Decode, Connector::Shfs),
        ],
        |c| {
            cache_aware(c);
            c.cache.decode_only_below_tokens = 64;
        },
    )
    .await;
    let body = |q| json!({"model": MODEL, "prompt": prompt(1, q), "max_tokens": 4, "stream": true});
    let first = fleet.post_bounded("/v1/completions", &body(0)).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("x-pdgate-decode-only").is_none());
    let decode = first.headers()["target-pod"].to_str().unwrap().to_string();
    first.text().await.unwrap();
    // The same prefix with another question: the decode holds all but the last block or two.
    let second = fleet.post_bounded("/v1/completions", &body(1)).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["x-pdgate-decode-only"], "cache-hit");
    assert_eq!(second.headers()["target-pod"], decode.as_str());
    assert!(second.headers().get("prefill-target-pod").is_none());
    assert!(!common::text_of(&second.text().await.unwrap()).is_empty());
    assert_eq!(fleet.prefill[0].stats().requests.completions, 1);
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(r#"pdgate_cache_decisions_total{role="decode",kind="decode_only"} 1"#),
        "{metrics}"
    );
    // An unrelated prompt still goes through both legs.
    let other = json!({"model": MODEL, "prompt": prompt(7, 0), "max_tokens": 4});
    let r = fleet.post_bounded("/v1/completions", &other).await;
    assert!(r.headers().get("x-pdgate-decode-only").is_none());
    r.text().await.unwrap();
    assert_eq!(fleet.prefill[0].stats().requests.completions, 2);
}

/// The value of `pdgate_endpoint_computing_tokens` for the one endpoint of `role`.
fn computing(metrics: &str, role: &str) -> u64 {
    let series = format!("pdgate_endpoint_computing_tokens{{role=\"{role}\",");
    let line = metrics.lines().find(|l| l.starts_with(&series));
    let value = line.and_then(|l| l.rsplit(' ').next()?.parse().ok());
    value.unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

#[tokio::test]
async fn a_prefill_leg_counts_its_predicted_prompt_tokens_while_it_runs() {
    let mut slow = sim(Role::Prefill, Connector::Shfs);
    // About 530 uncached prompt tokens: a second of prefill.
    slow.latency.prefill_per_token = std::time::Duration::from_millis(2);
    let fleet = start(
        vec![slow],
        vec![sim(Role::Decode, Connector::Shfs)],
        cache_aware,
    )
    .await;
    assert_eq!(computing(&fleet.metrics().await, "prefill"), 0);
    let body = json!({"model": MODEL, "prompt": prompt(3, 0), "max_tokens": 4});
    let watch = async {
        for _ in 0..500 {
            let m = fleet.metrics().await;
            let seen = computing(&m, "prefill");
            if seen > 0 {
                return (seen, computing(&m, "decode"));
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("the prefill leg never counted its tokens");
    };
    let (answer, (during, decode)) =
        tokio::join!(fleet.post_bounded("/v1/completions", &body), watch);
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-pdgate-predicted-cached-tokens"], "0");
    answer.text().await.unwrap();
    // Nothing was cached: the leg computed the whole prompt, as the decision counted it.
    let metrics = fleet.metrics().await;
    let prompt_tokens = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"pdgate_cache_prompt_tokens_total{role="prefill"} "#))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("prompt tokens counted");
    assert_eq!(during, prompt_tokens);
    assert!(during > 400, "{during}");
    // The decode receives the KV: it computes nothing. The answer released the prefill's.
    assert_eq!(decode, 0);
    assert_eq!(computing(&metrics, "prefill"), 0);
}

#[tokio::test]
async fn chat_conversations_follow_their_earlier_turns() {
    let fleet = two_prefills_one_decode(Connector::Shfs, |c| {
        c.policy.prefill_policy = "cache_aware".into()
    })
    .await;
    let mut seen: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for session in 0..4 {
        let mut messages =
            vec![json!({"role": "system", "content": format!("session {session} ").repeat(60)})];
        for turn in 0..3 {
            messages.push(json!({"role": "user", "content": format!("turn {turn} question")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 4});
            let r = fleet.post_bounded("/v1/chat/completions", &body).await;
            assert_eq!(r.status(), 200);
            seen.entry(session)
                .or_default()
                .insert(r.headers()["prefill-target-pod"].to_str().unwrap().into());
            r.text().await.unwrap();
            messages.push(json!({"role": "assistant", "content": "an answer"}));
        }
    }
    for (s, pods) in &seen {
        assert_eq!(pods.len(), 1, "session {s} moved: {pods:?}");
    }
    // Affinity is not everything on one engine: the new sessions spread over both prefills.
    let used: BTreeSet<&String> = seen.values().flatten().collect();
    assert_eq!(used.len(), 2, "sessions on {used:?}: {seen:?}");
}

#[test]
fn bad_cache_knobs_name_the_field() {
    let err = pdgate::Config::from_toml(
        r#"
        prefill_policy = "cache_aware"
        [cache]
        block_size = 0
        "#,
    )
    .unwrap()
    .validate(&kvtransfer::Registry::with_builtins())
    .unwrap_err()
    .to_string();
    assert!(err.contains("cache.block_size"), "{err}");
    let c = pdgate::Config::from_toml(
        r#"
        [cache]
        block_size = 32
        approximate_ttl = "30s"
        decode_only_below_tokens = 128
        [cache.models.m]
        block_size = 64
        "#,
    )
    .unwrap();
    assert_eq!(c.cache.block_size_for(Some("m")), 64);
    assert_eq!(c.cache.approximate_ttl, std::time::Duration::from_secs(30));
    assert!(pdgate::Config::from_toml("[cache]\nblock_sise = 3").is_err());
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON body or of the SSE chunk with usage.
fn usage_cached(body: &str) -> u64 {
    let usage =
        |v: &serde_json::Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    if body.starts_with("data:") {
        body.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| usage(&serde_json::from_str(d).expect("event json")))
            .last()
            .expect("a chunk with usage")
    } else {
        usage(&serde_json::from_str(body).expect("json")).expect("usage")
    }
}

#[tokio::test]
async fn usage_reports_the_prefills_cached_tokens() {
    prefills_cached_tokens_are_billed(Connector::Shfs).await;
}

#[tokio::test]
async fn usage_reports_the_prefills_cached_tokens_with_mooncake() {
    // Concurrent legs: the prefill's answer may come after the decode's usage, which then waits.
    prefills_cached_tokens_are_billed(Connector::Mooncake).await;
}

#[tokio::test]
async fn usage_reports_the_prefills_cached_tokens_with_sglang() {
    prefills_cached_tokens_are_billed(Connector::Sglang).await;
}

async fn prefills_cached_tokens_are_billed(connector: Connector) {
    // Round robin over two prefills, one decode: the decode caches every prompt it served, so
    // on a prompt's second visit it holds it while the other prefill does not.
    let fleet = two_prefills_one_decode(connector, |c| {
        c.policy.prefill_policy = "round_robin".into()
    })
    .await;
    let mut cached = Vec::new();
    for (group, stream) in [(1, false), (1, false), (2, true), (2, true), (1, false)] {
        let mut body = json!({"model": MODEL, "prompt": prompt(group, 0), "max_tokens": 4});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = fleet.post_bounded("/v1/completions", &body).await;
        assert_eq!(r.status(), 200);
        cached.push(usage_cached(&r.text().await.expect("body")));
    }
    assert!(
        fleet.decode[0].stats().prefix_cache_hits > 0,
        "the decode found prompts cached"
    );
    // Second visits land on the prefill that never saw the prompt: it computed all of it.
    assert_eq!(cached[..4], [0, 0, 0, 0]);
    // The third visit of group 1 is back on the prefill that computed it first.
    let hits: u64 = fleet
        .prefill
        .iter()
        .map(|e| e.stats().prefix_cache_hits)
        .sum();
    assert!(cached[4] > 0);
    assert_eq!(cached[4], hits);
}
