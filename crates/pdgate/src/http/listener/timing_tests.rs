//! Paused-time tests for the listener's client idle timeout, over loopback sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::*;

const IDLE: Duration = Duration::from_secs(10);
/// Bounds a test whose timeout logic is broken (it would otherwise wait forever).
const GIVE_UP: Duration = Duration::from_secs(3600);
const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nhost: gateway\r\n\r\n";

struct Server {
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

async fn server() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/", get(|| async { "ok" }));
    let shutdown = CancellationToken::new();
    let limits = ConnectionLimits {
        idle: IDLE,
        max_streams: 64,
    };
    let task = tokio::spawn(serve(listener, app, limits, None, shutdown.clone()));
    Server {
        addr,
        shutdown,
        task,
    }
}

/// Reads until the server closes the connection; returns what it sent and when it closed.
async fn until_closed(tcp: &mut TcpStream) -> (String, Instant) {
    let mut seen = Vec::new();
    let read = async {
        let mut buf = [0u8; 1024];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(GIVE_UP, read)
        .await
        .expect("the connection was never closed");
    (String::from_utf8_lossy(&seen).into_owned(), Instant::now())
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_sends_nothing_is_closed_at_the_idle_timeout() {
    let s = server().await;
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    let start = Instant::now();
    let (seen, at) = until_closed(&mut tcp).await;
    assert_eq!(seen, "");
    assert_eq!(at - start, IDLE);
    s.shutdown.cancel();
    s.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_request_sent_within_the_idle_timeout_is_answered() {
    let s = server().await;
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
    tcp.write_all(REQUEST).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tcp.read(&mut buf).await.unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("ok"), "{answer}");
    s.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_partial_head_is_closed_at_the_idle_timeout() {
    let s = server().await;
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: gat").await.unwrap();
    let start = Instant::now();
    let (seen, at) = until_closed(&mut tcp).await;
    // hyper may answer 408 before closing; it must not be a served request.
    assert!(!seen.contains("200 OK"), "{seen}");
    let waited = at - start;
    assert!(
        (IDLE..IDLE + Duration::from_secs(1)).contains(&waited),
        "{waited:?}"
    );
    s.shutdown.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_kept_alive_connection_is_closed_one_idle_timeout_after_its_last_answer() {
    let s = server().await;
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    tcp.write_all(REQUEST).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tcp.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).ends_with("ok"));
    let answered = Instant::now();
    let (seen, at) = until_closed(&mut tcp).await;
    assert!(!seen.contains("200 OK"), "{seen}");
    let waited = at - answered;
    assert!(
        (IDLE..IDLE + Duration::from_secs(1)).contains(&waited),
        "{waited:?}"
    );
    s.shutdown.cancel();
}
