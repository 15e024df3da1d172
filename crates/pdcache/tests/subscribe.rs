//! The KV-event subscriber against real zeromq sockets on loopback: the test plays the engine
//! with a PUB (and a ROUTER for replay) and checks what reaches the index.
#![cfg(feature = "subscriber")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdcache::events::{
    BlockHash, BlockStored, END_SEQ, EventBatch, KvEvent, encode_batch, encode_seq,
};
use pdcache::index::{CacheIndex, EndpointId, IndexConfig, Match};
use pdcache::keys::{BlockKey, token_keys};
use pdcache::subscribe::{
    BoundSubscriber, Feed, SharedIndex, SubscriberConfig, SubscriberStats, Subscription,
};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const TOPIC: &str = "kv@A@tiny";
const BS: usize = 4;

fn prompt(n: u32) -> Vec<u32> {
    (0..8).map(|i| n * 100 + i).collect()
}

fn stored(n: u32) -> EventBatch {
    let hashes = vec![
        BlockHash::Uint(u64::from(n) * 10),
        BlockHash::Uint(u64::from(n) * 10 + 1),
    ];
    let e = BlockStored::new(hashes, None, prompt(n), BS as u32);
    EventBatch {
        ts: now_secs(),
        events: vec![KvEvent::BlockStored(e)],
        data_parallel_rank: Some(0),
    }
}

fn empty() -> EventBatch {
    EventBatch {
        ts: now_secs(),
        events: vec![],
        data_parallel_rank: Some(0),
    }
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn msg(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("frames")
}

/// Published batches, (seq, payload), kept for replay as vLLM's `buffer_steps` does.
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A fake engine: a bound PUB, a bound replay ROUTER, and the batches it has published.
struct Engine {
    publisher: PubSocket,
    endpoint: String,
    replay: Option<String>,
    buffer: ReplayBuffer,
    next: u64,
    _router: Option<tokio::task::JoinHandle<()>>,
}

impl Engine {
    async fn start(with_replay: bool, omit_topic_in_replay: bool) -> Self {
        let mut publisher = PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind pub")
            .to_string();
        let buffer: ReplayBuffer = Arc::default();
        let (replay, router) = if with_replay {
            let mut router = RouterSocket::new();
            let ep = router
                .bind("tcp://127.0.0.1:0")
                .await
                .expect("bind router")
                .to_string();
            let buf = buffer.clone();
            let task = tokio::spawn(async move {
                while let Ok(req) = router.recv().await {
                    let frames = req.into_vec();
                    let [id, _, start] = frames.as_slice() else {
                        continue;
                    };
                    let start = u64::from_be_bytes(start.as_ref().try_into().expect("8 bytes"));
                    let batches: Vec<(u64, Vec<u8>)> = buf.lock().expect("lock").clone();
                    for (seq, payload) in batches.into_iter().filter(|(s, _)| *s >= start) {
                        let mut f = vec![id.clone(), Bytes::new()];
                        if !omit_topic_in_replay {
                            f.push(Bytes::from_static(TOPIC.as_bytes()));
                        }
                        f.push(Bytes::copy_from_slice(&encode_seq(seq)));
                        f.push(Bytes::from(payload));
                        router.send(msg(f)).await.expect("reply");
                    }
                    let end = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&encode_seq(END_SEQ)),
                        Bytes::new(),
                    ];
                    router.send(msg(end)).await.expect("end");
                }
            });
            (Some(ep), Some(task))
        } else {
            (None, None)
        };
        Self {
            publisher,
            endpoint,
            replay,
            buffer,
            next: 0,
            _router: router,
        }
    }

    /// Publishes the next batch; `lose` keeps it in the replay buffer but off the wire.
    async fn publish(&mut self, batch: &EventBatch, lose: bool) {
        let seq = self.next;
        self.next += 1;
        let payload = encode_batch(batch);
        self.buffer
            .lock()
            .expect("lock")
            .push((seq, payload.clone()));
        if !lose {
            let frames = vec![
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&encode_seq(seq)),
                Bytes::from(payload),
            ];
            self.publisher.send(msg(frames)).await.expect("publish");
        }
    }

    /// A restarted engine: sequence from 0, empty replay buffer.
    fn restart(&mut self) {
        self.next = 0;
        self.buffer.lock().expect("lock").clear();
    }

    /// A restarted engine process: its PUB socket closes and a new one binds the same address.
    async fn restart_process(&mut self) {
        self.restart();
        let old = std::mem::replace(&mut self.publisher, PubSocket::new());
        drop(old.close().await);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.publisher.bind(&self.endpoint).await.is_err() {
            assert!(Instant::now() < deadline, "rebind {}", self.endpoint);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn shared_index() -> (SharedIndex, EndpointId) {
    let mut idx = CacheIndex::new(IndexConfig::default(), Instant::now());
    let ep = idx.add_endpoint().expect("room");
    (Arc::new(Mutex::new(idx)), ep)
}

fn blocks_held(index: &SharedIndex, n: u32) -> u32 {
    let keys: Vec<BlockKey> = token_keys(&prompt(n), BS);
    let mut out: Vec<Match> = Vec::new();
    index.lock().expect("lock").match_prefix(&keys, &mut out);
    out.first().map_or(0, |m| m.blocks)
}

fn config() -> SubscriberConfig {
    SubscriberConfig {
        replay_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_millis(200),
        retry_backoff: Duration::from_millis(20),
        ..SubscriberConfig::default()
    }
}

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

/// Polls `cond` for up to 5 s.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes empty batches until the subscriber has applied one (PUB drops everything sent
/// before the SUB's subscription arrives).
async fn warm_up(engine: &mut Engine, stats: &SubscriberStats) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(&stats.batches) == 0 {
        assert!(Instant::now() < deadline, "subscriber never connected");
        engine.publish(&empty(), false).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn late_join_and_gaps_are_replayed_and_a_restart_clears() {
    for omit_topic in [false, true] {
        let mut engine = Engine::start(true, omit_topic).await;
        let (index, ep) = shared_index();
        // Published before anyone listens: only the replay buffer has them.
        engine.publish(&stored(1), false).await;
        let feed = Feed {
            index: index.clone(),
            endpoint: ep,
            ranks: Vec::new(),
        };
        let sub = Subscription::connect(&engine.endpoint, engine.replay.clone(), feed, config());
        let stats = sub.stats().clone();
        warm_up(&mut engine, &stats).await;
        until("the late join's replay", || blocks_held(&index, 1) == 2).await;
        assert_eq!(count(&stats.replays), 1, "omit_topic={omit_topic}");

        // A batch lost on the wire: the next one reveals the gap, the replay fills it.
        engine.publish(&stored(2), true).await;
        engine.publish(&stored(3), false).await;
        until("gap replay", || {
            blocks_held(&index, 2) == 2 && blocks_held(&index, 3) == 2
        })
        .await;
        assert_eq!(
            (
                count(&stats.gaps),
                count(&stats.replays),
                count(&stats.clears)
            ),
            (1, 2, 0)
        );
        // Batches the replay delivered are not measured again live; the next live one is.
        engine.publish(&empty(), false).await;
        until("a live batch", || count(&stats.lag_count) > 0).await;
        assert!(count(&stats.lag_max_us) < 5_000_000);

        // The engine restarts: its sequence starts over and its cache is gone.
        engine.restart();
        engine.publish(&stored(4), false).await;
        until("restart", || blocks_held(&index, 4) == 2).await;
        assert_eq!(count(&stats.restarts), 1);
        assert_eq!(
            (
                blocks_held(&index, 1),
                blocks_held(&index, 2),
                blocks_held(&index, 3)
            ),
            (0, 0, 0)
        );
        drop(sub);
    }
}

#[tokio::test]
async fn a_restarted_engine_process_is_followed_and_its_first_batches_replayed() {
    let mut engine = Engine::start(true, false).await;
    let (index, ep) = shared_index();
    let feed = Feed {
        index: index.clone(),
        endpoint: ep,
        ranks: Vec::new(),
    };
    let sub = Subscription::connect(&engine.endpoint, engine.replay.clone(), feed, config());
    let stats = sub.stats().clone();
    warm_up(&mut engine, &stats).await;
    engine.publish(&stored(1), false).await;
    until("store", || blocks_held(&index, 1) == 2).await;
    // The engine process restarts; what it publishes first goes out before the subscriber is
    // back (only its replay buffer has it). The subscriber notices the lost connection,
    // reconnects, drops the old entries and learns the new ones from the replay.
    let replays = count(&stats.replays);
    engine.restart_process().await;
    engine.publish(&stored(2), true).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while blocks_held(&index, 2) != 2 {
        assert!(
            Instant::now() < deadline,
            "the subscriber never learned what the restarted engine stored"
        );
        engine.publish(&empty(), false).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        count(&stats.replays) > replays,
        "its first batch came from the replay"
    );
    assert_eq!(blocks_held(&index, 1), 0, "the old cache is gone");
}

#[tokio::test]
async fn a_gap_without_replay_drops_the_endpoints_entries() {
    let mut engine = Engine::start(false, false).await;
    let (index, ep) = shared_index();
    let sub = Subscription::connect(
        &engine.endpoint,
        None,
        Feed {
            index: index.clone(),
            endpoint: ep,
            ranks: Vec::new(),
        },
        config(),
    );
    let stats = sub.stats().clone();
    warm_up(&mut engine, &stats).await;
    engine.publish(&stored(1), false).await;
    until("store", || blocks_held(&index, 1) == 2).await;
    engine.publish(&stored(2), true).await;
    engine.publish(&stored(3), false).await;
    until("gap", || count(&stats.gaps) == 1).await;
    assert_eq!(
        blocks_held(&index, 1),
        0,
        "entries before the gap may be stale: dropped"
    );
    assert_eq!(
        blocks_held(&index, 3),
        2,
        "the batch after the gap is applied"
    );
    assert_eq!(
        (count(&stats.clears), count(&stats.replay_failures)),
        (1, 0)
    );
    // Garbage on the wire is counted, not applied, and never stops the task.
    let junk = vec![Bytes::from_static(b"t"), Bytes::from_static(b"short")];
    engine.publisher.send(msg(junk)).await.expect("send");
    until("dropped", || count(&stats.dropped) == 1).await;
    engine.publish(&stored(5), false).await;
    until("after junk", || blocks_held(&index, 5) == 2).await;
}

#[tokio::test]
async fn a_bound_subscriber_routes_engines_by_topic() {
    let bound = BoundSubscriber::bind("tcp://127.0.0.1:0", config())
        .await
        .expect("bind");
    assert!(
        bound.endpoint().starts_with("tcp://127.0.0.1:"),
        "{}",
        bound.endpoint()
    );
    let (index, ep) = shared_index();
    let stats = bound
        .add(
            TOPIC,
            Feed {
                index: index.clone(),
                endpoint: ep,
                ranks: Vec::new(),
            },
            None,
        )
        .await
        .expect("add");
    // The engine connects its PUB to us, as vLLM does for a non-wildcard endpoint.
    let mut publisher = PubSocket::new();
    publisher.connect(bound.endpoint()).await.expect("connect");
    let mut seq = 0u64;
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(&stats.batches) == 0 {
        assert!(Instant::now() < deadline, "never routed");
        let payload = encode_batch(&if seq == 0 { empty() } else { stored(1) });
        let f = vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&encode_seq(seq)),
            Bytes::from(payload),
        ];
        publisher.send(msg(f)).await.expect("send");
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let f = vec![
        Bytes::from_static(TOPIC.as_bytes()),
        Bytes::copy_from_slice(&encode_seq(seq)),
        Bytes::from(encode_batch(&stored(7))),
    ];
    publisher.send(msg(f)).await.expect("send");
    until("routed store", || blocks_held(&index, 7) == 2).await;
    let other = vec![
        Bytes::from_static(b"kv@B@tiny"),
        Bytes::copy_from_slice(&encode_seq(0)),
        Bytes::from(encode_batch(&stored(8))),
    ];
    publisher.send(msg(other)).await.expect("send");
    until("unrouted", || count(&bound.unrouted().dropped) == 1).await;
    assert_eq!(blocks_held(&index, 8), 0);
    bound.remove(TOPIC).await.expect("remove");
}
