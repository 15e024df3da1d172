//! A run's description: where to send ([`Target`]), how ([`Load`]), against which objectives
//! ([`Slo`]) and what ([`Config`]).

use std::sync::Arc;
use std::time::Duration;

use crate::BenchError;
use crate::dist::Dist;
use crate::metrics::EngineRole;
use crate::mooncake::Trace;
use crate::trace::{TraceSpec, WorkloadKind};
use crate::workload::{Api, DirectConnector};

/// What to load.
#[derive(Debug, Clone)]
pub enum Target {
    /// One OpenAI endpoint: a gateway, or a single engine.
    Url(String),
    /// Replicas of one gateway behind a client that alternates between them: request `i` goes
    /// to replica `i mod n`, whatever its content.
    Replicas(Vec<String>),
    /// Direct PD against a prefill and a decode engine.
    Direct {
        /// Prefill engine base URL.
        prefill: String,
        /// Decode engine base URL.
        decode: String,
        /// How KV-transfer parameters are carried between the legs.
        connector: DirectConnector,
    },
}

/// How requests are issued.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// `concurrency` clients, each sending its next request when the previous one ends.
    Closed {
        /// Number of clients.
        concurrency: usize,
    },
    /// Requests start at a fixed rate whatever the latency; latency counts from the
    /// scheduled start (no coordinated omission). Requests due while `max_in_flight` are
    /// open are not sent and count as `overflow` errors.
    Open {
        /// Requests per second.
        rate: f64,
        /// Cap on concurrently open requests.
        max_in_flight: usize,
    },
    /// Requests of a trace file ([`Config::replay`]) start at their recorded times divided by
    /// `rate_factor` (and by [`Config::time_scale`]), whatever the latency; otherwise as `Open`.
    Replay {
        /// 2.0 sends twice as fast as recorded.
        rate_factor: f64,
        /// Cap on concurrently open requests.
        max_in_flight: usize,
    },
}

/// Service-level objectives a request is judged by (streams only).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    /// Time to first token at most this.
    pub ttft: Option<Duration>,
    /// The request's mean gap between tokens (time per output token) at most this.
    pub itl: Option<Duration>,
}

impl Slo {
    /// True when an objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft.is_some() || self.itl.is_some()
    }
}

/// A complete run description.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to send.
    pub target: Target,
    /// Which API.
    pub api: Api,
    /// Streaming or not.
    pub stream: bool,
    /// `model` field; `None`: the first model the target's `GET /v1/models` lists (falling
    /// back to `pdsim` with a warning).
    pub model: Option<String>,
    /// The trace replayed (`WorkloadKind::Synthetic`: the `--prompt-len` generator).
    pub trace: TraceSpec,
    /// Oracle block size (tokens).
    pub oracle_block_size: usize,
    /// Capacity-limited oracle: engines and blocks per engine.
    pub oracle_limit: Option<(usize, usize)>,
    /// Engine base URLs whose `/metrics` are read before and after the run.
    pub engine_metrics: Vec<String>,
    /// Print a live progress line on stderr (after a few seconds).
    pub progress: bool,
    /// Closed or open loop.
    pub load: Load,
    /// Stop after this many requests (measured ones, warm-up excluded).
    pub requests: Option<u64>,
    /// Stop issuing new requests after this long.
    pub duration: Option<Duration>,
    /// Prompt length in words.
    pub prompt_len: Dist,
    /// `max_tokens` per request.
    pub output_len: Dist,
    /// Per-request timeout.
    pub timeout: Duration,
    /// RNG seed for lengths.
    pub seed: u64,
    /// Unmeasured requests sent first (closed loop at the same concurrency; open loop at up
    /// to 64 clients) to open connections and warm caches.
    pub warmup: u64,
    /// Closed loop: client `i` of `n` starts after `ramp * i / n` (measured phase only).
    pub ramp: Duration,
    /// The trace file replayed by [`Load::Replay`].
    pub replay: Option<Arc<Trace>>,
    /// Simulated seconds per wall second of the engines (pdsim `--time-scale`): replay send
    /// times are divided by it, and every latency, duration and rate is reported in simulated
    /// time (wall x `time_scale`).
    pub time_scale: f64,
    /// Objectives for SLO attainment and goodput.
    pub slo: Slo,
    /// Roles of the `engine_metrics` engines, by index (empty: unknown).
    pub engine_roles: Vec<Option<EngineRole>>,
}

impl Config {
    /// Defaults: one closed-loop client, non-streaming completions, 1000 requests, prompts of
    /// 128 words, 16 output tokens, 60 s timeout, no warm-up, no ramp.
    pub fn new(target: Target) -> Self {
        Config {
            target,
            api: Api::Completions,
            stream: false,
            model: None,
            trace: TraceSpec::new(WorkloadKind::Synthetic),
            oracle_block_size: 16,
            oracle_limit: None,
            engine_metrics: Vec::new(),
            progress: false,
            load: Load::Closed { concurrency: 1 },
            requests: Some(1000),
            duration: None,
            prompt_len: Dist::Fixed(128),
            output_len: Dist::Fixed(16),
            timeout: Duration::from_secs(60),
            seed: 1,
            warmup: 0,
            ramp: Duration::ZERO,
            replay: None,
            time_scale: 1.0,
            slo: Slo::default(),
            engine_roles: Vec::new(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), BenchError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(BenchError::Config(
                "--time-scale must be a positive number".into(),
            ));
        }
        if self.slo.is_set() && !self.stream {
            return Err(BenchError::Config(
                "--slo-ttft and --slo-itl need --stream (TTFT and token gaps are measured on streams)"
                    .into(),
            ));
        }
        match (&self.load, &self.replay) {
            (Load::Replay { .. }, None) => {
                return Err(BenchError::Config(
                    "a replay needs a trace file (--trace-file)".into(),
                ));
            }
            (Load::Replay { .. }, Some(_)) if self.is_trace() => {
                return Err(BenchError::Config(
                    "--trace-file replaces --workload: give one of them".into(),
                ));
            }
            (Load::Replay { .. }, Some(_)) if self.api != Api::Completions => {
                return Err(BenchError::Config(
                    "a trace file is replayed on the completions API (chat role markers would shift its blocks)"
                        .into(),
                ));
            }
            (Load::Replay { rate_factor, .. }, Some(_))
                if !(rate_factor.is_finite() && *rate_factor > 0.0) =>
            {
                return Err(BenchError::Config(
                    "--rate-factor must be a positive number".into(),
                ));
            }
            _ => {}
        }
        if self.requests.is_none()
            && self.duration.is_none()
            && !self.is_trace()
            && self.replay.is_none()
        {
            return Err(BenchError::Config(
                "unbounded run: give --requests and/or --duration".into(),
            ));
        }
        if self.requests == Some(0) {
            return Err(BenchError::Config("--requests must be at least 1".into()));
        }
        if self.duration.is_some_and(|d| d.is_zero()) || self.timeout.is_zero() {
            return Err(BenchError::Config(
                "--duration and --timeout must be positive".into(),
            ));
        }
        match self.load {
            Load::Closed { concurrency: 0 } => Err(BenchError::Config(
                "--concurrency must be at least 1".into(),
            )),
            Load::Open { rate, .. } if !(rate.is_finite() && rate > 0.0) => Err(
                BenchError::Config("--rate must be a positive number".into()),
            ),
            Load::Open {
                max_in_flight: 0, ..
            }
            | Load::Replay {
                max_in_flight: 0, ..
            } => Err(BenchError::Config(
                "--max-in-flight must be at least 1".into(),
            )),
            _ => Ok(()),
        }
    }

    /// True when a cache-sensitive trace (not the synthetic generator) is replayed.
    pub fn is_trace(&self) -> bool {
        self.trace.kind != WorkloadKind::Synthetic
    }

    /// The API actually called: multi-turn is always chat.
    pub fn effective_api(&self) -> Api {
        if self.trace.kind == WorkloadKind::MultiTurn {
            Api::Chat
        } else {
            self.api
        }
    }

    pub(crate) fn peak_connections(&self) -> usize {
        match self.load {
            Load::Closed { concurrency } => concurrency,
            Load::Open { max_in_flight, .. } | Load::Replay { max_in_flight, .. } => {
                max_in_flight.min(100_000)
            }
        }
    }
}
