//! The operational routes: `/v1/models`, `/health`, `/ready`, `/metrics`. They answer from the
//! snapshot and the metrics without touching an engine.

use std::sync::Arc;

use axum::extract::State;
use axum::response::IntoResponse;
use http::HeaderMap;
use http::StatusCode;
use http::header::{self, HeaderValue};

use crate::pd::Answer;
use crate::state::Gateway;

pub(crate) async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Answer {
    if let Err(err) = gw.edge.client_keys.check(&headers) {
        return crate::http::edge::refuse(gw, &headers, err);
    }
    let snap = gw.store.load();
    // Configured models, and those the healthy engines named when none is configured.
    let mut models: std::collections::BTreeSet<String> = snap.models.iter().cloned().collect();
    models.extend(gw.health.learned_models());
    let mut data: Vec<_> = models
        .iter()
        .map(|m| {
            serde_json::json!({
                "id": m, "object": "model", "created": 0, "owned_by": "pdgate", "root": m, "parent": null
            })
        })
        .collect();
    // LoRA adapters some routable engine serves, as vLLM lists them: under their base model.
    data.extend(snap.adapters.iter().map(|(a, parent)| {
        serde_json::json!({
            "id": a, "object": "model", "created": 0, "owned_by": "pdgate", "root": a, "parent": parent
        })
    }));
    axum::Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

pub(crate) async fn ready(State(gw): State<Arc<Gateway>>) -> Answer {
    let snap = gw.store.load();
    let draining = gw.is_draining();
    let missing = unserved_models(&gw, &snap);
    let ready = missing.is_empty() && !draining;
    let reason = if draining {
        Some("draining".to_string())
    } else if missing.is_empty() {
        None
    } else {
        Some(format!(
            "no prefill/decode pair that passed its health checks for {}",
            missing.join(", ")
        ))
    };
    let body = serde_json::json!({
        "ready": ready,
        "draining": draining,
        "reason": reason,
        "encode": snap.encode.iter().map(|e| &e.name).collect::<Vec<_>>(),
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

/// The models (or `any model`, for a fleet that names none) without a routable prefill/decode
/// pair whose endpoints passed their latest health check.
fn unserved_models(gw: &Gateway, snap: &crate::endpoints::Snapshot) -> Vec<String> {
    let verified = |e: &crate::endpoints::Endpoint| gw.health.verified(&e.name);
    let served = |model: Option<&str>| {
        snap.prefill.iter().any(|p| {
            p.serves(model)
                && verified(p)
                && snap
                    .decode
                    .iter()
                    .any(|d| d.serves(model) && snap.pairs(p, d) && verified(d))
        })
    };
    if snap.models.is_empty() {
        return if served(None) {
            Vec::new()
        } else {
            vec!["any model".to_string()]
        };
    }
    snap.models
        .iter()
        .filter(|m| !served(Some(m.as_str())))
        .map(|m| format!("model {m:?}"))
        .collect()
}

/// `/metrics` on the API port: behind the client keys, and absent (404) when an admin listener
/// serves it.
pub(crate) async fn api_metrics(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Answer {
    if !gw.settings.metrics_on_api {
        let err = crate::error::GatewayError::NotFound {
            path: "/metrics".into(),
        };
        return crate::http::edge::refuse(gw, &headers, err);
    }
    if let Err(err) = gw.edge.client_keys.check(&headers) {
        return crate::http::edge::refuse(gw, &headers, err);
    }
    metrics(State(gw)).await
}

/// The admin listener's routes: `/metrics`, `/health`, `/ready`, open (bind it where only
/// operators reach).
pub(crate) fn admin_router(gw: Arc<Gateway>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .with_state(gw)
}

/// Any other path (the ext-proc listener, which serves no OpenAI route): 404, OpenAI-shaped.
pub(crate) async fn not_found(gw: Arc<Gateway>, uri: http::Uri, headers: HeaderMap) -> Answer {
    let err = crate::error::GatewayError::NotFound {
        path: uri.path().to_string(),
    };
    crate::http::edge::refuse(gw, &headers, err)
}

pub(crate) async fn metrics(State(gw): State<Arc<Gateway>>) -> Answer {
    if let Some(cache) = &gw.routing.cache {
        cache.refresh_gauges();
    }
    let snap = gw.store.load();
    gw.metrics.set_fleet([
        ("encode", held(&snap.encode)),
        ("prefill", held(&snap.prefill)),
        ("decode", held(&snap.decode)),
    ]);
    let (tokens, capacity) = gw.routing.retry_budget.levels();
    gw.metrics.set_retry_budget(tokens, capacity);
    let text = gw.metrics.render();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// Each endpoint's name, requests in flight and predicted prompt tokens in computation (one
/// read of its load, so the two agree).
fn held(list: &[Arc<crate::endpoints::Endpoint>]) -> Vec<(&str, usize, usize)> {
    list.iter()
        .map(|e| {
            let (requests, tokens) = e.load.held();
            (e.name.as_str(), requests as usize, tokens as usize)
        })
        .collect()
}
