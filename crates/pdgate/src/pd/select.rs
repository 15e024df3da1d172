//! Retry targets, per-endpoint caps, and engine aborts (SGLang `POST /abort_request`), including
//! the abort sent when a client leaves an SGLang stream before its end.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http::header::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::time::timeout;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{debug, warn};

use crate::client::{self, HttpClient, Leg};
use crate::endpoints::Endpoint;
use crate::error::{GatewayError, Source};
use crate::gateway::Gateway;
use crate::guarded::OnEnd;
use crate::pool::EngineBody;
use crate::relay::PartnerResult;

/// Bound on one abort call.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Drops candidates at `max_in_flight_per_endpoint`; all of them there is an overload (429).
pub fn under_cap(
    gw: &Gateway,
    candidates: Vec<Arc<Endpoint>>,
) -> Result<Vec<Arc<Endpoint>>, GatewayError> {
    let cap = gw.config.max_in_flight_per_endpoint;
    if cap == 0 || candidates.is_empty() {
        return Ok(candidates);
    }
    let open: Vec<Arc<Endpoint>> = candidates
        .into_iter()
        .filter(|e| e.load.in_flight() < cap)
        .collect();
    if open.is_empty() {
        gw.metrics.count_rejected("endpoint_cap");
        return Err(GatewayError::Overloaded {
            retry_after_secs: crate::admission::RETRY_AFTER_SECS,
        });
    }
    Ok(open)
}

impl Gateway {
    /// Another endpoint for a failed `leg`, if `max_retries`, candidates and the retry budget
    /// allow one. `tried` holds the endpoints already used for this leg. A prefill keeps the
    /// connector (the decode was chosen for it); a decode must accept it.
    pub fn retry_target(
        &self,
        leg: Source,
        model: Option<&str>,
        prefill: &Endpoint,
        decode: &Endpoint,
        tried: &[String],
    ) -> Option<Arc<Endpoint>> {
        if tried.len() > self.config.max_retries as usize {
            return None;
        }
        let snap = self.store.load();
        let cap = self.config.max_in_flight_per_endpoint;
        let connector = prefill.connector.as_deref().unwrap_or_default();
        let open = |e: &Arc<Endpoint>| {
            !tried.iter().any(|t| t == &e.name)
                && e.serves(model)
                && (cap == 0 || e.load.in_flight() < cap)
        };
        let (candidates, policy): (Vec<Arc<Endpoint>>, _) = match leg {
            Source::Prefill => (
                snap.prefill
                    .iter()
                    .filter(|p| {
                        open(p)
                            && p.connector.as_deref().unwrap_or_default() == connector
                            && snap.pairs(p, decode)
                    })
                    .cloned()
                    .collect(),
                &self.prefill_policy,
            ),
            _ => (
                snap.decode
                    .iter()
                    .filter(|d| open(d) && snap.pairs(prefill, d))
                    .cloned()
                    .collect(),
                &self.decode_policy,
            ),
        };
        // A lone candidate needs no policy (and takes no round-robin turn from new requests).
        let i = match candidates.len() {
            0 => return None,
            1 => 0,
            _ => policy.pick(&candidates)?,
        };
        if !self.retry_budget.try_withdraw() {
            warn!(leg = %leg, "retry budget exhausted; not retrying");
            return None;
        }
        self.metrics.count_retry(leg);
        Some(candidates[i].clone())
    }
}

/// What came first while a concurrent prefill was still running: the decode's first frame, or
/// the prefill's end.
#[derive(Debug)]
pub enum FirstByte {
    /// The decode's first frame (`None`: its body was empty); the prefill still runs.
    Frame(Option<Frame<Bytes>>),
    /// The prefill succeeded first.
    PrefillDone,
    /// The prefill failed first: nothing reached the client, a retry is safe.
    PrefillFailed(GatewayError),
    /// The decode broke or stayed silent past `idle`.
    DecodeFailed(GatewayError),
}

/// Waits for the decode's first frame or the prefill's end, whichever comes first.
pub async fn first_byte(
    body: &mut EngineBody,
    prefill: &mut AbortOnDropHandle<PartnerResult>,
    idle: Duration,
    decode: &Endpoint,
) -> FirstByte {
    tokio::select! {
        biased;
        done = prefill => match done {
            Ok(Ok(())) => FirstByte::PrefillDone,
            Ok(Err(e)) => FirstByte::PrefillFailed(e),
            Err(join) => FirstByte::PrefillFailed(GatewayError::Internal(format!("prefill task ended: {join}"))),
        },
        frame = timeout(idle, body.frame()) => match frame {
            Ok(None) => FirstByte::Frame(None),
            Ok(Some(Ok(frame))) => FirstByte::Frame(Some(frame)),
            Ok(Some(Err(e))) => FirstByte::DecodeFailed(GatewayError::Upstream {
                leg: Source::Decode,
                endpoint: decode.name.clone(),
                reason: format!("broke the response stream: {e}"),
                timeout: false,
            }),
            Err(_) => FirstByte::DecodeFailed(client::timed_out(Source::Decode, decode, idle)),
        },
    }
}

/// Tells an SGLang decode engine to drop `request_id` (bounded; other connectors need nothing:
/// closing the connection aborts a vLLM request).
pub async fn abort_sglang(
    client: &HttpClient,
    connector: &str,
    endpoint: &Endpoint,
    request_id: &str,
) {
    if connector != kvtransfer::CONNECTOR_TYPE_SGLANG {
        return;
    }
    let body = Bytes::from(serde_json::json!({ "rid": request_id }).to_string());
    let leg = Leg {
        leg: Source::Decode,
        endpoint,
        path: "/abort_request",
        method: Method::POST,
        body,
        request_id,
        headers: &HeaderMap::new(),
        extra: &[],
    };
    if timeout(ABORT_TIMEOUT, client::send(client, leg))
        .await
        .is_err()
    {
        debug!(endpoint = %endpoint.name, "abort_request timed out");
    }
}

/// Sends [`abort_sglang`] when dropped while armed (the client left before the stream's end).
#[derive(Debug)]
pub struct AbortOnLeave {
    client: HttpClient,
    endpoint: Arc<Endpoint>,
    request_id: String,
    tasks: TaskTracker,
    armed: bool,
}

impl AbortOnLeave {
    /// A guard for `request_id` on the SGLang decode `endpoint`.
    pub fn new(gw: &Gateway, endpoint: Arc<Endpoint>, request_id: String) -> Self {
        AbortOnLeave {
            client: gw.client.clone(),
            endpoint,
            request_id,
            tasks: gw.tasks.clone(),
            armed: true,
        }
    }
}

impl Drop for AbortOnLeave {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let endpoint = self.endpoint.clone();
        let request_id = std::mem::take(&mut self.request_id);
        self.tasks.spawn_on(
            async move {
                abort_sglang(
                    &client,
                    kvtransfer::CONNECTOR_TYPE_SGLANG,
                    &endpoint,
                    &request_id,
                )
                .await;
            },
            &runtime,
        );
    }
}

/// A clean end disarms the abort; an error or a drop before the end keeps it.
impl OnEnd for AbortOnLeave {
    fn ended(&mut self, clean: bool) {
        if clean {
            self.armed = false;
        }
    }
}
