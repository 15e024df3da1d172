//! A concurrent request's second chances, before any decode byte reached the client: blame by
//! evidence (a decode that gave up waiting for KV), another prefill for both legs, fresh
//! bootstrap facts for the same prefill, or the decode alone (fallback).

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::config::PrefillFailurePolicy;
use crate::endpoints::Endpoint;
use crate::engine::client;
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::pd::decode_head::decode_last;
use crate::pd::{Answer, Exchange, Pd, abort, select};
use crate::state::Gateway;

/// Longest a request waits for the reconciler to look a prefill's bootstrap facts up again.
pub(crate) const REQUERY_WAIT: Duration = Duration::from_secs(2);

/// Why a request leaves its prefill, for the log: a prefill taken out of rotation while the
/// request waited did not fail it.
pub(crate) fn why_moved(err: &GatewayError) -> &'static str {
    if err.is_release() {
        "prefill taken out of rotation while the request waited"
    } else {
        "prefill failed"
    }
}

/// A decode failed on `prefill`'s KV with a bootstrap-based connector (Mooncake): asks for the
/// prefill's facts to be looked up again and waits (at most [`REQUERY_WAIT`]) for the round.
/// When they changed (the prefill restarted with a new engine id, the decode refused the old
/// one), gives the prefill's endpoint with the fresh facts: the failure was nobody's, and the
/// request can run again on it. `None`: the facts still hold (the failure stands).
pub(crate) async fn fresh_prefill(gw: &Gateway, prefill: &Endpoint) -> Option<Arc<Endpoint>> {
    let ticket = gw.requery.ask(&prefill.name);
    if !gw.requery.wait(ticket, REQUERY_WAIT).await {
        return None;
    }
    let snapshot = gw.store.load();
    let now = snapshot.prefill.iter().find(|p| p.name == prefill.name)?;
    (now.pod.mooncake_bootstrap.is_some()
        && now.pod.mooncake_bootstrap != prefill.pod.mooncake_bootstrap)
        .then(|| now.clone())
}

/// Runs both legs again on `fresh` (the same prefill, its bootstrap facts looked up again) after
/// a decode refused the stale ones: the decode drops the request first.
pub(crate) async fn retry_on_fresh_facts(
    gw: &Gateway,
    pd: &mut Pd,
    ex: &mut Exchange,
    decode: &Endpoint,
    fresh: Arc<Endpoint>,
) -> Result<(), GatewayError> {
    let request_id = ex.request_id.as_str();
    warn!(id = %request_id, prefill = %pd.prefill.name, decode = %decode.name, "decode failed on the prefill's stale bootstrap facts (its engine id changed); retrying once on fresh ones");
    abort::abort_now(gw, pd.agent.as_ref(), decode, request_id).await;
    pd.switch_prefill(request_id, fresh)?;
    ex.touched(pd);
    gw.metrics.count_retry(Leg::Prefill);
    if let Some(r) = ex.record() {
        r.trace().retried();
    }
    Ok(())
}

/// A decode gave up waiting for KV (a late 5xx or first-frame error event) while its concurrent
/// prefill had not answered: logged, counted against the prefill, and returned as the prefill's
/// (retryable) failure.
pub(crate) fn kv_wait_failure(
    gw: &Gateway,
    pd: &Pd,
    request_id: &str,
    decode: &str,
    waited: Duration,
) -> GatewayError {
    warn!(
        id = %request_id,
        prefill = %pd.prefill.name,
        decode,
        ?waited,
        "decode gave up waiting for KV while the prefill had not answered; blaming the prefill"
    );
    gw.health.observe(&pd.prefill.name, Err(Cause::KvWait));
    if pd.agent.needs_bootstrap_lookup() {
        gw.requery.ask(&pd.prefill.name);
    }
    client::upstream(
        Leg::Prefill,
        pd.prefill.target(),
        UpstreamKind::Timeout,
        format!("did not hand its KV over within {waited:?}"),
    )
}

/// A concurrent prefill failed before any decode byte reached the client: moves `pd` to
/// another prefill (the caller restarts both legs), or gives the error back.
pub(crate) async fn retry_both_legs(
    gw: &Gateway,
    pd: &mut Pd,
    ex: &mut Exchange,
    tried: &mut Vec<String>,
    err: GatewayError,
) -> Result<(), GatewayError> {
    let request_id = ex.request_id.as_str();
    let next = if err.retryable() {
        select::retry_target(
            gw,
            Leg::Prefill,
            pd.model.as_deref(),
            &pd.prefill,
            &pd.decode,
            tried,
        )
    } else {
        None
    };
    let Some(next) = next else {
        return Err(err);
    };
    let why = why_moved(&err);
    warn!(id = %request_id, from = %pd.prefill.name, to = %next.name, error = %err, "{why} before the first decode byte; retrying both legs");
    // The decode must drop the request before the retry reuses its id.
    abort::abort_now(gw, pd.agent.as_ref(), &pd.decode, request_id).await;
    tried.push(next.name.clone());
    pd.switch_prefill(request_id, next)?;
    ex.touched(pd);
    if let Some(r) = ex.record() {
        r.trace().retried();
    }
    Ok(())
}

/// The concurrent prefill failed for good before any decode byte reached the client. With
/// `on_prefill_failure = "fallback"` and a connector whose decode can serve a plain request
/// ([`kvtransfer::KvTransferAgent::allows_decode_only`]), the decode serves the client's request
/// alone, marked `x-pdgate-fallback`; otherwise the decode is told to drop the request and the
/// error goes back. A client error (the prefill refused the request) never falls back.
pub(crate) async fn fall_back(
    ex: &mut Exchange,
    mut pd: Pd,
    err: GatewayError,
) -> Result<Answer, GatewayError> {
    let gw = ex.gw.clone();
    let fallback = gw.config.legs.on_prefill_failure == PrefillFailurePolicy::Fallback
        && pd.agent.allows_decode_only()
        && !err.status().is_client_error();
    // The decode must drop the bootstrapped request before its id is reused (or given up).
    if !fallback {
        abort::abort_later(&gw, pd.agent.as_ref(), &pd.decode, &ex.request_id);
        return Err(err);
    }
    abort::abort_now(&gw, pd.agent.as_ref(), &pd.decode, &ex.request_id).await;
    let why = why_moved(&err);
    warn!(id = %ex.request_id, prefill = %pd.prefill.name, error = %err, "{why}; decode serves the request alone");
    gw.metrics.count_fallback(pd.served.connector);
    pd.served.fallback = true;
    pd.prefill_cached = None;
    // A plain request: no transfer state (an id naming the failed prefill) goes with it.
    pd.restart(&ex.request_id);
    let body = pd.clean.to_bytes();
    decode_last(ex, pd, body, false).await
}
