//! Encoder disaggregation end to end (docs/contracts.md §14): pdgate in front of pdsim encoders,
//! prefills and decodes on loopback. A multimodal chat request goes encoder -> prefill ->
//! decode and the prefill loads each item from the encoder (pdsim fails a wrong handoff);
//! text-only requests and fleets without encoders are served as before; an encoder that fails
//! fails the request clearly, or (`on_encode_failure = "fallback"`) lets the prefill encode.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;
use pdgate::config::{Config, PrefillFailurePolicy};
use pdsim::{Connector, Faults, Role, SimConfig, SimHandle};
use serde_json::{Value, json};

fn image(url: &str) -> Value {
    json!({"type":"image_url","image_url":{"url":url}})
}

/// A chat request with `images` and a question, `max_tokens` 8.
fn mm_chat(images: &[&str], stream: bool) -> Value {
    let mut content: Vec<Value> = images.iter().map(|u| image(u)).collect();
    content.push(json!({"type":"text","text":"describe these pictures"}));
    json!({"model":MODEL,"messages":[{"role":"user","content":content}],"max_tokens":8,"stream":stream})
}

/// Posts a chat completion with these images to the gateway.
async fn post_images(fleet: &Fleet, images: &[&str], stream: bool) -> reqwest::Response {
    fleet
        .post("/v1/chat/completions", &mm_chat(images, stream))
        .await
}

/// Engines (`encoders` with their configs) and a gateway: `prefill`/`decode` as in
/// [`common::start`], the encoders in `[[encode]]`. Passive ejection is off, so an encoder a
/// test breaks stays in rotation for its requests (active checks take longer than a test to
/// eject one; an ejected encoder is the fleet-without-encoders case).
async fn fleet_with_encoders(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    encoders: Vec<SimConfig>,
    tweak: impl FnOnce(&mut Config),
) -> (Fleet, Vec<SimHandle>) {
    let mut handles = Vec::new();
    for c in encoders {
        handles.push(pdsim::spawn(c).await.expect("encoder"));
    }
    let endpoints: Vec<_> = handles.iter().map(|e| endpoint_for(e, None)).collect();
    let fleet = start(prefill, decode, |c| {
        c.encode = endpoints;
        c.health.consecutive_failures = 0;
        tweak(c);
    })
    .await;
    (fleet, handles)
}

fn encoder() -> SimConfig {
    sim(Role::Encode, Connector::None)
}

async fn shfs_with_encoders(
    encoders: usize,
    tweak: impl FnOnce(&mut Config),
) -> (Fleet, Vec<SimHandle>) {
    fleet_with_encoders(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        (0..encoders).map(|_| encoder()).collect(),
        tweak,
    )
    .await
}

async fn baseline_text(body: &Value) -> String {
    text_of(&one_engine_answer("/v1/chat/completions", body).await)
}

/// The `ec_transfer_params` of the last body `engine` received, if any.
fn last_ec_params(engine: &SimHandle) -> Option<Value> {
    let body = engine.stats().recent_requests.last()?.body.clone();
    let v: Value = serde_json::from_str(&body).ok()?;
    v.get("ec_transfer_params").cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_request_goes_encoder_prefill_decode() {
    let (fleet, encoders) = shfs_with_encoders(2, |_| {}).await;
    let (p, d) = (&fleet.prefill[0], &fleet.decode[0]);
    for stream in [false, true] {
        let body = mm_chat(&["http://img/a.png", "http://img/b.png"], stream);
        let r = fleet.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("x-pdgate-fallback").is_none());
        let client_id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        let text = text_of(&r.text().await.unwrap());
        assert_eq!(
            text,
            baseline_text(&mm_chat(&["http://img/a.png", "http://img/b.png"], false)).await
        );
        // Each item went to an encoder alone, text-free, under a child of the request's id.
        let sent: Vec<_> = encoders
            .iter()
            .flat_map(|e| e.stats().recent_requests)
            .filter(|r| {
                r.request_id
                    .as_deref()
                    .unwrap_or_default()
                    .starts_with(&format!("{client_id}:"))
            })
            .collect();
        assert_eq!(sent.len(), 2, "{sent:?}");
        for r in &sent {
            let v: Value = serde_json::from_str(&r.body).unwrap();
            let content = v["messages"][0]["content"].as_array().unwrap();
            assert_eq!(content.len(), 1);
            assert_eq!(content[0]["type"], "image_url");
            assert_eq!(
                (v["max_tokens"].as_u64(), v["stream"].as_bool()),
                (Some(1), Some(false))
            );
            assert!(!r.body.contains("describe"), "{}", r.body);
        }
        // The prefill leg carried both items' parameters; the decode leg none.
        let params = last_ec_params(p).expect("prefill got ec_transfer_params");
        assert_eq!(params.as_object().unwrap().len(), 2, "{params}");
        assert!(
            params
                .as_object()
                .unwrap()
                .values()
                .all(|e| e["do_remote_encode"] == true)
        );
        assert_eq!(last_ec_params(d), None);
    }
    // The prefill pulled every item (2 per request) from the encoders, encoded none itself, and
    // the decode loaded the prefill's KV.
    let ps = p.stats();
    assert_eq!(
        (ps.ec.pulled, ps.ec.encoded_locally, ps.ec.failed),
        (4, 0, 0),
        "{ps:?}"
    );
    let encoded: u64 = encoders.iter().map(|e| e.stats().ec.encoded).sum();
    let served: u64 = encoders.iter().map(|e| e.stats().ec.served).sum();
    assert_eq!((encoded, served), (4, 4));
    // Least-request spread the two items of a request over both encoders.
    assert!(
        encoders.iter().all(|e| e.stats().ec.encoded == 2),
        "{:?}",
        encoders.iter().map(|e| e.stats().ec).collect::<Vec<_>>()
    );
    let ds = d.stats();
    assert_eq!((ds.transfers_pulled, ds.recomputed), (2, 0), "{ds:?}");
    assert!(
        fleet
            .metrics()
            .await
            .contains("pdgate_encodes_total{outcome=\"encoded\"} 2")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_only_requests_skip_the_encoder() {
    let (fleet, encoders) = shfs_with_encoders(1, |_| {}).await;
    for (path, body) in [
        ("/v1/chat/completions", chat(false)),
        ("/v1/chat/completions", chat(true)),
        ("/v1/completions", completion(false)),
    ] {
        let r = fleet.post(path, &body).await;
        assert_eq!(r.status(), 200, "{path}");
        r.text().await.unwrap();
    }
    let es = encoders[0].stats();
    assert_eq!(
        (es.requests.chat_completions, es.ec.encoded),
        (0, 0),
        "{es:?}"
    );
    assert_eq!(last_ec_params(&fleet.prefill[0]), None);
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_without_encoders_serves_images_as_before() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    let r = post_images(&fleet, &["http://img/a.png"], false).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    let ps = fleet.prefill[0].stats();
    assert_eq!((ps.ec.pulled, ps.ec.encoded_locally), (0, 1), "{ps:?}");
    assert_eq!(last_ec_params(&fleet.prefill[0]), None);
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connector_without_ec_transfer_params_skips_the_encoder() {
    // TensorRT-LLM's servers have no `ec_transfer_params`: its prefill encodes the items.
    let (fleet, encoders) = fleet_with_encoders(
        vec![sim(Role::Prefill, Connector::Trtllm)],
        vec![sim(Role::Decode, Connector::Trtllm)],
        vec![encoder()],
        |_| {},
    )
    .await;
    let r = post_images(&fleet, &["http://img/a.png"], false).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    assert_eq!(encoders[0].stats().requests.chat_completions, 0);
    assert_eq!(fleet.prefill[0].stats().ec.encoded_locally, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_connector_runs_its_encoders_before_both_legs() {
    let (fleet, encoders) = fleet_with_encoders(
        vec![sim(Role::Prefill, Connector::Mooncake)],
        vec![sim(Role::Decode, Connector::Mooncake)],
        vec![encoder()],
        |_| {},
    )
    .await;
    for stream in [false, true] {
        let r = post_images(&fleet, &["http://img/m.png"], stream).await;
        assert_eq!(r.status(), 200);
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    assert_eq!(fleet.prefill[0].stats().ec.pulled, 2);
    assert_eq!(encoders[0].stats().ec.served, 2);
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_down_fails_the_request_with_a_clear_error() {
    let (fleet, mut encoders) = shfs_with_encoders(1, |_| {}).await;
    encoders.pop().unwrap().shutdown().await;
    let r = post_images(&fleet, &["http://img/a.png"], false).await;
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("encode engine"), "{v}");
    assert_eq!(v["error"]["code"], 502, "{v}");
    // Nothing reached the prefill or the decode.
    assert_eq!(fleet.prefill[0].stats().requests.chat_completions, 0);
    assert_eq!(fleet.decode[0].stats().requests.chat_completions, 0);
    let metrics = fleet.metrics().await;
    assert!(metrics.contains("pdgate_encodes_total{outcome=\"failed\"} 1"));
    assert!(metrics.contains("outcome=\"encode_error\""), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_encoder_times_out_with_504() {
    let (fleet, encoders) = shfs_with_encoders(1, |c| {
        c.legs.encode_timeout = Duration::from_millis(300);
    })
    .await;
    encoders[0].set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = post_images(&fleet, &["http://img/a.png"], true).await;
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not answer"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fallback_the_prefill_encodes_when_no_encoder_can() {
    let (fleet, encoders) = shfs_with_encoders(1, |c| {
        c.legs.on_encode_failure = PrefillFailurePolicy::Fallback;
    })
    .await;
    encoders[0].set_faults(Faults {
        error_rate: 1.0,
        ..Faults::default()
    });
    let r = post_images(&fleet, &["http://img/a.png"], false).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    let ps = fleet.prefill[0].stats();
    assert_eq!((ps.ec.pulled, ps.ec.encoded_locally), (0, 1), "{ps:?}");
    assert_eq!(last_ec_params(&fleet.prefill[0]), None);
    assert!(
        fleet
            .metrics()
            .await
            .contains("pdgate_encodes_total{outcome=\"fallback\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_encoder_is_retried_on_another() {
    let (fleet, encoders) = shfs_with_encoders(2, |_| {}).await;
    encoders[0].set_faults(Faults {
        error_rate: 1.0,
        ..Faults::default()
    });
    for _ in 0..3 {
        let r = post_images(&fleet, &["http://img/r.png"], false).await;
        assert_eq!(r.status(), 200);
        r.text().await.unwrap();
    }
    assert_eq!(encoders[1].stats().ec.served, 3);
    assert_eq!(fleet.prefill[0].stats().ec.pulled, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_refusing_the_item_is_relayed_as_the_client_error() {
    let (fleet, _encoders) = shfs_with_encoders(1, |_| {}).await;
    let body = json!({"model":MODEL,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]});
    let r = fleet.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("names no media"),
        "{v}"
    );
    assert_eq!(fleet.prefill[0].stats().requests.chat_completions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_items_are_refused_before_any_leg() {
    let (fleet, encoders) = shfs_with_encoders(1, |c| c.legs.encode_max_items = 2).await;
    let r = post_images(&fleet, &["u1", "u2", "u3"], false).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "messages", "{v}");
    assert_eq!(encoders[0].stats().requests.chat_completions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_handoff_fails_the_prefill() {
    // The encoder advertises a side channel nothing listens on: the prefill cannot load the
    // item and fails as vLLM fails a load (500). With `on_prefill_failure = "fail"` the client
    // gets that failure; by default the decode serves the request alone, marked as a fallback.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let wrong = Faults {
        advertise_side_channel_port: Some(port),
        ..Faults::default()
    };
    let (fleet, encoders) = shfs_with_encoders(1, |c| {
        c.legs.on_prefill_failure = PrefillFailurePolicy::Fail;
    })
    .await;
    encoders[0].set_faults(wrong.clone());
    let r = post_images(&fleet, &["http://img/w.png"], false).await;
    assert_eq!(r.status(), 500);
    let ps = fleet.prefill[0].stats();
    assert_eq!((ps.ec.pulled, ps.ec.failed), (0, 1), "{ps:?}");
    assert!(ps.ec.last_error.unwrap().contains("cannot reach"));
    assert_eq!(fleet.decode[0].stats().requests.chat_completions, 0);

    let (fleet, encoders) = shfs_with_encoders(1, |_| {}).await;
    encoders[0].set_faults(wrong);
    let r = post_images(&fleet, &["http://img/w.png"], false).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-pdgate-fallback"], "prefill-failed");
    r.text().await.unwrap();
    assert_eq!(fleet.prefill[0].stats().ec.failed, 1);
    assert_eq!(fleet.decode[0].stats().recomputed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_prefill_leg_gets_its_items_encoded_again() {
    // The first prefill fails; the item's encoder output is handed over once, so the retry on
    // the second prefill needs (and gets) a fresh encode.
    let (fleet, encoders) = fleet_with_encoders(
        vec![
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Shfs),
        ],
        vec![sim(Role::Decode, Connector::Shfs)],
        vec![encoder()],
        |c| {
            c.legs.on_prefill_failure = PrefillFailurePolicy::Fail;
        },
    )
    .await;
    fleet.prefill[0].set_faults(Faults {
        error_rate: 1.0,
        ..Faults::default()
    });
    let mut served = 0;
    for _ in 0..4 {
        let r = post_images(&fleet, &["http://img/t.png"], false).await;
        assert_eq!(r.status(), 200);
        r.text().await.unwrap();
        served += 1;
    }
    let es = encoders[0].stats();
    let pulled = fleet.prefill[1].stats().ec.pulled;
    assert_eq!(pulled, served);
    // Every prefill leg had its own encode: more encodes than pulls when a leg was retried.
    assert!(es.ec.encoded > pulled, "{es:?}");
    assert_eq!(es.ec.refused, 0, "never a reused handoff: {es:?}");
}
