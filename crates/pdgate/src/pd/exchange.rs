//! [`Exchange`]: one PD request's whole state, from its routing ([`plan`]) to its relayed
//! answer. Its fields are private to this file: the steps (`legs`, `relay`, `delegate`, the next
//! step after a failure in `retry`) read and change it through the methods below, so what a move
//! to another endpoint changes (agent, context, served names, the record) changes together, in
//! one place.

use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderMap;
use kvtransfer::{Dispatch, JsonBody, KvTransferAgent, MergeOutcome, RoutingContext};
use tracing::{debug, warn};

use crate::endpoints::Endpoint;
use crate::error::{GatewayError, Leg};
use crate::headers::{self, Served};
use crate::metrics::RequestRecord;
use crate::pd::view::RequestView;
use crate::pd::{Route, encode, select, usage};
use crate::state::{Engines, Gateway, Settings};

/// One PD request on its way through the gateway: the shared state it reads, its id and metrics
/// record, the pair serving it and everything a leg is built from, and what its second chances
/// have used. [`plan`] builds it; the record moves into the relayed body when the answer starts
/// ([`Exchange::take_record`]); an error before that goes back to the edge with the record
/// ([`Exchange::into_record`]), which records and renders it, so every outcome is counted once.
pub(crate) struct Exchange {
    gw: Arc<Gateway>,
    request_id: String,
    record: Option<RequestRecord>,
    route: Route,
    forwarded: HeaderMap,
    /// The routing context of the current attempt (its transfer key, the agent's state).
    ctx: RoutingContext,
    /// The client body without client-supplied transfer fields: the base of every leg.
    clean: JsonBody,
    prefill: Arc<Endpoint>,
    decode: Arc<Endpoint>,
    agent: Arc<dyn KvTransferAgent>,
    model: Option<String>,
    served: Served,
    /// The prefill's reported cached prompt tokens, which the client's usage carries.
    prefill_cached: Option<u32>,
    /// The prefill leg's base when the route needs one other than `clean`
    /// ([`Route::prefill_base`]); the agent builds the prefill leg from it.
    prefill_base: Option<JsonBody>,
    /// Prompt tokens `prefill` is predicted to compute (0 unknown), counted in its load while a
    /// prefill leg runs there.
    prefill_tokens: u32,
    /// Prompt tokens whose KV the decode holds (0 unknown), counted in its load while the
    /// decode leg runs there.
    decode_tokens: u32,
    /// The encoder requests of a multimodal request behind encoders ([`encode::work`]).
    encode: Option<encode::Work>,
    /// Prefills used (empty until the first one fails: the first is `prefill`).
    tried_prefills: Vec<String>,
    /// Decodes the current decode leg tried to reach (empty until one was unreachable).
    tried_decodes: Vec<String>,
    /// Moved to another decode once already.
    moved: bool,
    /// The prefill's bootstrap facts were looked up again once already.
    requeried: bool,
}

/// Steps 1 and 2, shared by every way a request is served (the proxy's flows, and an external
/// proxy's processor): parse the body, strip client transfer fields, read the request, choose
/// the pair (the decode among `decodes` when given: a proxy's subset hint), check the request
/// against the connector, and name the request in its record. The exchange takes the record
/// from `record`; an error leaves it there. The exchange is boxed: it is large, and the
/// caller's future holds it while the legs run, so it is built once where it stays and only
/// its pointer moves.
pub(crate) async fn plan(
    gw: &Arc<Gateway>,
    record: &mut Option<RequestRecord>,
    route: Route,
    headers: &HeaderMap,
    body: Bytes,
    decodes: Option<&[String]>,
) -> Result<Box<Exchange>, GatewayError> {
    let id = record.as_ref().map_or("", |r| r.request_id());
    // Without a cache-aware policy nothing predicts the prompt's tokens: the body's bytes stand
    // in, counted as the text view counts a prompt's (`BYTES_PER_TOKEN`), so that an
    // endpoint's load counts the work its requests carry and not only their number
    // (`least_request` breaks ties by it).
    let body_tokens =
        u32::try_from(body.len().div_ceil(pdcache::keys::BYTES_PER_TOKEN)).unwrap_or(u32::MAX);
    let mut clean = kvtransfer::parse_bounded(body, kvtransfer::checks::MAX_JSON_DEPTH)
        .map_err(GatewayError::refused_body)?;
    let stripped = kvtransfer::strip_client_transfer_fields(&mut clean);
    if !stripped.is_empty() {
        debug!(id, ?stripped, "removed client-supplied transfer fields");
    }
    let view = RequestView::read(&clean, route)?;
    debug!(id, model = ?view.model, stream = view.stream, "request read");
    let routing = &gw.routing;
    routing.retry_budget.deposit();
    let snapshot = match decodes {
        None => gw.store.load(),
        Some(names) => Arc::new(select::within(
            &gw.store.load(),
            names,
            view.model.as_deref(),
        )?),
    };
    let prefix = match routing.cache.as_ref() {
        None => None,
        Some(c) => Some(
            crate::cache::view_of(
                c,
                &gw.engines.client,
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
        decode_tokens,
    } = select::pair(routing, &snapshot, view.model.as_deref(), prefix.as_ref())?;
    let (prefill_tokens, decode_tokens) = match prefix {
        Some(_) => (prefill_tokens, decode_tokens),
        None => (body_tokens, body_tokens),
    };
    if let Some(cached) = predicted_cached {
        debug!(id, cached, decode_only, "cache-aware decision");
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
    let encode = if decode_only {
        None
    } else {
        encode::work(
            &gw.settings.encode,
            &snapshot,
            &clean,
            route,
            view.model.as_deref(),
            agent.as_ref(),
        )?
    };
    let Some(mut record) = record.take() else {
        return Err(GatewayError::Internal("request measured twice".into()));
    };
    record.set_connector(connector);
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
        prefill_policy: routing.prefill_policy.name(),
        decode_policy: routing.decode_policy.name(),
        decode_only,
        predicted_cached,
    });
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
        targets: gw.settings.expose_target_headers,
    };
    let mut forwarded = headers::forwarded(headers);
    crate::engine::client::engine_credentials(
        &mut forwarded,
        gw.engines.forward_client_authorization,
        gw.engines.engine_authorization.as_ref(),
    );
    let prefill_base = if decode_only {
        None
    } else {
        route.prefill_base(&clean)
    };
    let request_id = record.request_id().to_owned();
    record.touched(if decode_only { "" } else { &prefill.name }, &decode.name);
    let ctx = context(&request_id, clean.clone(), &prefill);
    Ok(Box::new(Exchange {
        gw: gw.clone(),
        request_id,
        record: Some(record),
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
        decode_tokens,
        encode,
        tried_prefills: Vec::new(),
        tried_decodes: Vec::new(),
        moved: false,
        requeried: false,
    }))
}

impl Exchange {
    /// The shared state, for a task that outlives the borrow of the exchange (and hands out the
    /// handles below).
    pub(crate) fn gw(&self) -> &Arc<Gateway> {
        &self.gw
    }

    /// What the request path reads of the configuration.
    pub(crate) fn settings(&self) -> &Settings {
        &self.gw.settings
    }

    /// What the legs are sent with.
    pub(crate) fn engines(&self) -> &Engines {
        &self.gw.engines
    }

    /// The client's request id (the answer's `x-request-id`).
    pub(crate) fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The request id the engine legs carry: the one a connector that addresses its engines
    /// through it chose, else the client's.
    pub(crate) fn leg_request_id(&self) -> &str {
        self.ctx
            .transfer
            .leg_request_id
            .as_deref()
            .unwrap_or(&self.request_id)
    }

    /// The record, while the exchange still holds it.
    pub(crate) fn record(&mut self) -> Option<&mut RequestRecord> {
        self.record.as_mut()
    }

    /// Hands the record to the relayed body (which records the outcome from then on).
    pub(crate) fn take_record(&mut self) -> Result<RequestRecord, GatewayError> {
        self.record
            .take()
            .ok_or_else(|| GatewayError::Internal("request measured twice".into()))
    }

    /// The record, for the edge to record an error with (`None` once the answer holds it).
    pub(crate) fn into_record(self) -> Option<RequestRecord> {
        self.record
    }

    /// The decode's head reached the client with `status`: the record names who served it.
    pub(crate) fn answered(&mut self, status: u16) {
        if let Some(record) = self.record.as_mut() {
            record.set_served(&self.served, status);
            record
                .trace()
                .relay_started(&self.request_id, &self.served, self.prefill_cached);
        }
    }

    /// [`Exchange::answered`], and the record handed to the relayed body.
    pub(crate) fn answer_record(&mut self, status: u16) -> Result<RequestRecord, GatewayError> {
        self.answered(status);
        self.take_record()
    }

    /// The PD route.
    pub(crate) fn route(&self) -> Route {
        self.route
    }

    /// The client headers that go to the engines (with the engines' credentials).
    pub(crate) fn forwarded(&self) -> &HeaderMap {
        &self.forwarded
    }

    /// The prefill endpoint of the current attempt.
    pub(crate) fn prefill(&self) -> &Arc<Endpoint> {
        &self.prefill
    }

    /// The decode endpoint of the current attempt.
    pub(crate) fn decode(&self) -> &Arc<Endpoint> {
        &self.decode
    }

    /// The prefill's agent.
    pub(crate) fn agent(&self) -> &dyn KvTransferAgent {
        self.agent.as_ref()
    }

    /// What the answer says about who served it.
    pub(crate) fn served(&self) -> &Served {
        &self.served
    }

    /// Prompt tokens the prefill is predicted to compute (0 unknown).
    pub(crate) fn prefill_tokens(&self) -> u32 {
        self.prefill_tokens
    }

    /// Prompt tokens whose KV the decode holds, counted in its load (0 unknown).
    pub(crate) fn decode_tokens(&self) -> u32 {
        self.decode_tokens
    }

    /// The prefill's reported cached prompt tokens.
    pub(crate) fn prefill_cached(&self) -> Option<u32> {
        self.prefill_cached
    }

    /// Records the prefill's cached prompt tokens (when it reported them).
    pub(crate) fn set_prefill_cached(&mut self, cached: Option<u32>) {
        self.prefill_cached = cached;
    }

    /// Whether both legs run at once (the agent's dispatch) and the decode is not serving alone.
    pub(crate) fn concurrent_pair(&self) -> bool {
        self.agent.dispatch() == Dispatch::Concurrent && !self.alone()
    }

    /// Whether the decode serves the request alone (by choice, or after a failed prefill).
    pub(crate) fn alone(&self) -> bool {
        self.served.fallback || self.served.decode_only.is_some()
    }

    /// Marks the end of the prefill leg in the record.
    pub(crate) fn prefill_done(&mut self) {
        if let Some(r) = self.record.as_mut() {
            r.prefill_done();
        }
    }

    /// Notes a second chance in the request's trace.
    pub(crate) fn retried(&mut self) {
        if let Some(r) = self.record.as_mut() {
            r.trace().retried();
        }
    }

    /// The next prefill leg's request for the current pair: the encoder legs run first when the
    /// request goes to encoders ([`encode::for_prefill_leg`]: each prefill leg loads its items'
    /// encoder output once, so they are encoded again for each), then the agent's request (bound
    /// to the decode), with the encoders' parameters set on it.
    pub(crate) async fn prefill_request(
        &mut self,
    ) -> Result<kvtransfer::PrefillRequest, GatewayError> {
        let ec = match &self.encode {
            // A request not behind encoders (most) has nothing to run.
            None => None,
            Some(work) => {
                let (id, model) = (&self.request_id, self.model.as_deref());
                let gw = &self.gw;
                let snap = gw.store.load();
                let (engines, routing) = (&gw.engines, &gw.routing);
                encode::for_prefill_leg(engines, routing, &snap, work, id, model, &self.forwarded)
                    .await?
            }
        };
        self.agent.bind_decode(&mut self.ctx, &self.decode.pod)?;
        let source = self.prefill_base.as_ref().unwrap_or(&self.clean);
        let body = self
            .agent
            .augment_prefill_request(&mut self.ctx, &self.prefill.pod, source)?;
        match ec {
            None => Ok(body),
            ec => encode::attach(body, ec),
        }
    }

    /// The prefill answered `body`: its leg ended, and its answer goes into the decode leg's body
    /// (its KV-transfer parameters; the cached tokens it reports), or the decode recomputes the
    /// prompt when the prefill handed nothing over.
    pub(crate) fn merge_prefill(&mut self, body: &[u8]) -> Result<Bytes, GatewayError> {
        self.prefill_done();
        let merged = self
            .agent
            .merge_prefill_response(&mut self.ctx, body, &self.prefill.pod)?;
        self.prefill_cached = usage::reported(body);
        if matches!(merged, MergeOutcome::Recompute) {
            warn!(
                id = %self.request_id,
                prefill = %self.prefill.name,
                "prefill answered without KV-transfer parameters; the decode recomputes the prompt"
            );
            self.engines()
                .metrics
                .count_recompute(self.served.connector);
            // The decode computes the prompt itself: its own usage is the right one.
            self.prefill_cached = None;
        }
        Ok(self.ctx.req_body.clone())
    }

    /// Shapes the decode leg before the prefill answers (concurrent connectors): the agent
    /// merges an empty answer; the decode leg's body is then [`Exchange::decode_body`].
    pub(crate) fn merge_before_prefill(&mut self) -> Result<(), GatewayError> {
        self.agent
            .merge_prefill_response(&mut self.ctx, b"", &self.prefill.pod)?;
        Ok(())
    }

    /// The decode leg's body as the agent shaped it.
    pub(crate) fn decode_body(&self) -> Bytes {
        self.ctx.req_body.clone()
    }

    /// The client's request as a plain request (no transfer fields): what a decode serving
    /// alone is sent.
    pub(crate) fn plain_body(&self) -> Bytes {
        self.clean.to_bytes()
    }

    /// Moves the request to another prefill endpoint (same connector), with a fresh context.
    pub(crate) fn switch_prefill(&mut self, next: Arc<Endpoint>) -> Result<(), GatewayError> {
        let agent = next
            .agent
            .clone()
            .ok_or_else(|| GatewayError::Internal("prefill endpoint without an agent".into()))?;
        self.agent = agent;
        // Predicted for the endpoint it leaves, not for this one.
        self.prefill_tokens = 0;
        self.served.prefill.clone_from(&next.name);
        self.prefill = next;
        self.restart();
        self.touched();
        Ok(())
    }

    /// Moves the request to another decode endpoint (the one that answers, in the end).
    pub(crate) fn switch_decode(&mut self, next: Arc<Endpoint>) {
        if Arc::ptr_eq(&next, &self.decode) {
            return;
        }
        self.served.decode.clone_from(&next.name);
        self.decode = next;
        self.touched();
    }

    /// A fresh routing context (new transfer key) for another attempt of the request.
    pub(crate) fn restart(&mut self) {
        self.ctx = context(&self.request_id, self.clean.clone(), &self.prefill);
    }

    /// The decode serves the client's request alone after a failed prefill: marked as a
    /// fallback, counted, and with no transfer state (an id naming the failed prefill) left.
    pub(crate) fn fall_back(&mut self) {
        self.engines().metrics.count_fallback(self.served.connector);
        self.served.fallback = true;
        self.prefill_cached = None;
        self.restart();
    }

    /// Another endpoint for a failed `leg` of this request ([`select::retry_target`]), one it
    /// has not tried: for a prefill, none of the prefills it used; for a decode, none this decode
    /// leg tried, or (`moving`: the request leaves its decode) any other decode.
    pub(crate) fn retry_target(&mut self, leg: Leg, moving: bool) -> Option<Arc<Endpoint>> {
        let (tried, current) = match leg {
            Leg::Prefill => (&mut self.tried_prefills, &self.prefill),
            Leg::Decode => (&mut self.tried_decodes, &self.decode),
            Leg::Encode => return None,
        };
        let model = self.model.as_deref();
        let (prefill, decode) = (&self.prefill, &self.decode);
        let (routing, snap) = (&self.gw.routing, self.gw.store.load());
        if moving {
            let tried = std::slice::from_ref(&decode.name);
            return select::retry_target(routing, &snap, leg, model, prefill, decode, tried);
        }
        if tried.is_empty() {
            tried.push(current.name.clone());
        }
        let next = select::retry_target(routing, &snap, leg, model, prefill, decode, tried)?;
        tried.push(next.name.clone());
        Some(next)
    }

    /// A new decode leg: no decode tried for it yet.
    pub(crate) fn decode_leg_started(&mut self) {
        self.tried_decodes.clear();
    }

    /// Marks the one move to another decode; false when it was made already.
    pub(crate) fn first_move(&mut self) -> bool {
        !std::mem::replace(&mut self.moved, true)
    }

    /// Marks the one look-up of the prefill's bootstrap facts (bootstrap-based connectors);
    /// false when it was made already, or the connector has none.
    pub(crate) fn first_requery(&mut self) -> bool {
        self.agent.needs_bootstrap_lookup() && !std::mem::replace(&mut self.requeried, true)
    }

    /// Whether a decode failure may still be the prefill's stale bootstrap facts (a
    /// bootstrap-based connector, not looked up again yet).
    pub(crate) fn may_requery(&self) -> bool {
        self.agent.needs_bootstrap_lookup() && !self.requeried
    }

    /// Names the current engines in the record (the access log's `prefill` and `decode`).
    fn touched(&mut self) {
        if let Some(record) = self.record.as_mut() {
            let prefill = if self.served.decode_only.is_some() {
                ""
            } else {
                &self.prefill.name
            };
            record.touched(prefill, &self.decode.name);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What `plan` hands back, and what the request's future holds while the legs run, is a
    /// pointer: moving the exchange itself would copy all of it at every step.
    #[test]
    fn a_planned_exchange_moves_as_a_pointer() {
        use std::mem::size_of;
        let handed_back = size_of::<Result<Box<Exchange>, GatewayError>>();
        assert!(handed_back < size_of::<Exchange>());
        assert!(size_of::<Result<Box<Exchange>, GatewayError>>() <= size_of::<GatewayError>() + 8);
    }
}
