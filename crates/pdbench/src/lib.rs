//! pdbench: a load generator for OpenAI-compatible endpoints and prefill/decode (PD) gateways.
//!
//! It measures what a PD gateway adds on top of the engines: it loads a gateway (or any
//! OpenAI endpoint) with closed-loop or open-loop traffic, and it can perform the PD two-leg
//! flow itself (`direct` mode) as the baseline.
//!
//! Modules:
//! - [`cli`]: the `pdbench` command line.
//! - [`config`]: [`Config`], [`Load`], [`Target`]: a run's description.
//! - [`runner`]: the closed- and open-loop drivers, [`run`].
//! - [`client`]: one request end to end (pooled hyper client, SSE timing, direct PD legs).
//! - [`workload`]: request bodies; [`dist`]: length distributions.
//! - [`stats`]: sharded HDR histograms and error classes; [`report`]: the result.
//! - [`sse`]: a bounded incremental SSE event reader.
//! - [`trace`]: the cache-sensitive workloads and the oracle hit share.
//! - [`mooncake`]: production traces (Mooncake format) and their oracle.
//! - [`metrics`]: engine counters read before and after a run (hits, work per engine).
//!
//! ```no_run
//! # async fn demo() -> Result<(), pdbench::BenchError> {
//! use pdbench::{Config, Load, Target};
//! let mut cfg = Config::new(Target::Url("http://127.0.0.1:8000".into()));
//! cfg.load = Load::Closed { concurrency: 16 };
//! cfg.stream = true;
//! cfg.requests = Some(500);
//! let report = pdbench::run(&cfg, tokio_util::sync::CancellationToken::new()).await?;
//! println!("{report}");
//! # Ok(()) }
//! ```

mod api;
pub mod cli;
pub mod client;
pub mod config;
pub mod dist;
pub mod metrics;
pub mod mooncake;
pub mod report;
pub mod runner;
pub mod sse;
pub mod stats;
pub mod trace;
pub mod workload;

pub use report::Report;
pub use runner::{Config, Load, Slo, Target, run};
pub use trace::{Order, TraceSpec, WorkloadKind};
pub use workload::{Api, DirectConnector};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A URL that cannot be used.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Inconsistent or out-of-range options.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Histogram allocation failed (bounds are constants, so this indicates a bug).
    #[error("histogram: {0}")]
    Histogram(#[from] hdrhistogram::CreationError),
}
