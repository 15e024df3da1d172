//! pdgate: an OpenAI-compatible prefill/decode (PD) disaggregation gateway.
//!
//! A client's completions or chat request is split in two legs: a *prefill* engine computes the
//! prompt's KV cache, a *decode* engine streams the tokens. The KV cache moves between them over a
//! transfer backend; each backend (resolved per prefill endpoint from the
//! `model.aibrix.ai/kv-connector-type` label, with a global default) wants the legs shaped
//! differently, which the [`kvtransfer`] agents know. pdgate owns everything around them:
//! endpoint discovery, pairing, policies, timeouts, cancellation, streaming, metrics.
//!
//! # Modules
//! - [`config`]: the one configuration type (TOML), validated once, naming bad fields.
//! - [`cli`]: flags that override the file, and the config-file watcher.
//! - [`endpoints`]: pods -> routable [`endpoints::Snapshot`] (pure), published atomically, with
//!   per-endpoint load counters.
//! - [`policy`]: `round_robin`, `random`, `least_request`, `power_of_two`.
//! - [`gateway`]: shared state, start-up, the reconciler (Mooncake bootstrap lookups), shutdown.
//! - [`flow`]: the path of one request (sequential or concurrent legs).
//! - [`relay`]: the decode body on its way to the client (backpressure, load release at end).
//! - [`server`]: the HTTP routes. [`client`]: the pooled engine client.
//! - [`error`]: one error type rendered once as an OpenAI error. [`metrics`]: Prometheus.
//! - [`demo`]: in-process simulated engines plus a gateway.
//! - [`health`]: active checks and passive outlier detection feeding the snapshot.
//! - [`admission`]: the in-flight limit with a bounded queue, and the retry budget.
//! - [`retry`]: retry targets, per-endpoint caps, SGLang aborts (also when a client leaves).
//!
//! # Example
//! ```no_run
//! use pdgate::{Config, Gateway, RunningGateway};
//! # async fn run() -> Result<(), pdgate::Error> {
//! let mut config = Config::from_toml(r#"
//!     kv_connector = "shfs"
//!     [[prefill]]
//!     url = "http://10.0.0.1:8000"
//!     [[decode]]
//!     url = "http://10.0.0.2:8000"
//! "#)?;
//! config.listen = "127.0.0.1:8080".parse().expect("address");
//! let gateway = Gateway::new(config, kvtransfer::Registry::with_builtins())?;
//! let running = RunningGateway::bind(gateway).await?;
//! running.run_until(async { let _ = tokio::signal::ctrl_c().await; }, std::time::Duration::from_secs(30)).await;
//! # Ok(()) }
//! ```

pub mod admission;
pub mod cli;
pub mod client;
pub mod config;
pub mod demo;
pub mod endpoints;
pub mod error;
pub mod flow;
pub mod gateway;
pub mod guarded;
pub mod health;
pub mod listener;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod relay;
pub mod retry;
pub mod server;

pub use config::{Config, ConfigError};
pub use error::GatewayError;
pub use gateway::{Gateway, RunningGateway};

/// Start-up failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listen address could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Bind(std::net::SocketAddr, std::io::Error),
    /// Other I/O failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A simulated engine failed to start (demo).
    #[error("starting a simulated engine: {0}")]
    Engine(std::io::Error),
}
