//! Encoder disaggregation through real HTTP on loopback: an encoder (`Role::Encode`) answers a
//! multimodal chat request with `ec_transfer_params`, a prefill given them loads each item from
//! the encoder, and a wrong handoff (an item the encoder does not hold, one already transferred,
//! one whose lease expired, an encoder that cannot be reached) fails the prefill as a failed load
//! fails it.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pdsim::{Connector, Faults, Role, SimHandle};
use serde_json::{Map, Value, json};

fn image(url: &str) -> Value {
    json!({"type":"image_url","image_url":{"url":url}})
}

/// A chat request with `parts` (and a question) in its user message.
fn chat_body(parts: &[Value]) -> Value {
    let mut content: Vec<Value> = parts.to_vec();
    content.push(json!({"type":"text","text":"What is in these?"}));
    json!({"model":"pdsim","messages":[{"role":"user","content":content}]})
}

/// What a gateway sends an encoder for one item (contracts §14).
fn encoder_body(part: &Value) -> Value {
    json!({"model":"pdsim","messages":[{"role":"user","content":[part]}],"max_tokens":1,"stream":false})
}

async fn encode(e: &SimHandle, part: &Value) -> Map<String, Value> {
    let (s, _, v) = post(chat(e), &encoder_body(part)).await;
    assert_eq!(s, 200, "{v}");
    v["ec_transfer_params"].as_object().unwrap().clone()
}

/// The prefill leg of `body` with `params` as its `ec_transfer_params`.
fn prefill_body(body: &Value, params: &Map<String, Value>) -> Value {
    let mut b = body.clone();
    b["max_tokens"] = json!(1);
    b["ec_transfer_params"] = Value::Object(params.clone());
    b
}

#[tokio::test]
async fn an_encoder_answers_with_the_mooncake_ec_params_of_its_item() {
    let e = engine(Role::Encode, Connector::None).await;
    let params = encode(&e, &image("http://img/cat.png")).await;
    assert_eq!(params.len(), 1);
    let (hash, entry) = params.iter().next().unwrap();
    assert_eq!(hash.len(), 64);
    assert_eq!(entry["do_remote_encode"], true);
    assert_eq!(entry["remote_host"], "localhost");
    assert_eq!(entry["remote_port"], e.side_channel_port().unwrap());
    assert!(entry["num_encoder_tokens"].as_u64().unwrap() >= 64);
    // The same media hashes the same; other media another way.
    let again = encode(&e, &image("http://img/cat.png")).await;
    assert!(again.contains_key(hash));
    let other = encode(&e, &image("http://img/dog.png")).await;
    assert!(!other.contains_key(hash));
    let st = e.stats();
    assert_eq!((st.role.as_str(), st.ec.encoded), ("encode", 3), "{st:?}");
}

#[tokio::test]
async fn an_encoder_refuses_what_it_cannot_encode() {
    let e = engine(Role::Encode, Connector::None).await;
    let (s, _, v) = post(
        chat(&e),
        &json!({"model":"pdsim","messages":[{"role":"user","content":"only text"}]}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        error_of(&v, 400)["message"]
            .as_str()
            .unwrap()
            .contains("multimodal")
    );
    let (s, _, _) = post(completions(&e), &json!({"model":"pdsim","prompt":"x"})).await;
    assert_eq!(s, 400);
    let (s, _, _) = post(
        chat(&e),
        &encoder_body(&json!({"type":"image_url","image_url":{}})),
    )
    .await;
    assert_eq!(s, 400, "a part without media");
    let (s, _, _) = post(
        chat(&e),
        &json!({"model":"other","messages":[{"role":"user","content":[image("u")]}]}),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(e.stats().ec.encoded, 0);
}

#[tokio::test]
async fn a_prefill_loads_every_item_its_params_name() {
    let e = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let parts = [
        image("http://img/1.png"),
        image("http://img/2.png"),
        json!({"type":"input_audio","input_audio":{"data":"UklG","format":"wav"}}),
    ];
    let mut params = Map::new();
    for part in &parts {
        params.extend(encode(&e, part).await);
    }
    assert_eq!(params.len(), 3);
    let body = chat_body(&parts);
    let (s, _, v) = post(chat(&p), &prefill_body(&body, &params)).await;
    assert_eq!(s, 200, "{v}");
    let (ps, es) = (p.stats(), e.stats());
    assert_eq!(
        (ps.ec.pulled, ps.ec.failed, ps.ec.encoded_locally),
        (3, 0, 0),
        "{ps:?}"
    );
    assert_eq!((es.ec.served, es.ec.refused), (3, 0), "{es:?}");
    // A decode (not an EC consumer) ignores them, as a vLLM decode without an EC connector.
    let d = engine(Role::Decode, Connector::Shfs).await;
    let (s, _, _) = post(chat(&d), &prefill_body(&body, &params)).await;
    assert_eq!(s, 200);
    assert_eq!(d.stats().ec.pulled, 0);
}

#[tokio::test]
async fn items_without_params_are_encoded_by_the_prefill() {
    let e = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let (one, two) = (image("http://img/1.png"), image("http://img/2.png"));
    let params = encode(&e, &one).await;
    // Only the first item was encoded remotely; no params at all for the plain request.
    let (s, _, v) = post(
        chat(&p),
        &prefill_body(&chat_body(&[one.clone(), two]), &params),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, _, _) = post(chat(&p), &chat_body(&[one])).await;
    assert_eq!(s, 200);
    let st = p.stats();
    assert_eq!((st.ec.pulled, st.ec.encoded_locally), (1, 2), "{st:?}");
}

#[tokio::test]
async fn a_reused_handoff_fails_the_second_prefill() {
    let e = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let part = image("http://img/once.png");
    let params = encode(&e, &part).await;
    let body = prefill_body(&chat_body(std::slice::from_ref(&part)), &params);
    let (s, _, _) = post(chat(&p), &body).await;
    assert_eq!(s, 200);
    let (s, _, v) = post(chat(&p), &body).await;
    assert_eq!(s, 500, "{v}");
    assert_eq!(error_of(&v, 500)["message"], "Internal server error");
    let st = p.stats();
    assert_eq!((st.ec.pulled, st.ec.failed), (1, 1), "{st:?}");
    assert!(st.ec.last_error.unwrap().contains("already transferred"));
    assert_eq!(e.stats().ec.refused, 1);
}

#[tokio::test]
async fn params_naming_an_item_the_encoder_never_encoded_fail() {
    let e = engine(Role::Encode, Connector::None).await;
    let other = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let part = image("http://img/x.png");
    let mut params = encode(&e, &part).await;
    // The right hash, the wrong encoder: it holds nothing under that hash.
    for entry in params.values_mut() {
        entry["remote_port"] = json!(other.side_channel_port().unwrap());
    }
    let (s, _, v) = post(chat(&p), &prefill_body(&chat_body(&[part]), &params)).await;
    assert_eq!(s, 500, "{v}");
    assert!(
        p.stats()
            .ec
            .last_error
            .unwrap()
            .contains("no encoder output")
    );
}

#[tokio::test]
async fn an_expired_item_fails_the_prefill() {
    let e = engine_with(Role::Encode, Connector::None, |c| {
        c.kv_lease = Duration::from_millis(50);
    })
    .await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let part = image("http://img/late.png");
    let params = encode(&e, &part).await;
    tokio::time::sleep(Duration::from_millis(120)).await;
    let (s, _, _) = post(chat(&p), &prefill_body(&chat_body(&[part]), &params)).await;
    assert_eq!(s, 500);
    assert!(p.stats().ec.last_error.unwrap().contains("expired"));
}

#[tokio::test]
async fn an_unreachable_encoder_fails_the_prefill() {
    let e = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let part = image("http://img/gone.png");
    let params = encode(&e, &part).await;
    e.shutdown().await;
    let (s, _, _) = post(chat(&p), &prefill_body(&chat_body(&[part]), &params)).await;
    assert_eq!(s, 500);
    assert!(p.stats().ec.last_error.unwrap().contains("cannot reach"));
}

#[tokio::test]
async fn a_refusing_encoder_and_a_wrong_advertised_port_fail_the_prefill() {
    let e = engine(Role::Encode, Connector::None).await;
    let p = engine(Role::Prefill, Connector::Shfs).await;
    let part = image("http://img/r.png");
    let params = encode(&e, &part).await;
    e.set_faults(Faults {
        refuse_kv: true,
        ..Faults::default()
    });
    let body = prefill_body(&chat_body(std::slice::from_ref(&part)), &params);
    let (s, _, _) = post(chat(&p), &body).await;
    assert_eq!(s, 500);
    assert!(p.stats().ec.last_error.unwrap().contains("refused"));
    // Advertising a port nothing listens on: unreachable.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    e.set_faults(Faults {
        advertise_side_channel_port: Some(port),
        ..Faults::default()
    });
    let params = encode(&e, &part).await;
    assert_eq!(params.values().next().unwrap()["remote_port"], port);
    let (s, _, _) = post(chat(&p), &prefill_body(&chat_body(&[part]), &params)).await;
    assert_eq!(s, 500);
}

#[tokio::test]
async fn a_combined_engine_consumes_too_and_a_used_entry_is_not_pulled() {
    let e = engine(Role::Encode, Connector::None).await;
    let both = engine(Role::Both, Connector::None).await;
    let part = image("http://img/b.png");
    let mut params = encode(&e, &part).await;
    let (s, _, v) = post(
        chat(&both),
        &prefill_body(&chat_body(std::slice::from_ref(&part)), &params),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // `do_remote_encode: false` (vLLM clears it once the transfer is triggered): not pulled.
    for entry in params.values_mut() {
        entry["do_remote_encode"] = json!(false);
    }
    let (s, _, _) = post(chat(&both), &prefill_body(&chat_body(&[part]), &params)).await;
    assert_eq!(s, 200);
    let st = both.stats();
    assert_eq!((st.ec.pulled, st.ec.encoded_locally), (1, 1), "{st:?}");
    // Mistyped params are refused as vLLM's request model refuses them.
    let (s, _, _) = post(
        chat(&both),
        &json!({"model":"pdsim","messages":[{"role":"user","content":"x"}],"ec_transfer_params":"h"}),
    )
    .await;
    assert_eq!(s, 400);
}
