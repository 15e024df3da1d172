//! Cache-aware routing in precise mode: pdsim engines with prefix caches publish vLLM KV events
//! (over ipc sockets, so nothing listens beyond this machine), pdgate subscribes, and its
//! predictions must equal the engines' own prefix-cache hits.

mod common;

use std::time::Duration;

use common::MODEL;
use pdgate::Config;
use pdsim::{Faults, Role, SimConfig};
use serde_json::json;

/// An engine with a prefix cache of `blocks` blocks of 16 tokens publishing its KV events. Its
/// tokenizer is a Hugging Face one, so token-id prompts reach the cache untouched, as in vLLM
/// (pdsim's default word tokenizer puts a BOS before them).
fn engine(role: Role, blocks: usize, tokenizer: &common::WordTokenizer) -> SimConfig {
    common::event_engine(role, 16, blocks, tokenizer)
}

/// A prompt of token ids: a 256-token prefix per group, then 40 tokens of its own.
fn tokens(group: u32, question: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..256).map(|i| 1000 + group * 997 + i).collect();
    t.extend((0..40).map(|i| 50_000 + question * 41 + i));
    t
}

/// Two prefills and two decodes publishing events, a cache-aware gateway subscribed to them.
async fn start(tweak: impl FnOnce(&mut Config)) -> common::Fleet {
    start_n(2, 2, tweak).await
}

/// `prefills` prefills and `decodes` decodes publishing events (with replay), a cache-aware
/// gateway subscribed to them.
async fn start_n(
    prefills: usize,
    decodes: usize,
    tweak: impl FnOnce(&mut Config),
) -> common::Fleet {
    // Loaded when the engines start; removed once they have.
    let tok = common::WordTokenizer::new(["hello", "world"]);
    let prefill: Vec<SimConfig> = (0..prefills)
        .map(|_| engine(Role::Prefill, 4096, &tok))
        .collect();
    let decode: Vec<SimConfig> = (0..decodes)
        .map(|_| engine(Role::Decode, 4096, &tok))
        .collect();
    common::start_subscribed(prefill, decode, 16, tweak).await
}

fn prefill_hits(fleet: &common::Fleet) -> u64 {
    fleet
        .prefill
        .iter()
        .map(|e| e.stats().prefix_cache_hits)
        .sum()
}

/// Waits (bounded) until the gateway's subscriptions stored at least `blocks` blocks.
async fn wait_events(fleet: &common::Fleet, role: &str, blocks: u64) {
    wait_events_at(fleet, &fleet.gateway.base_url(), role, blocks).await;
}

async fn wait_events_at(fleet: &common::Fleet, base: &str, role: &str, blocks: u64) {
    let what = format!(r#"pdgate_cache_events{{role="{role}",what="blocks_stored"}}"#);
    wait_counter_at(fleet, base, &what, blocks).await;
}

/// A sample's value in Prometheus text (0 when absent).
fn sample(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (bounded) until the gateway's KV-event counter `what` of `role` reaches `at_least`.
async fn wait_event_count(fleet: &common::Fleet, role: &str, what: &str, at_least: u64) {
    let name = format!(r#"pdgate_cache_events{{role="{role}",what="{what}"}}"#);
    wait_counter(fleet, &name, at_least).await;
}

/// Waits (bounded) until the gateway's sample `name` (with its labels) reaches `at_least`.
async fn wait_counter(fleet: &common::Fleet, name: &str, at_least: u64) {
    wait_counter_at(fleet, &fleet.gateway.base_url(), name, at_least).await;
}

async fn wait_counter_at(fleet: &common::Fleet, base: &str, name: &str, at_least: u64) {
    let mut seen = 0;
    for _ in 0..100 {
        let m = fleet
            .http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics body");
        seen = sample(&m, name);
        if seen >= at_least {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{name} stayed at {seen}, below {at_least}");
}

/// Sends the prompt of `group`/`question`; returns (predicted cached tokens, the prefill's
/// actual prefix-cache hit, the prefill that served it).
async fn send(fleet: &common::Fleet, group: u32, question: u32) -> (u64, u64, String) {
    let body = json!({"model": MODEL, "prompt": tokens(group, question), "max_tokens": 4});
    let before = prefill_hits(fleet);
    let r = fleet.post_bounded("/v1/completions", &body).await;
    assert_eq!(r.status(), 200);
    let predicted = r.headers()["x-pdgate-predicted-cached-tokens"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("a number");
    let prefill = r.headers()["prefill-target-pod"]
        .to_str()
        .expect("ascii")
        .to_string();
    r.text().await.expect("body");
    (predicted, prefill_hits(fleet) - before, prefill)
}

/// Sends group-0 prompts until the gateway has seen a batch of each of `roles`: a subscriber
/// that joins after an engine published misses that batch (ZMQ's slow joiner), so a test that
/// needs an engine's sequence known waits for this first. (A decode's events are subscribed to
/// only where its cache is read: `decode_cache_weight`.)
async fn warm(fleet: &common::Fleet, roles: &[&str]) {
    for question in 0..50 {
        send(fleet, 0, question).await;
        let m = fleet.metrics().await;
        let seen = |role: &str| {
            sample(
                &m,
                &format!(r#"pdgate_cache_events{{role="{role}",what="batches"}}"#),
            ) > 0
        };
        if roles.iter().all(|r| seen(r)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the gateway never saw the engines' events");
}

fn set_event_faults(fleet: &common::Fleet, faults: &Faults) {
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        e.set_faults(faults.clone());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_equal_the_engines_hits_and_prefixes_stick() {
    let fleet = start(|_| {}).await;
    let mut exact = 0;
    let mut total = 0;
    let mut owner: std::collections::BTreeMap<u32, String> = Default::default();
    for q in 0..6 {
        for g in 0..4 {
            let body = json!({"model": MODEL, "prompt": tokens(g, q), "max_tokens": 4});
            let before = prefill_hits(&fleet);
            let r = fleet.post_bounded("/v1/completions", &body).await;
            assert_eq!(r.status(), 200);
            let predicted: u64 = r.headers()["x-pdgate-predicted-cached-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let prefill = r.headers()["prefill-target-pod"]
                .to_str()
                .unwrap()
                .to_string();
            r.text().await.unwrap();
            let actual = prefill_hits(&fleet) - before;
            total += 1;
            if predicted == actual {
                exact += 1;
            }
            if q > 0 {
                assert_eq!(owner[&g], prefill, "group {g} moved");
                assert!(actual > 0, "group {g} question {q} missed");
            }
            owner.entry(g).or_insert(prefill);
        }
    }
    assert!(
        exact * 100 >= total * 99,
        "{exact} of {total} predictions exact"
    );
    wait_events(&fleet, "prefill", 4 * 18).await;
    let m = fleet.metrics().await;
    // The decodes cached every prompt too, but a decode chosen by its load alone (the
    // default) is not subscribed to: its events would decide nothing (`two_gateways_...`
    // reads them, with a decode cache weight).
    let decode_blocks: u64 = fleet.decode.iter().map(|e| e.stats().cached_blocks).sum();
    assert!(
        decode_blocks >= 18,
        "the decodes cached {decode_blocks} blocks"
    );
    assert_eq!(
        sample(
            &m,
            r#"pdgate_cache_events{role="decode",what="blocks_stored"}"#
        ),
        0,
        "{m}"
    );
    assert!(m.contains(r#"pdgate_cache_event_lag_seconds{role="prefill",what="max"}"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_engine_cache_is_forgotten() {
    let fleet = start(|_| {}).await;
    let body = |q| json!({"model": MODEL, "prompt": tokens(9, q), "max_tokens": 4});
    let r = fleet.post_bounded("/v1/completions", &body(0)).await;
    let first = r.headers()["prefill-target-pod"]
        .to_str()
        .unwrap()
        .to_string();
    r.text().await.unwrap();
    wait_events(&fleet, "prefill", 18).await;
    // The prefill that served the prompt holds its blocks, the other none: what the index
    // learned came from `first`, and the clear below has something to forget.
    let holding = |e: &pdsim::SimHandle| e.stats().cached_blocks > 0;
    let (served, other): (Vec<_>, Vec<_>) = fleet
        .prefill
        .iter()
        .partition(|e| e.base_url().trim_start_matches("http://") == first);
    assert_eq!(served.len(), 1, "{first} is none of the prefills");
    assert!(holding(served[0]), "{first} cached nothing");
    assert!(
        !other.iter().any(|e| holding(e)),
        "the other prefill cached the prompt"
    );
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        e.reset_prefix_cache();
    }
    assert!(!holding(served[0]), "{first} kept its blocks");
    // Bounded wait until the gateway applied the clears; then nothing is predicted cached.
    let mut predicted = u64::MAX;
    for _ in 0..100 {
        let m = fleet.metrics().await;
        if m.contains(r#"pdgate_cache_index_entries{model="m"} 0"#) {
            predicted = 0;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(predicted, 0, "the index kept entries of cleared engines");
    let before = prefill_hits(&fleet);
    let r = fleet.post_bounded("/v1/completions", &body(1)).await;
    assert_eq!(r.headers()["x-pdgate-predicted-cached-tokens"], "0");
    r.text().await.unwrap();
    assert_eq!(prefill_hits(&fleet) - before, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_reading_the_same_events_agree() {
    // Decodes weigh the blocks they hold (by default a decode receiving the KV is chosen by its
    // load, which each gateway sees only for itself). What is compared is the index: the
    // engines' scraped load (which one gateway may read while the other's request is in
    // flight) is off.
    let fleet = start(|c| {
        c.cache.decode_cache_weight = 1.0;
        c.cache.engine_load_interval = Duration::ZERO;
    })
    .await;
    let config = fleet.gateway.gateway().config.clone();
    let gw = pdgate::Gateway::new(config, kvtransfer::Registry::with_builtins()).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let pods = gw.config.pods().expect("pods");
    let second = pdgate::RunningGateway::start(gw, listener, pods)
        .await
        .expect("second gateway");
    let post = |base: String, g: u32, q: u32| {
        let http = fleet.http.clone();
        async move {
            let body = json!({"model": MODEL, "prompt": tokens(g, q), "max_tokens": 4});
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .expect("request");
            assert_eq!(r.status(), 200);
            let pair = (
                r.headers()["prefill-target-pod"]
                    .to_str()
                    .unwrap()
                    .to_string(),
                r.headers()["target-pod"].to_str().unwrap().to_string(),
            );
            r.text().await.unwrap();
            pair
        }
    };
    let first = fleet.gateway.base_url();
    for g in 0..4 {
        post(first.clone(), g, 0).await;
    }
    // Both gateways have seen every engine's blocks (the second only through events).
    for base in [first.clone(), second.base_url()] {
        wait_events_at(&fleet, &base, "prefill", 4 * 18).await;
        wait_events_at(&fleet, &base, "decode", 4 * 18).await;
    }
    let mut agreed = 0;
    for g in 0..4 {
        let a = post(first.clone(), g, 1).await;
        let b = post(second.base_url(), g, 2).await;
        assert_eq!(a, b, "the gateways disagree on group {g}");
        agreed += 1;
    }
    eprintln!(
        "| Replica agreement | two gateways on the same KV events chose the same (prefill, decode) for {agreed} of 4 prefix groups |"
    );
}

// Recovery: the index follows the engines through restarts, lost events, stalls and departures.

/// Short speculative entries, so a test sees what the events alone say soon after a decision.
fn short_speculation(c: &mut Config) {
    c.cache.speculative_ttl = Duration::from_millis(100);
}

/// Longer than `short_speculation`'s TTL plus the index's expiry sweep period.
const PAST_SPECULATION: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_its_entries() {
    // The decode's cache weighs something, so its events are read too.
    let fleet = start_n(1, 1, |c| {
        short_speculation(c);
        c.cache.decode_cache_weight = 1.0;
    })
    .await;
    // A restart shows against a sequence already seen: every subscriber must have joined.
    warm(&fleet, &["prefill", "decode"]).await;
    let m = fleet.metrics().await;
    let stored =
        |role: &str| format!(r#"pdgate_cache_events{{role="{role}",what="blocks_stored"}}"#);
    let (p, d) = (
        sample(&m, &stored("prefill")),
        sample(&m, &stored("decode")),
    );
    send(&fleet, 1, 0).await;
    wait_counter(&fleet, &stored("prefill"), p + 18).await;
    wait_counter(&fleet, &stored("decode"), d + 18).await;
    for e in fleet.prefill.iter().chain(fleet.decode.iter()) {
        e.restart();
    }
    // The next batch each engine publishes starts at sequence 0 again: a restart.
    send(&fleet, 2, 0).await;
    wait_event_count(&fleet, "prefill", "restarts", 1).await;
    wait_event_count(&fleet, "decode", "restarts", 1).await;
    tokio::time::sleep(PAST_SPECULATION).await;
    let (predicted, actual, _) = send(&fleet, 1, 1).await;
    assert_eq!(
        (predicted, actual),
        (0, 0),
        "the restarted engine lost group 1"
    );
    // What the engine stored after its restart is known.
    let (predicted, actual, _) = send(&fleet, 2, 1).await;
    assert_eq!(predicted, actual);
    assert_eq!(actual, 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_gap_is_filled_from_the_replay_socket() {
    let fleet = start_n(1, 1, short_speculation).await;
    send(&fleet, 3, 0).await;
    wait_events(&fleet, "prefill", 18).await;
    // Group 4's batches are lost on the wire (their sequence numbers used, replay keeps them).
    set_event_faults(
        &fleet,
        &Faults {
            kv_events_drop_rate: 1.0,
            ..Faults::default()
        },
    );
    send(&fleet, 4, 0).await;
    set_event_faults(&fleet, &Faults::default());
    // Group 5's batch shows the gap; the subscriber replays the missed batch first.
    send(&fleet, 5, 0).await;
    wait_event_count(&fleet, "prefill", "gaps", 1).await;
    wait_event_count(&fleet, "prefill", "replays", 1).await;
    wait_events(&fleet, "prefill", 3 * 18).await;
    tokio::time::sleep(PAST_SPECULATION).await;
    let (predicted, actual, _) = send(&fleet, 4, 1).await;
    assert_eq!(actual, 256);
    assert_eq!(predicted, actual, "the replayed blocks are in the index");
    let m = fleet.metrics().await;
    assert_eq!(
        sample(&m, r#"pdgate_cache_events{role="prefill",what="clears"}"#),
        0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_that_stop_fall_back_to_approximate_entries_until_they_resume() {
    let fleet = start_n(1, 1, |c| {
        short_speculation(c);
        c.cache.events_timeout = Duration::from_millis(50);
    })
    .await;
    send(&fleet, 6, 0).await;
    wait_events(&fleet, "prefill", 18).await;
    let stall = Faults {
        kv_events_stall: true,
        ..Faults::default()
    };
    set_event_faults(&fleet, &stall);
    // Sent while the events are stalled: its speculative entries expire unconfirmed.
    send(&fleet, 7, 0).await;
    tokio::time::sleep(PAST_SPECULATION).await;
    // No batch since a decision that stored blocks: the endpoints go approximate.
    send(&fleet, 7, 1).await;
    let stopped = r#"pdgate_cache_events_stopped_total{role="prefill"}"#;
    wait_counter(&fleet, stopped, 1).await;
    tokio::time::sleep(PAST_SPECULATION).await;
    // The approximate entries outlive the speculative ones: group 7 is still known.
    let (predicted, actual, _) = send(&fleet, 7, 2).await;
    assert_eq!(actual, 256);
    assert_eq!(predicted, actual);
    // The stall ends: the queued batches arrive, and the endpoints are precise again.
    set_event_faults(&fleet, &Faults::default());
    send(&fleet, 8, 0).await;
    // Groups 6, 7 and 8 (18 blocks each) and the two question blocks of 7's later prompts.
    wait_events(&fleet, "prefill", 3 * 18 + 2 + 2).await;
    tokio::time::sleep(PAST_SPECULATION).await;
    let (predicted, actual, _) = send(&fleet, 8, 1).await;
    assert_eq!((predicted, actual), (256, 256));
    let m = fleet.metrics().await;
    assert_eq!(sample(&m, stopped), 1, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_leaves_is_purged() {
    let fleet = start(short_speculation).await;
    let (_, _, owner) = send(&fleet, 9, 0).await;
    wait_events(&fleet, "prefill", 18).await;
    let entries = r#"pdgate_cache_index_entries{model="m"}"#;
    let before = sample(&fleet.metrics().await, entries);
    let all = fleet.gateway.gateway().config.pods().expect("pods");
    let port: u16 = owner
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port");
    let rest: Vec<kvtransfer::Pod> = all
        .iter()
        .filter(|p| p.http_port != port)
        .cloned()
        .collect();
    fleet
        .gateway
        .pods()
        .send(std::sync::Arc::new(rest))
        .expect("discovery");
    let mut after = before;
    for _ in 0..100 {
        after = sample(&fleet.metrics().await, entries);
        if after < before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its 18 event-confirmed blocks went with it (the decodes' events are not read).
    assert_eq!(before - after, 18, "{before} -> {after}");
    // The remaining prefill never held group 9: nothing is predicted there.
    let (predicted, actual, prefill) = send(&fleet, 9, 1).await;
    assert_ne!(prefill, owner);
    assert_eq!((predicted, actual), (0, 0));
}

/// A text prompt of the engines' two words: a 256-word prefix per group, then 40 words of
/// the question's own.
fn words(group: u32, question: u32) -> String {
    let prefix = (0..256).map(|i| (i / (group + 1)).is_multiple_of(2));
    let own = (0..40).map(|i| i <= question);
    let words: Vec<&str> = prefix
        .chain(own)
        .map(|hello| if hello { "hello" } else { "world" })
        .collect();
    words.join(" ")
}

/// Events carry the engines' token blocks, so a text prompt matches them only when the gateway
/// keys it by the same tokens. With no tokenizer configured and `engine_tokenize` left unset,
/// the gateway asks an engine's `/tokenize` for the models that have events: predictions are
/// exact with no tuning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_match_events_with_no_tokenizer_configured() {
    let fleet = start(|c| assert_eq!(c.cache.engine_tokenize, None, "the default")).await;
    warm(&fleet, &["prefill"]).await;
    let stored = r#"pdgate_cache_events{role="prefill",what="blocks_stored"}"#;
    let (mut exact, mut hits) = (0, 0);
    for q in 0..4 {
        for g in 0..2 {
            let body = json!({"model": MODEL, "prompt": words(g, q), "max_tokens": 4});
            let seen = sample(&fleet.metrics().await, stored);
            let before = prefill_hits(&fleet);
            let r = fleet.post_bounded("/v1/completions", &body).await;
            assert_eq!(r.status(), 200);
            let predicted: u64 = r.headers()["x-pdgate-predicted-cached-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            r.text().await.unwrap();
            let actual = prefill_hits(&fleet) - before;
            if q > 0 {
                assert!(actual >= 256, "group {g} question {q}: only {actual} hit");
                hits += 1;
                exact += u32::from(predicted == actual);
            }
            // Each prompt stores at least its question's own blocks: the next decision sees them.
            wait_counter(&fleet, stored, seen + 1).await;
        }
    }
    assert_eq!(
        exact, hits,
        "{exact} of {hits} predictions equal the engines' hits"
    );
}
