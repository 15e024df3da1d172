//! Admission by predicted prefill work (`cache.max_queued_prefill_tokens`): a request whose
//! prefill already has more than the bound of predicted tokens to compute ahead of it is
//! refused with 429 and `Retry-After`; an idle prefill takes any prompt.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{MODEL, metric, pair};
use pdsim::{Connector, Faults};
use serde_json::{Value, json};

/// A prompt of `words` five-byte words (without a tokenizer pdgate estimates about 1.5 tokens
/// per word from the bytes: 100 words ~ 150 predicted tokens).
fn body(words: usize, tag: &str) -> Value {
    let prompt = format!("{tag} {}", "alpha ".repeat(words));
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_queued_prefill_bound_are_refused_and_others_served() {
    let fleet = pair(Connector::Shfs, |c| {
        c.policy.prefill_policy = "cache_aware".into();
        c.policy.decode_policy = "cache_aware".into();
        c.cache.max_queued_prefill_tokens = 500;
    })
    .await;
    // An idle prefill takes a prompt far longer than the bound.
    let big = fleet
        .post_bounded("/v1/completions", &body(2000, "b"))
        .await;
    assert_eq!(big.status(), 200);
    big.text().await.unwrap();

    // Work in flight counts: hold a 400-word prefill (~600 tokens ahead, over the bound of
    // 500): the next request is refused; once the first is done, the same prompt is served.
    fleet.prefill[0].set_faults(Faults {
        first_byte_delay_ms: 1500,
        ..Faults::default()
    });
    let gw = fleet.gateway.base_url();
    let http = fleet.http.clone();
    let held = tokio::spawn(async move {
        http.post(format!("{gw}/v1/completions"))
            .json(&body(400, "c"))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap()
            .status()
    });
    // Wait (bounded) until the gateway holds the first one's tokens on the prefill.
    let computing = r#"pdgate_endpoint_computing_tokens{role="prefill""#;
    let mut held_tokens = 0.0;
    for _ in 0..100 {
        let m = fleet.metrics().await;
        held_tokens = m
            .lines()
            .filter(|l| l.starts_with(computing))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        if held_tokens > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        held_tokens >= 400.0,
        "held {held_tokens}: {}",
        fleet
            .metrics()
            .await
            .lines()
            .filter(|l| l.contains("in_flight") || l.contains("computing"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let second = fleet.post_bounded("/v1/completions", &body(10, "d")).await;
    assert_eq!(second.status(), 429, "~600 tokens queued ahead > 500");
    assert_eq!(second.headers()["retry-after"], "1");
    let err: Value = second.json().await.unwrap();
    assert!(err["error"]["message"].is_string(), "{err}");
    assert_eq!(
        fleet.prefill[0].stats().requests.completions,
        2,
        "the long one and the held one: the refused one never reached the prefill"
    );
    assert_eq!(held.await.unwrap(), 200);
    fleet.prefill[0].set_faults(Faults::default());
    let again = fleet.post_bounded("/v1/completions", &body(10, "d")).await;
    assert_eq!(again.status(), 200, "the queue drained");
    again.text().await.unwrap();
    let m = fleet.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"pdgate_admission_rejected_total{reason="queued_prefill_tokens"}"#
        ),
        1.0
    );
}
