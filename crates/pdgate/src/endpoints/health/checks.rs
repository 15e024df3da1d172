//! The active checker: `GET /health` (plus Mooncake's `/query`, and `/v1/models` where nobody
//! configured the models) on every endpoint each `health_check_interval`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Health, HealthConfig, ProbeTarget};
use crate::engine::EnginePool;
use crate::engine::probe::{ProbeError, get_ok};

/// One check's outcome: the endpoint, whether it passed, the models it named (if asked).
type Checked = (String, Result<(), ProbeError>, Option<Vec<String>>);

async fn probe(client: EnginePool, target: ProbeTarget, limit: Duration) -> Checked {
    let mut result = get_ok(&client, &target.health_url, limit).await;
    if result.is_ok()
        && let Some(q) = &target.query_url
    {
        result = get_ok(&client, q, limit).await;
    }
    let mut models = None;
    if result.is_ok()
        && let Some(url) = &target.models_url
    {
        models = learn_models(&client, url, target.authorization.as_ref(), limit).await;
    }
    (target.name, result, models)
}

/// The model ids of an OpenAI `/v1/models` answer; `None` when it cannot be had (the check
/// itself still passed: `/health` decides that).
async fn learn_models(
    client: &EnginePool,
    url: &str,
    authorization: Option<&http::HeaderValue>,
    limit: Duration,
) -> Option<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Model {
        id: String,
    }
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Model>,
    }
    match crate::engine::probe::get_with(client, url, authorization, limit, 256 * 1024).await {
        Ok((status, body)) if status.is_success() => serde_json::from_slice::<List>(&body)
            .ok()
            .map(|l| l.data.into_iter().map(|m| m.id).collect()),
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
            for target in health.targets() {
                probes.spawn(probe(client.clone(), target, config.health_check_timeout));
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            Some(done) = probes.join_next(), if !probes.is_empty() => {
                if let Ok((name, result, models)) = done {
                    if let Some(models) = models {
                        health.learned(&name, models);
                    }
                    match result {
                        Ok(()) => health.check_result(&name, true, ""),
                        Err(why) => health.check_result(&name, false, &why.to_string()),
                    }
                }
            }
            _ = tokio::time::sleep(tick) => {}
        }
    }
}
