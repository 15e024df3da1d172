//! Configuration: engine role, KV connector, latency model and fault set.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::profile::Profile;

/// Connector label values, matching the pod label `model.aibrix.ai/kv-connector-type`.
///
/// Kept local so pdsim does not depend on the kvtransfer crate for three strings.
pub const CONNECTOR_TYPE_SHFS: &str = "shfs";
/// Connector label value for the AWS Neuron NixlConnector.
pub const CONNECTOR_TYPE_NIXL: &str = "nixl";
/// Connector label value for vLLM's MooncakeConnector.
pub const CONNECTOR_TYPE_MOONCAKE: &str = "mooncake";
/// Connector label value for SGLang's bootstrap handoff.
pub const CONNECTOR_TYPE_SGLANG: &str = "sglang";
/// Connector label value for vLLM's P2pNcclConnector.
pub const CONNECTOR_TYPE_P2P_NCCL: &str = "p2pnccl";
/// Connector label value for vLLM's MoRIIOConnector in write mode.
pub const CONNECTOR_TYPE_MORIIO: &str = "moriio";
/// Connector label value for vLLM's MoRIIOConnector in read mode.
pub const CONNECTOR_TYPE_MORIIO_READ: &str = "moriio-read";
/// Connector label value for TensorRT-LLM disaggregated serving.
pub const CONNECTOR_TYPE_TRTLLM: &str = "trtllm";
/// Connector label value for an engine without KV transfer.
pub const CONNECTOR_TYPE_NONE: &str = "none";

/// A string did not name a known role or connector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?} (valid: {valid})")]
pub struct ParseEnumError {
    what: &'static str,
    value: String,
    valid: &'static str,
}

/// Which side of a prefill/decode pair this engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Produces KV: answers the prefill leg and keeps the prompt's KV for a decode.
    Prefill,
    /// Consumes KV: answers the decode leg after pulling the prefill's KV.
    Decode,
    /// A combined engine: serves plain requests and may both produce and consume KV.
    Both,
    /// An encoder-only engine (encoder disaggregation): answers a chat request's multimodal
    /// items with `ec_transfer_params` and serves them to the prefill that loads them.
    Encode,
}

impl Role {
    /// The lower-case name used on the command line and in stats.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
            Role::Encode => "encode",
        }
    }

    /// Whether this role keeps KV for a remote decode.
    pub fn produces(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether this role loads KV from a remote prefill.
    pub fn consumes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    /// Whether this role loads encoder output named by `ec_transfer_params` (an EC consumer:
    /// the prefill of an E/P/D fleet, or a combined engine behind an encoder).
    pub fn loads_encoder_output(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = ParseEnumError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            "encode" => Ok(Role::Encode),
            _ => Err(ParseEnumError {
                what: "role",
                value: s.to_owned(),
                valid: "prefill, decode, both, encode",
            }),
        }
    }
}

/// The KV-transfer backend whose handoff this engine reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Connector {
    /// vLLM NixlConnector wire format (AIBrix `shfs`): params returned by prefill, copied to decode.
    Shfs,
    /// AWS Neuron NixlConnector: the whole prefill response travels in `disagg_prefill_resp`.
    Nixl,
    /// vLLM MooncakeConnector: bootstrap server, `transfer_id`, concurrent legs.
    Mooncake,
    /// SGLang: shared `bootstrap_host`/`bootstrap_port`/`bootstrap_room` on both legs.
    Sglang,
    /// vLLM P2pNcclConnector (in `GET` mode): both engines' addresses in the request id; the
    /// decode pulls from the prefill address the id names.
    #[serde(rename = "p2pnccl")]
    P2pNccl,
    /// vLLM MoRIIOConnector, write mode: each leg's `kv_transfer_params` name the other engine;
    /// concurrent legs.
    Moriio,
    /// vLLM MoRIIOConnector, read mode: the decode also needs the prefill's
    /// `remote_engine_id` and `remote_block_ids`; sequential legs.
    #[serde(rename = "moriio-read")]
    MoriioRead,
    /// TensorRT-LLM: `disaggregated_params` with `context_only` / `generation_only` phases.
    Trtllm,
    /// No KV transfer at all.
    None,
}

impl Connector {
    /// The lower-case name used on the command line, in pod labels and in stats.
    pub fn as_str(self) -> &'static str {
        match self {
            Connector::Shfs => CONNECTOR_TYPE_SHFS,
            Connector::Nixl => CONNECTOR_TYPE_NIXL,
            Connector::Mooncake => CONNECTOR_TYPE_MOONCAKE,
            Connector::Sglang => CONNECTOR_TYPE_SGLANG,
            Connector::P2pNccl => CONNECTOR_TYPE_P2P_NCCL,
            Connector::Moriio => CONNECTOR_TYPE_MORIIO,
            Connector::MoriioRead => CONNECTOR_TYPE_MORIIO_READ,
            Connector::Trtllm => CONNECTOR_TYPE_TRTLLM,
            Connector::None => CONNECTOR_TYPE_NONE,
        }
    }

    /// Whether a prefill with this connector serves a KV side channel.
    pub(crate) fn has_side_channel(self) -> bool {
        matches!(
            self,
            Connector::Shfs
                | Connector::Nixl
                | Connector::Mooncake
                | Connector::P2pNccl
                | Connector::Moriio
                | Connector::MoriioRead
                | Connector::Trtllm
        )
    }

    /// Whether a prefill with this connector serves a bootstrap server.
    pub(crate) fn has_bootstrap(self) -> bool {
        matches!(self, Connector::Mooncake | Connector::Sglang)
    }
}

impl fmt::Display for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Connector {
    type Err = ParseEnumError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            CONNECTOR_TYPE_SHFS => Ok(Connector::Shfs),
            CONNECTOR_TYPE_NIXL => Ok(Connector::Nixl),
            CONNECTOR_TYPE_MOONCAKE => Ok(Connector::Mooncake),
            CONNECTOR_TYPE_SGLANG => Ok(Connector::Sglang),
            CONNECTOR_TYPE_P2P_NCCL => Ok(Connector::P2pNccl),
            CONNECTOR_TYPE_MORIIO => Ok(Connector::Moriio),
            CONNECTOR_TYPE_MORIIO_READ => Ok(Connector::MoriioRead),
            CONNECTOR_TYPE_TRTLLM => Ok(Connector::Trtllm),
            CONNECTOR_TYPE_NONE => Ok(Connector::None),
            _ => Err(ParseEnumError {
                what: "connector",
                value: s.to_owned(),
                valid: "shfs, nixl, mooncake, sglang, p2pnccl, moriio, moriio-read, trtllm, none",
            }),
        }
    }
}

/// How long simulated work takes. `Default` is zero delay everywhere.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyModel {
    /// Compute time per prompt token that is not cached or loaded from a remote prefill.
    #[serde(with = "millis_f64")]
    pub prefill_per_token: Duration,
    /// Fixed time to first token (scheduling, first forward pass), paid by every request.
    #[serde(with = "millis_f64")]
    pub ttft: Duration,
    /// Inter-token latency: time per generated token after the first.
    #[serde(with = "millis_f64")]
    pub itl: Duration,
    /// Concurrent requests served at once; further requests queue. 0 = unlimited.
    pub slots: usize,
}

impl LatencyModel {
    /// Whether every delay is zero (no timers on the hot path).
    pub fn is_zero(&self) -> bool {
        self.prefill_per_token.is_zero() && self.ttft.is_zero() && self.itl.is_zero()
    }

    /// A latency model shaped like a small model on one GPU.
    pub fn realistic() -> Self {
        LatencyModel {
            prefill_per_token: Duration::from_micros(100),
            ttft: Duration::from_millis(20),
            itl: Duration::from_millis(10),
            slots: 64,
        }
    }
}

/// Faults to inject. `Default` injects nothing. Accepted as JSON by `POST /sim/faults`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Probability in `[0, 1]` that a generation request is answered with `error_status`.
    pub error_rate: f64,
    /// HTTP status of injected errors (default 500).
    pub error_status: u16,
    /// Never answer generation requests; wait until the client leaves.
    pub hang: bool,
    /// Delay before the response head of generation requests, in milliseconds.
    pub first_byte_delay_ms: u64,
    /// Drop the connection after this many body chunks (SSE events; non-streaming bodies are cut in half).
    pub drop_after_chunks: Option<u32>,
    /// `GET /health` answers 503.
    pub dead: bool,
    /// Refuse KV handoffs: side channel and bootstrap pulls fail, incoming remote KV fails.
    pub refuse_kv: bool,
    /// Model vLLM 0.32's engine crash: a shfs decode given `do_remote_prefill: true` without
    /// the remote fields answers 500 "EngineCore encountered an issue..." and the engine dies
    /// for good (`/health` 503, every later generation request 500). Off: that request alone fails.
    pub crash_on_bad_kv_params: bool,
    /// KV events: probability in `[0, 1]` that a batch is lost on the wire (its sequence number
    /// is used, so subscribers see a gap; replay still has it, as after a ZMQ HWM drop).
    pub kv_events_drop_rate: f64,
    /// KV events: sequence numbers skipped before every batch (0 = none).
    pub kv_events_skip_seq: u64,
    /// KV events: the publisher stops sending; batches queue (bounded by `hwm`, then dropped
    /// and counted) and go out when the stall ends.
    pub kv_events_stall: bool,
    /// Decode: KV-transfer parameters are ignored and the prompt is recomputed, as by a vLLM
    /// decode started without a KV connector (the answer looks right; no KV moved).
    pub ignore_kv: bool,
    /// Decode: a failed KV load recomputes the prompt and answers 200, as vLLM's
    /// `kv_load_failure_policy = "recompute"` does, instead of failing the request.
    pub recompute_on_kv_failure: bool,
    /// Prefill (shfs): the side-channel port advertised in `kv_transfer_params.remote_port`
    /// instead of the one it listens on, as when `VLLM_NIXL_SIDE_CHANNEL_PORT` disagrees with
    /// the engine's real side channel. Encoder: the port advertised in `ec_transfer_params`.
    pub advertise_side_channel_port: Option<u16>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            error_rate: 0.0,
            error_status: 500,
            hang: false,
            first_byte_delay_ms: 0,
            drop_after_chunks: None,
            dead: false,
            refuse_kv: false,
            crash_on_bad_kv_params: false,
            kv_events_drop_rate: 0.0,
            kv_events_skip_seq: 0,
            kv_events_stall: false,
            ignore_kv: false,
            recompute_on_kv_failure: false,
            advertise_side_channel_port: None,
        }
    }
}

impl Faults {
    /// Whether any request-path fault is active (dead health and KV refusal excluded).
    pub(crate) fn affects_requests(&self) -> bool {
        self.error_rate > 0.0
            || self.hang
            || self.first_byte_delay_ms > 0
            || self.drop_after_chunks.is_some()
    }
}

/// vLLM's `--kv-events-config` (`vllm/config/kv_events.py`), same field names and defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish KV-cache events at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` (or `"null"`: publish nothing).
    pub publisher: String,
    /// The PUB socket: binds when it contains `*` or `::` or is `ipc://`/`inproc://`,
    /// otherwise connects (the subscriber binds), as vLLM decides.
    pub endpoint: String,
    /// The replay ROUTER socket (always binds); none = no replay.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Send high-water mark: batches queued for the socket before new ones are dropped.
    pub hwm: usize,
    /// Topic frame of every message.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: "zmq".to_owned(),
            endpoint: "tcp://*:5557".to_owned(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Whether events are published (enabled and a zmq publisher).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }

    /// vLLM's rule: the PUB socket binds for wildcard, IPv6-any, ipc and inproc endpoints.
    pub fn binds(&self) -> bool {
        let e = &self.endpoint;
        e.contains('*') || e.contains("::") || e.starts_with("ipc://") || e.starts_with("inproc://")
    }
}

/// The address a ZMQ socket binds for `endpoint`. libzmq (vLLM's) reads `tcp://*:P` as every
/// interface; the pure-Rust `zeromq` crate resolves the host by name lookup and fails on `*`,
/// so the wildcard is spelt out as `0.0.0.0`.
pub(crate) fn zmq_bind_address(endpoint: &str) -> std::borrow::Cow<'_, str> {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}").into(),
        None => endpoint.into(),
    }
}

/// The engine's prefix cache (vLLM's `--block-size`, `--enable-prefix-caching`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per KV block (default 16).
    pub block_size: u32,
    /// Cached blocks kept; unreferenced ones are evicted LRU (default 65536).
    pub kv_cache_blocks: usize,
    /// Reuse cached prefixes (default on).
    pub enable_prefix_caching: bool,
    /// A Hugging Face `tokenizer.json` (its chat template from `tokenizer_config.json`
    /// beside it); none = the deterministic word tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Report `usage.prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`).
    pub enable_prompt_tokens_details: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 16,
            kv_cache_blocks: 65_536,
            enable_prefix_caching: true,
            tokenizer: None,
            enable_prompt_tokens_details: true,
        }
    }
}

/// Everything an engine needs to start. Build with [`SimConfig::new`] and adjust fields.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Prefill, decode or both.
    pub role: Role,
    /// KV-transfer backend reproduced.
    pub connector: Connector,
    /// Served model name (default `pdsim`).
    pub model: String,
    /// OpenAI HTTP listener (default `127.0.0.1:0`).
    pub listen: SocketAddr,
    /// shfs/nixl/mooncake KV side channel listener (default `127.0.0.1:0`).
    pub side_channel_listen: SocketAddr,
    /// mooncake/sglang bootstrap listener (default `127.0.0.1:0`).
    pub bootstrap_listen: SocketAddr,
    /// `remote_host` advertised by a prefill (default `localhost`, like vLLM).
    pub advertise_host: String,
    /// How long a prefill keeps KV for a decode, and an encoder its encoded items (default 30 s).
    pub kv_lease: Duration,
    /// Bound on every handoff wait: mooncake decode waiting for KV, sglang rendezvous, pulls (default 10 s).
    pub handoff_timeout: Duration,
    /// Simulated compute time.
    pub latency: LatencyModel,
    /// Faults active at start.
    pub faults: Faults,
    /// Engine id advertised to decodes (default random).
    pub engine_id: Option<String>,
    /// Prefix cache and tokenizer (library default: details in `usage` on).
    pub cache: CacheConfig,
    /// KV-cache events (default off).
    pub kv_events: KvEventsConfig,
    /// Simulated seconds per wall second: every delay is divided by it and every reported time
    /// is simulated (default 1).
    pub time_scale: f64,
    /// The step-loop engine model; `None` (default) keeps the per-request delays of `latency`.
    pub step: Option<StepModel>,
    /// Context window (prompt plus output); default the step model's profile's, else 32,768.
    pub max_model_len: Option<u32>,
    /// Data-parallel ranks behind the one API server (vLLM `--data-parallel-size`, default 1):
    /// each has its own prefix cache, queue and KV-event publisher (on the endpoints moved by
    /// its rank, as vLLM moves them); `X-data-parallel-rank` pins a request to one, unpinned
    /// requests are balanced like vLLM's internal load balancer.
    pub data_parallel_size: u32,
    /// LoRA adapters served from the start, as `(name, path)` (vLLM `--lora-modules
    /// name=path`); more load at run time through `/v1/load_lora_adapter`.
    pub lora_modules: Vec<(String, String)>,
}

/// Context window when neither `max_model_len` nor a profile gives one.
pub const DEFAULT_MAX_MODEL_LEN: u32 = 32_768;

/// The step-loop engine model, shaped like vLLM v1's scheduler: each step batches the running
/// requests' decode tokens and prefill chunks up to `max_num_batched_tokens`, at most
/// `max_num_seqs` requests run, admission needs KV blocks (`CacheConfig::kv_cache_blocks`), and
/// a step lasts what the profile's roofline says.
#[derive(Clone, Debug, PartialEq)]
pub struct StepModel {
    /// How long a step takes.
    pub profile: Profile,
    /// Tokens per step (chunked prefill), vLLM's `--max-num-batched-tokens`.
    pub max_num_batched_tokens: u32,
    /// Requests running at once, vLLM's `--max-num-seqs`.
    pub max_num_seqs: usize,
}

impl StepModel {
    /// vLLM's online-serving defaults (8192 batched tokens, 256 sequences) on `profile`.
    pub fn new(profile: Profile) -> Self {
        StepModel {
            profile,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
        }
    }
}

impl SimConfig {
    /// The context window this engine serves.
    pub fn context_window(&self) -> u32 {
        self.max_model_len
            .or_else(|| self.step.as_ref().map(|s| s.profile.max_model_len))
            .unwrap_or(DEFAULT_MAX_MODEL_LEN)
    }
}

impl SimConfig {
    /// A zero-delay, fault-free engine on loopback port 0 with every default.
    pub fn new(role: Role, connector: Connector) -> Self {
        let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        SimConfig {
            role,
            connector,
            model: "pdsim".to_owned(),
            listen: any,
            side_channel_listen: any,
            bootstrap_listen: any,
            advertise_host: "localhost".to_owned(),
            kv_lease: Duration::from_secs(30),
            handoff_timeout: Duration::from_secs(10),
            latency: LatencyModel::default(),
            faults: Faults::default(),
            engine_id: None,
            cache: CacheConfig::default(),
            kv_events: KvEventsConfig::default(),
            time_scale: 1.0,
            step: None,
            max_model_len: None,
            data_parallel_size: 1,
            lora_modules: Vec::new(),
        }
    }
}

mod millis_f64 {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms = f64::deserialize(d)?;
        Duration::try_from_secs_f64(ms / 1000.0).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zmq_wildcard_binds_every_interface() {
        assert_eq!(zmq_bind_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(
            zmq_bind_address("tcp://127.0.0.1:5557"),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(zmq_bind_address("ipc:///tmp/kv"), "ipc:///tmp/kv");
    }

    #[test]
    fn role_and_connector_round_trip() {
        for r in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(r.to_string().parse::<Role>(), Ok(r));
        }
        for c in [
            Connector::Shfs,
            Connector::Nixl,
            Connector::Mooncake,
            Connector::Sglang,
            Connector::None,
        ] {
            assert_eq!(c.to_string().parse::<Connector>(), Ok(c));
        }
        assert_eq!("ShFs".parse::<Connector>(), Ok(Connector::Shfs));
        assert!("nope".parse::<Connector>().is_err());
        assert!("".parse::<Role>().is_err());
    }

    #[test]
    fn kv_events_config_takes_vllm_fields_and_bind_rule() {
        let c: KvEventsConfig = serde_json::from_str(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":"kv"}"#,
        )
        .unwrap();
        assert!(c.publishes() && !c.binds());
        assert_eq!(c.buffer_steps, 10_000);
        assert!(KvEventsConfig::default().binds());
        for (e, binds) in [
            ("tcp://*:1", true),
            ("tcp://[::]:1", true),
            ("ipc:///tmp/x", true),
            ("inproc://x", true),
            ("tcp://10.0.0.1:1", false),
        ] {
            let c = KvEventsConfig {
                endpoint: e.into(),
                ..KvEventsConfig::default()
            };
            assert_eq!(c.binds(), binds, "{e}");
        }
        assert!(!KvEventsConfig::default().publishes());
        assert!(serde_json::from_str::<KvEventsConfig>(r#"{"endpont":"x"}"#).is_err());
    }

    #[test]
    fn faults_parse_partial_and_reject_unknown() {
        let f: Faults = serde_json::from_str(r#"{"hang":true}"#).unwrap();
        assert!(f.hang);
        assert_eq!(f.error_status, 500);
        assert!(serde_json::from_str::<Faults>(r#"{"hnag":true}"#).is_err());
    }
}
