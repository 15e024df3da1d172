//! Paused-time tests for the relay's idle timeout, against a scripted engine on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::*;
use crate::engine::EnginePool;
use crate::engine::pool::PoolConfig;
use crate::metrics::Metrics;

const IDLE: Duration = Duration::from_secs(30);
/// Bounds a test whose timeout logic is broken (it would otherwise wait forever).
const GIVE_UP: Duration = Duration::from_secs(3600);

/// An engine that answers one streamed response: each chunk after its delay, then silence with
/// the connection held open.
async fn engine(script: Vec<(Duration, &'static str)>) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let authority = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut buf = [0u8; 1024];
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "the gateway left before its request head ended");
            head.extend_from_slice(&buf[..n]);
        }
        tcp.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await
        .unwrap();
        for (delay, chunk) in script {
            tokio::time::sleep(delay).await;
            let frame = format!("{:x}\r\n{chunk}\r\n", chunk.len());
            tcp.write_all(frame.as_bytes()).await.unwrap();
        }
        let mut rest = [0u8; 64];
        while matches!(tcp.read(&mut rest).await, Ok(n) if n > 0) {}
    });
    (authority, task)
}

async fn relay(authority: &str, sse: bool) -> RelayBody {
    let pool = EnginePool::new(PoolConfig {
        connect_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(90),
        max_idle_per_engine: 4,
    });
    let request = http::Request::post(format!("http://{authority}/v1/completions"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = pool.request(request).await.unwrap();
    let record = RequestRecord::start(Arc::new(Metrics::new()), "/v1/completions");
    RelayBody::new(
        response.into_body(),
        IDLE,
        sse,
        Vec::new(),
        record,
        "decode-0".to_owned(),
    )
}

/// Reads `body` to its end: the data chunks, the error that ended it (if any) and when.
async fn drain(body: RelayBody) -> (Vec<Bytes>, Option<GatewayError>, Instant) {
    // `frame()` wants an `Unpin` body; the relay holds a timer.
    drain_pinned(Box::pin(body)).await
}

async fn drain_pinned(
    mut body: Pin<Box<RelayBody>>,
) -> (Vec<Bytes>, Option<GatewayError>, Instant) {
    let mut chunks = Vec::new();
    let read = async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => chunks.extend(frame.into_data().ok()),
                Some(Err(RelayError(err))) => return Some(err),
                None => return None,
            }
        }
    };
    let err = tokio::time::timeout(GIVE_UP, read)
        .await
        .expect("the relay never ended");
    (chunks, err, Instant::now())
}

fn assert_silent_decode(err: Option<GatewayError>) {
    match err {
        Some(GatewayError::Upstream {
            leg: Leg::Decode,
            kind: UpstreamKind::Silent,
            endpoint,
            ..
        }) => assert_eq!(endpoint, "decode-0"),
        other => panic!("expected a silent decode, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn silence_for_the_idle_timeout_ends_the_body_with_a_silent_decode() {
    let (authority, _engine) = engine(vec![(Duration::ZERO, "data: a\n\n")]).await;
    let start = Instant::now();
    let body = relay(&authority, false).await;
    let (chunks, err, at) = drain(body).await;
    assert_eq!(chunks, vec![Bytes::from_static(b"data: a\n\n")]);
    assert_silent_decode(err);
    assert_eq!(at - start, IDLE);
}

#[tokio::test(start_paused = true)]
async fn every_chunk_restarts_the_idle_timeout() {
    // Gaps of 20 s each, under the 30 s timeout; their sum (40 s) is over it.
    let gap = Duration::from_secs(20);
    let (authority, _engine) = engine(vec![
        (Duration::ZERO, "data: a\n\n"),
        (gap, "data: b\n\n"),
        (gap, "data: c\n\n"),
    ])
    .await;
    let start = Instant::now();
    let body = relay(&authority, false).await;
    let (chunks, err, at) = drain(body).await;
    assert_eq!(chunks.len(), 3, "{chunks:?}");
    assert_silent_decode(err);
    assert_eq!(at - start, gap * 2 + IDLE);
}

#[tokio::test(start_paused = true)]
async fn an_event_stream_ends_its_silence_with_an_error_event() {
    let (authority, _engine) = engine(vec![(Duration::ZERO, "data: a\n\n")]).await;
    let start = Instant::now();
    let body = relay(&authority, true).await;
    let (chunks, err, at) = drain(body).await;
    assert!(
        err.is_none(),
        "an SSE body ends cleanly after its error event"
    );
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    let event = String::from_utf8_lossy(&chunks[1]);
    assert!(event.contains("error"), "{event}");
    assert_eq!(at - start, IDLE);
}

#[tokio::test(start_paused = true)]
async fn the_idle_timeout_counts_from_the_last_of_many_chunks() {
    // Chunks a second apart for longer than the timeout: the timer, set once, fires while they
    // still come and is set again from the last one each time.
    let script: Vec<(Duration, &'static str)> = (0..100)
        .map(|_| (Duration::from_secs(1), "data: t\n\n"))
        .collect();
    let (authority, _engine) = engine(script).await;
    let start = Instant::now();
    let body = relay(&authority, false).await;
    let (chunks, err, at) = drain(body).await;
    assert_eq!(chunks.len(), 100);
    assert_silent_decode(err);
    assert_eq!(at - start, Duration::from_secs(100) + IDLE);
}

#[tokio::test(start_paused = true)]
async fn a_body_read_on_by_another_task_still_times_out() {
    // The timer holds the waker of the task that polled first; another task reading on must be
    // woken at the deadline too.
    let (authority, _engine) = engine(vec![
        (Duration::ZERO, "data: a\n\n"),
        (Duration::from_secs(10), "data: b\n\n"),
    ])
    .await;
    let start = Instant::now();
    let mut body = Box::pin(relay(&authority, false).await);
    let first = tokio::spawn(async move {
        let frame = body.frame().await.unwrap().unwrap();
        // Polled once more here, so that the timer takes this task's waker.
        let pending = futures_util::poll!(body.frame());
        assert!(pending.is_pending());
        (frame, body)
    });
    let (frame, body) = first.await.unwrap();
    assert_eq!(
        frame.into_data().unwrap(),
        Bytes::from_static(b"data: a\n\n")
    );
    let (chunks, err, at) = drain_pinned(body).await;
    assert_eq!(chunks, vec![Bytes::from_static(b"data: b\n\n")]);
    assert_silent_decode(err);
    assert_eq!(at - start, Duration::from_secs(10) + IDLE);
}
