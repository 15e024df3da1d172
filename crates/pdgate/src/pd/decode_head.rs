//! The decode leg up to its response head, shared by every flow (sequential, concurrent,
//! decode-only and the fallback): connect failures retried on another decode, and a decode taken
//! out of rotation while the request waits (nothing reached the client) given up at once and the
//! request moved, once, to another decode ([`send`]). The flows that end with the decode alone
//! (by choice, or after a failed prefill) send it here ([`decode_last`]), and every flow relays
//! a head that no prefill still runs beside through [`relay_head`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use tracing::{Instrument, info_span, warn};

use crate::endpoints::{Endpoint, LoadGuard};
use crate::engine::EngineBody;
use crate::engine::client::{self, LegRequest};
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::pd::{Answer, Exchange, Pd, abort, relay, select};
use crate::state::Gateway;

/// A decode's response head with the endpoint that sent it and the load it holds.
pub(crate) type DecodeHead = (Response<EngineBody>, Arc<Endpoint>, LoadGuard);

/// Whether `err` is a decode leg given up because its endpoint went down meanwhile.
fn released(err: &GatewayError) -> bool {
    err.is_release() && err.source_of() == crate::error::Source::Engine(Leg::Decode)
}

/// The span of the decode leg up to its response head (`retries`: connect failures retried).
fn decode_span(request_id: &str, endpoint: &str, decode_only: bool) -> tracing::Span {
    info_span!(
        "decode",
        request_id,
        endpoint,
        otel.kind = "client",
        decode_only,
        retries = tracing::field::Empty,
    )
}

/// Sends `body` as the decode leg of `pd` and waits for its head ([`decode_head`]), also giving
/// how long the head took. A decode taken out of rotation meanwhile is given up at once; the
/// first time (`moved` false) the request moves to another decode, the old one is told to drop
/// it, and `Ok(None)` asks the caller to send again (after a new prefill when the body carried
/// the old decode's hand-over). Otherwise the release is the error.
pub(crate) async fn send(
    ex: &mut Exchange,
    pd: &mut Pd,
    body: Bytes,
    moved: &mut bool,
    decode_only: bool,
) -> Result<Option<(DecodeHead, Duration)>, GatewayError> {
    let gw = ex.gw.clone();
    let span = decode_span(&ex.request_id, &pd.decode.name, decode_only);
    match decode_head(&gw, pd, &ex.request_id, body)
        .instrument(span)
        .await
    {
        Err(err) if !*moved && released(&err) => {
            let Some(next) = another_decode(&gw, ex, pd) else {
                return Err(err);
            };
            *moved = true;
            abort::abort_later(&gw, pd.agent.as_ref(), &pd.decode, &ex.request_id);
            pd.restart(&ex.request_id);
            pd.switch_decode(next);
            ex.touched(pd);
            Ok(None)
        }
        head => head.map(Some),
    }
}

/// Resolves once `endpoint` is taken out of rotation, when legs waiting on it are to be given up
/// then (`reliability.retry_on_ejection`); pending otherwise. Both legs select on it.
pub(crate) async fn went_down(gw: &Gateway, endpoint: &str) {
    if gw.config.reliability.retry_on_ejection {
        gw.health.went_down(endpoint).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// Another decode for a request whose decode went down before its head; `None` when there is
/// none (or the retry budget is spent).
fn another_decode(gw: &Gateway, ex: &mut Exchange, pd: &Pd) -> Option<Arc<Endpoint>> {
    let tried = [pd.decode.name.clone()];
    let model = pd.model.as_deref();
    let next = select::retry_target(gw, Leg::Decode, model, &pd.prefill, &pd.decode, &tried)?;
    warn!(id = %ex.request_id, from = %pd.decode.name, to = %next.name, "decode taken out of rotation before its answer; moving the request to another decode");
    if let Some(r) = ex.record() {
        r.trace().retried();
    }
    Some(next)
}

/// Sends the decode leg and waits for its response head within the decode timeout; also gives
/// how long the head took. A connection failure (nothing was sent) is retried on another decode
/// endpoint; a decode taken out of rotation meanwhile ends the wait at once
/// (`reliability.retry_on_ejection`). A 5xx head is the caller's to blame (the decode's own
/// failure, or for a concurrent connector possibly the prefill's).
async fn decode_head(
    gw: &Gateway,
    pd: &Pd,
    request_id: &str,
    body: Bytes,
) -> Result<(DecodeHead, Duration), GatewayError> {
    let request_id = pd
        .ctx
        .transfer
        .leg_request_id
        .as_deref()
        .unwrap_or(request_id);
    let mut endpoint = pd.decode.clone();
    let mut tried = vec![endpoint.name.clone()];
    loop {
        let load = LoadGuard::acquire(&endpoint.load);
        gw.health.begin(&endpoint.name);
        let leg = LegRequest {
            leg: Leg::Decode,
            endpoint: endpoint.target(),
            path: pd.route.path(),
            method: Method::POST,
            body: body.clone(),
            request_id,
            headers: &pd.forwarded,
            extra: &[],
        };
        let sent = tokio::time::Instant::now();
        let head = tokio::select! {
            head = client::send_within(&gw.client, leg, gw.config.legs.decode_timeout) => head,
            // Already counted (that is why it is down): not observed again.
            () = went_down(gw, &endpoint.name) => return Err(client::upstream(Leg::Decode, endpoint.target(), UpstreamKind::Released, "was taken out of rotation while the request waited for its answer".into())),
        };
        match head {
            // A decode's success is counted when its body ends cleanly (the relay), not at the
            // head: a decode that breaks its streams after a 200 must not look healthy.
            Ok(head) => return Ok(((head, endpoint, load), sent.elapsed())),
            Err(err) => {
                gw.health.observe(&endpoint.name, Err(Cause::of(&err)));
                if err.is_connect_failure()
                    && let Some(next) = select::retry_target(
                        gw,
                        Leg::Decode,
                        pd.model.as_deref(),
                        &pd.prefill,
                        &endpoint,
                        &tried,
                    )
                {
                    warn!(id = %request_id, from = %endpoint.name, to = %next.name, "decode unreachable; retrying on another decode");
                    tracing::Span::current()
                        .record("retries", i64::try_from(tried.len()).unwrap_or(i64::MAX));
                    tried.push(next.name.clone());
                    endpoint = next;
                    continue;
                }
                return Err(err);
            }
        }
    }
}

/// The decode alone, by choice: it holds (almost) all of the prompt in its own cache, so the
/// client's request goes to it as a plain request, with no prefill leg and no transfer fields.
pub(crate) async fn decode_only(ex: &mut Exchange, pd: Pd) -> Result<Answer, GatewayError> {
    let body = pd.clean.to_bytes();
    decode_last(ex, pd, body, true).await
}

/// Sends `body` as the decode leg (no prefill leg left running) and relays its response; a
/// decode taken out of rotation before its head hands the same body to another decode (once).
pub(crate) async fn decode_last(
    ex: &mut Exchange,
    mut pd: Pd,
    body: Bytes,
    decode_only: bool,
) -> Result<Answer, GatewayError> {
    let mut moved = false;
    loop {
        let sent = send(ex, &mut pd, body.clone(), &mut moved, decode_only);
        if let Some((head, _)) = sent.await? {
            return relay_head(ex, pd, head);
        }
    }
}

/// Relays the decode's response (no prefill leg left running).
pub(crate) fn relay_head(
    ex: &mut Exchange,
    mut pd: Pd,
    head: DecodeHead,
) -> Result<Answer, GatewayError> {
    let gw = ex.gw.clone();
    let (head, decode, decode_load) = head;
    if head.status().is_server_error() {
        gw.health.observe(&decode.name, Err(Cause::ServerError));
    }
    gw.health.model_refused(head.status());
    pd.switch_decode(decode);
    let record = ex.take_record()?;
    Ok(relay::respond(
        &gw,
        &ex.request_id,
        head,
        pd,
        decode_load,
        None,
        None,
        record,
    ))
}
