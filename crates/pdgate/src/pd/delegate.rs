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
use crate::pd::{Exchange, legs};

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

/// The decode leg, ready for another proxy to send, and what it holds meanwhile (the request's
/// state stays in its [`Exchange`]).
pub(crate) struct Delegated {
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

/// Runs the prefill side of the planned exchange `ex` (or leaves it to a sidecar) and shapes
/// the decode leg.
pub(crate) async fn delegate(ex: &mut Exchange, by: PrefillBy) -> Result<Delegated, GatewayError> {
    let mut partner = None;
    let mut sidecar_prefill = None;
    let body = if ex.alone() {
        ex.plain_body()
    } else {
        match (by, ex.agent().dispatch()) {
            (PrefillBy::Sidecar, _) => {
                let prefill = ex.prefill();
                sidecar_prefill = Some(LoadGuard::computing(&prefill.load, ex.prefill_tokens()));
                ex.plain_body()
            }
            // Boxed like the proxy's flows: the prefill leg's future is large.
            (PrefillBy::Gateway, Dispatch::Sequential) => {
                match Box::pin(legs::prefill_and_merge(ex)).await? {
                    Some(body) => body,
                    // The prefill failed: the decode serves the client's request alone.
                    None => ex.plain_body(),
                }
            }
            (PrefillBy::Gateway, Dispatch::Concurrent) => {
                let limit = ex.settings().concurrent_prefill_timeout;
                let request = ex.prefill_request().await?;
                partner = Some(legs::start_prefill(ex, limit, request)?);
                ex.decode_body()
            }
        }
    };
    let leg_request_id = ex.leg_request_id().to_string();
    let decode = ex.decode();
    let decode_load = LoadGuard::computing(&decode.load, ex.decode_tokens());
    let engines = ex.engines();
    engines.health.begin(&decode.name);
    let abort = AbortOnLeave::new(engines, ex.agent(), Arc::clone(decode), ex.request_id());
    Ok(Delegated {
        body,
        leg_request_id,
        partner,
        _decode_load: decode_load,
        sidecar_prefill,
        abort,
    })
}
