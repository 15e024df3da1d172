//! The HTTP front: OpenAI routes, health, readiness, metrics and pass-through.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderValue};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::admission;
use crate::client::{self, Leg};
use crate::endpoints::LoadGuard;
use crate::error::{GatewayError, Source};
use crate::flow::{DECODE_TARGET_HEADER, Route, is_hop_header};
use crate::gateway::Gateway;
use crate::metrics::RequestRecord;
use crate::relay::RelayBody;

/// The gateway's routes.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(passthrough)
        .with_state(gw)
}

/// Reads a request body once, refusing more than `limit` bytes with 413.
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(GatewayError::bad_request(
            format!("could not read the request body: {e}"),
            None,
        )),
    }
}

/// An error answered before the flow started, still naming the request.
fn refused(e: GatewayError, headers: &HeaderMap) -> Response {
    let mut response = e.into_response();
    if let Ok(v) = HeaderValue::from_str(&crate::flow::request_id(headers)) {
        response.headers_mut().insert(client::X_REQUEST_ID, v);
    }
    response
}

async fn pd_route(gw: Arc<Gateway>, route: Route, request: Request) -> Response {
    let slot = match gw.admission.admit().await {
        Ok(slot) => slot,
        Err(e) => return refused(e, request.headers()),
    };
    let (parts, body) = request.into_parts();
    let response = match read_body(&parts.headers, body, gw.config.max_body_bytes).await {
        Ok(bytes) => gw.handle_pd(route, &parts.headers, bytes).await,
        Err(e) => e.into_response(),
    };
    admission::hold(response, slot)
}

async fn completions(State(gw): State<Arc<Gateway>>, request: Request) -> Response {
    pd_route(gw, Route::Completions, request).await
}

async fn chat(State(gw): State<Arc<Gateway>>, request: Request) -> Response {
    pd_route(gw, Route::Chat, request).await
}

async fn models(State(gw): State<Arc<Gateway>>) -> Response {
    let snap = gw.store.load();
    let data: Vec<_> = snap
        .models
        .iter()
        .map(|m| {
            serde_json::json!({
                "id": m, "object": "model", "created": 0, "owned_by": "pdgate", "root": m, "parent": null
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    let snap = gw.store.load();
    let draining = gw.is_draining();
    let ready = snap.has_routable_pair() && !draining;
    let body = serde_json::json!({
        "ready": ready,
        "draining": draining,
        "prefill": snap.prefill.iter().map(|e| &e.name).collect::<Vec<_>>(),
        "decode": snap.decode.iter().map(|e| &e.name).collect::<Vec<_>>(),
        "excluded": snap.excluded.iter().map(|(n, why)| serde_json::json!({"endpoint": n, "reason": why})).collect::<Vec<_>>(),
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let text = gw.metrics.render(&gw.store.load());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// Any other `/v1/*` request goes to a decode endpoint unchanged.
async fn passthrough(State(gw): State<Arc<Gateway>>, request: Request) -> Response {
    if !request.uri().path().starts_with("/v1/") {
        let path = request.uri().path().to_string();
        return GatewayError::NotFound { path }.into_response();
    }
    let slot = match gw.admission.admit().await {
        Ok(slot) => slot,
        Err(e) => return refused(e, request.headers()),
    };
    admission::hold(forward(gw, request).await, slot)
}

async fn forward(gw: Arc<Gateway>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or(path);
    let body = match read_body(&parts.headers, body, gw.config.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let model = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
    let snap = gw.store.load();
    let decodes: Vec<_> = snap
        .decode
        .iter()
        .filter(|d| d.serves(model.as_deref()))
        .cloned()
        .collect();
    let Some(i) = gw.decode_policy.pick(&decodes) else {
        return GatewayError::NoEndpoint {
            what: "decode",
            model: model.unwrap_or_default(),
        }
        .into_response();
    };
    let decode = &decodes[i];
    let request_id = crate::flow::request_id(&parts.headers);
    let mut forwarded = client::forwarded_headers(&parts.headers);
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        forwarded.insert(header::CONTENT_TYPE, ct.clone());
    }
    let load = LoadGuard::acquire(&decode.load);
    let leg = Leg {
        leg: Source::Decode,
        endpoint: decode,
        path: &path_and_query,
        method: parts.method,
        body,
        request_id: &request_id,
        headers: &forwarded,
        extra: &[],
    };
    let head =
        match tokio::time::timeout(gw.config.decode_timeout, client::send(&gw.client, leg)).await {
            Ok(Ok(head)) => head,
            Ok(Err(e)) => return e.into_response(),
            Err(_) => {
                return client::timed_out(Source::Decode, decode, gw.config.decode_timeout)
                    .into_response();
            }
        };
    let (head_parts, body) = head.into_parts();
    let sse = head_parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let record = RequestRecord::start(gw.metrics.clone(), "passthrough");
    let relay = RelayBody::new(
        body,
        gw.config.stream_idle_timeout,
        sse,
        vec![load],
        record,
        decode.name.clone(),
    );
    let mut response = Response::new(Body::new(relay));
    *response.status_mut() = head_parts.status;
    for (name, value) in head_parts.headers.iter() {
        if !is_hop_header(name) {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&decode.name) {
        response.headers_mut().insert(DECODE_TARGET_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(client::X_REQUEST_ID, v);
    }
    response
}
