//! Client authentication: API keys from `--api-key` (repeatable), `PDGATE_API_KEYS`
//! (comma-separated), `security.api_keys` and `security.api_keys_file` (one key per line, `#`
//! comments; watched and reloaded). With no key configured anywhere the API is open.
//!
//! A key is presented as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
//! (Anthropic clients on `/v1/messages`). It is compared with every configured key in constant
//! time ([`subtle`]), so the answer's timing says nothing about how much of a key matched. The
//! check runs before any body is read; it allocates nothing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::error::GatewayError;

/// A secret string: never printed by `Debug`. (It serializes as itself: the configuration is
/// serialized only internally, to merge flags into the file and to compare reloads.)
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The keys clients may present, replaced as a whole when the key file changes.
#[derive(Debug)]
pub(crate) struct ClientKeys {
    /// Whether a key is required at all (some key source is configured).
    required: bool,
    /// Keys from the configuration and flags (fixed).
    fixed: Vec<Secret>,
    /// Keys from the file (reloaded).
    from_file: ArcSwap<Vec<Secret>>,
    file: Option<PathBuf>,
}

/// Reads a key file: one key per line, blank lines and `#` comments skipped.
fn read_key_file(path: &Path) -> std::io::Result<Vec<Secret>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| Secret(l.to_string()))
        .collect())
}

/// The key a request presents, if any.
fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(AUTHORIZATION) {
        let v = v.as_bytes();
        let (scheme, rest) = v.split_at_checked(7)?;
        return scheme
            .eq_ignore_ascii_case(b"bearer ")
            .then(|| rest.trim_ascii());
    }
    headers.get("x-api-key").map(|v| v.as_bytes().trim_ascii())
}

impl ClientKeys {
    /// The keys of `config` (a missing or unreadable key file is a start-up error).
    pub(crate) fn new(config: &crate::http::guard::SecurityConfig) -> std::io::Result<Self> {
        let from_file = match &config.api_keys_file {
            Some(path) => read_key_file(path)?,
            None => Vec::new(),
        };
        Ok(ClientKeys {
            required: !config.api_keys.is_empty() || config.api_keys_file.is_some(),
            fixed: config.api_keys.clone(),
            from_file: ArcSwap::from_pointee(from_file),
            file: config.api_keys_file.clone(),
        })
    }

    /// `Ok` when no key is required or the request presents a configured one; 401 otherwise.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<(), GatewayError> {
        if !self.required {
            return Ok(());
        }
        let Some(key) = presented(headers).filter(|k| !k.is_empty()) else {
            return Err(GatewayError::Unauthorized { missing: true });
        };
        let file = self.from_file.load();
        // Every key is compared (no early exit), each in constant time.
        let mut ok = subtle::Choice::from(0);
        for k in self.fixed.iter().chain(file.iter()) {
            ok |= k.0.as_bytes().ct_eq(key);
        }
        if bool::from(ok) {
            Ok(())
        } else {
            Err(GatewayError::Unauthorized { missing: false })
        }
    }

    /// Re-reads the key file whenever its modification time or size changes (polled every
    /// `interval`), until `shutdown`. A file that cannot be read keeps the keys it had.
    pub(crate) async fn watch(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let Some(path) = self.file.clone() else {
            return;
        };
        let files = [path.clone()];
        crate::watch::on_change(&files, interval, shutdown, || match read_key_file(&path) {
            Ok(keys) => {
                info!(file = %path.display(), keys = keys.len(), "API key file reloaded");
                self.from_file.store(Arc::new(keys));
                true
            }
            Err(e) => {
                warn!(file = %path.display(), error = %e, "API key file unreadable; keeping the previous keys");
                false
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::guard::SecurityConfig;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn keys_are_required_once_configured() {
        let open = ClientKeys::new(&SecurityConfig::default()).unwrap();
        assert!(open.check(&HeaderMap::new()).is_ok());
        let config = SecurityConfig {
            api_keys: vec![Secret("k1".into()), Secret("k2".into())],
            ..SecurityConfig::default()
        };
        let keys = ClientKeys::new(&config).unwrap();
        assert!(
            keys.check(&headers(&[("authorization", "Bearer k1")]))
                .is_ok()
        );
        assert!(
            keys.check(&headers(&[("authorization", "bearer  k2 ")]))
                .is_ok()
        );
        assert!(keys.check(&headers(&[("x-api-key", "k2")])).is_ok());
        for bad in [
            "Bearer wrong",
            "Bearer k",
            "Bearer k10",
            "Basic k1",
            "k1",
            "Bearer ",
        ] {
            let err = keys.check(&headers(&[("authorization", bad)])).unwrap_err();
            assert_eq!(err.status(), http::StatusCode::UNAUTHORIZED, "{bad}");
        }
        assert!(keys.check(&HeaderMap::new()).is_err());
        assert_eq!(format!("{:?}", config.api_keys), "[Secret(..), Secret(..)]");
    }
}
