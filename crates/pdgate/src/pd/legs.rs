//! The two legs, scheduled as the prefill's agent wants them ([`kvtransfer::Dispatch`]), from
//! [`serve`]: [`sequential`] (prefill, merge its answer, then decode) or [`concurrent`] (both at
//! once; a prefill failing before the decode's first byte restarts both on another prefill), or
//! the decode alone ([`decode_only`], [`decode_last`]). The prefill leg is [`prefill_leg`], the
//! decode leg up to its head [`send`], shared by every flow. Every failed attempt ends in one
//! [`Failure`], and [`Exchange::next`] (`pd::retry`) decides what follows; the flows here carry
//! it out. They end at the decode's response head and hand over to the relay.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::OptionFuture;
use http::{Method, Response};
use http_body::Frame;
use kvtransfer::Dispatch;
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, info_span};

use crate::endpoints::{Endpoint, LoadGuard};
use crate::engine::EngineBody;
use crate::engine::client::{self, Collected, LegRequest};
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::pd::handover::{FirstByte, first_byte, next_frame};
use crate::pd::relay::{self, PartnerResult};
use crate::pd::retry::{self, Failure, Next};
use crate::pd::{Answer, Exchange, usage};
use crate::state::Engines;

/// The prefill leg, owned, so it can run on its own task beside the decode leg.
struct PrefillJob {
    endpoint: Arc<Endpoint>,
    path: &'static str,
    request_id: String,
    forwarded: http::HeaderMap,
    body: Bytes,
    extra: Vec<(http::HeaderName, http::HeaderValue)>,
    /// Bound on the whole leg.
    limit: Duration,
    /// Prompt tokens the endpoint is predicted to compute (0 unknown).
    tokens: u32,
}

impl PrefillJob {
    fn new(ex: &Exchange, request: kvtransfer::PrefillRequest, limit: Duration) -> Self {
        PrefillJob {
            limit,
            tokens: ex.prefill_tokens(),
            endpoint: ex.prefill().clone(),
            path: ex.route().path(),
            // A connector that addresses its engines through the request id chose the legs' id.
            request_id: ex.leg_request_id().to_string(),
            forwarded: ex.forwarded().clone(),
            body: request.body,
            extra: request.headers,
        }
    }
}

/// The span of one prefill attempt, a child of the request's: the engine gets its context as
/// `traceparent` when spans are exported. Disabled (free) otherwise.
fn prefill_span(request_id: &str, endpoint: &str) -> tracing::Span {
    info_span!("prefill", request_id, endpoint, otel.kind = "client")
}

/// Sends the prefill leg and reads its whole (bounded) answer within the job's limit, giving up
/// at once if the endpoint is ejected meanwhile (`reliability.retry_on_ejection`: the caller
/// retries elsewhere). The outcome feeds passive health (a 4xx is the client's fault, not the
/// engine's).
async fn prefill_leg(engines: &Engines, job: PrefillJob) -> Result<Collected, GatewayError> {
    // The prompt tokens it computes count as work queued there (cache-aware choices) until
    // it answers.
    let _load = LoadGuard::computing(&job.endpoint.load, job.tokens);
    engines.health.begin(&job.endpoint.name);
    let leg = LegRequest {
        leg: Leg::Prefill,
        endpoint: job.endpoint.target(),
        path: job.path,
        method: Method::POST,
        body: job.body,
        request_id: &job.request_id,
        headers: &job.forwarded,
        extra: &job.extra,
    };
    let work = async {
        let head = client::send(&engines.client, leg).await?;
        client::collect(Leg::Prefill, job.endpoint.target(), head).await
    };
    let limit = job.limit;
    let started = tokio::time::Instant::now();
    let went_down = went_down(engines, &job.endpoint.name);
    // Biased: the leg's own outcome first (and no random draw per poll).
    let result = tokio::select! {
        biased;
        done = timeout(limit, work) => done.unwrap_or_else(|_| {
            Err(client::timed_out(Leg::Prefill, job.endpoint.target(), limit))
        }),
        () = went_down => {
            // Already counted (that is why it is down): not observed again.
            return Err(client::upstream(
                Leg::Prefill,
                job.endpoint.target(),
                UpstreamKind::Released,
                "was taken out of rotation while the request waited for it".into(),
            ));
        }
    };
    let outcome = match &result {
        Ok(c) if c.status.is_server_error() => Err(Cause::ServerError),
        Ok(_) => Ok(()),
        Err(e) => Err(Cause::of(e)),
    };
    if let Ok(c) = &result {
        engines.health.model_refused(c.status);
    }
    engines.health.observe(&job.endpoint.name, outcome);
    if outcome.is_ok() {
        engines
            .health
            .observe_latency(&job.endpoint.name, started.elapsed());
    }
    result
}

/// Runs the planned exchange `ex` to the client's answer: the decode alone when the plan says
/// so, else the two legs as the agent schedules them.
pub(crate) async fn serve(ex: &mut Exchange) -> Result<Answer, GatewayError> {
    // Boxed: the flows' futures are large, and every async caller up to axum's own box would
    // otherwise hold (and move) them inline.
    if ex.alone() {
        return Box::pin(decode_only(ex)).await;
    }
    match ex.agent().dispatch() {
        Dispatch::Sequential => Box::pin(sequential(ex)).await,
        Dispatch::Concurrent => Box::pin(concurrent(ex)).await,
    }
}

/// Prefill, merge, decode. A failed prefill is retried on another prefill, then (by policy)
/// either fails the request or lets the decode serve it alone. A decode taken out of rotation
/// while the request waits for its head is given up at once: the request moves to another decode
/// (once), where both legs run again (its KV may already be gone).
pub(crate) async fn sequential(ex: &mut Exchange) -> Result<Answer, GatewayError> {
    loop {
        let Some(body) = prefill_and_merge(ex).await? else {
            return decode_last(ex, false).await;
        };
        // Boxed, like the prefill leg: this flow's own future then stays small, and the flows'
        // box (`serve`) copies no more than the request's state.
        match Box::pin(send(ex, body, false)).await {
            Ok((head, _)) => return relay_head(ex, head),
            // Moved: the KV went to the old decode, so the prefill runs again.
            Err(Next::RetryBoth | Next::RetryLeg) => {}
            Err(Next::Alone) => return decode_last(ex, false).await,
            Err(Next::Fail(err)) => return Err(err),
        }
    }
}

/// The prefill leg (retried on other prefills) and the merge of its answer: the decode leg's
/// body, or `None` when the decode serves the client's request alone after the prefill failed.
pub(crate) async fn prefill_and_merge(ex: &mut Exchange) -> Result<Option<Bytes>, GatewayError> {
    loop {
        let request = ex.prefill_request().await?;
        let job = PrefillJob::new(ex, request, ex.settings().prefill_timeout);
        let span = prefill_span(ex.request_id(), &ex.prefill().name);
        // Boxed, like the decode leg: this flow's own future then stays small, and the flows'
        // box (`serve`) copies no more than the request's state.
        let collected = Box::pin(prefill_leg(ex.engines(), job))
            .instrument(span)
            .await;
        let err = match collected {
            Ok(c) if c.status.is_success() => match ex.merge_prefill(&c.body) {
                Ok(body) => return Ok(Some(body)),
                Err(err) => err,
            },
            Ok(c) => client::status_error(Leg::Prefill, c),
            Err(err) => err,
        };
        match ex.next(Failure::Prefill(err)).await {
            Next::RetryLeg | Next::RetryBoth => {}
            Next::Alone => {
                ex.prefill_done();
                return Ok(None);
            }
            Next::Fail(err) => {
                ex.prefill_done();
                return Err(err);
            }
        }
    }
}

/// Both legs at once. The response head is held until the decode's first byte or the
/// prefill's end, so a prefill failing meanwhile can still be retried (the client has nothing).
///
/// Blame by evidence: a decode 5xx that came after `reliability.kv_wait_evidence` while the
/// prefill had not answered is the decode giving up waiting for KV: it counts against the
/// prefill, and the request moves to another prefill (or falls back) like a failed prefill.
pub(crate) async fn concurrent(ex: &mut Exchange) -> Result<Answer, GatewayError> {
    loop {
        match attempt(ex).await {
            Ok(ready) => {
                if ready.partner.is_none() {
                    ex.prefill_done();
                }
                return relay::respond(
                    ex,
                    ready.head,
                    ready.decode_load,
                    ready.partner,
                    ready.prefix,
                );
            }
            // Another prefill, another decode or fresh bootstrap facts: both legs again.
            Err(Next::RetryBoth | Next::RetryLeg) => {}
            Err(Next::Alone) => return decode_last(ex, false).await,
            Err(Next::Fail(err)) => return Err(err),
        }
    }
}

/// An attempt of both legs that reached the decode's head (and, with a prefill still running or
/// a bootstrap-based connector, its first frame) before any decode byte reached the client.
struct Ready {
    head: Response<EngineBody>,
    decode_load: LoadGuard,
    partner: Option<AbortOnDropHandle<PartnerResult>>,
    prefix: Option<Frame<Bytes>>,
}

/// Starts the prefill leg of a concurrent connector (`request`: [`Exchange::prefill_request`])
/// on its own task (aborted when dropped), after the agent shaped both legs: the decode leg's
/// body is then [`Exchange::decode_body`]. The task answers the cached prompt tokens the prefill
/// reports.
pub(crate) fn start_prefill(
    ex: &mut Exchange,
    limit: Duration,
    request: kvtransfer::PrefillRequest,
) -> Result<AbortOnDropHandle<PartnerResult>, GatewayError> {
    ex.merge_before_prefill()?;
    // The task owns the gateway (and so the handle it runs the leg with).
    let gw = ex.gw().clone();
    let job = PrefillJob::new(ex, request, limit);
    let span = prefill_span(ex.request_id(), &ex.prefill().name);
    Ok(AbortOnDropHandle::new(tokio::spawn(
        async move {
            let c = prefill_leg(&gw.engines, job).await?;
            if c.status.is_success() {
                Ok(usage::reported(&c.body))
            } else {
                Err(client::status_error(Leg::Prefill, c))
            }
        }
        .instrument(span),
    )))
}

/// One attempt of both legs, up to the decode's head and (with a prefill still running or a
/// bootstrap-based connector) its first frame. A failure ends in the next step
/// [`Exchange::next`] decided.
async fn attempt(ex: &mut Exchange) -> Result<Ready, Next> {
    enum Step {
        Prefill(Result<PartnerResult, tokio::task::JoinError>),
        Decode(Result<(DecodeHead, Duration), Next>),
    }
    let request = ex.prefill_request().await.map_err(Next::Fail)?;
    let limit = ex.settings().concurrent_prefill_timeout;
    let prefill_task = start_prefill(ex, limit, request).map_err(Next::Fail)?;
    let mut partner = Some(prefill_task);
    let decode_sent = tokio::time::Instant::now();
    // The prefill's cached tokens, when it answers before the decode's head.
    let mut early_cached = None;
    let step = {
        let body = ex.decode_body();
        let decode = send(ex, body, false);
        tokio::pin!(decode);
        loop {
            let step = tokio::select! {
                biased;
                Some(done) = OptionFuture::from(partner.as_mut()) => Step::Prefill(done),
                head = &mut decode => Step::Decode(head),
            };
            match step {
                Step::Prefill(Ok(Ok(cached))) => {
                    early_cached = cached;
                    partner = None;
                }
                other => break other,
            }
        }
    };
    ex.set_prefill_cached(early_cached);
    let ((head, decode_load), took) = match step {
        Step::Decode(head) => head?,
        Step::Prefill(done) => {
            // The decode future is dropped (its connection closed).
            let err = match done {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => GatewayError::Internal("prefill outcome lost".into()),
                Err(join) => GatewayError::Internal(format!("prefill task ended: {join}")),
            };
            return Err(ex.next(Failure::Prefill(err)).await);
        }
    };
    let (kv_wait_evidence, idle) = {
        let s = ex.settings();
        (s.kv_wait_evidence, s.stream_idle_timeout)
    };
    if head.status().is_server_error() {
        if partner.is_some() && took >= kv_wait_evidence {
            // The prefill never handed its KV over: its failure, not the decode's.
            drop((partner.take(), head, decode_load));
            let err = retry::kv_wait_failure(ex, took);
            return Err(ex.next(Failure::Prefill(err)).await);
        }
        if ex.first_requery()
            && let Some(fresh) = ex.fresh_prefill().await
        {
            drop((partner.take(), head, decode_load));
            return Err(ex.next(Failure::StaleFacts(fresh)).await);
        }
        ex.engines()
            .health
            .observe(&ex.decode().name, Err(Cause::ServerError));
    }
    let (parts, mut body) = head.into_parts();
    let mut prefix = None;
    if let Some(task) = partner.as_mut() {
        match first_byte(&mut body, task, idle, ex.decode()).await {
            // A streaming decode sends its head before it waits for KV (as vLLM does): an
            // error event as its first frame, late, with the prefill still silent, is the
            // same KV-wait failure, and the client has nothing yet.
            FirstByte::Frame(Some(frame))
                if decode_sent.elapsed() >= kv_wait_evidence
                    && frame.data_ref().is_some_and(|d| relay::is_error_event(d)) =>
            {
                drop((partner.take(), body, decode_load));
                let err = retry::kv_wait_failure(ex, decode_sent.elapsed());
                return Err(ex.next(Failure::Prefill(err)).await);
            }
            FirstByte::Frame(frame) => prefix = frame,
            FirstByte::PrefillDone(cached) => {
                ex.set_prefill_cached(cached);
                partner = None;
            }
            FirstByte::PrefillFailed(err) => {
                drop((body, decode_load));
                return Err(ex.next(Failure::Prefill(err)).await);
            }
            FirstByte::DecodeFailed(err) => return Err(ex.next(Failure::Decode(err)).await),
        }
    }
    // A streaming decode reports a refused KV pull as an error event after its 200 head.
    if ex.may_requery() {
        if prefix.is_none() {
            match next_frame(&mut body, idle, ex.decode()).await {
                Ok(frame) => prefix = frame,
                Err(err) => return Err(ex.next(Failure::Decode(err)).await),
            }
        }
        let refused = prefix
            .as_ref()
            .and_then(Frame::data_ref)
            .is_some_and(|d| relay::is_error_event(d));
        if refused
            && ex.first_requery()
            && let Some(fresh) = ex.fresh_prefill().await
        {
            drop((partner.take(), body, decode_load));
            return Err(ex.next(Failure::StaleFacts(fresh)).await);
        }
    }
    Ok(Ready {
        head: Response::from_parts(parts, body),
        decode_load,
        partner,
        prefix,
    })
}

/// A decode's response head with the load it holds (the endpoint is the exchange's decode).
pub(crate) type DecodeHead = (Response<EngineBody>, LoadGuard);

/// The span of the decode leg up to its response head (`retries`: unreachable decodes left for
/// another one).
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

/// Sends `body` as the decode leg of `ex` and waits for its head ([`decode_head`]), also giving
/// how long the head took. A failure ends in the step [`Exchange::next`] decides: another
/// decode for an unreachable one is tried here; any other step (the request moved to another
/// decode, or failed) is the caller's.
pub(crate) async fn send(
    ex: &mut Exchange,
    body: Bytes,
    decode_only: bool,
) -> Result<(DecodeHead, Duration), Next> {
    let span = decode_span(ex.request_id(), &ex.decode().name, decode_only);
    async {
        ex.decode_leg_started();
        let mut retries: i64 = 0;
        loop {
            let err = match decode_head(ex, body.clone()).await {
                Ok(head) => return Ok(head),
                Err(err) => err,
            };
            match ex.next(Failure::Decode(err)).await {
                Next::RetryLeg => {
                    retries += 1;
                    tracing::Span::current().record("retries", retries);
                }
                next => return Err(next),
            }
        }
    }
    .instrument(span)
    .await
}

/// Resolves once `endpoint` is taken out of rotation, when legs waiting on it are to be given up
/// then (`reliability.retry_on_ejection`); pending otherwise. Both legs select on it.
pub(crate) async fn went_down(engines: &Engines, endpoint: &str) {
    if engines.retry_on_ejection {
        engines.health.went_down(endpoint).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// Sends the decode leg to the exchange's decode and waits for its response head within the
/// decode timeout; also gives how long the head took. A decode taken out of rotation meanwhile
/// ends the wait at once (`reliability.retry_on_ejection`). A 5xx head is the caller's to blame
/// (the decode's own failure, or for a concurrent connector possibly the prefill's).
async fn decode_head(ex: &Exchange, body: Bytes) -> Result<(DecodeHead, Duration), GatewayError> {
    let engines = ex.engines();
    let endpoint = ex.decode();
    let load = LoadGuard::computing(&endpoint.load, ex.decode_tokens());
    engines.health.begin(&endpoint.name);
    let leg = LegRequest {
        leg: Leg::Decode,
        endpoint: endpoint.target(),
        path: ex.route().path(),
        method: Method::POST,
        body,
        request_id: ex.leg_request_id(),
        headers: ex.forwarded(),
        extra: &[],
    };
    let sent = tokio::time::Instant::now();
    let head = tokio::select! {
        head = client::send_within(&engines.client, leg, ex.settings().decode_timeout) => head,
        // Already counted (that is why it is down): not observed again.
        () = went_down(engines, &endpoint.name) => return Err(client::upstream(Leg::Decode, endpoint.target(), UpstreamKind::Released, "was taken out of rotation while the request waited for its answer".into())),
    };
    match head {
        // A decode's success is counted when its body ends cleanly (the relay), not at the
        // head: a decode that breaks its streams after a 200 must not look healthy.
        Ok(head) => Ok(((head, load), sent.elapsed())),
        Err(err) => {
            engines.health.observe(&endpoint.name, Err(Cause::of(&err)));
            Err(err)
        }
    }
}

/// The decode alone, by choice: it holds (almost) all of the prompt in its own cache, so the
/// client's request goes to it as a plain request, with no prefill leg and no transfer fields.
pub(crate) async fn decode_only(ex: &mut Exchange) -> Result<Answer, GatewayError> {
    decode_last(ex, true).await
}

/// Sends the client's plain request as the decode leg (no prefill leg left running) and relays
/// its response; a decode taken out of rotation before its head hands the same body to another
/// decode (once).
pub(crate) async fn decode_last(
    ex: &mut Exchange,
    decode_only: bool,
) -> Result<Answer, GatewayError> {
    let body = ex.plain_body();
    loop {
        match send(ex, body.clone(), decode_only).await {
            Ok((head, _)) => return relay_head(ex, head),
            Err(Next::Fail(err)) => return Err(err),
            // Moved to another decode: the same plain request there.
            Err(Next::Alone | Next::RetryBoth | Next::RetryLeg) => {}
        }
    }
}

/// Relays the decode's response (no prefill leg left running).
pub(crate) fn relay_head(ex: &mut Exchange, head: DecodeHead) -> Result<Answer, GatewayError> {
    let (head, decode_load) = head;
    let health = &ex.engines().health;
    if head.status().is_server_error() {
        health.observe(&ex.decode().name, Err(Cause::ServerError));
    }
    health.model_refused(head.status());
    relay::respond(ex, head, decode_load, None, None)
}
