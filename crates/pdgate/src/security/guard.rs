//! What the edge refuses before routing: request targets not in canonical form, paths outside
//! the pass-through allow-list, and the settings ([`SecurityConfig`]) that bound them.
//!
//! Engines served by ASGI servers (vLLM, SGLang) %-decode the path and normalise it before
//! routing, so `/v1/%63ompletions` reaches an engine's real completions handler. pdgate routes on
//! the bytes as sent; any target the two could read differently is refused here, and only the
//! paths in the allow-list are relayed at all.

use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderValue, Method, Uri, Version};
use serde::{Deserialize, Serialize};

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

/// A named client with its own key and limits (`[[security.clients]]`). The name labels its
/// metrics; the key never appears anywhere but here.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// The label in metrics and logs.
    pub name: String,
    /// The key it presents.
    pub key: Secret,
    /// Requests started per second, on average (bursts up to one second's worth); unset or 0:
    /// unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
    /// Requests it may have in flight at once; unset or 0: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
}

/// The `[security]` section of the configuration.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// Paths (exact, canonical) relayed unchanged to a decode engine, besides the PD routes.
    /// Anything else answers 404 without touching an engine.
    pub passthrough: Vec<String>,
    /// A request body must be read completely within this long of its head (408 otherwise).
    #[serde(
        deserialize_with = "crate::durations::de_duration",
        serialize_with = "crate::durations::ser_duration"
    )]
    pub request_body_timeout: Duration,
    /// Total bytes of request bodies being read at once (0: unbounded). A body that does not
    /// fit waits up to `body_budget_wait`, then gets 503 with `Retry-After`.
    pub max_buffered_body_bytes: usize,
    /// How long a body waits for room in `max_buffered_body_bytes`.
    #[serde(
        deserialize_with = "crate::durations::de_duration",
        serialize_with = "crate::durations::ser_duration"
    )]
    pub body_budget_wait: Duration,
    /// HTTP/2: streams (requests) one connection may have open at once; the rest are refused
    /// (`RST_STREAM(REFUSED_STREAM)`). HTTP/1.1 serves one request per connection at a time.
    pub max_streams_per_connection: u32,
    /// Client API keys (`Authorization: Bearer KEY` or `x-api-key`). With none here, none from
    /// `--api-key`/`PDGATE_API_KEYS` and no `api_keys_file`, the API is open.
    pub api_keys: Vec<Secret>,
    /// Named clients, each with its own key and optional limits (`[[security.clients]]`):
    /// `name`, `key`, `requests_per_second`, `max_in_flight`.
    pub clients: Vec<ClientConfig>,
    /// A file of client API keys, one per line (`#` comments), re-read when it changes.
    pub api_keys_file: Option<PathBuf>,
    /// Sent to every engine as `Authorization: Bearer KEY` (engines started with `--api-key`).
    pub engine_api_key: Option<Secret>,
    /// Whether the client's `Authorization` header goes to the engines. Unset: only when
    /// neither an engine key nor client keys are configured (then the client's key is the
    /// engines' own); with client keys, the client's key is pdgate's and stays here.
    pub forward_client_authorization: Option<bool>,
    /// Name the serving endpoints in the answer (`prefill-target-pod`, `target-pod`: AIBrix
    /// compatibility). Off by default: endpoint names default to their internal address.
    pub expose_target_headers: bool,
    /// Serve `/metrics` (and `/health`, `/ready`) on this address instead of the API port.
    pub admin_listen: Option<std::net::SocketAddr>,
    /// The listener's certificate chain (PEM): with `tls_key`, the API is served over HTTPS
    /// (HTTP/1.1 and HTTP/2 by ALPN). Re-read when it changes.
    pub tls_cert: Option<PathBuf>,
    /// The listener's private key (PEM), re-read when it changes.
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that `https://` engines are verified against (default: the
    /// system's roots).
    pub engine_ca_file: Option<PathBuf>,
    /// A client certificate (PEM) presented to `https://` engines (mTLS), with
    /// `engine_client_key`.
    pub engine_client_cert: Option<PathBuf>,
    /// The key of `engine_client_cert` (PEM).
    pub engine_client_key: Option<PathBuf>,
    /// How often `api_keys_file` and the TLS files are checked for changes.
    #[serde(
        deserialize_with = "crate::durations::de_duration",
        serialize_with = "crate::durations::ser_duration"
    )]
    pub reload_interval: Duration,
}

/// The pass-through paths allowed by default: the OpenAI and vLLM routes that neither carry KV
/// transfer nor change engine state (`/v1/responses` and `/v1/messages` are PD routes).
pub const DEFAULT_PASSTHROUGH: [&str; 3] = ["/v1/embeddings", "/tokenize", "/detokenize"];

impl Default for SecurityConfig {
    fn default() -> Self {
        SecurityConfig {
            passthrough: DEFAULT_PASSTHROUGH
                .iter()
                .map(|p| (*p).to_string())
                .collect(),
            request_body_timeout: Duration::from_secs(30),
            max_buffered_body_bytes: 256 * 1024 * 1024,
            body_budget_wait: Duration::from_secs(1),
            max_streams_per_connection: 64,
            api_keys: Vec::new(),
            clients: Vec::new(),
            api_keys_file: None,
            admin_listen: None,
            expose_target_headers: false,
            engine_api_key: None,
            forward_client_authorization: None,
            reload_interval: Duration::from_secs(5),
            tls_cert: None,
            tls_key: None,
            engine_ca_file: None,
            engine_client_cert: None,
            engine_client_key: None,
        }
    }
}

impl SecurityConfig {
    /// Checks the section once at start-up; the error names the field.
    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        for (i, path) in self.passthrough.iter().enumerate() {
            if let Err(why) = canonical_path(path) {
                return Err((
                    format!("security.passthrough[{i}]"),
                    format!("{path:?} is not a canonical path: {why}"),
                ));
            }
        }
        for (a, b) in [
            ("tls_cert", "tls_key"),
            ("engine_client_cert", "engine_client_key"),
        ] {
            let set = |name: &str| match name {
                "tls_cert" => self.tls_cert.is_some(),
                "tls_key" => self.tls_key.is_some(),
                "engine_client_cert" => self.engine_client_cert.is_some(),
                _ => self.engine_client_key.is_some(),
            };
            if set(a) != set(b) {
                let (given, missing) = if set(a) { (a, b) } else { (b, a) };
                return Err((
                    format!("security.{missing}"),
                    format!("must be set with security.{given}"),
                ));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, c) in self.clients.iter().enumerate() {
            if c.name.is_empty() || !names.insert(c.name.as_str()) {
                return Err((
                    format!("security.clients[{i}].name"),
                    format!("{:?} is empty or not unique", c.name),
                ));
            }
            if c.key.0.trim().is_empty() {
                return Err((format!("security.clients[{i}].key"), "is empty".into()));
            }
            if c.requests_per_second
                .is_some_and(|r| !r.is_finite() || r < 0.0)
            {
                return Err((
                    format!("security.clients[{i}].requests_per_second"),
                    "must be a number >= 0".into(),
                ));
            }
        }
        if self.reload_interval.is_zero() {
            return Err((
                "security.reload_interval".into(),
                "must be greater than zero".into(),
            ));
        }
        if self.request_body_timeout.is_zero() {
            return Err((
                "security.request_body_timeout".into(),
                "must be greater than zero".into(),
            ));
        }
        Ok(())
    }

    /// Whether client `Authorization` headers are forwarded to engines (see the field).
    pub(crate) fn forwards_client_authorization(&self) -> bool {
        self.forward_client_authorization.unwrap_or(
            self.engine_api_key.is_none()
                && self.api_keys.is_empty()
                && self.api_keys_file.is_none(),
        )
    }

    /// The engines' `Authorization` value, built once.
    pub(crate) fn engine_authorization(&self) -> Result<Option<HeaderValue>, (String, String)> {
        let Some(key) = &self.engine_api_key else {
            return Ok(None);
        };
        let mut v = HeaderValue::from_str(&format!("Bearer {}", key.0)).map_err(|_| {
            (
                "security.engine_api_key".to_string(),
                "is not a valid header value".to_string(),
            )
        })?;
        v.set_sensitive(true);
        Ok(Some(v))
    }
}

/// Whether `path` (already canonical) may be relayed to an engine: one of `passthrough` (the
/// section's allow-list) exactly.
pub(crate) fn allows(passthrough: &[String], path: &str) -> bool {
    passthrough.iter().any(|p| p == path)
}

/// Why a path is not canonical, or `Ok`. Canonical: starts with `/`, no empty, `.` or `..`
/// segment (so no `//` and no trailing `/`, the root `/` aside), and only unreserved characters,
/// sub-delimiters, `:` and `@` (RFC 3986 `pchar` without `%`): no escape an engine would decode,
/// no backslash, no control byte. One pass over the bytes, no allocation.
pub(crate) fn canonical_path(path: &str) -> Result<(), &'static str> {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err("it does not start with /");
    }
    if bytes.len() == 1 {
        return Ok(());
    }
    for segment in path[1..].split('/') {
        match segment {
            "" => return Err("it has an empty segment (a doubled or trailing /)"),
            "." | ".." => return Err("it has a dot segment"),
            _ => {}
        }
        for &b in segment.as_bytes() {
            let ok = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b);
            if !ok {
                return Err(if b == b'%' {
                    "it has a percent-escape"
                } else {
                    "it has a character outside the canonical set"
                });
            }
        }
    }
    Ok(())
}

/// Refuses (400) a request whose target an engine could read as another path than pdgate does:
/// `CONNECT`, an absolute-form or authority-form target (HTTP/1.x: HTTP/2 requests always carry
/// `:scheme` and `:authority`, which hyper puts in the URI), a path not in canonical form.
pub(crate) fn check_target(
    method: &Method,
    uri: &Uri,
    version: Version,
) -> Result<(), GatewayError> {
    if method == Method::CONNECT {
        return Err(GatewayError::bad_request("CONNECT is not served", None));
    }
    if version < Version::HTTP_2 && (uri.scheme().is_some() || uri.authority().is_some()) {
        return Err(GatewayError::bad_request(
            "the request target must be a path (origin-form), not an absolute URL",
            None,
        ));
    }
    canonical_path(uri.path()).map_err(|why| {
        GatewayError::bad_request(format!("the request path is not canonical: {why}"), None)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_paths_pass_and_every_ambiguous_form_fails() {
        for ok in [
            "/",
            "/v1/completions",
            "/tokenize",
            "/v1/completions;x",
            "/v1/a.b",
        ] {
            assert_eq!(canonical_path(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "v1/completions",
            "/v1/%63ompletions",
            "/v1%2Fcompletions",
            "/v1/completions%2F",
            "/v1/./completions",
            "/v1/x/../completions",
            "/v1//completions",
            "//v1/completions",
            "/v1/completions/",
            "/v1\\completions",
            "/v1/com\u{0}pletions",
            "/v1/cömpletions",
            "/v1/a b",
            "/..",
        ] {
            assert!(canonical_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn connect_and_absolute_targets_are_refused() {
        let h1 = Version::HTTP_11;
        let abs: Uri = "http://169.254.169.254/v1/completions".parse().unwrap();
        assert!(check_target(&Method::POST, &abs, h1).is_err());
        assert!(check_target(&Method::POST, &abs, Version::HTTP_2).is_ok());
        let authority: Uri = "169.254.169.254:80".parse().unwrap();
        assert!(check_target(&Method::CONNECT, &authority, h1).is_err());
        assert!(check_target(&Method::CONNECT, &authority, Version::HTTP_2).is_err());
        assert!(check_target(&Method::POST, &authority, h1).is_err());
        let origin: Uri = "/v1/completions?x=1".parse().unwrap();
        assert!(check_target(&Method::POST, &origin, h1).is_ok());
        let escaped: Uri = "http://x/v1/%63ompletions".parse().unwrap();
        assert!(check_target(&Method::POST, &escaped, Version::HTTP_2).is_err());
    }

    #[test]
    fn the_allow_list_is_exact_and_validated() {
        let c = SecurityConfig::default();
        assert!(allows(&c.passthrough, "/v1/embeddings"));
        assert!(!allows(&c.passthrough, "/v1/embeddings/"));
        assert!(!allows(&c.passthrough, "/v1/load_lora_adapter"));
        assert!(!allows(&c.passthrough, "/V1/embeddings"));
        let bad = SecurityConfig {
            passthrough: vec!["/v1//x".into()],
            ..SecurityConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().0, "security.passthrough[0]");
        assert!(c.validate().is_ok());
    }
}
