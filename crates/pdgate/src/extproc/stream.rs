//! One ext_proc stream: one client request as the proxy reports it, message by message.
//!
//! Request headers (checked: route, method, client key, head size) -> request body (buffered,
//! or streamed and collected here, bounded) -> the decision: the PD plan, the prefill leg (or a
//! sidecar named), and the decode's request as mutations with its destination -> response
//! headers (the serving endpoints, the record) -> response body chunks (usage, error events)
//! up to `end_of_stream`, where the decode's load, the admission slot and the engine abort are
//! released, as the proxy's relay does at its body's end. A stream that closes or resets
//! before that end drops them the same way (the record counts a cancelled request). Every wait
//! for the proxy's next message is bounded by the timeout the proxy's own edge uses there.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    processing_request,
};
use futures_util::FutureExt;
use http::header::{self, HeaderMap};
use http::{Method, StatusCode};
use std::sync::Arc;
use tracing::{Instrument, debug};

use crate::engine::guarded::OnEnd;
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::extproc::wire;
use crate::headers;
use crate::http::edge;
use crate::limits::Slot;
use crate::metrics::{Cause, RequestRecord};
use crate::pd::delegate::{self, Delegated, PrefillBy};
use crate::pd::relay::{self, PartnerResult};
use crate::pd::{self, Exchange, Route, usage};
use crate::security::auth::Pass;
use crate::state::Gateway;

/// What the next message answers, or how the stream ends.
enum Step {
    /// Answer and go on.
    Answer(ProcessingResponse),
    /// Answer and end the stream (an immediate response: the proxy stops processing).
    Last(ProcessingResponse),
    /// End the stream with a gRPC status.
    Fail(tonic::Status),
    /// The proxy closed (or reset) the stream.
    End,
}

/// Where the request is.
enum Phase {
    /// Nothing yet: the request headers come first.
    Headers,
    /// Headers checked; the body is being collected.
    Body(Box<Pending>),
    /// Decided: the proxy sends the decode's request; its response is relayed through here.
    Relay(Box<Relay>),
    /// The response ended; trailers (if any) and the stream's close are left.
    Done,
}

/// A request whose body is on its way.
struct Pending {
    record: RequestRecord,
    route: Route,
    headers: HeaderMap,
    pass: Pass,
    body: BytesMut,
}

/// A decided request, held until its response ends (dropped early: a reset).
struct Relay {
    ex: Box<Exchange>,
    delegated: Delegated,
    // Held for the request's life, like the proxy's answer holds them (`auth::hold`).
    _slot: Slot,
    _pass: Pass,
    /// The response head arrived.
    head: bool,
    sse: bool,
    /// The decode answered 5xx (counted at the head, not again at the end).
    server_error: bool,
    /// The decode sent an SSE error event.
    error_event: bool,
}

/// One stream's state.
pub(crate) struct Session {
    gw: Arc<Gateway>,
    by: PrefillBy,
    inbound: tonic::Streaming<ProcessingRequest>,
    phase: Phase,
    /// The proxy's metadata (the subset hint), from the first message that carries it.
    metadata: Option<Metadata>,
}

/// The answers to one ext_proc stream.
pub(crate) fn responses(
    gw: Arc<Gateway>,
    by: PrefillBy,
    inbound: tonic::Streaming<ProcessingRequest>,
) -> impl futures_util::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send + 'static {
    let session = Session {
        gw,
        by,
        inbound,
        phase: Phase::Headers,
        metadata: None,
    };
    futures_util::stream::unfold(Some(session), |session| async move {
        let mut session = session?;
        match session.step().await {
            Step::Answer(r) => Some((Ok(r), Some(session))),
            Step::Last(r) => Some((Ok(r), None)),
            Step::Fail(status) => Some((Err(status), None)),
            Step::End => None,
        }
    })
}

impl Session {
    /// How long the next message may take: what the proxy's edge allows at the same point.
    fn wait(&self) -> Duration {
        let s = &self.gw.settings;
        match &self.phase {
            Phase::Headers | Phase::Body(_) => self.gw.edge.request_body_timeout,
            Phase::Relay(r) if !r.head => s.decode_timeout,
            Phase::Relay(_) | Phase::Done => s.stream_idle_timeout,
        }
    }

    async fn step(&mut self) -> Step {
        let wait = self.wait();
        let message = match tokio::time::timeout(wait, self.inbound.message()).await {
            Err(_) => return self.timed_out(wait).await,
            Ok(Ok(Some(m))) => m,
            // Closed or reset: whatever the phase holds is dropped with the session.
            Ok(Ok(None) | Err(_)) => return Step::End,
        };
        if self.metadata.is_none() {
            self.metadata = message.metadata_context;
        }
        use processing_request::Request;
        match message.request {
            Some(Request::RequestHeaders(h)) => self.request_headers(h).await,
            Some(Request::RequestBody(b)) => self.request_body(b).await,
            Some(Request::ResponseHeaders(h)) => self.response_headers(h).await,
            Some(Request::ResponseBody(b)) => self.response_body(b).await,
            Some(Request::RequestTrailers(_)) => Step::Answer(wire::trailers(true)),
            Some(Request::ResponseTrailers(_)) => Step::Answer(wire::trailers(false)),
            None => Step::Fail(tonic::Status::invalid_argument(
                "a processing request without a request",
            )),
        }
    }

    /// The proxy sent nothing within [`Session::wait`].
    async fn timed_out(&mut self, after: Duration) -> Step {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Headers => Step::Fail(tonic::Status::deadline_exceeded(
                "no request headers within the request body timeout",
            )),
            Phase::Body(p) => {
                Step::Last(immediate(Some(p.record), GatewayError::BodyTimeout { after }).await)
            }
            Phase::Relay(r) => {
                let decode = r.ex.decode();
                let err = if r.head {
                    relay::engine_failed(
                        Some(&self.gw.health),
                        r.ex.request_id(),
                        &decode.name,
                        Cause::Silent,
                        &format!("nothing for {after:?}"),
                    );
                    GatewayError::Upstream {
                        leg: Leg::Decode,
                        endpoint: decode.name.clone(),
                        kind: UpstreamKind::Silent,
                        detail: format!("sent nothing for {after:?}"),
                    }
                } else {
                    let err = crate::engine::client::timed_out(Leg::Decode, decode.target(), after);
                    self.gw.health.observe(&decode.name, Err(Cause::of(&err)));
                    err
                };
                let Relay { ex, delegated, .. } = *r;
                drop(delegated);
                Step::Last(immediate(ex.into_record(), err).await)
            }
            Phase::Done => Step::End,
        }
    }

    async fn request_headers(&mut self, h: HttpHeaders) -> Step {
        if !matches!(self.phase, Phase::Headers) {
            return out_of_order("request headers");
        }
        let (headers, pseudo) = wire::headers(h.headers.as_ref());
        let path = pseudo.path.unwrap_or_default();
        let route = route_of(&path);
        let record = RequestRecord::begin(
            self.gw.metrics.clone(),
            route.map_or("other", Route::label),
            &headers,
        );
        let checked = (|| {
            let route = route.ok_or_else(|| GatewayError::NotFound { path: path.clone() })?;
            let method = pseudo.method.as_deref().unwrap_or_default();
            if method != Method::POST.as_str() {
                return Err(GatewayError::MethodNotAllowed {
                    method: Method::from_bytes(method.as_bytes()).unwrap_or(Method::GET),
                    path: route.path().to_string(),
                });
            }
            // The proxy matched the route on its exact (canonical) path: no target to check.
            let pass = edge::check_request(&self.gw.edge.client_keys, &headers, None)?;
            if h.end_of_stream {
                return Err(GatewayError::bad_request(
                    "the request has no body; send the request as JSON",
                    None,
                ));
            }
            Ok((route, pass))
        })();
        match checked {
            Err(err) => Step::Last(immediate(Some(record), err).await),
            Ok((route, pass)) => {
                self.phase = Phase::Body(Box::new(Pending {
                    record,
                    route,
                    headers,
                    pass,
                    body: BytesMut::new(),
                }));
                Step::Answer(wire::request_headers(CommonResponse::default()))
            }
        }
    }

    async fn request_body(&mut self, b: HttpBody) -> Step {
        let Phase::Body(pending) = &mut self.phase else {
            return out_of_order("a request body");
        };
        let limit = self.gw.edge.max_body_bytes;
        if pending.body.len() + b.body.len() > limit {
            let Phase::Body(p) = std::mem::replace(&mut self.phase, Phase::Done) else {
                return Step::End;
            };
            return Step::Last(
                immediate(Some(p.record), GatewayError::PayloadTooLarge { limit }).await,
            );
        }
        pending.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            // A streamed body: collected here, answered chunk by chunk unchanged.
            return Step::Answer(wire::request_body(CommonResponse::default(), None));
        }
        let Phase::Body(pending) = std::mem::replace(&mut self.phase, Phase::Done) else {
            return Step::End;
        };
        self.decide(*pending).await
    }

    /// The decision: plan, prefill, and the decode's request for the proxy.
    async fn decide(&mut self, pending: Pending) -> Step {
        let Pending {
            record,
            route,
            headers,
            pass,
            body,
        } = pending;
        let subset = wire::subset_hint(self.metadata.as_ref(), &headers);
        let span = record.trace_span().clone();
        let mut record = Some(record);
        let by = self.by;
        let gw = self.gw.clone();
        let decided = async {
            let slot = gw.edge.admission.admit().await?;
            let (headers, body) = (&headers, body.freeze());
            let mut ex =
                pd::plan(&gw, &mut record, route, headers, body, subset.as_deref()).await?;
            match delegate::delegate(&mut ex, by).await {
                Ok(delegated) => Ok((slot, ex, delegated)),
                Err(err) => {
                    record = ex.into_record();
                    Err(err)
                }
            }
        }
        .instrument(span)
        .await;
        let (slot, ex, mut delegated) = match decided {
            Ok(d) => d,
            Err(err) => return Step::Last(immediate(record, err).await),
        };
        let body = std::mem::take(&mut delegated.body);
        let response = self.destination(&ex, &delegated, body);
        debug!(id = %ex.request_id(), decode = %ex.decode().name, "destination named");
        self.phase = Phase::Relay(Box::new(Relay {
            ex,
            delegated,
            _slot: slot,
            _pass: pass,
            head: false,
            sse: false,
            server_error: false,
            error_event: false,
        }));
        Step::Answer(response)
    }

    /// The request-body answer: the decode's body, its headers, and its destination in every
    /// form a proxy reads (`target-pod`, `x-gateway-destination-endpoint`, `envoy.lb`).
    fn destination(&self, ex: &Exchange, d: &Delegated, body: Bytes) -> ProcessingResponse {
        // The engine's address: a data-parallel rank is named by the header below.
        let decode = ex.decode().engine_name().as_bytes();
        let mut set = vec![
            wire::set(headers::DECODE_TARGET_HEADER.as_str(), decode),
            wire::set(wire::DESTINATION, decode),
            wire::set(headers::X_REQUEST_ID.as_str(), d.leg_request_id.as_bytes()),
            wire::set(header::CONTENT_TYPE.as_str(), b"application/json"),
            wire::set(
                header::CONTENT_LENGTH.as_str(),
                body.len().to_string().as_bytes(),
            ),
        ];
        let prefill = &ex.served().prefill;
        if self.by == PrefillBy::Sidecar && !prefill.is_empty() {
            set.push(wire::set(wire::PREFILLER, prefill.as_bytes()));
        }
        // As on the proxy's legs: no engine hint from the client (the rank is the gateway's
        // choice, when the decode is a rank), and the engine's credentials.
        let rank_header = kvtransfer::DATA_PARALLEL_RANK_HEADER;
        let mut remove = Vec::new();
        match ex.decode().rank {
            Some(rank) => set.push(wire::set(rank_header.as_str(), rank.to_string().as_bytes())),
            None => remove.push(rank_header.as_str().to_string()),
        }
        let engine_key = ex.decode().authorization.as_ref();
        match engine_key.or(self.gw.engines.engine_authorization.as_ref()) {
            Some(key) => set.push(wire::set(header::AUTHORIZATION.as_str(), key.as_bytes())),
            None if !self.gw.engines.forward_client_authorization => {
                remove.push(header::AUTHORIZATION.as_str().to_string());
            }
            None => {}
        }
        let name = ex.decode().engine_name();
        wire::request_body(
            wire::common(set, remove, Some(body), true),
            Some(wire::destination_metadata(name)),
        )
    }

    async fn response_headers(&mut self, h: HttpHeaders) -> Step {
        let Phase::Relay(relay) = &mut self.phase else {
            return out_of_order("response headers");
        };
        if relay.head {
            return out_of_order("response headers twice");
        }
        let (headers, pseudo) = wire::headers(h.headers.as_ref());
        let status = pseudo.status.unwrap_or(200);
        relay.head = true;
        // The decode answers: its prefill (a sidecar's) is done.
        relay.delegated.sidecar_prefill = None;
        relay.sse = headers::is_event_stream(&headers);
        relay.ex.answered(status);
        relay.server_error = StatusCode::from_u16(status).is_ok_and(|s| s.is_server_error());
        let ex = &relay.ex;
        if relay.server_error {
            self.gw
                .health
                .observe(&ex.decode().name, Err(Cause::ServerError));
        }
        let mut out = HeaderMap::new();
        ex.served().apply(ex.request_id(), &mut out);
        let response =
            wire::response_headers(wire::common(wire::set_all(&out), Vec::new(), None, false));
        if h.end_of_stream {
            self.finish();
        }
        Step::Answer(response)
    }

    async fn response_body(&mut self, b: HttpBody) -> Step {
        let Phase::Relay(relay) = &mut self.phase else {
            return out_of_order("a response body");
        };
        let mut data = Bytes::from(b.body);
        if let Some(partner) = relay.delegated.partner.as_mut() {
            // The decode's usage waits for the concurrent prefill's figure (bounded by the
            // prefill leg's own timeout); otherwise its outcome is only looked at.
            let outcome: Option<Result<PartnerResult, _>> = if usage::reported(&data).is_some() {
                Some(partner.await)
            } else {
                partner.now_or_never()
            };
            if let Some(joined) = outcome {
                relay.delegated.partner = None;
                let result = joined.unwrap_or_else(|join| {
                    Err(GatewayError::Internal(format!(
                        "prefill task ended: {join}"
                    )))
                });
                match result {
                    Err(err) => {
                        let Phase::Relay(r) = std::mem::replace(&mut self.phase, Phase::Done)
                        else {
                            return Step::End;
                        };
                        let Relay { ex, delegated, .. } = *r;
                        drop(delegated);
                        return Step::Last(immediate(ex.into_record(), err).await);
                    }
                    Ok(Some(cached)) => relay.ex.set_prefill_cached(Some(cached)),
                    Ok(None) => {}
                }
            }
        }
        let mut mutated = None;
        if !data.is_empty() {
            if let Some(record) = relay.ex.record() {
                record.first_byte();
            }
            if relay.sse && !relay.error_event && relay::is_error_event(&data) {
                relay.error_event = true;
            }
            if let Some(cached) = relay.ex.prefill_cached()
                && let Some(patched) = usage::patch(&data, cached, !relay.sse)
            {
                data = patched;
                mutated = Some(data);
            }
        }
        if b.end_of_stream {
            self.finish();
        }
        Step::Answer(wire::response_body(wire::common(
            Vec::new(),
            Vec::new(),
            mutated,
            false,
        )))
    }

    /// The response ended cleanly: recorded, counted for the decode's health, and everything
    /// the request held released.
    fn finish(&mut self) {
        let Phase::Relay(relay) = std::mem::replace(&mut self.phase, Phase::Done) else {
            return;
        };
        let Relay {
            mut ex,
            mut delegated,
            server_error,
            error_event,
            ..
        } = *relay;
        if let Ok(mut record) = ex.take_record() {
            let health = (!server_error).then_some(&*self.gw.health);
            relay::finish_clean(health, &ex.decode().name, error_event, &mut record);
        }
        if let Some(abort) = delegated.abort.as_mut() {
            abort.ended(true);
        }
    }
}

/// The PD route a request path names (the query aside).
fn route_of(path: &str) -> Option<Route> {
    let path = path.split('?').next().unwrap_or_default();
    [
        Route::Completions,
        Route::Chat,
        Route::Responses,
        Route::Messages,
    ]
    .into_iter()
    .find(|r| r.path() == path)
}

/// A message the protocol does not allow at this point.
fn out_of_order(what: &str) -> Step {
    Step::Fail(tonic::Status::failed_precondition(format!(
        "{what} out of order"
    )))
}

/// `err` as the proxy's answer to the client: rendered and recorded by the edge, like every
/// error of the proxy (hop-by-hop headers left to the proxy).
async fn immediate(record: Option<RequestRecord>, err: GatewayError) -> ProcessingResponse {
    let details = err.to_string();
    let (parts, body) = edge::finish(record, Err(err)).into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let mut headers = parts.headers;
    let hop: Vec<_> = headers
        .keys()
        .filter(|k| headers::is_hop_header(k) && **k != headers::X_REQUEST_ID)
        .cloned()
        .collect();
    for name in hop {
        headers.remove(name);
    }
    wire::immediate(parts.status, &headers, body, details)
}
