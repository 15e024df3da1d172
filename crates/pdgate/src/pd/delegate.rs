//! The PD flow when another proxy carries the decode leg (Envoy, with pdgate as its external
//! processor): the same plan ([`super::plan`]) and the same prefill legs as the proxy's flows,
//! ending with the decode leg's request (its body, its request id, its endpoint) handed to that
//! proxy instead of sent. What the proxy's relay holds until the decode's body ends (the
//! decode's load, a concurrent prefill, the engine abort) comes back with it, for the caller to
//! hold until the proxy reports that end.

use std::sync::Arc;

use bytes::Bytes;
use kvtransfer::Dispatch;
use tokio_util::task::AbortOnDropHandle;

use crate::endpoints::LoadGuard;
use crate::error::GatewayError;
use crate::pd::abort::AbortOnLeave;
use crate::pd::relay::PartnerResult;
use crate::pd::{Exchange, Pd, Plan, legs};

/// Who runs the prefill leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrefillBy {
    /// pdgate, as the proxy does: before the decode's request (sequential connectors) or beside
    /// it (concurrent ones).
    Gateway,
    /// A sidecar beside the decode engine (llm-d's form): pdgate names the prefill and the decode
    /// gets the client's request.
    Sidecar,
}

/// The decode leg, ready for another proxy to send, and what it holds meanwhile.
pub(crate) struct Delegated {
    /// The request's state (served endpoints, the prefill's cached tokens, the agent).
    pub(crate) pd: Pd,
    /// The decode leg's body: the agent's, or the client's without transfer fields.
    pub(crate) body: Bytes,
    /// The decode leg's `x-request-id` (a connector may address its engines through it).
    pub(crate) leg_request_id: String,
    /// A concurrent connector's prefill leg, running beside the decode.
    pub(crate) partner: Option<AbortOnDropHandle<PartnerResult>>,
    /// The decode's load, held until its response ends.
    pub(crate) _decode_load: LoadGuard,
    /// The prefill a sidecar calls, counted on it until the decode's head.
    pub(crate) sidecar_prefill: Option<LoadGuard>,
    /// The agent's engine abort, sent when the response does not end cleanly.
    pub(crate) abort: Option<AbortOnLeave>,
}

/// Runs the prefill side of `plan` (or leaves it to a sidecar) and shapes the decode leg.
pub(crate) async fn delegate(
    ex: &mut Exchange,
    plan: Plan,
    by: PrefillBy,
) -> Result<Delegated, GatewayError> {
    let gw = ex.gw.clone();
    let Plan {
        mut pd,
        decode_only,
    } = plan;
    let mut partner = None;
    let mut sidecar_prefill = None;
    let body = if decode_only {
        pd.clean.to_bytes()
    } else {
        match (by, pd.agent.dispatch()) {
            (PrefillBy::Sidecar, _) => {
                sidecar_prefill = Some(LoadGuard::computing(&pd.prefill.load, pd.prefill_tokens));
                pd.clean.to_bytes()
            }
            // Boxed like the proxy's flows: the prefill leg's future is large.
            (PrefillBy::Gateway, Dispatch::Sequential) => {
                Box::pin(legs::prefill_and_merge(ex, &mut pd)).await?
            }
            (PrefillBy::Gateway, Dispatch::Concurrent) => {
                let limit = legs::concurrent_prefill_limit(&gw);
                let ec = pd.encode_for_prefill(&gw, &ex.request_id).await?;
                partner = Some(legs::start_prefill(
                    &gw,
                    &ex.request_id,
                    &mut pd,
                    limit,
                    ec,
                )?);
                pd.ctx.req_body.clone()
            }
        }
    };
    let leg_request_id = (pd.ctx.transfer.leg_request_id.as_deref())
        .unwrap_or(&ex.request_id)
        .to_string();
    let decode_load = LoadGuard::acquire(&pd.decode.load);
    gw.health.begin(&pd.decode.name);
    let abort = AbortOnLeave::new(
        &gw,
        pd.agent.as_ref(),
        Arc::clone(&pd.decode),
        &ex.request_id,
    );
    Ok(Delegated {
        pd,
        body,
        leg_request_id,
        partner,
        _decode_load: decode_load,
        sidecar_prefill,
        abort,
    })
}
