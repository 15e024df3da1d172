//! One engine leg: build the request, send it on the pool, read or stream the answer, with
//! typed failures ([`Leg`], [`UpstreamKind`]) that the flow classifies by kind, never by text.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::engine::pool::{EngineAddr, EngineBody, EnginePool, PoolError};
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::headers::X_REQUEST_ID;

/// Largest prefill response body the gateway reads into memory.
pub const MAX_PREFILL_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

/// The engine a leg goes to: its name (for errors) and address. Borrowed from whatever the
/// caller routes with, so engine I/O knows nothing of endpoints.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    /// Name used in errors and logs.
    pub name: &'a str,
    /// Where it is reached (its base URL, parsed).
    pub addr: &'a EngineAddr,
    /// The engine's own `Authorization`, replacing the one the leg's headers carry.
    pub authorization: Option<&'a HeaderValue>,
    /// The data-parallel rank the leg is pinned to, sent as `X-data-parallel-rank`.
    pub rank: Option<u32>,
}

/// The engine credentials on a leg's forwarded headers: the client's `Authorization` removed
/// unless it is to be forwarded, the engine key set when there is one.
pub(crate) fn engine_credentials(
    forwarded: &mut HeaderMap,
    forward_client: bool,
    engine: Option<&HeaderValue>,
) {
    if !forward_client {
        forwarded.remove(http::header::AUTHORIZATION);
    }
    if let Some(v) = engine {
        forwarded.insert(http::header::AUTHORIZATION, v.clone());
    }
}

/// One request to one engine.
#[derive(Debug)]
pub struct LegRequest<'a> {
    /// Which leg this is.
    pub leg: Leg,
    /// The engine.
    pub endpoint: Target<'a>,
    /// Request path (and query), e.g. `/v1/completions`.
    pub path: &'a str,
    /// HTTP method.
    pub method: Method,
    /// Request body.
    pub body: Bytes,
    /// The request id for `X-Request-Id`.
    pub request_id: &'a str,
    /// Forwarded client headers.
    pub headers: &'a HeaderMap,
    /// Agent-supplied headers (typed by the agent: nothing to check here).
    pub extra: &'a [(HeaderName, HeaderValue)],
}

/// An upstream failure of `leg` on `endpoint`.
pub fn upstream(
    leg: Leg,
    endpoint: Target<'_>,
    kind: UpstreamKind,
    detail: String,
) -> GatewayError {
    GatewayError::Upstream {
        leg,
        endpoint: endpoint.name.to_string(),
        kind,
        detail,
    }
}

/// The pool's error as an upstream failure: the kind comes from the pool's variant.
fn from_pool(leg: Leg, endpoint: Target<'_>, err: &PoolError) -> GatewayError {
    let kind = if err.is_connect() {
        UpstreamKind::Connect
    } else {
        UpstreamKind::Broken
    };
    let mut detail = match kind {
        UpstreamKind::Connect => format!("refused the connection: {err}"),
        _ => format!("failed: {err}"),
    };
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        source = s.source();
    }
    upstream(leg, endpoint, kind, detail)
}

/// Sends one leg and returns the response head (the body streams on).
pub async fn send(
    client: &EnginePool,
    leg: LegRequest<'_>,
) -> Result<Response<EngineBody>, GatewayError> {
    // Origin form: the pool knows the engine's address already.
    let mut builder = Request::builder().method(leg.method).uri(leg.path);
    if let Some(h) = builder.headers_mut() {
        h.extend(leg.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        crate::telemetry::inject_leg_context(h);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(id) = HeaderValue::from_str(leg.request_id) {
            h.insert(X_REQUEST_ID, id);
        }
        for (k, v) in leg.extra {
            h.insert(k.clone(), v.clone());
        }
        if let Some(v) = leg.endpoint.authorization {
            h.insert(header::AUTHORIZATION, v.clone());
        }
        // After the agent's headers: the router chose the rank (an agent that names one, as
        // Mooncake does, took the same choice).
        if let Some(rank) = leg.endpoint.rank {
            h.insert(
                kvtransfer::DATA_PARALLEL_RANK_HEADER,
                HeaderValue::from(rank),
            );
        }
    }
    let request = builder
        .body(Full::new(leg.body))
        .map_err(|e| GatewayError::Internal(format!("building the {:?} request: {e}", leg.leg)))?;
    let response = client
        .send(leg.endpoint.addr, request)
        .await
        .map_err(|e| from_pool(leg.leg, leg.endpoint, &e))?;
    if response.status().is_redirection() {
        // A redirect names the engine's own (internal) address in `Location`, and following it
        // would send the request where no endpoint list says: neither relayed nor followed.
        return Err(upstream(
            leg.leg,
            leg.endpoint,
            UpstreamKind::Broken,
            format!(
                "answered with a redirect ({}), which is not relayed",
                response.status().as_u16()
            ),
        ));
    }
    Ok(response)
}

/// A fully read (bounded) engine response.
#[derive(Debug)]
pub struct Collected {
    /// Status.
    pub status: StatusCode,
    /// Content type, relayed with error bodies.
    pub content_type: Option<HeaderValue>,
    /// Body.
    pub body: Bytes,
}

/// Reads a whole response body, at most [`MAX_PREFILL_RESPONSE_BYTES`].
pub async fn collect(
    leg: Leg,
    endpoint: Target<'_>,
    response: Response<EngineBody>,
) -> Result<Collected, GatewayError> {
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_PREFILL_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| {
            upstream(
                leg,
                endpoint,
                UpstreamKind::Broken,
                format!("broke its response body: {e}"),
            )
        })?
        .to_bytes();
    Ok(Collected {
        status: parts.status,
        content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
        body,
    })
}

/// Turns a non-2xx collected response into the error relayed to the client.
pub fn status_error(leg: Leg, collected: Collected) -> GatewayError {
    GatewayError::UpstreamStatus {
        leg,
        status: collected.status,
        body: collected.body,
        content_type: collected.content_type,
    }
}

/// A timeout error for `leg` on `endpoint`.
pub fn timed_out(leg: Leg, endpoint: Target<'_>, after: Duration) -> GatewayError {
    upstream(
        leg,
        endpoint,
        UpstreamKind::Timeout,
        format!("did not answer within {after:?}"),
    )
}

/// Sends `leg` and waits for the response head within `limit`.
pub async fn send_within(
    client: &EnginePool,
    leg: LegRequest<'_>,
    limit: Duration,
) -> Result<Response<EngineBody>, GatewayError> {
    let (which, endpoint) = (leg.leg, leg.endpoint);
    tokio::time::timeout(limit, send(client, leg))
        .await
        .unwrap_or_else(|_| Err(timed_out(which, endpoint, limit)))
}
