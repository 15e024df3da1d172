//! The Gateway API Inference Extension's `InferencePool` (`inference.networking.k8s.io/v1`, as
//! released in v1.6.0: `spec.selector.matchLabels`, `spec.targetPorts[].number`): what pdgate
//! reads of it to find its pods. Pure; the watch loop reads the object.

use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;

/// The API group of InferencePool.
pub const GROUP: &str = "inference.networking.k8s.io";
/// The version read.
pub const VERSION: &str = "v1";
/// The kind.
pub const KIND: &str = "InferencePool";

/// The resource, for a dynamic `Api`.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, KIND),
        "inferencepools",
    )
}

/// What the pod watch takes from a pool: its label selector and the engine port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolView {
    /// `spec.selector.matchLabels` as a selector (`k=v,...`, keys sorted).
    pub selector: String,
    /// The first of `spec.targetPorts`.
    pub port: u16,
}

impl PoolView {
    /// Reads a pool's `spec`; the error says what is wrong with it.
    pub fn from_spec(spec: &Value) -> Result<PoolView, String> {
        let labels = spec["selector"]["matchLabels"]
            .as_object()
            .filter(|m| !m.is_empty())
            .ok_or("spec.selector.matchLabels is missing or empty")?;
        let mut terms = Vec::with_capacity(labels.len());
        for (k, v) in labels {
            let v = v
                .as_str()
                .ok_or_else(|| format!("spec.selector.matchLabels.{k} is not a string"))?;
            terms.push(format!("{k}={v}"));
        }
        terms.sort();
        let port = spec["targetPorts"][0]["number"]
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or("spec.targetPorts[0].number is missing or not a port")?;
        Ok(PoolView {
            selector: terms.join(","),
            port,
        })
    }

    /// The pod selector: the pool's, and the configured one when there is one.
    pub fn selector_with(&self, configured: Option<&str>) -> String {
        match configured {
            Some(c) => format!("{},{c}", self.selector),
            None => self.selector.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pool_gives_its_selector_and_first_port() {
        let spec = json!({
            "selector": {"matchLabels": {"app": "vllm", "model.aibrix.ai/name": "llama"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "pdgate", "port": {"number": 9002}},
        });
        let view = PoolView::from_spec(&spec).expect("valid");
        assert_eq!(view.selector, "app=vllm,model.aibrix.ai/name=llama");
        assert_eq!(view.port, 8000);
        assert_eq!(
            view.selector_with(Some("tier=gold")),
            "app=vllm,model.aibrix.ai/name=llama,tier=gold"
        );
    }

    #[test]
    fn a_pool_without_labels_or_ports_is_refused_with_the_field() {
        let no_labels = json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]});
        assert!(
            PoolView::from_spec(&no_labels)
                .unwrap_err()
                .contains("matchLabels")
        );
        let no_port = json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []});
        assert!(
            PoolView::from_spec(&no_port)
                .unwrap_err()
                .contains("targetPorts")
        );
        let bad_port =
            json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]});
        assert!(PoolView::from_spec(&bad_port).is_err());
    }
}
