//! Shared harness: pdsim engines on port 0 and a pdgate in front of them, all in-process.
#![allow(dead_code)]

pub mod envoy;

use std::collections::BTreeMap;
use std::time::Duration;

use pdgate::config::{Config, EndpointConfig};
use pdgate::{Gateway, RunningGateway};
use pdsim::{Connector, Role, SimConfig, SimHandle};
use serde_json::{Value, json};
use tokio::net::TcpListener;

pub const MODEL: &str = "m";

pub struct Fleet {
    pub prefill: Vec<SimHandle>,
    pub decode: Vec<SimHandle>,
    pub gateway: RunningGateway,
    pub http: reqwest::Client,
}

pub fn sim(role: Role, connector: Connector) -> SimConfig {
    let mut c = SimConfig::new(role, connector);
    c.model = MODEL.to_string();
    c
}

pub fn endpoint_for(engine: &SimHandle, connector: Option<Connector>) -> EndpointConfig {
    let mut labels = BTreeMap::new();
    if let Some(c) = connector {
        labels.insert(
            kvtransfer::CONNECTOR_TYPE_IDENTIFIER.to_string(),
            c.as_str().to_string(),
        );
    }
    // Connectors whose legs name their peer: the port the peer dials is where pdsim serves KV.
    let mut annotations = BTreeMap::new();
    if let Some(port) = engine.side_channel_port() {
        let key = match connector {
            Some(Connector::P2pNccl) => Some(kvtransfer::P2P_NCCL_KV_PORT),
            Some(Connector::Moriio | Connector::MoriioRead) => {
                Some(kvtransfer::MORIIO_HANDSHAKE_PORT)
            }
            _ => None,
        };
        if let Some(key) = key {
            annotations.insert(key.to_string(), port.to_string());
        }
    }
    EndpointConfig {
        url: engine.base_url(),
        model: Some(MODEL.to_string()),
        labels,
        annotations,
        bootstrap_port: engine.bootstrap_port(),
        ..EndpointConfig::default()
    }
}

/// Starts the given engines, and a configuration naming each with its connector label.
pub async fn engines(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
) -> (Config, Vec<SimHandle>, Vec<SimHandle>) {
    let mut config = Config::default();
    let mut p = Vec::new();
    for c in prefill {
        let connector = c.connector;
        let e = pdsim::spawn(c).await.expect("prefill engine");
        config.prefill.push(endpoint_for(&e, Some(connector)));
        p.push(e);
    }
    let mut d = Vec::new();
    for c in decode {
        let connector = c.connector;
        let e = pdsim::spawn(c).await.expect("decode engine");
        config.decode.push(endpoint_for(&e, Some(connector)));
        d.push(e);
    }
    (config, p, d)
}

/// A fresh `ipc://` endpoint in the temp dir (KV-event publishers and replay sockets: nothing
/// listens beyond this machine).
pub fn ipc(tag: &str) -> String {
    format!(
        "ipc://{}/pdgate-test-{}-{tag}.sock",
        std::env::temp_dir().display(),
        uuid::Uuid::new_v4().simple()
    )
}

/// A shfs engine with a prefix cache of `blocks` blocks of `block_size` tokens, keyed by
/// `tokenizer` (a Hugging Face one, so token-id prompts reach the cache untouched, as in vLLM),
/// publishing its KV events (with replay) on ipc sockets.
pub fn event_engine(
    role: Role,
    block_size: u32,
    blocks: usize,
    tokenizer: &WordTokenizer,
) -> SimConfig {
    let mut c = sim(role, Connector::Shfs);
    c.cache.block_size = block_size;
    c.cache.tokenizer = Some(tokenizer.path.clone());
    c.cache.kv_cache_blocks = blocks;
    c.kv_events = pdsim::KvEventsConfig {
        enable_kv_cache_events: true,
        endpoint: ipc("pub"),
        replay_endpoint: Some(ipc("replay")),
        ..pdsim::KvEventsConfig::default()
    };
    c
}

/// Each engine's KV-event endpoint and replay endpoint, prefills then decodes (the order of the
/// gateway config's endpoints).
pub fn subscriptions(prefill: &[SimConfig], decode: &[SimConfig]) -> Vec<(String, Option<String>)> {
    prefill
        .iter()
        .chain(decode)
        .map(|c| {
            (
                c.kv_events.endpoint.clone(),
                c.kv_events.replay_endpoint.clone(),
            )
        })
        .collect()
}

/// Starts the given engines and a cache-aware gateway (both roles, blocks of `block_size`)
/// subscribed to each engine's KV events and replay; `tweak` adjusts the rest of its config.
pub async fn start_subscribed(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    block_size: usize,
    tweak: impl FnOnce(&mut Config),
) -> Fleet {
    let events = subscriptions(&prefill, &decode);
    start(prefill, decode, move |c| {
        c.policy.prefill_policy = "cache_aware".into();
        c.policy.decode_policy = "cache_aware".into();
        c.cache.block_size = block_size;
        let eps = c.prefill.iter_mut().chain(c.decode.iter_mut());
        for (ep, (events, replay)) in eps.zip(events) {
            ep.kv_events = Some(events);
            ep.kv_events_replay = replay;
        }
        tweak(c);
    })
    .await
}

/// Lets every subscription see its publisher's stream: two rounds of a throwaway prompt sent
/// straight to each engine, to each of its `ranks` data-parallel ranks (`X-data-parallel-rank`)
/// when it has more than one (ZMQ drops what a late subscriber missed; the second batch of a
/// publisher makes the gateway replay the first).
pub async fn warm_subscriptions(fleet: &Fleet, ranks: u32) {
    let engines: Vec<&SimHandle> = fleet.prefill.iter().chain(fleet.decode.iter()).collect();
    for round in 0..2u32 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for (i, e) in engines.iter().enumerate() {
            for rank in 0..ranks {
                let prompt: Vec<u32> = (0..32).map(|t| 900_000 + round * 100 + t).collect();
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
                let mut post = fleet.http.post(format!("{}/v1/completions", e.base_url()));
                if ranks > 1 {
                    post = post.header("x-data-parallel-rank", rank.to_string());
                }
                let r = post.json(&body).send().await.expect("warm-up request");
                assert_eq!(r.status(), 200, "engine {i} rank {rank}");
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// `items` in a fixed pseudo-random order: a Fisher-Yates shuffle driven by a 64-bit LCG from
/// `seed` (workloads whose groups arrive interleaved, the same in every run).
pub fn shuffled<T>(mut items: Vec<T>, mut seed: u64) -> Vec<T> {
    for i in (1..items.len()).rev() {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = (seed >> 33) as usize % (i + 1);
        items.swap(i, j);
    }
    items
}

/// Starts the given engines and a gateway; waits until the gateway is ready (bounded).
pub async fn start(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    tweak: impl FnOnce(&mut Config),
) -> Fleet {
    let fleet = start_unready(prefill, decode, tweak).await;
    fleet.wait_ready(true).await;
    fleet
}

/// Like [`start`], without waiting for readiness (for fleets that are never ready).
pub async fn start_unready(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    tweak: impl FnOnce(&mut Config),
) -> Fleet {
    launch(prefill, decode, tweak, None).await
}

/// Like [`start`], pdgate serving as Envoy's external processor: `gateway.addr()` serves the
/// ext_proc service (gRPC) and the operational routes (`/ready`, `/metrics`).
pub async fn start_ext_proc(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    tweak: impl FnOnce(&mut Config),
    options: pdgate::ExtProcOptions,
) -> Fleet {
    let fleet = launch(prefill, decode, tweak, Some(options)).await;
    fleet.wait_ready(true).await;
    fleet
}

/// The engines and a gateway in front of them: the proxy, or the external processor when
/// `ext_proc` carries its options.
async fn launch(
    prefill: Vec<SimConfig>,
    decode: Vec<SimConfig>,
    tweak: impl FnOnce(&mut Config),
    ext_proc: Option<pdgate::ExtProcOptions>,
) -> Fleet {
    let (mut config, p, d) = engines(prefill, decode).await;
    // The suites assert on who served what.
    config.security.expose_target_headers = true;
    tweak(&mut config);
    let gw = Gateway::new(config, kvtransfer::Registry::with_builtins()).expect("config");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let pods = gw.config.pods().expect("pods");
    let gateway = match ext_proc {
        None => RunningGateway::start(gw, listener, pods).await,
        Some(options) => RunningGateway::start_ext_proc(gw, listener, pods, options).await,
    }
    .expect("gateway");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    Fleet {
        prefill: p,
        decode: d,
        gateway,
        http,
    }
}

/// What one engine serving both phases (no connector) answers `body` at `path`: the body,
/// after asserting a 200. The outputs a PD pair must reproduce.
pub async fn one_engine_answer(path: &str, body: &Value) -> String {
    let engine = pdsim::spawn(sim(Role::Both, Connector::None))
        .await
        .expect("engine");
    let r = reqwest::Client::new()
        .post(format!("{}{}", engine.base_url(), path))
        .json(body)
        .send()
        .await
        .expect("one engine");
    assert_eq!(r.status(), 200);
    r.text().await.expect("body")
}

/// The last request `engine` received.
pub fn last_request(engine: &SimHandle) -> pdsim::stats::RecentRequest {
    engine
        .stats()
        .recent_requests
        .last()
        .expect("the engine received a request")
        .clone()
}

/// The decode loaded the prefill's KV for each of `requests` (SGLang's push is not counted
/// as a pull), and recomputed or failed none.
pub fn assert_kv_loaded(decode: &SimHandle, connector: Connector, requests: usize) {
    let d = decode.stats();
    assert_eq!(
        d.recomputed, 0,
        "{connector:?}: decode recomputed instead of loading KV"
    );
    assert_eq!(d.transfers_failed, 0, "{connector:?}");
    if connector != Connector::Sglang {
        assert_eq!(d.transfers_pulled, requests as u64, "{connector:?}: {d:?}");
    }
}

/// One prefill and one decode of `connector`.
pub async fn pair(connector: Connector, tweak: impl FnOnce(&mut Config)) -> Fleet {
    start(
        vec![sim(Role::Prefill, connector)],
        vec![sim(Role::Decode, connector)],
        tweak,
    )
    .await
}

/// Two prefills and one decode of `connector`.
pub async fn two_prefills_one_decode(
    connector: Connector,
    tweak: impl FnOnce(&mut Config),
) -> Fleet {
    start(
        vec![sim(Role::Prefill, connector), sim(Role::Prefill, connector)],
        vec![sim(Role::Decode, connector)],
        tweak,
    )
    .await
}

impl Fleet {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.gateway.base_url(), path)
    }

    pub async fn wait_ready(&self, want: bool) {
        let mut last = 0;
        for _ in 0..200 {
            let r = self
                .http
                .get(self.url("/ready"))
                .send()
                .await
                .expect("ready");
            last = r.status().as_u16();
            if (last == 200) == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("gateway readiness stayed {last}");
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("request")
    }

    /// The gateway's Prometheus text.
    pub async fn metrics(&self) -> String {
        let r = self
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics");
        r.text().await.expect("metrics body")
    }

    /// Like [`Fleet::post`], failing the test if the gateway has not answered within 10 s
    /// (every timeout the tests configure is far below that).
    pub async fn post_bounded(&self, path: &str, body: &Value) -> reqwest::Response {
        tokio::time::timeout(Duration::from_secs(10), self.post(path, body))
            .await
            .expect("the gateway answered within its timeouts")
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request")
    }

    /// In-flight counts of every gateway endpoint.
    pub fn gateway_in_flight(&self) -> usize {
        let snap = self.gateway.gateway().store.load();
        snap.prefill
            .iter()
            .chain(snap.decode.iter())
            .map(|e| e.load.in_flight())
            .sum()
    }

    /// Waits (bounded) until no engine and no gateway endpoint holds a request.
    pub async fn wait_idle(&self) {
        for _ in 0..200 {
            let engines: u64 = self
                .prefill
                .iter()
                .chain(self.decode.iter())
                .map(|e| e.stats().in_flight)
                .sum();
            if engines == 0 && self.gateway_in_flight() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "still busy: gateway {} engines {:?}",
            self.gateway_in_flight(),
            self.prefill
                .iter()
                .chain(self.decode.iter())
                .map(|e| e.stats().in_flight)
                .collect::<Vec<_>>()
        );
    }
}

pub fn completion(stream: bool) -> Value {
    json!({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 12, "stream": stream})
}

pub fn chat(stream: bool) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a fox"}], "max_tokens": 12, "stream": stream})
}

/// The generated text of a non-streaming or streaming (SSE) response body.
pub fn text_of(body: &str) -> String {
    if body.starts_with("data:") {
        let mut out = String::new();
        let mut done = false;
        for event in body.split("\n\n").filter(|e| !e.is_empty()) {
            let data = event.strip_prefix("data: ").expect("data: framing");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("event json");
            assert!(v.get("error").is_none(), "error event: {data}");
            for c in v["choices"].as_array().into_iter().flatten() {
                if let Some(t) = c["text"].as_str() {
                    out.push_str(t);
                }
                if let Some(t) = c["delta"]["content"].as_str() {
                    out.push_str(t);
                }
            }
        }
        assert!(done, "stream ended without [DONE]: {body}");
        out
    } else {
        let v: Value = serde_json::from_str(body).expect("json body");
        let c = &v["choices"][0];
        c["text"]
            .as_str()
            .or_else(|| c["message"]["content"].as_str())
            .unwrap_or_else(|| panic!("no text in {body}"))
            .to_string()
    }
}

/// A Hugging Face `tokenizer.json` (word level: one token per whitespace-separated word of
/// `words`, `<s>` first, `<unk>` for the rest) in its own temporary directory, removed on drop.
/// pdsim engines given it treat prompts as vLLM does (token-id prompts pass untouched), and a
/// gateway given it computes the engines' own tokens.
pub struct WordTokenizer {
    dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl WordTokenizer {
    pub fn new<'a>(words: impl IntoIterator<Item = &'a str>) -> Self {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<s>".into(), json!(0));
        vocab.insert("<unk>".into(), json!(1));
        for w in words {
            let id = vocab.len();
            vocab.entry(w.to_string()).or_insert(json!(id));
        }
        let special = |id: u32, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<s>"), special(1, "<unk>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        let dir =
            std::env::temp_dir().join(format!("pdgate-tok-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("tokenizer dir");
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tokenizer.to_string()).expect("tokenizer.json");
        WordTokenizer { dir, path }
    }
}

impl Drop for WordTokenizer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Kills `engine` (its listeners close at once, as when the process dies), keeps it gone for
/// `gone`, and starts it again on the same ports with a new engine id (bounded retries while
/// the old sockets close).
pub async fn restart(engine: SimHandle, gone: Duration) -> SimHandle {
    let mut c = engine.config().clone();
    let ip = engine.addr().ip();
    c.listen = engine.addr();
    if let Some(p) = engine.side_channel_port() {
        c.side_channel_listen = std::net::SocketAddr::new(ip, p);
    }
    if let Some(p) = engine.bootstrap_port() {
        c.bootstrap_listen = std::net::SocketAddr::new(ip, p);
    }
    let old_id = engine.engine_id().to_string();
    c.engine_id = None;
    drop(engine);
    tokio::time::sleep(gone).await;
    for _ in 0..100 {
        match pdsim::spawn(c.clone()).await {
            Ok(e) => {
                assert_ne!(e.engine_id(), old_id, "a restarted engine has a new id");
                return e;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    panic!("engine could not bind its ports again");
}

/// The sum of the series in Prometheus text `text` that start with `series` (a name, or a name
/// with the start of its labels). The metric must be exposed (its `# TYPE` line is there): a
/// misspelt or renamed metric fails the test instead of reading 0.
pub fn metric(text: &str, series: &str) -> f64 {
    let name = series.split('{').next().unwrap_or(series);
    let exposed = text.lines().any(|l| {
        l.strip_prefix("# TYPE ")
            .and_then(|l| l.split(' ').next())
            .is_some_and(|family| family == name || format!("{family}_total") == name)
    });
    assert!(exposed, "metric {name} is not exposed:\n{text}");
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Log output kept in memory (a `tracing_subscriber` writer for tests that read the log).
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Every line written so far that parses as JSON.
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}
