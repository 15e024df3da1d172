//! Bounded GETs for the control plane (active health checks, Mooncake `/query`), off the
//! request path.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::engine::pool::EnginePool;

/// Why a probe failed (for logs; health decides by the fact, not the text).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The URL is not one a request can be built for.
    #[error("{0}")]
    Request(String),
    /// The exchange failed.
    #[error("{url}: {detail}")]
    Failed {
        /// The URL probed.
        url: String,
        /// What went wrong.
        detail: String,
    },
    /// No answer within the limit.
    #[error("{url} did not answer within {limit:?}")]
    Timeout {
        /// The URL probed.
        url: String,
        /// The limit.
        limit: Duration,
    },
    /// The engine answered a non-2xx status.
    #[error("{url} answered {status}")]
    Status {
        /// The URL probed.
        url: String,
        /// The status.
        status: StatusCode,
    },
}

/// A bounded GET for control-plane probes (`/health`, Mooncake `/query`): the whole exchange
/// within `limit`, at most `max_body` bytes read (the rest is dropped with the connection).
pub async fn get(
    client: &EnginePool,
    url: &str,
    limit: Duration,
    max_body: usize,
) -> Result<(StatusCode, Bytes), ProbeError> {
    get_with(client, url, None, limit, max_body).await
}

/// [`get`] with an `Authorization` header (engines started with an API key guard `/v1/*`).
pub async fn get_with(
    client: &EnginePool,
    url: &str,
    authorization: Option<&http::HeaderValue>,
    limit: Duration,
    max_body: usize,
) -> Result<(StatusCode, Bytes), ProbeError> {
    let mut builder = Request::builder().method(Method::GET).uri(url);
    if let Some(v) = authorization {
        builder = builder.header(http::header::AUTHORIZATION, v.clone());
    }
    let request = builder
        .body(Full::new(Bytes::new()))
        .map_err(|e| ProbeError::Request(e.to_string()))?;
    let failed = |detail: String| ProbeError::Failed {
        url: url.to_string(),
        detail,
    };
    let work = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), max_body)
            .collect()
            .await
            .map_err(|e| failed(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| ProbeError::Timeout {
            url: url.to_string(),
            limit,
        })?
}

/// A GET that must answer 2xx within `limit` (the body is drained, bounded, so the connection
/// can be reused).
pub async fn get_ok(client: &EnginePool, url: &str, limit: Duration) -> Result<(), ProbeError> {
    let (status, _) = get(client, url, limit, 64 * 1024).await?;
    if status.is_success() {
        Ok(())
    } else {
        Err(ProbeError::Status {
            url: url.to_string(),
            status,
        })
    }
}
