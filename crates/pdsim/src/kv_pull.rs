//! The decode's pull client: a small HTTP/1 client for side-channel and
//! bootstrap calls, and the URL helpers it needs.

use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;

/// Why a decode could not load its KV.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("timed out after {0:?} talking to {1}")]
    Timeout(Duration, String),
    #[error("malformed answer from {0}")]
    Malformed(String),
}

/// A small HTTP/1 client for side-channel and bootstrap calls.
#[derive(Clone)]
pub(crate) struct PullClient {
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl PullClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        PullClient {
            // Idle pooled connections close on their own so no client task outlives its use for long.
            client: Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(5))
                .build(connector),
        }
    }

    /// GETs `url` and returns the body of a 200, bounded by `timeout`.
    pub async fn get(&self, url: String, timeout: Duration) -> Result<Bytes, PullError> {
        let uri: hyper::Uri =
            url.parse()
                .map_err(|e: hyper::http::uri::InvalidUri| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
        let fut = async {
            let resp = self
                .client
                .get(uri)
                .await
                .map_err(|e| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| PullError::Unreachable {
                    url: url.clone(),
                    reason: e.to_string(),
                })?
                .to_bytes();
            if status != StatusCode::OK {
                return Err(PullError::Status {
                    url: url.clone(),
                    status: status.as_u16(),
                    body: String::from_utf8_lossy(&body).chars().take(200).collect(),
                });
            }
            Ok(body)
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| PullError::Timeout(timeout, url.clone()))?
    }
}

/// `host:port` for a URL, bracketing IPv6 literals.
pub(crate) fn host_port(host: &str, port: u64) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Percent-encodes one URL path segment.
pub(crate) fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The worker address a mooncake bootstrap `/query` answer gives for `engine_id`.
pub(crate) fn mooncake_worker(query: &[u8], engine_id: &str) -> Result<String, String> {
    let v: Value = serde_json::from_slice(query)
        .map_err(|e| format!("bootstrap /query answer is not JSON: {e}"))?;
    let ranks = v
        .as_object()
        .ok_or("bootstrap /query answer is not an object")?;
    let rank = ranks
        .values()
        .find(|r| r.get("engine_id").and_then(Value::as_str) == Some(engine_id))
        .ok_or_else(|| {
            format!("remote_engine_id {engine_id:?} is not served by that bootstrap server")
        })?;
    let addr = rank
        .pointer("/worker_addr/0/0")
        .and_then(Value::as_str)
        .ok_or("bootstrap /query answer has no worker_addr")?;
    addr.strip_prefix("tcp://")
        .map(str::to_owned)
        .ok_or_else(|| format!("worker_addr {addr:?} is not tcp://host:port"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_worker_matches_engine_id() {
        let q = br#"{"0":{"engine_id":"a","worker_addr":{"0":{"0":"tcp://h:1"}}},"1":{"engine_id":"b","worker_addr":{"0":{"0":"tcp://h:2"}}}}"#;
        assert_eq!(mooncake_worker(q, "b").unwrap(), "h:2");
        assert!(mooncake_worker(q, "c").unwrap_err().contains("not served"));
        assert!(mooncake_worker(b"{}", "a").is_err());
        assert!(
            mooncake_worker(
                br#"{"0":{"engine_id":"a","worker_addr":{"0":{"0":"h:1"}}}}"#,
                "a"
            )
            .is_err()
        );
        assert!(mooncake_worker(b"[]", "a").is_err());
    }
}
