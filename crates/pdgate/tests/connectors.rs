//! Every connector end to end through real HTTP on loopback, asserting on the engines' counters
//! that KV was really handed off (not recomputed) and that outputs match a single engine.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use common::*;
use pdsim::{Connector, Role};
use serde_json::{Value, json};

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
        assert_eq!(r.status(), 200, "{connector:?} {path} {body}");
        let h = r.headers().clone();
        assert_eq!(h["x-pdgate-connector"], connector.as_str());
        assert_eq!(h["prefill-target-pod"], fleet.prefill[0].addr().to_string());
        assert_eq!(h["target-pod"], fleet.decode[0].addr().to_string());
        assert!(h.get("x-pdgate-fallback").is_none());
        let id = h["x-request-id"].to_str().unwrap().to_string();
        let text = text_of(&r.text().await.unwrap());
        assert!(!text.is_empty());
        assert_eq!(
            text,
            baseline_text(body, path).await,
            "{connector:?} {path}"
        );
        // The same request id reached both legs.
        let p = fleet.prefill[0].stats();
        let d = fleet.decode[0].stats();
        assert_eq!(
            p.recent_requests.last().unwrap().request_id.as_deref(),
            Some(id.as_str())
        );
        assert_eq!(
            d.recent_requests.last().unwrap().request_id.as_deref(),
            Some(id.as_str())
        );
    }
    assert_kv_loaded(&fleet.decode[0], connector, cases.len());
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shfs_end_to_end() {
    end_to_end(Connector::Shfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_end_to_end() {
    end_to_end(Connector::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_end_to_end() {
    end_to_end(Connector::Mooncake).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_end_to_end() {
    end_to_end(Connector::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shfs_remote_host_is_the_prefill_pod_ip_not_what_the_engine_advertised() {
    let mut p = sim(Role::Prefill, Connector::Shfs);
    // An engine that advertises an address nobody can reach: the gateway must overwrite it.
    p.advertise_host = "unreachable.invalid".into();
    let fleet = start(vec![p], vec![sim(Role::Decode, Connector::Shfs)], |_| {}).await;
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 200);
    let d = fleet.decode[0].stats();
    assert_eq!(d.transfers_pulled, 1);
    let sent = &d.recent_requests.last().unwrap().body;
    assert!(sent.contains(r#""remote_host":"127.0.0.1""#), "{sent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_transfer_fields_never_reach_the_engines() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let mut body = completion(false);
    body["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_host": "169.254.169.254", "remote_port": 80});
    body["bootstrap_host"] = json!("169.254.169.254");
    body["disagg_prefill_resp"] = json!({"x": 1});
    let r = fleet
        .http
        .post(fleet.url("/v1/completions"))
        .header("x-data-parallel-rank", "7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for engine in fleet.prefill.iter().chain(fleet.decode.iter()) {
        let last = engine.stats().recent_requests.last().unwrap().clone();
        assert!(!last.body.contains("169.254.169.254"), "{}", last.body);
        assert!(!last.body.contains("disagg_prefill_resp"), "{}", last.body);
        assert_eq!(last.data_parallel_rank, None);
    }
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_fleet_routes_each_request_with_the_prefill_pods_agent() {
    let fleet = start(
        vec![
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Mooncake),
        ],
        vec![
            sim(Role::Decode, Connector::Shfs),
            sim(Role::Decode, Connector::Mooncake),
        ],
        |_| {},
    )
    .await;
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..8 {
        let body = if i % 2 == 0 {
            completion(i % 4 == 0)
        } else {
            chat(i % 3 == 0)
        };
        let path = if i % 2 == 0 {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let r = fleet.post(path, &body).await;
        assert_eq!(r.status(), 200);
        let connector = r.headers()["x-pdgate-connector"]
            .to_str()
            .unwrap()
            .to_string();
        let prefill = r.headers()["prefill-target-pod"]
            .to_str()
            .unwrap()
            .to_string();
        let decode = r.headers()["target-pod"].to_str().unwrap().to_string();
        let idx = if connector == "shfs" { 0 } else { 1 };
        assert_eq!(prefill, fleet.prefill[idx].addr().to_string());
        assert_eq!(
            decode,
            fleet.decode[idx].addr().to_string(),
            "{connector} paired with the wrong decode"
        );
        text_of(&r.text().await.unwrap());
        *seen.entry(connector).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "both connectors used: {seen:?}");
    for d in &fleet.decode {
        let s = d.stats();
        assert_eq!(s.recomputed, 0, "{s:?}");
        assert_eq!(s.transfers_failed, 0, "{s:?}");
        assert!(s.transfers_pulled > 0, "{s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefills_share_the_load_and_models_route() {
    let fleet = two_prefills_one_decode(Connector::Shfs, |c| {
        c.policy.prefill_policy = "round_robin".into()
    })
    .await;
    for _ in 0..4 {
        assert_eq!(
            fleet
                .post("/v1/completions", &completion(false))
                .await
                .status(),
            200
        );
    }
    for p in &fleet.prefill {
        assert_eq!(p.stats().requests.completions, 2);
    }
    let models: Value = fleet
        .http
        .get(fleet.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    let r = fleet
        .post("/v1/completions", &json!({"model": "other", "prompt": "x"}))
        .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 404);
}
