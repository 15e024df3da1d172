//! Which endpoints serve a request: the pair for a new request, another endpoint for a failed
//! leg. Reads the snapshot and the [`Routing`] handle (the policies, the cache index, health,
//! the per-endpoint cap and the retry budget); sends nothing.
//!
//! [`pair`] sees the request's model, its prefix view and the whole snapshot, and returns both
//! endpoints; with a `cache_aware` policy, [`cache_aware`] weighs cached prefixes and may choose
//! the decode first and serve the request there alone ([`Pair::decode_only`]). Both choose the
//! decode for a chosen prefill with the one filter [`decode_for`], which also chooses the decode
//! of a request no prefill serves (the passthrough paths).

mod cache_aware;

use std::sync::Arc;

use tracing::warn;

use crate::cache::PrefixView;
use crate::endpoints::{Endpoint, Snapshot};
use crate::error::{GatewayError, Leg};
use crate::limits::under_cap;
use crate::state::Routing;

/// The endpoints chosen for a request.
#[derive(Debug)]
pub(crate) struct Pair {
    pub(crate) prefill: Arc<Endpoint>,
    pub(crate) decode: Arc<Endpoint>,
    /// The decode serves the request alone: it holds (almost) all of the prompt already.
    pub(crate) decode_only: bool,
    /// Prompt tokens predicted cached where the prompt is computed (the prefill, or the decode
    /// when alone); `None` without cache-aware routing.
    pub(crate) predicted_cached: Option<u32>,
    /// Prompt tokens the prefill is predicted to compute (its uncached ones), counted in its
    /// load while the prefill leg runs; 0 where not predicted (no cache-aware prefill choice).
    pub(crate) prefill_tokens: u32,
    /// Prompt tokens whose KV the decode will hold, counted in its load while its leg runs (a
    /// cache-aware decode's cost weighs them); 0 where the prompt was not read.
    pub(crate) decode_tokens: u32,
}

/// Why no pair serves `model`. A LoRA adapter that no prefill or no decode holds does not
/// exist for a disaggregated request (both legs run it): vLLM's 404, as for an unknown model.
pub(super) fn no_pair(snap: &Snapshot, model: Option<&str>) -> GatewayError {
    let any_prefill = snap.prefill.iter().any(|p| p.serves(model));
    let any_decode = snap.decode.iter().any(|d| d.serves(model));
    let unheld_adapter = |m: &str| snap.adapter_parent(m).is_some() && !(any_prefill && any_decode);
    if let Some(m) = model
        && (unheld_adapter(m)
            || (!any_prefill
                && !any_decode
                && !snap.models.is_empty()
                && !snap.models.iter().any(|x| x == m)))
    {
        return GatewayError::ModelNotFound {
            model: m.to_string(),
        };
    }
    let what = match (any_prefill, any_decode) {
        (false, _) => "prefill",
        (true, false) => "decode",
        (true, true) => "prefill/decode pair (connectors disagree)",
    };
    GatewayError::NoEndpoint {
        what,
        model: model.unwrap_or_default().to_string(),
    }
}

/// `snap` with its decodes restricted to those named in `names` (`host:port`: a proxy's subset
/// hint, the endpoints it can send the request to; every data-parallel rank of a named engine
/// stays). None of them routable: 503.
pub(crate) fn within(
    snap: &Snapshot,
    names: &[String],
    model: Option<&str>,
) -> Result<Snapshot, GatewayError> {
    let decode: Vec<Arc<Endpoint>> = snap
        .decode
        .iter()
        .filter(|d| names.iter().any(|n| n == &d.name || n == d.engine_name()))
        .cloned()
        .collect();
    if decode.is_empty() {
        return Err(GatewayError::NoEndpoint {
            what: "decode (in the destination subset)",
            model: model.unwrap_or_default().to_string(),
        });
    }
    let mut within = Snapshot {
        encode: snap.encode.clone(),
        prefill: snap.prefill.clone(),
        decode,
        models: snap.models.clone(),
        adapters: snap.adapters.clone(),
        excluded: Vec::new(),
        roleset_pairing: snap.roleset_pairing,
        every_pair: snap.every_pair,
        same_models: snap.same_models,
        ..Snapshot::default()
    };
    within.index_loads();
    Ok(within)
}

/// Chooses a prefill and a decode endpoint that serve `model` and agree on the connector. With
/// a `cache_aware` policy and the request's prefix view, [`cache_aware::pair`] decides instead.
pub(crate) fn pair(
    routing: &Routing,
    snap: &Snapshot,
    model: Option<&str>,
    prefix: Option<&PrefixView>,
) -> Result<Pair, GatewayError> {
    if let (Some(cache), Some(view)) = (&routing.cache, prefix) {
        return cache_aware::pair(routing, cache, snap, model, view);
    }
    let compatible = |p: &Endpoint, d: &Endpoint| d.serves(model) && snap.pairs(p, d);
    let prefills: Vec<Arc<Endpoint>> = snap
        .prefill
        .iter()
        .filter(|p| p.serves(model) && snap.decode.iter().any(|d| compatible(p, d)))
        .cloned()
        .collect();
    let prefills = under_cap(
        routing.max_in_flight_per_endpoint,
        &routing.metrics,
        routing.health.hold_back_probed(prefills),
    )?;
    let Some(i) = routing.prefill_policy.pick(&prefills) else {
        return Err(no_pair(snap, model));
    };
    let prefill = prefills[i].clone();
    let decode = decode_for(routing, snap, model, Some(&prefill))?;
    Ok(Pair {
        prefill,
        decode,
        decode_only: false,
        predicted_cached: None,
        prefill_tokens: 0,
        decode_tokens: 0,
    })
}

/// The decode for a chosen `prefill` (`None`: a request no prefill serves, a passthrough path):
/// one that serves `model` and pairs with the prefill, under the per-endpoint cap, by the
/// decode policy. The one decode filter of both pairings and of the passthrough paths.
pub(crate) fn decode_for(
    routing: &Routing,
    snap: &Snapshot,
    model: Option<&str>,
    prefill: Option<&Endpoint>,
) -> Result<Arc<Endpoint>, GatewayError> {
    let decodes: Vec<Arc<Endpoint>> = snap
        .decode
        .iter()
        .filter(|d| d.serves(model) && prefill.is_none_or(|p| snap.pairs(p, d)))
        .cloned()
        .collect();
    let decodes = under_cap(
        routing.max_in_flight_per_endpoint,
        &routing.metrics,
        routing.health.hold_back_probed(decodes),
    )?;
    let j = routing
        .decode_policy
        .pick(&decodes)
        .ok_or_else(|| GatewayError::NoEndpoint {
            what: "decode",
            model: model.unwrap_or_default().to_string(),
        })?;
    Ok(decodes[j].clone())
}

/// Another endpoint for a failed `leg`, if `max_retries`, candidates and the retry budget
/// allow one. `tried` holds the endpoints already used for this leg. A prefill keeps the
/// connector (the decode was chosen for it); a decode must accept it. `snap` is the current
/// snapshot.
pub(crate) fn retry_target(
    routing: &Routing,
    snap: &Snapshot,
    leg: Leg,
    model: Option<&str>,
    prefill: &Endpoint,
    decode: &Endpoint,
    tried: &[String],
) -> Option<Arc<Endpoint>> {
    if tried.len() > routing.max_retries {
        return None;
    }
    let cap = routing.max_in_flight_per_endpoint;
    let connector = prefill.connector.as_deref().unwrap_or_default();
    let open = |e: &Arc<Endpoint>| {
        !tried.iter().any(|t| t == &e.name)
            && e.serves(model)
            && (cap == 0 || e.load.in_flight() < cap)
    };
    let (candidates, policy): (Vec<Arc<Endpoint>>, _) = match leg {
        Leg::Prefill => (
            snap.prefill
                .iter()
                .filter(|p| {
                    open(p)
                        && p.connector.as_deref().unwrap_or_default() == connector
                        && snap.pairs(p, decode)
                })
                .cloned()
                .collect(),
            &routing.prefill_policy,
        ),
        Leg::Decode => (
            snap.decode
                .iter()
                .filter(|d| open(d) && snap.pairs(prefill, d))
                .cloned()
                .collect(),
            &routing.decode_policy,
        ),
        // Encoder legs choose their own retries (`pd::encode`).
        Leg::Encode => return None,
    };
    let candidates = routing.health.hold_back_probed(candidates);
    // A lone candidate needs no policy (and takes no round-robin turn from new requests).
    let i = match candidates.len() {
        0 => return None,
        1 => 0,
        _ => policy.pick(&candidates)?,
    };
    if !routing.retry_budget.try_withdraw() {
        warn!(leg = %leg, "retry budget exhausted; not retrying");
        routing.metrics.count_retry_refused(leg);
        return None;
    }
    routing.metrics.count_retry(leg);
    Some(candidates[i].clone())
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use kvtransfer::{Pod, Registry};

    use super::*;
    use crate::endpoints::adapters::AdapterParents;
    use crate::endpoints::{LoadTable, SnapshotInputs, build_snapshot};

    fn pod(name: &str, role: &str) -> Pod {
        let mut p = Pod::new(name, "10.0.0.1", 8000).with_label("role-name", role);
        p.name = name.to_string();
        p.ready = true;
        p
    }

    #[test]
    fn an_adapter_no_decode_holds_is_not_found() {
        let reg = Registry::with_builtins();
        let sql: AdapterParents = [("sql".to_string(), "m".to_string())].into();
        let learned = BTreeMap::from([("p".to_string(), sql)]);
        let inputs = SnapshotInputs {
            registry: &reg,
            default_connector: "shfs",
            default_models: &["m".to_string()],
            unhealthy: &BTreeSet::new(),
            roleset_pairing: false,
            adapters: &learned,
        };
        let snap = build_snapshot(
            &[pod("p", "prefill"), pod("d", "decode")],
            &inputs,
            &LoadTable::default(),
        );
        let e = no_pair(&snap, Some("sql"));
        assert!(matches!(e, GatewayError::ModelNotFound { .. }), "{e:?}");
        // The base model has its pair; an unknown name is not found either.
        assert!(matches!(
            no_pair(&snap, Some("other")),
            GatewayError::ModelNotFound { .. }
        ));
    }
}
