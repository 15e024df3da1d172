//! Encoder legs (encoder disaggregation, docs/contracts.md §14): a multimodal chat request goes
//! encoder -> prefill -> decode.
//!
//! [`work`] decides, once per request, whether it goes to encoders at all: a chat request with
//! multimodal parts, a prefill leg that will run on a connector whose engines take
//! `ec_transfer_params`, and encoders in the fleet for the model. Otherwise nothing changes (a
//! text-only request, a fleet without encoders). [`for_prefill_leg`] runs the encoder legs
//! before each prefill leg, one per item, at once (each item's encoder output is handed over
//! once, so a prefill leg that runs again needs its items encoded again); each leg is bounded
//! by `encode_timeout`, a failed one is retried on another encoder (`max_retries`, the retry
//! budget). [`attach`] sets the merged parameters on the prefill leg the agent built.
//!
//! An encoder that answers a 4xx fails the request with its answer (the item itself is bad). An
//! item no encoder could encode fails the request (502/504, `on_encode_failure = "fail"`, the
//! default) or lets the prefill encode every item itself (`"fallback"`).

use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::try_join_all;
use http::{HeaderMap, Method};
use kvtransfer::JsonBody;
use kvtransfer::encoder::{self, EncodedItem};
use tokio::time::timeout;
use tracing::{Instrument, info_span, warn};

use crate::config::PrefillFailurePolicy;
use crate::endpoints::policy::{LeastRequest, Policy};
use crate::endpoints::{Endpoint, LoadGuard, Snapshot};
use crate::engine::client::{self, LegRequest};
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::route::Route;
use crate::state::{EncodeSettings, Engines, Routing};

/// Where encoders are sent a request's items.
const ENCODE_PATH: &str = "/v1/chat/completions";

/// The encoder requests of one multimodal request, built once from the client's body.
#[derive(Debug)]
pub(crate) struct Work {
    requests: Vec<Bytes>,
    /// The encoder legs' knobs, read when the work was planned.
    settings: EncodeSettings,
}

/// The encoder requests of `clean` when it goes to encoders (see the module docs); `None`
/// otherwise.
///
/// # Errors
/// A 400 for a request with more multimodal items than `encode_max_items`.
pub(crate) fn work(
    settings: &EncodeSettings,
    snapshot: &Snapshot,
    clean: &JsonBody,
    route: Route,
    model: Option<&str>,
    agent: &dyn kvtransfer::KvTransferAgent,
) -> Result<Option<Work>, GatewayError> {
    if route != Route::Chat
        || !agent.accepts_ec_transfer_params()
        || !snapshot.encode.iter().any(|e| e.serves(model))
    {
        return Ok(None);
    }
    let requests = encoder::encoder_requests(clean);
    if requests.is_empty() {
        return Ok(None);
    }
    let max = settings.max_items;
    if requests.len() > max {
        return Err(GatewayError::bad_request(
            format!(
                "the request has {} multimodal items; at most {max} are accepted",
                requests.len()
            ),
            Some("messages"),
        ));
    }
    Ok(Some(Work {
        requests,
        settings: *settings,
    }))
}

/// The prefill leg with the encoders' parameters (when there are any) as its
/// `ec_transfer_params`.
///
/// # Errors
/// An internal error when the agent's prefill body is not a JSON object.
pub(crate) fn attach(
    mut request: kvtransfer::PrefillRequest,
    params: Option<Bytes>,
) -> Result<kvtransfer::PrefillRequest, GatewayError> {
    if let Some(params) = params {
        request.body = encoder::with_ec_params(&request.body, &params)
            .map_err(|e| GatewayError::Internal(format!("prefill body: {e}")))?;
    }
    Ok(request)
}

/// Runs the encoder legs of `work` for one prefill leg, on the encoders of `snap` that serve
/// `model`: the `ec_transfer_params` the prefill leg carries (`None`: no encoder handed
/// anything over, or the fallback). `routing` gives the per-endpoint cap and what a retry may
/// use.
///
/// # Errors
/// An encoder's 4xx as it answered, or (`on_encode_failure = "fail"`) the failure of an item no
/// encoder could encode.
pub(crate) async fn for_prefill_leg(
    engines: &Engines,
    routing: &Routing,
    snap: &Snapshot,
    work: &Work,
    request_id: &str,
    model: Option<&str>,
    forwarded: &HeaderMap,
) -> Result<Option<Bytes>, GatewayError> {
    let encoders: Vec<Arc<Endpoint>> = snap
        .encode
        .iter()
        .filter(|e| e.serves(model))
        .cloned()
        .collect();
    let encoders = &encoders;
    let span = info_span!("encode", request_id, items = work.requests.len());
    let legs = work.requests.iter().enumerate().map(|(i, body)| {
        let id = format!("{request_id}:{i}:{:06x}", rand::random::<u32>() & 0xff_ffff);
        let item = Item {
            id,
            body: body.clone(),
            model,
            forwarded,
            limit: work.settings.timeout,
        };
        async move { item.encode(engines, routing, encoders).await }
    });
    match try_join_all(legs).instrument(span).await {
        Ok(items) => {
            engines.metrics.count_encode("encoded");
            let items: Vec<EncodedItem> = items.into_iter().flatten().collect();
            Ok(encoder::merge_ec_params(&items))
        }
        Err(err)
            if work.settings.on_failure == PrefillFailurePolicy::Fallback
                && !err.status().is_client_error() =>
        {
            warn!(id = %request_id, error = %err, "no encoder encoded an item; the prefill encodes the request's items itself");
            engines.metrics.count_encode("fallback");
            Ok(None)
        }
        Err(err) => {
            engines.metrics.count_encode("failed");
            Err(err)
        }
    }
}

/// One multimodal item of a request, for an encoder.
struct Item<'a> {
    /// The encoder leg's request id.
    id: String,
    body: Bytes,
    model: Option<&'a str>,
    forwarded: &'a HeaderMap,
    /// Bound on one encoder leg (`encode_timeout`).
    limit: std::time::Duration,
}

impl Item<'_> {
    /// The item on the least loaded of `encoders`, retried on another one after a retryable
    /// failure.
    async fn encode(
        &self,
        engines: &Engines,
        routing: &Routing,
        encoders: &[Arc<Endpoint>],
    ) -> Result<Option<EncodedItem>, GatewayError> {
        let cap = routing.max_in_flight_per_endpoint;
        let mut tried: Vec<String> = Vec::new();
        loop {
            let open: Vec<Arc<Endpoint>> = encoders
                .iter()
                .filter(|e| !tried.contains(&e.name))
                .filter(|e| cap == 0 || e.load.in_flight() < cap)
                .cloned()
                .collect();
            let open = routing.health.hold_back_probed(open);
            let Some(encoder) = LeastRequest.pick(&open).and_then(|i| open.get(i)) else {
                return Err(GatewayError::NoEndpoint {
                    what: "encode",
                    model: self.model.unwrap_or_default().to_string(),
                });
            };
            let encoder = encoder.clone();
            let err = match self.leg(engines, &encoder).await {
                Ok(item) => return Ok(item),
                Err(err) => err,
            };
            let again = err.retryable()
                && tried.len() < routing.max_retries
                && encoders.len() > tried.len() + 1;
            if !again || !routing.retry_budget.try_withdraw() {
                return Err(err);
            }
            routing.metrics.count_retry(Leg::Encode);
            warn!(id = %self.id, from = %encoder.name, error = %err, "encoder leg failed; retrying on another encoder");
            tried.push(encoder.name.clone());
        }
    }

    /// One encoder leg: the request, its whole answer within `encode_timeout`, the answer
    /// checked.
    async fn leg(
        &self,
        engines: &Engines,
        encoder: &Endpoint,
    ) -> Result<Option<EncodedItem>, GatewayError> {
        let _load = LoadGuard::acquire(&encoder.load);
        engines.health.begin(&encoder.name);
        let limit = self.limit;
        let request = LegRequest {
            leg: Leg::Encode,
            endpoint: encoder.target(),
            path: ENCODE_PATH,
            method: Method::POST,
            body: self.body.clone(),
            request_id: &self.id,
            headers: self.forwarded,
            extra: &[],
        };
        let work = async {
            let head = client::send(&engines.client, request).await?;
            client::collect(Leg::Encode, encoder.target(), head).await
        };
        let started = tokio::time::Instant::now();
        let result = timeout(limit, work)
            .await
            .unwrap_or_else(|_| Err(client::timed_out(Leg::Encode, encoder.target(), limit)));
        let outcome = match &result {
            Ok(c) if c.status.is_server_error() => Err(Cause::ServerError),
            Ok(_) => Ok(()),
            Err(e) => Err(Cause::of(e)),
        };
        engines.health.observe(&encoder.name, outcome);
        if outcome.is_ok() {
            engines
                .health
                .observe_latency(&encoder.name, started.elapsed());
        }
        let collected = result?;
        if !collected.status.is_success() {
            return Err(client::status_error(Leg::Encode, collected));
        }
        encoder::check_encoder_answer(&collected.body).map_err(|e| {
            client::upstream(
                Leg::Encode,
                encoder.target(),
                UpstreamKind::Broken,
                format!("answered what cannot be used: {e}"),
            )
        })
    }
}
