//! pdgate: an OpenAI-compatible prefill/decode (PD) disaggregation gateway.
//!
//! A client's completions or chat request is split in two legs: a *prefill* engine computes the
//! prompt's KV cache, a *decode* engine streams the tokens. The KV cache moves between them over a
//! transfer backend; each backend (resolved per prefill endpoint from the
//! `model.aibrix.ai/kv-connector-type` label, with a global default) wants the legs shaped
//! differently, which the [`kvtransfer`] agents know, quirks included (aborts, bootstrap
//! lookups): pdgate never compares connector names. pdgate owns everything around them:
//! endpoint discovery, pairing, policies, timeouts, cancellation, streaming, metrics.
//!
//! # Modules, in the order a request meets them
//! - `http`: the one edge. The accept loop, the routes, the size-limited body read, and the
//!   one place where an error becomes an OpenAI-shaped answer with `x-request-id` and a
//!   recorded outcome.
//! - `security`: what the edge applies: request-target checks and the pass-through allow-list,
//!   client keys and named clients' limits, the body budget, TLS (`[security]`).
//! - `pd`: one `Exchange` per request (its whole state, private, changed by its methods):
//!   `view` (what the request is) -> `select` (the pair, retry targets) -> `legs` (sequential
//!   or concurrent; every failed attempt's next step decided in `retry`) -> `relay` (the decode
//!   body to the client); `abort` is the one path for engine aborts. `route`: the PD routes (their paths,
//!   checks and labels).
//! - `engine`: engine I/O: the connection pool, one leg (typed failures, timeouts), probes.
//! - `cache`: cache-aware routing: the request's prefix view (block keys), a cache index per
//!   model (`pdcache`), the `[cache]` config section, its metrics; `pd::select` consults it
//!   when a policy is `cache_aware`.
//! - `endpoints`: pods -> routable snapshot (pure), load counters; `policy` (round_robin,
//!   random, least_request, power_of_two; where a cache-aware policy goes) and `health`
//!   (active checks, passive outlier ejection).
//! - `discovery`: the pod sources (static, the watched config file, Kubernetes via `pdkube`) and
//!   the reconciler that does bootstrap lookups and publishes snapshots.
//! - `limits`: admission (in-flight limit, bounded queue), the per-endpoint cap, the retry budget.
//! - [`config`]: the one configuration type, one field per section (each owned by the module
//!   that reads it where the layering allows), its flags, validation.
//! - [`telemetry`]: logging set-up, the request's spans (`request`, `prefill`, `kv_handoff`,
//!   `decode`, `relay`), OpenTelemetry export (`[telemetry]`, off by default).
//! - `state`: [`Gateway`], the shared state, and the handles it gives components (`Routing`
//!   for selection, `Engines` for legs, `Edge` for the way in). `run`: [`RunningGateway`], bind/serve/drain.
//! - `metrics`: Prometheus. `headers`: header names and the request id. `error`:
//!   [`GatewayError`], typed by where it came from ([`Leg`], [`UpstreamKind`]), and
//!   [`ConfigError`]. `durations`: durations as the file spells them. `watch`: files re-read
//!   when they change.
//! - [`extproc`]: the gateway as Envoy's external processor (`pdgate ext-proc`): the same state
//!   and PD steps, the decode leg carried by the proxy (`pd::delegate`).
//! - [`demo`] (cargo feature `demo`, on by default): simulated engines plus a gateway.
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
//! config.http.listen = "127.0.0.1:8080".parse().expect("address");
//! let gateway = Gateway::new(config, kvtransfer::Registry::with_builtins())?;
//! let running = RunningGateway::bind(gateway).await?;
//! running.run_until(async { let _ = tokio::signal::ctrl_c().await; }, std::time::Duration::from_secs(30)).await;
//! # Ok(()) }
//! ```

// (rustfmt keeps these sorted; the order a request meets them is the list above.)
pub(crate) mod cache;
pub mod check;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub(crate) mod discovery;
pub(crate) mod durations;
pub(crate) mod endpoints;
pub(crate) mod engine;
pub(crate) mod error;
pub mod extproc;
pub(crate) mod headers;
pub(crate) mod http;
pub(crate) mod limits;
pub(crate) mod metrics;
pub(crate) mod pd;
pub(crate) mod route;
pub(crate) mod run;
pub(crate) mod security;
pub(crate) mod state;
pub mod telemetry;
pub(crate) mod watch;

pub use cache::{CacheConfig, ModelCacheConfig};
pub use config::{Config, ConfigError, EndpointConfig, LogFormat, RunArgs};
pub use discovery::file::watch_config_file;
pub use error::{GatewayError, Leg, Source, UpstreamKind};
pub use extproc::ExtProcOptions;
#[doc(hidden)]
pub use pd::bench as cache_bench;
pub use run::{RunningGateway, listen};
pub use state::{Gateway, PodSet};
pub use telemetry::{OtlpProtocol, Telemetry, TelemetryConfig};

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
