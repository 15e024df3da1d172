//! Encoder disaggregation (EPD): the encoder role and the encoder-cache (EC) consumer.
//!
//! An encoder (`--role encode`, vLLM's `--mm-encoder-only` with an `ec_producer` connector)
//! answers a chat request carrying multimodal parts with `ec_transfer_params`, one entry per
//! item keyed by its hash, as vLLM's Mooncake EC connector does
//! (`{"do_remote_encode":true,"num_encoder_tokens":N,"remote_host":H,"remote_port":P}`), keeps
//! each item ([`crate::ec_store`]) and serves it once on its side channel (`GET /ec/{hash}`).
//! A prefill (an `ec_consumer`) given those parameters loads each of its items from the encoder
//! the entry names before it computes the prompt, and fails the request the way a failed KV load
//! fails it (500) when the item is unknown there, already transferred, expired or the encoder is
//! unreachable. An item without an entry is encoded by the prefill itself.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Map, Value, json};

use crate::ec_store::EcLookupError;
use crate::engine::Engine;
use crate::error::ApiError;
use crate::kv_pull::{host_port, seg};
use crate::mm::MmItem;
use crate::request::{Endpoint, GenRequest, parse_with};

/// The encoder's side channel: one pull of an encoded item.
pub(crate) fn side_channel_router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/ec/{hash}", get(pull))
        .with_state(engine)
}

async fn pull(State(engine): State<Arc<Engine>>, Path(hash): Path<String>) -> Response {
    let c = &engine.counters;
    let r = if engine.faults.load().refuse_kv {
        Err(EcLookupError::Refused)
    } else {
        engine.ec.take(&hash)
    };
    match r {
        Ok(tokens) => {
            c.ec_served.fetch_add(1, Relaxed);
            axum::Json(json!({"mm_hash": hash, "num_encoder_tokens": tokens})).into_response()
        }
        Err(e) => {
            c.ec_refused.fetch_add(1, Relaxed);
            e.into_response()
        }
    }
}

/// What an encoder answers a generation request: the items' `ec_transfer_params`, after the
/// simulated encoder time. Only chat requests with multimodal parts are served (what an
/// encoder-only engine does with anything else was not read from vLLM; pdsim refuses it so a
/// gateway that sends text to an encoder is caught).
pub(crate) async fn answer(engine: &Engine, endpoint: Endpoint, body: &[u8], id: &str) -> Response {
    match encode(engine, endpoint, body, id).await {
        Ok(body) => {
            let mut r = Response::new(axum::body::Body::from(body));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => e.into_response(),
    }
}

async fn encode(
    engine: &Engine,
    endpoint: Endpoint,
    body: &[u8],
    id: &str,
) -> Result<String, ApiError> {
    if endpoint != Endpoint::Chat {
        return Err(ApiError::bad(format!(
            "this encoder-only engine serves /v1/chat/completions with multimodal content, not {}",
            endpoint.path()
        )));
    }
    let req = parse_with(endpoint, body, engine.served(), &engine.tok)?;
    if req.mm.is_empty() {
        return Err(ApiError::bad(
            "this encoder-only engine got a request without multimodal content to encode",
        ));
    }
    let tokens: u32 = req.mm.iter().map(|i| i.tokens).sum();
    let latency = &engine.cfg.latency;
    let took = latency.ttft + latency.prefill_per_token * tokens;
    if !took.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(engine.clock.wall(took)) => {}
            () = engine.shutdown.cancelled() => {
                return Err(ApiError::Aborted("engine is shutting down".into()));
            }
        }
    }
    let port = engine
        .faults
        .load()
        .advertise_side_channel_port
        .or(engine.side_channel_port)
        .unwrap_or(0);
    let mut params = Map::new();
    for item in &req.mm {
        engine.ec.keep(&item.hash, item.tokens);
        engine.counters.ec_encoded.fetch_add(1, Relaxed);
        params.insert(
            item.hash.clone(),
            json!({
                "do_remote_encode": true,
                "num_encoder_tokens": item.tokens,
                "remote_host": engine.cfg.advertise_host,
                "remote_port": port,
            }),
        );
    }
    let answer = json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion",
        "created": engine.clock.now_unix() as u64,
        "model": engine.cfg.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null
        }],
        "usage": {"prompt_tokens": req.prompt.count + tokens, "total_tokens": req.prompt.count + tokens, "completion_tokens": 0},
        "prompt_logprobs": null,
        "kv_transfer_params": null,
        "ec_transfer_params": params,
    });
    Ok(answer.to_string())
}

/// The entry of `params` a consumer loads `item` from: `(host, port)` when it names where (and
/// has not been used: `do_remote_encode` false), as vLLM's `has_caches` and
/// `update_state_after_alloc` read it.
fn source(params: &Map<String, Value>, item: &MmItem) -> Option<(String, u64)> {
    let entry = params.get(&item.hash)?.as_object()?;
    if entry.get("do_remote_encode") == Some(&Value::Bool(false)) {
        return None;
    }
    let host = entry.get("remote_host")?.as_str()?.to_owned();
    let port = entry.get("remote_port")?.as_u64()?;
    Some((host, port))
}

/// An EC consumer (prefill or combined engine) loads the encoder output of `req`'s items named
/// by its `ec_transfer_params`, once per distinct item; the others it encodes itself.
///
/// # Errors
/// The 500 of a failed load (vLLM's generic engine error) when a named item cannot be loaded.
pub(crate) async fn load(
    engine: &Engine,
    req: &GenRequest,
    request_id: &str,
) -> Result<(), ApiError> {
    let c = &engine.counters;
    let mut seen = HashSet::new();
    for item in req.mm.iter().filter(|i| seen.insert(i.hash.as_str())) {
        let Some((host, port)) = req
            .ec_transfer_params
            .as_ref()
            .and_then(|p| source(p, item))
        else {
            c.ec_local.fetch_add(1, Relaxed);
            continue;
        };
        let url = format!("http://{}/ec/{}", host_port(&host, port), seg(&item.hash));
        let fail = |reason: String| {
            c.ec_failed.fetch_add(1, Relaxed);
            tracing::warn!(%request_id, mm_hash = %item.hash, error = %reason, "encoder cache load failed");
            engine.ec.failed(reason.clone());
            ApiError::KvLoad(format!(
                "encoder cache load of mm_hash {}: {reason}",
                item.hash
            ))
        };
        let timeout = engine.cfg.handoff_timeout.max(Duration::from_millis(1));
        let got = engine
            .client
            .get(url, timeout)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let pulled: Value = serde_json::from_slice(&got).map_err(|e| fail(e.to_string()))?;
        if pulled.get("mm_hash").and_then(Value::as_str) != Some(item.hash.as_str())
            || pulled.get("num_encoder_tokens").and_then(Value::as_u64)
                != Some(u64::from(item.tokens))
        {
            return Err(fail(format!(
                "the encoder sent another item ({pulled}) than this request's"
            )));
        }
        c.ec_pulled.fetch_add(1, Relaxed);
    }
    Ok(())
}
