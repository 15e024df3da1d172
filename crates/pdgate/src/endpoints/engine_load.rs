//! Engine load from the engines' own metrics (`cache.engine_load_interval`).
//!
//! A gateway counts only the requests it sent ([`Load::held`]); beside other replicas in front
//! of the same fleet, each one takes the engines the others filled for idle. Each interval,
//! [`run`] reads every prefill and decode engine's `/metrics` (vLLM's gauges
//! `vllm:num_requests_running` and `vllm:num_requests_waiting`) and stores on each endpoint's
//! [`Load`] what the engine holds beyond this gateway ([`Load::set_others`]); the cache-aware
//! cost counts both ([`Load::with_others`]). Off the request path: a decision reads one more
//! atomic word per candidate.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::endpoints::{Endpoint, Load, Snapshot};
use crate::engine::EnginePool;
use crate::engine::probe::get_with;

/// The gauges read (vLLM's names; pdsim exposes them too).
const RUNNING: &[u8] = b"vllm:num_requests_running";
const WAITING: &[u8] = b"vllm:num_requests_waiting";
/// vLLM's info gauge of its cache configuration (labels `num_gpu_blocks`, `block_size`, ...).
const CACHE_CONFIG: &[u8] = b"vllm:cache_config_info";

/// Largest `/metrics` answer read (vLLM's, with its histograms, is a few hundred KB).
const MAX_BODY: usize = 8 << 20;

/// Weight of the mean tokens per request so far against new requests, in requests: the mean
/// follows about the last this many requests sent to the endpoint.
const MEAN_WEIGHT: f64 = 32.0;

/// Requests an engine runs plus those it queues, from its Prometheus text: the series of the
/// data-parallel rank `rank` (label `engine="<rank>"`), or the sum of every series without one.
/// `None` when the text carries neither gauge for it, or a value that is not a count (the
/// estimate is then cleared rather than guessed).
///
/// A line scan for the two names, not a Prometheus parser: the rest of the text (hundreds of
/// histogram lines on vLLM) is skipped at the cost of comparing each line's first bytes.
pub(crate) fn queued_requests(text: &[u8], rank: Option<u32>) -> Option<u64> {
    let mut total = 0.0f64;
    let mut seen = [false; 2];
    for line in text.split(|&b| b == b'\n') {
        let (which, rest) = if let Some(rest) = line.strip_prefix(RUNNING) {
            (0, rest)
        } else if let Some(rest) = line.strip_prefix(WAITING) {
            (1, rest)
        } else {
            continue;
        };
        // `name{labels} value [timestamp]` or `name value [timestamp]`: anything else is
        // another metric sharing the prefix (`vllm:num_requests_running_foo`).
        let (labels, value) = match rest.first() {
            Some(b'{') => {
                let end = rest.iter().position(|&b| b == b'}')?;
                (&rest[1..end], &rest[end + 1..])
            }
            Some(b' ' | b'\t') => (&rest[..0], rest),
            _ => continue,
        };
        if let Some(rank) = rank
            && label(labels, b"engine")
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.parse::<u32>().ok())
                != Some(rank)
        {
            continue;
        }
        let value = std::str::from_utf8(value).ok()?.split_whitespace().next()?;
        let value: f64 = value.parse().ok()?;
        if !value.is_finite() || value < 0.0 {
            return None;
        }
        total += value;
        seen[which] = true;
    }
    // Both gauges, or the count would be half of it.
    (seen == [true, true]).then_some(total.round() as u64)
}

/// The prompt tokens an engine's KV cache holds in all, from its Prometheus text: the
/// `num_gpu_blocks` x `block_size` labels of `vllm:cache_config_info` (the series of
/// data-parallel rank `rank` where the series name ranks, label `engine`). `None` where the
/// text has none, or values that are not counts.
pub(crate) fn cache_tokens(text: &[u8], rank: Option<u32>) -> Option<u64> {
    text.split(|&b| b == b'\n').find_map(|line| {
        let labels = line.strip_prefix(CACHE_CONFIG)?.strip_prefix(b"{")?;
        let labels = &labels[..labels.iter().position(|&b| b == b'}')?];
        let engine = label(labels, b"engine").and_then(|v| std::str::from_utf8(v).ok());
        if let (Some(rank), Some(engine)) = (rank, engine)
            && engine.parse::<u32>().ok() != Some(rank)
        {
            return None;
        }
        let count = |name: &[u8]| {
            std::str::from_utf8(label(labels, name)?)
                .ok()?
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
        };
        count(b"num_gpu_blocks")?.checked_mul(count(b"block_size")?)
    })
}

/// The value of label `name` in `a="x",b="y"` (no escapes in the values read here).
fn label<'a>(labels: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let mut rest = labels;
    loop {
        let eq = rest.iter().position(|&b| b == b'=')?;
        let key = rest[..eq].trim_ascii();
        let after = rest[eq + 1..].strip_prefix(b"\"")?;
        let close = after.iter().position(|&b| b == b'"')?;
        if key == name {
            return Some(&after[..close]);
        }
        rest = after[close + 1..]
            .strip_prefix(b",")
            .unwrap_or(&after[close + 1..]);
    }
}

/// The requests an engine holds beyond this gateway's `own`: never below zero (a request this
/// gateway counts may not have reached the engine yet, e.g. a decode leg waiting on its
/// prefill, or have left it before its guard was dropped; both make the estimate low, never
/// high).
pub(crate) fn others(engine_total: u64, own: u32) -> u32 {
    u32::try_from(engine_total.saturating_sub(u64::from(own))).unwrap_or(u32::MAX)
}

/// The prompt tokens an endpoint's recent requests made it compute, per request: what others'
/// requests are priced at. Others route the same traffic through the same cost, so their
/// requests are taken to cost what this gateway's recent ones did (the uncached tokens it
/// predicted; 0 on a decode, which computes no prompt). Neither exact (another replica's cache
/// view differs) nor stale for long: it follows about the last [`MEAN_WEIGHT`] requests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct MeanTokens {
    /// [`Load::sent`] at the last update.
    sent: (u64, u64),
    /// Tokens per request (`None` until a request was seen).
    mean: Option<f64>,
}

impl MeanTokens {
    /// Takes in the requests sent since the last update (`sent`: [`Load::sent`] now).
    pub(crate) fn update(&mut self, sent: (u64, u64)) -> f64 {
        let requests = sent.0.saturating_sub(self.sent.0) as f64;
        let tokens = sent.1.saturating_sub(self.sent.1) as f64;
        self.sent = sent;
        if requests > 0.0 {
            self.mean = Some(match self.mean {
                None => tokens / requests,
                Some(m) => (m * MEAN_WEIGHT + tokens) / (MEAN_WEIGHT + requests),
            });
        }
        self.mean.unwrap_or(0.0)
    }
}

/// Stores on `load` what the engine holds beyond it: `engine_total` requests in all (`None`:
/// unknown, which clears the estimate), the others' priced at `mean` tokens each.
pub(crate) fn apply(load: &Load, engine_total: Option<u64>, mean: f64) {
    let Some(total) = engine_total else {
        load.set_others(0, 0);
        return;
    };
    let requests = others(total, load.held().0);
    let tokens = (f64::from(requests) * mean).min(f64::from(u32::MAX)) as u32;
    load.set_others(requests, tokens);
}

/// One engine's scrape: its `/metrics` URL, `Authorization`, and the endpoints it speaks for
/// (the data-parallel ranks of one engine share one answer).
struct Scrape {
    url: String,
    authorization: Option<http::HeaderValue>,
    endpoints: Vec<Arc<Endpoint>>,
}

/// The prefill and decode endpoints of `snap`, grouped by engine.
fn scrapes(snap: &Snapshot, authorization: Option<&http::HeaderValue>) -> Vec<Scrape> {
    let mut by_url: HashMap<String, usize> = HashMap::new();
    let mut out: Vec<Scrape> = Vec::new();
    for ep in snap.prefill.iter().chain(&snap.decode) {
        let Some(base) = crate::endpoints::base_url(&ep.pod) else {
            continue;
        };
        let url = format!("{base}/metrics");
        match by_url.get(&url) {
            Some(&i) => out[i].endpoints.push(ep.clone()),
            None => {
                by_url.insert(url.clone(), out.len());
                out.push(Scrape {
                    url,
                    authorization: ep.authorization.clone().or_else(|| authorization.cloned()),
                    endpoints: vec![ep.clone()],
                });
            }
        }
    }
    out
}

/// Scrapes every prefill and decode engine of the current snapshot each `interval` and
/// stores their load beyond this gateway on their endpoints ([`apply`]); ends when `cancel`
/// fires. Each scrape is bounded by one interval (at least 20 ms, at most 2 s) and a round
/// starts when the last one ended and the interval passed: a scrape that fails or times out
/// clears its endpoints' estimate, so none outlives about three intervals.
pub async fn run(
    snapshot: impl Fn() -> Arc<Snapshot> + Send + 'static,
    client: EnginePool,
    authorization: Option<http::HeaderValue>,
    interval: Duration,
    cancel: CancellationToken,
) {
    if interval.is_zero() {
        return;
    }
    let limit = interval.clamp(Duration::from_millis(20), Duration::from_secs(2));
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // By endpoint name (the key of its load): the mean tokens of its recent requests.
    let mut means: HashMap<String, MeanTokens> = HashMap::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let snap = snapshot();
        let mut round: JoinSet<(Scrape, Option<bytes::Bytes>)> = JoinSet::new();
        for scrape in scrapes(&snap, authorization.as_ref()) {
            let client = client.clone();
            round.spawn(async move {
                let got = get_with(
                    &client,
                    &scrape.url,
                    scrape.authorization.as_ref(),
                    limit,
                    MAX_BODY,
                )
                .await;
                let body = match got {
                    Ok((status, body)) if status.is_success() => Some(body),
                    Ok((status, _)) => {
                        tracing::debug!(url = %scrape.url, %status, "engine load not scraped");
                        None
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "engine load not scraped");
                        None
                    }
                };
                (scrape, body)
            });
        }
        let names: std::collections::HashSet<&str> = snap
            .prefill
            .iter()
            .chain(&snap.decode)
            .map(|e| e.name.as_str())
            .collect();
        means.retain(|name, _| names.contains(name.as_str()));
        drop(names);
        drop(snap);
        // The round ends within `limit` (every scrape is bounded); the task with it at `cancel`.
        loop {
            let done = tokio::select! {
                () = cancel.cancelled() => return,
                done = round.join_next() => done,
            };
            let Some(done) = done else { break };
            let Ok((scrape, body)) = done else { continue };
            for ep in &scrape.endpoints {
                // The engine's size does not change while it runs: a failed scrape keeps it.
                if let Some(tokens) = body.as_deref().and_then(|b| cache_tokens(b, ep.rank)) {
                    ep.load.set_cache_tokens(tokens);
                }
                let total = body.as_deref().and_then(|b| queued_requests(b, ep.rank));
                let mean = means.entry(ep.name.clone()).or_default();
                let mean = mean.update(ep.load.sent());
                apply(&ep.load, total, mean);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::LoadGuard;

    const VLLM: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
vllm:num_requests_running_total_foo{engine=\"0\"} 100
vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 7.0
";

    #[test]
    fn running_plus_waiting_summed_or_by_rank() {
        assert_eq!(queued_requests(VLLM.as_bytes(), None), Some(10));
        assert_eq!(queued_requests(VLLM.as_bytes(), Some(0)), Some(5));
        assert_eq!(queued_requests(VLLM.as_bytes(), Some(1)), Some(5));
        // A rank the engine does not report: unknown, not idle.
        assert_eq!(queued_requests(VLLM.as_bytes(), Some(2)), None);
        // pdsim's form (no engine label), CRLF line ends, a timestamp.
        let pdsim = "vllm:num_requests_running{model_name=\"m\"} 4\r\n\
                     vllm:num_requests_waiting{model_name=\"m\"} 1 1712345678000\r\n";
        assert_eq!(queued_requests(pdsim.as_bytes(), None), Some(5));
        let bare = "vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n";
        assert_eq!(queued_requests(bare.as_bytes(), None), Some(2));
        // The label found among others, wherever it stands.
        let late = "vllm:num_requests_running{model_name=\"m\",engine=\"3\"} 1\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"3\"} 6\n";
        assert_eq!(queued_requests(late.as_bytes(), Some(3)), Some(7));
    }

    #[test]
    fn the_engines_kv_tokens_from_its_cache_config() {
        // vLLM's form: one series per data-parallel rank, many labels, the counts label values.
        let vllm = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                    # TYPE vllm:cache_config_info gauge\n\
                    vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"4096\",num_cpu_blocks=\"None\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"2048\"} 1.0\n";
        assert_eq!(cache_tokens(vllm.as_bytes(), None), Some(4096 * 16));
        assert_eq!(cache_tokens(vllm.as_bytes(), Some(1)), Some(2048 * 32));
        assert_eq!(cache_tokens(vllm.as_bytes(), Some(2)), None);
        // pdsim's form: no engine label, so any rank reads it.
        let pdsim = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"64\"} 1.0\n";
        assert_eq!(cache_tokens(pdsim.as_bytes(), Some(3)), Some(1024));
        // Absent, unset (vLLM's "None" before profiling), not a count, or without its block
        // size: unknown.
        for text in [
            VLLM,
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"0\"} 1.0\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"-5\"} 1.0\n",
            "vllm:cache_config_info{num_gpu_blocks=\"5\"} 1.0\n",
            "vllm:cache_config_info_other{block_size=\"16\",num_gpu_blocks=\"5\"} 1.0\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"5\" 1.0\n",
        ] {
            assert_eq!(cache_tokens(text.as_bytes(), None), None, "{text}");
        }
    }

    #[test]
    fn missing_gauges_and_garbage_are_unknown() {
        assert_eq!(queued_requests(b"", None), None);
        assert_eq!(queued_requests(b"\x00\xff garbage\n{}}", None), None);
        let only_running = "vllm:num_requests_running{model_name=\"m\"} 4\n";
        assert_eq!(queued_requests(only_running.as_bytes(), None), None);
        for bad in ["x", "NaN", "-1", "+Inf", ""] {
            let text = format!(
                "vllm:num_requests_running{{model_name=\"m\"}} {bad}\n\
                 vllm:num_requests_waiting{{model_name=\"m\"}} 1\n"
            );
            assert_eq!(queued_requests(text.as_bytes(), None), None, "{bad:?}");
        }
        let unclosed =
            "vllm:num_requests_running{model_name=\"m\" 4\nvllm:num_requests_waiting 1\n";
        assert_eq!(queued_requests(unclosed.as_bytes(), None), None);
    }

    #[test]
    fn others_are_what_the_engine_holds_beyond_this_gateway() {
        assert_eq!(others(10, 4), 6);
        assert_eq!(others(3, 4), 0, "own requests not yet at the engine");
        assert_eq!(others(u64::MAX, 0), u32::MAX);
        // Capped so that the sum with this gateway's word never carries between its halves.
        let load = Arc::new(Load::default());
        let _own = LoadGuard::computing(&load, 7);
        load.set_others(u32::MAX, u32::MAX);
        assert_eq!(load.others(), ((1 << 31) - 1, (1 << 31) - 1));
        assert_eq!(load.with_others(), (1 << 31, (1 << 31) + 6));

        let load = Arc::new(Load::default());
        let _own = [
            LoadGuard::computing(&load, 100),
            LoadGuard::computing(&load, 300),
        ];
        let mut mean = MeanTokens::default();
        let m = mean.update(load.sent());
        assert_eq!(m, 200.0);
        apply(&load, Some(5), m);
        assert_eq!(load.others(), (3, 600));
        assert_eq!(load.held(), (2, 400), "own load untouched");
        assert_eq!(load.with_others(), (5, 1000));
        // A failed scrape clears the estimate.
        apply(&load, None, m);
        assert_eq!(load.others(), (0, 0));
        assert_eq!(load.with_others(), load.held());
    }

    #[test]
    fn the_mean_follows_recent_requests() {
        let load = Arc::new(Load::default());
        let mut mean = MeanTokens::default();
        assert_eq!(mean.update(load.sent()), 0.0, "nothing sent yet");
        drop(LoadGuard::computing(&load, 1000));
        assert_eq!(mean.update(load.sent()), 1000.0);
        // No new request: the mean stays.
        assert_eq!(mean.update(load.sent()), 1000.0);
        for _ in 0..32 {
            drop(LoadGuard::computing(&load, 0));
        }
        // 32 cached requests weigh as much as the mean's history.
        assert_eq!(mean.update(load.sent()), 500.0);
    }
}
