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
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::engine::guarded::{GuardedBody, OnEnd};
use crate::error::{ConfigError, field_error};

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
mod tests;
