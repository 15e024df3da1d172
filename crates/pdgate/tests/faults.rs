//! Fault suite: pdsim engines with injected faults (kill, hang, slow, 5xx, flapping, overload)
//! behind pdgate, under bounded concurrent load on loopback.
//!
//! For every scenario: no client waits past the configured timeouts, every request gets either
//! the right answer (its own prompt's tokens, compared with a single engine) or a clear error,
//! nothing is answered twice, in-flight counters (gateway and engines) and admission gauges return
//! to zero, and memory stays bounded. Run with `--nocapture` to see, per scenario, the share of
//! requests that succeeded and the worst latency.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use pdgate::config::Config;
use pdsim::{Connector, Faults, LatencyModel, Role, SimConfig, SimHandle};
use serde_json::{Value, json};

const REQUESTS: usize = 64;
const CONCURRENCY: usize = 8;

/// Short timeouts so faults resolve quickly; every knob the suite relies on is set here.
fn tight(c: &mut Config) {
    c.legs.prefill_timeout = Duration::from_millis(800);
    c.legs.decode_timeout = Duration::from_secs(3);
    c.legs.stream_idle_timeout = Duration::from_secs(2);
    c.pool.connect_timeout = Duration::from_millis(500);
    c.health.health_check_interval = Duration::from_millis(100);
    c.health.health_check_timeout = Duration::from_millis(300);
    c.health.unhealthy_threshold = 2;
    c.health.healthy_threshold = 1;
    c.health.consecutive_failures = 3;
    c.health.base_ejection = Duration::from_millis(500);
    c.health.max_ejection = Duration::from_secs(2);
    c.legs.max_retries = 1;
    c.limits.retry_budget_min = 20;
    c.shutdown.drain_delay = Duration::ZERO;
}

/// The longest any request may take under `tight`: every prefill attempt timing out, the decode
/// head at its bound, and a stream going idle, plus slack for a loaded 2-core machine.
fn bound(c: &Config) -> Duration {
    c.legs.prefill_timeout * (c.legs.max_retries + 1)
        + c.pool.connect_timeout * (c.legs.max_retries + 1)
        + c.legs.decode_timeout
        + c.legs.stream_idle_timeout
        + c.limits.queue_timeout.min(Duration::from_secs(5))
        + Duration::from_secs(3)
}

fn engine(role: Role, connector: Connector) -> SimConfig {
    let mut c = sim(role, connector);
    c.latency = LatencyModel {
        ttft: Duration::from_millis(10),
        itl: Duration::from_millis(3),
        ..LatencyModel::default()
    };
    c.handoff_timeout = Duration::from_secs(2);
    c
}

async fn fleet(connector: Connector, extra: impl FnOnce(&mut Config)) -> Fleet {
    start(
        vec![
            engine(Role::Prefill, connector),
            engine(Role::Prefill, connector),
        ],
        vec![
            engine(Role::Decode, connector),
            engine(Role::Decode, connector),
        ],
        |c| {
            tight(c);
            extra(c);
        },
    )
    .await
}

/// Request `i`: its own prompt, alternating route and streaming.
fn request(i: usize) -> (&'static str, Value) {
    let stream = i.is_multiple_of(2);
    if i % 4 < 2 {
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": format!("request {i}: the quick brown fox"), "max_tokens": 8, "stream": stream}),
        )
    } else {
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": format!("request {i}: tell a story")}], "max_tokens": 8, "stream": stream}),
        )
    }
}

/// What one engine alone answers to every request (the oracle for "correct and not mixed").
async fn expected() -> Arc<Vec<String>> {
    let engine = pdsim::spawn(sim(Role::Both, Connector::None))
        .await
        .expect("baseline engine");
    let http = reqwest::Client::new();
    let mut out = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        let (path, body) = request(i);
        let r = http
            .post(format!("{}{}", engine.base_url(), path))
            .json(&body)
            .send()
            .await
            .expect("baseline");
        assert_eq!(r.status(), 200);
        out.push(text_of(&r.text().await.expect("baseline body")));
    }
    engine.shutdown().await;
    Arc::new(out)
}

#[derive(Debug)]
enum Outcome {
    Ok,
    /// A clear error: an OpenAI error body or SSE error event, or a 429/503 with Retry-After.
    Error(u16, String),
}

/// Judges one finished response; panics on anything that is neither right nor a clear error.
fn judge(i: usize, status: u16, id: Option<&str>, body: &str, want: &str) -> Outcome {
    assert_eq!(
        id,
        Some(format!("fault-{i}").as_str()),
        "request {i}: x-request-id"
    );
    if status != 200 {
        let v: Value = serde_json::from_str(body)
            .unwrap_or_else(|_| panic!("request {i}: {status} without a JSON error: {body:?}"));
        let message = v["error"]["message"].as_str();
        assert!(
            message.is_some(),
            "request {i}: unclear error {status}: {body}"
        );
        return Outcome::Error(status, message.unwrap_or_default().to_string());
    }
    if body.starts_with("data:") {
        let mut text = String::new();
        let mut dones = 0;
        for event in body.split("\n\n").filter(|e| !e.is_empty()) {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("request {i}: bad SSE framing {event:?}"));
            if data == "[DONE]" {
                dones += 1;
                continue;
            }
            let v: Value = serde_json::from_str(data)
                .unwrap_or_else(|_| panic!("request {i}: bad event {data:?}"));
            if let Some(m) = v["error"]["message"].as_str() {
                assert_eq!(dones, 0, "request {i}: error after [DONE]");
                return Outcome::Error(200, format!("stream: {m}"));
            }
            for c in v["choices"].as_array().into_iter().flatten() {
                text.push_str(c["text"].as_str().unwrap_or_default());
                text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
            }
        }
        assert_eq!(dones, 1, "request {i}: answered {dones} times: {body}");
        assert_eq!(text, want, "request {i}: wrong or mixed tokens");
    } else {
        let v: Value = serde_json::from_str(body)
            .unwrap_or_else(|_| panic!("request {i}: 200 with a broken JSON body {body:?}"));
        let c = &v["choices"][0];
        let text = c["text"]
            .as_str()
            .or_else(|| c["message"]["content"].as_str())
            .unwrap_or_else(|| panic!("request {i}: no text in {body}"));
        assert_eq!(text, want, "request {i}: wrong or mixed tokens");
    }
    Outcome::Ok
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// What one scenario measured.
struct Report {
    share: f64,
    metrics: String,
}

/// Runs the load, checks every invariant, prints the scenario's numbers.
async fn run_load(name: &str, fleet: &Fleet, want: &Arc<Vec<String>>) -> Report {
    let config = fleet.gateway.gateway().config.clone();
    let limit = bound(&config);
    let http = reqwest::Client::builder()
        .timeout(limit)
        .build()
        .expect("client");
    let rss_before = rss_bytes();
    let started = Instant::now();
    let results: Vec<(usize, Duration, Result<Outcome, String>)> =
        futures_util::stream::iter(0..REQUESTS)
            .map(|i| {
                let http = http.clone();
                let url = fleet.url(request(i).0);
                async move {
                    let t = Instant::now();
                    let sent = http
                        .post(url)
                        .header("x-request-id", format!("fault-{i}"))
                        .json(&request(i).1)
                        .send()
                        .await;
                    let outcome = match sent {
                        Err(e) => Err(format!("request {i}: {e}")),
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let retry_after = r.headers().get("retry-after").is_some();
                            let id = r
                                .headers()
                                .get("x-request-id")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_string);
                            if status == 429 {
                                assert!(retry_after, "request {i}: 429 without Retry-After");
                            }
                            match r.text().await {
                                Ok(body) => Ok((status, id, body)),
                                // A JSON body cut by a decode dying after its head: the client
                                // sees a broken body, never a wrong one.
                                Err(e) => Ok((
                                    599,
                                    id,
                                    format!("{{\"error\":{{\"message\":\"broken body: {e}\"}}}}"),
                                )),
                            }
                        }
                    };
                    (i, t.elapsed(), outcome)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .map(|(i, took, r)| {
                let judged =
                    r.map(|(status, id, body)| judge(i, status, id.as_deref(), &body, &want[i]));
                (i, took, judged)
            })
            .collect()
            .await;
    let wall = started.elapsed();
    let mut ok = 0usize;
    let mut worst = Duration::ZERO;
    let mut errors: HashMap<String, usize> = HashMap::new();
    for (i, took, judged) in &results {
        worst = worst.max(*took);
        assert!(
            *took <= limit,
            "{name}: request {i} waited {took:?}, past the configured bound {limit:?}"
        );
        match judged {
            Ok(Outcome::Ok) => ok += 1,
            Ok(Outcome::Error(status, message)) => {
                let class = message
                    .split_whitespace()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" ");
                *errors.entry(format!("{status} {class}")).or_default() += 1;
            }
            Err(e) => panic!("{name}: {e} (no answer within {limit:?})"),
        }
    }
    assert_eq!(results.len(), REQUESTS);
    fleet.wait_idle().await;
    let metrics = fleet.metrics().await;
    assert_eq!(
        metric(&metrics, "pdgate_endpoint_in_flight"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "pdgate_admission_in_flight"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "pdgate_admission_queued"),
        0.0,
        "{metrics}"
    );
    let finished = metric(&metrics, "pdgate_requests_total");
    assert!(
        finished >= REQUESTS as f64 - metric(&metrics, "pdgate_admission_rejected_total"),
        "{name}: every admitted request is counted once: {metrics}"
    );
    // Outcomes are counted by class: every answer the client read to its end is a success
    // (or a fallback: served by the decode alone).
    assert!(
        metric(&metrics, "pdgate_fallbacks_total")
            + metric(
                &metrics,
                "pdgate_requests_total{route=\"completions\",connector=\"shfs\",outcome=\"success\",model=\"m\"}"
            )
            + metric(
                &metrics,
                "pdgate_requests_total{route=\"chat\",connector=\"shfs\",outcome=\"success\",model=\"m\"}"
            )
            + metric(
                &metrics,
                "pdgate_requests_total{route=\"completions\",connector=\"sglang\",outcome=\"success\",model=\"m\"}"
            )
            + metric(
                &metrics,
                "pdgate_requests_total{route=\"chat\",connector=\"sglang\",outcome=\"success\",model=\"m\"}"
            )
            >= ok as f64,
        "{name}: {ok} successes: {metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "pdgate_requests_total{route=\"completions\",connector=\"shfs\",outcome=\"cancelled\",model=\"m\"}"
        ) + metric(
            &metrics,
            "pdgate_requests_total{route=\"chat\",connector=\"shfs\",outcome=\"cancelled\",model=\"m\"}"
        ),
        0.0,
        "{name}: no client left: {metrics}"
    );
    let grown = rss_bytes().saturating_sub(rss_before);
    assert!(grown < 256 << 20, "{name}: memory grew by {grown} bytes");
    let share = ok as f64 / REQUESTS as f64;
    println!(
        "FAULTS {name}: {ok}/{REQUESTS} succeeded ({:.1}%), worst latency {:.0} ms, wall {:.0} ms, retries {}, ejections {}, fallbacks {}, rss +{} KiB, errors {errors:?}",
        share * 100.0,
        worst.as_secs_f64() * 1000.0,
        wall.as_secs_f64() * 1000.0,
        metric(&metrics, "pdgate_retries_total"),
        metric(&metrics, "pdgate_ejections_total"),
        metric(&metrics, "pdgate_fallbacks_total"),
        grown / 1024,
    );
    Report { share, metrics }
}

fn set(engine: &SimHandle, f: impl FnOnce(&mut Faults)) {
    let mut faults = Faults::default();
    f(&mut faults);
    engine.set_faults(faults);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_prefill_and_decode_under_load() {
    let want = expected().await;
    let mut fleet = fleet(Connector::Shfs, |_| {}).await;
    let prefill = fleet.prefill.remove(0);
    let decode = fleet.decode.remove(0);
    let killer = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        prefill.shutdown().await;
        decode.shutdown().await;
    };
    let (Report { share, .. }, ()) = tokio::join!(run_load("kill", &fleet, &want), killer);
    // Connect failures are retried on the survivors: nothing is lost.
    assert!(share >= 0.8, "kill: {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_prefill_is_retried_then_ejected() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |c| c.health.health_checks = false).await;
    set(&fleet.prefill[0], |f| f.hang = true);
    let Report { share, metrics } = run_load("hang", &fleet, &want).await;
    assert_eq!(share, 1.0, "hang: a timed-out prefill is retried elsewhere");
    assert!(
        metric(&metrics, "pdgate_ejections_total{role=\"prefill\"}") >= 1.0,
        "hang: the hanging prefill was ejected: {metrics}"
    );
    assert!(metric(&metrics, "pdgate_retries_total{leg=\"prefill\"}") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_engines_answer_correctly() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |_| {}).await;
    set(&fleet.prefill[1], |f| f.first_byte_delay_ms = 300);
    set(&fleet.decode[0], |f| f.first_byte_delay_ms = 400);
    let Report { share, .. } = run_load("slow", &fleet, &want).await;
    assert_eq!(share, 1.0, "slow");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_prefill_5xx_and_decode_5xx() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |c| c.health.health_checks = false).await;
    set(&fleet.prefill[0], |f| {
        f.error_rate = 1.0;
        f.error_status = 503;
    });
    set(&fleet.decode[1], |f| f.error_rate = 0.25);
    let Report { share, .. } = run_load("5xx", &fleet, &want).await;
    // Prefill 5xx are retried; decode 5xx after a successful prefill are relayed as they came.
    assert!(share >= 0.5, "5xx: {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_endpoints() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |_| {}).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let flapper = {
        let p = &fleet.prefill[0];
        let d = &fleet.decode[1];
        let stop = stop.clone();
        async move {
            let mut on = false;
            while !stop.is_cancelled() {
                on = !on;
                let faults = Faults {
                    dead: on,
                    error_rate: if on { 1.0 } else { 0.0 },
                    ..Faults::default()
                };
                p.set_faults(faults.clone());
                d.set_faults(Faults {
                    drop_after_chunks: on.then_some(2),
                    ..Faults::default()
                });
                tokio::time::sleep(Duration::from_millis(120)).await;
            }
            p.set_faults(Faults::default());
            d.set_faults(Faults::default());
        }
    };
    let load = async {
        let r = run_load("flapping", &fleet, &want).await;
        stop.cancel();
        r
    };
    let (Report { share, .. }, ()) = tokio::join!(load, flapper);
    assert!(share >= 0.5, "flapping: {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_retry_after() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |c| {
        c.limits.max_in_flight = 3;
        c.limits.max_queue = 2;
        c.limits.queue_timeout = Duration::from_millis(300);
    })
    .await;
    for d in &fleet.decode {
        set(d, |f| f.first_byte_delay_ms = 150);
    }
    let Report { share, .. } = run_load("overload", &fleet, &want).await;
    assert!(share > 0.0 && share < 1.0, "overload: {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connector_prefill_failure_retries_both_legs() {
    let want = expected().await;
    let fleet = fleet(Connector::Sglang, |c| c.health.health_checks = false).await;
    set(&fleet.prefill[0], |f| f.error_rate = 1.0);
    let Report { share, metrics } = run_load("sglang-5xx", &fleet, &want).await;
    // A prefill that fails after the decode's response head went out can no longer be retried
    // (the client has bytes): those few end with an SSE error event.
    assert!(share >= 0.9, "sglang-5xx: {share}");
    assert!(metric(&metrics, "pdgate_retries_total{leg=\"prefill\"}") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_turns_ready_false_first_and_finishes_streams() {
    let mut decode = engine(Role::Decode, Connector::Shfs);
    decode.latency.itl = Duration::from_millis(60);
    let fleet = start(
        vec![engine(Role::Prefill, Connector::Shfs)],
        vec![decode],
        |c| {
            tight(c);
            c.shutdown.drain_delay = Duration::from_millis(400);
        },
    )
    .await;
    let Fleet {
        prefill,
        decode,
        gateway,
        http,
    } = fleet;
    let base = gateway.base_url();
    let mut stream = http
        .post(format!("{base}/v1/completions"))
        .json(&completion(true))
        .send()
        .await
        .expect("stream");
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.expect("chunk").expect("first chunk");
    let shutdown = tokio::spawn(gateway.shutdown(Duration::from_secs(5)));
    // /ready goes false while the listener still serves.
    let mut saw_draining = false;
    for _ in 0..100 {
        match http.get(format!("{base}/ready")).send().await {
            Ok(r) if r.status() == 503 => {
                let v: Value = r.json().await.expect("ready json");
                assert_eq!(v["draining"], true, "{v}");
                saw_draining = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("listener closed before /ready went false: {e}"),
        }
    }
    assert!(saw_draining);
    // The in-flight stream completes intact.
    let mut body = first.to_vec();
    while let Some(c) = stream.chunk().await.expect("rest of the stream") {
        body.extend_from_slice(&c);
    }
    assert!(!text_of(std::str::from_utf8(&body).expect("utf8")).is_empty());
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown within its deadline")
        .expect("shutdown task");
    // Then the listener is closed.
    assert!(http.get(format!("{base}/ready")).send().await.is_err());
    for e in prefill.into_iter().chain(decode) {
        e.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_an_sglang_stream_aborts_the_decode() {
    let mut decode = engine(Role::Decode, Connector::Sglang);
    decode.latency.itl = Duration::from_millis(50);
    let fleet = start(
        vec![engine(Role::Prefill, Connector::Sglang)],
        vec![decode],
        tight,
    )
    .await;
    let mut r = fleet.post("/v1/completions", &completion(true)).await;
    assert_eq!(r.status(), 200);
    assert!(r.chunk().await.expect("chunk").is_some());
    drop(r);
    let mut aborted = 0;
    for _ in 0..100 {
        aborted = fleet.decode[0].stats().requests.abort_requests;
        if aborted > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(aborted, 1, "the decode was told to abort");
    fleet.wait_idle().await;
    // A stream read to its end sends no abort.
    let r = fleet.post("/v1/completions", &completion(true)).await;
    assert!(!text_of(&r.text().await.expect("body")).is_empty());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fleet.decode[0].stats().requests.abort_requests, 1);
}

async fn ready_json(fleet: &Fleet) -> (u16, Value) {
    let r = fleet
        .http
        .get(fleet.url("/ready"))
        .send()
        .await
        .expect("ready");
    let status = r.status().as_u16();
    (status, r.json().await.expect("ready json"))
}

/// Polls `/ready` (bounded) until `check` holds.
async fn ready_until(fleet: &Fleet, what: &str, check: impl Fn(u16, &Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..200 {
        let (status, v) = ready_json(fleet).await;
        if check(status, &v) {
            return v;
        }
        last = v;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{what}: /ready stayed {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_checks_drive_routing_and_readiness() {
    let fleet = fleet(Connector::Shfs, |_| {}).await;
    let sick = fleet.decode[0].addr().to_string();
    set(&fleet.decode[0], |f| f.dead = true);
    ready_until(&fleet, "decode leaves", |s, v| {
        s == 200
            && v["excluded"].to_string().contains(&sick)
            && v["decode"].as_array().is_some_and(|d| d.len() == 1)
    })
    .await;
    for _ in 0..6 {
        let r = fleet.post("/v1/completions", &completion(false)).await;
        assert_eq!(r.status(), 200);
        assert_ne!(r.headers()["target-pod"], sick.as_str());
    }
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(&format!(
            "pdgate_endpoint_healthy{{role=\"decode\",endpoint=\"{sick}\"}} 0"
        )),
        "{metrics}"
    );
    // Both prefills failing their checks: no routable pair, /ready says so.
    for p in &fleet.prefill {
        set(p, |f| f.dead = true);
    }
    ready_until(&fleet, "no pair", |s, _| s == 503).await;
    let r = fleet.post("/v1/completions", &completion(false)).await;
    assert_eq!(r.status(), 503);
    // Healed endpoints come back.
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        set(e, |_| {});
    }
    ready_until(&fleet, "healed", |s, v| {
        s == 200 && v["decode"].as_array().is_some_and(|d| d.len() == 2)
    })
    .await;
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_endpoint_cap_refuses_with_retry_after() {
    let fleet = start(
        vec![engine(Role::Prefill, Connector::Shfs)],
        vec![engine(Role::Decode, Connector::Shfs)],
        |c| {
            tight(c);
            c.limits.max_in_flight_per_endpoint = 1;
        },
    )
    .await;
    set(&fleet.decode[0], |f| f.first_byte_delay_ms = 400);
    let body = completion(false);
    let first = fleet.post("/v1/completions", &body);
    let second = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        fleet.post("/v1/completions", &completion(false)).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status(), 200);
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["retry-after"], "1");
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_bounds_retries() {
    let fleet = fleet(Connector::Shfs, |c| {
        c.health.health_checks = false;
        c.health.consecutive_failures = 0;
        c.limits.retry_budget_min = 1;
        c.limits.retry_budget_ratio = 0.0;
        c.policy.prefill_policy = "round_robin".into();
    })
    .await;
    set(&fleet.prefill[0], |f| f.error_rate = 1.0);
    let mut fallbacks = 0;
    for _ in 0..8 {
        let r = fleet.post("/v1/completions", &completion(false)).await;
        assert_eq!(r.status(), 200);
        fallbacks += usize::from(r.headers().get("x-pdgate-fallback").is_some());
        assert!(!text_of(&r.text().await.expect("body")).is_empty());
    }
    let metrics = fleet.metrics().await;
    assert_eq!(metric(&metrics, "pdgate_retries_total"), 1.0, "{metrics}");
    // Every other request hit the failing prefill; only the first was retried.
    assert_eq!(fallbacks, 3, "{metrics}");
    // The three refusals and the empty budget are visible.
    assert_eq!(
        metric(&metrics, "pdgate_retries_refused_total{leg=\"prefill\"}"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "pdgate_retry_budget_tokens"),
        0.0,
        "{metrics}"
    );
    fleet.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_decode_is_bounded_then_ejected() {
    let want = expected().await;
    let fleet = fleet(Connector::Shfs, |c| c.health.health_checks = false).await;
    set(&fleet.decode[0], |f| f.hang = true);
    let Report { share, metrics } = run_load("decode-hang", &fleet, &want).await;
    // A decode that accepted the request and then hangs is not retried (it may be working);
    // its requests end with 504 at decode_timeout (outcome `timeout`), and least_request plus
    // ejection keep the rest away from it.
    assert!(share >= 0.8, "decode-hang: {share}");
    assert!(
        metric(
            &metrics,
            "pdgate_requests_total{route=\"completions\",connector=\"shfs\",outcome=\"timeout\",model=\"m\"}"
        ) + metric(
            &metrics,
            "pdgate_requests_total{route=\"chat\",connector=\"shfs\",outcome=\"timeout\",model=\"m\"}"
        ) >= 1.0,
        "{metrics}"
    );
}

/// A decode that answers 200 and then breaks every stream is ejected like one that answers 5xx
/// (passive health counts what happens after the head), and traffic moves to the healthy one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_breaks_streams_after_its_head_is_ejected() {
    let fleet = fleet(Connector::Shfs, |c| {
        c.policy.decode_policy = "least_request".into();
        c.health.consecutive_failures = 3;
        // One ejection for the whole test.
        c.health.base_ejection = Duration::from_secs(60);
        c.health.max_ejection = Duration::from_secs(60);
    })
    .await;
    let sick = fleet.decode[0].addr().to_string();
    set(&fleet.decode[0], |f| f.drop_after_chunks = Some(2));
    let long = |i: usize| json!({"model": MODEL, "prompt": format!("stream {i}"), "max_tokens": 16, "stream": true});
    let mut broken = 0;
    for i in 0..40 {
        let r = fleet.post("/v1/completions", &long(i)).await;
        assert_eq!(r.status(), 200);
        let served_by_sick = r.headers()["target-pod"] == sick.as_str();
        let text = r.text().await.unwrap_or_default();
        if served_by_sick && (text.contains("\"error\"") || !text.contains("[DONE]")) {
            broken += 1;
        }
    }
    // Three broken streams in a row eject it, and nothing is sent to it after that.
    assert_eq!(broken, 3, "{broken} streams broke");
    let metrics = fleet.metrics().await;
    assert!(
        metrics.contains(&format!(
            "pdgate_endpoint_healthy{{role=\"decode\",endpoint=\"{sick}\"}} 0"
        )),
        "{metrics}"
    );
    assert!(metric(&metrics, "pdgate_ejections_total{role=\"decode\"}") >= 1.0);
    // Once ejected, the sick decode gets nothing: the last requests all end cleanly.
    for i in 40..50 {
        let r = fleet.post("/v1/completions", &long(i)).await;
        assert_ne!(r.headers()["target-pod"], sick.as_str());
        assert!(r.text().await.unwrap().contains("[DONE]"));
    }
    fleet.wait_idle().await;
}

// ---------------------------------------------------------------------------------------------
// The reliability campaign: for shfs, mooncake and sglang, one fault per scenario on one of two
// prefills or decodes (so a healthy path always exists). A warm-up of `WARM_UP` requests is the
// detection window (ejection after `outlier_consecutive_failures`, for the rest of the run); the
// next `MEASURED` requests must succeed at >= 99.9%. Engines have zero delay: a scenario takes a
// few hundred milliseconds plus whatever the fault itself costs its first requests.

const WARM_UP: usize = 40;
const MEASURED: usize = 500;
/// Requests after the measured ones, sent only while a rule that needs samples (the latency
/// outlier rule) has not yet decided: a loaded machine answers the warm-up too slowly for it.
const MORE_WARM_UP: usize = 120;
const CAMPAIGN_CONCURRENCY: usize = 16;

/// What one engine alone answers to requests `0..WARM_UP + MEASURED + MORE_WARM_UP`, computed
/// once.
async fn oracle() -> Arc<Vec<String>> {
    static ORACLE: tokio::sync::OnceCell<Arc<Vec<String>>> = tokio::sync::OnceCell::const_new();
    ORACLE
        .get_or_init(|| async {
            let engine = pdsim::spawn(sim(Role::Both, Connector::None))
                .await
                .expect("baseline engine");
            let http = reqwest::Client::new();
            let base = engine.base_url();
            let out: Vec<String> = futures_util::stream::iter(0..WARM_UP + MEASURED + MORE_WARM_UP)
                .map(|i| {
                    let (http, base) = (http.clone(), base.clone());
                    async move {
                        let (path, body) = request(i);
                        let r = http
                            .post(format!("{base}{path}"))
                            .json(&body)
                            .send()
                            .await
                            .expect("baseline");
                        assert_eq!(r.status(), 200);
                        text_of(&r.text().await.expect("baseline body"))
                    }
                })
                .buffered(CAMPAIGN_CONCURRENCY)
                .collect()
                .await;
            engine.shutdown().await;
            Arc::new(out)
        })
        .await
        .clone()
}

/// One scenario's numbers over its measured requests.
struct Row {
    ok: usize,
    errors: std::collections::BTreeMap<u16, usize>,
    worst: Duration,
}

/// Sends requests `range` (bounded concurrency); every answer right or a clear error.
async fn send_all(fleet: &Fleet, range: std::ops::Range<usize>, want: &[String]) -> Row {
    let limit = bound(&fleet.gateway.gateway().config);
    let http = reqwest::Client::builder()
        .timeout(limit)
        .build()
        .expect("client");
    let results: Vec<(usize, Duration, u16, Outcome)> = futures_util::stream::iter(range)
        .map(|i| {
            let http = http.clone();
            let url = fleet.url(request(i).0);
            async move {
                let t = Instant::now();
                let r = http
                    .post(url)
                    .header("x-request-id", format!("fault-{i}"))
                    .json(&request(i).1)
                    .send()
                    .await
                    .unwrap_or_else(|e| panic!("request {i}: no answer within {limit:?}: {e}"));
                let status = r.status().as_u16();
                let id = r
                    .headers()
                    .get("x-request-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let (status, body) = match r.text().await {
                    Ok(body) => (status, body),
                    // A JSON body cut after its head: the client sees a broken body (599 here).
                    Err(e) => (
                        599,
                        format!("{{\"error\":{{\"message\":\"broken body: {e}\"}}}}"),
                    ),
                };
                (i, t.elapsed(), status, id, body)
            }
        })
        .buffer_unordered(CAMPAIGN_CONCURRENCY)
        .map(|(i, took, status, id, body)| {
            (
                i,
                took,
                status,
                judge(i, status, id.as_deref(), &body, &want[i]),
            )
        })
        .collect()
        .await;
    let mut row = Row {
        ok: 0,
        errors: Default::default(),
        worst: Duration::ZERO,
    };
    for (i, took, status, outcome) in results {
        assert!(took <= limit, "request {i} waited {took:?}, past {limit:?}");
        row.worst = row.worst.max(took);
        match outcome {
            Outcome::Ok => row.ok += 1,
            Outcome::Error(_, _) => *row.errors.entry(status).or_default() += 1,
        }
    }
    row
}

/// The campaign's fleet: two prefills and two decodes of `connector` with zero delay, health
/// checks off and one ejection lasting the whole run (the measured requests see the fleet after
/// detection), unless `tweak` says otherwise.
async fn campaign_fleet(
    connector: Connector,
    tweak: impl FnOnce(&mut Config),
    engines: impl Fn(&mut SimConfig),
) -> Fleet {
    let zero = |role| {
        let mut c = sim(role, connector);
        c.handoff_timeout = Duration::from_secs(2);
        engines(&mut c);
        c
    };
    start(
        vec![zero(Role::Prefill), zero(Role::Prefill)],
        vec![zero(Role::Decode), zero(Role::Decode)],
        |c| {
            tight(c);
            c.health.health_checks = false;
            c.health.base_ejection = Duration::from_secs(60);
            c.health.max_ejection = Duration::from_secs(60);
            c.limits.retry_budget_min = 100;
            tweak(c);
        },
    )
    .await
}

/// Runs one scenario: fleet, fault, warm-up, measured run; checks the gauges and prints a row.
/// Returns the measured success share and the metrics text.
async fn campaign(
    name: &str,
    connector: Connector,
    tweak: impl FnOnce(&mut Config),
    engines: impl Fn(&mut SimConfig),
    fault: impl FnOnce(&Fleet),
) -> (f64, String) {
    let want = oracle().await;
    let fleet = campaign_fleet(connector, tweak, engines).await;
    fault(&fleet);
    let warm = send_all(&fleet, 0..WARM_UP, &want).await;
    let row = send_all(&fleet, WARM_UP..WARM_UP + MEASURED, &want).await;
    finish(name, &fleet, &warm, &row).await
}

/// Heals every engine, checks that the gauges are back to 0, prints the scenario's row.
async fn finish(name: &str, fleet: &Fleet, warm: &Row, row: &Row) -> (f64, String) {
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        e.set_faults(Faults::default());
    }
    fleet.wait_idle().await;
    let metrics = fleet.metrics().await;
    let gauges = metric(&metrics, "pdgate_endpoint_in_flight")
        + metric(&metrics, "pdgate_admission_in_flight")
        + metric(&metrics, "pdgate_admission_queued");
    assert_eq!(gauges, 0.0, "{name}: gauges back to 0: {metrics}");
    let share = row.ok as f64 / MEASURED as f64;
    let errors: Vec<String> = row
        .errors
        .iter()
        .map(|(s, n)| format!("{s}: {:.1}%", *n as f64 * 100.0 / MEASURED as f64))
        .collect();
    println!(
        "CAMPAIGN | {name:<28} | {:>6.1}% | errors [{}] | worst {:>5.0} ms | warm-up {}/{WARM_UP} ok | gauges 0 | ejections p {} d {} | retries {} | fallbacks {}",
        share * 100.0,
        errors.join(", "),
        row.worst.max(warm.worst).as_secs_f64() * 1000.0,
        warm.ok,
        metric(&metrics, "pdgate_ejections_total{role=\"prefill\"}"),
        metric(&metrics, "pdgate_ejections_total{role=\"decode\"}"),
        metric(&metrics, "pdgate_retries_total"),
        metric(&metrics, "pdgate_fallbacks_total"),
    );
    (share, metrics)
}

/// Which engine a restart scenario kills.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Prefill,
    Decode,
}

/// One engine killed under load (half of the warm-up in flight), gone for 300 ms, then started
/// again on the same ports with a new engine id. The detection window is the warm-up plus the
/// wait until the gateway routes to the restarted engine again (active checks every 100 ms,
/// ejections of 500 ms); the measured requests then run on the whole fleet again.
async fn restart_scenario(name: &str, connector: Connector, victim: Victim) -> (f64, String) {
    let want = oracle().await;
    let mut fleet = campaign_fleet(
        connector,
        |c| {
            c.health.health_checks = true;
            c.health.base_ejection = Duration::from_millis(500);
            c.health.max_ejection = Duration::from_secs(2);
        },
        |_| {},
    )
    .await;
    let engine = match victim {
        Victim::Prefill => fleet.prefill.remove(0),
        Victim::Decode => fleet.decode.remove(0),
    };
    let name_of = engine.addr().to_string();
    let half = WARM_UP / 2;
    let (first, back) = tokio::join!(send_all(&fleet, 0..half, &want), async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        restart(engine, Duration::from_millis(300)).await
    });
    match victim {
        Victim::Prefill => fleet.prefill.insert(0, back),
        Victim::Decode => fleet.decode.insert(0, back),
    }
    // Routable again: listed by /ready and not excluded.
    let role = match victim {
        Victim::Prefill => "prefill",
        Victim::Decode => "decode",
    };
    ready_until(&fleet, "restarted engine routable", |s, v| {
        s == 200
            && v[role].to_string().contains(&name_of)
            && !v["excluded"].to_string().contains(&name_of)
    })
    .await;
    let second = send_all(&fleet, half..WARM_UP, &want).await;
    let served_before = served(&fleet, victim);
    let row = send_all(&fleet, WARM_UP..WARM_UP + MEASURED, &want).await;
    assert!(
        served(&fleet, victim) > served_before,
        "{name}: the restarted engine takes traffic again"
    );
    let warm = Row {
        ok: first.ok + second.ok,
        errors: Default::default(),
        worst: first.worst.max(second.worst),
    };
    finish(name, &fleet, &warm, &row).await
}

/// Generation requests the victim (index 0 of its role) has received.
fn served(fleet: &Fleet, victim: Victim) -> u64 {
    let e = match victim {
        Victim::Prefill => &fleet.prefill[0],
        Victim::Decode => &fleet.decode[0],
    };
    e.stats().requests.completions + e.stats().requests.chat_completions
}

const CONNECTORS: [Connector; 3] = [Connector::Shfs, Connector::Mooncake, Connector::Sglang];

fn each_connector(name: &str, c: Connector) -> String {
    format!("{}-{name}", c.as_str())
}

/// A decode that answers 200 and then breaks its streams (SSE and JSON) is ejected in the
/// detection window; afterwards every request succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_decode_drops_streams() {
    for c in CONNECTORS {
        let (share, _) = campaign(
            &each_connector("decode-drops-streams", c),
            c,
            |_| {},
            |_| {},
            |f| set(&f.decode[0], |x| x.drop_after_chunks = Some(2)),
        )
        .await;
        assert!(share >= 0.999, "{c:?}: {share}");
    }
}

/// A decode answering 5xx is ejected in the detection window (its 5xx are passed back to the
/// client until then, counted `decode_error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_decode_5xx() {
    for c in CONNECTORS {
        let (share, metrics) = campaign(
            &each_connector("decode-5xx", c),
            c,
            |_| {},
            |_| {},
            |f| set(&f.decode[0], |x| x.error_rate = 1.0),
        )
        .await;
        assert!(share >= 0.999, "{c:?}: {share}");
        assert!(
            metrics
                .lines()
                .any(|l| l.contains("outcome=\"decode_error\"") && !l.ends_with(" 0")),
            "{c:?}: a decode 5xx is a decode_error: {metrics}"
        );
    }
}

/// A prefill answering 5xx: retried on the other prefill (or the decode serves alone), then
/// ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_prefill_5xx() {
    for c in CONNECTORS {
        let (share, _) = campaign(
            &each_connector("prefill-5xx", c),
            c,
            |_| {},
            |_| {},
            |f| set(&f.prefill[0], |x| x.error_rate = 1.0),
        )
        .await;
        assert!(share >= 0.999, "{c:?}: {share}");
    }
}

/// A frozen prefill (accepts, never answers): the gateway's prefill bound fires before the
/// engines' KV wait, the prefill is blamed, retried elsewhere and ejected; no decode is blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_prefill_frozen() {
    for c in CONNECTORS {
        let (share, metrics) = campaign(
            &each_connector("prefill-frozen", c),
            c,
            |_| {},
            |_| {},
            |f| set(&f.prefill[0], |x| x.hang = true),
        )
        .await;
        assert!(share >= 0.999, "{c:?}: {share}");
        assert_eq!(
            metric(&metrics, "pdgate_ejections_total{role=\"decode\"}"),
            0.0,
            "{c:?}: {metrics}"
        );
        assert!(metric(&metrics, "pdgate_ejections_total{role=\"prefill\"}") >= 1.0);
    }
}

/// Timeouts ordered the wrong way (the engines' KV wait is shorter than the gateway's prefill
/// bound): the decode gives up first, with a 5xx (or, streaming, an error event) while the
/// prefill has not answered. Blame by evidence puts it on the prefill: the request is retried on
/// the other prefill, the frozen prefill is ejected, and neither decode is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_kv_wait_blames_the_frozen_prefill() {
    for c in [Connector::Mooncake, Connector::Sglang] {
        let (share, metrics) = campaign(
            &each_connector("kv-wait-blames-prefill", c),
            c,
            |cfg| {
                cfg.legs.prefill_timeout = Duration::from_secs(5);
                cfg.reliability.concurrent_prefill_timeout = Duration::from_secs(5);
                cfg.reliability.kv_wait_evidence = Duration::from_millis(150);
            },
            |e| e.handoff_timeout = Duration::from_millis(300),
            |f| set(&f.prefill[0], |x| x.hang = true),
        )
        .await;
        assert!(share >= 0.999, "{c:?}: {share}");
        assert_eq!(
            metric(&metrics, "pdgate_ejections_total{role=\"decode\"}"),
            0.0,
            "{c:?}: the decodes are not blamed: {metrics}"
        );
        assert!(
            metric(&metrics, "pdgate_ejections_total{role=\"prefill\"}") >= 1.0,
            "{c:?}: {metrics}"
        );
    }
}

/// A prefill restarted (killed under load, back on the same port after 300 ms; for mooncake
/// with a new engine id, which the decodes refuse when handed the old one). Its bootstrap facts
/// are looked up again when it comes back, and a request that meets the stale id is retried on
/// fresh ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_prefill_restarted() {
    restart_each_connector("prefill-restarted", Victim::Prefill).await;
}

/// A decode killed under load and restarted on the same port: connect failures are retried on
/// the other decode, and the restarted one takes traffic again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_decode_killed_and_restarted() {
    restart_each_connector("decode-restarted", Victim::Decode).await;
}

async fn restart_each_connector(name: &str, victim: Victim) {
    for c in CONNECTORS {
        let (share, _) = restart_scenario(&each_connector(name, c), c, victim).await;
        assert!(share >= 0.999, "{c:?}: {share}");
    }
}

/// A prefill answering correctly but 2 s slower than its peer (within every timeout): the
/// latency outlier rule ejects it in the detection window, the requests waiting on it are
/// released and retried, and the measured requests never wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_prefill_2s_slower() {
    for c in CONNECTORS {
        let want = oracle().await;
        let fleet = campaign_fleet(
            c,
            |cfg| {
                cfg.legs.prefill_timeout = Duration::from_secs(5);
                cfg.reliability.concurrent_prefill_timeout = Duration::from_secs(5);
            },
            |e| e.handoff_timeout = Duration::from_secs(4),
        )
        .await;
        set(&fleet.prefill[0], |x| x.first_byte_delay_ms = 2000);
        let warm = send_all(&fleet, 0..WARM_UP, &want).await;
        // The detection window ends with the ejection. The rule needs answers from the slow
        // prefill: on a loaded machine the warm-up's may be too few (some fail), so more
        // warm-up traffic follows until it decides, and then a bounded wait for the last ones.
        let ejected = || async {
            metric(
                &fleet.metrics().await,
                "pdgate_ejections_total{role=\"prefill\"}",
            ) >= 1.0
        };
        let more = WARM_UP + MEASURED;
        for batch in (more..more + MORE_WARM_UP).step_by(WARM_UP) {
            if ejected().await {
                break;
            }
            send_all(&fleet, batch..batch + WARM_UP, &want).await;
        }
        let detected = tokio::time::Instant::now() + Duration::from_secs(10);
        while !ejected().await && tokio::time::Instant::now() < detected {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let before = served(&fleet, Victim::Prefill);
        let row = send_all(&fleet, WARM_UP..WARM_UP + MEASURED, &want).await;
        let slow_served = served(&fleet, Victim::Prefill) - before;
        let (share, metrics) =
            finish(&each_connector("prefill-2s-slower", c), &fleet, &warm, &row).await;
        assert!(share >= 0.999, "{c:?}: {share}");
        assert_eq!(slow_served, 0, "{c:?}: the slow prefill is out of rotation");
        assert!(
            metric(&metrics, "pdgate_ejections_total{role=\"prefill\"}") >= 1.0,
            "{c:?}: {metrics}"
        );
    }
}
