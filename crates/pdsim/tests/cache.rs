//! The prefix cache and its KV events, through real HTTP and real ZMQ on loopback.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdcache::events::{END_SEQ, EventBatch, KvEvent, decode_batch, decode_seq};
use pdcache::vllm_hash::{BlockHasher, event_value};
use pdsim::{Connector, Faults, KvEventsConfig, Role, SimConfig, SimHandle};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A SUB socket bound on a free loopback port (the router-binds mode) and its endpoint.
async fn subscriber() -> (zeromq::SubSocket, String) {
    let mut sub = zeromq::SubSocket::new();
    let ep = sub.bind("tcp://127.0.0.1:0").await.unwrap();
    sub.subscribe("").await.unwrap();
    (sub, ep.to_string())
}

fn events_to(endpoint: &str, replay: bool) -> KvEventsConfig {
    KvEventsConfig {
        enable_kv_cache_events: true,
        endpoint: endpoint.to_owned(),
        replay_endpoint: replay.then(|| "tcp://127.0.0.1:0".to_owned()),
        topic: "kv@test".to_owned(),
        ..KvEventsConfig::default()
    }
}

/// The next message: (topic, seq, batch).
async fn next(sub: &mut zeromq::SubSocket) -> (String, u64, EventBatch) {
    let m = tokio::time::timeout(Duration::from_secs(5), sub.recv())
        .await
        .expect("an event batch within 5 s")
        .unwrap();
    let f = m.into_vec();
    assert_eq!(f.len(), 3, "topic, sequence, payload");
    (
        String::from_utf8(f[0].to_vec()).unwrap(),
        decode_seq(&f[1]).unwrap(),
        decode_batch(&f[2]).unwrap(),
    )
}

/// Waits until the engine has a connected subscriber (ZMQ drops messages sent before).
async fn connected(h: &SimHandle, sub: &mut zeromq::SubSocket) {
    // Probe with resets until one arrives; then drain nothing else is pending.
    for _ in 0..100 {
        h.reset_prefix_cache();
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            let _ = m;
            while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(30), sub.recv()).await
            {
            }
            return;
        }
    }
    panic!("subscriber never connected");
}

fn words(n: usize, tag: &str) -> String {
    (0..n).map(|i| format!("{tag}{i} ")).collect()
}

async fn complete(h: &SimHandle, prompt: &str) -> Value {
    let (s, _, v) = post(completions(h), &json!({"prompt": prompt, "max_tokens": 1})).await;
    assert_eq!(s, 200, "{v}");
    v
}

fn stored(b: &EventBatch) -> Vec<&pdcache::events::BlockStored> {
    b.events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn repeated_prefixes_hit_capped_below_the_prompt_and_cost_less() {
    let h = engine(Role::Both, Connector::None).await;
    // 40 words + BOS = 41 tokens: 2 full blocks of 16.
    let p = words(40, "a");
    assert_eq!(cached(&complete(&h, &p).await), 0);
    let after_first = h.stats().computed_tokens;
    assert_eq!(after_first, 41);
    assert_eq!(cached(&complete(&h, &p).await), 32);
    assert_eq!(
        h.stats().computed_tokens - after_first,
        9,
        "only the uncached tail is computed"
    );
    // A prompt of exactly 3 blocks recomputes its last block: hit 32, not 48.
    let q = words(47, "a");
    assert_eq!(cached(&complete(&h, &q).await), 32);
    assert_eq!(cached(&complete(&h, &q).await), 32);
    // Another first block: no hit at all.
    assert_eq!(cached(&complete(&h, &words(40, "b")).await), 0);
    let s = h.stats();
    assert_eq!(s.prefix_cache_hits, 96);
    assert_eq!(s.prefix_cache_queries, 41 + 41 + 48 + 48 + 41);
    // /metrics says the same as usage and /sim/stats.
    let m = client()
        .get(format!("{}/metrics", h.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("vllm:prefix_cache_hits_total{model_name=\"pdsim\"} 96"),
        "{m}"
    );
    assert!(m.contains(&format!(
        "vllm:prefix_cache_queries_total{{model_name=\"pdsim\"}} {}",
        s.prefix_cache_queries
    )));
    assert!(m.contains("vllm:prompt_tokens_cached_total{model_name=\"pdsim\"} 96"));
    assert!(m.contains("vllm:request_prefill_kv_computed_tokens_count{model_name=\"pdsim\"} 5"));
    h.shutdown().await;
}

#[tokio::test]
async fn no_prefix_caching_computes_everything_and_details_can_be_off() {
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.cache.enable_prefix_caching = false;
        c.cache.enable_prompt_tokens_details = false;
    })
    .await;
    let p = words(40, "a");
    complete(&h, &p).await;
    let v = complete(&h, &p).await;
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    assert_eq!(h.stats().computed_tokens, 82);
    assert_eq!(h.stats().prefix_cache_hits, 0);
    h.shutdown().await;
}

#[tokio::test]
async fn stored_events_carry_vllm_hashes_and_eviction_emits_block_removed() {
    let (mut sub, ep) = subscriber().await;
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.kv_events = events_to(&ep, false);
        c.cache.kv_cache_blocks = 2;
    })
    .await;
    connected(&h, &mut sub).await;
    let a = words(33, "a");
    complete(&h, &a).await;
    let (topic, _, b) = next(&mut sub).await;
    assert_eq!(topic, "kv@test");
    assert_eq!(b.data_parallel_rank, Some(0));
    let s = stored(&b);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].block_size, 16);
    assert_eq!(s[0].parent_block_hash, None);
    assert_eq!(s[0].token_ids.len(), 32);
    // The hashes are vLLM's sha256_cbor over the token ids the event carries.
    let want: Vec<u64> = BlockHasher::default()
        .chain(&s[0].token_ids, 16)
        .iter()
        .map(event_value)
        .collect();
    let got: Vec<u64> = s[0].block_hashes.iter().map(|h| h.as_u64()).collect();
    assert_eq!(got, want);
    // The tokens are what /tokenize answers.
    let (st, _, t) = post(format!("{}/tokenize", h.base_url()), &json!({"prompt": a})).await;
    assert_eq!(st, 200);
    assert_eq!(t["count"], 34);
    let ids: Vec<u32> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(&ids[..32], &s[0].token_ids[..]);
    // A different 2-block prompt evicts both blocks, deepest first, before storing.
    complete(&h, &words(33, "b")).await;
    let (_, _, b) = next(&mut sub).await;
    let kinds: Vec<&str> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(_) => "stored",
            KvEvent::BlockRemoved(_) => "removed",
            KvEvent::AllBlocksCleared => "cleared",
        })
        .collect();
    assert_eq!(kinds, ["removed", "removed", "stored"]);
    match &b.events[0] {
        KvEvent::BlockRemoved(r) => assert_eq!(r.block_hashes[0].as_u64(), got[1]),
        e => panic!("{e:?}"),
    }
    // A reset is AllBlocksCleared.
    let r = client()
        .post(format!("{}/reset_prefix_cache", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, _, b) = next(&mut sub).await;
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(h.stats().cached_blocks, 0);
    assert!(h.stats().kv_event_batches_published >= 3);
    h.shutdown().await;
}

#[tokio::test]
async fn a_decode_caches_the_kv_it_pulled_and_its_generated_tokens() {
    let (mut sub, ep) = subscriber().await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let d = engine_with(Role::Decode, Connector::Shfs, |c| {
        c.kv_events = events_to(&ep, false)
    })
    .await;
    connected(&d, &mut sub).await;
    let prompt = words(40, "t");
    let (s, _, pv) = post(
        completions(&p),
        &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200);
    let kv = pv["kv_transfer_params"].clone();
    let (s, _, dv) = post(
        completions(&d),
        &json!({"prompt": prompt, "max_tokens": 30, "kv_transfer_params": kv}),
    )
    .await;
    assert_eq!(s, 200, "{dv}");
    assert_eq!(d.stats().transfers_pulled, 1);
    assert_eq!(
        d.stats().computed_tokens,
        0,
        "the KV arrived, nothing computed"
    );
    // Prompt (41) + 29 generated tokens with KV = 70 tokens: 4 full blocks.
    let mut blocks = 0;
    while blocks < 4 {
        let (_, _, b) = next(&mut sub).await;
        blocks += stored(&b)
            .iter()
            .map(|s| s.block_hashes.len())
            .sum::<usize>();
    }
    assert_eq!(blocks, 4);
    assert_eq!(d.stats().cached_blocks, 4);
    // The next turn (history + answer + more) sent straight to the decode hits locally.
    let answer = dv["choices"][0]["text"].as_str().unwrap();
    let next_turn = format!("{prompt}{answer} and more words here");
    let (s, _, v) = post(
        completions(&d),
        &json!({"prompt": next_turn, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(cached(&v), 64);
    assert_eq!(d.stats().prefix_cache_hits, 64);
    p.shutdown().await;
    d.shutdown().await;
}

#[tokio::test]
async fn replay_returns_the_batches_a_subscriber_missed() {
    let (_sub, ep) = subscriber().await;
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.kv_events = events_to(&ep, true)
    })
    .await;
    for i in 0..3 {
        complete(&h, &words(20, &format!("r{i}x"))).await;
    }
    let replay = h.kv_events_replay_endpoint().unwrap().to_owned();
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay).await.unwrap();
    // Wait until all three went through the publisher.
    for _ in 0..200 {
        if h.stats().kv_event_batches_published + h.stats().kv_event_batches_dropped >= 1
            && h.stats().kv_events_published >= 3
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut ask = ZmqMessage::from(bytes::Bytes::new());
    ask.push_back(bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()));
    dealer.send(ask).await.unwrap();
    let mut seqs = Vec::new();
    let mut events = 0;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(m.len(), 4, "empty, topic, seq, payload");
        assert!(m[0].is_empty());
        assert_eq!(&m[1][..], b"kv@test");
        let seq = decode_seq(&m[2]).unwrap();
        if seq == END_SEQ {
            break;
        }
        seqs.push(seq);
        events += decode_batch(&m[3]).unwrap().events.len();
    }
    assert!(!seqs.is_empty());
    assert_eq!(seqs[0], 0);
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
    assert_eq!(events, 3);
    h.shutdown().await;
}

#[tokio::test]
async fn event_faults_skip_drop_and_restart_sequences() {
    let (mut sub, ep) = subscriber().await;
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.kv_events = events_to(&ep, false)
    })
    .await;
    connected(&h, &mut sub).await;
    complete(&h, &words(20, "f0x")).await;
    let (_, s0, _) = next(&mut sub).await;
    h.set_faults(Faults {
        kv_events_skip_seq: 5,
        ..Faults::default()
    });
    complete(&h, &words(20, "f1x")).await;
    let (_, s1, _) = next(&mut sub).await;
    assert_eq!(s1, s0 + 6);
    h.set_faults(Faults {
        kv_events_drop_rate: 1.0,
        ..Faults::default()
    });
    let dropped = h.stats().kv_event_batches_dropped;
    complete(&h, &words(20, "f2x")).await;
    for _ in 0..200 {
        if h.stats().kv_event_batches_dropped > dropped {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.stats().kv_event_batches_dropped, dropped + 1);
    h.set_faults(Faults::default());
    // A restart: cache gone, sequence from 0 again, no AllBlocksCleared.
    let r = client()
        .post(format!("{}/sim/restart", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(h.stats().cached_blocks, 0);
    complete(&h, &words(20, "f0x")).await;
    let (_, s, b) = next(&mut sub).await;
    assert_eq!(s, 0);
    assert_eq!(
        stored(&b).len(),
        1,
        "stored again from scratch: {:?}",
        b.events
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_stalled_publisher_sends_when_the_stall_ends() {
    let (mut sub, ep) = subscriber().await;
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.kv_events = events_to(&ep, false)
    })
    .await;
    connected(&h, &mut sub).await;
    h.set_faults(Faults {
        kv_events_stall: true,
        ..Faults::default()
    });
    complete(&h, &words(20, "s0x")).await;
    complete(&h, &words(20, "s1x")).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(150), sub.recv())
            .await
            .is_err(),
        "nothing while stalled"
    );
    h.set_faults(Faults::default());
    let mut got = 0;
    while got < 2 {
        let (_, _, b) = next(&mut sub).await;
        got += stored(&b).len();
    }
    assert_eq!(got, 2);
    h.shutdown().await;
}

#[test]
fn sim_config_defaults_keep_the_cache_on_and_events_off() {
    let c = SimConfig::new(Role::Both, Connector::None);
    assert!(c.cache.enable_prefix_caching);
    assert_eq!(c.cache.block_size, 16);
    assert!(!c.kv_events.publishes());
}
