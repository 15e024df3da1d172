//! The allow-listed paths (`security.passthrough`) go to a decode endpoint: method, path and
//! query unchanged, the body a JSON object without the client's transfer fields (or empty).
//! Everything else is a 404, and a request target that is not canonical a 400, both answered
//! without touching an engine.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use bytes::Bytes;
use http::header;
use tracing::debug;

use crate::endpoints::{Endpoint, LoadGuard};
use crate::engine::client::{self, LegRequest};
use crate::error::{GatewayError, Leg};
use crate::headers::{self, DECODE_TARGET_HEADER};
use crate::http::edge;
use crate::metrics::RequestRecord;
use crate::pd::Answer;
use crate::pd::relay::RelayBody;
use crate::pd::select;
use crate::security::auth;
use crate::state::{Engines, Gateway, Settings};

/// The fallback route.
pub(crate) async fn passthrough(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    // The head's checks come first: a client without a key learns nothing, not even which paths
    // exist.
    let target = (request.method(), request.uri(), request.version());
    let pass = match edge::check_request(&gw.edge.client_keys, request.headers(), Some(target)) {
        Ok(pass) => pass,
        Err(err) => return edge::refuse(gw, request.headers(), err),
    };
    if !gw.settings.passes(request.uri().path()) {
        let path = request.uri().path().to_string();
        return edge::refuse(gw, request.headers(), GatewayError::NotFound { path });
    }
    let mut record = Some(RequestRecord::begin(
        gw.metrics.clone(),
        "passthrough",
        request.headers(),
    ));
    let result = async {
        let (parts, body) = request.into_parts();
        let body = edge::read_request_body(&gw.edge, &parts.headers, body).await?;
        let slot = gw.edge.admission.admit().await?;
        let (body, model) = clean_body(body)?;
        // The decode the PD routes would choose for a request no prefill serves: the same
        // filter, cap and policy, and the same error when there is none.
        let decode = select::decode_for(&gw.routing, &gw.store.load(), model.as_deref(), None)?;
        let answer = forward(&gw.engines, &gw.settings, &decode, &mut record, parts, body).await?;
        Ok(auth::hold(answer, slot, pass))
    }
    .await;
    edge::finish(record, result)
}

/// The body an engine may see: empty, or a JSON object (unique keys, bounded depth) without any
/// client transfer field. Returns it with its `model`.
fn clean_body(body: Bytes) -> Result<(Bytes, Option<String>), GatewayError> {
    if body.is_empty() {
        return Ok((body, None));
    }
    let mut json = kvtransfer::parse_bounded(body, kvtransfer::checks::MAX_JSON_DEPTH)
        .map_err(GatewayError::refused_body)?;
    let stripped = kvtransfer::strip_client_transfer_fields(&mut json);
    if !stripped.is_empty() {
        debug!(?stripped, "removed client-supplied transfer fields");
    }
    let model = match json.get::<Option<String>>("model") {
        Some(Ok(m)) => m,
        _ => None,
    };
    Ok((json.to_bytes(), model))
}

/// Relays the request (`parts`, its cleaned `body`) to `decode`; the relayed body takes
/// `record` (left there on an error).
async fn forward(
    engines: &Engines,
    settings: &Settings,
    decode: &Endpoint,
    record: &mut Option<RequestRecord>,
    parts: http::request::Parts,
    body: Bytes,
) -> Result<Answer, GatewayError> {
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |p| p.as_str());
    let mut forwarded = headers::forwarded(&parts.headers);
    client::engine_credentials(
        &mut forwarded,
        engines.forward_client_authorization,
        engines.engine_authorization.as_ref(),
    );
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        forwarded.insert(header::CONTENT_TYPE, ct.clone());
    }
    let load = LoadGuard::acquire(&decode.load);
    let request_id = record.as_ref().map_or("", |r| r.request_id());
    let leg = LegRequest {
        leg: Leg::Decode,
        endpoint: decode.target(),
        path: path_and_query,
        method: parts.method,
        body,
        request_id,
        headers: &forwarded,
        extra: &[],
    };
    let head = client::send_within(&engines.client, leg, settings.decode_timeout).await?;
    let Some(record) = record.take() else {
        return Err(GatewayError::Internal("request measured twice".into()));
    };
    // The answer names the request; the record keeps its id for the access log.
    let request_id = record.request_id().to_owned();
    let (head_parts, body) = head.into_parts();
    let sse = headers::is_event_stream(&head_parts.headers);
    let relay = RelayBody::new(
        body,
        settings.stream_idle_timeout,
        sse,
        vec![load],
        record,
        decode.name.clone(),
    );
    let mut response = Answer::new(Body::new(relay));
    *response.status_mut() = head_parts.status;
    headers::copy_end_to_end(&head_parts.headers, response.headers_mut());
    if settings.expose_target_headers
        && let Ok(v) = http::HeaderValue::from_str(&decode.name)
    {
        response.headers_mut().insert(DECODE_TARGET_HEADER, v);
    }
    headers::stamp_request_id(response.headers_mut(), &request_id);
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relayed_bodies_lose_every_client_transfer_field() {
        let body = br#"{"model":"m","input":"x","KV_TRANSFER_PARAMS":{"remote_host":"h"},"Remote_Port":1,"vllm_xargs":{"transfer_id":"t","keep":1}}"#;
        let (clean, model) = clean_body(Bytes::from_static(body)).unwrap();
        assert_eq!(model.as_deref(), Some("m"));
        let v: serde_json::Value = serde_json::from_slice(&clean).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"model":"m","input":"x","vllm_xargs":{"keep":1}})
        );
        assert!(clean_body(Bytes::new()).unwrap().0.is_empty());
        for bad in [
            &b"[1]"[..],
            b"\"s\"",
            br#"{"a":1,"a":2}"#,
            br#"{"a":1} x"#,
            b"\xff",
        ] {
            let err = clean_body(Bytes::copy_from_slice(bad)).unwrap_err();
            assert_eq!(err.status(), http::StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }
}
