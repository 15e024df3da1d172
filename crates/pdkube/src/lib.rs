//! pdkube: Kubernetes discovery for pdgate.
//!
//! Finds AIBrix-labelled (or llm-d-labelled, via key overrides) prefill, decode and encoder
//! ([`ROLE_ENCODE`]) engine pods
//! and publishes the routable set as an immutable snapshot on a `tokio::sync::watch` channel.
//! The request path only ever reads the latest snapshot; it never waits on the API server.
//!
//! Level-triggered, like kube-rs' reflector:
//! ```text
//! list + watch (kube::runtime::watcher, backoff) -> store of pods -> debounce window
//!   -> routable_pods(store)  (pure)  -> [pair_rolesets]  -> send only if changed
//! ```
//!
//! Modules:
//! - [`config`]: [`KubeDiscoveryConfig`] and [`LabelKeys`] (AIBrix defaults, serde, validation).
//! - [`pods`]: the pure mapping [`routable_pods`] / [`classify_pod`] and [`pair_rolesets`].
//! - [`watch`]: the watch loop [`run`] and [`client_from_env`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use pdkube::{KubeDiscoveryConfig, client_from_env, run};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn demo() -> Result<(), pdkube::KubeDiscoveryError> {
//! let client = client_from_env().await?;
//! let config = KubeDiscoveryConfig {
//!     selector: Some("model.aibrix.ai/name=llama-3-8b".into()),
//!     ..KubeDiscoveryConfig::default()
//! };
//! let (tx, mut rx) = tokio::sync::watch::channel(Arc::new(Vec::new()));
//! let cancel = CancellationToken::new();
//! let task = tokio::spawn(run(client, config, tx, cancel.clone()));
//! rx.changed().await.ok();
//! for pod in rx.borrow().iter() {
//!     println!("{} {:?}:{} {:?}", pod.name, pod.ip, pod.http_port, pod.labels.get("role-name"));
//! }
//! cancel.cancel();
//! task.await.ok();
//! # Ok(())
//! # }
//! ```

pub mod config;
pub mod pods;
pub mod pool;
pub mod watch;

pub use config::{KubeDiscoveryConfig, LabelKeys};
pub use pods::{
    ROLE_DECODE, ROLE_ENCODE, ROLE_PREFILL, SkipReason, classify_pod, pair_rolesets, routable_from,
    routable_pods,
};
pub use watch::{client_from_env, client_from_kubeconfig, install_crypto_provider, run};

/// The endpoint type discovery publishes: `kvtransfer::Pod`, with `ready == true`, `ip` set,
/// the pod's labels plus the canonical AIBrix keys, only canonical annotations, and
/// `mooncake_bootstrap: None` (the gateway attaches bootstrap facts after its own lookups).
pub type EndpointPod = kvtransfer::Pod;

/// Errors from discovery set-up. Watch failures are not errors: they are retried with backoff
/// while the last good endpoint set keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum KubeDiscoveryError {
    /// A configuration field is invalid.
    #[error("invalid kubernetes discovery config field `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field (`namespace`, `selector`, `keys.role`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Neither in-cluster configuration nor a kubeconfig could be loaded.
    #[error("no kubernetes client configuration (in-cluster or kubeconfig): {0}")]
    ClientConfig(#[source] kube::config::InferConfigError),
    /// The kubeconfig file could not be read or has no usable context.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    /// The client could not be built from the configuration.
    #[error("building the kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The watch stream ended, which kube's watcher never does on its own.
    #[error("kubernetes watch stream ended unexpectedly")]
    WatchEnded,
}
