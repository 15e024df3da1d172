//! The PD exchange: one [`Exchange`] per request, in four steps.
//!
//! 1. [`view`]: parse the body once and read what the request is (model, stream, batch shape).
//! 2. [`select`]: choose the prefill/decode pair (and, on failure, another endpoint for a leg);
//!    [`encode`]: whether a multimodal request's items go to encoders before each prefill leg.
//! 3. [`legs`]: run the two legs the way the prefill's agent wants them, sequential (prefill,
//!    merge, decode) or concurrent (both at once, a failed prefill cancels the decode), up to
//!    the decode's response head.
//! 4. [`relay`]: stream the decode body to the client, holding the loads, the running prefill
//!    and the metrics record until it ends.
//!
//! Engine aborts (a connector's quirk, asked of its agent) have one path: [`abort`].
//! Errors go back to the HTTP edge, which renders them.

pub(crate) mod abort;
#[doc(hidden)]
pub mod bench;
pub(crate) mod decode_head;
pub(crate) mod delegate;
pub(crate) mod encode;
pub(crate) mod handover;
pub(crate) mod legs;
pub(crate) mod relay;
pub(crate) mod retry;
pub(crate) mod select;
pub(crate) mod usage;
pub(crate) mod view;

use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderMap;
use kvtransfer::{Dispatch, JsonBody, KvTransferAgent, RoutingContext};
use tracing::debug;

use crate::endpoints::Endpoint;
use crate::error::GatewayError;
use crate::headers::{self, Served};
use crate::metrics::RequestRecord;
use crate::state::Gateway;

pub(crate) use view::Route;

/// The answer to a client: axum's body type, which every route returns.
pub(crate) type Answer = http::Response<axum::body::Body>;

/// One client request on its way through the gateway: its id, its route label and its metrics
/// record. The HTTP edge creates it, the flow moves the record into the relayed body once the
/// response starts, and the edge records any error that comes back (see
/// `http::edge::finish`), so every outcome is counted exactly once.
#[derive(Debug)]
pub(crate) struct Exchange {
    pub(crate) gw: Arc<Gateway>,
    pub(crate) request_id: String,
    record: Option<RequestRecord>,
}

impl Exchange {
    /// Starts measuring a request on the route labelled `route` (a closed set).
    pub(crate) fn new(gw: Arc<Gateway>, route: &'static str, headers: &HeaderMap) -> Self {
        let mut record = RequestRecord::start(gw.metrics.clone(), route);
        let request_id = headers::request_id(headers);
        record.set_request_id(&request_id);
        *record.trace() = crate::telemetry::RequestTrace::start(&request_id, route, headers);
        Exchange {
            request_id,
            record: Some(record),
            gw,
        }
    }

    /// The record, while the flow still holds it.
    pub(crate) fn record(&mut self) -> Option<&mut RequestRecord> {
        self.record.as_mut()
    }

    /// The request's span (disabled unless export or the log filter wants it).
    pub(crate) fn span(&self) -> tracing::Span {
        self.record
            .as_ref()
            .map_or_else(tracing::Span::none, |r| r.trace_span().clone())
    }

    /// Names `pd`'s current engines in the record (after a move to another endpoint).
    pub(crate) fn touched(&mut self, pd: &Pd) {
        if let Some(record) = self.record.as_mut() {
            record.touched(&pd.prefill.name, &pd.decode.name);
        }
    }

    /// Hands the record to the relayed body (which records the outcome from then on).
    pub(crate) fn take_record(&mut self) -> Result<RequestRecord, GatewayError> {
        self.record
            .take()
            .ok_or_else(|| GatewayError::Internal("request measured twice".into()))
    }
}

/// The state of one PD request between its steps.
pub(crate) struct Pd {
    pub(crate) route: Route,
    pub(crate) forwarded: HeaderMap,
    pub(crate) ctx: RoutingContext,
    /// The client body without client-supplied transfer fields: the base of every leg.
    pub(crate) clean: JsonBody,
    pub(crate) prefill: Arc<Endpoint>,
    pub(crate) decode: Arc<Endpoint>,
    pub(crate) agent: Arc<dyn KvTransferAgent>,
    pub(crate) model: Option<String>,
    pub(crate) served: Served,
    /// The prefill's reported cached prompt tokens, which the client's usage carries.
    pub(crate) prefill_cached: Option<u32>,
    /// The prefill leg's base when the route needs one other than `clean`
    /// ([`Route::prefill_base`]); the agent builds the prefill leg from it.
    pub(crate) prefill_base: Option<JsonBody>,
    /// Prompt tokens `prefill` is predicted to compute ([`select::Pair::prefill_tokens`]; 0
    /// unknown), counted in its load while a prefill leg runs there.
    pub(crate) prefill_tokens: u32,
    /// The encoder requests of a multimodal request behind encoders ([`encode::work`]).
    pub(crate) encode: Option<encode::Work>,
}

impl Pd {
    /// Runs the encoder legs for the next prefill leg ([`encode::for_prefill_leg`]).
    pub(crate) async fn encode_for_prefill(
        &self,
        gw: &Arc<Gateway>,
        request_id: &str,
    ) -> Result<Option<Bytes>, GatewayError> {
        encode::for_prefill_leg(
            gw,
            self.encode.as_ref(),
            request_id,
            self.model.as_deref(),
            &self.forwarded,
        )
        .await
    }
}

impl Pd {
    /// Moves the request to another prefill endpoint (same connector), with a fresh context.
    pub(crate) fn switch_prefill(
        &mut self,
        request_id: &str,
        next: Arc<Endpoint>,
    ) -> Result<(), GatewayError> {
        let agent = next
            .agent
            .clone()
            .ok_or_else(|| GatewayError::Internal("prefill endpoint without an agent".into()))?;
        self.agent = agent;
        // Predicted for the endpoint it leaves, not for this one.
        self.prefill_tokens = 0;
        self.served.prefill = next.name.clone();
        self.prefill = next;
        self.restart(request_id);
        Ok(())
    }

    /// A fresh routing context (new transfer key) for another attempt of the request.
    pub(crate) fn restart(&mut self, request_id: &str) {
        self.ctx = context(request_id, self.clean.clone(), &self.prefill);
    }

    /// Records the decode endpoint that answered.
    pub(crate) fn switch_decode(&mut self, decode: Arc<Endpoint>) {
        self.served.decode = decode.name.clone();
        self.decode = decode;
    }
}

/// The routing context of one attempt. Its transfer key is the gateway's own (random, so unique
/// across gateway replicas too): transfer ids must not follow the client's `X-Request-Id`, or two
/// requests sent with the same id would share (and mix up) one KV transfer. The client's id stays
/// the request id, on the legs and in the answer. The prefill's data-parallel rank, when it is
/// one, is the rank agents name (Mooncake's decode dials that rank's engine).
fn context(request_id: &str, clean: JsonBody, prefill: &Endpoint) -> RoutingContext {
    let mut ctx = RoutingContext::from_parsed(request_id, clean);
    ctx.transfer_key = uuid::Uuid::new_v4().simple().to_string();
    ctx.transfer.dp_rank = prefill.rank;
    ctx
}

/// Serves one request on a PD route: view, select, legs, relay.
pub(crate) async fn serve(
    ex: &mut Exchange,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Answer, GatewayError> {
    let Plan { pd, decode_only } = plan(ex, route, headers, body, None).await?;
    // Boxed: the two flows' futures are ~6 KB, and every async caller up to axum's own box
    // would otherwise hold (and move) that much inline.
    if decode_only {
        return Box::pin(decode_head::decode_only(ex, pd)).await;
    }
    match pd.agent.dispatch() {
        Dispatch::Sequential => Box::pin(legs::sequential(ex, pd)).await,
        Dispatch::Concurrent => Box::pin(legs::concurrent(ex, pd)).await,
    }
}

/// A request read and routed, before any leg: the pair and how it is served.
pub(crate) struct Plan {
    pub(crate) pd: Pd,
    /// The decode serves it alone, by choice (`pd.served.decode_only` says why).
    pub(crate) decode_only: bool,
}

/// Steps 1 and 2, shared by every way a request is served (the proxy's flows, and an external
/// proxy's processor): parse the body, strip client transfer fields, read the request, choose
/// the pair (the decode among `decodes` when given: a proxy's subset hint), check the request
/// against the connector, and name the request in its record.
pub(crate) async fn plan(
    ex: &mut Exchange,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
    decodes: Option<&[String]>,
) -> Result<Plan, GatewayError> {
    let gw = ex.gw.clone();
    let mut clean = kvtransfer::parse_bounded(body, kvtransfer::checks::MAX_JSON_DEPTH)
        .map_err(GatewayError::refused_body)?;
    let stripped = kvtransfer::strip_client_transfer_fields(&mut clean);
    if !stripped.is_empty() {
        debug!(id = %ex.request_id, ?stripped, "removed client-supplied transfer fields");
    }
    let view = view::RequestView::read(&clean, route)?;
    debug!(id = %ex.request_id, model = ?view.model, stream = view.stream, "request read");
    gw.retry_budget.deposit();
    let snapshot = match decodes {
        None => gw.store.load(),
        Some(names) => Arc::new(select::within(
            &gw.store.load(),
            names,
            view.model.as_deref(),
        )?),
    };
    let prefix = match gw.cache.as_ref() {
        None => None,
        Some(c) => Some(
            crate::cache::view_of(
                c,
                &gw.client,
                &gw.health,
                &snapshot,
                &clean,
                route,
                view.model.as_deref(),
            )
            .await,
        ),
    };
    let select::Pair {
        prefill,
        decode,
        decode_only,
        predicted_cached,
        prefill_tokens,
    } = select::pair(&gw, &snapshot, view.model.as_deref(), prefix.as_ref())?;
    if let Some(cached) = predicted_cached {
        debug!(id = %ex.request_id, cached, decode_only, "cache-aware decision");
    }
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
    // Before any leg: a request the engines would refuse must not run (and pin KV on) a prefill.
    if let Some(endpoint) = route.check_endpoint() {
        agent
            .check_request(&clean, endpoint)
            .map_err(GatewayError::Rejected)?;
    }
    // A route this connector cannot hand over (or a request bound to one engine's state) goes
    // to the decode alone, as a plain request.
    let alone = if decode_only {
        Some("cache-hit")
    } else if !route.disaggregates(agent.as_ref())
        || (route == Route::Responses && crate::route::responses_state(&clean))
    {
        Some("route")
    } else {
        None
    };
    let decode_only = alone.is_some();
    let ctx = context(&ex.request_id, clean.clone(), &prefill);
    if let Some(record) = ex.record() {
        record.set_connector(connector);
        record.touched(if decode_only { "" } else { &prefill.name }, &decode.name);
        if let Some(m) = view.model.as_deref()
            && snapshot.models.iter().any(|known| known == m)
        {
            record.set_model(m);
        }
        record.trace().routed(crate::telemetry::Routed {
            connector,
            model: view.model.as_deref(),
            prefill: &prefill.name,
            decode: &decode.name,
            prefill_policy: &gw.config.policy.prefill_policy,
            decode_policy: &gw.config.policy.decode_policy,
            decode_only,
            predicted_cached,
        });
    }
    let served = Served {
        prefill: if decode_only {
            String::new()
        } else {
            prefill.name.clone()
        },
        decode: decode.name.clone(),
        connector,
        fallback: false,
        decode_only: alone,
        predicted_cached,
        targets: gw.config.security.expose_target_headers,
    };
    let mut forwarded = headers::forwarded(headers);
    crate::engine::client::engine_credentials(
        &mut forwarded,
        gw.forward_client_authorization,
        gw.engine_authorization.as_ref(),
    );
    let prefill_base = if decode_only {
        None
    } else {
        route.prefill_base(&clean)
    };
    let encode = if decode_only {
        None
    } else {
        encode::work(
            &gw,
            &snapshot,
            &clean,
            route,
            view.model.as_deref(),
            agent.as_ref(),
        )?
    };
    let pd = Pd {
        route,
        forwarded,
        ctx,
        clean,
        prefill,
        decode,
        agent,
        model: view.model,
        served,
        prefill_cached: None,
        prefill_base,
        prefill_tokens,
        encode,
    };
    Ok(Plan { pd, decode_only })
}
