//! pdbench against in-process pdsim engines on port 0: closed and open loop, streaming and
//! not, and the direct PD mode performing a real KV handoff.

use std::time::Duration;

use pdbench::{Api, Config, DirectConnector, Load, Report, Target};
use pdsim::{Connector, Role, SimConfig};
use tokio_util::sync::CancellationToken;

/// Runs `cfg` with a generous outer bound so a hung run fails the test instead of hanging it.
async fn run(cfg: &Config) -> Report {
    tokio::time::timeout(
        Duration::from_secs(120),
        pdbench::run(cfg, CancellationToken::new()),
    )
    .await
    .expect("run terminates")
    .expect("run starts")
}

fn base(target: Target) -> Config {
    let mut cfg = Config::new(target);
    cfg.prompt_len = "4..24".parse().expect("dist");
    cfg.output_len = pdbench::dist::Dist::Fixed(8);
    cfg.timeout = Duration::from_secs(30);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_completions_non_streaming() {
    let engine = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let mut cfg = base(Target::Url(engine.base_url()));
    cfg.load = Load::Closed { concurrency: 4 };
    cfg.requests = Some(60);
    let r = run(&cfg).await;
    assert_eq!(r.errors_by_class, Default::default(), "{r}");
    assert_eq!(r.ok, 60);
    assert_eq!(r.requests, 60);
    assert_eq!(r.output_tokens, 60 * 8, "usage.completion_tokens summed");
    let lat = r.latency_ms.expect("latency");
    assert_eq!(lat.count, 60);
    assert!(lat.p50 <= lat.p99 && lat.p99 <= lat.max);
    assert!(r.ttft_ms.is_none(), "no TTFT without streaming");
    assert_eq!(engine.stats().responses_ok, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_chat_streaming_measures_ttft_and_gaps() {
    let engine = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let mut cfg = base(Target::Url(engine.base_url()));
    cfg.api = Api::Chat;
    cfg.stream = true;
    cfg.load = Load::Closed { concurrency: 8 };
    cfg.requests = Some(40);
    cfg.warmup = 5;
    let r = run(&cfg).await;
    assert_eq!(r.ok, 40, "{r}");
    assert_eq!(r.errors, 0);
    assert_eq!(r.output_tokens, 40 * 8);
    assert_eq!(r.ttft_ms.expect("ttft").count, 40);
    // Each stream has 8 token events, so 7 gaps each.
    assert_eq!(r.itl_ms.expect("itl").count, 40 * 7);
    // Warm-up requests reach the engine but are not in the report.
    assert_eq!(engine.stats().responses_ok, 45);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_completions_streaming() {
    let engine = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let mut cfg = base(Target::Url(engine.base_url()));
    cfg.stream = true;
    cfg.load = Load::Open {
        rate: 400.0,
        max_in_flight: 1000,
    };
    cfg.requests = Some(50);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 50, "{r}");
    assert_eq!(r.load, "open");
    assert_eq!(r.rate, Some(400.0));
    assert_eq!(r.ttft_ms.expect("ttft").count, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_bound_stops_issuing() {
    let engine = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let mut cfg = base(Target::Url(engine.base_url()));
    cfg.load = Load::Open {
        rate: 100.0,
        max_in_flight: 100,
    };
    cfg.requests = None;
    cfg.duration = Some(Duration::from_millis(300));
    let r = run(&cfg).await;
    // Arrivals are scheduled at i/rate from the start and stop at the deadline, so at most
    // rate * duration + 1 requests exist, whatever the machine's speed.
    assert!(r.requests >= 1, "{r}");
    assert!(r.requests <= 31, "{r}");
    assert_eq!(r.errors, 0, "{r}");

    let mut closed = base(Target::Url(engine.base_url()));
    closed.load = Load::Closed { concurrency: 2 };
    closed.ramp = Duration::from_millis(50);
    closed.requests = Some(1_000_000);
    closed.duration = Some(Duration::from_millis(200));
    let r = run(&closed).await;
    assert!(r.ok >= 1 && r.ok < 1_000_000, "{r}");
}

async fn direct_pair(stream: bool, api: Api) {
    let prefill = pdsim::spawn(SimConfig::new(Role::Prefill, Connector::Shfs))
        .await
        .expect("prefill");
    let decode = pdsim::spawn(SimConfig::new(Role::Decode, Connector::Shfs))
        .await
        .expect("decode");
    let mut cfg = base(Target::Direct {
        prefill: prefill.base_url(),
        decode: decode.base_url(),
        connector: DirectConnector::Shfs,
    });
    cfg.api = api;
    cfg.stream = stream;
    cfg.load = Load::Closed { concurrency: 4 };
    cfg.requests = Some(30);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 30, "{r}");
    assert_eq!(r.errors, 0, "{r}");
    assert_eq!(r.prefill_ms.expect("prefill leg timed").count, 30);
    let d = decode.stats();
    let p = prefill.stats();
    assert_eq!(d.transfers_pulled, 30, "decode pulled every prompt's KV");
    assert_eq!(d.recomputed, 0, "decode recomputed nothing");
    assert_eq!(d.transfers_failed, 0);
    assert_eq!(p.transfers_served, 30, "prefill served every transfer");
    if stream {
        assert_eq!(r.ttft_ms.expect("ttft").count, 30);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_shfs_handoff_non_streaming() {
    direct_pair(false, Api::Completions).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_shfs_handoff_streaming_chat() {
    direct_pair(true, Api::Chat).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_refuses_a_prefill_without_kv_params() {
    // A plain engine answers the prefill leg without kv_transfer_params: not a PD baseline.
    let plain = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let decode = pdsim::spawn(SimConfig::new(Role::Decode, Connector::Shfs))
        .await
        .expect("decode");
    let mut cfg = base(Target::Direct {
        prefill: plain.base_url(),
        decode: decode.base_url(),
        connector: DirectConnector::Shfs,
    });
    cfg.requests = Some(5);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 0, "{r}");
    assert_eq!(r.errors_by_class.get("protocol"), Some(&5), "{r}");
    assert_eq!(decode.stats().transfers_pulled, 0);
}
