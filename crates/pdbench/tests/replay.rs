//! Trace replay (Mooncake format) through the real gateway: pdsim engines and pdgate on port 0,
//! pdbench replaying a hand-written trace open loop. Equal hash ids must give equal token blocks
//! in pdsim (the prefill's prefix-cache counters match a hand count exactly), every request
//! asks for its `output_length` tokens, and the report carries SLO attainment, the oracle and
//! each role's busy share. The Mooncake synthetic trace (`tests/fixtures/`) is read and its head
//! replayed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvtransfer::Registry;
use pdbench::metrics::EngineRole;
use pdbench::mooncake::Trace;
use pdbench::{Config, Load, Report, Slo, Target};
use pdgate::config::{Config as GatewayConfig, EndpointConfig};
use pdgate::{Gateway, RunningGateway};
use pdsim::{Connector, LatencyModel, Role, SimConfig, SimHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "m";

struct Fleet {
    prefill: Vec<SimHandle>,
    decode: Vec<SimHandle>,
    gateway: RunningGateway,
}

fn engine(role: Role) -> SimConfig {
    let mut c = SimConfig::new(role, Connector::Shfs);
    c.model = MODEL.into();
    c.cache.block_size = 16;
    // Fast engines: each request of the hand-written trace (500 ms apart) ends long before the
    // next is due, so which blocks are cached when a request arrives does not depend on timing.
    c.latency = LatencyModel {
        prefill_per_token: Duration::ZERO,
        ttft: Duration::from_millis(1),
        itl: Duration::from_millis(1),
        slots: 0,
    };
    c
}

fn endpoint(e: &SimHandle) -> EndpointConfig {
    let mut labels = std::collections::BTreeMap::new();
    labels.insert(
        kvtransfer::CONNECTOR_TYPE_IDENTIFIER.to_string(),
        Connector::Shfs.as_str().to_string(),
    );
    EndpointConfig {
        url: e.base_url(),
        model: Some(MODEL.into()),
        labels,
        bootstrap_port: e.bootstrap_port(),
        ..EndpointConfig::default()
    }
}

async fn fleet(prefills: usize, decodes: usize) -> Fleet {
    let mut config = GatewayConfig::default();
    let mut prefill = Vec::new();
    for _ in 0..prefills {
        let e = pdsim::spawn(engine(Role::Prefill)).await.expect("prefill");
        config.prefill.push(endpoint(&e));
        prefill.push(e);
    }
    let mut decode = Vec::new();
    for _ in 0..decodes {
        let e = pdsim::spawn(engine(Role::Decode)).await.expect("decode");
        config.decode.push(endpoint(&e));
        decode.push(e);
    }
    config.policy.prefill_policy = "round_robin".into();
    config.policy.decode_policy = "round_robin".into();
    let gw = Gateway::new(config, Registry::with_builtins()).expect("gateway config");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let pods = gw.config.pods().expect("pods");
    let gateway = RunningGateway::start(gw, listener, pods)
        .await
        .expect("gateway");
    let fleet = Fleet {
        prefill,
        decode,
        gateway,
    };
    wait_ready(&fleet).await;
    fleet
}

/// Polls the gateway's readiness (bounded).
async fn wait_ready(fleet: &Fleet) {
    let client = plain_client();
    let url = format!("{}/ready", fleet.gateway.base_url());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = pdbench::client::get(&client, &url).await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gateway not ready in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn plain_client() -> pdbench::client::HttpClient {
    pdbench::client::http_client(4)
}

fn replay_config(fleet: &Fleet, trace: Trace, rate_factor: f64) -> Config {
    let mut cfg = Config::new(Target::Url(fleet.gateway.base_url()));
    cfg.model = Some(MODEL.into());
    cfg.stream = true;
    cfg.requests = None;
    cfg.replay = Some(Arc::new(trace));
    cfg.load = Load::Replay {
        rate_factor,
        max_in_flight: 1000,
    };
    cfg.timeout = Duration::from_secs(60);
    cfg.oracle_block_size = 16;
    for (e, role) in fleet
        .prefill
        .iter()
        .map(|e| (e, EngineRole::Prefill))
        .chain(fleet.decode.iter().map(|e| (e, EngineRole::Decode)))
    {
        cfg.engine_metrics.push(e.base_url());
        cfg.engine_roles.push(Some(role));
    }
    cfg
}

async fn run(cfg: &Config) -> Report {
    tokio::time::timeout(
        Duration::from_secs(180),
        pdbench::run(cfg, CancellationToken::new()),
    )
    .await
    .expect("the replay ends")
    .expect("the replay starts")
}

fn tiny() -> Trace {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mooncake-tiny.jsonl");
    Trace::load(&path).expect("the hand-written trace")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_written_trace_through_the_gateway() {
    let fleet = fleet(1, 1).await;
    let mut cfg = replay_config(&fleet, tiny(), 1.0);
    cfg.slo = Slo {
        ttft: Some(Duration::from_secs(50)),
        // Below any real gap: no request meets it.
        itl: Some(Duration::from_nanos(1000)),
    };
    cfg.oracle_limit = Some((1, 64));
    let r = run(&cfg).await;
    println!("{r}");
    assert_eq!(r.errors_by_class, Default::default(), "{r}");
    assert_eq!(r.ok, 6, "{r}");
    assert_eq!(r.load, "replay");
    let replay = r.replay.as_ref().expect("replay info");
    assert_eq!((replay.requests_in_file, replay.requests_due), (6, 6));
    assert!((replay.span_s - 2.5).abs() < 1e-9);
    // max_tokens = output_length with ignore_eos: 4+6+3+5+2+3 tokens, so 3+5+2+4+1+2 gaps.
    assert_eq!(r.output_tokens, 23, "{r}");
    assert_eq!(r.itl_ms.expect("itl").count, 17);
    assert_eq!(r.ttft_ms.expect("ttft").count, 6);
    // Prompts are cut to input_length tokens (BOS + words).
    assert_eq!(r.usage_prompt_tokens, 1100 + 1300 + 700 + 1536 + 1000 + 300);

    // Equal ids, equal blocks: the prefill's cache hits, counted by hand in blocks of 16.
    // r1 shares ids 1,2 with r0: 1024 tokens. r3 repeats r0's ids; r0's third block was cut
    // at 1100 tokens, so r3 hits r0's 68 full blocks: 1088 tokens (the same words: a block's
    // text does not depend on where a request cuts it). r4 shares id 5 with r2: 512 tokens.
    let e = r.engines.as_ref().expect("engine metrics");
    let p = &e.engines[0];
    assert_eq!(p.role, Some(EngineRole::Prefill));
    assert_eq!(p.prefix_cache_hits, 1024.0 + 1088.0 + 512.0, "{r}");
    assert_eq!(p.prefix_cache_queries, 5936.0, "{r}");
    let share = e.prefill_hit_share.expect("prefill engines known");
    assert!((share - 2624.0 / 5936.0).abs() < 1e-9, "{r}");
    // The oracle (whole trace blocks, infinite cache) counts r3's three ids in full.
    let o = r.oracle.as_ref().expect("oracle");
    assert_eq!(o.prompt_tokens, 5936);
    assert_eq!(o.reusable_tokens, 1024 + 1536 + 512);
    assert!(share <= o.hit_share, "the engines stay within the oracle");
    let l = o.limited.as_ref().expect("capacity-bounded oracle");
    assert_eq!((l.engines, l.cache_blocks), (1, 64));
    assert!(l.reusable_tokens <= o.reusable_tokens);
    // Busy share: one engine per role is its own mean.
    let roles: Vec<&str> = e.balance.iter().map(|b| b.role.as_str()).collect();
    assert_eq!(roles, ["prefill", "decode"]);
    assert!(
        e.balance.iter().all(|b| b.max_over_mean == Some(1.0)),
        "{r}"
    );
    assert_eq!(e.balance[1].max, 23.0, "the decode generated every token");

    let slo = r.slo.as_ref().expect("slo");
    assert_eq!(slo.ttft_attainment, 1.0, "{r}");
    assert_eq!(slo.itl_attainment, 0.0, "{r}");
    assert_eq!(slo.attainment, 0.0);
    assert_eq!(slo.goodput_rps, 0.0);
    let json = serde_json::to_value(&r).expect("json");
    assert_eq!(json["slo"]["ttft_attainment"], 1.0);
    assert_eq!(json["replay"]["requests_due"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_scale_and_rate_factor_shape_the_replay() {
    let fleet = fleet(2, 2).await;
    let mut cfg = replay_config(&fleet, tiny(), 4.0);
    cfg.time_scale = 2.5;
    cfg.requests = Some(5);
    cfg.slo = Slo {
        ttft: Some(Duration::from_secs(50)),
        itl: Some(Duration::from_secs(50)),
    };
    let r = run(&cfg).await;
    println!("{r}");
    assert_eq!(r.ok, 5, "--requests cuts the trace: {r}");
    assert_eq!(r.replay.as_ref().expect("replay").requests_due, 5);
    // Reported durations are simulated: wall x time scale.
    assert!((r.elapsed_s - r.wall_s * 2.5).abs() < 1e-9, "{r}");
    // The last of 5 requests is due 2 s into the trace, i.e. 2 / (4 x 2.5) = 0.2 s of wall
    // time: the run cannot end before it.
    assert!(r.wall_s >= 0.2, "{r}");
    let slo = r.slo.as_ref().expect("slo");
    assert_eq!(slo.attainment, 1.0, "{r}");
    assert!((slo.goodput_rps - 5.0 / r.elapsed_s).abs() < 1e-9);
    // Round robin over two of each: both prefills and both decodes worked.
    let e = r.engines.as_ref().expect("engines");
    assert_eq!(e.engines.len(), 4);
    for b in &e.balance {
        assert_eq!(b.engines, 2);
        let x = b.max_over_mean.expect("work done");
        assert!((1.0..=2.0).contains(&x), "{b:?}");
    }
    // The oracle covers only the requests that came due.
    assert_eq!(
        r.oracle.as_ref().expect("oracle").prompt_tokens,
        1100 + 1300 + 700 + 1536 + 1000
    );
}

/// The synthetic trace (`tests/fixtures/mooncake-synthetic.jsonl.gz`), or `PDBENCH_MOONCAKE_TRACE`.
fn synthetic() -> Trace {
    let path = std::env::var_os("PDBENCH_MOONCAKE_TRACE").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mooncake-synthetic.jsonl.gz"),
        PathBuf::from,
    );
    Trace::load(&path).expect("the synthetic trace reads")
}

#[test]
fn synthetic_trace_reads_gzipped_with_its_documented_oracle() {
    let t = synthetic();
    // The fixtures' README: 3,993 requests over 1,022 s, mean input 15,325 tokens, oracle 0.651.
    assert_eq!(t.requests.len(), 3993);
    assert!((t.span_s() - 1022.0).abs() < 1.0, "{}", t.span_s());
    let mean = t
        .requests
        .iter()
        .map(|r| f64::from(r.input_length))
        .sum::<f64>()
        / t.requests.len() as f64;
    assert!((mean - 15_325.0).abs() < 1.0, "{mean}");
    let o = pdbench::mooncake::oracle(&t.requests, 16, Some((8, 1 << 20)));
    assert!((o.hit_share - 0.651).abs() < 0.0005, "{}", o.hit_share);
    // Caches large enough for everything, pinned by first id: below the shared infinite
    // cache (prefix trees that share later ids but not the first are split), above nothing.
    let l = o.limited.expect("limited");
    assert!(l.hit_share <= o.hit_share && l.hit_share > 0.3, "{l:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_trace_head_through_the_gateway() {
    let mut t = synthetic();
    t.requests.truncate(12);
    let fleet = fleet(2, 1).await;
    // The engines' context length, as they publish it.
    let models = format!("{}/v1/models", fleet.prefill[0].base_url());
    let (status, body) = pdbench::client::get(&plain_client(), &models)
        .await
        .expect("models");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let max_len = v["data"][0]["max_model_len"]
        .as_u64()
        .expect("max_model_len");
    let too_long = t
        .requests
        .iter()
        .filter(|r| u64::from(r.input_length) + u64::from(r.output_length) > max_len)
        .count();
    // Its first 12 requests span 2.8 s of trace time; 10x faster.
    let cfg = replay_config(&fleet, t, 10.0);
    let r = run(&cfg).await;
    println!("{r}");
    assert_eq!(r.requests, 12, "{r}");
    // Prompts longer than the engines' context are refused with a 4xx, everything else served.
    assert_eq!(r.ok as usize, 12 - too_long, "{r}");
    assert_eq!(
        r.errors_by_class.get("http_4xx").copied().unwrap_or(0) as usize,
        too_long,
        "{r}"
    );
}
