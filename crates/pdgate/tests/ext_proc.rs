//! pdgate as Envoy's external processor (`pdgate ext-proc`), driven by a client that speaks
//! ext_proc the way Envoy does (`common::envoy`; no Envoy can be installed here). The engines
//! are pdsim's; the handoff checks are the proxy tests'.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::envoy::*;
use common::*;
use http::header::{HeaderMap, HeaderValue};
use pdgate::ExtProcOptions;
use pdsim::{Connector, Role};
use serde_json::{Value, json};

async fn ext_pair(connector: Connector, tweak: impl FnOnce(&mut pdgate::Config)) -> Fleet {
    start_ext_proc(
        vec![sim(Role::Prefill, connector)],
        vec![sim(Role::Decode, connector)],
        tweak,
        ExtProcOptions::default(),
    )
    .await
}

async fn baseline_text(body: &Value, path: &str) -> String {
    text_of(&one_engine_answer(path, body).await)
}

/// The proxy tests' handoff checks, through the processor: the decode loaded the prefill's KV
/// for every request and answered what one engine answers.
async fn hands_off(connector: Connector) {
    let fleet = ext_pair(connector, |_| {}).await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let cases = [
        ("/v1/completions", completion(false)),
        ("/v1/completions", completion(true)),
        ("/v1/chat/completions", chat(false)),
        ("/v1/chat/completions", chat(true)),
    ];
    let decode = fleet.decode[0].addr().to_string();
    let prefill = fleet.prefill[0].addr().to_string();
    for (path, body) in &cases {
        let r = match envoy.request(path, body, &[], None).await {
            Ok(r) => r,
            Err(refused) => {
                let why = fleet.decode[0].stats().last_kv_error;
                panic!("{connector:?} {path}: {refused:?} ({why:?})");
            }
        };
        assert_eq!(r.status, 200, "{connector:?} {path}: {}", r.body);
        assert_eq!(r.destination, decode);
        assert_eq!(r.target_pod, decode);
        assert_eq!(r.metadata_destination.as_deref(), Some(decode.as_str()));
        assert_eq!(r.prefiller, None);
        let h = &r.headers;
        assert_eq!(h["x-pdgate-connector"], connector.as_str());
        assert_eq!(h["prefill-target-pod"], prefill.as_str());
        assert_eq!(h["target-pod"], decode.as_str());
        assert!(h.get("x-pdgate-fallback").is_none());
        let text = text_of(&r.body);
        assert!(!text.is_empty());
        assert_eq!(
            text,
            baseline_text(body, path).await,
            "{connector:?} {path}"
        );
        // One id on both legs (a connector that addresses its engines through it chose it).
        let p = last_request(&fleet.prefill[0]);
        let d = last_request(&fleet.decode[0]);
        assert_eq!(p.request_id, d.request_id, "{connector:?}");
        assert_eq!(d.body.as_bytes(), &r.sent_body[..]);
    }
    assert_kv_loaded(&fleet.decode[0], connector, cases.len());
    fleet.wait_idle().await;
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric(&metrics, "pdgate_requests_total{route=\"completions\""),
        2.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shfs_hands_off_through_ext_proc() {
    hands_off(Connector::Shfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_hands_off_through_ext_proc() {
    hands_off(Connector::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_hands_off_through_ext_proc() {
    hands_off(Connector::Mooncake).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_hands_off_through_ext_proc() {
    hands_off(Connector::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2pnccl_hands_off_through_ext_proc() {
    hands_off(Connector::P2pNccl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moriio_write_mode_hands_off_through_ext_proc() {
    hands_off(Connector::Moriio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moriio_read_mode_hands_off_through_ext_proc() {
    hands_off(Connector::MoriioRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_hands_off_through_ext_proc() {
    hands_off(Connector::Trtllm).await;
}

fn prompt(group: usize, question: usize) -> String {
    let prefix: String = format!("system prompt of group {group}: ").repeat(80);
    format!("{prefix} question {question}: what is {question} times {group}?")
}

/// What a cache-aware decision said about one request, by engine index (the fleets' ports
/// differ).
#[derive(Debug)]
struct Decision {
    prefill: Option<usize>,
    decode: usize,
    decode_only: Option<String>,
    predicted_cached: Option<String>,
}

fn decision(fleet: &Fleet, h: &reqwest::header::HeaderMap) -> Decision {
    let index = |list: &[pdsim::SimHandle], name: &str| {
        h.get(name).map(|v| {
            let v = v.to_str().unwrap();
            list.iter()
                .position(|e| e.addr().to_string() == v)
                .expect("a fleet engine")
        })
    };
    let text = |name: &str| h.get(name).map(|v| v.to_str().unwrap().to_string());
    Decision {
        prefill: index(&fleet.prefill, "prefill-target-pod"),
        decode: index(&fleet.decode, "target-pod").expect("a decode"),
        decode_only: text("x-pdgate-decode-only"),
        predicted_cached: text("x-pdgate-predicted-cached-tokens"),
    }
}

fn cache_aware(c: &mut pdgate::Config) {
    c.policy.prefill_policy = "cache_aware".into();
    c.policy.decode_policy = "cache_aware".into();
    c.cache.decode_only_below_tokens = 64;
}

/// The same requests, one at a time, through the proxy and through the processor, each in front
/// of its own fresh fleet: the same decisions (pair, decode-only, predicted cached tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_decisions_and_decode_only_match_the_proxy() {
    let engines = || {
        (
            vec![
                sim(Role::Prefill, Connector::Shfs),
                sim(Role::Prefill, Connector::Shfs),
            ],
            vec![
                sim(Role::Decode, Connector::Shfs),
                sim(Role::Decode, Connector::Shfs),
            ],
        )
    };
    let asked = [(1, 0), (2, 0), (1, 1), (2, 1), (3, 0), (1, 2)];
    let groups: Vec<usize> = asked.iter().map(|(g, _)| *g).collect();
    let requests: Vec<Value> = asked
        .into_iter()
        .map(|(g, q)| json!({"model": MODEL, "prompt": prompt(g, q), "max_tokens": 4}))
        .collect();
    let (p, d) = engines();
    let proxy = start(p, d, cache_aware).await;
    let mut by_proxy = Vec::new();
    for body in &requests {
        let r = proxy.post_bounded("/v1/completions", body).await;
        assert_eq!(r.status(), 200);
        by_proxy.push(decision(&proxy, r.headers()));
        r.text().await.unwrap();
    }
    let (p, d) = engines();
    let ext = start_ext_proc(p, d, cache_aware, ExtProcOptions::default()).await;
    let envoy = Envoy::new(ext.gateway.addr());
    let mut by_ext = Vec::new();
    for body in &requests {
        let r = envoy
            .request("/v1/completions", body, &[], None)
            .await
            .expect("served");
        assert_eq!(r.status, 200);
        let d = decision(&ext, &r.headers);
        assert_eq!(r.destination, ext.decode[d.decode].addr().to_string());
        if d.decode_only.is_some() {
            // Decode-only: the client's request, no transfer fields, no prefill leg.
            assert!(!String::from_utf8_lossy(&r.sent_body).contains("kv_transfer_params"));
        }
        text_of(&r.body);
        by_ext.push(d);
    }
    // What the cache decided is the same; which of two idle engines takes a new prefix is a
    // tie either may win, so engines are compared through affinity: a decode-only request goes
    // to the decode that served its prefix first, in both fleets.
    let outcome = |d: &[Decision]| -> Vec<(bool, Option<String>, Option<String>)> {
        d.iter()
            .map(|d| {
                (
                    d.prefill.is_some(),
                    d.decode_only.clone(),
                    d.predicted_cached.clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        outcome(&by_ext),
        outcome(&by_proxy),
        "{by_ext:?} {by_proxy:?}"
    );
    for decisions in [&by_ext, &by_proxy] {
        for (i, d) in decisions.iter().enumerate() {
            if d.decode_only.is_some() {
                let first = groups.iter().position(|g| *g == groups[i]).unwrap();
                assert_eq!(d.decode, decisions[first].decode, "{decisions:?}");
            }
        }
    }
    // The decisions are worth comparing: affinity made some requests decode-only.
    let alone = by_ext.iter().filter(|d| d.decode_only.is_some()).count();
    assert!(alone >= 2, "{by_ext:?}");
    let prefilled: u64 = ext
        .prefill
        .iter()
        .map(|p| p.stats().requests.completions)
        .sum();
    assert_eq!(prefilled as usize, requests.len() - alone);
    let metrics = ext.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            r#"pdgate_cache_decisions_total{role="decode",kind="decode_only"}"#
        ),
        alone as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_the_decode_and_an_empty_fit_is_503() {
    let fleet = start_ext_proc(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![
            sim(Role::Decode, Connector::Shfs),
            sim(Role::Decode, Connector::Shfs),
        ],
        |c| c.policy.decode_policy = "round_robin".into(),
        ExtProcOptions::default(),
    )
    .await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let second = fleet.decode[1].addr().to_string();
    let mut seen = BTreeMap::new();
    for i in 0..4 {
        // Metadata (the protocol's form) and the header (its fallback) alike.
        let r = if i % 2 == 0 {
            let hint = pdgate::extproc::subset_metadata(&[&second, "10.9.9.9:8000"]);
            envoy
                .request("/v1/completions", &completion(false), &[], Some(hint))
                .await
        } else {
            let header = format!("10.9.9.9:8000, {second}");
            envoy
                .request(
                    "/v1/completions",
                    &completion(false),
                    &[("x-gateway-destination-endpoint-subset", &header)],
                    None,
                )
                .await
        }
        .expect("served");
        assert_eq!(r.status, 200);
        *seen.entry(r.destination).or_insert(0) += 1;
    }
    assert_eq!(seen, BTreeMap::from([(second.clone(), 4)]));
    // Without a hint, round robin uses both.
    for _ in 0..2 {
        let r = envoy
            .request("/v1/completions", &completion(false), &[], None)
            .await;
        *seen.entry(r.expect("served").destination).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    let hint = pdgate::extproc::subset_metadata(&["10.9.9.9:8000"]);
    match envoy
        .request("/v1/completions", &completion(false), &[], Some(hint))
        .await
    {
        Err(Refused::Immediate {
            status,
            body,
            headers,
        }) => {
            assert_eq!(status, 503);
            assert_eq!(body["error"]["code"], 503, "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("subset")
            );
            assert_eq!(headers["content-type"], "application/json");
            assert!(headers.get("x-request-id").is_some());
        }
        Err(other) => panic!("{other:?}"),
        Ok(r) => panic!("served by {} despite the hint", r.destination),
    }
    // Nothing reached an engine for it.
    assert_eq!(fleet.prefill[0].stats().requests.completions, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_form_names_the_prefill_and_leaves_its_call_to_the_sidecar() {
    let fleet = start_ext_proc(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |_| {},
        ExtProcOptions {
            prefill_by_sidecar: true,
        },
    )
    .await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let mut body = completion(false);
    body["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_host": "169.254.169.254"});
    let r = envoy
        .request("/v1/completions", &body, &[], None)
        .await
        .expect("served");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.destination, fleet.decode[0].addr().to_string());
    assert_eq!(r.prefiller, Some(fleet.prefill[0].addr().to_string()));
    // The client's request minus its transfer fields; pdgate called no prefill.
    let sent = String::from_utf8_lossy(&r.sent_body).to_string();
    assert!(!sent.contains("kv_transfer_params"), "{sent}");
    assert!(!sent.contains("169.254.169.254"), "{sent}");
    assert_eq!(fleet.prefill[0].stats().requests.completions, 0);
    assert!(!text_of(&r.body).is_empty());
    fleet.wait_idle().await;
}

/// The gateway's in-flight gauge of the decode.
async fn decode_in_flight(fleet: &Fleet) -> f64 {
    let metrics = fleet.metrics().await;
    metric(&metrics, "pdgate_endpoint_in_flight{role=\"decode\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_mid_response_releases_the_load() {
    let mut decode = sim(Role::Decode, Connector::Shfs);
    decode.latency.itl = Duration::from_millis(40);
    let fleet = start_ext_proc(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![decode],
        |_| {},
        ExtProcOptions::default(),
    )
    .await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let body =
        json!({"model": MODEL, "prompt": "a long answer", "max_tokens": 200, "stream": true});
    let mut decided = envoy
        .decide("/v1/completions", &body, &[], None)
        .await
        .expect("decided");
    let mut r = decided.forward(&envoy.http).await;
    decided.head(&r).await.expect("head relayed");
    for _ in 0..2 {
        let chunk = r.chunk().await.unwrap().expect("a chunk");
        decided.chunk(chunk, false).await.expect("chunk relayed");
    }
    assert_eq!(decode_in_flight(&fleet).await, 1.0);
    // The client leaves: Envoy resets the upstream request and the processing stream.
    drop(r);
    drop(decided);
    for _ in 0..100 {
        if decode_in_flight(&fleet).await == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(decode_in_flight(&fleet).await, 0.0);
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            r#"pdgate_requests_total{route="completions",connector="shfs",outcome="cancelled""#
        ),
        1.0,
        "{metrics}"
    );
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_past_envoys_message_timeout_is_abandoned() {
    let mut prefill = sim(Role::Prefill, Connector::Shfs);
    prefill.faults.hang = true;
    let fleet = start_ext_proc(
        vec![prefill],
        vec![sim(Role::Decode, Connector::Shfs)],
        |_| {},
        ExtProcOptions::default(),
    )
    .await;
    let mut envoy = Envoy::new(fleet.gateway.addr());
    envoy.message_timeout = Duration::from_millis(300);
    match envoy
        .decide("/v1/completions", &completion(false), &[], None)
        .await
    {
        Err(Refused::TimedOut) => {}
        Err(other) => panic!("{other:?}"),
        Ok(d) => panic!("decided {} with a hung prefill", d.destination()),
    }
    // Envoy gave up and closed the stream: the prefill leg is closed and its load released.
    fleet.wait_idle().await;
    assert_eq!(fleet.decode[0].stats().requests.completions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_comes_is_answered_408_within_the_body_timeout() {
    let fleet = ext_pair(Connector::Shfs, |c| {
        c.security.request_body_timeout = Duration::from_millis(200);
    })
    .await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let mut stream = Stream::open(envoy.addr, Duration::from_secs(10), None).await;
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let pseudo = [(":method", "POST"), (":path", "/v1/completions")];
    let answer = stream
        .send(Req::RequestHeaders(ep::HttpHeaders {
            headers: Some(proto_headers(&pseudo, &headers)),
            end_of_stream: false,
            ..ep::HttpHeaders::default()
        }))
        .await
        .expect("headers answered");
    assert!(matches!(answer.response, Some(Resp::RequestHeaders(_))));
    // No body: the processor answers on its own once the timeout passed.
    let next = tokio::time::timeout(Duration::from_secs(10), stream.rx.message())
        .await
        .expect("answered within the body timeout")
        .expect("an answer")
        .expect("not closed");
    match next.response {
        Some(Resp::ImmediateResponse(i)) => match immediate(i) {
            Refused::Immediate { status, body, .. } => {
                assert_eq!(status, 408);
                assert_eq!(body["error"]["code"], 408);
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_gateways_json_errors() {
    let fleet = ext_pair(Connector::Shfs, |_| {}).await;
    let envoy = Envoy::new(fleet.gateway.addr());
    let cases: [(&str, Value, u16); 3] = [
        (
            "/v1/completions",
            json!({"model": "other", "prompt": "x"}),
            404,
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": true}}),
            400,
        ),
        ("/v1/embeddings", json!({"model": MODEL, "input": "x"}), 404),
    ];
    for (path, body, want) in cases {
        match envoy.request(path, &body, &[], None).await {
            Err(Refused::Immediate { status, body, .. }) => {
                assert_eq!(status, want, "{path} {body}");
                assert_eq!(body["error"]["code"], want, "{body}");
                assert!(body["error"]["message"].is_string(), "{body}");
            }
            Err(other) => panic!("{other:?}"),
            Ok(r) => panic!("{path} forwarded to {}", r.destination),
        }
    }
    // The listener serves no OpenAI route over plain HTTP: Envoy is the front.
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 404, "{v}");
    assert_eq!(fleet.prefill[0].stats().requests.completions, 0);
    assert_eq!(fleet.decode[0].stats().requests.completions, 0);
}
