//! Simulated KV: the prefill's store, its side channel and bootstrap servers,
//! and the decode's pull client.
//!
//! The "KV" of a prompt is its token digest and count. A prefill keeps it for a
//! lease; a decode fetches it over loopback HTTP and checks it against its own
//! prompt, so a gateway that pairs the wrong legs, drops fields or waits too
//! long makes the decode fail the way a real engine's KV load fails.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::engine::Engine;

/// What a prefill keeps for a decode.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvEntry {
    pub digest: u64,
    pub num_tokens: u32,
    pub cached_tokens: u32,
    pub expires: Instant,
}

/// The wire form of a pulled entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct KvWire {
    pub digest: String,
    pub num_tokens: u32,
    pub cached_tokens: u32,
}

impl From<&KvEntry> for KvWire {
    fn from(e: &KvEntry) -> Self {
        KvWire {
            digest: format!("{:016x}", e.digest),
            num_tokens: e.num_tokens,
            cached_tokens: e.cached_tokens,
        }
    }
}

#[derive(Debug)]
struct Room {
    decode_arrived: bool,
    failed: Option<&'static str>,
    kv: Option<KvEntry>,
    created: Instant,
}

/// KV kept by a prefill, keyed per connector.
#[derive(Debug)]
pub(crate) struct KvStore {
    /// shfs / nixl: by remote_request_id.
    by_request: Mutex<HashMap<String, KvEntry>>,
    /// mooncake: by transfer_id.
    by_transfer: Mutex<HashMap<String, KvEntry>>,
    /// sglang: by bootstrap_room.
    rooms: Mutex<HashMap<u64, Room>>,
    changed: watch::Sender<u64>,
    lease: Duration,
}

const PURGE_ABOVE: usize = 1024;

fn purge(map: &mut HashMap<String, KvEntry>, now: Instant) {
    if map.len() > PURGE_ABOVE {
        map.retain(|_, e| e.expires > now);
    }
}

/// Why a side-channel lookup failed; rendered as status + message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LookupError {
    #[error("no KV for request {0:?} on this engine")]
    Unknown(String),
    #[error("KV lease for {0:?} expired")]
    Expired(String),
    #[error("engine id mismatch: asked for {asked:?}, this engine is {actual:?}")]
    WrongEngine { asked: String, actual: String },
    #[error("KV handoff refused (injected fault)")]
    Refused,
    #[error("timed out waiting for KV of {0:?}")]
    Timeout(String),
    #[error("prefill for room {0} failed: {1}")]
    PrefillFailed(u64, &'static str),
    #[error("engine shutting down")]
    Shutdown,
}

impl IntoResponse for LookupError {
    fn into_response(self) -> Response {
        let status = match self {
            LookupError::Unknown(_) => StatusCode::NOT_FOUND,
            LookupError::Expired(_) => StatusCode::GONE,
            LookupError::WrongEngine { .. } | LookupError::PrefillFailed(..) => {
                StatusCode::CONFLICT
            }
            LookupError::Refused | LookupError::Shutdown => StatusCode::SERVICE_UNAVAILABLE,
            LookupError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
        };
        (status, self.to_string()).into_response()
    }
}

impl KvStore {
    pub fn new(lease: Duration) -> Self {
        KvStore {
            by_request: Mutex::new(HashMap::new()),
            by_transfer: Mutex::new(HashMap::new()),
            rooms: Mutex::new(HashMap::new()),
            changed: watch::Sender::new(0),
            lease,
        }
    }

    pub fn entry(&self, digest: u64, num_tokens: u32, cached_tokens: u32) -> KvEntry {
        KvEntry {
            digest,
            num_tokens,
            cached_tokens,
            expires: Instant::now() + self.lease,
        }
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn put_request(&self, request_id: String, e: KvEntry) {
        if let Ok(mut m) = self.by_request.lock() {
            purge(&mut m, Instant::now());
            m.insert(request_id, e);
        }
    }

    pub fn put_transfer(&self, transfer_id: String, e: KvEntry) {
        if let Ok(mut m) = self.by_transfer.lock() {
            purge(&mut m, Instant::now());
            m.insert(transfer_id, e);
        }
        self.notify();
    }

    /// Consumes an entry: a transfer is served once.
    fn take(
        map: &Mutex<HashMap<String, KvEntry>>,
        key: &str,
    ) -> Result<Option<KvEntry>, LookupError> {
        let mut m = map.lock().map_err(|_| LookupError::Shutdown)?;
        match m.remove(key) {
            Some(e) if e.expires <= Instant::now() => Err(LookupError::Expired(key.to_owned())),
            other => Ok(other),
        }
    }

    /// Waits until something changes or `deadline` passes; false on timeout or shutdown.
    async fn wait_change(
        rx: &mut watch::Receiver<u64>,
        deadline: Instant,
        engine: &Engine,
    ) -> bool {
        tokio::select! {
            r = tokio::time::timeout_at(deadline, rx.changed()) => matches!(r, Ok(Ok(()))),
            () = engine.shutdown.cancelled() => false,
        }
    }

    /// sglang prefill side: registers `room` and waits until its decode arrives.
    pub async fn room_await_decode(
        &self,
        engine: &Engine,
        room: u64,
        deadline: Instant,
    ) -> Result<(), LookupError> {
        let mut rx = self.changed.subscribe();
        {
            let mut rooms = self.rooms.lock().map_err(|_| LookupError::Shutdown)?;
            let now = Instant::now();
            if rooms.len() > PURGE_ABOVE {
                rooms.retain(|_, r| now.duration_since(r.created) < self.lease);
            }
            rooms.entry(room).or_insert_with(|| Room {
                decode_arrived: false,
                failed: None,
                kv: None,
                created: now,
            });
        }
        loop {
            let arrived = self
                .rooms
                .lock()
                .map_err(|_| LookupError::Shutdown)?
                .get(&room)
                .is_some_and(|r| r.decode_arrived);
            if arrived {
                return Ok(());
            }
            if !Self::wait_change(&mut rx, deadline, engine).await {
                self.room_fail(room, "prefill gave up waiting for its decode");
                return Err(LookupError::Timeout(format!(
                    "decode for bootstrap_room {room}"
                )));
            }
        }
    }

    /// sglang prefill side: the KV for `room` is ready.
    pub fn room_publish(&self, room: u64, e: KvEntry) {
        if let Ok(mut rooms) = self.rooms.lock()
            && let Some(r) = rooms.get_mut(&room)
        {
            r.kv = Some(e);
        }
        self.notify();
    }

    /// sglang prefill side: the prefill failed; tell a waiting decode.
    pub fn room_fail(&self, room: u64, why: &'static str) {
        if let Ok(mut rooms) = self.rooms.lock()
            && let Some(r) = rooms.get_mut(&room)
        {
            r.failed = Some(why);
        }
        self.notify();
    }

    /// sglang decode side (served on the prefill's bootstrap server).
    async fn room_join(
        &self,
        engine: &Engine,
        room: u64,
        deadline: Instant,
    ) -> Result<KvEntry, LookupError> {
        let mut rx = self.changed.subscribe();
        {
            let mut rooms = self.rooms.lock().map_err(|_| LookupError::Shutdown)?;
            let r = rooms.entry(room).or_insert_with(|| Room {
                decode_arrived: false,
                failed: None,
                kv: None,
                created: Instant::now(),
            });
            r.decode_arrived = true;
        }
        self.notify();
        loop {
            {
                let mut rooms = self.rooms.lock().map_err(|_| LookupError::Shutdown)?;
                if let Some(r) = rooms.get(&room) {
                    if let Some(why) = r.failed {
                        rooms.remove(&room);
                        return Err(LookupError::PrefillFailed(room, why));
                    }
                    if let Some(kv) = r.kv {
                        rooms.remove(&room);
                        return Ok(kv);
                    }
                }
            }
            if !Self::wait_change(&mut rx, deadline, engine).await {
                return Err(LookupError::Timeout(format!("bootstrap_room {room}")));
            }
        }
    }

    async fn transfer_wait(
        &self,
        engine: &Engine,
        transfer_id: &str,
        deadline: Instant,
    ) -> Result<KvEntry, LookupError> {
        let mut rx = self.changed.subscribe();
        loop {
            if let Some(e) = Self::take(&self.by_transfer, transfer_id)? {
                return Ok(e);
            }
            if !Self::wait_change(&mut rx, deadline, engine).await {
                return Err(LookupError::Timeout(format!("transfer_id {transfer_id}")));
            }
        }
    }
}

// ---------- prefill-side servers ----------

/// The side channel: shfs/nixl pulls by request id, mooncake pulls by transfer id.
pub(crate) fn side_channel_router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/kv/{engine_id}/{request_id}", get(kv_pull))
        .route("/mooncake/{transfer_id}", get(mooncake_pull))
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
    if asked != engine.engine_id {
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
                .transfer_wait(&engine, &transfer_id, q.deadline(&engine))
                .await
        }
        Err(e) => Err(e),
    };
    served(&engine, r)
}

async fn query(State(engine): State<Arc<Engine>>) -> Response {
    let worker = format!(
        "tcp://{}:{}",
        engine.cfg.advertise_host,
        engine.side_channel_port.unwrap_or(0)
    );
    let body = serde_json::json!({
        "0": {"engine_id": engine.engine_id, "worker_addr": {"0": {"0": worker}}}
    });
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
            .room_join(&engine, room, q.deadline(&engine))
            .await
    };
    served(&engine, r)
}

// ---------- decode-side client ----------

/// Why a decode could not load its KV.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("timed out after {0:?} talking to {1}")]
    Timeout(Duration, String),
    #[error("malformed answer from {0}")]
    Malformed(String),
}

/// A small HTTP/1 client for side-channel and bootstrap calls.
#[derive(Clone)]
pub(crate) struct PullClient {
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl PullClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        PullClient {
            // Idle pooled connections close on their own so no client task outlives its use for long.
            client: Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(5))
                .build(connector),
        }
    }

    /// GETs `url` and returns the body of a 200, bounded by `timeout`.
    pub async fn get(&self, url: String, timeout: Duration) -> Result<Bytes, PullError> {
        let uri: hyper::Uri =
            url.parse()
                .map_err(|e: hyper::http::uri::InvalidUri| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
        let fut = async {
            let resp = self
                .client
                .get(uri)
                .await
                .map_err(|e| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?
                .to_bytes();
            if status != StatusCode::OK {
                return Err(PullError::Status {
                    url: url.clone(),
                    status: status.as_u16(),
                    body: String::from_utf8_lossy(&body).chars().take(200).collect(),
                });
            }
            Ok(body)
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| PullError::Timeout(timeout, url.clone()))?
    }
}

/// `host:port` for a URL, bracketing IPv6 literals.
pub(crate) fn host_port(host: &str, port: u64) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
