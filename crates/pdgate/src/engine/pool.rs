//! Keep-alive HTTP/1.1 connections to the engines, on hyper's connection API.
//!
//! A connection goes back to the pool when its response body ends, and is taken again by the
//! next request to the same engine (most recently used first). A body dropped before its end
//! closes its connection: that is how a vLLM engine learns that a request was abandoned. A
//! request that never left a pooled connection (the engine had just closed it) is sent again on
//! another one. Connections idle for longer than the idle timeout are closed the next time the
//! engine's list is touched; the engine's own keep-alive timeout usually closes them first.
//!
//! hyper-util's pooled client did the same with more machinery than a gateway needs: per request
//! it hashed the scheme and authority byte by byte, boxed the request future and spawned a task
//! to put the connection back (bench/profile.sh callgrind: 5% of pdgate's instructions).
//!
//! `https://` engines are reached over TLS (rustls, `security.engine_ca_file`); their idle
//! connections are kept apart from plain ones to the same `host:port`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::Body;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::engine::guarded::{GuardedBody, OnEnd};

type Sender = http1::SendRequest<Full<Bytes>>;

/// Why an engine request failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No connection could be opened (nothing was sent).
    #[error("{0}")]
    Connect(String),
    /// The exchange failed on an open connection.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// The request cannot be sent to an engine (not an `http://host[:port]` URI).
    #[error("{0}")]
    Target(String),
}

impl PoolError {
    /// Whether nothing was sent because no connection could be opened.
    pub fn is_connect(&self) -> bool {
        matches!(self, PoolError::Connect(_))
    }
}

/// Pool settings.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// Bound on opening a TCP connection.
    pub connect_timeout: Duration,
    /// Connections idle for longer are closed.
    pub idle_timeout: Duration,
    /// Idle connections kept per engine; more are closed when their response ends.
    pub max_idle_per_engine: usize,
}

/// The engine client: cheap to clone, all clones share the connections.
#[derive(Clone, Debug)]
pub struct EnginePool {
    inner: Arc<Inner>,
}

/// Idle connections by `host:port`: plain (`[0]`) and TLS (`[1]`).
type IdleLists = [HashMap<Box<str>, Vec<Idle>>; 2];

struct Inner {
    idle: Mutex<IdleLists>,
    config: PoolConfig,
    /// The TLS client for `https://` engines.
    tls: Option<TlsConnector>,
    /// Ends every connection task once the last handle on the pool is gone.
    stop: CancellationToken,
    _stop_on_drop: DropGuard,
}

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("idle", &self.idle)
            .field("config", &self.config)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl EnginePool {
    /// An empty pool for `http://` engines.
    #[cfg(test)]
    pub fn new(config: PoolConfig) -> Self {
        Self::with_tls(config, None)
    }

    /// An empty pool; `https://` engines are reached with `tls` (refused without it).
    pub fn with_tls(config: PoolConfig, tls: Option<TlsConnector>) -> Self {
        let stop = CancellationToken::new();
        EnginePool {
            inner: Arc::new(Inner {
                idle: Mutex::new([HashMap::new(), HashMap::new()]),
                config,
                tls,
                _stop_on_drop: stop.clone().drop_guard(),
                stop,
            }),
        }
    }

    /// Sends `request` (an absolute `http://` URI) on a pooled or new connection and returns the
    /// response head; the body streams on.
    ///
    /// # Errors
    /// [`PoolError::Connect`] when no connection could be opened, [`PoolError::Http`] when the
    /// exchange failed, [`PoolError::Target`] for a URI that names no HTTP engine.
    pub async fn request(
        &self,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<EngineBody>, PoolError> {
        let (authority, tls) = to_origin_form(&mut request)?;
        if tls && self.inner.tls.is_none() {
            return Err(PoolError::Target(
                "https:// engines need the pool's TLS client".into(),
            ));
        }
        loop {
            let (mut sender, pooled) = match self.inner.checkout(authority.as_str(), tls) {
                Some(sender) => (sender, true),
                None => (self.connect(&authority, tls).await?, false),
            };
            // A new connection takes its first request before the handshake settles; a pooled
            // one is ready once its previous response has been read to the end.
            if pooled
                && !sender.is_ready()
                && !matches!(
                    tokio::time::timeout(self.inner.config.connect_timeout, sender.ready()).await,
                    Ok(Ok(()))
                )
            {
                continue;
            }
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let checkin = Checkin {
                        pool: self.inner.clone(),
                        authority: authority.clone(),
                        tls,
                        sender,
                    };
                    return Ok(response.map(|body| engine_body(body, checkin)));
                }
                Err(mut e) => match e.take_message() {
                    // The engine closed the pooled connection before the request left.
                    Some(unsent) if pooled => request = unsent,
                    _ => return Err(PoolError::Http(e.into_error())),
                },
            }
        }
    }

    /// Idle connections kept for `authority` (`host:port`).
    #[cfg(test)]
    pub fn idle_connections(&self, authority: &str) -> usize {
        self.inner.lock()[0].get(authority).map_or(0, Vec::len)
    }

    async fn connect(&self, authority: &Authority, tls: bool) -> Result<Sender, PoolError> {
        let limit = self.inner.config.connect_timeout;
        let address = socket_target(authority, tls);
        let tcp = match tokio::time::timeout(limit, TcpStream::connect(address)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(PoolError::Connect(e.to_string())),
            Err(_) => {
                return Err(PoolError::Connect(format!(
                    "no connection within {limit:?}"
                )));
            }
        };
        let _ = tcp.set_nodelay(true);
        if let (true, Some(connector)) = (tls, &self.inner.tls) {
            let name = ServerName::try_from(socket_target(authority, tls).0.to_string())
                .map_err(|e| PoolError::Connect(format!("TLS server name: {e}")))?;
            let stream = match tokio::time::timeout(limit, connector.connect(name, tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return Err(PoolError::Connect(format!("TLS handshake: {e}"))),
                Err(_) => {
                    return Err(PoolError::Connect(format!(
                        "no TLS handshake within {limit:?}"
                    )));
                }
            };
            return Ok(self.drive(TokioIo::new(stream)).await?);
        }
        Ok(self.drive(TokioIo::new(tcp)).await?)
    }

    /// The HTTP/1.1 handshake on `io`, with the connection's task owned by the pool.
    async fn drive<IO>(&self, io: IO) -> Result<Sender, hyper::Error>
    where
        IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (sender, connection) = http1::handshake(io).await?;
        let stop = self.inner.stop.clone();
        // Owned through `stop`: the task ends with its connection, or with the pool.
        tokio::spawn(async move {
            tokio::select! {
                _ = connection => {}
                () = stop.cancelled() => {}
            }
        });
        Ok(sender)
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, IdleLists> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn checkout(&self, authority: &str, tls: bool) -> Option<Sender> {
        let mut idle = self.lock();
        let list = idle[usize::from(tls)].get_mut(authority)?;
        let now = Instant::now();
        while let Some(entry) = list.pop() {
            if !entry.sender.is_closed()
                && now.duration_since(entry.since) < self.config.idle_timeout
            {
                return Some(entry.sender);
            }
        }
        None
    }

    fn checkin(&self, authority: &Authority, tls: bool, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let entry = Idle {
            sender,
            since: Instant::now(),
        };
        let mut lists = self.lock();
        let idle = &mut lists[usize::from(tls)];
        match idle.get_mut(authority.as_str()) {
            Some(list) => self.push(list, entry),
            // The key is allocated only for an engine's first idle connection.
            None if self.config.max_idle_per_engine > 0 => {
                idle.insert(authority.as_str().into(), vec![entry]);
            }
            None => {}
        }
    }

    /// Adds `entry` to an engine's idle list within the limit, after closing the connections
    /// idle past the timeout (the longest idle are at the front).
    fn push(&self, list: &mut Vec<Idle>, entry: Idle) {
        let stale = list
            .iter()
            .take_while(|e| entry.since.duration_since(e.since) >= self.config.idle_timeout)
            .count();
        list.drain(..stale);
        if list.len() < self.config.max_idle_per_engine {
            list.push(entry);
        }
    }
}

/// Host and port to connect to: `host()` keeps an IPv6 literal's brackets, which a socket address
/// does not take; without a port, `http://` means 80 and `https://` 443.
fn socket_target(authority: &Authority, tls: bool) -> (&str, u16) {
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    (
        host,
        authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
    )
}

/// Rewrites an absolute `http[s]://host[:port]/path` URI to the origin form an HTTP/1.1 server
/// expects (`/path`), sets `Host`, and returns the authority and whether it is TLS.
fn to_origin_form(request: &mut Request<Full<Bytes>>) -> Result<(Authority, bool), PoolError> {
    let parts = std::mem::take(request.uri_mut()).into_parts();
    let tls = match &parts.scheme {
        Some(s) if *s == Scheme::HTTP => false,
        Some(s) if *s == Scheme::HTTPS => true,
        _ => {
            return Err(PoolError::Target(
                "engines are reached over http:// or https:// only".into(),
            ));
        }
    };
    let authority = parts
        .authority
        .ok_or_else(|| PoolError::Target("the engine URI has no host".into()))?;
    let path = parts
        .path_and_query
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *request.uri_mut() = Uri::from(path);
    if !request.headers().contains_key(header::HOST) {
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| PoolError::Target(format!("engine host: {e}")))?;
        request.headers_mut().insert(header::HOST, host);
    }
    Ok((authority, tls))
}

/// What puts a connection back when its response ends.
#[derive(Debug)]
pub struct Checkin {
    pool: Arc<Inner>,
    authority: Authority,
    tls: bool,
    sender: Sender,
}

impl Checkin {
    fn put_back(self) {
        self.pool.checkin(&self.authority, self.tls, self.sender);
    }
}

/// An engine response body. Read to its end, it returns its connection to the pool; dropped
/// earlier, or broken, it closes the connection.
pub type EngineBody = GuardedBody<Incoming, Option<Checkin>>;

impl OnEnd for Option<Checkin> {
    fn ended(&mut self, clean: bool) {
        if let Some(checkin) = self.take()
            && clean
        {
            checkin.put_back();
        }
    }
}

/// Wraps `inner`; a body without content ends at once.
fn engine_body(inner: Incoming, checkin: Checkin) -> EngineBody {
    let mut guard = Some(checkin);
    if inner.is_end_stream() {
        guard.ended(true);
    }
    GuardedBody::new(inner, guard)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::task::JoinSet;

    use super::*;

    #[derive(Clone, Copy)]
    enum Mode {
        /// Answers every request on a kept-alive connection.
        KeepAlive,
        /// Answers with `connection: close`, then closes.
        CloseAfterEach,
        /// Sends the head and one chunk of a stream, then waits for the client to leave.
        HoldStream,
    }

    /// A raw HTTP/1.1 engine on loopback that counts connections and records request heads.
    struct Engine {
        authority: String,
        accepted: Arc<AtomicUsize>,
        closed: Arc<AtomicUsize>,
        heads: Arc<Mutex<Vec<String>>>,
        _tasks: JoinSet<()>,
    }

    async fn engine(mode: Mode) -> Engine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = JoinSet::new();
        let (a, c, h) = (accepted.clone(), closed.clone(), heads.clone());
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((tcp, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                connections.spawn(serve(tcp, mode, c.clone(), h.clone()));
            }
        });
        Engine {
            authority,
            accepted,
            closed,
            heads,
            _tasks: tasks,
        }
    }

    async fn serve(
        mut tcp: TcpStream,
        mode: Mode,
        closed: Arc<AtomicUsize>,
        heads: Arc<Mutex<Vec<String>>>,
    ) {
        let mut buf = Vec::new();
        loop {
            let Some(end) = read_head(&mut tcp, &mut buf).await else {
                closed.fetch_add(1, Ordering::SeqCst);
                return;
            };
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            buf.drain(..end);
            heads.lock().unwrap().push(head);
            let reply: &[u8] = match mode {
                Mode::KeepAlive => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                Mode::CloseAfterEach => {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                }
                Mode::HoldStream => {
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
                }
            };
            tcp.write_all(reply).await.unwrap();
            match mode {
                Mode::KeepAlive => {}
                Mode::CloseAfterEach => return,
                Mode::HoldStream => {
                    let mut rest = [0u8; 64];
                    while matches!(tcp.read(&mut rest).await, Ok(n) if n > 0) {}
                    closed.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
    }

    /// Reads up to the end of a request head (requests here have no body); `None` on EOF.
    async fn read_head(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
        loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                return Some(i + 4);
            }
            let mut chunk = [0u8; 1024];
            match tcp.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn pool(idle_timeout: Duration, max_idle_per_engine: usize) -> EnginePool {
        EnginePool::new(PoolConfig {
            connect_timeout: Duration::from_secs(5),
            idle_timeout,
            max_idle_per_engine,
        })
    }

    fn get(authority: &str) -> Request<Full<Bytes>> {
        Request::get(format!("http://{authority}/v1/models?x=1"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn read_all(pool: &EnginePool, authority: &str) -> Bytes {
        let response = pool.request(get(authority)).await.unwrap();
        assert_eq!(response.status(), 200);
        response.into_body().collect().await.unwrap().to_bytes()
    }

    async fn eventually(what: &str, check: impl Fn() -> bool) {
        for _ in 0..500 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what} did not happen within 5 s");
    }

    #[tokio::test]
    async fn a_connection_read_to_the_end_is_reused_with_origin_form_and_host() {
        let engine = engine(Mode::KeepAlive).await;
        let pool = pool(Duration::from_secs(60), 16);
        for _ in 0..3 {
            assert_eq!(read_all(&pool, &engine.authority).await, "ok");
        }
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_connections(&engine.authority), 1);
        let head = engine.heads.lock().unwrap()[0].to_ascii_lowercase();
        assert!(
            head.starts_with("get /v1/models?x=1 http/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\nhost: {}\r\n", engine.authority)),
            "{head}"
        );
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        let engine = engine(Mode::HoldStream).await;
        let pool = pool(Duration::from_secs(60), 16);
        let mut body = pool
            .request(get(&engine.authority))
            .await
            .unwrap()
            .into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "hello");
        drop(body);
        eventually("the engine seeing the connection close", || {
            engine.closed.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(pool.idle_connections(&engine.authority), 0);
    }

    #[tokio::test]
    async fn connections_the_engine_closes_are_replaced() {
        let engine = engine(Mode::CloseAfterEach).await;
        let pool = pool(Duration::from_secs(60), 16);
        for _ in 0..20 {
            assert_eq!(read_all(&pool, &engine.authority).await, "ok");
        }
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 20);
    }

    #[tokio::test]
    async fn idle_timeout_and_idle_limit_close_connections() {
        let engine = engine(Mode::KeepAlive).await;
        let short = pool(Duration::from_millis(50), 16);
        read_all(&short, &engine.authority).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        read_all(&short, &engine.authority).await;
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 2);
        let none = pool(Duration::from_secs(60), 0);
        read_all(&none, &engine.authority).await;
        read_all(&none, &engine.authority).await;
        assert_eq!(engine.accepted.load(Ordering::SeqCst), 4);
        assert_eq!(none.idle_connections(&engine.authority), 0);
        // Both connections of the no-idle pool were closed.
        eventually("the engine seeing both connections close", || {
            engine.closed.load(Ordering::SeqCst) >= 3
        })
        .await;
    }

    #[test]
    fn socket_targets_take_bare_ipv6_literals_and_default_ports() {
        let target = |a: &str| {
            let a: Authority = a.parse().unwrap();
            let (host, port) = socket_target(&a, false);
            (host.to_string(), port)
        };
        assert_eq!(target("[fd00::2]:8001"), ("fd00::2".to_string(), 8001));
        assert_eq!(target("10.0.0.1:8000"), ("10.0.0.1".to_string(), 8000));
        assert_eq!(
            target("prefill-0.engines"),
            ("prefill-0.engines".to_string(), 80)
        );
        let a: Authority = "prefill-0.engines".parse().unwrap();
        assert_eq!(socket_target(&a, true).1, 443);
    }

    #[tokio::test]
    async fn refused_connections_and_bad_targets_are_told_apart() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap().port()
        };
        let pool = pool(Duration::from_secs(60), 16);
        let err = pool
            .request(get(&format!("127.0.0.1:{port}")))
            .await
            .unwrap_err();
        assert!(err.is_connect(), "{err}");
        let https = Request::get("https://127.0.0.1:1/")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let err = pool.request(https).await.unwrap_err();
        assert!(matches!(err, PoolError::Target(_)), "{err}");
    }
}
