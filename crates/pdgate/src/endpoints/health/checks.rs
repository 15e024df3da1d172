//! The active checker: `GET /health` (plus Mooncake's `/query`, and `/v1/models` where nobody
//! configured the models) on every endpoint each `health_check_interval`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Health, HealthConfig, ProbeTarget};
use crate::endpoints::adapters::Cards;
use crate::engine::EnginePool;
use crate::engine::probe::{ProbeError, get_ok};

/// One check's outcome: the endpoints it speaks for (the ranks of one engine share its probe),
/// whether it passed, what its `/v1/models` named (if asked and answered), and whether its
/// models are learned.
type Checked = (Vec<String>, Result<(), ProbeError>, Option<Cards>, bool);

/// The targets grouped by what is requested: the data-parallel ranks of one engine are probed
/// once, and the answer counts for each. Order follows the first target of each group.
fn by_engine(targets: Vec<ProbeTarget>) -> Vec<(ProbeTarget, Vec<String>)> {
    let mut groups: Vec<(ProbeTarget, Vec<String>)> = Vec::new();
    for t in targets {
        let same = |g: &(ProbeTarget, Vec<String>)| {
            g.0.health_url == t.health_url
                && g.0.query_url == t.query_url
                && g.0.models_url == t.models_url
                && g.0.role == t.role
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.1.push(t.name),
            None => {
                let name = t.name.clone();
                groups.push((t, vec![name]));
            }
        }
    }
    groups
}

async fn probe(
    client: EnginePool,
    target: ProbeTarget,
    names: Vec<String>,
    limit: Duration,
) -> Checked {
    let mut result = get_ok(&client, &target.health_url, limit).await;
    if result.is_ok()
        && let Some(q) = &target.query_url
    {
        result = get_ok(&client, q, limit).await;
    }
    let mut cards = None;
    if result.is_ok()
        && let Some(url) = &target.models_url
    {
        cards = learn_models(&client, url, target.authorization.as_ref(), limit).await;
    }
    (names, result, cards, target.learn_models)
}

/// The models and adapters of an OpenAI `/v1/models` answer; `None` when it cannot be had
/// (the check itself still passed: `/health` decides that).
async fn learn_models(
    client: &EnginePool,
    url: &str,
    authorization: Option<&http::HeaderValue>,
    limit: Duration,
) -> Option<Cards> {
    match crate::engine::probe::get_with(client, url, authorization, limit, 256 * 1024).await {
        Ok((status, body)) if status.is_success() => Cards::parse(&body),
        Ok((status, _)) => {
            tracing::debug!(url, %status, "engine models not learned");
            None
        }
        Err(e) => {
            tracing::debug!(url, error = %e, "engine models not learned");
            None
        }
    }
}

/// Runs active checks every `health_check_interval` (when enabled) and ends ejection periods.
/// Ends when `cancel` fires.
pub async fn run(
    health: Arc<Health>,
    client: EnginePool,
    config: HealthConfig,
    cancel: CancellationToken,
) {
    let tick = config.health_check_interval.min(Duration::from_millis(250));
    let mut next_check = Instant::now();
    let mut probes: JoinSet<Checked> = JoinSet::new();
    loop {
        let now = Instant::now();
        health.tick(now);
        if config.health_checks && now >= next_check && probes.is_empty() {
            next_check = now + config.health_check_interval;
            for (target, names) in by_engine(health.targets()) {
                probes.spawn(probe(
                    client.clone(),
                    target,
                    names,
                    config.health_check_timeout,
                ));
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            Some(done) = probes.join_next(), if !probes.is_empty() => {
                if let Ok((names, result, cards, learn_models)) = done {
                    let why = result.err().map(|e| e.to_string());
                    for name in &names {
                        if let Some(cards) = &cards {
                            if learn_models {
                                health.learned(name, cards.models.clone());
                            }
                            health.learned_adapters(name, cards.adapters.clone());
                        }
                        health.check_result(name, why.is_none(), why.as_deref().unwrap_or(""));
                    }
                }
            }
            // An engine refused an adapter: the next round starts now (or when this one ends).
            () = health.refresh_asked() => next_check = Instant::now(),
            _ = tokio::time::sleep(tick) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Role;

    fn target(name: &str, url: &str) -> ProbeTarget {
        ProbeTarget {
            name: name.into(),
            role: Role::Decode,
            health_url: format!("{url}/health"),
            query_url: None,
            models_url: None,
            learn_models: false,
            authorization: None,
        }
    }

    #[test]
    fn ranks_of_one_engine_share_a_probe() {
        let groups = by_engine(vec![
            target("a#dp0", "http://a"),
            target("b", "http://b"),
            target("a#dp1", "http://a"),
        ]);
        let names: Vec<Vec<String>> = groups.into_iter().map(|g| g.1).collect();
        assert_eq!(
            names,
            vec![
                vec!["a#dp0".to_string(), "a#dp1".to_string()],
                vec!["b".to_string()]
            ]
        );
        // Another role on the same address is probed on its own (a combined test fleet).
        let mut prefill = target("a", "http://a");
        prefill.role = Role::Prefill;
        assert_eq!(
            by_engine(vec![target("a#dp0", "http://a"), prefill]).len(),
            2
        );
    }
}
