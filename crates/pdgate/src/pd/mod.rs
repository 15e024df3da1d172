//! The path of one PD request: parse once, pick a pair, run the two legs the way the connector
//! wants them (sequential or concurrent), relay the decode body.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::OptionFuture;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response};
use kvtransfer::{Dispatch, JsonBody, KvTransferAgent, MergeOutcome, RoutingContext};
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, debug, debug_span, warn};

use crate::client::{self, Collected, Leg};
use crate::config::PrefillFailurePolicy;
use crate::endpoints::{Endpoint, LoadGuard, Snapshot};
use crate::error::{GatewayError, Source};
use crate::gateway::Gateway;
use crate::guarded::GuardedBody;
use crate::metrics::RequestRecord;
use crate::pool::EngineBody;
use crate::relay::{PartnerResult, RelayBody};
use crate::retry::{AbortOnLeave, FirstByte, abort_sglang, first_byte};

/// Response header naming the prefill endpoint (AIBrix spelling).
pub const PREFILL_TARGET_HEADER: &str = "prefill-target-pod";
/// Response header naming the decode endpoint (AIBrix spelling).
pub const DECODE_TARGET_HEADER: &str = "target-pod";
/// Response header naming the connector used.
pub const CONNECTOR_HEADER: &str = "x-pdgate-connector";
/// Response header present when the decode served the request alone after a prefill failure.
pub const FALLBACK_HEADER: &str = "x-pdgate-fallback";

/// The OpenAI routes that go through the PD flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    Chat,
}

impl Route {
    /// The request path, used for both legs.
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }

    /// Metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::Chat => "chat",
        }
    }
}

/// What routing needs to know about a request, read once from the parsed body.
#[derive(Debug)]
struct RequestView {
    model: Option<String>,
    stream: bool,
    /// The parameter that makes this a batch (`n` or `prompt`), if any.
    batched: Option<&'static str>,
}

fn field<'a, T: serde::Deserialize<'a>>(
    body: &'a JsonBody,
    key: &'static str,
    what: &str,
) -> Result<Option<T>, GatewayError> {
    match body.get::<Option<T>>(key) {
        None => Ok(None),
        Some(Ok(v)) => Ok(v),
        Some(Err(_)) => Err(GatewayError::bad_request(
            format!("`{key}` must be {what}"),
            Some(key),
        )),
    }
}

impl RequestView {
    fn read(body: &JsonBody, route: Route) -> Result<Self, GatewayError> {
        let model: Option<String> = field(body, "model", "a string")?;
        let stream = field::<bool>(body, "stream", "a boolean")?.unwrap_or(false);
        let n = field::<u64>(body, "n", "a positive integer")?.unwrap_or(1);
        let mut batched = (n > 1).then_some("n");
        if route == Route::Completions
            && let Some(raw) = body.get_raw("prompt")
            && raw.trim_start().starts_with('[')
        {
            let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(raw)
                .map_err(|_| GatewayError::bad_request("`prompt` is not valid", Some("prompt")))?;
            let nested = items
                .first()
                .is_some_and(|i| i.get().starts_with('"') || i.get().starts_with('['));
            if nested && items.len() > 1 {
                batched = Some("prompt");
            }
        }
        Ok(RequestView {
            model,
            stream,
            batched,
        })
    }
}

/// The request id used on both legs: the client's `X-Request-Id` when it is sane, else fresh.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 128
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Headers describing how the request was served.
#[derive(Clone, Debug)]
struct Meta {
    request_id: String,
    prefill: String,
    decode: String,
    connector: &'static str,
    fallback: bool,
}

impl Meta {
    fn apply(&self, headers: &mut HeaderMap) {
        const NAMES: [HeaderName; 4] = [
            client::X_REQUEST_ID,
            HeaderName::from_static(PREFILL_TARGET_HEADER),
            HeaderName::from_static(DECODE_TARGET_HEADER),
            HeaderName::from_static(CONNECTOR_HEADER),
        ];
        let values = [
            self.request_id.as_str(),
            &self.prefill,
            &self.decode,
            self.connector,
        ];
        for (name, v) in NAMES.into_iter().zip(values) {
            if let Ok(v) = HeaderValue::from_str(v) {
                headers.insert(name, v);
            }
        }
        if self.fallback {
            headers.insert(
                HeaderName::from_static(FALLBACK_HEADER),
                HeaderValue::from_static("prefill-failed"),
            );
        }
    }
}

/// Everything one PD request carries between its steps.
struct Pd {
    route: Route,
    forwarded: HeaderMap,
    ctx: RoutingContext,
    clean: JsonBody,
    prefill: Arc<Endpoint>,
    decode: Arc<Endpoint>,
    agent: Arc<dyn KvTransferAgent>,
    model: Option<String>,
    meta: Meta,
}

/// The prefill leg, owned, so it can run on its own task beside the decode leg.
struct PrefillJob {
    endpoint: Arc<Endpoint>,
    path: &'static str,
    request_id: String,
    forwarded: HeaderMap,
    body: Bytes,
    extra: Vec<(&'static str, String)>,
}

impl Pd {
    /// Moves the request to another prefill endpoint (same connector), with a fresh context.
    fn switch_prefill(&mut self, next: Arc<Endpoint>) -> Result<(), GatewayError> {
        let agent = next
            .agent
            .clone()
            .ok_or_else(|| GatewayError::Internal("prefill endpoint without an agent".into()))?;
        let mut ctx = RoutingContext::from_parsed(&self.meta.request_id, self.clean.clone());
        ctx.model = self.ctx.model.clone();
        ctx.path = self.ctx.path.clone();
        ctx.stream = self.ctx.stream;
        self.ctx = ctx;
        self.agent = agent;
        self.meta.prefill = next.name.clone();
        self.prefill = next;
        Ok(())
    }

    /// Records the decode endpoint that answered.
    fn switch_decode(&mut self, decode: Arc<Endpoint>) {
        self.meta.decode = decode.name.clone();
        self.decode = decode;
    }

    fn prefill_job(&self, request: kvtransfer::PrefillRequest) -> PrefillJob {
        PrefillJob {
            endpoint: self.prefill.clone(),
            path: self.route.path(),
            request_id: self.meta.request_id.clone(),
            forwarded: self.forwarded.clone(),
            body: request.body,
            extra: request.headers,
        }
    }
}

fn body_error(e: kvtransfer::BodyError) -> GatewayError {
    GatewayError::bad_request(format!("invalid request body: {e}"), None)
}

/// Chooses a prefill and a decode endpoint that serve `model` and agree on the connector.
pub fn select_pair(
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
    let prefills = crate::retry::under_cap(gw, prefills)?;
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
    let decodes = crate::retry::under_cap(gw, decodes)?;
    let j = gw
        .decode_policy
        .pick(&decodes)
        .ok_or_else(|| GatewayError::NoEndpoint {
            what: "decode",
            model: model_name(),
        })?;
    Ok((prefill, decodes[j].clone()))
}

impl Gateway {
    /// Serves one completions or chat request through the PD flow. Never fails: errors are
    /// rendered here, once, as OpenAI-shaped responses.
    pub async fn handle_pd(
        self: &Arc<Self>,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Response<axum::body::Body> {
        let request_id = request_id(headers);
        let span = debug_span!("request", id = %request_id, route = route.label());
        let mut record = Some(RequestRecord::start(self.metrics.clone(), route.label()));
        let result = self
            .pd(route, headers, body, &request_id, &mut record)
            .instrument(span)
            .await;
        match result {
            Ok(response) => response,
            Err(err) => {
                if let Some(mut record) = record {
                    record.finish_error(&err);
                }
                debug!(id = %request_id, error = %err, "request failed");
                let mut response = axum::response::IntoResponse::into_response(err);
                if let Ok(v) = HeaderValue::from_str(&request_id) {
                    response.headers_mut().insert(client::X_REQUEST_ID, v);
                }
                response
            }
        }
    }

    async fn pd(
        self: &Arc<Self>,
        route: Route,
        headers: &HeaderMap,
        body: Bytes,
        request_id: &str,
        record: &mut Option<RequestRecord>,
    ) -> Result<Response<axum::body::Body>, GatewayError> {
        let mut clean = JsonBody::parse(body).map_err(body_error)?;
        let stripped = kvtransfer::strip_client_transfer_fields(&mut clean);
        if !stripped.is_empty() {
            debug!(?stripped, "removed client-supplied transfer fields");
        }
        let view = RequestView::read(&clean, route)?;
        self.retry_budget.deposit();
        let snapshot = self.store.load();
        let (prefill, decode) = select_pair(self, &snapshot, view.model.as_deref())?;
        let agent = prefill
            .agent
            .clone()
            .ok_or_else(|| GatewayError::Internal("prefill endpoint without an agent".into()))?;
        let connector = agent.connector_type();
        if let Some(param) = view.batched
            && !agent.supports_batch()
        {
            return Err(GatewayError::bad_request(
                format!(
                    "connector {connector} serves one prompt with n=1 per request; send the prompts as separate requests"
                ),
                Some(param),
            ));
        }
        let mut ctx = RoutingContext::from_parsed(request_id, clean.clone());
        ctx.model = view.model.clone().unwrap_or_default();
        ctx.path = route.path().to_string();
        ctx.stream = view.stream;
        // The record stays with the caller until the relay takes it: an error on the way is
        // then counted by its class, not as a cancellation.
        let measured = record
            .as_mut()
            .ok_or_else(|| GatewayError::Internal("request measured twice".into()))?;
        measured.set_connector(connector);
        if let Some(m) = view.model.as_deref()
            && snapshot.models.iter().any(|known| known == m)
        {
            measured.set_model(m);
        }
        let meta = Meta {
            request_id: request_id.to_string(),
            prefill: prefill.name.clone(),
            decode: decode.name.clone(),
            connector,
            fallback: false,
        };
        let pd = Pd {
            route,
            forwarded: client::forwarded_headers(headers),
            ctx,
            clean,
            prefill,
            decode,
            agent,
            model: view.model,
            meta,
        };
        // Boxed: the two flows' futures are ~6 KB, and every async caller up to axum's own box
        // would otherwise hold (and move) that much inline.
        match pd.agent.dispatch() {
            Dispatch::Sequential => Box::pin(self.sequential(pd, record)).await,
            Dispatch::Concurrent => Box::pin(self.concurrent(pd, record)).await,
        }
    }

    /// Sends the prefill leg and reads its whole (bounded) answer within the prefill timeout.
    /// The outcome feeds passive health (a 4xx is the client's fault, not the engine's).
    async fn prefill_leg(&self, job: PrefillJob) -> Result<Collected, GatewayError> {
        let _load = LoadGuard::acquire(&job.endpoint.load);
        let leg = Leg {
            leg: Source::Prefill,
            endpoint: &job.endpoint,
            path: job.path,
            method: Method::POST,
            body: job.body,
            request_id: &job.request_id,
            headers: &job.forwarded,
            extra: &job.extra,
        };
        let work = async {
            let head = client::send(&self.client, leg).await?;
            client::collect(Source::Prefill, &job.endpoint, head).await
        };
        let result = timeout(self.config.prefill_timeout, work)
            .await
            .unwrap_or_else(|_| {
                Err(client::timed_out(
                    Source::Prefill,
                    &job.endpoint,
                    self.config.prefill_timeout,
                ))
            });
        let healthy = matches!(&result, Ok(c) if !c.status.is_server_error());
        self.health.observe(&job.endpoint.name, healthy);
        result
    }

    async fn sequential(
        self: &Arc<Self>,
        mut pd: Pd,
        record: &mut Option<RequestRecord>,
    ) -> Result<Response<axum::body::Body>, GatewayError> {
        let mut tried = vec![pd.prefill.name.clone()];
        let collected = loop {
            let prefill_request =
                pd.agent
                    .augment_prefill_request(&mut pd.ctx, &pd.prefill.pod, &pd.clean)?;
            let collected = self
                .prefill_leg(pd.prefill_job(prefill_request))
                .instrument(debug_span!("prefill", endpoint = %pd.prefill.name))
                .await;
            let retryable = match &collected {
                Ok(c) => c.status.is_server_error(),
                Err(e) => e.retryable(),
            };
            if retryable
                && let Some(next) = self.retry_target(
                    Source::Prefill,
                    pd.model.as_deref(),
                    &pd.prefill,
                    &pd.decode,
                    &tried,
                )
            {
                warn!(id = %pd.meta.request_id, from = %pd.prefill.name, to = %next.name, "prefill failed; retrying on another prefill");
                tried.push(next.name.clone());
                pd.switch_prefill(next)?;
                continue;
            }
            break collected;
        };
        if let Some(r) = record.as_mut() {
            r.prefill_done();
        }
        let merged = match collected {
            Ok(c) if c.status.is_success() => pd
                .agent
                .merge_prefill_response(&mut pd.ctx, &c.body, &pd.prefill.pod)
                .map_err(GatewayError::from),
            Ok(c) if c.status.is_client_error() => {
                return Err(client::status_error(Source::Prefill, c));
            }
            Ok(c) => Err(client::status_error(Source::Prefill, c)),
            Err(e) => Err(e),
        };
        let decode_body = match merged {
            Ok(MergeOutcome::KvAttached) => pd.ctx.req_body.clone(),
            Ok(MergeOutcome::Recompute) => {
                warn!(
                    id = %pd.meta.request_id,
                    prefill = %pd.prefill.name,
                    "prefill answered without KV-transfer parameters; the decode recomputes the prompt"
                );
                self.metrics.count_recompute(pd.meta.connector);
                pd.ctx.req_body.clone()
            }
            Err(err) => match self.config.on_prefill_failure {
                PrefillFailurePolicy::Fail => return Err(err),
                PrefillFailurePolicy::Fallback => {
                    warn!(id = %pd.meta.request_id, prefill = %pd.prefill.name, error = %err, "prefill failed; decode serves the request alone");
                    self.metrics.count_fallback(pd.meta.connector);
                    pd.meta.fallback = true;
                    pd.clean.to_bytes()
                }
            },
        };
        let (head, decode, decode_load) = self
            .decode_head(&pd, decode_body)
            .instrument(debug_span!("decode", endpoint = %pd.decode.name))
            .await?;
        pd.switch_decode(decode);
        let record = take_record(record)?;
        Ok(self.relay(head, pd, decode_load, None, None, record))
    }

    /// Sends the decode leg and waits for its response head within the decode timeout. A
    /// connection failure (nothing was sent) is retried on another decode endpoint.
    async fn decode_head(
        &self,
        pd: &Pd,
        body: Bytes,
    ) -> Result<(Response<EngineBody>, Arc<Endpoint>, LoadGuard), GatewayError> {
        let mut endpoint = pd.decode.clone();
        let mut tried = vec![endpoint.name.clone()];
        loop {
            let load = LoadGuard::acquire(&endpoint.load);
            let leg = Leg {
                leg: Source::Decode,
                endpoint: &endpoint,
                path: pd.route.path(),
                method: Method::POST,
                body: body.clone(),
                request_id: &pd.meta.request_id,
                headers: &pd.forwarded,
                extra: &[],
            };
            let result = timeout(self.config.decode_timeout, client::send(&self.client, leg))
                .await
                .unwrap_or_else(|_| {
                    Err(client::timed_out(
                        Source::Decode,
                        &endpoint,
                        self.config.decode_timeout,
                    ))
                });
            match result {
                Ok(head) => {
                    self.health
                        .observe(&endpoint.name, !head.status().is_server_error());
                    return Ok((head, endpoint, load));
                }
                Err(err) => {
                    self.health.observe(&endpoint.name, false);
                    if client::is_connect_failure(&err)
                        && let Some(next) = self.retry_target(
                            Source::Decode,
                            pd.model.as_deref(),
                            &pd.prefill,
                            &endpoint,
                            &tried,
                        )
                    {
                        warn!(id = %pd.meta.request_id, from = %endpoint.name, to = %next.name, "decode unreachable; retrying on another decode");
                        tried.push(next.name.clone());
                        endpoint = next;
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }

    async fn concurrent(
        self: &Arc<Self>,
        mut pd: Pd,
        record: &mut Option<RequestRecord>,
    ) -> Result<Response<axum::body::Body>, GatewayError> {
        enum Step {
            Prefill(Result<PartnerResult, tokio::task::JoinError>),
            Decode(Result<(Response<EngineBody>, Arc<Endpoint>, LoadGuard), GatewayError>),
        }
        let mut tried = vec![pd.prefill.name.clone()];
        loop {
            let prefill_request =
                pd.agent
                    .augment_prefill_request(&mut pd.ctx, &pd.prefill.pod, &pd.clean)?;
            pd.agent
                .merge_prefill_response(&mut pd.ctx, b"", &pd.prefill.pod)?;
            let prefill_task: AbortOnDropHandle<PartnerResult> = {
                let gw = self.clone();
                let job = pd.prefill_job(prefill_request);
                let span = debug_span!("prefill", endpoint = %pd.prefill.name);
                AbortOnDropHandle::new(tokio::spawn(
                    async move {
                        let c = gw.prefill_leg(job).await?;
                        if c.status.is_success() {
                            Ok(())
                        } else {
                            Err(client::status_error(Source::Prefill, c))
                        }
                    }
                    .instrument(span),
                ))
            };
            let mut partner = Some(prefill_task);
            let step = {
                let decode = self
                    .decode_head(&pd, pd.ctx.req_body.clone())
                    .instrument(debug_span!("decode", endpoint = %pd.decode.name));
                tokio::pin!(decode);
                loop {
                    let step = tokio::select! {
                        biased;
                        Some(done) = OptionFuture::from(partner.as_mut()) => Step::Prefill(done),
                        head = &mut decode => Step::Decode(head),
                    };
                    match step {
                        Step::Prefill(Ok(Ok(()))) => partner = None,
                        other => break other,
                    }
                }
            };
            let head = match step {
                Step::Decode(head) => head,
                Step::Prefill(done) => {
                    // The decode future is dropped (its connection closed).
                    let err = match done {
                        Ok(Err(e)) => e,
                        Ok(Ok(())) => GatewayError::Internal("prefill outcome lost".into()),
                        Err(join) => GatewayError::Internal(format!("prefill task ended: {join}")),
                    };
                    self.retry_both_legs(&mut pd, &mut tried, err).await?;
                    continue;
                }
            };
            let (head, decode, decode_load) = match head {
                Ok(head) => head,
                Err(err) => {
                    self.abort_decode(&pd);
                    return Err(err);
                }
            };
            pd.switch_decode(decode);
            // Hold the response head until the decode's first byte or the prefill's end: a
            // prefill failing meanwhile can still be retried (the client has nothing yet).
            let (parts, mut body) = head.into_parts();
            let mut prefix = None;
            if let Some(task) = partner.as_mut() {
                let idle = self.config.stream_idle_timeout;
                match first_byte(&mut body, task, idle, &pd.decode).await {
                    FirstByte::Frame(frame) => prefix = frame,
                    FirstByte::PrefillDone => partner = None,
                    FirstByte::PrefillFailed(err) => {
                        drop((body, decode_load));
                        self.retry_both_legs(&mut pd, &mut tried, err).await?;
                        continue;
                    }
                    FirstByte::DecodeFailed(err) => {
                        self.abort_decode(&pd);
                        return Err(err);
                    }
                }
            }
            if partner.is_none()
                && let Some(r) = record.as_mut()
            {
                r.prefill_done();
            }
            let head = Response::from_parts(parts, body);
            let record = take_record(record)?;
            return Ok(self.relay(head, pd, decode_load, partner, prefix, record));
        }
    }

    /// A concurrent prefill failed before any decode byte reached the client: moves `pd` to
    /// another prefill (the caller restarts both legs), or gives the error back.
    async fn retry_both_legs(
        &self,
        pd: &mut Pd,
        tried: &mut Vec<String>,
        err: GatewayError,
    ) -> Result<(), GatewayError> {
        let next = if err.retryable() {
            self.retry_target(
                Source::Prefill,
                pd.model.as_deref(),
                &pd.prefill,
                &pd.decode,
                tried,
            )
        } else {
            None
        };
        let Some(next) = next else {
            self.abort_decode(pd);
            return Err(err);
        };
        warn!(id = %pd.meta.request_id, from = %pd.prefill.name, to = %next.name, error = %err, "prefill failed before the first decode byte; retrying both legs");
        // SGLang wants an abort, sent before the retry reuses the request id.
        abort_sglang(
            &self.client,
            pd.meta.connector,
            &pd.decode,
            &pd.meta.request_id,
        )
        .await;
        tried.push(next.name.clone());
        pd.switch_prefill(next)
    }

    /// Tells an SGLang decode engine to drop a request whose prefill failed.
    fn abort_decode(&self, pd: &Pd) {
        if pd.meta.connector != kvtransfer::CONNECTOR_TYPE_SGLANG {
            return;
        }
        let client = self.client.clone();
        let endpoint = pd.decode.clone();
        let body = Bytes::from(serde_json::json!({ "rid": pd.meta.request_id }).to_string());
        let request_id = pd.meta.request_id.clone();
        self.tasks.spawn(async move {
            let leg = Leg {
                leg: Source::Decode,
                endpoint: &endpoint,
                path: "/abort_request",
                method: Method::POST,
                body,
                request_id: &request_id,
                headers: &HeaderMap::new(),
                extra: &[],
            };
            let _ = timeout(Duration::from_secs(2), client::send(&client, leg)).await;
        });
    }

    fn relay(
        &self,
        head: Response<EngineBody>,
        pd: Pd,
        decode_load: LoadGuard,
        partner: Option<AbortOnDropHandle<PartnerResult>>,
        prefix: Option<http_body::Frame<Bytes>>,
        record: RequestRecord,
    ) -> Response<axum::body::Body> {
        let (parts, body) = head.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let relay = RelayBody::new(
            body,
            self.config.stream_idle_timeout,
            sse,
            vec![decode_load],
            record,
            pd.decode.name.clone(),
        )
        .with_partner(partner)
        .with_prefix(prefix);
        let mut body = axum::body::Body::new(relay);
        if pd.meta.connector == kvtransfer::CONNECTOR_TYPE_SGLANG {
            // vLLM aborts when its connection closes; SGLang also wants to be told.
            let guard = AbortOnLeave::new(self, pd.decode.clone(), pd.meta.request_id.clone());
            body = GuardedBody::wrap(body, guard);
        }
        let mut response = Response::new(body);
        *response.status_mut() = parts.status;
        let headers = response.headers_mut();
        for (name, value) in parts.headers.iter() {
            if !is_hop_header(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        pd.meta.apply(headers);
        response
    }
}

/// Hands the request's record to the relay (which records the outcome from then on).
fn take_record(record: &mut Option<RequestRecord>) -> Result<RequestRecord, GatewayError> {
    record
        .take()
        .ok_or_else(|| GatewayError::Internal("request measured twice".into()))
}

/// Headers that describe one connection, not the message.
pub fn is_hop_header(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "upgrade"
            | "te"
            | "trailer"
            | "content-length"
            | "date"
            | "server"
            | "x-request-id"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(body: &str, route: Route) -> Result<RequestView, GatewayError> {
        RequestView::read(
            &JsonBody::parse(Bytes::from(body.to_string())).unwrap(),
            route,
        )
    }

    #[test]
    fn reads_the_request_view() {
        let v = view(
            r#"{"model":"m","stream":true,"prompt":"hi"}"#,
            Route::Completions,
        )
        .unwrap();
        assert_eq!(v.model.as_deref(), Some("m"));
        assert!(v.stream);
        assert_eq!(v.batched, None);
        assert_eq!(
            view(r#"{"prompt":["a","b"]}"#, Route::Completions)
                .unwrap()
                .batched,
            Some("prompt")
        );
        assert_eq!(
            view(r#"{"prompt":[1,2,3]}"#, Route::Completions)
                .unwrap()
                .batched,
            None
        );
        assert_eq!(
            view(r#"{"prompt":[[1,2]]}"#, Route::Completions)
                .unwrap()
                .batched,
            None
        );
        assert_eq!(
            view(r#"{"n":2,"messages":[]}"#, Route::Chat)
                .unwrap()
                .batched,
            Some("n")
        );
        assert!(view(r#"{"stream":null}"#, Route::Chat).is_ok());
        let err = view(r#"{"stream":"yes"}"#, Route::Chat).unwrap_err();
        assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
        assert!(view(r#"{"model":7}"#, Route::Chat).is_err());
    }

    #[test]
    fn request_ids_are_honoured_only_when_sane() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&h), "abc-123");
        h.insert("x-request-id", HeaderValue::from_static("a b"));
        assert_eq!(request_id(&h).len(), 32);
        assert_ne!(request_id(&HeaderMap::new()), request_id(&HeaderMap::new()));
    }
}
