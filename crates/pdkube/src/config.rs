//! Discovery configuration: which pods to watch and which labels carry what.

use std::time::Duration;

use kvtransfer::labels;
use serde::Deserialize;

use crate::KubeDiscoveryError;

/// Canonical AIBrix label: the pod's role (`prefill`, `decode`, `encode`; anything else is
/// combined).
pub const ROLE_LABEL: &str = labels::ROLE_NAME;
/// Canonical AIBrix label: the roleset that groups prefill and decode pods.
pub const ROLESET_LABEL: &str = labels::ROLESET_NAME;
/// Canonical AIBrix label: the served model name.
pub const MODEL_LABEL: &str = labels::MODEL_NAME;
/// Canonical AIBrix label: the engine's HTTP port (default 8000).
pub const PORT_LABEL: &str = labels::MODEL_PORT;
/// Canonical AIBrix label: the engine kind (`vllm`, `sglang`, `trtllm`).
pub const ENGINE_LABEL: &str = labels::ENGINE;
/// Canonical AIBrix label: the KV-transfer connector (`shfs`, `nixl`, `mooncake`).
pub const CONNECTOR_LABEL: &str = labels::KV_CONNECTOR_TYPE;
/// Canonical AIBrix label: index of the pod inside a multi-node group (`"0"` is the leader).
pub const POD_GROUP_INDEX_LABEL: &str = labels::POD_GROUP_INDEX;
/// Canonical AIBrix annotation: the SGLang bootstrap port (default 8998).
pub const SGLANG_BOOTSTRAP_PORT_ANNOTATION: &str = labels::SGLANG_BOOTSTRAP_PORT;

/// pdgate annotation: the data-parallel ranks the engine serves (vLLM `--data-parallel-size`),
/// each routed to as its own target. Passed through as written; pdgate checks it (a pod with a
/// value that is not a number in 1..=1024 is left out, with the reason).
pub const DATA_PARALLEL_SIZE_ANNOTATION: &str = "pdgate.io/data-parallel-size";

/// HTTP port assumed when a pod carries no port label (AIBrix default).
pub const DEFAULT_HTTP_PORT: u16 = kvtransfer::DEFAULT_HTTP_PORT;

/// Where each fact is read from on a Kubernetes pod.
///
/// Defaults are the AIBrix keys of contracts.md section 8. Every key can be overridden, e.g.
/// `role = "llm-d.ai/role"` for llm-d deployments. Whatever the source keys, discovered pods
/// carry the canonical AIBrix keys ([`ROLE_LABEL`], [`MODEL_LABEL`], ...), so the gateway reads
/// one vocabulary.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LabelKeys {
    /// Label holding the role (`prefill` / `decode` / other = combined).
    pub role: String,
    /// Label holding the roleset name.
    pub roleset: String,
    /// Label holding the model name.
    pub model: String,
    /// Label holding the engine's HTTP port.
    pub port: String,
    /// Label holding the engine kind.
    pub engine: String,
    /// Label holding the KV-transfer connector type.
    pub connector: String,
    /// Label holding the index inside a multi-node pod group; only `"0"` or absent is routable.
    pub pod_group_index: String,
    /// Annotation holding the SGLang bootstrap port.
    pub sglang_bootstrap_port_annotation: String,
}

impl Default for LabelKeys {
    fn default() -> Self {
        Self {
            role: ROLE_LABEL.to_owned(),
            roleset: ROLESET_LABEL.to_owned(),
            model: MODEL_LABEL.to_owned(),
            port: PORT_LABEL.to_owned(),
            engine: ENGINE_LABEL.to_owned(),
            connector: CONNECTOR_LABEL.to_owned(),
            pod_group_index: POD_GROUP_INDEX_LABEL.to_owned(),
            sglang_bootstrap_port_annotation: SGLANG_BOOTSTRAP_PORT_ANNOTATION.to_owned(),
        }
    }
}

impl LabelKeys {
    /// Checks that no key is empty; the error names the field.
    pub fn validate(&self) -> Result<(), KubeDiscoveryError> {
        let fields = [
            ("keys.role", &self.role),
            ("keys.roleset", &self.roleset),
            ("keys.model", &self.model),
            ("keys.port", &self.port),
            ("keys.engine", &self.engine),
            ("keys.connector", &self.connector),
            ("keys.pod_group_index", &self.pod_group_index),
            (
                "keys.sglang_bootstrap_port_annotation",
                &self.sglang_bootstrap_port_annotation,
            ),
        ];
        for (field, value) in fields {
            if value.trim().is_empty() {
                return Err(KubeDiscoveryError::InvalidConfig {
                    field,
                    reason: "must not be empty".to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// What to watch and how to turn it into endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeDiscoveryConfig {
    /// Namespace to watch. `None`: the client's default namespace (in-cluster: the gateway's own
    /// namespace; kubeconfig: the context's namespace). `Some("*")`: all namespaces (needs a
    /// ClusterRole instead of a Role).
    pub namespace: Option<String>,
    /// Kubernetes label selector (`k=v,k2 in (a,b),!k3`) applied server-side.
    pub selector: Option<String>,
    /// Label and annotation keys.
    pub keys: LabelKeys,
    /// How long to gather watch events before recomputing the endpoint set. The window opens at
    /// the first event after a publish, so a steady stream of events cannot delay a publish by
    /// more than one window. In configuration files: milliseconds under `debounce_ms`.
    #[serde(rename = "debounce_ms", deserialize_with = "deserialize_millis")]
    pub debounce: Duration,
    /// Only publish prefill and decode pods that belong to a roleset holding at least one
    /// routable prefill and one routable decode pod (the gateway must then pair within a roleset).
    pub roleset_pairing: bool,
    /// Follow the Gateway API Inference Extension `InferencePool` of this name
    /// (`inference.networking.k8s.io/v1`) in the watched namespace: its
    /// `spec.selector.matchLabels` selects the pods (together with `selector`, when set) and its
    /// first `spec.targetPorts` number is their engine port. Roles and connectors still come from
    /// the pods' labels.
    pub inference_pool: Option<String>,
    /// How often the InferencePool is read again; a changed selector or port restarts the pod
    /// watch. In configuration files: milliseconds under `inference_pool_refresh_ms`.
    #[serde(
        rename = "inference_pool_refresh_ms",
        deserialize_with = "deserialize_millis"
    )]
    pub inference_pool_refresh: Duration,
}

/// Namespace value meaning "watch every namespace".
pub const ALL_NAMESPACES: &str = "*";

/// Default debounce window.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(250);

/// Default interval between two reads of the followed InferencePool.
pub const DEFAULT_POOL_REFRESH: Duration = Duration::from_secs(10);

impl Default for KubeDiscoveryConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            selector: None,
            keys: LabelKeys::default(),
            debounce: DEFAULT_DEBOUNCE,
            roleset_pairing: false,
            inference_pool: None,
            inference_pool_refresh: DEFAULT_POOL_REFRESH,
        }
    }
}

impl KubeDiscoveryConfig {
    /// Validates once at start-up; errors name the offending field.
    pub fn validate(&self) -> Result<(), KubeDiscoveryError> {
        self.keys.validate()?;
        if let Some(ns) = &self.namespace
            && ns != ALL_NAMESPACES
            && !is_dns_label(ns)
        {
            return Err(KubeDiscoveryError::InvalidConfig {
                field: "namespace",
                reason: format!("{ns:?} is not a valid namespace name (RFC 1123 label) or \"*\""),
            });
        }
        if let Some(selector) = &self.selector {
            validate_selector(selector)?;
        }
        if let Some(pool) = &self.inference_pool {
            if !is_dns_subdomain(pool) {
                return Err(KubeDiscoveryError::InvalidConfig {
                    field: "inference_pool",
                    reason: format!("{pool:?} is not a valid object name (RFC 1123 subdomain)"),
                });
            }
            if self.namespace.as_deref() == Some(ALL_NAMESPACES) {
                return Err(KubeDiscoveryError::InvalidConfig {
                    field: "inference_pool",
                    reason: "an InferencePool lives in one namespace: name it, not \"*\"".into(),
                });
            }
            if self.inference_pool_refresh < Duration::from_millis(10)
                || self.inference_pool_refresh > Duration::from_secs(3600)
            {
                return Err(KubeDiscoveryError::InvalidConfig {
                    field: "inference_pool_refresh",
                    reason: format!("{:?} is outside 10 ms ..= 1 h", self.inference_pool_refresh),
                });
            }
        }
        if self.debounce > Duration::from_secs(60) {
            return Err(KubeDiscoveryError::InvalidConfig {
                field: "debounce",
                reason: format!("{:?} is longer than 60 s", self.debounce),
            });
        }
        Ok(())
    }
}

fn deserialize_millis<'de, D>(deserializer: D) -> Result<Duration, D::Error>
where
    D: serde::Deserializer<'de>,
{
    u64::deserialize(deserializer).map(Duration::from_millis)
}

/// RFC 1123 subdomain (object names): dot-separated labels, at most 253 characters.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// RFC 1123 label: lower-case alphanumerics and '-', 1..=63, alphanumeric at both ends.
fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// Catches the mistakes that would otherwise only show up as a 400 from the API server retried
/// forever: an empty selector, empty terms, unbalanced parentheses.
fn validate_selector(selector: &str) -> Result<(), KubeDiscoveryError> {
    let invalid = |reason: String| KubeDiscoveryError::InvalidConfig {
        field: "selector",
        reason,
    };
    if selector.trim().is_empty() {
        return Err(invalid("must not be empty when given".to_owned()));
    }
    let mut depth = 0i32;
    let mut term = String::new();
    let mut terms = Vec::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut term));
                continue;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(invalid(format!("unbalanced ')' in {selector:?}")));
        }
        term.push(c);
    }
    terms.push(term);
    if depth != 0 {
        return Err(invalid(format!("unbalanced '(' in {selector:?}")));
    }
    if let Some(bad) = terms.iter().find(|t| {
        let t = t.trim();
        t.is_empty() || t == "!" || t.starts_with('=') || t.ends_with("!=")
    }) {
        return Err(invalid(format!("malformed term {bad:?} in {selector:?}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_aibrix_keys() {
        let c = KubeDiscoveryConfig::default();
        assert_eq!(c.keys.role, "role-name");
        assert_eq!(c.keys.model, "model.aibrix.ai/name");
        assert_eq!(
            c.keys.pod_group_index,
            "stormservice.orchestration.aibrix.ai/pod-group-index"
        );
        assert_eq!(c.debounce, Duration::from_millis(250));
        assert!(!c.roleset_pairing);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn partial_key_override_deserializes() {
        let c: KubeDiscoveryConfig = serde_json::from_str(
            r#"{"namespace":"llm","debounce_ms":100,"keys":{"role":"llm-d.ai/role"}}"#,
        )
        .expect("config parses");
        assert_eq!(c.keys.role, "llm-d.ai/role");
        assert_eq!(c.keys.model, MODEL_LABEL);
        assert_eq!(c.debounce, Duration::from_millis(100));
        assert_eq!(c.namespace.as_deref(), Some("llm"));
    }

    #[test]
    fn unknown_key_field_is_rejected() {
        let r: Result<LabelKeys, _> = serde_json::from_str(r#"{"rolle":"x"}"#);
        assert!(r.is_err());
    }

    #[test]
    fn empty_key_names_the_field() {
        let mut c = KubeDiscoveryConfig::default();
        c.keys.port = " ".to_owned();
        let err = c.validate().expect_err("empty key rejected").to_string();
        assert!(err.contains("keys.port"), "{err}");
    }

    #[test]
    fn namespace_validation() {
        for ok in ["default", "llm-serving", "*", "a1"] {
            let c = KubeDiscoveryConfig {
                namespace: Some(ok.to_owned()),
                ..Default::default()
            };
            assert!(c.validate().is_ok(), "{ok}");
        }
        for bad in ["", "Default", "-x", "x-", "a_b", &"a".repeat(64)] {
            let c = KubeDiscoveryConfig {
                namespace: Some(bad.to_owned()),
                ..Default::default()
            };
            let err = c.validate().expect_err(bad).to_string();
            assert!(err.contains("namespace"), "{err}");
        }
    }

    #[test]
    fn selector_validation() {
        for ok in [
            "app=engine",
            "app=engine,role-name in (prefill,decode)",
            "!canary",
            "tier!=cache",
            "model.aibrix.ai/name=llama",
        ] {
            assert!(validate_selector(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "  ",
            "a=b,",
            ",a=b",
            "a in (x,y",
            "a in x)",
            "=b",
            "!",
            "a!=",
        ] {
            let err = validate_selector(bad).expect_err(bad).to_string();
            assert!(err.contains("selector"), "{err}");
        }
    }

    #[test]
    fn debounce_upper_bound() {
        let c = KubeDiscoveryConfig {
            debounce: Duration::from_secs(61),
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }
}
