//! Cache-aware routing in precise mode: pdsim engines with prefix caches publish vLLM KV events
//! (over ipc sockets, so nothing listens beyond this machine), pdgate subscribes, and its
//! predictions must equal the engines' own prefix-cache hits.

mod common;

use std::time::Duration;

use common::{MODEL, sim};
use pdgate::Config;
use pdsim::{Connector, KvEventsConfig, Role, SimConfig};
use serde_json::json;

fn ipc(tag: &str) -> String {
    let dir = std::env::temp_dir();
    format!(
        "ipc://{}/pdgate-kv-{}-{tag}.sock",
        dir.display(),
        uuid::Uuid::new_v4().simple()
    )
}

/// An engine with a prefix cache of `blocks` blocks of 16 tokens publishing its KV events. Its
/// tokenizer is a Hugging Face one, so token-id prompts reach the cache untouched, as in vLLM
/// (pdsim's default word tokenizer puts a BOS before them).
fn engine(role: Role, blocks: usize, tokenizer: &common::WordTokenizer) -> SimConfig {
    let mut c = sim(role, Connector::Shfs);
    c.cache.block_size = 16;
    c.cache.tokenizer = Some(tokenizer.path.clone());
    c.cache.kv_cache_blocks = blocks;
    c.kv_events = KvEventsConfig {
        enable_kv_cache_events: true,
        endpoint: ipc("pub"),
        replay_endpoint: Some(ipc("replay")),
        ..KvEventsConfig::default()
    };
    c
}

/// A prompt of token ids: a 256-token prefix per group, then 40 tokens of its own.
fn tokens(group: u32, question: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..256).map(|i| 1000 + group * 997 + i).collect();
    t.extend((0..40).map(|i| 50_000 + question * 41 + i));
    t
}

/// Two prefills and two decodes publishing events, a cache-aware gateway subscribed to them.
async fn start(tweak: impl FnOnce(&mut Config)) -> common::Fleet {
    // Loaded when the engines start; removed once they have.
    let tok = common::WordTokenizer::new(["hello", "world"]);
    let prefill = vec![
        engine(Role::Prefill, 4096, &tok),
        engine(Role::Prefill, 4096, &tok),
    ];
    let decode = vec![
        engine(Role::Decode, 4096, &tok),
        engine(Role::Decode, 4096, &tok),
    ];
    let events = |list: &[SimConfig]| -> Vec<(String, Option<String>)> {
        list.iter()
            .map(|c| {
                (
                    c.kv_events.endpoint.clone(),
                    c.kv_events.replay_endpoint.clone(),
                )
            })
            .collect()
    };
    let (pe, de) = (events(&prefill), events(&decode));
    common::start(prefill, decode, move |c| {
        c.prefill_policy = "cache_aware".into();
        c.decode_policy = "cache_aware".into();
        c.cache.block_size = 16;
        for (ep, (events, replay)) in c.prefill.iter_mut().zip(&pe) {
            ep.kv_events = Some(events.clone());
            ep.kv_events_replay = replay.clone();
        }
        for (ep, (events, replay)) in c.decode.iter_mut().zip(&de) {
            ep.kv_events = Some(events.clone());
            ep.kv_events_replay = replay.clone();
        }
        tweak(c);
    })
    .await
}

fn prefill_hits(fleet: &common::Fleet) -> u64 {
    fleet
        .prefill
        .iter()
        .map(|e| e.stats().prefix_cache_hits)
        .sum()
}

/// Waits (bounded) until the gateway's subscriptions stored at least `blocks` blocks.
async fn wait_events(fleet: &common::Fleet, role: &str, blocks: u64) {
    wait_events_at(fleet, &fleet.gateway.base_url(), role, blocks).await;
}

async fn wait_events_at(fleet: &common::Fleet, base: &str, role: &str, blocks: u64) {
    let want = format!(r#"pdgate_cache_events{{role="{role}",what="blocks_stored"}} "#);
    for _ in 0..100 {
        let m = fleet
            .http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics body");
        let seen: u64 = m
            .lines()
            .find_map(|l| l.strip_prefix(want.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if seen >= blocks {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never saw {blocks} stored {role} blocks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_equal_the_engines_hits_and_prefixes_stick() {
    let fleet = start(|_| {}).await;
    let mut exact = 0;
    let mut total = 0;
    let mut owner: std::collections::BTreeMap<u32, String> = Default::default();
    for q in 0..6 {
        for g in 0..4 {
            let body = json!({"model": MODEL, "prompt": tokens(g, q), "max_tokens": 4});
            let before = prefill_hits(&fleet);
            let r = fleet.post_bounded("/v1/completions", &body).await;
            assert_eq!(r.status(), 200);
            let predicted: u64 = r.headers()["x-pdgate-predicted-cached-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let prefill = r.headers()["prefill-target-pod"]
                .to_str()
                .unwrap()
                .to_string();
            r.text().await.unwrap();
            let actual = prefill_hits(&fleet) - before;
            total += 1;
            if predicted == actual {
                exact += 1;
            }
            if q > 0 {
                assert_eq!(owner[&g], prefill, "group {g} moved");
                assert!(actual > 0, "group {g} question {q} missed");
            }
            owner.entry(g).or_insert(prefill);
        }
    }
    assert!(
        exact * 100 >= total * 99,
        "{exact} of {total} predictions exact"
    );
    wait_events(&fleet, "prefill", 4 * 18).await;
    let m = fleet.metrics().await;
    assert!(
        m.contains(r#"pdgate_cache_events{role="decode",what="blocks_stored"}"#),
        "{m}"
    );
    assert!(m.contains(r#"pdgate_cache_event_lag_seconds{role="prefill",what="max"}"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_engine_cache_is_forgotten() {
    let fleet = start(|_| {}).await;
    let body = |q| json!({"model": MODEL, "prompt": tokens(9, q), "max_tokens": 4});
    let r = fleet.post_bounded("/v1/completions", &body(0)).await;
    let first = r.headers()["prefill-target-pod"]
        .to_str()
        .unwrap()
        .to_string();
    r.text().await.unwrap();
    wait_events(&fleet, "prefill", 18).await;
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        e.reset_prefix_cache();
    }
    // Bounded wait until the gateway applied the clears; then nothing is predicted cached.
    let mut predicted = u64::MAX;
    for _ in 0..100 {
        let m = fleet.metrics().await;
        if m.contains(r#"pdgate_cache_index_entries{model="m"} 0"#) {
            predicted = 0;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(predicted, 0, "the index kept entries of cleared engines");
    let before = prefill_hits(&fleet);
    let r = fleet.post_bounded("/v1/completions", &body(1)).await;
    assert_eq!(r.headers()["x-pdgate-predicted-cached-tokens"], "0");
    r.text().await.unwrap();
    assert_eq!(prefill_hits(&fleet) - before, 0);
    let _ = first;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_reading_the_same_events_agree() {
    let fleet = start(|_| {}).await;
    let config = fleet.gateway.gateway().config.clone();
    let gw = pdgate::Gateway::new(config, kvtransfer::Registry::with_builtins()).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let pods = gw.config.pods().expect("pods");
    let second = pdgate::RunningGateway::start(gw, listener, pods)
        .await
        .expect("second gateway");
    let post = |base: String, g: u32, q: u32| {
        let http = fleet.http.clone();
        async move {
            let body = json!({"model": MODEL, "prompt": tokens(g, q), "max_tokens": 4});
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("request");
            assert_eq!(r.status(), 200);
            let pair = (
                r.headers()["prefill-target-pod"]
                    .to_str()
                    .unwrap()
                    .to_string(),
                r.headers()["target-pod"].to_str().unwrap().to_string(),
            );
            r.text().await.unwrap();
            pair
        }
    };
    let first = fleet.gateway.base_url();
    for g in 0..4 {
        post(first.clone(), g, 0).await;
    }
    // Both gateways have seen every engine's blocks (the second only through events).
    for base in [first.clone(), second.base_url()] {
        wait_events_at(&fleet, &base, "prefill", 4 * 18).await;
        wait_events_at(&fleet, &base, "decode", 4 * 18).await;
    }
    for g in 0..4 {
        let a = post(first.clone(), g, 1).await;
        let b = post(second.base_url(), g, 2).await;
        assert_eq!(a, b, "the gateways disagree on group {g}");
    }
}
