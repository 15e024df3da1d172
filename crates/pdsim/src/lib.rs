//! pdsim: an engine simulator that speaks vLLM 0.33's HTTP surface and
//! reproduces each KV-transfer connector's prefill/decode handoff, so that a
//! gateway that gets a PD contract wrong fails the way it would against real
//! engines. Contracts: `docs/contracts.md` of the pdgate workspace.
//!
//! Modules:
//! - [`config`]: [`Role`], [`Connector`], [`LatencyModel`], [`Faults`], [`SimConfig`].
//! - `http`: the OpenAI routes and `/sim/faults`, `/sim/stats`, `/abort_request`.
//! - `request` / `respond`: vLLM request validation and response shapes.
//! - `plan`: which handoff a request performs (a pure function of body, role, connector).
//! - `job`: runs one request: slot, handoff, compute, generation, KV hand-over.
//! - `engine`: state shared by every request and listener of one engine.
//! - `dp`: data-parallel ranks (`--data-parallel-size`): a cache, queue and KV-event
//!   publisher each, the `X-data-parallel-rank` header, vLLM's balancer for unpinned requests.
//! - `prefix_cache`: vLLM-like block cache (chained `sha256_cbor` hashes, LRU of unreferenced
//!   blocks); `kv_events`: its changes published as vLLM's ZMQ KV events, with replay.
//! - `tokens`: the deterministic word tokenizer, or a Hugging Face one (`pdcache::tokenizer`).
//! - `kv_store`: the prefill's KV kept for its decode; `kv_servers`: the side channel and
//!   bootstrap servers that serve it; `kv_pull`: the decode's pull client.
//! - `encoder`: encoder disaggregation: the encoder role (`Role::Encode`) and the prefill's
//!   loads of encoder output; `mm`: a request's multimodal items and their hashes; `ec_store`:
//!   what an encoder keeps for its prefills.
//! - [`lora`]: LoRA adapters (`--lora-modules`, load/unload endpoints, adapters in
//!   `/v1/models`); an adapter request's blocks hash its name and its KV events carry it.
//! - [`stats`]: [`SimStats`], also rendered as Prometheus text on `/metrics`.
//!
//! ```no_run
//! use pdsim::{Connector, Role, SimConfig};
//! # async fn demo() -> std::io::Result<()> {
//! let prefill = pdsim::spawn(SimConfig::new(Role::Prefill, Connector::Shfs)).await?;
//! let decode = pdsim::spawn(SimConfig::new(Role::Decode, Connector::Shfs)).await?;
//! println!("P {} D {}", prefill.base_url(), decode.base_url());
//! assert_eq!(decode.stats().transfers_pulled, 0);
//! prefill.shutdown().await;
//! decode.shutdown().await;
//! # Ok(()) }
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod addressed;
mod clock;
pub mod config;
mod dp;
mod ec_store;
mod encoder;
mod engine;
mod error;
pub mod fleet;
mod handoff;
mod http;
mod job;
mod kv_events;
mod kv_pull;
mod kv_servers;
mod kv_store;
pub mod lora;
mod mm;
mod plan;
mod prefix_cache;
pub mod profile;
mod request;
mod respond;
mod respond_api;
mod scheduler;
pub mod stats;
mod step_loop;
mod tokens;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

pub use config::{
    CONNECTOR_TYPE_MOONCAKE, CONNECTOR_TYPE_NIXL, CONNECTOR_TYPE_NONE, CONNECTOR_TYPE_SGLANG,
    CONNECTOR_TYPE_SHFS, CacheConfig, Connector, DEFAULT_MAX_MODEL_LEN, Faults, KvEventsConfig,
    LatencyModel, ParseEnumError, Role, SimConfig, StepModel,
};
pub use error::ApiError;
pub use profile::Profile;
pub use stats::{EcStats, EndpointCounts, RankStats, RecentRequest, SimStats};

use arc_swap::ArcSwap;
use engine::Engine;
pub use kv_events::EventsError;
use tokens::Tok;

/// How long [`SimHandle::shutdown`] waits for connections to drain.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// A running engine. Dropping it stops every listener and task it owns.
pub struct SimHandle {
    engine: Arc<Engine>,
    addr: SocketAddr,
    tasks: JoinSet<()>,
}

fn serve(tasks: &mut JoinSet<()>, listener: TcpListener, router: Router, engine: &Engine) {
    let token = engine.shutdown.clone();
    let listener = listener.tap_io(|tcp| {
        // Small SSE events must not wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    tasks.spawn(async move {
        let r = axum::serve(listener, router.into_make_service())
            .with_graceful_shutdown(token.cancelled_owned())
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "pdsim listener stopped");
        }
    });
}

/// Binds every listener the role and connector need and starts serving.
///
/// Returns once the sockets are bound, so requests can be sent right away.
pub async fn spawn(config: SimConfig) -> std::io::Result<SimHandle> {
    let listener = TcpListener::bind(config.listen).await?;
    let addr = listener.local_addr()?;
    let produces = config.role.produces();
    let encodes = config.role == Role::Encode;
    let side = if encodes || (produces && config.connector.has_side_channel()) {
        Some(TcpListener::bind(config.side_channel_listen).await?)
    } else {
        None
    };
    let boot = if produces && config.connector.has_bootstrap() {
        Some(TcpListener::bind(config.bootstrap_listen).await?)
    } else {
        None
    };
    let side_port = side
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?
        .map(|a| a.port());
    let boot_port = boot
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?
        .map(|a| a.port());
    let engine_id = config
        .engine_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let tok = match &config.cache.tokenizer {
        None => Tok::Words,
        Some(path) => Tok::Hf(Arc::new(
            pdcache::tokenizer::HfTokenizer::load(path).map_err(std::io::Error::other)?,
        )),
    };
    let faults = Arc::new(ArcSwap::from_pointee(config.faults.clone()));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let clock = clock::SimClock::new(config.time_scale);
    let mut tasks = JoinSet::new();
    let publishes = config.kv_events.publishes() && config.cache.enable_prefix_caching;
    let mut engine = Engine::new(config, engine_id, (side_port, boot_port), faults, tok);
    engine.shutdown = shutdown;
    engine.clock = clock;
    // Each rank is its own engine core: its publisher on the endpoint moved by its rank (as
    // vLLM's), its own scheduler.
    let mut queues = Vec::new();
    for (i, rank) in (0u32..).zip(engine.ranks.iter_mut()) {
        if publishes {
            let sink = kv_events::start(
                &engine.cfg.kv_events,
                i,
                engine.faults.clone(),
                engine.shutdown.clone(),
                &mut tasks,
                clock,
            )
            .await
            .map_err(std::io::Error::other)?;
            rank.events = Some(sink);
        }
        if engine.cfg.step.is_some() {
            let (handle, rx) = step_loop::StepLoop::new();
            rank.steps = Some(handle);
            queues.push(rx);
        }
    }
    let engine = Arc::new(engine);
    for (i, rx) in queues.into_iter().enumerate() {
        tasks.spawn(scheduler::run(engine.clone(), i, rx));
    }
    serve(&mut tasks, listener, http::router(engine.clone()), &engine);
    if let Some(l) = side {
        let router = if encodes {
            encoder::side_channel_router(engine.clone())
        } else {
            kv_servers::side_channel_router(engine.clone())
        };
        serve(&mut tasks, l, router, &engine);
    }
    if let Some(l) = boot {
        serve(
            &mut tasks,
            l,
            kv_servers::bootstrap_router(engine.clone()),
            &engine,
        );
    }
    tracing::info!(
        %addr,
        role = %engine.cfg.role,
        connector = %engine.cfg.connector,
        engine_id = %engine.engine_id,
        side_channel_port = ?side_port,
        bootstrap_port = ?boot_port,
        "pdsim serving"
    );
    Ok(SimHandle {
        engine,
        addr,
        tasks,
    })
}

impl SimHandle {
    /// The OpenAI HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://IP:PORT` of the OpenAI HTTP listener.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Bootstrap server port (mooncake/sglang prefill or combined engines), if any.
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.engine.bootstrap_port
    }

    /// KV side-channel port (shfs/nixl/mooncake prefill or combined engines), if any.
    pub fn side_channel_port(&self) -> Option<u16> {
        self.engine.side_channel_port
    }

    /// The engine id advertised to decodes.
    pub fn engine_id(&self) -> &str {
        &self.engine.engine_id
    }

    /// The configuration the engine started with (faults may have changed since).
    pub fn config(&self) -> &SimConfig {
        &self.engine.cfg
    }

    /// The same data as `GET /sim/stats`.
    pub fn stats(&self) -> SimStats {
        self.engine.snapshot()
    }

    /// Replaces the active faults (same as `POST /sim/faults`).
    pub fn set_faults(&self, faults: Faults) {
        self.engine.faults.store(Arc::new(faults));
    }

    /// The PUB endpoint actually bound (rank 0's), when the KV-event publisher binds (vLLM's
    /// rule).
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.engine.ranks.first()?.events.as_ref()?.bound.as_deref()
    }

    /// The replay ROUTER endpoint actually bound (rank 0's), if replay is configured.
    pub fn kv_events_replay_endpoint(&self) -> Option<&str> {
        self.engine
            .ranks
            .first()?
            .events
            .as_ref()?
            .replay_bound
            .as_deref()
    }

    /// Empties the prefix cache and publishes `AllBlocksCleared` (same as `POST /reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) {
        self.engine.reset_prefix_cache();
    }

    /// Simulates an engine restart for the cache and its events: cache empty, event sequence
    /// back to 0, no `AllBlocksCleared` (same as `POST /sim/restart`).
    pub fn restart(&self) {
        self.engine.restart();
    }

    /// Stops accepting, ends in-flight work, waits (bounded) for connections to close.
    pub async fn shutdown(mut self) {
        self.engine.shutdown.cancel();
        let tasks = &mut self.tasks;
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("pdsim shutdown grace elapsed; aborting listeners");
            self.tasks.abort_all();
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.engine.shutdown.cancel();
        self.tasks.abort_all();
    }
}
