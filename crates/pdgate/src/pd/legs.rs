//! The two legs, scheduled as the prefill's agent wants them ([`kvtransfer::Dispatch`]):
//! [`sequential`] (prefill, merge its answer, then decode) or [`concurrent`] (both at once; a
//! prefill failing before the decode's first byte restarts both on another prefill). Both end at
//! the decode's response head and hand over to the relay.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::OptionFuture;
use http::{Method, Response};
use http_body::Frame;
use kvtransfer::MergeOutcome;
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, info_span, warn};

use crate::config::PrefillFailurePolicy;
use crate::endpoints::{Endpoint, LoadGuard};
use crate::engine::EngineBody;
use crate::engine::client::{self, Collected, LegRequest};
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::pd::decode_head::{self, DecodeHead};
use crate::pd::handover::{FirstByte, first_byte, next_frame};
use crate::pd::relay::{self, PartnerResult};
use crate::pd::retry::{self, fall_back, kv_wait_failure, retry_both_legs};
use crate::pd::{Answer, Exchange, Pd, abort, encode, select, usage};
use crate::state::Gateway;

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
    fn new(
        pd: &Pd,
        request_id: &str,
        request: kvtransfer::PrefillRequest,
        limit: Duration,
    ) -> Self {
        PrefillJob {
            limit,
            tokens: pd.prefill_tokens,
            endpoint: pd.prefill.clone(),
            path: pd.route.path(),
            // A connector that addresses its engines through the request id chose the legs' id.
            request_id: (pd.ctx.transfer.leg_request_id.as_deref())
                .unwrap_or(request_id)
                .to_string(),
            forwarded: pd.forwarded.clone(),
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
async fn prefill_leg(gw: &Gateway, job: PrefillJob) -> Result<Collected, GatewayError> {
    // The prompt tokens it computes count as work queued there (cache-aware choices) until
    // it answers.
    let _load = LoadGuard::computing(&job.endpoint.load, job.tokens);
    gw.health.begin(&job.endpoint.name);
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
        let head = client::send(&gw.client, leg).await?;
        client::collect(Leg::Prefill, job.endpoint.target(), head).await
    };
    let limit = job.limit;
    let started = tokio::time::Instant::now();
    let went_down = decode_head::went_down(gw, &job.endpoint.name);
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
        gw.health.model_refused(c.status);
    }
    gw.health.observe(&job.endpoint.name, outcome);
    if outcome.is_ok() {
        gw.health
            .observe_latency(&job.endpoint.name, started.elapsed());
    }
    result
}

/// Prefill, merge, decode. A failed prefill is retried on another prefill, then (by policy)
/// either fails the request or lets the decode serve it alone. A decode taken out of rotation
/// while the request waits for its head is given up at once: the request moves to another decode
/// (once), where both legs run again (its KV may already be gone), or the fallback alone.
pub(crate) async fn sequential(ex: &mut Exchange, mut pd: Pd) -> Result<Answer, GatewayError> {
    let mut body = prefill_and_merge(ex, &mut pd).await?;
    let mut moved = false;
    loop {
        // Boxed, like the prefill leg: this flow's own future then stays small, and the flows'
        // box (`pd::serve`) copies no more than the request's state.
        let sent = decode_head::send(ex, &mut pd, body.clone(), &mut moved, false);
        match Box::pin(sent).await? {
            Some((head, _)) => return decode_head::relay_head(ex, pd, head),
            // Moved: the KV went to the old decode, so the prefill runs again; a fallback
            // sends the same plain request.
            None if !pd.served.fallback => body = prefill_and_merge(ex, &mut pd).await?,
            None => {}
        }
    }
}

/// The prefill leg's body for the current pair: the agent's (bound to the decode), with the
/// encoders' parameters `ec` for this leg set on it.
fn prefill_body(
    pd: &mut Pd,
    ec: Option<Bytes>,
) -> Result<kvtransfer::PrefillRequest, GatewayError> {
    pd.agent.bind_decode(&mut pd.ctx, &pd.decode.pod)?;
    let source = pd.prefill_base.as_ref().unwrap_or(&pd.clean);
    let body = pd
        .agent
        .augment_prefill_request(&mut pd.ctx, &pd.prefill.pod, source)?;
    encode::attach(body, ec)
}

/// The prefill leg (retried on other prefills) and the merge of its answer: the decode leg's
/// body (the client's own when the decode serves alone after a failed prefill).
pub(crate) async fn prefill_and_merge(
    ex: &mut Exchange,
    pd: &mut Pd,
) -> Result<Bytes, GatewayError> {
    let gw = ex.gw.clone();
    let mut tried = vec![pd.prefill.name.clone()];
    let collected = loop {
        // Each prefill leg loads its items' encoder output once: encoded again for each.
        let ec = pd.encode_for_prefill(&gw, &ex.request_id).await?;
        let prefill_request = prefill_body(pd, ec)?;
        let job = PrefillJob::new(
            pd,
            &ex.request_id,
            prefill_request,
            gw.config.legs.prefill_timeout,
        );
        // Boxed, like the decode leg below: this flow's own future then stays small, and the
        // flows' box (`pd::serve`) copies no more than the request's state.
        let collected = Box::pin(prefill_leg(&gw, job))
            .instrument(prefill_span(&ex.request_id, &pd.prefill.name))
            .await;
        let retryable = match &collected {
            Ok(c) => c.status.is_server_error(),
            Err(e) => e.retryable(),
        };
        if retryable
            && let Some(next) = select::retry_target(
                &gw,
                Leg::Prefill,
                pd.model.as_deref(),
                &pd.prefill,
                &pd.decode,
                &tried,
            )
        {
            let why = collected
                .as_ref()
                .err()
                .map_or("prefill failed", retry::why_moved);
            warn!(id = %ex.request_id, from = %pd.prefill.name, to = %next.name, "{why}; retrying on another prefill");
            if let Some(r) = ex.record() {
                r.trace().retried();
            }
            tried.push(next.name.clone());
            pd.switch_prefill(&ex.request_id, next)?;
            ex.touched(pd);
            continue;
        }
        break collected;
    };
    if let Some(r) = ex.record() {
        r.prefill_done();
    }
    let merged = match collected {
        Ok(c) if c.status.is_success() => {
            pd.prefill_cached = usage::reported(&c.body);
            pd.agent
                .merge_prefill_response(&mut pd.ctx, &c.body, &pd.prefill.pod)
                .map_err(GatewayError::from)
        }
        Ok(c) if c.status.is_client_error() => {
            return Err(client::status_error(Leg::Prefill, c));
        }
        Ok(c) => Err(client::status_error(Leg::Prefill, c)),
        Err(e) => Err(e),
    };
    let decode_body = match merged {
        Ok(MergeOutcome::KvAttached) => pd.ctx.req_body.clone(),
        Ok(MergeOutcome::Recompute) => {
            warn!(
                id = %ex.request_id,
                prefill = %pd.prefill.name,
                "prefill answered without KV-transfer parameters; the decode recomputes the prompt"
            );
            gw.metrics.count_recompute(pd.served.connector);
            // The decode computes the prompt itself: its own usage is the right one.
            pd.prefill_cached = None;
            pd.ctx.req_body.clone()
        }
        Err(err) => match gw.config.legs.on_prefill_failure {
            PrefillFailurePolicy::Fail => return Err(err),
            PrefillFailurePolicy::Fallback if !pd.agent.allows_decode_only() => return Err(err),
            PrefillFailurePolicy::Fallback => {
                let why = retry::why_moved(&err);
                warn!(id = %ex.request_id, prefill = %pd.prefill.name, error = %err, "{why}; decode serves the request alone");
                gw.metrics.count_fallback(pd.served.connector);
                pd.served.fallback = true;
                // A plain request: no transfer state (an id naming the failed prefill) goes with it.
                pd.restart(&ex.request_id);
                pd.clean.to_bytes()
            }
        },
    };
    Ok(decode_body)
}

/// Both legs at once. The response head is held until the decode's first byte or the
/// prefill's end, so a prefill failing meanwhile can still be retried (the client has nothing).
///
/// Blame by evidence: a decode 5xx that came after `reliability.kv_wait_evidence` while the
/// prefill had not answered is the decode giving up waiting for KV: it counts against the
/// prefill, and the request moves to another prefill (or falls back) like a failed prefill.
pub(crate) async fn concurrent(ex: &mut Exchange, mut pd: Pd) -> Result<Answer, GatewayError> {
    let gw = ex.gw.clone();
    let mut state = Attempts {
        limit: concurrent_prefill_limit(&gw),
        tried: vec![pd.prefill.name.clone()],
        bootstrap: pd.agent.needs_bootstrap_lookup(),
        requeried: false,
        moved: false,
    };
    loop {
        // The one place an attempt's outcome becomes the next step: relay, both legs again
        // (another decode, fresh facts, another prefill), the decode alone, or fail.
        match attempt(ex, &mut pd, &mut state).await? {
            Outcome::Ready {
                head,
                decode_load,
                partner,
                prefix,
            } => {
                if partner.is_none()
                    && let Some(r) = ex.record()
                {
                    r.prefill_done();
                }
                let record = ex.take_record()?;
                return Ok(relay::respond(
                    &gw,
                    &ex.request_id,
                    head,
                    pd,
                    decode_load,
                    partner,
                    prefix,
                    record,
                ));
            }
            Outcome::Moved => {}
            Outcome::StaleFacts { decode, fresh } => {
                retry::retry_on_fresh_facts(&gw, &mut pd, ex, &decode, fresh).await?;
            }
            Outcome::PrefillFailed(err) => {
                if let Err(err) = retry_both_legs(&gw, &mut pd, ex, &mut state.tried, err).await {
                    return fall_back(ex, pd, err).await;
                }
            }
            Outcome::DecodeFailed(err) => {
                abort::abort_later(&gw, pd.agent.as_ref(), &pd.decode, &ex.request_id);
                return Err(err);
            }
        }
    }
}

/// How one attempt of both legs ended, before any decode byte reached the client.
// One per attempt, matched at once: boxing the large variant would cost an allocation per
// request for nothing.
#[allow(clippy::large_enum_variant)]
enum Outcome {
    /// The decode's head (and first frame, when it was read) with the prefill still running or
    /// done: relay it.
    Ready {
        head: Response<EngineBody>,
        decode_load: LoadGuard,
        partner: Option<AbortOnDropHandle<PartnerResult>>,
        prefix: Option<Frame<Bytes>>,
    },
    /// The decode was taken out of rotation: the request moved to another decode.
    Moved,
    /// The decode refused the prefill's stale bootstrap facts; `fresh` carries new ones.
    StaleFacts {
        decode: Arc<Endpoint>,
        fresh: Arc<Endpoint>,
    },
    /// The prefill failed, or by evidence never handed its KV over.
    PrefillFailed(GatewayError),
    /// The decode failed.
    DecodeFailed(GatewayError),
}

/// What a concurrent request keeps across its attempts.
struct Attempts {
    /// Bound on each prefill leg.
    limit: Duration,
    /// Prefills used.
    tried: Vec<String>,
    /// A bootstrap-based connector (Mooncake): a decode failure may be the prefill's stale facts
    /// (a restarted prefill's new engine id); checked once per request (`requeried`).
    bootstrap: bool,
    requeried: bool,
    /// Moved to another decode once already.
    moved: bool,
}

/// Bound on a prefill leg that runs beside its decode.
pub(crate) fn concurrent_prefill_limit(gw: &Gateway) -> Duration {
    gw.config
        .legs
        .prefill_timeout
        .min(gw.config.reliability.concurrent_prefill_timeout)
}

/// Starts the prefill leg of a concurrent connector on its own task (aborted when dropped),
/// after the agent shaped both legs: the decode leg's body is then `pd.ctx.req_body`. The task
/// answers the cached prompt tokens the prefill reports. `ec`: the encoders' parameters for
/// this prefill leg ([`Pd::encode_for_prefill`]).
pub(crate) fn start_prefill(
    gw: &Arc<Gateway>,
    request_id: &str,
    pd: &mut Pd,
    limit: Duration,
    ec: Option<Bytes>,
) -> Result<AbortOnDropHandle<PartnerResult>, GatewayError> {
    let prefill_request = prefill_body(pd, ec)?;
    pd.agent
        .merge_prefill_response(&mut pd.ctx, b"", &pd.prefill.pod)?;
    let gw = gw.clone();
    let job = PrefillJob::new(pd, request_id, prefill_request, limit);
    let span = prefill_span(request_id, &pd.prefill.name);
    Ok(AbortOnDropHandle::new(tokio::spawn(
        async move {
            let c = prefill_leg(&gw, job).await?;
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
/// bootstrap-based connector) its first frame.
async fn attempt(
    ex: &mut Exchange,
    pd: &mut Pd,
    state: &mut Attempts,
) -> Result<Outcome, GatewayError> {
    enum Step {
        Prefill(Result<PartnerResult, tokio::task::JoinError>),
        Decode(Result<Option<(DecodeHead, Duration)>, GatewayError>),
    }
    let gw = ex.gw.clone();
    let ec = pd.encode_for_prefill(&gw, &ex.request_id).await?;
    let prefill_task = start_prefill(&gw, &ex.request_id, pd, state.limit, ec)?;
    let mut partner = Some(prefill_task);
    let decode_sent = tokio::time::Instant::now();
    // The prefill's cached tokens, when it answers before the decode's head.
    let mut early_cached = None;
    let step = {
        let body = pd.ctx.req_body.clone();
        let decode = decode_head::send(ex, pd, body, &mut state.moved, false);
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
    pd.prefill_cached = early_cached;
    let head = match step {
        Step::Decode(head) => head,
        Step::Prefill(done) => {
            // The decode future is dropped (its connection closed).
            let err = match done {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => GatewayError::Internal("prefill outcome lost".into()),
                Err(join) => GatewayError::Internal(format!("prefill task ended: {join}")),
            };
            return Ok(Outcome::PrefillFailed(err));
        }
    };
    let ((head, decode, decode_load), took) = match head {
        Ok(Some(head)) => head,
        // Moved to another decode: both legs again there.
        Ok(None) => return Ok(Outcome::Moved),
        Err(err) => return Ok(Outcome::DecodeFailed(err)),
    };
    if head.status().is_server_error() {
        let kv_wait = partner.is_some() && took >= gw.config.reliability.kv_wait_evidence;
        if kv_wait {
            // The prefill never handed its KV over: its failure, not the decode's.
            drop((partner.take(), head, decode_load));
            let err = kv_wait_failure(&gw, pd, &ex.request_id, &decode.name, took);
            return Ok(Outcome::PrefillFailed(err));
        }
        if state.bootstrap && !state.requeried {
            state.requeried = true;
            if let Some(fresh) = retry::fresh_prefill(&gw, &pd.prefill).await {
                drop((partner.take(), head, decode_load));
                return Ok(Outcome::StaleFacts { decode, fresh });
            }
        }
        gw.health.observe(&decode.name, Err(Cause::ServerError));
    }
    pd.switch_decode(decode);
    let (parts, mut body) = head.into_parts();
    let mut prefix = None;
    if let Some(task) = partner.as_mut() {
        let idle = gw.config.legs.stream_idle_timeout;
        match first_byte(&mut body, task, idle, &pd.decode).await {
            // A streaming decode sends its head before it waits for KV (as vLLM does): an
            // error event as its first frame, late, with the prefill still silent, is the
            // same KV-wait failure, and the client has nothing yet.
            FirstByte::Frame(Some(frame))
                if decode_sent.elapsed() >= gw.config.reliability.kv_wait_evidence
                    && frame.data_ref().is_some_and(|d| relay::is_error_event(d)) =>
            {
                drop((partner.take(), body, decode_load));
                let waited = decode_sent.elapsed();
                let err = kv_wait_failure(&gw, pd, &ex.request_id, &pd.decode.name, waited);
                return Ok(Outcome::PrefillFailed(err));
            }
            FirstByte::Frame(frame) => prefix = frame,
            FirstByte::PrefillDone(cached) => {
                pd.prefill_cached = cached;
                partner = None;
            }
            FirstByte::PrefillFailed(err) => {
                drop((body, decode_load));
                return Ok(Outcome::PrefillFailed(err));
            }
            FirstByte::DecodeFailed(err) => return Ok(Outcome::DecodeFailed(err)),
        }
    }
    // A streaming decode reports a refused KV pull as an error event after its 200 head.
    if state.bootstrap && !state.requeried {
        if prefix.is_none() {
            let idle = gw.config.legs.stream_idle_timeout;
            match next_frame(&mut body, idle, &pd.decode).await {
                Ok(frame) => prefix = frame,
                Err(err) => return Ok(Outcome::DecodeFailed(err)),
            }
        }
        let refused = prefix
            .as_ref()
            .and_then(Frame::data_ref)
            .is_some_and(|d| relay::is_error_event(d));
        if refused {
            state.requeried = true;
            if let Some(fresh) = retry::fresh_prefill(&gw, &pd.prefill).await {
                drop((partner.take(), body, decode_load));
                let decode = pd.decode.clone();
                return Ok(Outcome::StaleFacts { decode, fresh });
            }
        }
    }
    Ok(Outcome::Ready {
        head: Response::from_parts(parts, body),
        decode_load,
        partner,
        prefix,
    })
}
