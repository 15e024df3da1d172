//! Client authentication: API keys from `--api-key` (repeatable), `PDGATE_API_KEYS`
//! (comma-separated), `security.api_keys` and `security.api_keys_file` (one key per line, `#`
//! comments; watched and reloaded). With no key configured anywhere the API is open.
//!
//! A key is presented as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
//! (Anthropic clients on `/v1/messages`). It is compared with every configured key in constant
//! time ([`subtle`]), so the answer's timing says nothing about how much of a key matched. The
//! check runs before any body is read; it allocates nothing.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use subtle::ConstantTimeEq;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::engine::guarded::{GuardedBody, OnEnd};
use crate::error::GatewayError;
use crate::metrics::{Metrics, Reloaded};
pub use crate::security::guard::{ClientConfig, Secret};

/// One named client's live limits.
#[derive(Debug)]
struct Client {
    name: String,
    key: Secret,
    rate: Option<Mutex<Bucket>>,
    max_in_flight: usize,
    in_flight: AtomicUsize,
}

/// A token bucket: `rate` tokens a second, at most `rate` (and at least 1) stored.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Takes a token, or says in how many whole seconds one will be there.
    fn take(&mut self, now: Instant) -> Result<(), u64> {
        let capacity = self.rate.max(1.0);
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(capacity);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            // At least 1 s: Retry-After is in whole seconds.
            Err(((1.0 - self.tokens) / self.rate).ceil().max(1.0) as u64)
        }
    }
}

/// What a request that passed the key check holds: its client's in-flight place, given back
/// when it is dropped (with the response's end).
#[derive(Debug, Default)]
pub(crate) struct Pass(Option<Arc<Client>>);

impl Drop for Pass {
    fn drop(&mut self) {
        if let Some(c) = &self.0
            && c.max_in_flight > 0
        {
            c.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The admission slot and the client's place, given back together when the response ends.
#[derive(Debug)]
pub(crate) struct Held(
    #[allow(dead_code)] crate::limits::Slot,
    #[allow(dead_code)] Pass,
);

impl OnEnd for Option<Held> {
    fn ended(&mut self, _clean: bool) {
        *self = None;
    }
}

/// Ties the admission `slot` and the client's `pass` to `response`: both go back when its body
/// ends.
pub(crate) fn hold(
    response: axum::response::Response,
    slot: crate::limits::Slot,
    pass: Pass,
) -> axum::response::Response {
    response.map(|inner| GuardedBody::wrap(inner, Some(Held(slot, pass))))
}

/// The keys clients may present, replaced as a whole when the key file changes.
#[derive(Debug)]
pub(crate) struct ClientKeys {
    /// Whether a key is required at all (some key source is configured).
    required: bool,
    /// Keys from the configuration and flags (fixed).
    fixed: Vec<Secret>,
    /// Named clients with their limits.
    clients: Vec<Arc<Client>>,
    metrics: Arc<Metrics>,
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

const CONCURRENCY: &str = "concurrent requests";

/// Takes a place for one request of `c` within its limits.
fn admit(c: &Arc<Client>) -> Result<Pass, GatewayError> {
    if c.max_in_flight > 0 {
        let held = c.in_flight.fetch_add(1, Ordering::AcqRel);
        if held >= c.max_in_flight {
            c.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(GatewayError::ClientLimit {
                client: c.name.clone(),
                limit: CONCURRENCY,
                retry_after_secs: 1,
            });
        }
    }
    let pass = Pass(Some(c.clone()));
    if let Some(rate) = &c.rate {
        let taken = rate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(Instant::now());
        if let Err(retry_after_secs) = taken {
            // `pass` drops here and gives the in-flight place back.
            return Err(GatewayError::ClientLimit {
                client: c.name.clone(),
                limit: "requests per second",
                retry_after_secs,
            });
        }
    }
    Ok(pass)
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
    pub(crate) fn new(
        config: &crate::security::guard::SecurityConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let from_file = match &config.api_keys_file {
            Some(path) => read_key_file(path)?,
            None => Vec::new(),
        };
        let now = Instant::now();
        let clients = config
            .clients
            .iter()
            .map(|c| {
                let rate = c.requests_per_second.filter(|r| *r > 0.0);
                Arc::new(Client {
                    name: c.name.clone(),
                    key: c.key.clone(),
                    rate: rate.map(|rate| {
                        Mutex::new(Bucket {
                            rate,
                            tokens: rate.max(1.0),
                            at: now,
                        })
                    }),
                    max_in_flight: c.max_in_flight.unwrap_or(0),
                    in_flight: AtomicUsize::new(0),
                })
            })
            .collect();
        Ok(ClientKeys {
            required: !config.api_keys.is_empty()
                || config.api_keys_file.is_some()
                || !config.clients.is_empty(),
            fixed: config.api_keys.clone(),
            clients,
            metrics,
            from_file: ArcSwap::from_pointee(from_file),
            file: config.api_keys_file.clone(),
        })
    }

    /// `Ok` when no key is required or the request presents a configured one (within its
    /// client's limits: 429 beyond them); 401 otherwise.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<Pass, GatewayError> {
        if !self.required {
            return Ok(Pass::default());
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
        let mut named = None;
        for c in &self.clients {
            let eq = c.key.0.as_bytes().ct_eq(key);
            ok |= eq;
            if bool::from(eq) {
                named = Some(c);
            }
        }
        if !bool::from(ok) {
            return Err(GatewayError::Unauthorized { missing: false });
        }
        let Some(c) = named else {
            return Ok(Pass::default());
        };
        let pass = admit(c);
        let result = match &pass {
            Ok(_) => "admitted",
            Err(GatewayError::ClientLimit {
                limit: CONCURRENCY, ..
            }) => "concurrency_limited",
            Err(_) => "rate_limited",
        };
        self.metrics.count_client(&c.name, result);
        pass
    }

    /// Every named client, for the metrics' label sets.
    pub(crate) fn client_names(&self) -> impl Iterator<Item = &str> {
        self.clients.iter().map(|c| c.name.as_str())
    }

    /// Re-reads the key file whenever its modification time or size changes (polled every
    /// `interval`), until `shutdown`. A file that cannot be read keeps the keys it had.
    pub(crate) async fn watch(
        self: Arc<Self>,
        interval: Duration,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) {
        let Some(path) = self.file.clone() else {
            return;
        };
        let files = [path.clone()];
        crate::watch::on_change(&files, interval, shutdown, || match read_key_file(&path) {
            Ok(keys) => {
                info!(file = %path.display(), keys = keys.len(), "API key file reloaded");
                self.from_file.store(Arc::new(keys));
                metrics.count_reload(Reloaded::ApiKeys, true);
                true
            }
            Err(e) => {
                warn!(file = %path.display(), error = %e, "API key file unreadable; keeping the previous keys");
                metrics.count_reload(Reloaded::ApiKeys, false);
                false
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::security::guard::SecurityConfig;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn keys_are_required_once_configured() {
        let open = ClientKeys::new(&SecurityConfig::default(), Arc::new(Metrics::new())).unwrap();
        assert!(open.check(&HeaderMap::new()).is_ok());
        let config = SecurityConfig {
            api_keys: vec![Secret("k1".into()), Secret("k2".into())],
            ..SecurityConfig::default()
        };
        let keys = ClientKeys::new(&config, Arc::new(Metrics::new())).unwrap();
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
