//! pdbench against in-process pdsim engines on port 0: closed and open loop, streaming and
//! not, the direct PD mode performing a real KV handoff, and the cache-sensitive workloads
//! (prefix cache on): the cached share from `usage` follows the oracle, multi-turn sends the
//! history, the model comes from `/v1/models`, failures keep a sample error.

use std::time::Duration;

use pdbench::{Api, Config, DirectConnector, Load, Order, Report, Target, TraceSpec, WorkloadKind};
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
async fn replicas_take_turns() {
    let a = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let b = pdsim::spawn(SimConfig::new(Role::Both, Connector::None))
        .await
        .expect("pdsim");
    let mut cfg = base(Target::Replicas(vec![a.base_url(), b.base_url()]));
    cfg.load = Load::Closed { concurrency: 3 };
    cfg.requests = Some(40);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 40, "{r}");
    assert_eq!(a.stats().responses_ok, 20, "every other request");
    assert_eq!(b.stats().responses_ok, 20, "every other request");
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

// Cache-sensitive workloads.

fn engine_config(model: &str) -> SimConfig {
    let mut c = SimConfig::new(Role::Both, Connector::None);
    c.model = model.to_owned();
    c.cache.block_size = 16;
    c
}

fn trace_cfg(url: String, kind: WorkloadKind) -> Config {
    let mut cfg = Config::new(Target::Url(url.clone()));
    cfg.trace = TraceSpec::new(kind);
    cfg.trace.groups = 4;
    cfg.trace.prompts_per_group = 5;
    cfg.trace.system_len = 200;
    cfg.trace.question_len = 20;
    cfg.trace.sessions = 3;
    cfg.trace.turns = 4;
    cfg.requests = None;
    cfg.output_len = pdbench::dist::Dist::Fixed(8);
    cfg.load = Load::Closed { concurrency: 2 };
    cfg.engine_metrics = vec![url];
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_hits_close_to_the_oracle_and_model_is_learnt() {
    let engine = pdsim::spawn(engine_config("served-name"))
        .await
        .expect("pdsim");
    for api in [Api::Completions, Api::Chat] {
        let mut cfg = trace_cfg(engine.base_url(), WorkloadKind::SharedPrefix);
        cfg.api = api;
        // One client: each request sees every earlier one cached, as the oracle assumes.
        cfg.load = Load::Closed { concurrency: 1 };
        if api == Api::Chat {
            cfg.trace.order = Order::Sequential;
        }
        let r = run(&cfg).await;
        assert_eq!(r.errors_by_class, Default::default(), "{r}");
        assert_eq!(r.ok, 20, "the trace is the bound");
        assert_eq!(r.model, "served-name", "from /v1/models");
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let oracle = r.oracle.as_ref().expect("oracle");
        // 4 groups x 4 later prompts reuse the ~200-token system prompt of ~222.
        assert!(oracle.hit_share > 0.6, "{r}");
        assert_eq!(
            oracle.prompt_tokens, r.usage_prompt_tokens,
            "same token model"
        );
        let cached = r.cached_share.expect("cached_tokens in usage");
        // One engine with a large cache reaches the oracle (the chat run shares no block with
        // the completions run: its role markers shift every block).
        assert!(
            (cached - oracle.hit_share).abs() < 0.02,
            "cached {cached} vs oracle {}",
            oracle.hit_share
        );
        let e = r.engines.as_ref().expect("engine metrics");
        assert!((e.hit_share - cached).abs() < 0.02, "{r}");
        assert!(e.prefill_computed_tokens > 0.0);
        assert!(e.prefill_computed_tokens < r.usage_prompt_tokens as f64 * 0.5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_control_reports_no_reuse() {
    let engine = pdsim::spawn(engine_config("pdsim")).await.expect("pdsim");
    let mut cfg = trace_cfg(engine.base_url(), WorkloadKind::Random);
    cfg.requests = Some(15);
    cfg.trace.random_count = Some(15);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 15, "{r}");
    assert_eq!(r.oracle.as_ref().expect("oracle").reusable_tokens, 0);
    assert!(r.cached_share.expect("usage") < 0.01, "{r}");
    let e = r.engines.as_ref().expect("engine metrics");
    assert_eq!(e.prefix_cache_hits, 0.0);
    assert_eq!(e.prefill_computed_tokens, r.usage_prompt_tokens as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_sends_the_history_with_answers() {
    let engine = pdsim::spawn(engine_config("pdsim")).await.expect("pdsim");
    let mut cfg = trace_cfg(engine.base_url(), WorkloadKind::MultiTurn);
    cfg.api = Api::Completions; // multi-turn switches to chat by itself
    cfg.trace.system_len = 40;
    cfg.trace.question_len = 10;
    cfg.load = Load::Closed { concurrency: 3 };
    let r = run(&cfg).await;
    assert_eq!(r.errors_by_class, Default::default(), "{r}");
    assert_eq!(r.ok, 12);
    assert_eq!(engine.stats().requests.chat_completions, 12, "chat route");
    let recent: Vec<serde_json::Value> = engine
        .stats()
        .recent_requests
        .iter()
        .map(|r| serde_json::from_str(&r.body).expect("json body"))
        .collect();
    let longest = recent
        .iter()
        .filter_map(|b| b["messages"].as_array().map(Vec::len))
        .max()
        .expect("chat bodies");
    // system + 3 (user, assistant) pairs + the new user message.
    assert_eq!(longest, 8);
    let last = recent
        .iter()
        .find(|b| b["messages"].as_array().map(Vec::len) == Some(8))
        .expect("a 4th turn");
    assert_eq!(last["messages"][2]["role"], "assistant");
    let assistant = last["messages"][2]["content"].as_str().expect("answer");
    assert!(!assistant.is_empty(), "the answer joins the history");
    let oracle = r.oracle.as_ref().expect("oracle");
    assert!(oracle.hit_share > 0.3, "{r}");
    let cached = r.cached_share.expect("usage");
    // The engine also caches generated tokens, which the oracle does not count.
    assert!(
        cached + 0.02 >= oracle.hit_share,
        "cached {cached} vs {}",
        oracle.hit_share
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_keep_a_sample_error_and_the_model_falls_back() {
    let mut c = engine_config("demo");
    c.faults.error_rate = 1.0;
    c.faults.error_status = 503;
    let engine = pdsim::spawn(c).await.expect("pdsim");
    let mut cfg = Config::new(Target::Url(engine.base_url()));
    cfg.model = Some("wrong".into());
    cfg.requests = Some(5);
    let r = run(&cfg).await;
    assert_eq!(r.ok, 0);
    let sample = r.sample_error.as_deref().expect("sample error");
    assert!(
        sample.starts_with("404") || sample.starts_with("503"),
        "{sample}"
    );
    assert!(sample.contains("error"), "{sample}");
    assert!(sample.len() <= 300 + 40);
    assert!(format!("{r}").contains("sample    "), "{r}");

    // A target without /v1/models: the old default, with a warning.
    let bare = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", bare.local_addr().expect("addr"));
    let app = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async { "{\"usage\":{\"completion_tokens\":1}}" }),
    );
    tokio::spawn(async move { axum::serve(bare, app).await });
    let mut cfg = Config::new(Target::Url(url));
    cfg.requests = Some(2);
    let r = run(&cfg).await;
    assert_eq!(r.model, "pdsim");
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(r.warnings[0].contains("/v1/models"));
}
