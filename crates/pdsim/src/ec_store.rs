//! What an encoder keeps for the prefills that load its output: each encoded item under its
//! hash, for a lease, with one pull per time it was encoded. A leaf.
//!
//! vLLM's Mooncake EC producer keeps an item's embedding for the consumer named in its answer
//! and triggers one transfer per `mm_hash` (`do_remote_encode` is cleared once used); newer
//! versions hold a reservation under a lease. The store models that: an item asked for after its
//! pulls are used is refused as reused, after its lease as expired, and a hash it never encoded
//! as unknown.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
struct Entry {
    tokens: u32,
    pulls: u32,
    expires: Instant,
}

/// Encoded items by hash.
#[derive(Debug)]
pub(crate) struct EcStore {
    items: Mutex<HashMap<String, Entry>>,
    lease: Duration,
    /// Why the last load of an item (as a consumer) failed.
    last_error: Mutex<Option<String>>,
}

/// Why a pull of an item was refused; rendered as status + message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EcLookupError {
    #[error("no encoder output for mm_hash {0:?} on this engine")]
    Unknown(String),
    #[error("encoder output for mm_hash {0:?} expired")]
    Expired(String),
    #[error("encoder output for mm_hash {0:?} was already transferred")]
    Reused(String),
    #[error("encoder-cache transfer refused (injected fault)")]
    Refused,
}

impl IntoResponse for EcLookupError {
    fn into_response(self) -> Response {
        let status = match self {
            EcLookupError::Unknown(_) => StatusCode::NOT_FOUND,
            EcLookupError::Expired(_) => StatusCode::GONE,
            EcLookupError::Reused(_) => StatusCode::CONFLICT,
            EcLookupError::Refused => StatusCode::SERVICE_UNAVAILABLE,
        };
        (status, self.to_string()).into_response()
    }
}

const PURGE_ABOVE: usize = 1024;

impl EcStore {
    pub fn new(lease: Duration) -> Self {
        EcStore {
            items: Mutex::new(HashMap::new()),
            lease,
            last_error: Mutex::new(None),
        }
    }

    /// Keeps why a load failed (for `SimStats`).
    pub fn failed(&self, reason: String) {
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(reason);
        }
    }

    /// Why the last load failed, if one did.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }

    /// Keeps `hash` (encoded once more: one more pull) for a fresh lease.
    pub fn keep(&self, hash: &str, tokens: u32) {
        let now = Instant::now();
        let Ok(mut items) = self.items.lock() else {
            return;
        };
        if items.len() > PURGE_ABOVE {
            items.retain(|_, e| e.expires > now && e.pulls > 0);
        }
        let expires = now + self.lease;
        items
            .entry(hash.to_owned())
            .and_modify(|e| {
                if e.expires <= now {
                    e.pulls = 0;
                }
                e.pulls += 1;
                e.expires = expires;
                e.tokens = tokens;
            })
            .or_insert(Entry {
                tokens,
                pulls: 1,
                expires,
            });
    }

    /// One pull of `hash`: its encoder tokens.
    pub fn take(&self, hash: &str) -> Result<u32, EcLookupError> {
        let Ok(mut items) = self.items.lock() else {
            return Err(EcLookupError::Unknown(hash.to_owned()));
        };
        let e = items
            .get_mut(hash)
            .ok_or_else(|| EcLookupError::Unknown(hash.to_owned()))?;
        if e.expires <= Instant::now() {
            items.remove(hash);
            return Err(EcLookupError::Expired(hash.to_owned()));
        }
        if e.pulls == 0 {
            return Err(EcLookupError::Reused(hash.to_owned()));
        }
        e.pulls -= 1;
        Ok(e.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_pull_per_encode_within_the_lease() {
        let s = EcStore::new(Duration::from_secs(5));
        assert_eq!(s.take("h"), Err(EcLookupError::Unknown("h".into())));
        s.keep("h", 70);
        assert_eq!(s.take("h"), Ok(70));
        assert_eq!(s.take("h"), Err(EcLookupError::Reused("h".into())));
        s.keep("h", 70);
        s.keep("h", 70);
        assert_eq!(s.take("h"), Ok(70));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(s.take("h"), Err(EcLookupError::Expired("h".into())));
        assert_eq!(s.take("h"), Err(EcLookupError::Unknown("h".into())));
    }
}
