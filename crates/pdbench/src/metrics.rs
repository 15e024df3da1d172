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
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: f64,
    /// `pdsim_kv_transfers_total{outcome="recomputed"}`: decode requests that received no KV
    /// and recomputed the prompt (pdsim only; vLLM does not count them).
    pub recomputed: f64,
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
            "vllm:generation_tokens_total" => c.generation_tokens += v,
            "pdsim_kv_transfers_total" if name_labels.contains("outcome=\"recomputed\"") => {
                c.recomputed += v;
            }
            _ => {}
        }
    }
    c
}

/// What an engine serves, when the run knows it (from a fleet file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineRole {
    /// A prefill engine: its work is the prefill tokens it computed.
    Prefill,
    /// A decode engine: its work is the tokens it generated.
    Decode,
}

/// What one engine did during the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineDelta {
    /// The engine's base URL.
    pub url: String,
    /// Its role, when known.
    pub role: Option<EngineRole>,
    /// Prefix-cache hit tokens.
    pub prefix_cache_hits: f64,
    /// Prefix-cache query tokens.
    pub prefix_cache_queries: f64,
    /// Prefill tokens computed (`None` when the engine does not export the histogram).
    pub prefill_computed_tokens: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: f64,
    /// Generated tokens.
    pub generation_tokens: f64,
    /// Decode requests that received no KV and recomputed the prompt (pdsim).
    pub recomputed: f64,
}

impl EngineDelta {
    /// The work this engine did, in the measure of its role: prefill tokens computed (prompt
    /// tokens less hits when the engine does not export the histogram), or for a decode
    /// engine the tokens it generated.
    pub fn work(&self) -> f64 {
        match self.role {
            Some(EngineRole::Decode) => self.generation_tokens,
            _ => self
                .prefill_computed_tokens
                .unwrap_or(self.prompt_tokens - self.prefix_cache_hits),
        }
    }
}

/// How evenly one group of engines shared the work: the busiest engine against the mean.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Balance {
    /// `prefill`, `decode`, or `all` when roles are unknown.
    pub role: String,
    /// What was counted: `prefill_computed_tokens` or `generation_tokens`.
    pub measure: &'static str,
    /// Engines in the group.
    pub engines: usize,
    /// The busiest engine's work.
    pub max: f64,
    /// The mean engine's work.
    pub mean: f64,
    /// `max / mean` (1.0 is perfectly even; `engines` is one engine doing everything).
    pub max_over_mean: Option<f64>,
}

fn balance(role: &str, measure: &'static str, group: &[&EngineDelta]) -> Option<Balance> {
    if group.is_empty() {
        return None;
    }
    let work: Vec<f64> = group.iter().map(|e| e.work()).collect();
    let max = work.iter().copied().fold(0.0, f64::max);
    let mean = work.iter().sum::<f64>() / work.len() as f64;
    Some(Balance {
        role: role.to_owned(),
        measure,
        engines: group.len(),
        max,
        mean,
        max_over_mean: (mean > 0.0).then(|| max / mean),
    })
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
    /// `hits / queries` over the prefill engines only (when roles are known).
    pub prefill_hit_share: Option<f64>,
    /// Busy share per role: the busiest engine's work over the mean.
    pub balance: Vec<Balance>,
    /// Requests whose decode received no KV and recomputed the prompt, all engines (pdsim):
    /// a router that does not hand the KV over pays every prompt twice.
    pub recomputed: f64,
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
    roles: &[Option<EngineRole>],
    before: &[Result<Counters, String>],
    after: &[Result<Counters, String>],
    warnings: &mut Vec<String>,
) -> Option<EngineTotals> {
    if urls.is_empty() {
        return None;
    }
    let mut engines = Vec::new();
    for (i, ((url, b), a)) in urls.iter().zip(before).zip(after).enumerate() {
        match (b, a) {
            (Ok(b), Ok(a)) => engines.push(EngineDelta {
                url: url.clone(),
                role: roles.get(i).copied().flatten(),
                prefix_cache_hits: a.hits - b.hits,
                prefix_cache_queries: a.queries - b.queries,
                prefill_computed_tokens: a.computed.map(|x| x - b.computed.unwrap_or(0.0)),
                prompt_tokens: a.prompt_tokens - b.prompt_tokens,
                generation_tokens: a.generation_tokens - b.generation_tokens,
                recomputed: a.recomputed - b.recomputed,
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
    let of = |role: Option<EngineRole>| -> Vec<&EngineDelta> {
        engines.iter().filter(|e| e.role == role).collect()
    };
    let (prefills, decodes, unknown) = (
        of(Some(EngineRole::Prefill)),
        of(Some(EngineRole::Decode)),
        of(None),
    );
    let prefill_hit_share = (!prefills.is_empty()).then(|| {
        let q: f64 = prefills.iter().map(|e| e.prefix_cache_queries).sum();
        let h: f64 = prefills.iter().map(|e| e.prefix_cache_hits).sum();
        if q > 0.0 { h / q } else { 0.0 }
    });
    let balance = [
        balance("prefill", "prefill_computed_tokens", &prefills),
        balance("decode", "generation_tokens", &decodes),
        balance("all", "prefill_computed_tokens", &unknown),
    ]
    .into_iter()
    .flatten()
    .collect();
    Some(EngineTotals {
        prefix_cache_hits: hits,
        prefix_cache_queries: queries,
        hit_share: if queries > 0.0 { hits / queries } else { 0.0 },
        prefill_computed_tokens: computed,
        prefill_hit_share,
        balance,
        recomputed: engines.iter().map(|e| e.recomputed).sum(),
        engines,
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
            vllm:prompt_tokens_total 200\n\
            pdsim_kv_transfers_total{role=\"decode\",outcome=\"recomputed\"} 3\n\
            pdsim_kv_transfers_total{role=\"decode\",outcome=\"served\"} 7\n";
        let c = parse(text);
        assert_eq!(c.recomputed, 3.0, "only the recomputed outcome");
        assert_eq!(c.hits, 100.0);
        assert_eq!(c.queries, 200.0);
        assert_eq!(c.computed, Some(104.0));
        assert_eq!(c.prompt_tokens, 200.0);
        let mut w = Vec::new();
        let urls = vec!["http://e:1".to_owned(), "http://e:2".to_owned()];
        let zero = Counters::default();
        let t = deltas(
            &urls,
            &[],
            &[Ok(zero), Ok(zero)],
            &[Ok(c), Err("down".into())],
            &mut w,
        )
        .expect("totals");
        assert_eq!(t.engines.len(), 1);
        assert!((t.hit_share - 0.5).abs() < 1e-12);
        assert_eq!(t.prefill_computed_tokens, 104.0);
        assert_eq!(t.recomputed, 3.0);
        assert_eq!(w, ["engine metrics http://e:2: down"]);
        assert!(t.prefill_hit_share.is_none(), "no roles");
        assert_eq!(t.balance.len(), 1);
        assert_eq!(t.balance[0].role, "all");
        assert_eq!(t.balance[0].max_over_mean, Some(1.0));
        assert_eq!(metrics_uri("http://e:1/"), "http://e:1/metrics");
    }

    #[test]
    fn busy_share_per_role() {
        let c = |hits: f64, queries: f64, computed: f64, generated: f64| Counters {
            hits,
            queries,
            computed: Some(computed),
            prompt_tokens: queries,
            generation_tokens: generated,
            recomputed: 0.0,
        };
        let urls: Vec<String> = (0..4).map(|i| format!("http://e:{i}")).collect();
        let roles = [
            Some(EngineRole::Prefill),
            Some(EngineRole::Prefill),
            Some(EngineRole::Decode),
            Some(EngineRole::Decode),
        ];
        let zero = Ok(Counters::default());
        let before = vec![zero.clone(), zero.clone(), zero.clone(), zero];
        let after = vec![
            Ok(c(300.0, 400.0, 100.0, 1.0)),
            Ok(c(0.0, 300.0, 300.0, 1.0)),
            Ok(c(0.0, 0.0, 0.0, 90.0)),
            Ok(c(500.0, 700.0, 200.0, 10.0)),
        ];
        let mut w = Vec::new();
        let t = deltas(&urls, &roles, &before, &after, &mut w).expect("totals");
        assert!(w.is_empty());
        // Prefill engines only: 300 of 700 queried tokens.
        let share = t.prefill_hit_share.expect("roles known");
        assert!((share - 300.0 / 700.0).abs() < 1e-12);
        assert!((t.hit_share - 800.0 / 1400.0).abs() < 1e-12, "every engine");
        let p = &t.balance[0];
        assert_eq!(
            (p.role.as_str(), p.measure),
            ("prefill", "prefill_computed_tokens")
        );
        assert_eq!((p.max, p.mean), (300.0, 200.0));
        assert_eq!(p.max_over_mean, Some(1.5));
        let d = &t.balance[1];
        assert_eq!(
            (d.role.as_str(), d.measure),
            ("decode", "generation_tokens")
        );
        assert_eq!(d.max_over_mean, Some(90.0 / 50.0));
        assert_eq!(t.balance.len(), 2);
    }
}
