//! LoRA adapters as routing constraints and cache spaces: pdsim engines holding different
//! adapters (`--lora-modules`, adapter-salted block hashes, `lora_name` in their KV events)
//! behind the real HTTP gateway. The gateway learns each engine's adapters from `/v1/models`,
//! sends an adapter's requests only to engines holding it, predicts each adapter's hits from
//! its own key space (the same token prefix under another adapter or the base model is no hit),
//! and follows adapters loaded and unloaded at run time.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::MODEL;
use pdgate::Config;
use pdsim::{Role, SimConfig, SimHandle};
use serde_json::{Value, json};

const BLOCK: u32 = 16;
const PREFIX: u32 = 256;
/// Token prefixes; each is asked under every model of [`MODELS`].
const PREFIXES: u32 = 6;
const QUESTIONS: u32 = 3;
/// The base model and three adapters.
const MODELS: [&str; 4] = [MODEL, "sql", "chat", "code"];
/// Adapters per engine: prefills, then decodes. Every adapter has a prefill and a decode, no
/// engine has every adapter.
const PREFILL_ADAPTERS: [&[&str]; 2] = [&["sql", "chat"], &["chat", "code"]];
const DECODE_ADAPTERS: [&[&str]; 2] = [&["sql", "code"], &["chat", "code"]];
/// The gateway's regular health round: a load is learned on the next one, an unload (an
/// engine's 404) on an early one.
const HEALTH_INTERVAL: Duration = Duration::from_secs(3);

/// An engine holding `adapters`, with a prefix cache (blocks of 16) publishing its KV events.
fn engine(role: Role, adapters: &[&str], tokenizer: &common::WordTokenizer) -> SimConfig {
    let mut c = common::event_engine(role, BLOCK, 4096, tokenizer);
    c.lora_modules = adapters
        .iter()
        .map(|a| ((*a).to_string(), format!("/adapters/{a}")))
        .collect();
    c
}

/// A prompt of token ids: prefix `p` (the same under every model), then 40 tokens of its own.
fn tokens(p: u32, model: usize, question: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..PREFIX).map(|i| 1000 + p * 997 + i).collect();
    t.extend((0..40).map(|i| 50_000 + p * 1009 + model as u32 * 211 + question * 41 + i));
    t
}

/// Every (prefix, model) group's questions in a fixed pseudo-random order (a seeded
/// Fisher-Yates shuffle), so the same prefix arrives under different models interleaved.
fn workload() -> Vec<(u32, usize, u32)> {
    let order: Vec<(u32, usize, u32)> = (0..PREFIXES)
        .flat_map(|p| (0..MODELS.len()).flat_map(move |m| (0..QUESTIONS).map(move |q| (p, m, q))))
        .collect();
    common::shuffled(order, 0x2545_f491_4f6c_dd1d)
}

async fn start(tok: &common::WordTokenizer) -> common::Fleet {
    let prefill: Vec<SimConfig> = PREFILL_ADAPTERS
        .iter()
        .map(|a| engine(Role::Prefill, a, tok))
        .collect();
    let decode: Vec<SimConfig> = DECODE_ADAPTERS
        .iter()
        .map(|a| engine(Role::Decode, a, tok))
        .collect();
    common::start_subscribed(prefill, decode, BLOCK as usize, move |c: &mut Config| {
        // Every request takes both legs: the prefill's prediction is checked on each.
        c.cache.decode_only_below_tokens = 0;
        c.health.health_check_interval = HEALTH_INTERVAL;
    })
    .await
}

/// The adapters the gateway lists, by name, with their base model.
async fn gateway_adapters(fleet: &common::Fleet) -> BTreeMap<String, String> {
    let v: Value = fleet
        .http
        .get(fleet.url("/v1/models"))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("models json");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| Some((m["id"].as_str()?.into(), m["parent"].as_str()?.into())))
        .collect()
}

/// Whether the gateway's routable snapshot has prefill `i` holding `adapter`.
fn prefill_holds(fleet: &common::Fleet, i: usize, adapter: &str) -> bool {
    let name = fleet.prefill[i].addr().to_string();
    let snap = fleet.gateway.gateway().store.load();
    snap.prefill
        .iter()
        .any(|p| p.name == name && p.adapters.own.iter().any(|a| a == adapter))
}

/// Polls `f` every 20 ms until it holds; how long that took, or `None` after `limit`.
async fn within(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f().await {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn hits(engines: &[SimHandle]) -> Vec<u64> {
    engines
        .iter()
        .map(|e| e.stats().prefix_cache_hits)
        .collect()
}

fn refused(fleet: &common::Fleet) -> u64 {
    fleet
        .prefill
        .iter()
        .chain(fleet.decode.iter())
        .map(|e| e.stats().model_not_found)
        .sum()
}

/// The engine of `engines` at `addr` (`host:port`).
fn engine_at(engines: &[SimHandle], addr: &str) -> usize {
    engines
        .iter()
        .position(|e| e.addr().to_string() == addr)
        .expect("a known engine")
}

async fn post(fleet: &common::Fleet, model: &str, prompt: &[u32]) -> reqwest::Response {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    fleet.post_bounded("/v1/completions", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_route_only_where_held_and_predictions_equal_hits() {
    let tok = common::WordTokenizer::new(["hello", "world"]);
    let fleet = start(&tok).await;
    let learned = within(Duration::from_secs(10), async || {
        gateway_adapters(&fleet).await.len() == 3
    })
    .await;
    assert!(learned.is_some(), "the gateway never listed the 3 adapters");
    assert_eq!(
        gateway_adapters(&fleet).await,
        [("chat", MODEL), ("code", MODEL), ("sql", MODEL)]
            .map(|(a, p)| (a.to_string(), p.to_string()))
            .into()
    );
    common::warm_subscriptions(&fleet, 1).await;

    let holds = |adapters: &[&[&str]], i: usize, model: &str| {
        model == MODEL || adapters[i].contains(&model)
    };
    let mut hit_tokens = 0u64;
    let mut mispredicted = Vec::new();
    let mut by_model: BTreeMap<&str, u64> = BTreeMap::new();
    for (p, m, q) in workload() {
        let model = MODELS[m];
        let before = hits(&fleet.prefill);
        let r = post(&fleet, model, &tokens(p, m, q)).await;
        assert_eq!(r.status(), 200, "prefix {p} model {model} question {q}");
        let header = |name: &str| r.headers()[name].to_str().expect("ascii").to_string();
        let predicted: u64 = header("x-pdgate-predicted-cached-tokens")
            .parse()
            .expect("a number");
        let (pt, dt) = (header("prefill-target-pod"), header("target-pod"));
        let body: Value = r.json().await.expect("body");
        assert_eq!(body["model"], model, "served under the adapter");
        let (pi, di) = (
            engine_at(&fleet.prefill, &pt),
            engine_at(&fleet.decode, &dt),
        );
        assert!(
            holds(&PREFILL_ADAPTERS, pi, model),
            "{model} sent to prefill {pi}"
        );
        assert!(
            holds(&DECODE_ADAPTERS, di, model),
            "{model} sent to decode {di}"
        );
        let after = hits(&fleet.prefill);
        let actual: u64 = after.iter().zip(&before).map(|(a, b)| a - b).sum();
        hit_tokens += actual;
        *by_model.entry(model).or_default() += actual;
        if predicted != actual {
            mispredicted.push(format!(
                "prefix {p} model {model} question {q} on {pt}: predicted {predicted}, hit {actual}"
            ));
        }
    }
    // The oracle: every question after a (prefix, model) group's first finds the whole prefix,
    // and nothing else (no model reuses another's blocks).
    let oracle = u64::from(PREFIXES * MODELS.len() as u32 * (QUESTIONS - 1) * PREFIX);
    let share = hit_tokens as f64 / oracle as f64;
    let refused_main = refused(&fleet);
    println!(
        "LoRA routing: hit share {share:.3} of the oracle ({hit_tokens} of {oracle} tokens), \
         {} mispredicted, {refused_main} refused by engines; hit tokens by model {by_model:?}",
        mispredicted.len()
    );
    assert!(
        mispredicted.is_empty(),
        "predictions differ from the engines' hits: {mispredicted:#?}"
    );
    assert_eq!(
        refused_main, 0,
        "a request reached an engine without its adapter"
    );
    assert!(share >= 0.9, "hit share {share:.3} of the oracle");
    let per_engine: Vec<BTreeMap<String, u64>> = fleet
        .prefill
        .iter()
        .chain(fleet.decode.iter())
        .map(|e| e.stats().lora_requests)
        .collect();
    println!("requests per adapter, prefills then decodes: {per_engine:?}");

    // An adapter for an unknown name, and one no decode holds, are vLLM's 404 at the gateway.
    let r = post(&fleet, "nope", &tokens(0, 0, 9)).await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.expect("error body");
    assert_eq!(v["error"]["type"], "NotFoundError", "{v}");

    // Run-time load: prefill 1 loads `sql`; the gateway learns it on its next round.
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let r = fleet
        .http
        .post(format!(
            "{}/v1/load_lora_adapter",
            fleet.prefill[1].base_url()
        ))
        .json(&load)
        .send()
        .await
        .expect("load");
    assert_eq!(r.status(), 200);
    let loaded_in = within(HEALTH_INTERVAL * 2, async || {
        prefill_holds(&fleet, 1, "sql")
    })
    .await
    .expect("the load learned within two health rounds");

    // Run-time unload: prefill 0 drops `sql`. Requests for prefixes it cached under `sql` still
    // go there until the gateway learns it; its first 404 asks for an early round, so they move
    // to prefill 1 well before the next regular one.
    let unload = json!({"lora_name": "sql"});
    let r = fleet
        .http
        .post(format!(
            "{}/v1/unload_lora_adapter",
            fleet.prefill[0].base_url()
        ))
        .json(&unload)
        .send()
        .await
        .expect("unload");
    assert_eq!(r.status(), 200);
    let before_p1 = fleet.prefill[1]
        .stats()
        .lora_requests
        .get("sql")
        .copied()
        .unwrap_or(0);
    let mut client_404s = 0u32;
    let mut n = 0u32;
    let moved_in = within(HEALTH_INTERVAL / 2, async || {
        n += 1;
        let r = post(&fleet, "sql", &tokens(n % PREFIXES, 1, 10 + n)).await;
        match r.status().as_u16() {
            200 => {
                let pt = r.headers()["prefill-target-pod"]
                    .to_str()
                    .expect("ascii")
                    .to_string();
                engine_at(&fleet.prefill, &pt) == 1
            }
            404 => {
                client_404s += 1;
                false
            }
            s => panic!("unexpected status {s}"),
        }
    })
    .await
    .expect("sql requests reach prefill 1 before the next regular health round");
    assert!(!prefill_holds(&fleet, 0, "sql"), "the unload was learned");
    let after_p1 = fleet.prefill[1].stats().lora_requests["sql"];
    assert!(after_p1 > before_p1);
    println!(
        "run-time adapters: load learned in {loaded_in:?}, unload learned and requests moved in \
         {moved_in:?} (health interval {HEALTH_INTERVAL:?}; {client_404s} request(s) answered \
         404 meanwhile)"
    );

    fleet.gateway.shutdown(Duration::from_secs(5)).await;
    for e in fleet.prefill.into_iter().chain(fleet.decode) {
        e.shutdown().await;
    }
}
