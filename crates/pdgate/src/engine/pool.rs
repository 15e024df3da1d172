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
//! to put the connection back (its share of pdgate's instructions: docs/benchmarks.md).
//!
//! No task is spawned per connection: the request's task drives its connection while it waits
//! for the head, and the response body drives it while it is read (`engine::conn`), so the
//! events already read from a streaming engine are relayed in one write. An idle connection is
//! polled again when it is taken: one the engine closed meanwhile ends there and the next one is
//! taken.
//!
//! `https://` engines are reached over TLS (rustls, `security.engine_ca_file`); their idle
//! connections are kept apart from plain ones to the same `host:port`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Context;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::Body;
use http_body_util::Full;
use hyper::body::Incoming;
use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use crate::engine::conn::Connection;
use crate::engine::guarded::{GuardedBody, OnEnd};
use crate::error::{ConfigError, field_error};

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

/// The `pool` section: engine connections (the file's keys `connect_timeout`,
/// `pool_idle_timeout`, `pool_max_idle_per_engine`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Bound on establishing a TCP connection to an engine.
    #[serde(with = "crate::durations::text")]
    pub connect_timeout: Duration,
    /// An idle engine connection older than this is closed instead of reused.
    #[serde(rename = "pool_idle_timeout", with = "crate::durations::text")]
    pub idle_timeout: Duration,
    /// Connections to one engine kept open while idle, for reuse; more are closed when their
    /// response ends.
    #[serde(rename = "pool_max_idle_per_engine")]
    pub max_idle_per_engine: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            connect_timeout: Duration::from_secs(5),
            // The engines' own keep-alive timeouts (vLLM's uvicorn: 5 s) usually close first.
            idle_timeout: Duration::from_secs(60),
            max_idle_per_engine: 4096,
        }
    }
}

impl PoolConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (field, d) in [
            ("connect_timeout", self.connect_timeout),
            ("pool_idle_timeout", self.idle_timeout),
        ] {
            if d.is_zero() {
                return Err(field_error(field, "must be greater than zero"));
            }
        }
        Ok(())
    }
}

/// Where an engine is reached, parsed once from its base URL (`http[s]://host[:port]`), so that
/// a leg builds no URL and parses none.
#[derive(Clone, Debug)]
pub struct EngineAddr {
    authority: Authority,
    tls: bool,
    /// `Host` for its requests.
    host: HeaderValue,
}

impl EngineAddr {
    /// Parses `base_url` (a path after the authority, if any, is ignored).
    ///
    /// # Errors
    /// [`PoolError::Target`] for a URL that names no HTTP engine.
    pub fn parse(base_url: &str) -> Result<Self, PoolError> {
        let uri: Uri = base_url
            .parse()
            .map_err(|e| PoolError::Target(format!("engine URL {base_url:?}: {e}")))?;
        Self::of(uri.into_parts())
    }

    fn of(parts: http::uri::Parts) -> Result<Self, PoolError> {
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
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| PoolError::Target(format!("engine host: {e}")))?;
        Ok(EngineAddr {
            authority,
            tls,
            host,
        })
    }
}

/// The engine client: cheap to clone, all clones share the connections.
#[derive(Clone, Debug)]
pub struct EnginePool {
    inner: Arc<Inner>,
}

/// Idle connections by `host:port`: plain (`[0]`) and TLS (`[1]`).
type IdleLists = [HashMap<Box<str>, Vec<Idle>, foldhash::fast::RandomState>; 2];

struct Inner {
    idle: Mutex<IdleLists>,
    config: PoolConfig,
    /// The TLS client for `https://` engines.
    tls: Option<TlsConnector>,
}

#[derive(Debug)]
struct Idle {
    conn: Connection,
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
        EnginePool {
            inner: Arc::new(Inner {
                idle: Mutex::new([HashMap::default(), HashMap::default()]),
                config,
                tls,
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
        let addr = to_origin_form(&mut request)?;
        self.send(&addr, request).await
    }

    /// Sends `request` (origin form: `/path`) to the engine at `addr`, as [`Self::request`];
    /// `Host` is set unless the request has one.
    ///
    /// # Errors
    /// As [`Self::request`].
    pub async fn send(
        &self,
        addr: &EngineAddr,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<EngineBody>, PoolError> {
        let EngineAddr { authority, tls, .. } = addr;
        let tls = *tls;
        if !request.headers().contains_key(header::HOST) {
            request
                .headers_mut()
                .insert(header::HOST, addr.host.clone());
        }
        if tls && self.inner.tls.is_none() {
            return Err(PoolError::Target(
                "https:// engines need the pool's TLS client".into(),
            ));
        }
        loop {
            let (mut conn, pooled) = match self.inner.checkout(authority.as_str(), tls) {
                Some(conn) => (conn, true),
                // Boxed: opening a connection (with its TLS handshake) is a large future, and
                // inline it made every leg's future, and each of their callers', that much
                // larger, to be moved on every request for a path that pooled connections skip.
                None => (Box::pin(self.connect(authority, tls)).await?, false),
            };
            // A new connection takes its first request before the handshake settles; a pooled
            // one is polled first (one the engine closed while idle ends there), and is ready
            // once its previous response has been read to the end.
            if pooled {
                conn.driver.settle().await;
                if !conn.is_usable() {
                    continue;
                }
                let Connection { sender, driver } = &mut conn;
                if !sender.is_ready()
                    && !matches!(
                        tokio::time::timeout(
                            self.inner.config.connect_timeout,
                            driver.along(std::future::poll_fn(|cx| sender.poll_ready(cx)))
                        )
                        .await,
                        Ok(Ok(()))
                    )
                {
                    continue;
                }
            }
            let Connection { sender, driver } = &mut conn;
            match driver.along(sender.try_send_request(request)).await {
                Ok(response) => {
                    let checkin = Checkin {
                        pool: self.inner.clone(),
                        authority: authority.clone(),
                        tls,
                        conn,
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

    async fn connect(&self, authority: &Authority, tls: bool) -> Result<Connection, PoolError> {
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
            return Ok(Connection::tls(stream).await?);
        }
        Ok(Connection::plain(tcp).await?)
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, IdleLists> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn checkout(&self, authority: &str, tls: bool) -> Option<Connection> {
        let mut idle = self.lock();
        let list = idle[usize::from(tls)].get_mut(authority)?;
        let now = Instant::now();
        while let Some(entry) = list.pop() {
            if entry.conn.is_usable() && now.duration_since(entry.since) < self.config.idle_timeout
            {
                return Some(entry.conn);
            }
        }
        None
    }

    fn checkin(&self, authority: &Authority, tls: bool, conn: Connection) {
        if !conn.is_usable() {
            return;
        }
        let entry = Idle {
            conn,
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
/// expects (`/path`) and returns where it goes.
fn to_origin_form(request: &mut Request<Full<Bytes>>) -> Result<EngineAddr, PoolError> {
    let mut parts = std::mem::take(request.uri_mut()).into_parts();
    let path = parts
        .path_and_query
        .take()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let addr = EngineAddr::of(parts)?;
    *request.uri_mut() = Uri::from(path);
    Ok(addr)
}

/// What puts a connection back when its response ends.
#[derive(Debug)]
struct Checkin {
    pool: Arc<Inner>,
    authority: Authority,
    tls: bool,
    conn: Connection,
}

/// An engine response body, which drives its connection while it is read. Read to its end, it
/// returns its connection to the pool; dropped earlier, or broken, it closes the connection.
pub type EngineBody = GuardedBody<Incoming, Return>;

/// The connection under an engine response, until the response ends.
#[derive(Debug)]
pub struct Return(Option<Checkin>);

impl OnEnd for Return {
    fn ended(&mut self, clean: bool) {
        if let Some(c) = self.0.take()
            && clean
        {
            c.pool.checkin(&c.authority, c.tls, c.conn);
        }
    }

    /// Reads and decodes what the engine sent, so that the next frame is there to be taken; a
    /// frame already read is handed over without waiting for more.
    fn before_poll(&mut self, cx: &mut Context<'_>) {
        if let Some(c) = self.0.as_mut() {
            c.conn.driver.poll(cx);
        }
    }
}

/// Wraps `inner`; a body without content ends at once.
fn engine_body(inner: Incoming, checkin: Checkin) -> EngineBody {
    let mut guard = Return(Some(checkin));
    if inner.is_end_stream() {
        guard.ended(true);
    }
    GuardedBody::new(inner, guard)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests;
