//! Where endpoints come from, and what is learnt about them before they are routable.
//!
//! A source (the static configuration, the watched config file in [`file`], Kubernetes via
//! `pdkube`) publishes `Vec<Pod>` on a watch channel; [`reconcile`] follows it, does the
//! bootstrap lookups an agent asks for ([`kvtransfer::KvTransferAgent::needs_bootstrap_lookup`],
//! Mooncake's `/query`), keeps the health checker's targets in step, and publishes a new
//! snapshot only when something changed. All I/O here is off the request path.

pub(crate) mod file;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtransfer::{MooncakeBootstrap, Pod};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::endpoints::Role;
use crate::endpoints::health::ProbeTarget;
use crate::engine::probe::{self, ProbeError};
use crate::state::{Gateway, PodSet};

/// Whether `pod` is a prefill whose agent needs bootstrap facts looked up.
fn needs_lookup(gw: &Gateway, pod: &Pod) -> bool {
    pod.label(kvtransfer::labels::ROLE_NAME) == Some("prefill")
        && gw
            .agent_for(pod)
            .is_some_and(|a| a.needs_bootstrap_lookup())
}

/// What active health checks probe for `pods`: `/health`, plus the bootstrap server's `/query`
/// where the agent depends on it. One target per data-parallel rank (health is per rank; the
/// checker probes the engine once for all of them).
pub(crate) fn probe_targets(gw: &Gateway, pods: &[Pod]) -> Vec<ProbeTarget> {
    pods.iter()
        .filter_map(|pod| {
            let ranks = crate::endpoints::ranks::targets(pod).ok()?;
            Some(ranks.into_iter().filter_map(move |(name, _)| {
                let mut target = probe_target(gw, pod)?;
                target.name = name;
                Some(target)
            }))
        })
        .flatten()
        .collect()
}

/// The engine's probe (named after the pod).
fn probe_target(gw: &Gateway, pod: &Pod) -> Option<ProbeTarget> {
    let role = Role::of_label(pod.label(kvtransfer::labels::ROLE_NAME))?;
    let base = crate::endpoints::base_url(pod)?;
    let query_url = if needs_lookup(gw, pod) {
        let host = pod.url_host()?;
        Some(format!(
            "http://{host}:{}/query",
            pod.mooncake_bootstrap_port()
        ))
    } else {
        None
    };
    // Models nobody configured are learned from the engine; its adapters always are.
    let unknown_models =
        pod.label(kvtransfer::labels::MODEL_NAME).is_none() && gw.config.models.is_empty();
    let models_url = (role != Role::Encode).then(|| format!("{base}/v1/models"));
    Some(ProbeTarget {
        name: pod.name.clone(),
        role,
        health_url: format!("{base}/health"),
        query_url,
        models_url,
        learn_models: unknown_models,
        authorization: gw.engines.engine_authorization.clone(),
    })
}

#[derive(Debug)]
struct CachedBootstrap {
    key: (Option<String>, u16),
    info: MooncakeBootstrap,
    fetched: Instant,
}

/// GET `/health` then `/query` on a Mooncake prefill, each bounded.
async fn lookup_bootstrap(gw: &Gateway, pod: &Pod) -> Result<MooncakeBootstrap, LookupError> {
    let host = pod.url_host().ok_or(LookupError::NoIp)?;
    let port = pod.mooncake_bootstrap_port();
    let get = |url: String| async move {
        probe::get(&gw.engines.client, &url, LOOKUP_TIMEOUT, LOOKUP_MAX_BODY).await
    };
    let (status, _) = get(format!("http://{host}:{}/health", pod.http_port)).await?;
    if !status.is_success() {
        return Err(LookupError::Unhealthy(status));
    }
    let (status, body) = get(format!("http://{host}:{port}/query")).await?;
    Ok(kvtransfer::parse_mooncake_bootstrap(
        port,
        status.as_u16(),
        &body,
    )?)
}

fn engine_ids(info: &MooncakeBootstrap) -> Vec<&str> {
    info.ranks.values().map(|r| r.engine_id.as_str()).collect()
}

/// Bound on each request of a bootstrap lookup.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest `/query` answer read.
const LOOKUP_MAX_BODY: usize = 1024 * 1024;

/// Why a bootstrap lookup failed.
#[derive(Debug, thiserror::Error)]
enum LookupError {
    #[error("pod has no IP")]
    NoIp,
    #[error("/health answered {0}")]
    Unhealthy(http::StatusCode),
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error(transparent)]
    Bootstrap(#[from] kvtransfer::BootstrapError),
}

/// Follows discovery: enriches pods with bootstrap information and publishes a new snapshot
/// whenever the result changes. Ends when `cancel` fires or discovery goes away.
pub(crate) async fn reconcile(
    gw: Arc<Gateway>,
    mut pods: watch::Receiver<PodSet>,
    cancel: CancellationToken,
) {
    let mut cache: HashMap<String, CachedBootstrap> = HashMap::new();
    let mut last = String::new();
    let mut last_targets = Vec::new();
    let mut was_down = std::collections::BTreeSet::new();
    loop {
        // Asked by requests (a decode failed on that prefill's KV), or back from being down: a
        // restarted prefill has a new engine id.
        let (mut asked, ticket) = gw.requery.take();
        let down = gw.health.unhealthy();
        asked.extend(was_down.difference(&down).cloned());
        was_down = down;
        let current = pods.borrow_and_update().clone();
        let targets = probe_targets(&gw, &current);
        if targets != last_targets {
            gw.health.sync(targets.clone());
            last_targets = targets;
        }
        let mut enriched: Vec<Pod> = Vec::with_capacity(current.len());
        let mut missing = false;
        for pod in current.iter() {
            let mut pod = pod.clone();
            if needs_lookup(&gw, &pod) && pod.mooncake_bootstrap.is_none() {
                let key = (pod.ip.clone(), pod.mooncake_bootstrap_port());
                let fresh = !asked.contains(&pod.name)
                    && cache.get(&pod.name).is_some_and(|c| {
                        c.key == key && c.fetched.elapsed() < gw.config.discovery.bootstrap_refresh
                    });
                if !fresh {
                    match lookup_bootstrap(&gw, &pod).await {
                        Ok(info) => {
                            if let Some(old) = cache.get(&pod.name)
                                && old.info != info
                            {
                                info!(pod = %pod.name, before = ?engine_ids(&old.info), now = ?engine_ids(&info), "mooncake bootstrap facts changed (the prefill restarted)");
                            }
                            cache.insert(
                                pod.name.clone(),
                                CachedBootstrap {
                                    key,
                                    info,
                                    fetched: Instant::now(),
                                },
                            );
                        }
                        Err(e) => {
                            warn!(pod = %pod.name, error = %e, "mooncake bootstrap lookup failed");
                            // Keep the last good answer only while the pod keeps its address.
                            if cache.get(&pod.name).is_some_and(|c| c.key != key) {
                                cache.remove(&pod.name);
                            }
                        }
                    }
                }
                pod.mooncake_bootstrap = cache.get(&pod.name).map(|c| c.info.clone());
                missing |= pod.mooncake_bootstrap.is_none();
            }
            enriched.push(pod);
        }
        cache.retain(|name, _| current.iter().any(|p| &p.name == name));
        let unhealthy = gw.health.unhealthy();
        let adapters = gw.health.adapters();
        let fingerprint = format!("{enriched:?}{unhealthy:?}{adapters:?}");
        if fingerprint != last {
            let snap = gw.publish(&enriched, &unhealthy);
            gw.metrics.count_discovery_change();
            info!(
                prefill = snap.prefill.len(),
                decode = snap.decode.len(),
                excluded = snap.excluded.len(),
                "endpoint set updated"
            );
            for (name, why) in &snap.excluded {
                info!(endpoint = %name, reason = %why, "endpoint not routable");
            }
            last = fingerprint;
        }
        gw.requery.finished(ticket);
        let wait = if missing {
            Duration::from_secs(1)
        } else {
            gw.config.discovery.bootstrap_refresh
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = pods.changed() => if changed.is_err() { return },
            _ = gw.health.changed() => {}
            _ = gw.requery.asked() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
