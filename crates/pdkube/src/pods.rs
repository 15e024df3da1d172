//! The pure half of discovery: Kubernetes pods in, routable endpoints out.
//!
//! No I/O and no clock: the watch loop calls [`routable_pods`] on its whole store every time it
//! publishes, so the result depends only on the current pods (level-triggered).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod as KubePod;

use crate::EndpointPod;
use crate::config::{
    CONNECTOR_LABEL, DATA_PARALLEL_SIZE_ANNOTATION, DEFAULT_HTTP_PORT, ENGINE_LABEL, LabelKeys,
    MODEL_LABEL, ROLE_LABEL, ROLESET_LABEL, SGLANG_BOOTSTRAP_PORT_ANNOTATION,
};

/// Role value of a prefill pod.
pub const ROLE_PREFILL: &str = "prefill";
/// Role value of a decode pod.
pub const ROLE_DECODE: &str = "decode";
/// Role value of an encoder pod (encoder disaggregation: multimodal items are encoded there
/// before the prefill). Published like any pod; roleset pairing keeps encoders whatever their
/// roleset (one encoder serves the prefills of every roleset, as vLLM's EPD proxy uses them).
pub const ROLE_ENCODE: &str = "encode";

/// Why a pod is not routable. Closed set, safe as a metrics label via [`SkipReason::as_str`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// The pod has no name (never true for objects from the API server).
    NoName,
    /// `metadata.deletionTimestamp` is set: the pod is shutting down.
    Terminating,
    /// Phase `Succeeded` or `Failed`.
    Finished,
    /// No `Ready=True` condition.
    NotReady,
    /// No pod IP yet.
    NoIp,
    /// A non-leader member of a multi-node group (`pod-group-index` other than `"0"`).
    GroupMember(String),
    /// The port label is not a port number in 1..=65535.
    BadPort(String),
    /// The SGLang bootstrap port annotation is not a port number in 1..=65535.
    BadBootstrapPort(String),
    /// Roleset pairing is on and the pod has no roleset, or its roleset lacks a routable
    /// prefill or decode partner.
    Unpaired,
}

impl SkipReason {
    /// Stable short name (for logs and metrics labels).
    pub fn as_str(&self) -> &'static str {
        match self {
            SkipReason::NoName => "no_name",
            SkipReason::Terminating => "terminating",
            SkipReason::Finished => "finished",
            SkipReason::NotReady => "not_ready",
            SkipReason::NoIp => "no_ip",
            SkipReason::GroupMember(_) => "group_member",
            SkipReason::BadPort(_) => "bad_port",
            SkipReason::BadBootstrapPort(_) => "bad_bootstrap_port",
            SkipReason::Unpaired => "unpaired",
        }
    }
}

/// Maps one pod to an endpoint, or says why it is not routable.
///
/// Routable: has a name, is not terminating, not finished, `Ready=True`, has an IP,
/// `pod-group-index` is `"0"` or absent, and the port label (if any) and SGLang bootstrap
/// annotation (if any) parse as ports. The endpoint keeps the pod's labels and adds the
/// canonical AIBrix keys read through `keys` (trimmed; role and engine lower-cased; empty values
/// dropped). Annotations carry only the canonical SGLang bootstrap port and the data-parallel
/// size.
pub fn classify_pod(pod: &KubePod, keys: &LabelKeys) -> Result<EndpointPod, SkipReason> {
    let meta = &pod.metadata;
    let name = meta
        .name
        .as_deref()
        .filter(|n| !n.is_empty())
        .ok_or(SkipReason::NoName)?;
    if meta.deletion_timestamp.is_some() {
        return Err(SkipReason::Terminating);
    }
    let status = pod.status.as_ref();
    if matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) {
        return Err(SkipReason::Finished);
    }
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready {
        return Err(SkipReason::NotReady);
    }
    let ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .map(str::trim)
        .filter(|ip| !ip.is_empty())
        .ok_or(SkipReason::NoIp)?;

    let empty = BTreeMap::new();
    let src_labels = meta.labels.as_ref().unwrap_or(&empty);
    let src_annotations = meta.annotations.as_ref().unwrap_or(&empty);
    let label = |key: &str| {
        src_labels
            .get(key)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    };

    if let Some(index) = label(&keys.pod_group_index)
        && index != "0"
    {
        return Err(SkipReason::GroupMember(index.to_owned()));
    }
    let http_port = match label(&keys.port) {
        None => DEFAULT_HTTP_PORT,
        Some(v) => parse_port(v).ok_or_else(|| SkipReason::BadPort(v.to_owned()))?,
    };
    let mut annotations = BTreeMap::new();
    if let Some(v) = src_annotations
        .get(&keys.sglang_bootstrap_port_annotation)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    {
        let port = parse_port(v).ok_or_else(|| SkipReason::BadBootstrapPort(v.to_owned()))?;
        annotations.insert(
            SGLANG_BOOTSTRAP_PORT_ANNOTATION.to_owned(),
            port.to_string(),
        );
    }
    if let Some(v) = src_annotations
        .get(DATA_PARALLEL_SIZE_ANNOTATION)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    {
        annotations.insert(DATA_PARALLEL_SIZE_ANNOTATION.to_owned(), v.to_owned());
    }

    let canonical: [(&str, Option<String>); 5] = [
        (ROLE_LABEL, label(&keys.role).map(str::to_ascii_lowercase)),
        (ROLESET_LABEL, label(&keys.roleset).map(str::to_owned)),
        (MODEL_LABEL, label(&keys.model).map(str::to_owned)),
        (
            ENGINE_LABEL,
            label(&keys.engine).map(str::to_ascii_lowercase),
        ),
        (CONNECTOR_LABEL, label(&keys.connector).map(str::to_owned)),
    ];
    let mut labels = src_labels.clone();
    for (key, value) in canonical {
        // A stale canonical label must not win over the configured source key.
        labels.remove(key);
        if let Some(value) = value {
            labels.insert(key.to_owned(), value);
        }
    }

    Ok(EndpointPod {
        name: name.to_owned(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        ip: Some(ip.to_owned()),
        labels,
        annotations,
        ready: true,
        http_port,
        ..EndpointPod::default()
    })
}

fn parse_port(v: &str) -> Option<u16> {
    v.parse::<u16>().ok().filter(|p| *p != 0)
}

/// Pure: Kubernetes pods -> routable endpoints, sorted by (namespace, name), duplicates removed.
///
/// See [`classify_pod`] for what is routable and how labels are rewritten to the canonical
/// AIBrix keys ("role-name", "roleset-name", "model.aibrix.ai/name",
/// "model.aibrix.ai/engine", "model.aibrix.ai/kv-connector-type", annotation
/// "model.aibrix.ai/sglang-bootstrap-port").
pub fn routable_pods(pods: &[KubePod], keys: &LabelKeys) -> Vec<EndpointPod> {
    routable_from(pods, keys)
}

/// [`routable_pods`] over any pod iterator (the watch loop maps its store without copying it).
pub fn routable_from<'a>(
    pods: impl IntoIterator<Item = &'a KubePod>,
    keys: &LabelKeys,
) -> Vec<EndpointPod> {
    let mut out: Vec<EndpointPod> = pods
        .into_iter()
        .filter_map(|p| classify_pod(p, keys).ok())
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    out.dedup_by(|a, b| a.namespace == b.namespace && a.name == b.name);
    out
}

/// Roleset pairing: keeps combined and encoder pods (role neither prefill nor decode), and keeps prefill and
/// decode pods only when their (namespace, roleset) holds at least one prefill and one decode
/// among `pods`. Input order is kept.
pub fn pair_rolesets(pods: Vec<EndpointPod>) -> Vec<EndpointPod> {
    fn role(p: &EndpointPod) -> Option<&str> {
        p.labels.get(ROLE_LABEL).map(String::as_str)
    }
    let mut has_prefill = BTreeSet::new();
    let mut has_decode = BTreeSet::new();
    for p in &pods {
        let Some(roleset) = p.labels.get(ROLESET_LABEL) else {
            continue;
        };
        let key = (p.namespace.as_str(), roleset.as_str());
        match role(p) {
            Some(ROLE_PREFILL) => has_prefill.insert(key),
            Some(ROLE_DECODE) => has_decode.insert(key),
            _ => false,
        };
    }
    let keep: Vec<bool> = pods
        .iter()
        .map(|p| match role(p) {
            Some(ROLE_PREFILL | ROLE_DECODE) => p.labels.get(ROLESET_LABEL).is_some_and(|rs| {
                let key = (p.namespace.as_str(), rs.as_str());
                has_prefill.contains(&key) && has_decode.contains(&key)
            }),
            _ => true,
        })
        .collect();
    pods.into_iter()
        .zip(keep)
        .filter_map(|(p, keep)| keep.then_some(p))
        .collect()
}

/// Counts of non-routable pods by reason (for a log line when the set changes).
pub fn skip_summary<'a>(
    pods: impl IntoIterator<Item = &'a KubePod>,
    keys: &LabelKeys,
) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for p in pods {
        if let Err(reason) = classify_pod(p, keys) {
            *out.entry(reason.as_str()).or_insert(0) += 1;
        }
    }
    out
}

#[cfg(test)]
#[path = "pods_tests.rs"]
mod tests;
