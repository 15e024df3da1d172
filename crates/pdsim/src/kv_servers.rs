//! The prefill-side servers a decode pulls KV from: the side channel
//! (shfs/nixl by request id, mooncake by transfer id) and the bootstrap
//! server (mooncake `/query`, sglang rooms).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use tokio::time::Instant;

use crate::engine::Engine;
use crate::kv_store::{KvEntry, KvStore, KvWire, LookupError};

/// The side channel: shfs/nixl pulls by request id, mooncake pulls by transfer id.
pub(crate) fn side_channel_router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/kv/{engine_id}/{request_id}", get(kv_pull))
        .route("/mooncake/{transfer_id}", get(mooncake_pull))
        .route("/p2p/{key}", get(addressed_pull))
        .with_state(engine)
}

/// The bootstrap server: mooncake `/query`, sglang rooms.
pub(crate) fn bootstrap_router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/query", get(query))
        .route("/room/{room}", get(room_join))
        .with_state(engine)
}

fn served(engine: &Engine, r: Result<KvEntry, LookupError>) -> Response {
    match r {
        Ok(e) => {
            engine.counters.transfers_served.fetch_add(1, Relaxed);
            axum::Json(KvWire::from(&e)).into_response()
        }
        Err(err) => {
            engine.counters.transfers_refused.fetch_add(1, Relaxed);
            err.into_response()
        }
    }
}

fn check_engine(engine: &Engine, asked: &str) -> Result<(), LookupError> {
    if engine.faults.load().refuse_kv {
        return Err(LookupError::Refused);
    }
    if !engine.serves_engine_id(asked) {
        return Err(LookupError::WrongEngine {
            asked: asked.to_owned(),
            actual: engine.engine_id.clone(),
        });
    }
    Ok(())
}

async fn kv_pull(
    State(engine): State<Arc<Engine>>,
    Path((engine_id, request_id)): Path<(String, String)>,
) -> Response {
    let r = check_engine(&engine, &engine_id).and_then(|()| {
        KvStore::take(&engine.kv.by_request, &request_id)?.ok_or(LookupError::Unknown(request_id))
    });
    served(&engine, r)
}

#[derive(Deserialize)]
struct WaitQuery {
    #[serde(default)]
    engine_id: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

impl WaitQuery {
    fn deadline(&self, engine: &Engine) -> Instant {
        let cap = engine.cfg.handoff_timeout;
        let d = self
            .timeout_ms
            .map_or(cap, |ms| Duration::from_millis(ms).min(cap));
        Instant::now() + d
    }
}

async fn mooncake_pull(
    State(engine): State<Arc<Engine>>,
    Path(transfer_id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Response {
    let r = match check_engine(&engine, q.engine_id.as_deref().unwrap_or_default()) {
        Ok(()) => {
            engine
                .kv
                .transfer_wait(&engine.shutdown, &transfer_id, q.deadline(&engine))
                .await
        }
        Err(e) => Err(e),
    };
    served(&engine, r)
}

/// p2pnccl / moriio / trtllm: the KV kept under `key` (the request id, or TensorRT-LLM's
/// `ctx_request_id`), waited for within the query's bound; served once.
async fn addressed_pull(
    State(engine): State<Arc<Engine>>,
    Path(key): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Response {
    let r = if engine.faults.load().refuse_kv {
        Err(LookupError::Refused)
    } else {
        engine
            .kv
            .transfer_wait(&engine.shutdown, &key, q.deadline(&engine))
            .await
    };
    served(&engine, r)
}

async fn query(State(engine): State<Arc<Engine>>) -> Response {
    let worker = format!(
        "tcp://{}:{}",
        engine.cfg.advertise_host,
        engine.side_channel_port.unwrap_or(0)
    );
    // One entry per data-parallel rank, each its own engine id (as vLLM's ranks have); the
    // KV of every rank is served by the one side channel.
    let body: serde_json::Map<String, serde_json::Value> = (0..engine.ranks.len())
        .map(|r| {
            let id = engine.rank_engine_id(r);
            (
                r.to_string(),
                serde_json::json!({"engine_id": id, "worker_addr": {"0": {"0": worker}}}),
            )
        })
        .collect();
    axum::Json(body).into_response()
}

async fn room_join(
    State(engine): State<Arc<Engine>>,
    Path(room): Path<u64>,
    Query(q): Query<WaitQuery>,
) -> Response {
    let r = if engine.faults.load().refuse_kv {
        Err(LookupError::Refused)
    } else {
        engine
            .kv
            .room_join(&engine.shutdown, room, q.deadline(&engine))
            .await
    };
    served(&engine, r)
}
