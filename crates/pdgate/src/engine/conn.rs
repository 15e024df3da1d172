//! One engine connection, driven by the task that uses it.
//!
//! hyper's client connection is a future that does the connection's I/O (writes the request,
//! reads and decodes the response). No task of its own polls it: the request's task polls it
//! while it waits for the response head ([`Driver::along`]), and the response body polls it
//! before each read of the body (`pool::EngineBody`). So hyper's decoder runs in the task that
//! relays the body, and every event already read from the engine is handed over in the same
//! wake-up: the client's connection writes them out together instead of one write each
//! (docs/benchmarks.md, "Streams"). An idle connection in the pool is polled by nobody; it is
//! polled again when it is taken, which is when a connection the engine closed meanwhile ends.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// The request side of an engine connection.
pub(crate) type Sender = http1::SendRequest<Full<Bytes>>;

type Plain = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;
type Tls = http1::Connection<TokioIo<TlsStream<TcpStream>>, Full<Bytes>>;

// Boxed: hyper's connection state is large, and a response (which carries it in its body) is
// moved several times on its way to the client.
enum Io {
    Plain(Box<Plain>),
    Tls(Box<Tls>),
}

/// hyper's connection future, dropped (closing the socket) once it has ended.
pub(crate) struct Driver(Option<Io>);

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("open", &self.is_open())
            .finish()
    }
}

impl Driver {
    /// Does the I/O that is possible now. A connection that ended (closed by the engine, broken,
    /// or not kept alive) is dropped: whatever waited on it has its answer or its error.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) {
        let ended = match &mut self.0 {
            Some(Io::Plain(c)) => Pin::new(&mut **c).poll(cx).is_ready(),
            Some(Io::Tls(c)) => Pin::new(&mut **c).poll(cx).is_ready(),
            None => false,
        };
        if ended {
            self.0 = None;
        }
    }

    /// Whether the connection has not ended.
    pub(crate) fn is_open(&self) -> bool {
        self.0.is_some()
    }

    /// Awaits `fut` while driving the connection.
    pub(crate) async fn along<F: Future>(&mut self, fut: F) -> F::Output {
        let mut fut = pin!(fut);
        poll_fn(|cx| {
            self.poll(cx);
            fut.as_mut().poll(cx)
        })
        .await
    }

    /// Polls the connection once: a connection the engine closed while it was idle ends here.
    pub(crate) async fn settle(&mut self) {
        poll_fn(|cx| {
            self.poll(cx);
            Poll::Ready(())
        })
        .await;
    }
}

/// An engine connection: its request side and its driver.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) sender: Sender,
    pub(crate) driver: Driver,
}

impl Connection {
    /// The HTTP/1.1 handshake on a plain TCP connection (no I/O yet).
    pub(crate) async fn plain(tcp: TcpStream) -> Result<Self, hyper::Error> {
        let (sender, conn) = http1::handshake(TokioIo::new(tcp)).await?;
        Ok(Connection {
            sender,
            driver: Driver(Some(Io::Plain(Box::new(conn)))),
        })
    }

    /// The HTTP/1.1 handshake on a TLS connection (no I/O yet).
    pub(crate) async fn tls(stream: TlsStream<TcpStream>) -> Result<Self, hyper::Error> {
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
        Ok(Connection {
            sender,
            driver: Driver(Some(Io::Tls(Box::new(conn)))),
        })
    }

    /// Whether the connection can take a request: not ended, and not closed by hyper.
    pub(crate) fn is_usable(&self) -> bool {
        self.driver.is_open() && !self.sender.is_closed()
    }
}
