//! Agents by connector type: an owned [`Registry`]. There is no process-wide
//! registry: a gateway builds its own at start-up and hands it around, so
//! nothing can change the set of agents behind its back.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::agent::KvTransferAgent;
use crate::agents::{
    CONNECTOR_TYPE_MORIIO, CONNECTOR_TYPE_MORIIO_READ, CONNECTOR_TYPE_P2P_NCCL,
    CONNECTOR_TYPE_TRTLLM, MooncakeAgent, MoriioAgent, NixlAgent, P2pNcclAgent, SglangAgent,
    ShfsAgent, TrtllmAgent,
};
use crate::pod::Pod;
use crate::{
    CONNECTOR_TYPE_IDENTIFIER, CONNECTOR_TYPE_MOONCAKE, CONNECTOR_TYPE_NIXL, CONNECTOR_TYPE_SGLANG,
    CONNECTOR_TYPE_SHFS,
};

/// Makes an agent; called on every [`Registry::resolve`], so keep it cheap
/// (built-ins clone a shared `Arc`).
pub type AgentFactory = Arc<dyn Fn() -> Arc<dyn KvTransferAgent> + Send + Sync>;

/// Errors from resolving an agent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// No agent is registered under the name.
    #[error("unknown KV transfer connector type {name:?} (valid: [{}])", valid.join(" "))]
    Unknown {
        /// The name asked for, as given.
        name: String,
        /// Registered names, sorted.
        valid: Vec<String>,
    },
    /// No pod was given.
    #[error("cannot resolve KV transfer agent: pod is nil")]
    PodNil,
}

/// Agent factories keyed by normalised (trimmed, lower-case) connector type.
#[derive(Clone, Default)]
pub struct Registry {
    factories: BTreeMap<String, AgentFactory>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("agents", &self.factories.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Trims and lower-cases a connector type.
pub fn normalize_connector_type(name: &str) -> String {
    name.trim().to_lowercase()
}

/// A factory that hands out clones of one shared stateless agent.
pub fn shared_factory(agent: Arc<dyn KvTransferAgent>) -> AgentFactory {
    Arc::new(move || Arc::clone(&agent))
}

impl Registry {
    /// A registry with no agents.
    pub fn empty() -> Self {
        Registry::default()
    }

    /// A registry with the built-in agents: `mooncake`, `moriio`, `moriio-read`, `nixl`,
    /// `p2pnccl`, `sglang`, `shfs`, `trtllm`.
    pub fn with_builtins() -> Self {
        let mut r = Registry::empty();
        r.register(CONNECTOR_TYPE_SHFS, shared_factory(Arc::new(ShfsAgent)));
        r.register(CONNECTOR_TYPE_NIXL, shared_factory(Arc::new(NixlAgent)));
        r.register(
            CONNECTOR_TYPE_MOONCAKE,
            shared_factory(Arc::new(MooncakeAgent)),
        );
        r.register(CONNECTOR_TYPE_SGLANG, shared_factory(Arc::new(SglangAgent)));
        r.register(
            CONNECTOR_TYPE_P2P_NCCL,
            shared_factory(Arc::new(P2pNcclAgent)),
        );
        r.register(
            CONNECTOR_TYPE_MORIIO,
            shared_factory(Arc::new(MoriioAgent::write())),
        );
        r.register(
            CONNECTOR_TYPE_MORIIO_READ,
            shared_factory(Arc::new(MoriioAgent::read())),
        );
        r.register(CONNECTOR_TYPE_TRTLLM, shared_factory(Arc::new(TrtllmAgent)));
        r
    }

    /// Registers `factory` under `name` (trimmed, lower-cased), replacing any
    /// previous factory of that name.
    pub fn register(&mut self, name: &str, factory: AgentFactory) {
        self.factories
            .insert(normalize_connector_type(name), factory);
    }

    /// A fresh agent for `connector_type` (trimmed, lower-cased).
    ///
    /// # Errors
    /// [`RegistryError::Unknown`], displayed as
    /// `unknown KV transfer connector type "foo" (valid: [mooncake moriio moriio-read nixl p2pnccl sglang shfs trtllm])`.
    pub fn resolve(&self, connector_type: &str) -> Result<Arc<dyn KvTransferAgent>, RegistryError> {
        match self
            .factories
            .get(&normalize_connector_type(connector_type))
        {
            Some(factory) => Ok(factory()),
            None => Err(RegistryError::Unknown {
                name: connector_type.to_owned(),
                valid: self.valid_agent_names(),
            }),
        }
    }

    /// Registered names, sorted.
    pub fn valid_agent_names(&self) -> Vec<String> {
        self.factories.keys().cloned().collect()
    }

    /// Whether `connector_type` (normalised) is registered.
    pub fn contains(&self, connector_type: &str) -> bool {
        self.factories
            .contains_key(&normalize_connector_type(connector_type))
    }

    /// Checks a global default at start-up; returns its normalised name.
    ///
    /// # Errors
    /// [`RegistryError::Unknown`] listing the valid names.
    pub fn validate_default(&self, global_default: &str) -> Result<String, RegistryError> {
        let name = normalize_connector_type(global_default);
        if self.factories.contains_key(&name) {
            Ok(name)
        } else {
            Err(RegistryError::Unknown {
                name: global_default.to_owned(),
                valid: self.valid_agent_names(),
            })
        }
    }

    /// The connector type for a pod label value: trimmed and lower-cased; a
    /// registered value wins; empty falls back to `global_default`
    /// (normalised); an unregistered non-empty value logs a warning (once per
    /// distinct value per process, then at debug level) and falls back too.
    pub fn resolve_connector_type(&self, label_value: &str, global_default: &str) -> String {
        let name = normalize_connector_type(label_value);
        if name.is_empty() {
            return normalize_connector_type(global_default);
        }
        if self.factories.contains_key(&name) {
            return name;
        }
        if first_sighting(&name) {
            tracing::warn!(
                label = CONNECTOR_TYPE_IDENTIFIER,
                value = %label_value,
                default = %global_default,
                "unrecognised KV connector type on pod label; using the default"
            );
        } else {
            tracing::debug!(value = %label_value, "unrecognised KV connector type; using the default");
        }
        normalize_connector_type(global_default)
    }

    /// The agent for a (prefill) pod: its [`CONNECTOR_TYPE_IDENTIFIER`] label
    /// first, then `global_default`.
    ///
    /// # Errors
    /// [`RegistryError::PodNil`] for `None`; [`RegistryError::Unknown`] when
    /// the resolved type (i.e. the default) is not registered.
    pub fn resolve_agent_for_pod(
        &self,
        pod: Option<&Pod>,
        global_default: &str,
    ) -> Result<Arc<dyn KvTransferAgent>, RegistryError> {
        let pod = pod.ok_or(RegistryError::PodNil)?;
        let label = pod.label(CONNECTOR_TYPE_IDENTIFIER).unwrap_or("");
        self.resolve(&self.resolve_connector_type(label, global_default))
    }
}

/// How many distinct unrecognised label values get their own warning; beyond
/// that (a misbehaving label source) they are logged at debug level.
const WARN_DISTINCT_LIMIT: usize = 64;

/// Whether `value` has not been warned about yet. Resolution runs per request,
/// so a mistyped label would otherwise log one warning per request.
fn first_sighting(value: &str) -> bool {
    static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut warned = WARNED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if warned.contains(value) || warned.len() >= WARN_DISTINCT_LIMIT {
        return false;
    }
    warned.insert(value.to_owned())
}
