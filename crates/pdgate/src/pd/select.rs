//! Which endpoints serve a request: the pair for a new request, another endpoint for a failed
//! leg. Reads the snapshot, the policies, the per-endpoint cap and the retry budget; sends
//! nothing.
//!
//! The seam for smarter choices (prefix-cache-aware selection, choosing the decode first) is
//! [`pair`]: it sees the request's model and the whole snapshot, and returns both endpoints.

use std::sync::Arc;

use tracing::warn;

use crate::endpoints::{Endpoint, Snapshot};
use crate::error::{GatewayError, Leg};
use crate::limits::under_cap;
use crate::state::Gateway;

/// Chooses a prefill and a decode endpoint that serve `model` and agree on the connector.
pub(crate) fn pair(
    gw: &Gateway,
    snap: &Snapshot,
    model: Option<&str>,
) -> Result<(Arc<Endpoint>, Arc<Endpoint>), GatewayError> {
    let model_name = || model.unwrap_or_default().to_string();
    let compatible = |p: &Endpoint, d: &Endpoint| d.serves(model) && snap.pairs(p, d);
    let prefills: Vec<Arc<Endpoint>> = snap
        .prefill
        .iter()
        .filter(|p| p.serves(model) && snap.decode.iter().any(|d| compatible(p, d)))
        .cloned()
        .collect();
    let prefills = under_cap(gw.config.max_in_flight_per_endpoint, &gw.metrics, prefills)?;
    let Some(i) = gw.prefill_policy.pick(&prefills) else {
        let any_prefill = snap.prefill.iter().any(|p| p.serves(model));
        let any_decode = snap.decode.iter().any(|d| d.serves(model));
        if let Some(m) = model
            && !any_prefill
            && !any_decode
            && !snap.models.is_empty()
            && !snap.models.iter().any(|x| x == m)
        {
            return Err(GatewayError::ModelNotFound {
                model: m.to_string(),
            });
        }
        let what = match (any_prefill, any_decode) {
            (false, _) => "prefill",
            (true, false) => "decode",
            (true, true) => "prefill/decode pair (connectors disagree)",
        };
        return Err(GatewayError::NoEndpoint {
            what,
            model: model_name(),
        });
    };
    let prefill = prefills[i].clone();
    let decodes: Vec<Arc<Endpoint>> = snap
        .decode
        .iter()
        .filter(|d| compatible(&prefill, d))
        .cloned()
        .collect();
    let decodes = under_cap(gw.config.max_in_flight_per_endpoint, &gw.metrics, decodes)?;
    let j = gw
        .decode_policy
        .pick(&decodes)
        .ok_or_else(|| GatewayError::NoEndpoint {
            what: "decode",
            model: model_name(),
        })?;
    Ok((prefill, decodes[j].clone()))
}

/// Another endpoint for a failed `leg`, if `max_retries`, candidates and the retry budget
/// allow one. `tried` holds the endpoints already used for this leg. A prefill keeps the
/// connector (the decode was chosen for it); a decode must accept it.
pub(crate) fn retry_target(
    gw: &Gateway,
    leg: Leg,
    model: Option<&str>,
    prefill: &Endpoint,
    decode: &Endpoint,
    tried: &[String],
) -> Option<Arc<Endpoint>> {
    if tried.len() > gw.config.max_retries as usize {
        return None;
    }
    let snap = gw.store.load();
    let cap = gw.config.max_in_flight_per_endpoint;
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
            &gw.prefill_policy,
        ),
        Leg::Decode => (
            snap.decode
                .iter()
                .filter(|d| open(d) && snap.pairs(prefill, d))
                .cloned()
                .collect(),
            &gw.decode_policy,
        ),
    };
    // A lone candidate needs no policy (and takes no round-robin turn from new requests).
    let i = match candidates.len() {
        0 => return None,
        1 => 0,
        _ => policy.pick(&candidates)?,
    };
    if !gw.retry_budget.try_withdraw() {
        warn!(leg = %leg, "retry budget exhausted; not retrying");
        gw.metrics.count_retry_refused(leg);
        return None;
    }
    gw.metrics.count_retry(leg);
    Some(candidates[i].clone())
}
