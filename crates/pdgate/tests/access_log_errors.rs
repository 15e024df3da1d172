//! The access log for requests that did not go as planned: an error pdgate answers itself (502
//! for an engine that failed or could not be reached, 504 for one that did not answer in time)
//! names the engines the request touched, the failing one included; a request released because
//! its prefill was taken out of rotation is not logged as a failed prefill.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use pdgate::config::{Config, PrefillFailurePolicy};
use pdsim::{Connector, Faults, Role};
use serde_json::{Value, json};

impl Captured {
    /// Every JSON line logged about request `id`: its access line (`request_id`) and the
    /// gateway's own lines about it (`id`).
    fn lines_of(&self, id: &str) -> Vec<Value> {
        self.json_lines()
            .into_iter()
            .filter(|v| v["fields"]["request_id"] == id || v["fields"]["id"] == id)
            .collect()
    }

    /// The access line of request `id`, waited for (bounded: the writer task writes it).
    async fn access_line(&self, id: &str) -> Value {
        for _ in 0..200 {
            let found: Vec<Value> = self
                .lines_of(id)
                .into_iter()
                .filter(|v| v["target"] == "pdgate::access")
                .collect();
            if let [line] = found.as_slice() {
                return line["fields"].clone();
            }
            assert!(found.len() < 2, "one access line for {id}: {found:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no access line for {id}");
    }

    /// The messages of the gateway's own lines about request `id`.
    fn messages_of(&self, id: &str) -> Vec<String> {
        self.lines_of(id)
            .iter()
            .filter(|v| v["target"] != "pdgate::access")
            .filter_map(|v| v["fields"]["message"].as_str().map(str::to_owned))
            .collect()
    }
}

/// The log of this test binary: one global subscriber (JSON, info and above) for all its tests,
/// each of which reads the lines of its own request ids.
fn log() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        tracing_subscriber::fmt()
            .json()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .init();
        captured
    })
}

/// An address where nothing listens (a port bound, then let go).
fn nothing_listens() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Health checks and outlier ejection off (an engine that fails stays in rotation), no second
/// chance for a failed prefill.
fn no_second_chances(c: &mut Config) {
    c.health.health_checks = false;
    c.health.consecutive_failures = 0;
    c.health.error_rate = 0.0;
    c.legs.on_prefill_failure = PrefillFailurePolicy::Fail;
}

/// Posts `body` to `path` as request `id` and reads the whole answer; its status.
async fn post(fleet: &Fleet, path: &str, body: &Value, id: &str) -> u16 {
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        fleet
            .http
            .post(fleet.url(path))
            .header("x-request-id", id)
            .json(body)
            .send(),
    )
    .await
    .expect("the gateway answered within its timeouts")
    .expect("request");
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    status
}

/// Asserts `line` is the access line of a request pdgate answered `status` itself, naming
/// `prefill` and `decode`.
fn assert_names(line: &Value, status: u16, outcome: &str, prefill: &str, decode: &str) {
    assert_eq!(line["status"], status, "{line}");
    assert_eq!(line["outcome"], outcome, "{line}");
    assert_eq!(line["prefill"], prefill, "{line}");
    assert_eq!(line["decode"], decode, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_prefill_is_named_with_its_decode() {
    let log = log();
    let gone = nothing_listens();
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            no_second_chances(c);
            c.prefill[0].url = format!("http://{gone}");
        },
    )
    .await;
    let r = post(&fleet, "/v1/chat/completions", &chat(false), "acc-p502").await;
    assert_eq!(r, 502);
    let line = log.access_line("acc-p502").await;
    let decode = fleet.decode[0].addr().to_string();
    assert_names(&line, 502, "prefill_error", &gone, &decode);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_decode_is_named_with_its_prefill() {
    let log = log();
    let gone = nothing_listens();
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            no_second_chances(c);
            c.decode[0].url = format!("http://{gone}");
        },
    )
    .await;
    let prefill = fleet.prefill[0].addr().to_string();
    let r = post(&fleet, "/v1/chat/completions", &chat(false), "acc-d502").await;
    assert_eq!(r, 502);
    let line = log.access_line("acc-d502").await;
    assert_names(&line, 502, "decode_error", &prefill, &gone);
    // A pass-through request has a decode leg only: the failing decode is named.
    let embeddings = json!({"model": MODEL, "input": "x"});
    let r = post(&fleet, "/v1/embeddings", &embeddings, "acc-pt502").await;
    assert_eq!(r, 502);
    let line = log.access_line("acc-pt502").await;
    assert_eq!(line["route"], "passthrough", "{line}");
    assert_eq!(line["status"], 502, "{line}");
    assert_eq!(line["decode"], gone, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leg_that_times_out_is_named_with_its_partner() {
    let log = log();
    let fleet = pair(Connector::Shfs, |c| {
        no_second_chances(c);
        c.legs.prefill_timeout = Duration::from_millis(300);
        c.legs.decode_timeout = Duration::from_millis(300);
    })
    .await;
    let prefill = fleet.prefill[0].addr().to_string();
    let decode = fleet.decode[0].addr().to_string();
    // The prefill never answers: 504, the prefill named with the decode it was paired with.
    fleet.prefill[0].set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = post(&fleet, "/v1/completions", &completion(false), "acc-p504").await;
    assert_eq!(r, 504);
    let line = log.access_line("acc-p504").await;
    assert_names(&line, 504, "timeout", &prefill, &decode);
    // The decode's head comes too late: 504, the decode named with the prefill that ran.
    fleet.prefill[0].set_faults(Faults::default());
    fleet.decode[0].set_faults(Faults {
        first_byte_delay_ms: 5_000,
        ..Faults::default()
    });
    let r = post(&fleet, "/v1/completions", &completion(false), "acc-d504").await;
    assert_eq!(r, 504);
    let line = log.access_line("acc-d504").await;
    assert_names(&line, 504, "timeout", &prefill, &decode);
}

/// Active checks every 100 ms, two failures take an endpoint out; a prefill waits up to 30 s.
fn quick_checks(c: &mut Config) {
    c.health.health_check_interval = Duration::from_millis(100);
    c.health.health_check_timeout = Duration::from_millis(200);
    c.health.unhealthy_threshold = 2;
    c.limits.retry_budget_min = 20;
    c.legs.prefill_timeout = Duration::from_secs(30);
}

/// Asserts that no line about request `id` calls its prefill failed, and that one says it was
/// taken out of rotation when `released`.
fn assert_not_failed(log: &Captured, id: &str, released: bool) {
    let messages = log.messages_of(id);
    assert!(
        !messages.iter().any(|m| m.contains("prefill failed")),
        "{id}: {messages:?}"
    );
    if released {
        assert!(
            messages.iter().any(|m| m.contains("taken out of rotation")),
            "{id}: {messages:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_released_by_an_ejected_prefill_are_not_logged_as_failed() {
    let log = log();
    // Two prefills taken in turn: requests waiting on the frozen one are released when its
    // health checks take it out, and served by the other.
    let fleet = start(
        vec![
            sim(Role::Prefill, Connector::Shfs),
            sim(Role::Prefill, Connector::Shfs),
        ],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            quick_checks(c);
            c.policy.prefill_policy = "round_robin".into();
        },
    )
    .await;
    fleet.prefill[0].set_faults(Faults {
        hang: true,
        dead: true,
        ..Faults::default()
    });
    let frozen = fleet.prefill[0].addr().to_string();
    let healthy = fleet.prefill[1].addr().to_string();
    let ids: Vec<String> = (0..4).map(|i| format!("acc-released-{i}")).collect();
    let started = Instant::now();
    let answers = futures_util::future::join_all(ids.iter().map(|id| {
        fleet
            .http
            .post(fleet.url("/v1/completions"))
            .header("x-request-id", id.as_str())
            .json(&completion(false))
            .send()
    }))
    .await;
    for r in answers {
        let r = r.unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "released, not timed out"
    );
    let mut released = 0;
    for id in &ids {
        let line = log.access_line(id).await;
        assert_eq!(line["outcome"], "success", "{line}");
        assert_eq!(line["prefill"], healthy, "{line}");
        let moved = log
            .messages_of(id)
            .iter()
            .any(|m| m.contains("taken out of rotation"));
        released += usize::from(moved);
        assert_not_failed(log, id, moved);
    }
    assert!(
        released >= 1,
        "a request waited on {frozen} and was released"
    );

    // The only prefill frozen: a released request falls back to the decode alone, which is not
    // a failed prefill either.
    let fleet = pair(Connector::Shfs, quick_checks).await;
    fleet.prefill[0].set_faults(Faults {
        hang: true,
        dead: true,
        ..Faults::default()
    });
    let r = fleet
        .http
        .post(fleet.url("/v1/completions"))
        .header("x-request-id", "acc-released-alone")
        .json(&completion(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-pdgate-fallback"], "prefill-failed");
    let _ = r.bytes().await;
    let line = log.access_line("acc-released-alone").await;
    assert_eq!(line["outcome"], "fallback", "{line}");
    assert_eq!(line["fallback"], true, "{line}");
    assert_not_failed(log, "acc-released-alone", true);
}
