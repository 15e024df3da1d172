//! Cache-aware routing's hit share against the oracle, through real sockets: two pdsim prefills
//! and two pdsim decodes (shfs) whose prefix caches each hold only part of the trace's working
//! set, the real gateway in front, pdbench replaying its `shared-prefix` and `multi-turn`
//! traces. `cache_aware` must reach at least 90% of the oracle's hit share where round robin
//! stays at or below 60% of it. Every arm prints its row (run with `--nocapture` to see the
//! table).

mod common;

use std::time::Duration;

use common::{MODEL, WordTokenizer, sim};
use pdbench::trace::{Prompt, TraceQueue};
use pdbench::{Api, Load, Report, Target, TraceSpec, WorkloadKind};
use pdsim::{Connector, KvEventsConfig, LatencyModel, Role, SimConfig};
use tokio_util::sync::CancellationToken;

const BLOCK: usize = 16;

/// How the gateway routes in one arm.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Arm {
    RoundRobin,
    LeastRequest,
    /// `cache_aware` on both roles, keys from the text (no events).
    Approximate,
    /// `cache_aware` on both roles, engines publish KV events, the gateway tokenizes.
    Precise,
    /// As `Precise`, and the decode serves alone when at most 64 tokens are uncached there.
    PreciseDecodeOnly,
    /// Engines publish KV events and the gateway has no tokenizer configured: its keys come
    /// from the engines' `/tokenize` (`cache.engine_tokenize`, on by default with events).
    PreciseEngineTokens,
}

impl Arm {
    fn policy(self) -> &'static str {
        match self {
            Arm::RoundRobin => "round_robin",
            Arm::LeastRequest => "least_request",
            _ => "cache_aware",
        }
    }

    fn precise(self) -> bool {
        matches!(
            self,
            Arm::Precise | Arm::PreciseDecodeOnly | Arm::PreciseEngineTokens
        )
    }
}

fn spec(kind: WorkloadKind) -> TraceSpec {
    let mut t = TraceSpec::new(kind);
    // Odd counts: round robin over two endpoints does not pin groups by accident.
    t.groups = 7;
    t.prompts_per_group = 6;
    t.sessions = 5;
    t.turns = 4;
    if kind == WorkloadKind::MultiTurn {
        // Long turns: a session's turn before last shares little of the next prompt, so an
        // endpoint that saw only every other turn gains little.
        t.system_len = 64;
        t.question_len = 128;
    } else {
        t.system_len = 512;
        t.question_len = 32;
    }
    t
}

/// Every word of the trace (for a tokenizer that knows them all).
fn words_of(spec: &TraceSpec) -> Vec<String> {
    let q = TraceQueue::new(spec, Api::Completions);
    let mut words = std::collections::BTreeSet::new();
    while let Ok(Some(item)) = q.try_next() {
        if let Prompt::Text(t) = &item.prompt {
            words.extend(t.split_whitespace().map(str::to_string));
        }
        q.done(&item, None);
    }
    words.into_iter().collect()
}

fn engine(role: Role, blocks: usize, arm: Arm, tok: Option<&WordTokenizer>) -> SimConfig {
    let mut c = sim(role, Connector::Shfs);
    c.cache.block_size = BLOCK as u32;
    c.cache.kv_cache_blocks = blocks;
    c.cache.tokenizer = tok.map(|t| t.path.clone());
    // Prefill time per uncached prompt token, so TTFT shows what the cache saved (a prompt of
    // the shared-prefix trace, ~545 tokens, takes ~55 ms uncached).
    c.latency = LatencyModel {
        prefill_per_token: Duration::from_micros(100),
        ttft: Duration::from_millis(1),
        itl: Duration::ZERO,
        slots: 0,
    };
    if arm.precise() {
        c.kv_events = KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: common::ipc("pub"),
            replay_endpoint: Some(common::ipc("replay")),
            ..KvEventsConfig::default()
        };
    }
    c
}

/// One arm: a fresh fleet (cold caches of `blocks` blocks per engine), the whole trace.
async fn run(kind: WorkloadKind, arm: Arm, blocks: usize) -> Report {
    run_spread(spec(kind), arm, blocks, 1).await.0
}

/// [`run`] with `clients` concurrent clients, also returning how many requests each prefill
/// served.
async fn run_spread(
    spec: TraceSpec,
    arm: Arm,
    blocks: usize,
    clients: usize,
) -> (Report, Vec<u64>) {
    let kind = spec.kind;
    let tok = arm
        .precise()
        .then(|| WordTokenizer::new(words_of(&spec).iter().map(String::as_str)));
    let tok = tok.as_ref();
    let prefill = vec![
        engine(Role::Prefill, blocks, arm, tok),
        engine(Role::Prefill, blocks, arm, tok),
    ];
    let decode = vec![
        engine(Role::Decode, blocks, arm, tok),
        engine(Role::Decode, blocks, arm, tok),
    ];
    let events = common::subscriptions(&prefill, &decode);
    let tokenizer = tok
        .filter(|_| arm != Arm::PreciseEngineTokens)
        .map(|t| t.path.clone());
    let fleet = common::start(prefill, decode, |c| {
        c.policy.prefill_policy = arm.policy().into();
        c.policy.decode_policy = arm.policy().into();
        c.cache.block_size = BLOCK;
        c.cache.tokenizer = tokenizer;
        // Approximate mode models each engine's capacity (precise mode sees its evictions)
        // from the KV blocks the engine's metrics report, scraped by default: nothing here
        // names it.
        if arm == Arm::PreciseDecodeOnly {
            c.cache.decode_only_below_tokens = 64;
        }
        if arm.precise() {
            for (ep, (events, replay)) in
                c.prefill.iter_mut().chain(c.decode.iter_mut()).zip(&events)
            {
                ep.kv_events = Some(events.clone());
                ep.kv_events_replay = replay.clone();
            }
        }
    })
    .await;
    let mut cfg = pdbench::Config::new(Target::Url(fleet.gateway.base_url()));
    cfg.api = Api::Completions;
    cfg.model = Some(MODEL.into());
    cfg.trace = spec;
    cfg.requests = None;
    cfg.oracle_block_size = BLOCK;
    cfg.oracle_limit = Some((2, blocks));
    cfg.engine_metrics = fleet.prefill.iter().map(|e| e.base_url()).collect();
    cfg.output_len = pdbench::dist::Dist::Fixed(4);
    // Streamed, so TTFT is measured (the usage comes in the final chunk). pdsim's prefill time
    // is per uncached prompt token (100 us by default, plus a fixed 20 ms): TTFT shows the hits.
    cfg.stream = true;
    // With one client a request's place in the sequence does not depend on timing, so round
    // robin's share (which engine a prompt's group lands on) does not vary from run to run.
    cfg.load = Load::Closed {
        concurrency: clients,
    };
    cfg.timeout = Duration::from_secs(30);
    let report = tokio::time::timeout(
        Duration::from_secs(120),
        pdbench::run(&cfg, CancellationToken::new()),
    )
    .await
    .expect("the trace finishes")
    .expect("the run starts");
    assert_eq!(report.errors, 0, "{report}");
    let oracle = report.oracle.as_ref().expect("oracle");
    let cached = report.cached_share.expect("cached_tokens in usage");
    let engines = report.engines.as_ref().expect("prefill metrics");
    let per_prefill: Vec<u64> = fleet
        .prefill
        .iter()
        .map(|e| {
            let r = e.stats().requests;
            r.completions + r.chat_completions
        })
        .collect();
    let prefill_requests: u64 = per_prefill.iter().sum();
    let metrics = fleet.metrics().await;
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let predicted = counter(r#"pdgate_cache_predicted_cached_tokens_total{role="prefill"} "#);
    let prefill_hits: u64 = fleet
        .prefill
        .iter()
        .map(|e| e.stats().prefix_cache_hits)
        .sum();
    let ttft = report.ttft_ms.expect("streamed: TTFT measured");
    eprintln!(
        "| {kind:?} | {arm:?} | cached {:.1}% | oracle {:.1}% (per-engine LRU {:.1}%) | {:.0}% of oracle | prefill hit {:.1}% | prefill tokens computed {:.0} | TTFT p50 {:.1} ms | TTFT p95 {:.1} ms | {:.1} req/s | prefill legs {prefill_requests} of {} | predicted/actual prefill hits {predicted}/{prefill_hits} |",
        cached * 100.0,
        oracle.hit_share * 100.0,
        oracle.limited.as_ref().map_or(0.0, |l| l.hit_share * 100.0),
        if oracle.hit_share > 0.0 {
            cached / oracle.hit_share * 100.0
        } else {
            100.0
        },
        engines.hit_share * 100.0,
        engines.prefill_computed_tokens,
        ttft.p50,
        ttft.p95,
        report.throughput_rps,
        report.ok,
    );
    if arm == Arm::Precise && clients == 1 {
        // Every prediction from events equals what the prefills then found cached. (With
        // concurrent clients a prompt may be predicted from a speculative entry while the
        // request that stores its blocks is still computing them.)
        assert_eq!(predicted, prefill_hits, "{metrics}");
    }
    if arm == Arm::PreciseDecodeOnly {
        let alone = counter(r#"pdgate_cache_decisions_total{role="decode",kind="decode_only"} "#);
        assert!(alone > 0, "{metrics}");
        assert_eq!(alone + prefill_requests, report.ok);
    }
    (report, per_prefill)
}

fn share_of_oracle(r: &Report) -> f64 {
    r.cached_share.expect("cached share") / r.oracle.as_ref().expect("oracle").hit_share
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_cache_aware_reaches_the_oracle_where_round_robin_does_not() {
    // 7 groups, each 32 shared blocks (+ 2 of its own per prompt): an engine of 144 blocks
    // keeps the shared blocks of 4 groups, not of all 7.
    let blocks = 144;
    let rr = run(WorkloadKind::SharedPrefix, Arm::RoundRobin, blocks).await;
    let lr = run(WorkloadKind::SharedPrefix, Arm::LeastRequest, blocks).await;
    let approx = run(WorkloadKind::SharedPrefix, Arm::Approximate, blocks).await;
    let precise = run(WorkloadKind::SharedPrefix, Arm::Precise, blocks).await;
    let alone = run(WorkloadKind::SharedPrefix, Arm::PreciseDecodeOnly, blocks).await;
    let engine_tokens = run(WorkloadKind::SharedPrefix, Arm::PreciseEngineTokens, blocks).await;
    eprintln!(
        "| shared prefix, 2 prefills x {blocks} blocks | of the oracle: round robin {:.3}, least request {:.3}, approximate {:.3}, precise {:.3}, precise + decode-only {:.3}, precise with no gateway tokenizer {:.3} |",
        share_of_oracle(&rr),
        share_of_oracle(&lr),
        share_of_oracle(&approx),
        share_of_oracle(&precise),
        share_of_oracle(&alone),
        share_of_oracle(&engine_tokens),
    );
    assert!(
        share_of_oracle(&rr) <= 0.6,
        "round robin {:.3}",
        share_of_oracle(&rr)
    );
    // Least request (one client: every choice a tie, drawn at random) scatters each group over
    // both engines too: reaching the oracle would take a draw that keeps nearly every group's
    // prompts on one engine.
    assert!(
        share_of_oracle(&lr) < 0.9,
        "least request {:.3}",
        share_of_oracle(&lr)
    );
    for (name, r) in [
        ("approximate", &approx),
        ("precise", &precise),
        ("precise + decode-only", &alone),
        ("precise, no gateway tokenizer", &engine_tokens),
    ] {
        assert!(
            share_of_oracle(r) >= 0.9,
            "{name} {:.3}",
            share_of_oracle(r)
        );
    }
    // Events without a configured tokenizer route as well as text keys do (within one prompt's
    // share of the trace).
    assert!(
        share_of_oracle(&engine_tokens) >= share_of_oracle(&approx) - 0.05,
        "no gateway tokenizer {:.3} vs approximate {:.3}",
        share_of_oracle(&engine_tokens),
        share_of_oracle(&approx)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_cache_aware_reaches_the_oracle_where_round_robin_does_not() {
    // 5 sessions of ~37 blocks at their last turn: an engine of 120 blocks holds 3, not all 5.
    let blocks = 120;
    let rr = run(WorkloadKind::MultiTurn, Arm::RoundRobin, blocks).await;
    let approx = run(WorkloadKind::MultiTurn, Arm::Approximate, blocks).await;
    assert!(
        share_of_oracle(&rr) <= 0.6,
        "round robin {:.3}",
        share_of_oracle(&rr)
    );
    assert!(
        share_of_oracle(&approx) >= 0.9,
        "approximate {:.3}",
        share_of_oracle(&approx)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_prompts_lose_nothing_against_least_request() {
    // The control: nothing to reuse. cache_aware must spread the misses like least_request.
    let (lr, lr_spread) = run_spread(spec(WorkloadKind::Random), Arm::LeastRequest, 144, 1).await;
    let (ca, ca_spread) = run_spread(spec(WorkloadKind::Random), Arm::Approximate, 144, 1).await;
    assert_eq!(ca.ok, lr.ok);
    assert!(
        ca.cached_share.unwrap_or(0.0) >= lr.cached_share.unwrap_or(0.0),
        "cache_aware {:?} vs least_request {:?}",
        ca.cached_share,
        lr.cached_share
    );
    eprintln!(
        "| Random control | cache_aware cached {:.1}% vs least_request {:.1}% | requests per prefill {ca_spread:?} vs {lr_spread:?} | TTFT p50 {:.1} vs {:.1} ms |",
        ca.cached_share.unwrap_or(0.0) * 100.0,
        lr.cached_share.unwrap_or(0.0) * 100.0,
        ca.ttft_ms.map_or(0.0, |t| t.p50),
        lr.ttft_ms.map_or(0.0, |t| t.p50),
    );
    for (name, spread) in [("least_request", &lr_spread), ("cache_aware", &ca_spread)] {
        let total: u64 = spread.iter().sum();
        assert!(
            spread.iter().all(|&n| n * 4 >= total),
            "{name} piled the misses up: {spread:?}"
        );
    }
}

/// The small-cache workload: 7 families of 14 shared blocks (224 tokens) and 2 of their own per
/// prompt, on prefills of 64 blocks each: 4 families fit in an engine, not 7. (An odd count:
/// with an even one, round robin over two prefills sends each family to one of them.)
fn small_cache_spec() -> TraceSpec {
    let mut t = TraceSpec::new(WorkloadKind::SharedPrefix);
    t.groups = 7;
    t.prompts_per_group = 6;
    t.system_len = 224;
    t.question_len = 32;
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_caches_hold_more_families_when_routing_partitions_them() {
    let blocks = 64;
    let share = |r: &Report| r.cached_share.expect("cached share");
    let rr = run_spread(small_cache_spec(), Arm::RoundRobin, blocks, 1)
        .await
        .0;
    let mut rows = vec![("round robin", share(&rr))];
    for (name, arm) in [
        ("approximate", Arm::Approximate),
        ("precise", Arm::Precise),
        ("precise, no gateway tokenizer", Arm::PreciseEngineTokens),
    ] {
        let (r, mut spread) = run_spread(small_cache_spec(), arm, blocks, 1).await;
        // Partitioned: one prefill holds 4 families, the other 3 (24 and 18 prompts).
        spread.sort_unstable();
        assert_eq!(spread, [18, 24], "{name}: families split across prefills");
        rows.push((name, share(&r)));
    }
    eprintln!("| small caches, 2 prefills x {blocks} blocks, hit share | {rows:?} |");
    // Round robin alternates each family between the prefills: both would need all 7.
    assert!(share(&rr) < 0.2, "{rows:?}");
    for (name, s) in &rows[1..] {
        assert!(*s >= 0.7, "{name}: {rows:?}");
    }
}

/// The same workload from four concurrent clients: a prefill holding a family often has
/// requests in flight when the family's next prompt arrives. Weighed by predicted time (its
/// queued tokens, not its request count) and with full caches paying for what they would
/// evict, it keeps its families (figures in docs/benchmarks.md, "Small caches"). What is lost
/// is a family's second prompt sent elsewhere while its holder still computes the first round's
/// misses (the faster choice where engines queue; pdsim's engines here do not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_caches_keep_families_partitioned_under_concurrent_clients() {
    let (blocks, clients) = (64, 4);
    let share = |r: &Report| r.cached_share.expect("cached share");
    let rr = run_spread(small_cache_spec(), Arm::RoundRobin, blocks, clients)
        .await
        .0;
    let mut rows = vec![("round robin", share(&rr), Vec::new())];
    for (name, arm) in [
        ("approximate", Arm::Approximate),
        ("precise", Arm::Precise),
        ("precise, no gateway tokenizer", Arm::PreciseEngineTokens),
    ] {
        let (r, spread) = run_spread(small_cache_spec(), arm, blocks, clients).await;
        rows.push((name, share(&r), spread));
    }
    eprintln!("| small caches, {clients} clients, hit share, prefill spread | {rows:?} |");
    for (name, s, _) in &rows[1..] {
        assert!(*s >= 0.6 && *s >= rows[0].1 + 0.15, "{name}: {rows:?}");
    }
}
