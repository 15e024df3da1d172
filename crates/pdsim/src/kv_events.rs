//! KV-cache events published as vLLM 0.32 does: ZMQ PUB, three frames per batch
//! (topic, 8-byte big-endian sequence, msgpack `[ts, events, dp_rank]`), and a
//! replay ROUTER that answers `["", start_seq]` with every buffered batch whose
//! sequence is at least `start_seq`, then an end marker.
//!
//! The request path never waits on a socket: it hands each cache change to a
//! bounded queue (`try_send`; a full queue drops and counts), and one publisher
//! task drains whatever is queued into one batch, like one scheduler step.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use pdcache::events::{END_SEQ, EventBatch, KvEvent, encode_batch_into, encode_seq};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::clock::SimClock;
use crate::config::{Faults, KvEventsConfig};

/// How often a stalled publisher looks whether the stall ended.
const STALL_POLL: Duration = Duration::from_millis(5);

/// Why the event sockets could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// Binding or connecting a socket failed.
    #[error("kv events {what} {endpoint}: {reason}")]
    Socket {
        /// `endpoint` or `replay_endpoint`.
        what: &'static str,
        /// The address.
        endpoint: String,
        /// What the socket library said.
        reason: String,
    },
}

/// Counters the engine reports.
#[derive(Debug, Default)]
pub(crate) struct EventCounters {
    pub batches_published: AtomicU64,
    pub batches_dropped: AtomicU64,
    pub events_published: AtomicU64,
}

/// Buffered batches for replay: (sequence, payload).
type Ring = Mutex<VecDeque<(u64, Bytes)>>;

/// The request path's handle on the publisher.
pub(crate) struct EventSink {
    tx: mpsc::Sender<Vec<KvEvent>>,
    pub counters: Arc<EventCounters>,
    seq: Arc<AtomicU64>,
    ring: Arc<Ring>,
    /// Publisher endpoint actually bound, when the PUB socket binds.
    pub bound: Option<String>,
    /// Replay endpoint actually bound.
    pub replay_bound: Option<String>,
}

impl EventSink {
    /// Queues one change; never blocks. Dropped (and counted) when the queue is full.
    pub fn send(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        if self.tx.try_send(events).is_err() {
            self.counters.batches_dropped.fetch_add(1, Relaxed);
        }
    }

    /// As after a crash: sequence back to 0, nothing buffered for replay.
    pub fn restart(&self) {
        self.seq.store(0, Ordering::SeqCst);
        if let Ok(mut r) = self.ring.lock() {
            r.clear();
        }
    }
}

/// The file of an `ipc://` endpoint this engine bound, removed when the socket's task ends (the
/// socket library leaves it behind: a test suite that starts hundreds of engines would fill
/// the temp dir with dead sockets).
struct IpcFile(Option<std::path::PathBuf>);

impl IpcFile {
    fn of(bound: &str) -> Self {
        IpcFile(bound.strip_prefix("ipc://").map(std::path::PathBuf::from))
    }
}

impl Drop for IpcFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn socket_err(what: &'static str, endpoint: &str, e: impl std::fmt::Display) -> EventsError {
    EventsError::Socket {
        what,
        endpoint: endpoint.to_owned(),
        reason: e.to_string(),
    }
}

/// Starts the publisher (and the replay server when configured).
pub(crate) async fn start(
    cfg: &KvEventsConfig,
    rank: u32,
    faults: Arc<ArcSwap<Faults>>,
    shutdown: CancellationToken,
    tasks: &mut tokio::task::JoinSet<()>,
    clock: SimClock,
) -> Result<EventSink, EventsError> {
    // Each data-parallel rank publishes on the endpoints moved by its rank, as vLLM's do.
    let moved = |what: &'static str, ep: &str| {
        pdcache::ranks::rank_endpoint(ep, rank)
            .ok_or_else(|| socket_err(what, ep, format!("no port to offset by rank {rank}")))
    };
    let endpoint = moved("endpoint", &cfg.endpoint)?;
    let replay_endpoint = cfg
        .replay_endpoint
        .as_deref()
        .map(|ep| moved("replay_endpoint", ep))
        .transpose()?;
    let mut socket = zeromq::PubSocket::new();
    let bound = if cfg.binds() {
        let ep = socket
            .bind(&crate::config::zmq_bind_address(&endpoint))
            .await
            .map_err(|e| socket_err("endpoint", &endpoint, e))?;
        Some(ep.to_string())
    } else {
        socket
            .connect(&endpoint)
            .await
            .map_err(|e| socket_err("endpoint", &endpoint, e))?;
        None
    };
    let ring: Arc<Ring> = Arc::new(Mutex::new(VecDeque::new()));
    let mut replay_bound = None;
    if let Some(ep) = &replay_endpoint {
        let mut router = zeromq::RouterSocket::new();
        let b = router
            .bind(&crate::config::zmq_bind_address(ep))
            .await
            .map_err(|e| socket_err("replay_endpoint", ep, e))?;
        replay_bound = Some(b.to_string());
        let file = IpcFile::of(&b.to_string());
        let ring = ring.clone();
        let topic = Bytes::from(cfg.topic.clone());
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let _file = file;
            tokio::select! {
                () = serve_replay(router, ring, topic) => {}
                () = stop.cancelled() => {}
            }
        });
    }
    let (tx, rx) = mpsc::channel(cfg.hwm.max(1));
    let counters = Arc::new(EventCounters::default());
    let seq = Arc::new(AtomicU64::new(0));
    let publisher = Publisher {
        socket,
        rx,
        topic: Bytes::from(cfg.topic.clone()),
        seq: seq.clone(),
        ring: ring.clone(),
        buffer_steps: cfg.buffer_steps,
        faults,
        counters: counters.clone(),
        clock,
        rank,
    };
    let file = IpcFile::of(bound.as_deref().unwrap_or_default());
    tasks.spawn(async move {
        let _file = file;
        tokio::select! {
            () = publisher.run() => {}
            () = shutdown.cancelled() => {}
        }
    });
    Ok(EventSink {
        tx,
        counters,
        seq,
        ring,
        bound,
        replay_bound,
    })
}

struct Publisher {
    socket: zeromq::PubSocket,
    rx: mpsc::Receiver<Vec<KvEvent>>,
    topic: Bytes,
    seq: Arc<AtomicU64>,
    ring: Arc<Ring>,
    buffer_steps: usize,
    faults: Arc<ArcSwap<Faults>>,
    counters: Arc<EventCounters>,
    /// Batch timestamps are simulated time.
    clock: SimClock,
    /// The data-parallel rank every batch names.
    rank: u32,
}

impl Publisher {
    async fn run(mut self) {
        let mut buf = Vec::with_capacity(1024);
        while let Some(first) = self.rx.recv().await {
            while self.faults.load().kv_events_stall {
                tokio::time::sleep(STALL_POLL).await;
            }
            let mut events = first;
            while let Ok(more) = self.rx.try_recv() {
                events.extend(more);
            }
            let n = events.len() as u64;
            let batch = EventBatch {
                ts: self.clock.now_unix(),
                events,
                data_parallel_rank: Some(i64::from(self.rank)),
            };
            buf.clear();
            encode_batch_into(&batch, &mut buf);
            let payload = Bytes::copy_from_slice(&buf);
            let (skip, drop_rate) = {
                let f = self.faults.load();
                (f.kv_events_skip_seq, f.kv_events_drop_rate)
            };
            let seq = self.seq.fetch_add(1 + skip, Ordering::SeqCst) + skip;
            if self.buffer_steps > 0
                && let Ok(mut ring) = self.ring.lock()
            {
                if ring.len() >= self.buffer_steps {
                    ring.pop_front();
                }
                ring.push_back((seq, payload.clone()));
            }
            if drop_rate > 0.0 && rand::random::<f64>() < drop_rate {
                self.counters.batches_dropped.fetch_add(1, Relaxed);
                continue;
            }
            let mut msg = ZmqMessage::from(self.topic.clone());
            msg.push_back(Bytes::copy_from_slice(&encode_seq(seq)));
            msg.push_back(payload);
            match self.socket.send(msg).await {
                Ok(()) => {
                    self.counters.batches_published.fetch_add(1, Relaxed);
                    self.counters.events_published.fetch_add(n, Relaxed);
                }
                Err(e) => {
                    self.counters.batches_dropped.fetch_add(1, Relaxed);
                    tracing::debug!(error = %e, "kv event batch not sent");
                }
            }
        }
    }
}

/// Answers `[identity, "", start_seq]` with `[identity, "", topic, seq, payload]` for every
/// buffered batch from `start_seq` on, then `[identity, "", topic, END_SEQ, ""]`.
async fn serve_replay(mut router: zeromq::RouterSocket, ring: Arc<Ring>, topic: Bytes) {
    loop {
        let msg = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "kv events replay socket stopped");
                return;
            }
        };
        let frames = msg.into_vec();
        let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = ring
            .lock()
            .map(|r| r.iter().filter(|(s, _)| *s >= start).cloned().collect())
            .unwrap_or_default();
        let frame = |seq: u64, payload: Bytes| {
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Bytes::new());
            m.push_back(topic.clone());
            m.push_back(Bytes::copy_from_slice(&encode_seq(seq)));
            m.push_back(payload);
            m
        };
        for (seq, payload) in batches {
            if router.send(frame(seq, payload)).await.is_err() {
                break;
            }
        }
        let _ = router.send(frame(END_SEQ, Bytes::new())).await;
    }
}
