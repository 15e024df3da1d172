//! The accept loop of the OpenAI front: HTTP/1.1, and HTTP/2 with prior knowledge (h2c).
//!
//! `axum::serve` would do the same, but it tells the versions apart by reading the first bytes
//! and handing them back to hyper as a separate 24-byte read. hyper then grows the connection's
//! 8 KiB read buffer to 16 KiB for the rest of the request line, for the life of the connection
//! (8 KiB more per open stream; docs/benchmarks.md). Here the first bytes are only peeked at.
//! Unlike `axum::serve`, a connection that sends no request head for the idle timeout is closed.

use std::io;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

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
    idle: Duration,
    shutdown: CancellationToken,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    connections.spawn(connection(tcp, app.clone(), idle, shutdown.clone()));
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

async fn connection(tcp: TcpStream, app: Router, idle: Duration, shutdown: CancellationToken) {
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
    // The router takes hyper's `Incoming` bodies as they are; a clone shares its route table.
    let service = TowerToHyperService::new(app);
    let io = TokioIo::new(tcp);
    let result = if h2 {
        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .serve_connection(io, service);
        // Boxed: HTTP/2 connections are rare here, and inline their state would enlarge the task
        // of every HTTP/1.1 connection by ~2.6 KiB (massif, 1,000 open streams).
        Box::pin(until_shutdown(conn, &shutdown)).await
    } else {
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(idle)
            // More than the edge accepts, so that the edge answers an oversized head (431 with
            // a JSON body and a request id) rather than hyper (a bare 431).
            .max_headers(4 * crate::http::edge::MAX_HEADERS)
            .serve_connection(io, service);
        until_shutdown(conn, &shutdown).await
    };
    if let Err(e) = result {
        debug!(error = %e, "connection ended with an error");
    }
}

/// Drives `conn` to its end; when `shutdown` fires first, asks it to finish gracefully.
async fn until_shutdown<C: GracefulConnection>(conn: C, shutdown: &CancellationToken) -> C::Output {
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        out = conn.as_mut() => return out,
        () = shutdown.cancelled() => conn.as_mut().graceful_shutdown(),
    }
    conn.await
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
