//! Any other `/v1/*` request goes to a decode endpoint unchanged (method, path, query, body);
//! everything else is a 404.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use http::header;

use crate::endpoints::LoadGuard;
use crate::engine::client::{self, LegRequest};
use crate::error::{GatewayError, Leg};
use crate::headers::{self, DECODE_TARGET_HEADER};
use crate::http::edge;
use crate::pd::relay::RelayBody;
use crate::pd::{Answer, Exchange};
use crate::state::Gateway;

/// The fallback route.
pub(crate) async fn passthrough(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    if !request.uri().path().starts_with("/v1/") {
        let path = request.uri().path().to_string();
        return edge::refuse(gw, request.headers(), GatewayError::NotFound { path });
    }
    let mut ex = Exchange::new(gw, "passthrough", request.headers());
    let result = async {
        edge::check_head(&ex.gw, request.headers())?;
        let slot = ex.gw.admission.admit().await?;
        let answer = forward(&mut ex, request).await?;
        Ok(crate::limits::hold(answer, slot))
    }
    .await;
    edge::finish(ex, result)
}

async fn forward(ex: &mut Exchange, request: Request) -> Result<Answer, GatewayError> {
    let gw = ex.gw.clone();
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or(path);
    let body = edge::read_body(&parts.headers, body, gw.config.max_body_bytes).await?;
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
        return Err(GatewayError::NoEndpoint {
            what: "decode",
            model: model.unwrap_or_default(),
        });
    };
    let decode = &decodes[i];
    let mut forwarded = headers::forwarded(&parts.headers);
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        forwarded.insert(header::CONTENT_TYPE, ct.clone());
    }
    let load = LoadGuard::acquire(&decode.load);
    let leg = LegRequest {
        leg: Leg::Decode,
        endpoint: decode.target(),
        path: &path_and_query,
        method: parts.method,
        body,
        request_id: &ex.request_id,
        headers: &forwarded,
        extra: &[],
    };
    let head = client::send_within(&gw.client, leg, gw.config.decode_timeout).await?;
    let (head_parts, body) = head.into_parts();
    let sse = headers::is_event_stream(&head_parts.headers);
    let relay = RelayBody::new(
        body,
        gw.config.stream_idle_timeout,
        sse,
        vec![load],
        ex.take_record()?,
        decode.name.clone(),
    );
    let mut response = Answer::new(Body::new(relay));
    *response.status_mut() = head_parts.status;
    headers::copy_end_to_end(&head_parts.headers, response.headers_mut());
    if let Ok(v) = http::HeaderValue::from_str(&decode.name) {
        response.headers_mut().insert(DECODE_TARGET_HEADER, v);
    }
    headers::stamp_request_id(response.headers_mut(), &ex.request_id);
    Ok(response)
}
