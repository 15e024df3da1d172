//! `pdgate check`: does a deployment really move KV from its prefills to its decodes?
//!
//! A decode that recomputes every prompt instead of receiving its KV (a mismatched connector, a
//! side channel advertised on the wrong port, a decode started without a KV connector) answers
//! correctly and only costs time, so nothing else notices it. For each prefill/decode pair (every
//! pair, or a sample in which every endpoint appears), a canary prompt goes through pdgate's own
//! request path pinned to that pair: a gateway with the deployment's configuration, serving only
//! those two endpoints. The decode's own counters then say whether it received the KV (pdsim's
//! `/sim/stats`; vLLM's external prefix-cache hits and NIXL bytes) or computed the prompt itself,
//! and its answer is compared with the decode's answer to the same prompt sent to it alone.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use kvtransfer::{Pod, Registry};
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::{Config, PrefillFailurePolicy};
use crate::endpoints::{Endpoint, Snapshot};
use crate::engine::pool::EnginePool;
use crate::run::{RunningGateway, listen};
use crate::state::Gateway;

/// Largest answer read from an engine or from the check's gateway.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// How often counters are read again while they settle after an answer.
const SETTLE_POLL: Duration = Duration::from_millis(100);

/// Words the canary prompts are made of (after a prefix unique to each canary).
const WORDS: [&str; 16] = [
    "the",
    "prefill",
    "computes",
    "a",
    "cache",
    "that",
    "every",
    "decode",
    "should",
    "receive",
    "instead",
    "of",
    "computing",
    "it",
    "once",
    "again",
];

/// What `pdgate check` sends, and how long it waits.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Every prefill/decode pair; otherwise a sample in which every endpoint appears once.
    pub all_pairs: bool,
    /// At most this many pairs are checked.
    pub max_pairs: usize,
    /// Words in each canary prompt (unique to the canary, so no cache already holds it).
    pub prompt_words: usize,
    /// Tokens each canary generates (greedy, `ignore_eos`).
    pub max_tokens: u32,
    /// Bound on each step: the pair's gateway ready, each request, the counters settling.
    pub timeout: Duration,
    /// A pair whose decode exposes no counter pdgate can read fails instead of passing as
    /// "unknown".
    pub require_evidence: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            all_pairs: false,
            max_pairs: 64,
            prompt_words: 48,
            max_tokens: 8,
            timeout: Duration::from_secs(60),
            require_evidence: false,
        }
    }
}

/// What the engines' counters say about the canary's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kv {
    /// The decode received the prompt's KV from the prefill.
    Received,
    /// The decode computed the prompt itself.
    Recomputed,
    /// The decode tried to load the KV and failed.
    Failed,
    /// Nothing observable says either way.
    Unknown,
}

impl Kv {
    fn as_str(self) -> &'static str {
        match self {
            Kv::Received => "received",
            Kv::Recomputed => "RECOMPUTED",
            Kv::Failed => "FAILED",
            Kv::Unknown => "unknown",
        }
    }
}

/// The result for one prefill/decode pair.
#[derive(Clone, Debug, Serialize)]
pub struct PairReport {
    /// The prefill endpoint's name.
    pub prefill: String,
    /// The decode endpoint's name.
    pub decode: String,
    /// The pair's connector.
    pub connector: String,
    /// The model the canary asked for.
    pub model: String,
    /// Status of the canary's answer through pdgate (0: none).
    pub status: u16,
    /// Whether the decode received the KV.
    pub kv: Kv,
    /// What the counters said, in words.
    pub evidence: String,
    /// The prefill leg, from the gateway's `pdgate_prefill_duration_seconds`.
    pub prefill_ms: Option<f64>,
    /// From the end of the prefill leg to the decode's first byte (`pdgate_kv_handoff_seconds`).
    pub handoff_ms: Option<f64>,
    /// The whole canary, as the client saw it.
    pub total_ms: f64,
    /// Whether the answer equals the decode's answer to the same prompt alone (None: not
    /// compared, because the canary failed).
    pub matches_decode_only: Option<bool>,
    /// Why the pair fails the check, if it does.
    pub problem: Option<String>,
}

impl PairReport {
    /// Whether the pair passed.
    pub fn ok(&self) -> bool {
        self.problem.is_none()
    }
}

/// Everything `pdgate check` found.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    /// One entry per pair checked.
    pub pairs: Vec<PairReport>,
    /// Endpoints that pair with nobody (no endpoint of the other role shares their connector
    /// and a model): requests can never reach them.
    pub unpaired: Vec<String>,
    /// Endpoints the gateway does not route to, and why (failed health checks, missing
    /// bootstrap facts, ...): not checked.
    pub excluded: Vec<String>,
}

impl CheckReport {
    /// Whether every pair passed.
    pub fn ok(&self) -> bool {
        !self.pairs.is_empty() && self.pairs.iter().all(PairReport::ok)
    }

    /// The report as a table, one line per pair, and a summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<44} {:<9} {:>6} {:<11} {:>10} {:>10} {:>9}  output",
            "pair", "connector", "status", "kv", "prefill", "handoff", "total"
        );
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
        for p in &self.pairs {
            let output = match p.matches_decode_only {
                Some(true) => "= decode-only",
                Some(false) => "DIFFERS from decode-only",
                None => "-",
            };
            let _ = writeln!(
                out,
                "{:<44} {:<9} {:>6} {:<11} {:>10} {:>10} {:>9}  {output}",
                format!("{} -> {}", p.prefill, p.decode),
                p.connector,
                p.status,
                p.kv.as_str(),
                ms(p.prefill_ms),
                ms(p.handoff_ms),
                format!("{:.1} ms", p.total_ms),
            );
            if !p.evidence.is_empty() {
                let _ = writeln!(out, "    {}", p.evidence);
            }
            if let Some(problem) = &p.problem {
                let _ = writeln!(out, "    FAIL: {problem}");
            }
        }
        for name in &self.unpaired {
            let _ = writeln!(
                out,
                "warning: {name} pairs with no endpoint of the other role"
            );
        }
        for why in &self.excluded {
            let _ = writeln!(out, "warning: not routable, not checked: {why}");
        }
        let count = |kv: Kv| self.pairs.iter().filter(|p| p.kv == kv).count();
        let _ = writeln!(
            out,
            "{} pairs: {} received the KV, {} recomputed, {} failed, {} unknown; {} failing",
            self.pairs.len(),
            count(Kv::Received),
            count(Kv::Recomputed),
            count(Kv::Failed),
            count(Kv::Unknown),
            self.pairs.iter().filter(|p| !p.ok()).count(),
        );
        out
    }
}

/// Checks the pairs of `pods` (the deployment's endpoints, from its configuration or its
/// discovery) with `config`'s connectors, models, engine credentials and timeouts.
///
/// # Errors
/// When `config` does not make a gateway (the same errors `pdgate` itself stops on).
pub async fn run(
    config: Config,
    registry: Registry,
    pods: Vec<Pod>,
    opts: &CheckOptions,
) -> Result<CheckReport, crate::Error> {
    let config = canary_config(config);
    // The fleet as the gateway sees it once discovery settled (bootstrap facts looked up,
    // health checked): which endpoints pair, and which are excluded and why.
    let fleet = start(&config, &registry, pods.clone()).await?;
    let ready = wait_ready(
        &fleet.gateway().engines.client,
        &fleet.base_url(),
        opts.timeout,
    )
    .await;
    let snapshot = fleet.gateway().store.load();
    fleet.shutdown(Duration::from_secs(2)).await;
    if let Err(why) = ready {
        tracing::warn!("the fleet is not ready: {why}");
    }
    let (pairs, unpaired) = choose_pairs(&snapshot, opts);
    let mut reports = Vec::with_capacity(pairs.len());
    for (p, d) in pairs {
        let pod = |ep: &Endpoint| {
            // The configured pod, not the endpoint's copy: that one lost the engine key.
            pods.iter()
                .find(|pod| pod.name == ep.pod.name)
                .cloned()
                .unwrap_or_else(|| ep.pod.clone())
        };
        let pair_pods = vec![pod(&p), pod(&d)];
        let report = check_pair(&config, &registry, pair_pods, &p, &d, &snapshot, opts).await?;
        reports.push(report);
    }
    Ok(CheckReport {
        pairs: reports,
        unpaired,
        excluded: snapshot
            .excluded
            .iter()
            .map(|(name, why)| format!("{name}: {why}"))
            .collect(),
    })
}

/// A gateway with `config` on a loopback port of its own, serving `pods`.
async fn start(
    config: &Config,
    registry: &Registry,
    pods: Vec<Pod>,
) -> Result<RunningGateway, crate::Error> {
    let gateway = Gateway::new(config.clone(), registry.clone())?;
    let listener =
        listen(config.http.listen).map_err(|e| crate::Error::Bind(config.http.listen, e))?;
    Ok(RunningGateway::start(gateway, listener, pods).await?)
}

/// The deployment's configuration, made fit for canaries: a private loopback gateway with no
/// client keys and no TLS, round robin on one pair, no fall-back or retry that would hide a
/// failing leg, no access log.
fn canary_config(mut config: Config) -> Config {
    config.http.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.http.access_log = false;
    config.security.admin_listen = None;
    config.security.tls_cert = None;
    config.security.tls_key = None;
    config.security.api_keys.clear();
    config.security.clients.clear();
    config.security.api_keys_file = None;
    config.policy.prefill_policy = "round_robin".into();
    config.policy.decode_policy = "round_robin".into();
    config.legs.on_prefill_failure = PrefillFailurePolicy::Fail;
    config.legs.max_retries = 0;
    config.shutdown.drain_delay = Duration::ZERO;
    config
}

/// A prefill and a decode.
type Pair = (Arc<Endpoint>, Arc<Endpoint>);

/// The pairs to check and the endpoints that pair with nobody. Without `all_pairs`, every
/// endpoint appears in at least one pair: prefill `i` is tried with the decodes from `i` on, so
/// the first pairs spread over the decodes.
fn choose_pairs(snapshot: &Snapshot, opts: &CheckOptions) -> (Vec<Pair>, Vec<String>) {
    let decodes = snapshot.decode.len();
    let mut candidates = Vec::new();
    for (i, p) in snapshot.prefill.iter().enumerate() {
        for k in 0..decodes {
            let d = &snapshot.decode[(i + k) % decodes];
            if snapshot.pairs(p, d) && models_meet(p, d) {
                candidates.push((p.clone(), d.clone()));
            }
        }
    }
    let mut seen_p = BTreeSet::new();
    let mut seen_d = BTreeSet::new();
    let mut chosen = Vec::new();
    for (p, d) in candidates {
        let fresh = !seen_p.contains(&p.name) || !seen_d.contains(&d.name);
        if opts.all_pairs || fresh {
            seen_p.insert(p.name.clone());
            seen_d.insert(d.name.clone());
            chosen.push((p, d));
        }
    }
    chosen.truncate(opts.max_pairs);
    let unpaired = snapshot
        .prefill
        .iter()
        .filter(|p| !seen_p.contains(&p.name))
        .chain(snapshot.decode.iter().filter(|d| !seen_d.contains(&d.name)))
        .map(|e| e.name.clone())
        .collect();
    (chosen, unpaired)
}

/// Whether the two endpoints serve a model in common (an endpoint that names none serves any).
fn models_meet(p: &Endpoint, d: &Endpoint) -> bool {
    p.models.is_empty() || d.models.is_empty() || p.models.iter().any(|m| d.models.contains(m))
}

/// A model both endpoints serve: one they both name, or the first the fleet serves when
/// either serves any.
fn shared_model(p: &Endpoint, d: &Endpoint, fleet: &[String]) -> Option<String> {
    match (p.models.is_empty(), d.models.is_empty()) {
        (false, false) => p.models.iter().find(|m| d.models.contains(m)).cloned(),
        (true, false) => d.models.first().cloned(),
        (false, true) => p.models.first().cloned(),
        (true, true) => fleet.first().cloned(),
    }
}

/// One canary through a gateway that serves only `p` and `d`.
async fn check_pair(
    config: &Config,
    registry: &Registry,
    pods: Vec<Pod>,
    p: &Endpoint,
    d: &Endpoint,
    fleet: &Snapshot,
    opts: &CheckOptions,
) -> Result<PairReport, crate::Error> {
    let running = start(config, registry, pods).await?;
    let client = running.gateway().engines.client.clone();
    let base = running.base_url();
    let mut report = PairReport {
        prefill: p.name.clone(),
        decode: d.name.clone(),
        connector: p.connector.clone().unwrap_or_default(),
        model: String::new(),
        status: 0,
        kv: Kv::Unknown,
        evidence: String::new(),
        prefill_ms: None,
        handoff_ms: None,
        total_ms: 0.0,
        matches_decode_only: None,
        problem: None,
    };
    let outcome = canary(&client, &base, p, d, fleet, opts, &mut report).await;
    if let Err(problem) = outcome {
        report.problem = Some(problem);
    }
    running.shutdown(Duration::from_secs(2)).await;
    Ok(report)
}

/// Sends the canary and the decode-only baseline; fills `report`. `Err` is the pair's problem.
async fn canary(
    client: &EnginePool,
    base: &str,
    p: &Endpoint,
    d: &Endpoint,
    fleet: &Snapshot,
    opts: &CheckOptions,
    report: &mut PairReport,
) -> Result<(), String> {
    wait_ready(client, base, opts.timeout).await?;
    let model = match shared_model(p, d, &fleet.models) {
        Some(m) => Some(m),
        None => served_model(client, base, opts.timeout).await,
    };
    let model = model.ok_or("the pair serves no model pdgate can name")?;
    report.model.clone_from(&model);
    let body = canary_body(&model, opts);
    let decode_url = crate::endpoints::base_url(&d.pod).ok_or("the decode has no address")?;
    let auth = d.authorization.as_ref();
    let before = Counters::read(client, &decode_url, auth, opts.timeout).await;

    let started = Instant::now();
    let answer = post(
        client,
        &format!("{base}/v1/completions"),
        None,
        &body,
        opts.timeout,
    )
    .await;
    report.total_ms = started.elapsed().as_secs_f64() * 1e3;
    let (status, bytes) = answer.map_err(|e| format!("no answer through pdgate: {e}"))?;
    report.status = status.as_u16();
    let metrics = get_text(client, &format!("{base}/metrics"), opts.timeout).await;
    report.prefill_ms = metrics
        .as_deref()
        .and_then(|m| series_sum(m, "pdgate_prefill_duration_seconds_sum"))
        .map(|s| s * 1e3);
    report.handoff_ms = metrics
        .as_deref()
        .and_then(|m| series_sum(m, "pdgate_kv_handoff_seconds_sum"))
        .map(|s| s * 1e3);
    if !status.is_success() {
        return Err(format!("pdgate answered {status}: {}", excerpt(&bytes)));
    }
    let text = completion_text(&bytes)
        .ok_or_else(|| format!("an answer without text: {}", excerpt(&bytes)))?;

    let without_kv = metrics
        .as_deref()
        .and_then(|m| series_sum(m, "pdgate_recomputes_total"))
        .is_some_and(|n| n > 0.0);
    let (kv, evidence) = if without_kv {
        (
            Kv::Recomputed,
            "the prefill answered without KV-transfer parameters (pdgate_recomputes_total)"
                .to_string(),
        )
    } else {
        settle(client, &decode_url, auth, &before, opts.timeout).await
    };
    report.kv = kv;
    report.evidence = evidence;

    let alone = post(
        client,
        &format!("{decode_url}/v1/completions"),
        auth,
        &body,
        opts.timeout,
    )
    .await;
    match alone {
        Ok((s, b)) if s.is_success() => {
            report.matches_decode_only =
                Some(completion_text(&b).as_deref() == Some(text.as_str()));
        }
        Ok((s, b)) => return Err(format!("the decode alone answered {s}: {}", excerpt(&b))),
        Err(e) => return Err(format!("the decode alone did not answer: {e}")),
    }
    match kv {
        Kv::Recomputed => return Err("the decode recomputed the prompt: no KV moved".into()),
        Kv::Failed => return Err("the decode failed to load the prompt's KV".into()),
        Kv::Unknown if opts.require_evidence => {
            return Err("nothing shows whether the decode received the KV".into());
        }
        _ => {}
    }
    if report.matches_decode_only == Some(false) {
        return Err("the answer differs from the decode's answer to the prompt alone".into());
    }
    Ok(())
}

/// A greedy completion of a prompt no cache holds yet.
fn canary_body(model: &str, opts: &CheckOptions) -> Value {
    let mut prompt = format!("pdgate check {}", uuid::Uuid::new_v4().simple());
    for i in 0..opts.prompt_words {
        prompt.push(' ');
        prompt.push_str(WORDS[i % WORDS.len()]);
    }
    json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": opts.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": false,
    })
}

/// Waits until the pair's gateway says it can route (`/ready` 200).
async fn wait_ready(client: &EnginePool, base: &str, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    let url = format!("{base}/ready");
    let mut last = String::new();
    while Instant::now() < deadline {
        match get(client, &url, limit).await {
            Ok((status, _)) if status.is_success() => return Ok(()),
            Ok((status, body)) => last = format!("{status}: {}", excerpt(&body)),
            Err(e) => last = e,
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
    Err(format!("the pair was not ready within {limit:?} ({last})"))
}

/// The first model the pair's gateway lists.
async fn served_model(client: &EnginePool, base: &str, limit: Duration) -> Option<String> {
    let (_, body) = get(client, &format!("{base}/v1/models"), limit)
        .await
        .ok()?;
    let v: Value = serde_json::from_slice(&body).ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

/// An engine's counters that tell a received KV from a recomputed prompt.
#[derive(Clone, Debug, PartialEq)]
enum Counters {
    /// pdsim's `/sim/stats`.
    Sim {
        pulled: u64,
        recomputed: u64,
        failed: u64,
    },
    /// vLLM's `/metrics`.
    Vllm {
        external_hits: f64,
        prompt_tokens: f64,
        nixl_bytes: f64,
        nixl_failed: f64,
    },
    /// Nothing pdgate can read.
    None,
}

impl Counters {
    async fn read(
        client: &EnginePool,
        engine: &str,
        auth: Option<&HeaderValue>,
        limit: Duration,
    ) -> Counters {
        if let Ok((status, body)) =
            get_with(client, &format!("{engine}/sim/stats"), auth, limit).await
            && status.is_success()
            && let Ok(v) = serde_json::from_slice::<Value>(&body)
        {
            let n = |k: &str| v[k].as_u64().unwrap_or(0);
            return Counters::Sim {
                pulled: n("transfers_pulled"),
                recomputed: n("recomputed"),
                failed: n("transfers_failed"),
            };
        }
        if let Ok((status, body)) =
            get_with(client, &format!("{engine}/metrics"), auth, limit).await
            && status.is_success()
        {
            let text = String::from_utf8_lossy(&body);
            if let Some(external_hits) = series_sum(&text, "vllm:external_prefix_cache_hits_total")
            {
                return Counters::Vllm {
                    external_hits,
                    prompt_tokens: series_sum(&text, "vllm:prompt_tokens_total").unwrap_or(0.0),
                    nixl_bytes: series_sum(&text, "vllm:nixl_bytes_transferred_sum").unwrap_or(0.0),
                    nixl_failed: series_sum(&text, "vllm:nixl_num_failed_transfers_total")
                        .unwrap_or(0.0),
                };
            }
        }
        Counters::None
    }

    /// What moved between `self` (before the canary) and `after`.
    fn verdict(&self, after: &Counters) -> (Kv, String) {
        match (self, after) {
            (
                Counters::Sim { pulled, recomputed, failed },
                Counters::Sim { pulled: p2, recomputed: r2, failed: f2 },
            ) => {
                let (pulled, recomputed, failed) = (p2 - pulled.min(p2), r2 - recomputed.min(r2), f2 - failed.min(f2));
                let words = format!("pdsim decode: {pulled} KV pulled, {recomputed} recomputed, {failed} failed loads");
                if recomputed > 0 || (failed > 0 && pulled == 0) {
                    (if failed > 0 { Kv::Failed } else { Kv::Recomputed }, words)
                } else if pulled > 0 {
                    (Kv::Received, words)
                } else {
                    (Kv::Unknown, words)
                }
            }
            (
                Counters::Vllm { external_hits, prompt_tokens, nixl_bytes, nixl_failed },
                Counters::Vllm {
                    external_hits: e2,
                    prompt_tokens: t2,
                    nixl_bytes: b2,
                    nixl_failed: f2,
                },
            ) => {
                let (hits, tokens, bytes, failed) =
                    (e2 - external_hits, t2 - prompt_tokens, b2 - nixl_bytes, f2 - nixl_failed);
                let words = format!(
                    "vLLM decode: {hits:.0} of {tokens:.0} prompt tokens loaded from the prefill (external prefix-cache hits), {bytes:.0} bytes over NIXL, {failed:.0} failed transfers"
                );
                if hits > 0.0 {
                    (Kv::Received, words)
                } else if failed > 0.0 {
                    (Kv::Failed, words)
                } else if tokens > 0.0 {
                    (Kv::Recomputed, words)
                } else {
                    (Kv::Unknown, words)
                }
            }
            _ => (
                Kv::Unknown,
                "the decode exposes no counter of received KV (pdsim /sim/stats or vLLM's vllm:external_prefix_cache_hits_total)".into(),
            ),
        }
    }
}

/// Reads the decode's counters until they show the canary (engines may publish them a moment
/// after the answer), up to `limit`.
async fn settle(
    client: &EnginePool,
    engine: &str,
    auth: Option<&HeaderValue>,
    before: &Counters,
    limit: Duration,
) -> (Kv, String) {
    let deadline = Instant::now() + limit.min(Duration::from_secs(10));
    loop {
        let after = Counters::read(client, engine, auth, limit).await;
        let verdict = before.verdict(&after);
        if verdict.0 != Kv::Unknown || matches!(after, Counters::None) || Instant::now() >= deadline
        {
            return verdict;
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// The sum of every series named `name` in a Prometheus text exposition (None: no such series).
fn series_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(value) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *sum.get_or_insert(0.0) += value;
        }
    }
    sum
}

/// `choices[0].text` of a completion.
fn completion_text(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v["choices"][0]["text"].as_str().map(str::to_string)
}

fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
}

async fn get(
    client: &EnginePool,
    url: &str,
    limit: Duration,
) -> Result<(StatusCode, Bytes), String> {
    get_with(client, url, None, limit).await
}

async fn get_with(
    client: &EnginePool,
    url: &str,
    auth: Option<&HeaderValue>,
    limit: Duration,
) -> Result<(StatusCode, Bytes), String> {
    crate::engine::probe::get_with(client, url, auth, limit, MAX_ANSWER_BYTES)
        .await
        .map_err(|e| e.to_string())
}

async fn get_text(client: &EnginePool, url: &str, limit: Duration) -> Option<String> {
    let (status, body) = get(client, url, limit).await.ok()?;
    status
        .is_success()
        .then(|| String::from_utf8_lossy(&body).into_owned())
}

/// A bounded JSON POST.
async fn post(
    client: &EnginePool,
    url: &str,
    auth: Option<&HeaderValue>,
    body: &Value,
    limit: Duration,
) -> Result<(StatusCode, Bytes), String> {
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(v) = auth {
        builder = builder.header(header::AUTHORIZATION, v.clone());
    }
    let request = builder
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let work = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, bytes))
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| format!("{url} did not answer within {limit:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_summed_over_their_labels_and_only_by_their_exact_name() {
        let text = "# HELP x\nvllm:external_prefix_cache_hits_total{engine=\"0\"} 96\n\
                    vllm:external_prefix_cache_hits_total{engine=\"1\"} 4\n\
                    vllm:external_prefix_cache_hits_created{engine=\"0\"} 1.7e9\n\
                    pdgate_recomputes_total 0\n";
        assert_eq!(
            series_sum(text, "vllm:external_prefix_cache_hits_total"),
            Some(100.0)
        );
        assert_eq!(series_sum(text, "pdgate_recomputes_total"), Some(0.0));
        assert_eq!(series_sum(text, "vllm:prompt_tokens_total"), None);
    }

    #[test]
    fn vllm_counters_tell_received_from_recomputed_kv() {
        let before = Counters::Vllm {
            external_hits: 10.0,
            prompt_tokens: 100.0,
            nixl_bytes: 0.0,
            nixl_failed: 0.0,
        };
        let received = Counters::Vllm {
            external_hits: 234.0,
            prompt_tokens: 340.0,
            nixl_bytes: 1e6,
            nixl_failed: 0.0,
        };
        let recomputed = Counters::Vllm {
            external_hits: 10.0,
            prompt_tokens: 340.0,
            nixl_bytes: 0.0,
            nixl_failed: 0.0,
        };
        let failed = Counters::Vllm {
            external_hits: 10.0,
            prompt_tokens: 340.0,
            nixl_bytes: 0.0,
            nixl_failed: 1.0,
        };
        assert_eq!(before.verdict(&received).0, Kv::Received);
        assert_eq!(before.verdict(&recomputed).0, Kv::Recomputed);
        assert_eq!(before.verdict(&failed).0, Kv::Failed);
        assert_eq!(before.verdict(&before).0, Kv::Unknown);
        assert_eq!(before.verdict(&Counters::None).0, Kv::Unknown);
    }

    #[test]
    fn pdsim_counters_tell_received_from_recomputed_kv() {
        let before = Counters::Sim {
            pulled: 3,
            recomputed: 1,
            failed: 0,
        };
        let sim = |pulled, recomputed, failed| Counters::Sim {
            pulled,
            recomputed,
            failed,
        };
        assert_eq!(before.verdict(&sim(4, 1, 0)).0, Kv::Received);
        assert_eq!(before.verdict(&sim(3, 2, 0)).0, Kv::Recomputed);
        assert_eq!(before.verdict(&sim(3, 2, 1)).0, Kv::Failed);
        assert_eq!(before.verdict(&sim(3, 1, 1)).0, Kv::Failed);
        assert_eq!(before.verdict(&before).0, Kv::Unknown);
    }
}
