//! Reading engines' KV events over ZMQ into a [`CacheIndex`] (feature `subscriber`).
//!
//! Two ways to listen, matching how vLLM's publisher binds or connects (it binds when its
//! endpoint has `*`, `::` or is `ipc://`, else it connects):
//! - [`Subscription::connect`]: one SUB per engine, connected to the engine's bound PUB
//!   (`tcp://engine:5557`);
//! - [`BoundSubscriber::bind`]: one SUB bound (e.g. on `tcp://127.0.0.1:0`) that engines connect
//!   to; engines are told apart by their `topic`, so each needs its own (vLLM's
//!   `--kv-events-config '{"topic": ...}'`).
//!
//! Each message is three frames (topic, 8-byte big-endian sequence, payload). The sequence is
//! tracked per publisher: a gap is filled from the engine's replay socket when one is configured
//! (a DEALER sending `["", start_seq]`; replies `["", topic?, seq, payload]` up to the end marker
//! [`END_SEQ`]), else that endpoint's entries are dropped, since the lost batches may have
//! removed blocks we still list; a sequence that goes back means the engine restarted, so its
//! cache is gone and so are its entries. A subscriber joining an engine mid-stream asks the
//! replay socket for what it still buffers, so it starts with the engine's current blocks.
//!
//! Every wait is bounded ([`SubscriberConfig`]); tasks belong to their handle and stop when it is
//! dropped. Counters ([`SubscriberStats`]) are plain atomics for the gateway's metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::events::{END_SEQ, EventBatch, decode_batch, decode_seq, encode_seq};
use crate::index::{CacheIndex, EndpointId};

/// One model's index, shared by the gateway's routing and the subscribers that feed it.
pub type SharedIndex = Arc<Mutex<CacheIndex>>;

/// Where one engine's events go.
#[derive(Debug, Clone)]
pub struct Feed {
    /// The model's index.
    pub index: SharedIndex,
    /// The engine's id in that index: where batches go that name no rank [`Feed::ranks`]
    /// lists.
    pub endpoint: EndpointId,
    /// For an engine serving data-parallel ranks, each rank's id by rank: a batch goes to the
    /// id of its `data_parallel_rank` (each rank has its own cache). Empty: one cache.
    pub ranks: Vec<EndpointId>,
}

impl Feed {
    /// Where `batch`'s events go: its rank's id, else [`Feed::endpoint`].
    pub fn target(&self, batch: &EventBatch) -> EndpointId {
        batch
            .data_parallel_rank
            .and_then(|r| usize::try_from(r).ok())
            .and_then(|r| self.ranks.get(r).copied())
            .unwrap_or(self.endpoint)
    }
}

/// Why a subscriber could not start.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// Binding the SUB socket failed.
    #[error("bind {endpoint}: {source}")]
    Bind {
        /// The address asked for.
        endpoint: String,
        /// What zeromq said.
        source: zeromq::ZmqError,
    },
    /// The bound subscriber's task has stopped.
    #[error("the bound subscriber has stopped")]
    Stopped,
}

/// Timeouts and filters.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriberConfig {
    /// Topic prefix to subscribe to (`""`: all).
    pub topic: String,
    /// Bound on connecting a socket; retried after `retry_backoff`.
    pub connect_timeout: Duration,
    /// Bound on each reply of a replay; on expiry the replay counts as failed.
    pub replay_timeout: Duration,
    /// Bound on waiting for the next message; on expiry the wait starts again (an idle engine
    /// publishes nothing), so the task never hangs on a dead socket unnoticed.
    pub idle_timeout: Duration,
    /// Pause before reconnecting after a failure.
    pub retry_backoff: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            topic: String::new(),
            connect_timeout: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(30),
            retry_backoff: Duration::from_millis(500),
        }
    }
}

/// Counters of one publisher's stream (or, for a bound subscriber, of messages no topic
/// claimed: see [`BoundSubscriber::unrouted`]).
#[derive(Debug, Default)]
pub struct SubscriberStats {
    /// Batches applied (live or replayed).
    pub batches: AtomicU64,
    /// Events applied.
    pub events: AtomicU64,
    /// Blocks stored.
    pub blocks_stored: AtomicU64,
    /// Blocks removed.
    pub blocks_removed: AtomicU64,
    /// Messages that could not be used (wrong frame count, undecodable payload, unknown topic).
    pub dropped: AtomicU64,
    /// Sequence gaps seen.
    pub gaps: AtomicU64,
    /// Gaps (or a late start) filled from the replay socket.
    pub replays: AtomicU64,
    /// Replays that failed or did not cover the gap.
    pub replay_failures: AtomicU64,
    /// Sequence restarts (engine restarted).
    pub restarts: AtomicU64,
    /// Times the endpoint's entries were dropped (gap without replay, restart, bad batch).
    pub clears: AtomicU64,
    /// Stores skipped for an unknown parent.
    pub orphaned: AtomicU64,
    /// Lag of the last live batch (now - its `ts`), microseconds.
    pub lag_last_us: AtomicU64,
    /// Largest lag seen, microseconds.
    pub lag_max_us: AtomicU64,
    /// Sum of lags, microseconds (with `lag_count`, the mean).
    pub lag_sum_us: AtomicU64,
    /// Live batches whose lag was measured.
    pub lag_count: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl SubscriberStats {
    fn observe_lag(&self, ts: f64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let lag = now - ts;
        if !(0.0..1e6).contains(&lag) {
            return; // clocks disagree; a negative or absurd lag says nothing
        }
        let us = (lag * 1e6) as u64;
        self.lag_last_us.store(us, Ordering::Relaxed);
        self.lag_max_us.fetch_max(us, Ordering::Relaxed);
        bump(&self.lag_sum_us, us);
        bump(&self.lag_count, 1);
    }
}

/// What a sequence number means, given the last one seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqEvent {
    /// The first message of this publisher seen by us.
    First,
    /// The next one.
    InOrder,
    /// Batches `from..seq` were missed.
    Gap {
        /// The first missed sequence number.
        from: u64,
    },
    /// The sequence went back: the publisher restarted (its cache is gone).
    Restart,
}

/// Classifies `seq` against the expected next sequence number.
pub fn classify(expected: Option<u64>, seq: u64) -> SeqEvent {
    match expected {
        None => SeqEvent::First,
        Some(e) if seq == e => SeqEvent::InOrder,
        Some(e) if seq > e => SeqEvent::Gap { from: e },
        Some(_) => SeqEvent::Restart,
    }
}

/// One publisher's state: where its events go, its sequence, its replay socket.
struct Publisher {
    feed: Feed,
    replay_endpoint: Option<String>,
    replay: Option<DealerSocket>,
    expected: Option<u64>,
    stats: Arc<SubscriberStats>,
}

impl Publisher {
    fn new(feed: Feed, replay_endpoint: Option<String>, stats: Arc<SubscriberStats>) -> Self {
        Self {
            feed,
            replay_endpoint,
            replay: None,
            expected: None,
            stats,
        }
    }

    /// Drops what this publisher's events put in the index: its endpoint's entries, and each
    /// rank's it feeds (lost batches may have removed blocks of any of them).
    fn clear(&mut self) {
        if let Ok(mut idx) = self.feed.index.lock() {
            idx.clear_endpoint(self.feed.endpoint);
            for &rank in &self.feed.ranks {
                if rank != self.feed.endpoint {
                    idx.clear_endpoint(rank);
                }
            }
        }
        bump(&self.stats.clears, 1);
    }

    /// The connection was lost: start over as a late joiner, without the old socket's state.
    fn rejoin(&mut self) {
        self.clear();
        self.expected = None;
        self.replay = None;
    }

    /// Applies one payload. An undecodable batch is a lost batch: the entries go.
    fn apply(&mut self, payload: &[u8], live: bool) {
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(_) => {
                bump(&self.stats.dropped, 1);
                self.clear();
                return;
            }
        };
        if live {
            self.stats.observe_lag(batch.ts);
        }
        let target = self.feed.target(&batch);
        let st = match self.feed.index.lock() {
            Ok(mut idx) => idx.apply_batch(target, &batch, Instant::now().into_std()),
            Err(_) => return,
        };
        bump(&self.stats.batches, 1);
        bump(&self.stats.events, batch.events.len() as u64);
        bump(&self.stats.blocks_stored, st.stored);
        bump(&self.stats.blocks_removed, st.removed);
        bump(&self.stats.orphaned, st.orphaned);
    }

    /// One live message.
    async fn on_message(&mut self, seq: u64, payload: &[u8], cfg: &SubscriberConfig) {
        match classify(self.expected, seq) {
            SeqEvent::InOrder => {}
            SeqEvent::First => {
                // Joined mid-stream: learn what the engine holds from its replay buffer.
                if seq > 0
                    && self.replay_endpoint.is_some()
                    && self.replay_from(0, false, cfg).await
                {
                    bump(&self.stats.replays, 1);
                }
            }
            SeqEvent::Gap { from } => {
                bump(&self.stats.gaps, 1);
                let filled = self.replay_endpoint.is_some()
                    && self.replay_from(from, true, cfg).await
                    && self.expected.is_some_and(|e| e >= seq);
                if filled {
                    bump(&self.stats.replays, 1);
                } else {
                    if self.replay_endpoint.is_some() {
                        bump(&self.stats.replay_failures, 1);
                    }
                    self.clear();
                    self.expected = None;
                }
            }
            SeqEvent::Restart => {
                bump(&self.stats.restarts, 1);
                self.clear();
                self.expected = None;
            }
        }
        if self.expected.is_some_and(|e| seq < e) {
            return; // the replay delivered it already
        }
        self.apply(payload, true);
        self.expected = Some(seq + 1);
    }

    /// Asks the replay socket for batches from `from` and applies them in order. `strict`: the
    /// first replayed batch must be `from` (filling a gap); otherwise any start will do (a late
    /// join). Returns whether the replay ran to its end marker without a hole.
    async fn replay_from(&mut self, from: u64, strict: bool, cfg: &SubscriberConfig) -> bool {
        let ok = self.try_replay(from, strict, cfg).await;
        if !ok {
            // A socket in an unknown state (a reply may still be on its way) is not reused.
            self.replay = None;
        }
        ok
    }

    async fn try_replay(&mut self, from: u64, strict: bool, cfg: &SubscriberConfig) -> bool {
        let Some(endpoint) = self.replay_endpoint.clone() else {
            return false;
        };
        if self.replay.is_none() {
            let mut dealer = DealerSocket::new();
            match timeout(cfg.connect_timeout, dealer.connect(&endpoint)).await {
                Ok(Ok(())) => self.replay = Some(dealer),
                _ => return false,
            }
        }
        let Some(dealer) = self.replay.as_mut() else {
            return false;
        };
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&encode_seq(from)),
        ]);
        let Ok(request) = request else { return false };
        if !matches!(
            timeout(cfg.connect_timeout, dealer.send(request)).await,
            Ok(Ok(()))
        ) {
            return false;
        }
        let mut next = if strict { Some(from) } else { None };
        let mut replies = Vec::new();
        loop {
            let msg = match timeout(cfg.replay_timeout, dealer.recv()).await {
                Ok(Ok(m)) => m,
                _ => return false,
            };
            let mut frames = msg.into_vec();
            // The DEALER keeps the empty delimiter; some vLLM builds omit the topic frame.
            if frames.first().is_some_and(|f| f.is_empty()) {
                frames.remove(0);
            }
            let (seq, payload) = match frames.as_slice() {
                [_, seq, payload] | [seq, payload] => (seq.clone(), payload.clone()),
                _ => return false,
            };
            let Ok(seq) = decode_seq(&seq) else {
                return false;
            };
            if seq == END_SEQ {
                break;
            }
            if seq < from {
                continue;
            }
            match next {
                Some(n) if seq != n => return false,
                _ => next = Some(seq + 1),
            }
            replies.push((seq, payload));
        }
        // Applied only once the whole replay arrived, so a failed replay leaves nothing half done.
        for (seq, payload) in replies {
            self.apply(&payload, false);
            self.expected = Some(seq + 1);
        }
        true
    }
}

/// Splits a SUB message into (topic, seq, payload).
fn frames(msg: ZmqMessage) -> Option<(Bytes, u64, Bytes)> {
    let frames = msg.into_vec();
    match frames.as_slice() {
        [topic, seq, payload] => Some((topic.clone(), decode_seq(seq).ok()?, payload.clone())),
        _ => None,
    }
}

/// A SUB connected to one engine; stops when dropped.
#[derive(Debug)]
pub struct Subscription {
    stats: Arc<SubscriberStats>,
    task: JoinHandle<()>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Subscription {
    /// Connects to an engine's PUB (`pub_endpoint`, e.g. `tcp://10.0.0.5:5557`), with its replay
    /// ROUTER if it has one. Must be called inside a tokio runtime; connecting (and reconnecting)
    /// happens in the background.
    pub fn connect(
        pub_endpoint: &str,
        replay_endpoint: Option<String>,
        feed: Feed,
        config: SubscriberConfig,
    ) -> Self {
        let stats = Arc::new(SubscriberStats::default());
        let publisher = Publisher::new(feed, replay_endpoint, stats.clone());
        let task = tokio::spawn(run_connected(pub_endpoint.to_owned(), publisher, config));
        Self { stats, task }
    }

    /// This engine's counters.
    pub fn stats(&self) -> &Arc<SubscriberStats> {
        &self.stats
    }
}

/// How often a connected subscriber looks for a lost connection while no message arrives.
const DISCONNECT_CHECK: Duration = Duration::from_secs(1);

async fn run_connected(endpoint: String, mut publisher: Publisher, cfg: SubscriberConfig) {
    loop {
        let mut sub = SubSocket::new();
        let mut monitor = sub.monitor();
        let ready = async {
            sub.subscribe(&cfg.topic).await?;
            sub.connect(&endpoint).await
        };
        if !matches!(timeout(cfg.connect_timeout, ready).await, Ok(Ok(()))) {
            tokio::time::sleep(cfg.retry_backoff).await;
            continue;
        }
        // zeromq's own reconnection of a SUB (0.7) hears nothing from a restarted publisher, so
        // a lost connection means a new socket, connected and subscribed like the first, and a
        // fresh start: the engine may have restarted (and published more batches than we saw,
        // which its sequence alone would show as a gap), so its entries go and the next message
        // is a late join, answered from its replay buffer.
        let tick = cfg.idle_timeout.min(DISCONNECT_CHECK);
        loop {
            match timeout(tick, sub.recv()).await {
                Err(_) => {}
                Ok(Err(_)) => tokio::time::sleep(cfg.retry_backoff).await,
                Ok(Ok(msg)) => match frames(msg) {
                    Some((_, seq, payload)) => publisher.on_message(seq, &payload, &cfg).await,
                    None => bump(&publisher.stats.dropped, 1),
                },
            }
            // Other socket events (connected, retried) are dropped.
            let mut lost = false;
            while let Ok(event) = monitor.try_recv() {
                lost |= matches!(event, zeromq::SocketEvent::Disconnected(_));
            }
            if lost {
                publisher.rejoin();
                break;
            }
        }
    }
}

enum Command {
    Add {
        topic: String,
        publisher: Box<Publisher>,
    },
    Remove {
        topic: String,
    },
}

/// One SUB bound locally that engines connect to, routing by topic; stops when dropped.
#[derive(Debug)]
pub struct BoundSubscriber {
    endpoint: String,
    commands: mpsc::Sender<Command>,
    unrouted: Arc<SubscriberStats>,
    task: JoinHandle<()>,
}

impl Drop for BoundSubscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl BoundSubscriber {
    /// Binds a SUB on `addr` (e.g. `tcp://127.0.0.1:0`); engines publish to [`Self::endpoint`].
    pub async fn bind(addr: &str, config: SubscriberConfig) -> Result<Self, SubscribeError> {
        let mut sub = SubSocket::new();
        let bind_err = |source| SubscribeError::Bind {
            endpoint: addr.to_owned(),
            source,
        };
        sub.subscribe(&config.topic).await.map_err(bind_err)?;
        let endpoint = sub.bind(addr).await.map_err(bind_err)?.to_string();
        let (commands, rx) = mpsc::channel(64);
        let unrouted = Arc::new(SubscriberStats::default());
        let task = tokio::spawn(run_bound(sub, rx, unrouted.clone(), config));
        Ok(Self {
            endpoint,
            commands,
            unrouted,
            task,
        })
    }

    /// The address engines should publish to (with the actual port).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Routes messages with this exact topic to `feed`; returns that engine's counters.
    pub async fn add(
        &self,
        topic: &str,
        feed: Feed,
        replay_endpoint: Option<String>,
    ) -> Result<Arc<SubscriberStats>, SubscribeError> {
        let stats = Arc::new(SubscriberStats::default());
        let publisher = Box::new(Publisher::new(feed, replay_endpoint, stats.clone()));
        self.commands
            .send(Command::Add {
                topic: topic.to_owned(),
                publisher,
            })
            .await
            .map_err(|_| SubscribeError::Stopped)?;
        Ok(stats)
    }

    /// Stops routing a topic (the engine left discovery).
    pub async fn remove(&self, topic: &str) -> Result<(), SubscribeError> {
        self.commands
            .send(Command::Remove {
                topic: topic.to_owned(),
            })
            .await
            .map_err(|_| SubscribeError::Stopped)
    }

    /// Counters of messages that no topic claimed (`dropped`) or that were malformed.
    pub fn unrouted(&self) -> &Arc<SubscriberStats> {
        &self.unrouted
    }
}

async fn run_bound(
    mut sub: SubSocket,
    mut commands: mpsc::Receiver<Command>,
    unrouted: Arc<SubscriberStats>,
    cfg: SubscriberConfig,
) {
    let mut publishers: HashMap<Bytes, Publisher> = HashMap::new();
    loop {
        tokio::select! {
            cmd = commands.recv() => match cmd {
                Some(Command::Add { topic, publisher }) => {
                    publishers.insert(Bytes::from(topic.into_bytes()), *publisher);
                }
                Some(Command::Remove { topic }) => {
                    publishers.remove(topic.as_bytes());
                }
                None => return,
            },
            msg = timeout(cfg.idle_timeout, sub.recv()) => match msg {
                Err(_) => {}
                Ok(Err(_)) => tokio::time::sleep(cfg.retry_backoff).await,
                Ok(Ok(msg)) => match frames(msg) {
                    Some((topic, seq, payload)) => match publishers.get_mut(&topic) {
                        Some(p) => p.on_message(seq, &payload, &cfg).await,
                        None => bump(&unrouted.dropped, 1),
                    },
                    None => bump(&unrouted.dropped, 1),
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_classification() {
        assert_eq!(classify(None, 7), SeqEvent::First);
        assert_eq!(classify(Some(7), 7), SeqEvent::InOrder);
        assert_eq!(classify(Some(7), 9), SeqEvent::Gap { from: 7 });
        assert_eq!(classify(Some(7), 0), SeqEvent::Restart);
        assert_eq!(classify(Some(7), 6), SeqEvent::Restart);
    }

    #[test]
    fn a_batch_goes_to_its_ranks_cache() {
        use crate::index::{CacheIndex, IndexConfig};
        let mut index = CacheIndex::new(IndexConfig::default(), std::time::Instant::now());
        let ids: Vec<EndpointId> = (0..3).map(|_| index.add_endpoint().unwrap()).collect();
        let feed = Feed {
            index: Arc::new(Mutex::new(index)),
            endpoint: ids[1],
            ranks: ids.clone(),
        };
        let batch = |rank| EventBatch {
            ts: 0.0,
            events: Vec::new(),
            data_parallel_rank: rank,
        };
        assert_eq!(feed.target(&batch(Some(0))), ids[0]);
        assert_eq!(feed.target(&batch(Some(2))), ids[2]);
        // No rank, or one beyond the engine's: the subscription's own.
        assert_eq!(feed.target(&batch(None)), ids[1]);
        assert_eq!(feed.target(&batch(Some(7))), ids[1]);
        assert_eq!(feed.target(&batch(Some(-1))), ids[1]);
    }
}
