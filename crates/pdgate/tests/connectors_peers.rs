//! The connectors whose legs name their peer (P2pNccl, MoRIIO write and read mode,
//! TensorRT-LLM) end to end through pdgate and pdsim on loopback: the decode loaded the
//! prefill's KV (never recomputed), the output matches a single engine, and mixed fleets pair
//! each prefill only with a decode of its own kind.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use common::*;
use pdsim::{Connector, Role};
use serde_json::Value;

async fn baseline_text(body: &Value, path: &str) -> String {
    text_of(&one_engine_answer(path, body).await)
}

async fn end_to_end(connector: Connector) {
    let fleet = pair(connector, |_| {}).await;
    let cases = [
        ("/v1/completions", completion(false)),
        ("/v1/completions", completion(true)),
        ("/v1/chat/completions", chat(false)),
        ("/v1/chat/completions", chat(true)),
    ];
    for (path, body) in &cases {
        let r = fleet.post(path, body).await;
        let status = r.status();
        if status != 200 {
            let why = fleet.decode[0].stats().last_kv_error;
            panic!(
                "{connector:?} {path} {body}: {status} {} ({why:?})",
                r.text().await.unwrap()
            );
        }
        let h = r.headers().clone();
        assert_eq!(h["x-pdgate-connector"], connector.as_str());
        assert_eq!(h["prefill-target-pod"], fleet.prefill[0].addr().to_string());
        assert_eq!(h["target-pod"], fleet.decode[0].addr().to_string());
        assert!(h.get("x-pdgate-fallback").is_none());
        let client_id = h["x-request-id"].to_str().unwrap().to_string();
        let text = text_of(&r.text().await.unwrap());
        assert!(!text.is_empty());
        assert_eq!(
            text,
            baseline_text(body, path).await,
            "{connector:?} {path}"
        );
        let p = last_request(&fleet.prefill[0]);
        let d = last_request(&fleet.decode[0]);
        // One id on both legs.
        assert_eq!(p.request_id, d.request_id, "{connector:?}");
        let leg_id = p.request_id.unwrap();
        match connector {
            Connector::P2pNccl | Connector::Moriio | Connector::MoriioRead => {
                // Both engines named in the id; the client keeps its own id.
                assert!(leg_id.starts_with("___prefill_addr_"), "{leg_id}");
                assert!(leg_id.contains("___decode_addr_"), "{leg_id}");
                assert_ne!(leg_id, client_id);
            }
            _ => assert_eq!(leg_id, client_id),
        }
        if connector == Connector::Trtllm {
            assert!(
                p.body.contains(r#""request_type":"context_only""#),
                "{}",
                p.body
            );
            assert!(
                d.body.contains(r#""request_type":"generation_only""#),
                "{}",
                d.body
            );
        }
    }
    let d = fleet.decode[0].stats();
    assert_eq!(
        d.recomputed, 0,
        "{connector:?}: decode recomputed instead of loading KV"
    );
    assert_eq!(d.transfers_failed, 0, "{connector:?}");
    assert_eq!(
        d.transfers_pulled,
        cases.len() as u64,
        "{connector:?}: {d:?}"
    );
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2pnccl_end_to_end() {
    end_to_end(Connector::P2pNccl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moriio_write_mode_end_to_end() {
    end_to_end(Connector::Moriio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moriio_read_mode_end_to_end() {
    end_to_end(Connector::MoriioRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_end_to_end() {
    end_to_end(Connector::Trtllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_fleet_pairs_each_prefill_with_its_own_kind() {
    let kinds = [
        Connector::Shfs,
        Connector::P2pNccl,
        Connector::Moriio,
        Connector::Trtllm,
    ];
    let fleet = start(
        kinds.iter().map(|c| sim(Role::Prefill, *c)).collect(),
        kinds.iter().map(|c| sim(Role::Decode, *c)).collect(),
        |_| {},
    )
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..16 {
        let (path, body) = if i % 2 == 0 {
            ("/v1/completions", completion(i % 4 == 0))
        } else {
            ("/v1/chat/completions", chat(i % 3 == 0))
        };
        let r = fleet.post(path, &body).await;
        assert_eq!(r.status(), 200, "{body}");
        let connector = r.headers()["x-pdgate-connector"]
            .to_str()
            .unwrap()
            .to_string();
        let idx = kinds.iter().position(|k| k.as_str() == connector).unwrap();
        assert_eq!(
            r.headers()["prefill-target-pod"],
            fleet.prefill[idx].addr().to_string()
        );
        assert_eq!(
            r.headers()["target-pod"],
            fleet.decode[idx].addr().to_string(),
            "{connector} paired with the wrong decode"
        );
        text_of(&r.text().await.unwrap());
        seen.insert(connector);
    }
    assert!(seen.len() >= 3, "most connectors used: {seen:?}");
    for d in &fleet.decode {
        let s = d.stats();
        assert_eq!(s.recomputed, 0, "{s:?}");
        assert_eq!(s.transfers_failed, 0, "{s:?}");
    }
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_route_is_served_by_the_decode_alone_for_peer_connectors() {
    let fleet = pair(Connector::P2pNccl, |_| {}).await;
    let body = serde_json::json!({"model": MODEL, "input": "hello there", "max_output_tokens": 4});
    let r = fleet.post("/v1/responses", &body).await;
    let status = r.status();
    let h = r.headers().clone();
    let text = r.text().await.unwrap();
    // The capability says P2pNccl carries no transfer on this route: no prefill leg ran.
    assert_eq!(
        fleet.prefill[0].stats().recent_requests.len(),
        0,
        "{status} {text}"
    );
    assert!(
        h.get("prefill-target-pod").is_none_or(|v| v.is_empty()),
        "{h:?}"
    );
}
