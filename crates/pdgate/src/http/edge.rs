//! The edge of the gateway: what every request passes on its way in (head checks, the
//! size-limited body read; [`admit`], all of it in order for the PD routes) and every answer on
//! its way out. [`finish`] is the one place where an
//! error becomes an answer: rendered OpenAI-shaped, stamped with `x-request-id`, its outcome
//! recorded in `pdgate_requests_total`.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{HeaderValue, Method, Uri, Version};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use std::sync::Arc;
use tracing::debug;

use crate::error::GatewayError;
use crate::headers;
use crate::limits::Slot;
use crate::metrics::RequestRecord;
use crate::pd::Answer;
use crate::security::auth::{ClientKeys, Pass};
use crate::security::budget::{BodyBudget, Reservation};
use crate::security::guard;
use crate::state::{Edge, Gateway};

/// Largest request head (names and values) answered with more than a 431.
pub(crate) const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Most header fields in a request head. hyper is configured to parse more, so that the edge,
/// not hyper, refuses a head with a proper answer.
pub(crate) const MAX_HEADERS: usize = 100;

/// The checks every request's head passes before anything reads it, in this order: the client
/// key (a client without one learns nothing, not even which paths exist), the head's size
/// ([`check_head`]), then the request target (`target`: method, URI and version; `None` where
/// the route was already matched on an exact path, as the ext_proc server does). Used by the PD
/// routes ([`admit`]), the passthrough paths and the ext_proc server.
pub(crate) fn check_request(
    keys: &ClientKeys,
    headers: &HeaderMap,
    target: Option<(&Method, &Uri, Version)>,
) -> Result<Pass, GatewayError> {
    let pass = keys.check(headers)?;
    check_head(headers)?;
    if let Some((method, uri, version)) = target {
        guard::check_target(method, uri, version)?;
    }
    Ok(pass)
}

/// Refuses a request head larger than [`MAX_HEADER_BYTES`] or with more than [`MAX_HEADERS`]
/// fields.
pub(crate) fn check_head(headers: &HeaderMap) -> Result<(), GatewayError> {
    if headers.len() > MAX_HEADERS {
        return Err(GatewayError::HeadersTooLarge {
            limit: MAX_HEADER_BYTES,
        });
    }
    let size: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if size > MAX_HEADER_BYTES {
        return Err(GatewayError::HeadersTooLarge {
            limit: MAX_HEADER_BYTES,
        });
    }
    Ok(())
}

/// Reads a request body once, refusing more than `limit` bytes with 413, holding its size in
/// `budget` while it is read (503 when the total is in use).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    budget: &BodyBudget,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    let mut reservation = Reservation::default();
    let mut body = Limited::new(body, limit);
    if declared == Some(0) {
        return Ok(Bytes::new());
    }
    // A declared body reserves its whole length before any byte is read.
    if let Some(n) = declared.and_then(|n| usize::try_from(n).ok()) {
        budget.grow(&mut reservation, n).await?;
    }
    let mut buf = BytesMut::new();
    let mut first: Option<Bytes> = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(GatewayError::PayloadTooLarge { limit });
            }
            Err(e) => {
                return Err(GatewayError::bad_request(
                    format!("could not read the request body: {e}"),
                    None,
                ));
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let held = buf.len() + first.as_ref().map_or(0, Bytes::len) + data.len();
        budget.grow(&mut reservation, held).await?;
        // A body in one frame (most of them) is passed on without a copy.
        match first.take() {
            None if buf.is_empty() => first = Some(data),
            Some(f) => {
                let whole = declared.and_then(|n| usize::try_from(n).ok());
                buf.reserve(whole.unwrap_or(0).max(f.len() + data.len()));
                buf.extend_from_slice(&f);
                buf.extend_from_slice(&data);
            }
            None => buf.extend_from_slice(&data),
        }
    }
    Ok(first.unwrap_or_else(|| buf.freeze()))
}

/// Reads a request body within the configured `request_body_timeout` (408 otherwise) and
/// `max_body_bytes` (413). A client that sends a head and then stalls holds nothing but its
/// connection: the admission slot is taken only after this returns.
pub(crate) async fn read_request_body(
    edge: &Edge,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, GatewayError> {
    let after = edge.request_body_timeout;
    let read = read_body(headers, body, edge.max_body_bytes, &edge.body_budget);
    tokio::time::timeout(after, read)
        .await
        .unwrap_or(Err(GatewayError::BodyTimeout { after }))
}

/// A PD request let in by [`admit`]: its headers, its body, and what it holds while it runs.
pub(crate) struct Admitted {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) slot: Slot,
    pub(crate) pass: Pass,
}

/// What a request on a PD route passes on its way in, in this order: the head's checks
/// ([`check_request`]: the client key, the head's size, the request target), the body (within `request_body_timeout` and
/// `max_body_bytes`), then an admission slot (taken only once the body is read).
pub(crate) async fn admit(edge: &Edge, request: Request) -> Result<Admitted, GatewayError> {
    let target = (request.method(), request.uri(), request.version());
    let pass = check_request(&edge.client_keys, request.headers(), Some(target))?;
    let (parts, body) = request.into_parts();
    let body = read_request_body(edge, &parts.headers, body).await?;
    let slot = edge.admission.admit().await?;
    Ok(Admitted {
        headers: parts.headers,
        body,
        slot,
        pass,
    })
}

/// The end of every request: an answer passes (the flow already named the request and handed
/// its record to the body); an error is recorded in `record` (the request's, while no answer
/// holds it), rendered and stamped with the request id here, once.
pub(crate) fn finish(
    record: Option<RequestRecord>,
    result: Result<Answer, GatewayError>,
) -> Answer {
    match result {
        Ok(answer) => answer,
        Err(err) => {
            let Some(mut record) = record else {
                debug!(error = %err, "request failed");
                return render(err);
            };
            // Only failed requests pay for the copy: the record gives its id to the access log.
            let id = record.request_id().to_owned();
            record.finish_error(&err);
            debug!(id = %id, error = %err, "request failed");
            let mut answer = render(err);
            headers::stamp_request_id(answer.headers_mut(), &id);
            answer
        }
    }
}

/// The whole answer for `err`: the engine's own answer relayed as it came, or the
/// OpenAI-shaped error with its status and the headers it calls for. Called by [`finish`] only
/// (which adds the request id and records the outcome), so every error is rendered in one place.
pub(crate) fn render(err: GatewayError) -> Response {
    if let GatewayError::UpstreamStatus {
        status,
        body,
        content_type,
        ..
    } = err
    {
        let mut response = (status, body).into_response();
        if let Some(ct) = content_type {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        return response;
    }
    let status = err.status();
    let mut response = (status, err.to_json()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    match err {
        // The unread body is still on the wire: the connection cannot carry another request.
        GatewayError::PayloadTooLarge { .. }
        | GatewayError::HeadersTooLarge { .. }
        | GatewayError::BodyTimeout { .. } => {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        GatewayError::Overloaded { retry_after_secs } => {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
        }
        GatewayError::Unauthorized { .. } => {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            // The body was not read: the connection cannot carry another request.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        GatewayError::Busy { retry_after_secs }
        | GatewayError::ClientLimit {
            retry_after_secs, ..
        } => {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
            // The unread body is still on the wire.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        _ => {}
    }
    response
}

/// An error outside any flow (unknown path, wrong method): recorded under route `other`.
pub(crate) fn refuse(gw: Arc<Gateway>, headers: &HeaderMap, err: GatewayError) -> Answer {
    let record = RequestRecord::begin(gw.metrics.clone(), "other", headers);
    finish(Some(record), Err(err))
}

/// A known path asked with a method it does not serve.
pub(crate) async fn method_not_allowed(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    let err = GatewayError::MethodNotAllowed {
        method: request.method().clone(),
        path: request.uri().path().to_string(),
    };
    refuse(gw, request.headers(), err)
}
