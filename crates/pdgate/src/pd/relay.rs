//! The body relayed from the decode engine to the client.
//!
//! Bytes pass through untouched and are pulled only as fast as the client reads them
//! (backpressure). The body owns everything a request holds: endpoint load guards, the
//! concurrently running prefill leg, and the request's metrics record. It ends on the engine's
//! end of stream, on silence longer than the idle timeout, or when the concurrent prefill fails;
//! dropping it (the client left) drops the decode connection and aborts the prefill at once.
//!
//! The per-event path is kept short (docs/benchmarks.md, "Streams: where an event's CPU goes"):
//! a relayed frame costs one clock read and no allocation; the idle timer is not reset per frame
//! but compared with the last frame's time when it fires (then set again for what is left), and
//! polled only then or for a new waker; the first byte is recorded once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::task::AbortOnDropHandle;

use crate::endpoints::LoadGuard;
use crate::endpoints::health::Health;
use crate::engine::EngineBody;
use crate::engine::guarded::GuardedBody;
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::headers;
use crate::metrics::{Cause, RequestRecord};
use crate::pd::abort::AbortOnLeave;
use crate::pd::{Answer, Exchange, usage};

/// The outcome of a leg running beside the relayed body: for a concurrent prefill, the cached
/// prompt tokens its answer reports (written into the usage the decode reports).
pub(crate) type PartnerResult = Result<Option<u32>, GatewayError>;

pin_project! {
    /// A decode response body on its way to the client.
    pub struct RelayBody {
        #[pin]
        inner: EngineBody,
        // Fires at the idle deadline as it was when it was last set; the deadline then is
        // `last_frame + idle_timeout`.
        #[pin]
        idle: Sleep,
        idle_timeout: Duration,
        last_frame: Instant,
        // The waker `idle` holds, so that it is polled (registered) again only for another one.
        idle_waker: Option<Waker>,
        first_byte: bool,
        partner: Option<AbortOnDropHandle<PartnerResult>>,
        prefix: Option<Frame<Bytes>>,
        sse: bool,
        // The prefill's cached prompt tokens, written into the usage the decode reports.
        cached_tokens: Option<u32>,
        done: bool,
        // The decode sent an SSE error event: the stream ends as a decode failure.
        error_event: bool,
        guards: Vec<LoadGuard>,
        record: RequestRecord,
        endpoint: String,
        health: Option<Arc<Health>>,
    }
}

impl RelayBody {
    /// Wraps a decode body. `sse` decides how late failures are reported (an SSE error event, or a
    /// broken body for JSON).
    pub fn new(
        inner: EngineBody,
        idle_timeout: Duration,
        sse: bool,
        guards: Vec<LoadGuard>,
        record: RequestRecord,
        endpoint: String,
    ) -> Self {
        let now = Instant::now();
        RelayBody {
            inner,
            idle: tokio::time::sleep_until(now + idle_timeout),
            idle_timeout,
            last_frame: now,
            idle_waker: None,
            first_byte: false,
            partner: None,
            prefix: None,
            sse,
            cached_tokens: None,
            done: false,
            error_event: false,
            guards,
            record,
            endpoint,
            health: None,
        }
    }

    /// Counts the body's end against the endpoint's passive health: a clean end as a success, a
    /// stream the engine breaks (or leaves silent) after its head as a failure, like a 5xx, so a
    /// decode that keeps breaking streams is ejected.
    pub fn set_health(&mut self, health: Arc<Health>) {
        self.health = Some(health);
    }

    /// A frame already read from `inner` (while waiting for the first byte), relayed first.
    pub fn set_prefix(&mut self, prefix: Option<Frame<Bytes>>) {
        self.prefix = prefix;
    }

    /// Reports `cached` prompt tokens in the relayed usage instead of the decode's figure
    /// (`pd::usage`: a JSON body keeps its length).
    pub fn set_cached_tokens(&mut self, cached: Option<u32>) {
        self.cached_tokens = cached;
    }

    /// Attaches a still-running prefill leg: its failure ends the stream with an error.
    pub fn set_partner(&mut self, partner: Option<AbortOnDropHandle<PartnerResult>>) {
        self.partner = partner;
    }
}

/// Why a relayed body ended early.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RelayError(pub GatewayError);

type Polled = Poll<Option<Result<Frame<Bytes>, RelayError>>>;

/// A decode failure after its head: logged with the endpoint and cause, and counted against the
/// endpoint's passive health.
pub(crate) fn engine_failed(
    health: Option<&Health>,
    id: &str,
    endpoint: &str,
    what: Cause,
    cause: &dyn std::fmt::Display,
) {
    let reason = what.as_str();
    tracing::warn!(id, endpoint, reason, cause = %cause, "decode failed after its response head");
    if let Some(h) = health {
        h.observe(endpoint, Err(what));
    }
}

/// Ready once `deadline` (the last frame's time plus the idle timeout) has passed. `idle` is
/// polled only when it fired or to hand it a waker it does not hold yet; when it fired before
/// `deadline` (frames came since it was set), it is set again, to `deadline`.
fn poll_idle(
    mut idle: Pin<&mut Sleep>,
    registered: &mut Option<Waker>,
    deadline: Instant,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let fired = idle.is_elapsed();
    if !fired
        && registered
            .as_ref()
            .is_some_and(|waker| waker.will_wake(cx.waker()))
    {
        return Poll::Pending;
    }
    if fired && idle.deadline() < deadline {
        idle.as_mut().reset(deadline);
    }
    // Out of budget, the timer returns Pending without holding the waker: not cached then.
    let armed = tokio::task::coop::has_budget_remaining();
    let polled = idle.as_mut().poll(cx);
    if polled.is_pending() {
        *registered = armed.then(|| cx.waker().clone());
    }
    polled
}

/// Whether an SSE chunk carries an error event (`data: {"error": ...}`, as vLLM and SGLang
/// write a failure after the head).
pub(crate) fn is_error_event(data: &[u8]) -> bool {
    // memchr's SIMD search: this runs on every relayed SSE chunk.
    memchr::memmem::find(data, b"data: {\"error\"").is_some()
}

/// The engine's body ended: a success for passive health and the record, unless the decode
/// reported an error event in it.
pub(crate) fn finish_clean(
    health: Option<&Health>,
    endpoint: &str,
    error_event: bool,
    record: &mut RequestRecord,
) {
    if error_event {
        engine_failed(
            health,
            record.request_id(),
            endpoint,
            Cause::ErrorEvent,
            &"SSE error event",
        );
        record.finish_error(&GatewayError::Upstream {
            leg: Leg::Decode,
            endpoint: endpoint.to_string(),
            kind: UpstreamKind::Broken,
            detail: "sent an error event".into(),
        });
        return;
    }
    if let Some(h) = health {
        h.observe(endpoint, Ok(()));
    }
    record.finish_ok();
}

fn fail(
    done: &mut bool,
    sse: bool,
    guards: &mut Vec<LoadGuard>,
    record: &mut RequestRecord,
    err: GatewayError,
) -> Polled {
    *done = true;
    guards.clear();
    record.finish_error(&err);
    if sse {
        Poll::Ready(Some(Ok(Frame::data(err.to_sse_event()))))
    } else {
        Poll::Ready(Some(Err(RelayError(err))))
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = RelayError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        if let Some(partner) = this.partner.as_mut()
            && let Poll::Ready(result) = Pin::new(partner).poll(cx)
        {
            *this.partner = None;
            let outcome = match result {
                Ok(outcome) => outcome,
                Err(join) => Err(GatewayError::Internal(format!(
                    "prefill task ended: {join}"
                ))),
            };
            match outcome {
                Err(err) => return fail(this.done, *this.sse, this.guards, this.record, err),
                Ok(cached) => {
                    // A concurrent prefill that answers after the decode's head ends its leg
                    // here: its duration (and, before the first byte, the handoff) is timed.
                    this.record.prefill_done();
                    if cached.is_some() {
                        *this.cached_tokens = cached;
                    }
                }
            }
        }
        let polled = match this.prefix.take() {
            Some(frame) => Poll::Ready(Some(Ok(frame))),
            None => this.inner.as_mut().poll_frame(cx),
        };
        match polled {
            // The decode's usage came before the concurrent prefill's answer, which has the
            // figure to bill: the frame waits for it (woken by the partner polled above; the
            // prefill leg is bounded by its own timeout).
            Poll::Ready(Some(Ok(frame)))
                if this.partner.is_some()
                    && frame
                        .data_ref()
                        .is_some_and(|d| usage::reported(d).is_some()) =>
            {
                *this.prefix = Some(frame);
                Poll::Pending
            }
            Poll::Ready(Some(Ok(mut frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !*this.first_byte {
                        *this.first_byte = true;
                        this.record.first_byte();
                    }
                    if *this.sse && !*this.error_event && is_error_event(data) {
                        *this.error_event = true;
                    }
                    if let Some(cached) = *this.cached_tokens
                        && let Some(patched) = usage::patch(data, cached, !*this.sse)
                    {
                        frame = Frame::data(patched);
                    }
                }
                *this.last_frame = Instant::now();
                // A sized body can end with its last frame (hyper then polls no more, and drops
                // the body): finish here, with a concurrent prefill still attached too.
                if this.inner.is_end_stream() {
                    *this.partner = None;
                    finish_clean(
                        this.health.as_deref(),
                        this.endpoint,
                        *this.error_event,
                        this.record,
                    );
                    *this.done = true;
                    this.guards.clear();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                engine_failed(
                    this.health.as_deref(),
                    this.record.request_id(),
                    this.endpoint,
                    Cause::Broken,
                    &e,
                );
                let err = GatewayError::Upstream {
                    leg: Leg::Decode,
                    endpoint: this.endpoint.clone(),
                    kind: UpstreamKind::Broken,
                    detail: format!("broke the response stream: {e}"),
                };
                fail(this.done, *this.sse, this.guards, this.record, err)
            }
            Poll::Ready(None) => {
                finish_clean(
                    this.health.as_deref(),
                    this.endpoint,
                    *this.error_event,
                    this.record,
                );
                *this.done = true;
                this.guards.clear();
                *this.partner = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                ready!(poll_idle(
                    this.idle.as_mut(),
                    this.idle_waker,
                    *this.last_frame + *this.idle_timeout,
                    cx
                ));
                engine_failed(
                    this.health.as_deref(),
                    this.record.request_id(),
                    this.endpoint,
                    Cause::Silent,
                    &format!("nothing for {:?}", this.idle_timeout),
                );
                let err = GatewayError::Upstream {
                    leg: Leg::Decode,
                    endpoint: this.endpoint.clone(),
                    kind: UpstreamKind::Silent,
                    detail: format!("sent nothing for {:?}", this.idle_timeout),
                };
                fail(this.done, *this.sse, this.guards, this.record, err)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.partner.is_none() && self.prefix.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.sse {
            return SizeHint::default();
        }
        let inner = self.inner.size_hint();
        // A frame already read from the engine still counts towards the length.
        let extra = self
            .prefix
            .as_ref()
            .and_then(Frame::data_ref)
            .map_or(0, |d| d.len() as u64);
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + extra);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + extra);
        }
        hint
    }
}

/// The client's answer: the decode's status and end-to-end headers, the serving endpoints, and
/// the relayed body (wrapped in the agent's abort-on-leave guard when it has an abort call). The
/// body takes the exchange's record from here on.
pub(crate) fn respond(
    ex: &mut Exchange,
    head: http::Response<EngineBody>,
    decode_load: LoadGuard,
    partner: Option<AbortOnDropHandle<PartnerResult>>,
    prefix: Option<Frame<Bytes>>,
) -> Result<Answer, GatewayError> {
    let (parts, body) = head.into_parts();
    let record = ex.answer_record(parts.status.as_u16())?;
    let (served, cached) = (ex.served(), ex.prefill_cached());
    let sse = headers::is_event_stream(&parts.headers);
    let engines = ex.engines();
    // Set in place, not by builder methods: each of those moved the whole body.
    let mut relay = RelayBody::new(
        body,
        ex.settings().stream_idle_timeout,
        sse,
        vec![decode_load],
        record,
        ex.decode().name.clone(),
    );
    relay.set_partner(partner);
    relay.set_prefix(prefix);
    relay.set_cached_tokens(cached);
    // A 5xx head was counted already; any other answer counts when its body ends.
    if !parts.status.is_server_error() {
        relay.set_health(engines.health.clone());
    }
    let mut body = axum::body::Body::new(relay);
    // vLLM aborts when its connection closes; an agent with an abort call also wants to be told.
    if let Some(guard) =
        AbortOnLeave::new(engines, ex.agent(), ex.decode().clone(), ex.request_id())
    {
        body = GuardedBody::wrap(body, guard);
    }
    let mut response = http::Response::new(body);
    *response.status_mut() = parts.status;
    let out = response.headers_mut();
    headers::copy_end_to_end(&parts.headers, out);
    served.apply(ex.request_id(), out);
    Ok(response)
}

#[cfg(test)]
mod timing_tests;
