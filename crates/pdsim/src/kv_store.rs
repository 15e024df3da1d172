//! The prefill's KV store: what a prefill keeps for its decode, per connector.
//!
//! The "KV" of a prompt is its token digest and count. A prefill keeps it for a
//! lease; a decode fetches it over loopback HTTP and checks it against its own
//! prompt, so a gateway that pairs the wrong legs, drops fields or waits too
//! long makes the decode fail the way a real engine's KV load fails.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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
    pub(crate) by_request: Mutex<HashMap<String, KvEntry>>,
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

    /// Whether KV is kept under `transfer_id` and not yet served (a key in use).
    pub(crate) fn transfer_pending(&self, transfer_id: &str) -> bool {
        self.by_transfer.lock().is_ok_and(|m| {
            m.get(transfer_id)
                .is_some_and(|e| e.expires > Instant::now())
        })
    }

    /// Consumes an entry: a transfer is served once.
    pub(crate) fn take(
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
        shutdown: &CancellationToken,
    ) -> bool {
        tokio::select! {
            r = tokio::time::timeout_at(deadline, rx.changed()) => matches!(r, Ok(Ok(()))),
            () = shutdown.cancelled() => false,
        }
    }

    /// sglang prefill side: registers `room` and waits until its decode arrives.
    pub async fn room_await_decode(
        &self,
        shutdown: &CancellationToken,
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
            if !Self::wait_change(&mut rx, deadline, shutdown).await {
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
    pub(crate) async fn room_join(
        &self,
        shutdown: &CancellationToken,
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
            if !Self::wait_change(&mut rx, deadline, shutdown).await {
                return Err(LookupError::Timeout(format!("bootstrap_room {room}")));
            }
        }
    }

    pub(crate) async fn transfer_wait(
        &self,
        shutdown: &CancellationToken,
        transfer_id: &str,
        deadline: Instant,
    ) -> Result<KvEntry, LookupError> {
        let mut rx = self.changed.subscribe();
        loop {
            if let Some(e) = Self::take(&self.by_transfer, transfer_id)? {
                return Ok(e);
            }
            if !Self::wait_change(&mut rx, deadline, shutdown).await {
                return Err(LookupError::Timeout(format!("transfer_id {transfer_id}")));
            }
        }
    }
}
