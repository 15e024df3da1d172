//! Reliability behaviours one request at a time: outcomes that tell the truth, the decode-alone
//! fallback of concurrent connectors, half-open probes, and legs released when their endpoint is
//! taken out of rotation. (The load campaign is in `faults.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdsim::{Connector, Faults, Role, SimHandle};
use serde_json::json;

/// `pdgate_requests_total` summed over the samples whose labels contain `outcome="..."`.
fn outcome(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("pdgate_requests_total{"))
        .filter(|l| l.contains(&format!("outcome=\"{name}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `pdgate_retries_total` of one leg.
fn retries(metrics: &str, leg: &str) -> f64 {
    let prefix = format!("pdgate_retries_total{{leg=\"{leg}\"}}");
    metrics
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Active checks every 100 ms, two failures take an endpoint out; room for retries.
fn quick_checks(c: &mut pdgate::config::Config) {
    c.health.health_check_interval = Duration::from_millis(100);
    c.health.health_check_timeout = Duration::from_millis(200);
    c.health.unhealthy_threshold = 2;
    c.limits.retry_budget_min = 20;
}

fn failing() -> Faults {
    Faults {
        error_rate: 1.0,
        ..Faults::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_tell_the_truth() {
    for connector in [Connector::Shfs, Connector::Mooncake, Connector::Sglang] {
        let fleet = pair(connector, |c| c.health.health_checks = false).await;
        // A decode 5xx passed back is a decode error, not a success (nor, for a concurrent
        // connector's sized body, a cancel).
        fleet.decode[0].set_faults(failing());
        for stream in [false, true] {
            let r = fleet
                .post_bounded("/v1/completions", &completion(stream))
                .await;
            assert_eq!(r.status(), 500, "{connector:?}");
            let _ = r.bytes().await;
        }
        fleet.decode[0].set_faults(Faults::default());
        let r = fleet
            .post_bounded("/v1/completions", &completion(false))
            .await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
        fleet.wait_idle().await;
        let m = fleet.metrics().await;
        assert_eq!(outcome(&m, "decode_error"), 2.0, "{connector:?}: {m}");
        assert_eq!(outcome(&m, "success"), 1.0, "{connector:?}: {m}");
        assert_eq!(outcome(&m, "cancelled"), 0.0, "{connector:?}: {m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refusing_an_unknown_model_is_a_client_error() {
    // Nobody configured the models: the gateway asks the engines, which refuse.
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        |c| {
            for e in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
                e.model = None;
            }
        },
    )
    .await;
    let r = fleet
        .post_bounded(
            "/v1/completions",
            &json!({"model": "nope", "prompt": "x", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status(), 404);
    let m = fleet.metrics().await;
    assert_eq!(outcome(&m, "client_error"), 1.0, "{m}");
    assert_eq!(outcome(&m, "prefill_error"), 0.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_mooncake_prefill_falls_back_to_the_decode_alone() {
    let fleet = pair(Connector::Mooncake, |c| c.health.health_checks = false).await;
    fleet.prefill[0].set_faults(failing());
    for stream in [false, true] {
        let r = fleet
            .post_bounded("/v1/completions", &completion(stream))
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-pdgate-fallback"], "prefill-failed");
        let text = text_of(&r.text().await.unwrap());
        assert!(!text.is_empty());
    }
    fleet.wait_idle().await;
    let m = fleet.metrics().await;
    assert_eq!(outcome(&m, "fallback"), 2.0, "{m}");
    // No KV moved: the decode computed the prompt itself.
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sglang_prefill_cannot_fall_back_and_aborts_the_decode() {
    // SGLang decode servers wait for a bootstrap room: no plain request can be served there.
    let fleet = pair(Connector::Sglang, |c| c.health.health_checks = false).await;
    fleet.prefill[0].set_faults(failing());
    let r = fleet
        .post_bounded("/v1/completions", &completion(false))
        .await;
    assert_eq!(r.status(), 500);
    assert!(r.headers().get("x-pdgate-fallback").is_none());
    let _ = r.bytes().await;
    let mut aborted = 0;
    for _ in 0..100 {
        aborted = fleet.decode[0].stats().requests.abort_requests;
        if aborted > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(aborted, 1);
    let m = fleet.metrics().await;
    assert_eq!(outcome(&m, "prefill_error"), 1.0, "{m}");
}

/// An ejected prefill comes back half-open: the first request is its probe, and while that
/// probe is under way every other request goes to its healthy peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_admits_one_probe_before_full_traffic() {
    let fleet = two_prefills_one_decode(Connector::Shfs, |c| {
        c.health.health_checks = false;
        c.health.consecutive_failures = 1;
        c.health.base_ejection = Duration::from_millis(300);
        c.health.max_ejection = Duration::from_millis(300);
        c.policy.prefill_policy = "round_robin".into();
    })
    .await;
    let sick = fleet.prefill[0].addr().to_string();
    fleet.prefill[0].set_faults(failing());
    // Round robin: within two requests one meets the failing prefill and ejects it.
    for _ in 0..2 {
        let r = fleet
            .post_bounded("/v1/completions", &completion(false))
            .await;
        assert_eq!(r.status(), 200);
    }
    let m = fleet.metrics().await;
    assert!(m.contains(&format!(
        "pdgate_endpoint_healthy{{role=\"prefill\",endpoint=\"{sick}\"}} 0"
    )));
    // Ejected by its 500s, so counted under that reason.
    let reason = format!(
        "pdgate_endpoint_ejections_total{{role=\"prefill\",endpoint=\"{sick}\",reason=\"5xx\"}} 1"
    );
    assert!(m.contains(&reason), "{m}");
    // Healed but slow; the ejection ends.
    fleet.prefill[0].set_faults(Faults {
        first_byte_delay_ms: 600,
        ..Faults::default()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = fleet.prefill[0].stats().requests.completions;
    // Sent together: one of them is the probe, the others must not follow it.
    let body = completion(false);
    let burst: Vec<_> = (0..6)
        .map(|_| fleet.post_bounded("/v1/completions", &body))
        .collect();
    let probe_and_rest = futures_util::future::join_all(burst);
    let later = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut to_sick = 0;
        for _ in 0..6 {
            let r = fleet
                .post_bounded("/v1/completions", &completion(false))
                .await;
            assert_eq!(r.status(), 200);
            to_sick += usize::from(r.headers()["prefill-target-pod"] == sick.as_str());
        }
        to_sick
    };
    let (answers, to_sick_meanwhile) = tokio::join!(probe_and_rest, later);
    assert!(answers.iter().all(|r| r.status() == 200));
    assert_eq!(to_sick_meanwhile, 0, "traffic waited for the probe");
    let probes = fleet.prefill[0].stats().requests.completions - before;
    assert!(
        probes <= 2,
        "{probes} requests reached the half-open prefill"
    );
    // The probe succeeded: full traffic again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut to_sick = 0;
    for _ in 0..4 {
        let r = fleet
            .post_bounded("/v1/completions", &completion(false))
            .await;
        to_sick += usize::from(r.headers()["prefill-target-pod"] == sick.as_str());
    }
    assert!(to_sick >= 1, "the healed prefill takes traffic again");
    fleet.wait_idle().await;
}

/// Requests waiting for a prefill's answer are released the moment it is taken out of rotation
/// (here by its health checks) and retried on its peer, instead of waiting out the prefill
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_an_ejected_prefill_are_retried_at_once() {
    let fleet = two_prefills_one_decode(Connector::Shfs, |c| {
        c.legs.prefill_timeout = Duration::from_secs(30);
        quick_checks(c);
        c.policy.prefill_policy = "round_robin".into();
    })
    .await;
    let case = ("/v1/completions", completion(false));
    released_and_retried(&fleet, &fleet.prefill[0], "prefill", "shfs", &case).await;
}

/// A Mooncake prefill restarted on the same ports has a new engine id; the decode refuses the
/// cached one (500). With health checks off nothing else notices: the decode's failure makes
/// the gateway look the prefill's bootstrap facts up again, and the request is retried once on
/// the fresh ones (nothing had reached the client), so no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mooncake_prefill_is_served_on_fresh_bootstrap_facts() {
    let mut fleet = pair(Connector::Mooncake, |c| c.health.health_checks = false).await;
    for stream in [false, true] {
        let r = fleet
            .post_bounded("/v1/completions", &completion(stream))
            .await;
        assert_eq!(r.status(), 200);
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    let prefill = fleet.prefill.remove(0);
    fleet
        .prefill
        .push(restart(prefill, Duration::from_millis(50)).await);
    for i in 0..6 {
        let r = fleet
            .post_bounded("/v1/completions", &completion(i % 2 == 0))
            .await;
        assert_eq!(r.status(), 200, "request {i}");
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    // One request met the stale engine id; it was retried, and nothing else failed.
    let m = fleet.metrics().await;
    assert!(retries(&m, "prefill") >= 1.0, "{m}");
    assert!(fleet.decode[0].stats().transfers_failed >= 1);
    assert_eq!(outcome(&m, "decode_error"), 0.0, "{m}");
    fleet.wait_idle().await;
}

/// Requests waiting for a decode's response head are released the moment it is taken out of
/// rotation (here by its health checks) and run again on another decode, instead of waiting
/// out the decode timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_an_ejected_decode_are_retried_at_once() {
    for connector in [Connector::Shfs, Connector::Sglang] {
        let fleet = two_decodes(connector, |_| {}).await;
        let what = format!("{connector:?}");
        let case = ("/v1/completions", completion(false));
        released_and_retried(&fleet, &fleet.decode[0], "decode", &what, &case).await;
    }
}

/// One prefill (failing its requests, or unused) and two decodes taken in turn, with quick
/// health checks and a 30 s decode timeout.
async fn two_decodes(
    connector: Connector,
    tweak: impl FnOnce(&mut pdgate::config::Config),
) -> Fleet {
    start(
        vec![sim(Role::Prefill, connector)],
        vec![sim(Role::Decode, connector), sim(Role::Decode, connector)],
        |c| {
            c.legs.decode_timeout = Duration::from_secs(30);
            quick_checks(c);
            c.policy.decode_policy = "round_robin".into();
            tweak(c);
        },
    )
    .await
}

/// A request the decode serves alone (here a Responses request bound to stored state, or a
/// Messages request an SGLang pair cannot hand over) whose decode is taken out of rotation
/// before its head moves to the other decode at once, like a PD request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_only_requests_waiting_on_an_ejected_decode_are_retried_at_once() {
    let mut bound = json!({"model": MODEL, "input": "Tell me a story", "max_output_tokens": 4});
    bound["previous_response_id"] = json!("resp_0123");
    let messages = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Tell me a story"}]});
    for (connector, case) in [
        (Connector::Shfs, ("/v1/responses", bound)),
        (Connector::Sglang, ("/v1/messages", messages)),
    ] {
        let fleet = two_decodes(connector, |_| {}).await;
        let what = format!("{connector:?} decode-only {}", case.0);
        released_and_retried(&fleet, &fleet.decode[0], "decode", &what, &case).await;
        assert_eq!(fleet.prefill[0].stats().requests.completions, 0, "{what}");
    }
}

/// A failed prefill falls back to the decode alone; when that decode is taken out of rotation
/// before its head, the fallback moves to the other decode at once (sequential and concurrent
/// connectors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallbacks_waiting_on_an_ejected_decode_are_retried_at_once() {
    for connector in [Connector::Mooncake, Connector::Shfs] {
        let fleet = two_decodes(connector, |c| {
            c.legs.on_prefill_failure = pdgate::config::PrefillFailurePolicy::Fallback;
            // The failing prefill stays in rotation: every request falls back.
            c.health.consecutive_failures = 0;
            c.health.error_rate = 0.0;
        })
        .await;
        fleet.prefill[0].set_faults(failing());
        let what = format!("{connector:?} fallback");
        let case = ("/v1/completions", completion(false));
        released_and_retried(&fleet, &fleet.decode[0], "decode", &what, &case).await;
        // Each request asked the prefill once and fell back once (a move keeps the fallback).
        let m = fleet.metrics().await;
        assert_eq!(outcome(&m, "fallback"), 6.0, "{what}: {m}");
        let fallbacks = format!(
            "pdgate_fallbacks_total{{connector=\"{}\"}} 6",
            connector.as_str()
        );
        assert!(m.contains(&fallbacks), "{what}: {m}");
        assert_eq!(fleet.prefill[0].stats().requests.completions, 6, "{what}");
    }
}

/// Freezes `victim` (hung, and failing its health checks), sends six `body`s to `path` at once and checks
/// that every one is answered far below the 30 s leg timeout: released when the health checks
/// take the victim out of rotation (~200 ms) and retried elsewhere, counted under `leg`'s
/// retries. Restores the victim and waits for the fleet to go idle.
async fn released_and_retried(
    fleet: &Fleet,
    victim: &SimHandle,
    leg: &str,
    what: &str,
    (path, body): &(&str, serde_json::Value),
) {
    victim.set_faults(Faults {
        hang: true,
        dead: true,
        ..Faults::default()
    });
    let started = Instant::now();
    let answers =
        futures_util::future::join_all((0..6).map(|_| fleet.post_bounded(path, body))).await;
    assert!(
        answers.iter().all(|r| r.status() == 200),
        "{what}: {:?}",
        answers.iter().map(|r| r.status()).collect::<Vec<_>>()
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{what}: {:?}",
        started.elapsed()
    );
    let m = fleet.metrics().await;
    assert!(retries(&m, leg) >= 1.0, "{what}: {m}");
    // Its health checks took it out.
    let ejected = format!(
        "pdgate_endpoint_ejections_total{{role=\"{leg}\",endpoint=\"{}\",reason=\"health_check\"}}",
        victim.addr()
    );
    assert!(m.contains(&ejected), "{what}: {m}");
    victim.set_faults(Faults::default());
    fleet.wait_idle().await;
}
