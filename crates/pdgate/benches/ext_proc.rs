//! The time pdgate's ext_proc service takes per request, beside the proxy's overhead, for the
//! same requests on the same engines (docs/ext-proc.md, "Decision latency").
//!
//! Two zero-delay pdsim engines (a prefill and a decode, connector `shfs`: no simulated compute,
//! every decode pulls its KV from the prefill), one pdgate proxy and one pdgate ext-proc in front
//! of them, in this process. One client sends each request three ways, one after the other:
//! - `direct`: the two legs by hand (prefill with `max_tokens` 1 and `do_remote_decode`, then
//!   the decode with the prefill's `kv_transfer_params`), timing the prefill leg on its own;
//! - the proxy: its end-to-end time; overhead = that minus `direct`'s;
//! - ext_proc, through the Envoy-like client of the tests (`tests/common/envoy.rs`): the time
//!   the processor took to answer every message of the request, minus this request's direct
//!   prefill leg (the processor runs a prefill leg of the same shape inside its answer to the
//!   body); and, of it, the answer to the body message (the decision) alone.
//!
//! `cargo bench -p pdgate --bench ext_proc [-- REQUESTS]` (default 2,000, after 200 warm-up
//! requests each way): prints p50 and p99 in microseconds. Wall times on a shared machine: run
//! it on an idle one.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a panic is the report

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::envoy::Envoy;
use common::{MODEL, engines, sim};
use pdgate::{ExtProcOptions, Gateway, RunningGateway};
use pdsim::{Connector, Role, SimConfig};
use serde_json::{Value, json};
use tokio::net::TcpListener;

fn zero_delay(role: Role) -> SimConfig {
    let mut c = sim(role, Connector::Shfs);
    c.latency.prefill_per_token = Duration::ZERO;
    c.latency.ttft = Duration::ZERO;
    c.latency.itl = Duration::ZERO;
    c.latency.slots = 0;
    c
}

fn body(i: usize) -> Value {
    let words: Vec<String> = (0..128)
        .map(|w| format!("w{}", (i * 131 + w) % 997))
        .collect();
    json!({"model": MODEL, "prompt": words.join(" "), "max_tokens": 16, "stream": false})
}

/// Both legs by hand: (whole, prefill leg).
async fn direct(
    http: &reqwest::Client,
    prefill: &str,
    decode: &str,
    i: usize,
) -> (Duration, Duration) {
    let started = Instant::now();
    let mut p = body(i);
    p["max_tokens"] = json!(1);
    p["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let r = http
        .post(format!("{prefill}/v1/completions"))
        .header("x-request-id", format!("direct-{i}"))
        .json(&p)
        .send()
        .await
        .expect("prefill");
    assert_eq!(r.status(), 200);
    let answer = r.bytes().await.expect("prefill body");
    let prefill_leg = started.elapsed();
    let host = prefill
        .trim_start_matches("http://")
        .split(':')
        .next()
        .unwrap();
    let params = pdbench::client::shfs_decode_params(&answer, host).expect("kv_transfer_params");
    let mut d = body(i);
    d["kv_transfer_params"] = serde_json::from_str(&params).unwrap();
    let r = http
        .post(format!("{decode}/v1/completions"))
        .header("x-request-id", format!("direct-{i}"))
        .json(&d)
        .send()
        .await
        .expect("decode");
    assert_eq!(r.status(), 200);
    r.bytes().await.expect("decode body");
    (started.elapsed(), prefill_leg)
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn percentiles(name: &str, mut v: Vec<i64>) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    println!("{name:<58} p50 {:>6} us   p99 {:>6} us", at(0.50), at(0.99));
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let (config, p, d) = engines(
        vec![zero_delay(Role::Prefill)],
        vec![zero_delay(Role::Decode)],
    )
    .await;
    let registry = || kvtransfer::Registry::with_builtins();
    let proxy_gw = Gateway::new(config.clone(), registry()).expect("config");
    let pods = proxy_gw.config.pods().expect("pods");
    let proxy = RunningGateway::start(
        proxy_gw,
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        pods.clone(),
    )
    .await
    .expect("proxy");
    let ext_gw = Gateway::new(config, registry()).expect("config");
    let ext = RunningGateway::start_ext_proc(
        ext_gw,
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        pods,
        ExtProcOptions::default(),
    )
    .await
    .expect("ext_proc");
    let http = reqwest::Client::new();
    let envoy = Envoy::new(ext.addr());
    let (prefill, decode) = (p[0].base_url(), d[0].base_url());
    let proxy_url = format!("{}/v1/completions", proxy.base_url());
    // Health checks first mark the engines routable.
    for _ in 0..200 {
        if http
            .get(format!("{}/ready", proxy.base_url()))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
            && http
                .get(format!("http://{}/ready", ext.addr()))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (mut proxy_overhead, mut ext_overhead, mut processor, mut decision) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut prefill_legs = Vec::new();
    for i in 0..n + 200 {
        let (whole, prefill_leg) = direct(&http, &prefill, &decode, i).await;
        let started = Instant::now();
        let r = http
            .post(&proxy_url)
            .json(&body(i))
            .send()
            .await
            .expect("proxy");
        assert_eq!(r.status(), 200);
        r.bytes().await.expect("proxy body");
        let through_proxy = started.elapsed();
        let relayed = envoy
            .request("/v1/completions", &body(i), &[], None)
            .await
            .expect("ext_proc");
        assert_eq!(relayed.status, 200);
        if i < 200 {
            continue;
        }
        prefill_legs.push(micros(prefill_leg));
        proxy_overhead.push(micros(through_proxy) - micros(whole));
        processor.push(micros(relayed.processor) - micros(prefill_leg));
        decision.push(micros(relayed.decide) - micros(prefill_leg));
        ext_overhead.push(micros(relayed.processor + relayed.forward) - micros(whole));
    }
    println!(
        "{n} non-streamed PD requests (shfs, 128 words, 16 tokens), one client, zero-delay engines"
    );
    percentiles("direct prefill leg", prefill_legs);
    percentiles("proxy: added over direct", proxy_overhead);
    percentiles(
        "ext_proc: all answers of a request, minus its prefill leg",
        processor,
    );
    percentiles(
        "ext_proc: answer to the body (decision), minus prefill",
        decision,
    );
    percentiles(
        "ext_proc: answers + forwarded decode, minus direct",
        ext_overhead,
    );
}
