//! The accept loop of the OpenAI front: HTTP/1.1, and HTTP/2 with prior knowledge (h2c); or,
//! with a certificate configured, HTTPS with HTTP/1.1 or HTTP/2 chosen by ALPN.
//!
//! `axum::serve` would do the same, but it tells the versions apart by reading the first bytes
//! and handing them back to hyper as a separate 24-byte read. hyper then grows the connection's
//! 8 KiB read buffer to 16 KiB for the rest of the request line, for the life of the connection
//! (8 KiB more per open stream; docs/benchmarks.md). Here the first bytes are only peeked at.
//! Unlike `axum::serve`, a connection that sends no request head for the idle timeout is closed.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::engine::guarded::{GuardedBody, OnEnd};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Per-connection bounds, from the configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionLimits {
    /// `client_idle_timeout`: no request head for this long closes the connection (HTTP/1.1);
    /// an HTTP/2 connection with no open stream for this long gets GOAWAY.
    pub(crate) idle: Duration,
    /// `security.max_streams_per_connection` (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub(crate) max_streams: u32,
}

impl ConnectionLimits {
    pub(crate) fn of(config: &crate::config::Config) -> Self {
        ConnectionLimits {
            idle: config.http.client_idle_timeout,
            max_streams: config.security.max_streams_per_connection,
        }
    }
}

/// Header bytes hyper accepts in one HTTP/2 request head (HTTP/1.1's is bounded by hyper's read
/// buffer, about 400 KiB): more than the edge accepts, so that the edge answers an oversized head
/// (431 with a JSON body and a request id) rather than hyper.
const HYPER_MAX_HEADER_BYTES: usize = 4 * crate::http::edge::MAX_HEADER_BYTES;

/// What an HTTP/2 client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves `app` on `listener` until `shutdown` fires, then stops accepting, lets every open
/// connection finish its in-flight requests (idle keep-alive connections close at once) and
/// returns. A connection that sends no complete request head for `idle` (a new one before its
/// first request, a kept-alive one between requests) is closed. Connection tasks are owned here:
/// dropping the future ends them.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    let (app, shutdown) = (app.clone(), shutdown.clone());
                    match &tls {
                        None => connections.spawn(connection(tcp, app, limits, shutdown)),
                        Some(tls) => {
                            connections.spawn(tls_connection(tcp, tls.clone(), app, limits, shutdown))
                        }
                    };
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Per-connection errors (the peer reset before `accept`) are skipped; anything else (out of
/// file descriptors, ...) would repeat at once, so the loop waits a little before the next try.
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset, Interrupted};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset | Interrupted
    ) {
        return;
    }
    warn!(error = %e, "accept failed; retrying in 100 ms");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

async fn connection(
    tcp: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let idle = limits.idle;
    let _ = tcp.set_nodelay(true);
    let first = tokio::select! {
        first = tokio::time::timeout(idle, starts_with_h2_preface(&tcp)) => first,
        () = shutdown.cancelled() => return,
    };
    let h2 = match first {
        Ok(Ok(h2)) => h2,
        Ok(Err(e)) => {
            debug!(error = %e, "connection failed before its first request");
            return;
        }
        Err(_) => {
            debug!("connection sent nothing within the idle timeout");
            return;
        }
    };
    serve_connection(tcp, h2, app, limits, shutdown).await;
}

/// A TLS connection: the handshake (bounded by the idle timeout), then HTTP/2 when the client
/// chose `h2` by ALPN, HTTP/1.1 otherwise.
async fn tls_connection(
    tcp: TcpStream,
    tls: TlsAcceptor,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let handshake = tokio::select! {
        done = tokio::time::timeout(limits.idle, tls.accept(tcp)) => done,
        () = shutdown.cancelled() => return,
    };
    let stream = match handshake {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            debug!(error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!("TLS handshake not done within the idle timeout");
            return;
        }
    };
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
    serve_connection(stream, h2, app, limits, shutdown).await;
}

/// Serves one connection whose protocol is known, until it ends or shutdown closes it.
async fn serve_connection<IO>(
    io: IO,
    h2: bool,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let idle = limits.idle;
    let io = TokioIo::new(io);
    let result = if h2 {
        // HTTP/2 has no head-read timeout: the connection is closed (GOAWAY) once no stream has
        // been open for `idle`.
        let streams = Arc::new(Streams::default());
        let counted = streams.clone();
        type Incoming = http::Request<hyper::body::Incoming>;
        let counting = ServiceExt::<Incoming>::map_future(app, move |served| {
            let guard = StreamGuard::new(counted.clone());
            async move {
                served
                    .await
                    .map(|r: axum::response::Response| r.map(|b| GuardedBody::wrap(b, guard)))
            }
        });
        let service = TowerToHyperService::new(counting);
        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.max_streams)
            .max_header_list_size(u32::try_from(HYPER_MAX_HEADER_BYTES).unwrap_or(u32::MAX))
            // Rapid reset: a client that opens and resets streams faster than they are served
            // gets GOAWAY.
            .max_pending_accept_reset_streams(Some(limits.max_streams as usize))
            .max_local_error_reset_streams(Some(1024))
            .keep_alive_interval(Some(idle))
            .keep_alive_timeout(Duration::from_secs(20))
            .serve_connection(io, service);
        // Boxed: HTTP/2 connections are rare here, and inline their state would enlarge the task
        // of every HTTP/1.1 connection by ~2.6 KiB (massif, 1,000 open streams).
        Box::pin(until_shutdown(conn, &shutdown, streams.idle_for(idle))).await
    } else {
        // The router takes hyper's `Incoming` bodies as they are; a clone shares its route table.
        let service = TowerToHyperService::new(app);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(idle)
            // More than the edge accepts, so that the edge answers an oversized head (431 with
            // a JSON body and a request id) rather than hyper (a bare 431).
            .max_headers(4 * crate::http::edge::MAX_HEADERS)
            .serve_connection(io, service);
        until_shutdown(conn, &shutdown, std::future::pending()).await
    };
    if let Err(e) = result {
        debug!(error = %e, "connection ended with an error");
    }
}

/// Drives `conn` to its end; when `shutdown` fires or `idle` ends first, asks it to finish
/// gracefully.
async fn until_shutdown<C: GracefulConnection>(
    conn: C,
    shutdown: &CancellationToken,
    idle: impl std::future::Future<Output = ()>,
) -> C::Output {
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        out = conn.as_mut() => return out,
        () = shutdown.cancelled() => conn.as_mut().graceful_shutdown(),
        () = idle => {
            debug!("HTTP/2 connection idle; closing");
            conn.as_mut().graceful_shutdown();
        }
    }
    conn.await
}

/// The open streams of one HTTP/2 connection (a stream is open from its request until its
/// response body ends or is dropped).
#[derive(Debug, Default)]
struct Streams {
    open: AtomicUsize,
    changed: Notify,
}

impl Streams {
    /// Ends once no stream has been open for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            // Created before the check: a change in between still wakes it.
            let changed = self.changed.notified();
            if self.open.load(Ordering::Acquire) == 0 {
                if tokio::time::timeout(idle, changed).await.is_err()
                    && self.open.load(Ordering::Acquire) == 0
                {
                    return;
                }
            } else {
                changed.await;
            }
        }
    }
}

/// One open stream; its drop (the response body's end, or the request dropped unanswered)
/// closes it.
#[derive(Debug)]
struct StreamGuard(Arc<Streams>);

impl StreamGuard {
    fn new(streams: Arc<Streams>) -> Self {
        streams.open.fetch_add(1, Ordering::AcqRel);
        streams.changed.notify_waiters();
        StreamGuard(streams)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

impl OnEnd for StreamGuard {
    fn ended(&mut self, _clean: bool) {}
}

/// Whether the client opens with the HTTP/2 preface, decided without consuming any byte. A
/// client that has sent part of the preface so far is waited for (bounded by the caller).
async fn starts_with_h2_preface(tcp: &TcpStream) -> io::Result<bool> {
    let mut first = [0u8; H2_PREFACE.len()];
    loop {
        let n = tcp.peek(&mut first).await?;
        if n == 0 || first[..n] != H2_PREFACE[..n] {
            return Ok(false);
        }
        if n == H2_PREFACE.len() {
            return Ok(true);
        }
        // `peek` stays ready while unread bytes wait, so poll for the rest of the preface.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod timing_tests;
