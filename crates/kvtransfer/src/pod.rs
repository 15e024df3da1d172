//! Engine pods as discovery describes them, and the Mooncake bootstrap facts
//! discovery attaches to prefill pods.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::labels;

/// HTTP port of an engine pod when no `model.aibrix.ai/port` label says
/// otherwise (contracts §8).
pub const DEFAULT_HTTP_PORT: u16 = 8000;

/// Default port of the vLLM Mooncake bootstrap server
/// (`VLLM_MOONCAKE_BOOTSTRAP_PORT`, contracts §5).
pub const DEFAULT_MOONCAKE_BOOTSTRAP_PORT: u16 = 8998;

/// Default SGLang disaggregation bootstrap port (contracts §6, §8).
pub const DEFAULT_SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// One engine pod: identity, address, metadata, readiness and discovery facts.
///
/// `Pod::default()` has no IP, is not ready and uses port
/// [`DEFAULT_HTTP_PORT`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    /// Pod name.
    pub name: String,
    /// Namespace (may be empty outside Kubernetes).
    pub namespace: String,
    /// IPv4, IPv6 (without brackets) or a host name; `None` until assigned.
    pub ip: Option<String>,
    /// Labels (see [`labels`]).
    pub labels: BTreeMap<String, String>,
    /// Annotations (see [`labels::SGLANG_BOOTSTRAP_PORT`]).
    pub annotations: BTreeMap<String, String>,
    /// Whether the pod passes its readiness check.
    pub ready: bool,
    /// Engine HTTP port.
    pub http_port: u16,
    /// Mooncake bootstrap facts, filled by discovery from `GET /query` when
    /// the pod appears or changes; never looked up per request.
    pub mooncake_bootstrap: Option<MooncakeBootstrap>,
}

impl Default for Pod {
    fn default() -> Self {
        Pod {
            name: String::new(),
            namespace: String::new(),
            ip: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            ready: false,
            http_port: DEFAULT_HTTP_PORT,
            mooncake_bootstrap: None,
        }
    }
}

impl Pod {
    /// A ready pod named `name` at `ip` (trimmed; empty means no IP) serving
    /// HTTP on `http_port`.
    pub fn new(name: impl Into<String>, ip: impl Into<String>, http_port: u16) -> Pod {
        let ip: String = ip.into();
        let ip = ip.trim();
        Pod {
            name: name.into(),
            ip: (!ip.is_empty()).then(|| ip.to_owned()),
            ready: true,
            http_port,
            ..Pod::default()
        }
    }

    /// Returns the pod with label `key` set to `value`.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Pod {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Returns the pod with annotation `key` set to `value`.
    pub fn with_annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Pod {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// Returns the pod with Mooncake bootstrap facts attached.
    pub fn with_mooncake_bootstrap(mut self, bootstrap: MooncakeBootstrap) -> Pod {
        self.mooncake_bootstrap = Some(bootstrap);
        self
    }

    /// The value of label `key`, if set.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }

    /// The value of annotation `key`, if set.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    /// The IP if set and non-empty.
    pub fn ip(&self) -> Option<&str> {
        self.ip
            .as_deref()
            .map(str::trim)
            .filter(|ip| !ip.is_empty())
    }

    /// The host part for a URL: the IP, with IPv6 addresses in brackets
    /// (`[::1]`). `None` without an IP.
    pub fn url_host(&self) -> Option<String> {
        self.ip().map(url_host)
    }

    /// `http://<url_host>:<http_port>`, or `None` without an IP.
    pub fn base_url(&self) -> Option<String> {
        self.url_host()
            .map(|h| format!("http://{h}:{}", self.http_port))
    }

    /// The SGLang bootstrap port: annotation
    /// [`labels::SGLANG_BOOTSTRAP_PORT`] when it is a valid port, else
    /// [`DEFAULT_SGLANG_BOOTSTRAP_PORT`].
    pub fn sglang_bootstrap_port(&self) -> u16 {
        self.annotation(labels::SGLANG_BOOTSTRAP_PORT)
            .and_then(|v| v.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .unwrap_or(DEFAULT_SGLANG_BOOTSTRAP_PORT)
    }

    /// The port of the bootstrap server a lookup queries (Mooncake `GET /query`): annotation
    /// [`labels::MOONCAKE_BOOTSTRAP_PORT`] when it parses, else
    /// [`DEFAULT_MOONCAKE_BOOTSTRAP_PORT`].
    pub fn mooncake_bootstrap_port(&self) -> u16 {
        self.annotation(labels::MOONCAKE_BOOTSTRAP_PORT)
            .and_then(|v| v.trim().parse::<u16>().ok())
            .unwrap_or(DEFAULT_MOONCAKE_BOOTSTRAP_PORT)
    }
}

/// `ip` as a URL host: IPv6 literals (anything containing `:`) get brackets
/// unless they already have them.
pub fn url_host(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    }
}

/// What a prefill pod's Mooncake bootstrap server reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeBootstrap {
    /// Bootstrap server port (decode dials `http://<pod ip>:<port>`).
    pub port: u16,
    /// Data-parallel ranks by index.
    pub ranks: BTreeMap<u32, MooncakeRank>,
}

/// One data-parallel rank of a Mooncake prefill engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeRank {
    /// The engine id decode must name as `remote_engine_id`.
    pub engine_id: String,
    /// Worker addresses by TP rank then PP rank (`tcp://h:p`); informational.
    pub worker_addr: BTreeMap<String, BTreeMap<String, String>>,
}

/// Errors from [`parse_mooncake_bootstrap`].
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// The `/query` endpoint answered a non-2xx status.
    #[error("mooncake bootstrap /query returned status {status}")]
    Status {
        /// HTTP status received.
        status: u16,
    },
    /// The answer is not a JSON object of ranks.
    #[error("mooncake bootstrap /query answer is not valid JSON: {0}")]
    Invalid(#[source] serde_json::Error),
    /// The answer lists no rank, or a rank lacks an `engine_id`.
    #[error("mooncake bootstrap /query answer has no engine_id{}", rank.as_ref().map(|r| format!(" for dp_rank {r}")).unwrap_or_default())]
    NoEngineId {
        /// The rank missing its id, or `None` when no rank was listed.
        rank: Option<String>,
    },
    /// A rank key is not a non-negative integer.
    #[error("mooncake bootstrap /query answer has invalid dp_rank {0:?}")]
    BadRank(String),
}

#[derive(Deserialize)]
struct RankWire<'a> {
    #[serde(default)]
    engine_id: Option<String>,
    #[serde(default, borrow)]
    worker_addr: Option<&'a RawValue>,
}

/// Parses the answer of `GET http://<prefill ip>:<port>/query` (contracts §5):
/// `{"<dp_rank>": {"engine_id": "...", "worker_addr": {"<tp>": {"<pp>": "tcp://h:p"}}}}`.
///
/// `status` is the HTTP status of the answer. A `worker_addr` of an unexpected
/// shape is ignored (the gateway never dials it).
///
/// # Errors
/// Non-2xx status: [`BootstrapError::Status`] ("returned status"); invalid
/// JSON or a non-object: [`BootstrapError::Invalid`]; `{}` or a rank without
/// `engine_id`: [`BootstrapError::NoEngineId`] ("no engine_id"); a rank key
/// that is not an integer: [`BootstrapError::BadRank`].
pub fn parse_mooncake_bootstrap(
    port: u16,
    status: u16,
    body: &[u8],
) -> Result<MooncakeBootstrap, BootstrapError> {
    if !(200..300).contains(&status) {
        return Err(BootstrapError::Status { status });
    }
    let wire: BTreeMap<String, RankWire<'_>> =
        serde_json::from_slice(body).map_err(BootstrapError::Invalid)?;
    if wire.is_empty() {
        return Err(BootstrapError::NoEngineId { rank: None });
    }
    let mut ranks = BTreeMap::new();
    for (key, rank) in wire {
        let index: u32 = key
            .trim()
            .parse()
            .map_err(|_| BootstrapError::BadRank(key.clone()))?;
        let engine_id = rank.engine_id.filter(|id| !id.is_empty()).ok_or_else(|| {
            BootstrapError::NoEngineId {
                rank: Some(key.clone()),
            }
        })?;
        let worker_addr = rank
            .worker_addr
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or_default();
        ranks.insert(
            index,
            MooncakeRank {
                engine_id,
                worker_addr,
            },
        );
    }
    Ok(MooncakeBootstrap { port, ranks })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_gets_brackets_once() {
        assert_eq!(url_host("::1"), "[::1]");
        assert_eq!(url_host("[::1]"), "[::1]");
        assert_eq!(url_host("10.0.0.1"), "10.0.0.1");
        let p = Pod::new("p", "fd00::5", 8100);
        assert_eq!(p.base_url().as_deref(), Some("http://[fd00::5]:8100"));
    }

    #[test]
    fn empty_ip_is_none() {
        assert_eq!(Pod::new("p", "  ", 8000).ip, None);
        let p = Pod {
            ip: Some(String::new()),
            ..Pod::default()
        };
        assert_eq!(p.base_url(), None);
        assert_eq!(Pod::default().http_port, DEFAULT_HTTP_PORT);
    }

    #[test]
    fn sglang_port_annotation() {
        let p = Pod::new("p", "1.2.3.4", 8000);
        assert_eq!(p.sglang_bootstrap_port(), 8998);
        let p = p.with_annotation(labels::SGLANG_BOOTSTRAP_PORT, " 9100 ");
        assert_eq!(p.sglang_bootstrap_port(), 9100);
        let p = p.with_annotation(labels::SGLANG_BOOTSTRAP_PORT, "70000");
        assert_eq!(p.sglang_bootstrap_port(), 8998);
    }

    #[test]
    fn bootstrap_parse_cases() {
        let ok = parse_mooncake_bootstrap(
            8998,
            200,
            br#"{"1":{"engine_id":"b"},"0":{"engine_id":"a","worker_addr":{"0":{"0":"tcp://h:1"}}}}"#,
        )
        .unwrap();
        assert_eq!(ok.ranks.len(), 2);
        assert_eq!(ok.ranks[&0].worker_addr["0"]["0"], "tcp://h:1");
        assert!(ok.ranks[&1].worker_addr.is_empty());
        let odd = parse_mooncake_bootstrap(1, 200, br#"{"0":{"engine_id":"a","worker_addr":[1]}}"#)
            .unwrap();
        assert!(odd.ranks[&0].worker_addr.is_empty());
        let e = parse_mooncake_bootstrap(1, 200, br#"{"x":{"engine_id":"a"}}"#).unwrap_err();
        assert!(matches!(e, BootstrapError::BadRank(_)));
        let e = parse_mooncake_bootstrap(1, 200, br#"{"0":{"engine_id":""}}"#).unwrap_err();
        assert!(e.to_string().contains("no engine_id"), "{e}");
        let e = parse_mooncake_bootstrap(1, 200, b"[]").unwrap_err();
        assert!(matches!(e, BootstrapError::Invalid(_)));
        let e = parse_mooncake_bootstrap(1, 404, b"{}").unwrap_err();
        assert!(e.to_string().contains("returned status 404"), "{e}");
    }
}
