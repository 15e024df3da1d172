//! Engine counters read before and after a run: prefix-cache hits and queries and prefill
//! tokens computed, from vLLM's (and pdsim's) Prometheus `/metrics`.

use bytes::Bytes;
use serde::Serialize;

use crate::client::{HttpClient, get};

/// The counters of one engine at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    /// `vllm:prefix_cache_hits_total` (tokens hit).
    pub hits: f64,
    /// `vllm:prefix_cache_queries_total` (tokens looked up).
    pub queries: f64,
    /// `vllm:request_prefill_kv_computed_tokens_sum` (prefill tokens computed).
    pub computed: Option<f64>,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: f64,
}

/// Sums every sample of each counter (all label sets) in a Prometheus text exposition.
pub fn parse(text: &str) -> Counters {
    let mut c = Counters::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = name_labels.split('{').next().unwrap_or_default().trim();
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        match name {
            "vllm:prefix_cache_hits_total" => c.hits += v,
            "vllm:prefix_cache_queries_total" => c.queries += v,
            "vllm:request_prefill_kv_computed_tokens_sum" => {
                *c.computed.get_or_insert(0.0) += v;
            }
            "vllm:prompt_tokens_total" => c.prompt_tokens += v,
            _ => {}
        }
    }
    c
}

/// What one engine did during the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineDelta {
    /// The engine's base URL.
    pub url: String,
    /// Prefix-cache hit tokens.
    pub prefix_cache_hits: f64,
    /// Prefix-cache query tokens.
    pub prefix_cache_queries: f64,
    /// Prefill tokens computed (`None` when the engine does not export the histogram).
    pub prefill_computed_tokens: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: f64,
}

/// Sum over every engine, with the hit share `hits / queries`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineTotals {
    /// Per engine.
    pub engines: Vec<EngineDelta>,
    /// Hit tokens, all engines.
    pub prefix_cache_hits: f64,
    /// Query tokens, all engines.
    pub prefix_cache_queries: f64,
    /// `prefix_cache_hits / prefix_cache_queries`.
    pub hit_share: f64,
    /// Prefill tokens computed, all engines that export it.
    pub prefill_computed_tokens: f64,
}

fn metrics_uri(base: &str) -> String {
    let b = base.trim().trim_end_matches('/');
    if b.ends_with("/metrics") {
        b.to_owned()
    } else {
        format!("{b}/metrics")
    }
}

/// Reads every engine's counters (`None` for one that could not be read).
pub async fn scrape_all(client: &HttpClient, urls: &[String]) -> Vec<Result<Counters, String>> {
    let mut out = Vec::with_capacity(urls.len());
    for u in urls {
        out.push(match get(client, &metrics_uri(u)).await {
            Ok((200, body)) => Ok(parse(&String::from_utf8_lossy(&body))),
            Ok((status, body)) => Err(status_text(status, &body)),
            Err(e) => Err(e),
        });
    }
    out
}

fn status_text(status: u16, body: &Bytes) -> String {
    format!(
        "HTTP {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(100)])
    )
}

/// The per-engine deltas; engines that failed either read become warnings.
pub fn deltas(
    urls: &[String],
    before: &[Result<Counters, String>],
    after: &[Result<Counters, String>],
    warnings: &mut Vec<String>,
) -> Option<EngineTotals> {
    if urls.is_empty() {
        return None;
    }
    let mut engines = Vec::new();
    for ((url, b), a) in urls.iter().zip(before).zip(after) {
        match (b, a) {
            (Ok(b), Ok(a)) => engines.push(EngineDelta {
                url: url.clone(),
                prefix_cache_hits: a.hits - b.hits,
                prefix_cache_queries: a.queries - b.queries,
                prefill_computed_tokens: a.computed.map(|x| x - b.computed.unwrap_or(0.0)),
                prompt_tokens: a.prompt_tokens - b.prompt_tokens,
            }),
            (Err(e), _) | (_, Err(e)) => warnings.push(format!("engine metrics {url}: {e}")),
        }
    }
    let hits: f64 = engines.iter().map(|e| e.prefix_cache_hits).sum();
    let queries: f64 = engines.iter().map(|e| e.prefix_cache_queries).sum();
    let computed = engines
        .iter()
        .filter_map(|e| e.prefill_computed_tokens)
        .sum();
    Some(EngineTotals {
        engines,
        prefix_cache_hits: hits,
        prefix_cache_queries: queries,
        hit_share: if queries > 0.0 { hits / queries } else { 0.0 },
        prefill_computed_tokens: computed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counters_over_label_sets() {
        let text = "# HELP vllm:prefix_cache_hits_total x\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 96.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 4\n\
            vllm:prefix_cache_queries_total{engine=\"0\"} 200\n\
            vllm:request_prefill_kv_computed_tokens_bucket{le=\"1.0\"} 3\n\
            vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\"} 104\n\
            vllm:prompt_tokens_total 200\n";
        let c = parse(text);
        assert_eq!(c.hits, 100.0);
        assert_eq!(c.queries, 200.0);
        assert_eq!(c.computed, Some(104.0));
        assert_eq!(c.prompt_tokens, 200.0);
        let mut w = Vec::new();
        let urls = vec!["http://e:1".to_owned(), "http://e:2".to_owned()];
        let zero = Counters::default();
        let t = deltas(
            &urls,
            &[Ok(zero), Ok(zero)],
            &[Ok(c), Err("down".into())],
            &mut w,
        )
        .expect("totals");
        assert_eq!(t.engines.len(), 1);
        assert!((t.hit_share - 0.5).abs() < 1e-12);
        assert_eq!(t.prefill_computed_tokens, 104.0);
        assert_eq!(w, ["engine metrics http://e:2: down"]);
        assert_eq!(metrics_uri("http://e:1/"), "http://e:1/metrics");
    }
}
