//! Data-parallel ranks (`--data-parallel-size`): a cache, queue and KV-event publisher per
//! rank, `X-data-parallel-rank` honoured and checked, unpinned requests balanced.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdcache::events::decode_batch;
use pdsim::{Connector, KvEventsConfig, Role, SimHandle};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv};

fn words(n: usize, tag: &str) -> String {
    (0..n).map(|i| format!("{tag}{i} ")).collect()
}

async fn on_rank(h: &SimHandle, prompt: &str, rank: Option<&str>) -> (u16, Value) {
    let body = json!({"prompt": prompt, "max_tokens": 1});
    let headers: Vec<(&str, &str)> = rank
        .map(|r| vec![("X-data-parallel-rank", r)])
        .unwrap_or_default();
    let (s, _, v) = post_h(completions(h), &body, &headers).await;
    (s, v)
}

#[tokio::test]
async fn each_rank_has_its_own_cache_and_the_header_pins_it() {
    let h = engine_with(Role::Both, Connector::None, |c| c.data_parallel_size = 4).await;
    let p = words(40, "a");
    let (s, v) = on_rank(&h, &p, Some("2")).await;
    assert_eq!((s, cached(&v)), (200, 0), "{v}");
    // Rank 2 holds the prompt's blocks; rank 1 does not.
    let (_, v) = on_rank(&h, &p, Some("2")).await;
    assert_eq!(cached(&v), 32);
    let (_, v) = on_rank(&h, &p, Some("1")).await;
    assert_eq!(cached(&v), 0);
    let ranks = h.stats().data_parallel_ranks;
    assert_eq!(ranks.len(), 4);
    assert_eq!(
        ranks.iter().map(|r| r.requests).collect::<Vec<_>>(),
        [0, 1, 2, 0]
    );
    assert_eq!(ranks[2].prefix_cache_hits, 32);
    assert_eq!(ranks[1].prefix_cache_hits, 0);
    // vLLM's answer to a rank it does not have; a header that is no integer is ignored.
    let (s, v) = on_rank(&h, &p, Some("4")).await;
    assert_eq!(s, 400, "{v}");
    assert!(
        error_of(&v, 400)["message"]
            .as_str()
            .unwrap()
            .contains("data_parallel_rank 4 is out of range [0, 4)"),
        "{v}"
    );
    let (s, _) = on_rank(&h, &p, Some("two")).await;
    assert_eq!(s, 200);
    h.shutdown().await;
}

#[tokio::test]
async fn unpinned_requests_spread_over_the_ranks() {
    let h = engine_with(Role::Both, Connector::None, |c| c.data_parallel_size = 4).await;
    for i in 0..16 {
        let (s, _) = on_rank(&h, &words(20, &format!("q{i}-")), None).await;
        assert_eq!(s, 200);
    }
    let per_rank: Vec<u64> = h
        .stats()
        .data_parallel_ranks
        .iter()
        .map(|r| r.requests)
        .collect();
    assert_eq!(per_rank, [4, 4, 4, 4], "idle ranks are taken in turn");
    h.shutdown().await;
}

#[tokio::test]
async fn each_rank_publishes_on_its_own_socket_with_its_rank() {
    let base = format!(
        "ipc://{}/pdsim-dp-{}.sock",
        std::env::temp_dir().display(),
        uuid::Uuid::new_v4().simple()
    );
    let h = engine_with(Role::Both, Connector::None, |c| {
        c.data_parallel_size = 2;
        c.kv_events = KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: base.clone(),
            ..KvEventsConfig::default()
        };
    })
    .await;
    // Rank 1 publishes where vLLM's rank 1 would: the endpoint with `_dp1`.
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&format!("{base}_dp1")).await.unwrap();
    let p = words(40, "b");
    let mut seen = None;
    for _ in 0..100 {
        on_rank(&h, &p, Some("1")).await;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            seen = Some(decode_batch(&m.into_vec()[2]).unwrap());
            break;
        }
        h.reset_prefix_cache();
    }
    let batch = seen.expect("a batch from rank 1");
    assert_eq!(batch.data_parallel_rank, Some(1));
    // Nothing of rank 0's reaches rank 1's socket.
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {}
    on_rank(&h, &words(40, "c"), Some("0")).await;
    let quiet = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await;
    assert!(
        quiet.is_err(),
        "rank 0's request published on rank 1's socket"
    );
    assert!(h.stats().data_parallel_ranks[0].cached_blocks > 0);
    h.shutdown().await;
}
