//! The pooled HTTP/1.1 client for engine legs.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::endpoints::Endpoint;
use crate::error::{GatewayError, Source};
use crate::pool::{EngineBody, EnginePool, PoolConfig, PoolError};

/// Shared engine client (connection pool per engine).
pub type HttpClient = EnginePool;

/// Largest prefill response body the gateway reads into memory.
pub const MAX_PREFILL_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

/// Client headers forwarded to both legs. Everything else (hop-by-hop headers, `host`,
/// `content-length`, `x-data-parallel-rank`, ...) is dropped.
const FORWARDED: [HeaderName; 6] = [
    header::AUTHORIZATION,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("baggage"),
    HeaderName::from_static("openai-organization"),
    HeaderName::from_static("openai-project"),
];

/// The request id header, on both legs and on the answer.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Builds the engine client.
pub fn build(connect_timeout: Duration) -> HttpClient {
    EnginePool::new(PoolConfig {
        connect_timeout,
        idle_timeout: Duration::from_secs(60),
        max_idle_per_engine: 4096,
    })
}

/// The client headers worth forwarding to engines.
pub fn forwarded_headers(incoming: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in &FORWARDED {
        for v in incoming.get_all(name) {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

/// One request to one engine.
#[derive(Debug)]
pub struct Leg<'a> {
    /// Which leg this is.
    pub leg: Source,
    /// The engine.
    pub endpoint: &'a Endpoint,
    /// Request path, e.g. `/v1/completions`.
    pub path: &'a str,
    /// HTTP method.
    pub method: Method,
    /// Request body.
    pub body: Bytes,
    /// The request id for `X-Request-Id`.
    pub request_id: &'a str,
    /// Forwarded client headers.
    pub headers: &'a HeaderMap,
    /// Agent-supplied headers.
    pub extra: &'a [(&'static str, String)],
}

fn upstream(leg: Source, endpoint: &Endpoint, reason: String, timeout: bool) -> GatewayError {
    GatewayError::Upstream {
        leg,
        endpoint: endpoint.name.clone(),
        reason,
        timeout,
    }
}

/// Reason prefix of a failure to connect (nothing was sent, so any endpoint may take the leg).
const CONNECT_FAILED: &str = "refused the connection";

/// Whether `err` is a failure to connect to the engine (the request never left the gateway).
pub fn is_connect_failure(err: &GatewayError) -> bool {
    matches!(err, GatewayError::Upstream { reason, timeout: false, .. } if reason.starts_with(CONNECT_FAILED))
}

fn describe(err: &PoolError) -> String {
    let prefix = if err.is_connect() {
        CONNECT_FAILED
    } else {
        "failed"
    };
    let mut text = format!("{prefix}: {err}");
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Sends one leg and returns the response head (the body streams on).
pub async fn send(client: &HttpClient, leg: Leg<'_>) -> Result<Response<EngineBody>, GatewayError> {
    let mut uri = String::with_capacity(leg.endpoint.base_url.len() + leg.path.len());
    uri.push_str(&leg.endpoint.base_url);
    uri.push_str(leg.path);
    let mut builder = Request::builder().method(leg.method).uri(uri);
    if let Some(h) = builder.headers_mut() {
        h.extend(leg.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(id) = HeaderValue::from_str(leg.request_id) {
            h.insert(X_REQUEST_ID, id);
        }
        for (k, v) in leg.extra {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(HeaderName::from_static(k), v);
            }
        }
    }
    let request = builder
        .body(Full::new(leg.body))
        .map_err(|e| GatewayError::Internal(format!("building the {:?} request: {e}", leg.leg)))?;
    client
        .request(request)
        .await
        .map_err(|e| upstream(leg.leg, leg.endpoint, describe(&e), false))
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
    leg: Source,
    endpoint: &Endpoint,
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
                format!("broke its response body: {e}"),
                false,
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
pub fn status_error(leg: Source, collected: Collected) -> GatewayError {
    GatewayError::UpstreamStatus {
        leg,
        status: collected.status,
        body: collected.body,
        content_type: collected.content_type,
    }
}

/// A timeout error for `leg` on `endpoint`.
pub fn timed_out(leg: Source, endpoint: &Endpoint, after: Duration) -> GatewayError {
    upstream(
        leg,
        endpoint,
        format!("did not answer within {after:?}"),
        true,
    )
}

/// A bounded GET for control-plane probes (`/health`, Mooncake `/query`): the whole exchange
/// within `limit`, at most `max_body` bytes read (the rest is dropped with the connection).
pub async fn get(
    client: &HttpClient,
    url: &str,
    limit: Duration,
    max_body: usize,
) -> Result<(StatusCode, Bytes), String> {
    let request = Request::builder()
        .method(Method::GET)
        .uri(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let work = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), max_body)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| format!("{url} did not answer within {limit:?}"))?
}
