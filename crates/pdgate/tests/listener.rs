//! The front's accept loop: HTTP/2 with prior knowledge next to HTTP/1.1, whole requests when
//! the first bytes arrive alone (an HTTP/1.1 `POST` and the HTTP/2 preface both start with
//! `P`), the client idle timeout, and graceful shutdown of open and silent connections.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::{Fleet, completion, pair, sim, start, text_of};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use pdsim::{Connector, Role};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// A TCP stream whose first write sends only `first` bytes, and whose next write waits 50 ms:
/// the server sees a request's opening bytes alone.
struct SplitFirstWrite {
    tcp: TcpStream,
    first: usize,
    state: Split,
}

enum Split {
    First,
    Waiting(Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl SplitFirstWrite {
    fn new(tcp: TcpStream, first: usize) -> Self {
        SplitFirstWrite {
            tcp,
            first,
            state: Split::First,
        }
    }
}

impl AsyncRead for SplitFirstWrite {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SplitFirstWrite {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        match &mut this.state {
            Split::First => {
                let n = buf.len().min(this.first);
                let written = std::task::ready!(Pin::new(&mut this.tcp).poll_write(cx, &buf[..n]))?;
                this.state =
                    Split::Waiting(Box::pin(tokio::time::sleep(Duration::from_millis(50))));
                Poll::Ready(Ok(written))
            }
            Split::Waiting(sleep) => {
                std::task::ready!(sleep.as_mut().poll(cx));
                this.state = Split::Done;
                Pin::new(&mut this.tcp).poll_write(cx, buf)
            }
            Split::Done => Pin::new(&mut this.tcp).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Shuts the gateway down (no drain delay) with a deadline far off: only connections that close on
/// their own let this end within 5 s.
async fn shut_down_without_waiting(fleet: Fleet, open: &str) {
    let Fleet { gateway, .. } = fleet;
    tokio::time::timeout(
        Duration::from_secs(5),
        gateway.shutdown(Duration::from_secs(60)),
    )
    .await
    .unwrap_or_else(|_| panic!("{open} held shutdown up"));
}

async fn connect(fleet: &Fleet) -> TcpStream {
    TcpStream::connect(fleet.gateway.addr()).await.unwrap()
}

/// An HTTP/2 (prior knowledge) connection to the gateway over `io`.
async fn h2<IO>(io: IO) -> http2::SendRequest<Full<Bytes>>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .handshake(TokioIo::new(io))
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    sender
}

async fn h2_completion(
    sender: &mut http2::SendRequest<Full<Bytes>>,
    fleet: &Fleet,
    stream: bool,
) -> (http::StatusCode, String) {
    let request = http::Request::post(fleet.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(completion(stream).to_string())))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(30), sender.send_request(request))
        .await
        .expect("answered in time")
        .expect("response");
    assert_eq!(response.version(), http::Version::HTTP_2);
    let status = response.status();
    let body = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_runs_the_pd_flow() {
    let fleet = pair(Connector::Nixl, |_| {}).await;
    let mut sender = h2(connect(&fleet).await).await;
    for stream in [false, true] {
        let (status, body) = h2_completion(&mut sender, &fleet, stream).await;
        assert_eq!(status, 200, "{body}");
        assert!(!text_of(&body).is_empty(), "{body}");
    }
    // Both requests went through prefill and decode, with the KV pulled.
    assert_eq!(fleet.prefill[0].stats().responses_ok, 2);
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preface_that_arrives_in_pieces_is_still_http2() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    // "PRI * HTTP" alone, then the rest of the preface 50 ms later.
    let mut sender = h2(SplitFirstWrite::new(connect(&fleet).await, 10)).await;
    let (status, body) = h2_completion(&mut sender, &fleet, false).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(fleet.decode[0].stats().transfers_pulled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_request_whose_first_byte_arrives_alone_is_served() {
    let fleet = pair(Connector::Shfs, |_| {}).await;
    // "P" matches the HTTP/2 preface so far; "PO" does not.
    let mut tcp = SplitFirstWrite::new(connect(&fleet).await, 1);
    let body = completion(false).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut response))
        .await
        .expect("answered in time")
        .unwrap();
    let response = String::from_utf8(response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    let (_, json) = response.split_once("\r\n\r\n").unwrap();
    assert!(!text_of(json).is_empty(), "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_http2_connections() {
    let fleet = pair(Connector::Shfs, |c| {
        c.shutdown.drain_delay = Duration::ZERO;
    })
    .await;
    let mut sender = h2(connect(&fleet).await).await;
    let (status, _) = h2_completion(&mut sender, &fleet, false).await;
    assert_eq!(status, 200);
    shut_down_without_waiting(fleet, "an idle HTTP/2 connection").await;
    // The server sent GOAWAY and closed: the connection is gone. The client's connection task
    // may see the GOAWAY a moment after shutdown returns, so wait for it (bounded).
    tokio::time::timeout(Duration::from_secs(10), async {
        while !sender.is_closed() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the client saw the connection close in time");
    sender
        .ready()
        .await
        .expect_err("no new request on a closed connection");
}

/// Reads until the peer closes the connection; `None` if it stays open for `limit`.
async fn read_until_closed(tcp: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    tokio::time::timeout(limit, tcp.read_to_end(&mut got))
        .await
        .ok()
        .map(|_| got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_after_the_idle_timeout_but_streams_outlast_it() {
    // Tokens every 100 ms: a 6-token stream runs ~600 ms, twice the idle timeout.
    let mut decode = sim(Role::Decode, Connector::Shfs);
    decode.latency.itl = Duration::from_millis(100);
    let fleet = start(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![decode],
        |c| {
            c.http.client_idle_timeout = Duration::from_millis(300);
        },
    )
    .await;
    let mut tcp = connect(&fleet).await;
    let body = serde_json::json!({"model": common::MODEL, "prompt": "hi", "max_tokens": 6, "stream": true})
        .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let started = tokio::time::Instant::now();
    tcp.write_all(request.as_bytes()).await.unwrap();
    // The kept-alive connection is closed by the gateway once idle: everything read until then
    // is one whole response.
    let response = read_until_closed(&mut tcp, Duration::from_secs(10))
        .await
        .expect("the idle connection was closed");
    let response = String::from_utf8(response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.contains("data: [DONE]"),
        "the stream ran to its end: {response}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the stream outlasted the timeout"
    );

    // A connection that never sends a byte is closed too.
    let mut silent = connect(&fleet).await;
    let got = read_until_closed(&mut silent, Duration::from_secs(10))
        .await
        .expect("the silent connection was closed");
    assert!(got.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_does_not_hold_shutdown_up() {
    let fleet = pair(Connector::Shfs, |c| {
        c.shutdown.drain_delay = Duration::ZERO;
    })
    .await;
    // Connected, nothing sent: waiting for its first bytes (the idle timeout is 620 s).
    let mut silent = connect(&fleet).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    shut_down_without_waiting(fleet, "a silent connection").await;
    assert!(
        read_until_closed(&mut silent, Duration::from_secs(5))
            .await
            .is_some()
    );
}
