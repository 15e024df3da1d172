//! `pdsim`: run one simulated vLLM-like engine. See `pdsim --help` and the crate README.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pdsim::fleet::FleetSpec;
use pdsim::{
    CacheConfig, Connector, Faults, KvEventsConfig, LatencyModel, Profile, Role, SimConfig,
    StepModel,
};

/// jemalloc, as in pdgate: a benchmark engine (or load generator) that spends less CPU per request
/// leaves more of a shared core to what is being measured.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// A vLLM 0.33-like engine simulator that verifies prefill/decode KV handoffs.
///
/// Serves POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
/// GET /metrics, POST /tokenize, POST /reset_prefix_cache, POST /abort_request {"rid":...},
/// GET|POST /sim/faults (JSON, see the --fault-* flags for fields), GET /sim/stats (JSON
/// counters and the last request bodies) and POST /sim/restart (cache and event sequence reset
/// as after a crash).
#[derive(Debug, Parser)]
#[command(name = "pdsim", version, about, long_about, after_long_help = AFTER_HELP)]
struct Args {
    /// Engine role: prefill (produces KV), decode (consumes KV), both (plain, single engine) or
    /// encode (encoder-only: answers multimodal chat requests with ec_transfer_params and serves
    /// the encoded items on its side channel).
    #[arg(long, env = "PDSIM_ROLE", default_value = "both")]
    role: Role,
    /// KV connector reproduced: shfs (vLLM NixlConnector params), nixl (Neuron,
    /// disagg_prefill_resp), mooncake (bootstrap /query + transfer_id), sglang (bootstrap room),
    /// p2pnccl (addresses in the request id), moriio / moriio-read (peer in kv_transfer_params),
    /// trtllm (disaggregated_params phases), none.
    #[arg(long, env = "PDSIM_CONNECTOR", default_value = "shfs")]
    connector: Connector,
    /// OpenAI HTTP listen address.
    #[arg(long, env = "PDSIM_LISTEN", default_value = "127.0.0.1:8100")]
    listen: SocketAddr,
    /// Served model name (requests naming another model get 404).
    #[arg(long, env = "PDSIM_MODEL", default_value = "pdsim")]
    model: String,
    /// KV side-channel listen address (shfs/nixl/mooncake prefill); vLLM's default port is 5600.
    #[arg(
        long,
        env = "PDSIM_SIDE_CHANNEL_LISTEN",
        default_value = "127.0.0.1:5600"
    )]
    side_channel_listen: SocketAddr,
    /// Bootstrap server listen address (mooncake/sglang prefill); engines default to 8998.
    #[arg(long, env = "PDSIM_BOOTSTRAP_LISTEN", default_value = "127.0.0.1:8998")]
    bootstrap_listen: SocketAddr,
    /// Host a prefill advertises as remote_host / in worker_addr (vLLM's default is localhost).
    #[arg(long, env = "PDSIM_ADVERTISE_HOST", default_value = "localhost")]
    advertise_host: String,
    /// Engine id advertised to decodes (default: random).
    #[arg(long, env = "PDSIM_ENGINE_ID")]
    engine_id: Option<String>,
    /// Seconds a prefill keeps KV for its decode.
    #[arg(long, env = "PDSIM_KV_LEASE_SECS", default_value_t = 30.0)]
    kv_lease_secs: f64,
    /// Seconds any handoff may wait (mooncake decode for its transfer, sglang rendezvous, pulls).
    #[arg(long, env = "PDSIM_HANDOFF_TIMEOUT_SECS", default_value_t = 10.0)]
    handoff_timeout_secs: f64,
    /// No simulated compute time at all (for overhead benchmarks); overrides the latency flags.
    #[arg(long, env = "PDSIM_ZERO_DELAY")]
    zero_delay: bool,
    /// Prefill compute per uncached prompt token, milliseconds.
    #[arg(long, env = "PDSIM_PREFILL_MS_PER_TOKEN", default_value_t = 0.1)]
    prefill_ms_per_token: f64,
    /// Time to first token, milliseconds.
    #[arg(long, env = "PDSIM_TTFT_MS", default_value_t = 20.0)]
    ttft_ms: f64,
    /// Inter-token latency, milliseconds.
    #[arg(long, env = "PDSIM_ITL_MS", default_value_t = 10.0)]
    itl_ms: f64,
    /// Concurrent requests served at once; more queue. 0 = unlimited.
    #[arg(long, env = "PDSIM_SLOTS", default_value_t = 64)]
    slots: usize,
    /// Fault: probability in [0,1] of answering a generation request with --fault-error-status.
    #[arg(long, env = "PDSIM_FAULT_ERROR_RATE", default_value_t = 0.0)]
    fault_error_rate: f64,
    /// Fault: HTTP status of injected errors.
    #[arg(long, env = "PDSIM_FAULT_ERROR_STATUS", default_value_t = 500)]
    fault_error_status: u16,
    /// Fault: never answer generation requests (until the client leaves).
    #[arg(long, env = "PDSIM_FAULT_HANG")]
    fault_hang: bool,
    /// Fault: delay before the response head, milliseconds.
    #[arg(long, env = "PDSIM_FAULT_FIRST_BYTE_DELAY_MS", default_value_t = 0)]
    fault_first_byte_delay_ms: u64,
    /// Fault: drop the connection after N body chunks (SSE events; JSON bodies are cut in half).
    #[arg(long, env = "PDSIM_FAULT_DROP_AFTER_CHUNKS")]
    fault_drop_after_chunks: Option<u32>,
    /// Fault: GET /health answers 503.
    #[arg(long, env = "PDSIM_FAULT_DEAD")]
    fault_dead: bool,
    /// Fault: refuse KV handoffs (side channel/bootstrap pulls and incoming remote KV fail).
    #[arg(long, env = "PDSIM_FAULT_REFUSE_KV")]
    fault_refuse_kv: bool,
    /// Fault: a shfs decode given do_remote_prefill=true without the remote fields kills the
    /// engine (500 "EngineCore encountered an issue...", then /health 503 and every request 500), like vLLM 0.32.
    #[arg(long, env = "PDSIM_FAULT_CRASH_ON_BAD_KV_PARAMS")]
    fault_crash_on_bad_kv_params: bool,
    /// Fault: probability in [0,1] that a KV-event batch is lost on the wire (replay keeps it).
    #[arg(long, env = "PDSIM_FAULT_KV_EVENTS_DROP_RATE", default_value_t = 0.0)]
    fault_kv_events_drop_rate: f64,
    /// Fault: KV-event sequence numbers skipped before every batch.
    #[arg(long, env = "PDSIM_FAULT_KV_EVENTS_SKIP_SEQ", default_value_t = 0)]
    fault_kv_events_skip_seq: u64,
    /// Fault: the KV-event publisher stalls (batches queue up to hwm, then drop).
    #[arg(long, env = "PDSIM_FAULT_KV_EVENTS_STALL")]
    fault_kv_events_stall: bool,
    /// Fault (decode): ignore KV-transfer params and recompute the prompt, like a vLLM decode
    /// started without a KV connector.
    #[arg(long, env = "PDSIM_FAULT_IGNORE_KV")]
    fault_ignore_kv: bool,
    /// Fault (decode): a failed KV load recomputes the prompt and answers 200 (vLLM's
    /// kv_load_failure_policy "recompute") instead of failing the request.
    #[arg(long, env = "PDSIM_FAULT_RECOMPUTE_ON_KV_FAILURE")]
    fault_recompute_on_kv_failure: bool,
    /// Fault (shfs prefill): advertise this side-channel port instead of the real one, like a
    /// VLLM_NIXL_SIDE_CHANNEL_PORT that disagrees with the engine's side channel.
    #[arg(long, env = "PDSIM_FAULT_ADVERTISE_SIDE_CHANNEL_PORT")]
    fault_advertise_side_channel_port: Option<u16>,
    /// Hugging Face tokenizer.json (chat template from tokenizer_config.json beside it); default:
    /// the deterministic word tokenizer (one token per whitespace-separated word, plus BOS).
    #[arg(long, env = "PDSIM_TOKENIZER")]
    tokenizer: Option<PathBuf>,
    /// Tokens per KV block (prefix-cache granularity and block ids).
    #[arg(long, env = "PDSIM_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Prefix-cache capacity in blocks; unreferenced blocks are evicted least recently used first.
    /// With --profile it is the engine's KV memory: running requests hold their blocks and a
    /// full cache makes requests wait. Default: the profile's, else 65536.
    #[arg(long, env = "PDSIM_KV_CACHE_BLOCKS")]
    kv_cache_blocks: Option<usize>,
    /// Step-loop engine model on this performance profile (vLLM v1-like scheduler: batched
    /// steps, chunked prefill, KV-bounded admission, step time from a roofline). Off: each
    /// request sleeps its own latency-model delays. Profiles: llama-3.1-8b-h100,
    /// llama-3.1-70b-h100-tp8, llama-3.1-8b-a100-40gb.
    #[arg(long, env = "PDSIM_PROFILE")]
    profile: Option<Profile>,
    /// With --profile: tokens per step (prefill chunks share it with decodes).
    #[arg(long, env = "PDSIM_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192)]
    max_num_batched_tokens: u32,
    /// With --profile: requests running at once; the rest wait.
    #[arg(long, env = "PDSIM_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    /// Context window (prompt plus max_tokens). Default: the profile's, else 32768.
    #[arg(long, env = "PDSIM_MAX_MODEL_LEN")]
    max_model_len: Option<u32>,
    /// Data-parallel ranks (vLLM's internal load-balancing mode): each has its own prefix
    /// cache, queue and KV-event publisher (rank r on the endpoint's port + r, or `_dp<r>` after
    /// an ipc path); `X-data-parallel-rank` pins a request to one.
    #[arg(long, env = "PDSIM_DATA_PARALLEL_SIZE", default_value_t = 1)]
    data_parallel_size: u32,
    /// LoRA adapters served from the start, vLLM's `name=path` (the path is never read);
    /// requests name one in `model`. More load at run time with `POST /v1/load_lora_adapter`.
    #[arg(long, num_args = 1.., value_parser = pdsim::lora::parse_module)]
    lora_modules: Vec<(String, String)>,
    /// Simulated seconds per wall second (10 = ten times faster than real time). Delays are
    /// divided by it; every time the engine reports (created, KV-event timestamps, /metrics) is
    /// simulated.
    #[arg(long, env = "PDSIM_TIME_SCALE", default_value_t = 1.0)]
    time_scale: f64,
    /// Reuse cached prompt prefixes (vLLM's default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    enable_prefix_caching: bool,
    /// Turn the prefix cache off: every prompt token is computed, no KV events.
    #[arg(long, env = "PDSIM_NO_ENABLE_PREFIX_CACHING")]
    no_enable_prefix_caching: bool,
    /// Report usage.prompt_tokens_details.cached_tokens (otherwise prompt_tokens_details is null).
    #[arg(long, env = "PDSIM_ENABLE_PROMPT_TOKENS_DETAILS")]
    enable_prompt_tokens_details: bool,
    /// vLLM's KV-events config as JSON, e.g. {"enable_kv_cache_events":true,"publisher":"zmq",
    /// "endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv","buffer_steps":10000,
    /// "hwm":100000}. The PUB socket binds when the endpoint has * or :: or is ipc:// or inproc://,
    /// otherwise it connects to a subscriber that binds.
    #[arg(long, env = "PDSIM_KV_EVENTS_CONFIG")]
    kv_events_config: Option<String>,
    /// Tokio worker threads (default: one per available core).
    #[arg(long, env = "PDSIM_WORKER_THREADS")]
    worker_threads: Option<usize>,
}

const AFTER_HELP: &str = "\
Handoffs (a wrong one fails like the real engine: 500 JSON error, or 200 then a data: {\"error\":...} event):
  shfs      prefill given kv_transfer_params.do_remote_decode=true returns vLLM 0.33's full kv_transfer_params
            and keeps the KV for --kv-lease-secs on its side channel; decode given do_remote_prefill=true pulls
            it from remote_host:remote_port by remote_engine_id/remote_request_id (once) and checks the prompt.
  nixl      prefill stores KV unasked and returns the same params; decode needs disagg_prefill_resp (the whole
            prefill response) and pulls through its kv_transfer_params.
  mooncake  prefill serves GET /query on its bootstrap port and ships KV under kv_transfer_params.transfer_id
            when it finished by length (answers kv_transfer_params: null); decode needs remote_bootstrap_addr
            (http://...), remote_engine_id and transfer_id, and waits up to --handoff-timeout-secs.
  sglang    both legs carry bootstrap_host/bootstrap_port/bootstrap_room; the prefill waits for the decode of
            its room, the decode for the prefill's KV (400 when a room is missing). POST /abort_request {\"rid\"}.
  p2pnccl   both legs carry X-Request-Id ___prefill_addr_<host:port>___decode_addr_<host:port>_<hex>; the prefill
            keeps its KV under that id, the decode fetches it from the prefill address (GET /p2p/<id>, vLLM's GET
            mode). An id without both addresses fails (500); an id still holding KV is refused on the prefill.
  moriio    prefill needs kv_transfer_params.do_remote_decode with the decode's remote_host/handshake/notify
            ports, decode needs do_remote_prefill with the prefill's; the decode waits on
            remote_host:remote_handshake_port. Each leg's params on the other side fail (wrong phase).
  moriio-read  as moriio, sequential: the prefill answers remote_engine_id/remote_block_ids, the decode needs them.
  trtllm    context server given disaggregated_params.request_type=context_only answers
            choices[0].disaggregated_params (ctx_request_id, opaque_state); generation server given
            generation_only loads by ctx_request_id from the opaque state (once). The wrong phase is a 400.
  none      no handoff. A decode without KV params (any connector) recomputes and counts it.

Faults JSON (POST /sim/faults; missing fields take these defaults, unknown fields are rejected):
  {\"error_rate\":0.0,\"error_status\":500,\"hang\":false,\"first_byte_delay_ms\":0,
   \"drop_after_chunks\":null,\"dead\":false,\"refuse_kv\":false,\"crash_on_bad_kv_params\":false,
   \"kv_events_drop_rate\":0.0,\"kv_events_skip_seq\":0,\"kv_events_stall\":false,\"ignore_kv\":false,
   \"recompute_on_kv_failure\":false,\"advertise_side_channel_port\":null}

Prefix cache (like vLLM's): full blocks of --block-size tokens, chained sha256_cbor hashes; hits capped
at prompt_tokens-1 (floor((n-1)/block)*block); prefill time = uncached tokens x --prefill-ms-per-token.
A prefill caches what it computed; a decode caches the KV it pulled plus its generated tokens.

Every flag can also be set through the environment variable shown next to it.

Fleets: `pdsim fleet --prefill N --decode M --gateway-config OUT.toml` runs N prefill and M decode
engines in one process (see `pdsim fleet --help`).
";

/// Runs N prefill and M decode engines in one process and writes a pdgate configuration for them.
///
/// When every engine listens, prints one JSON line {"prefill":[url...],"decode":[url...],
/// "gateway_config":path} (also written to --ready-file), then runs until SIGTERM or SIGINT.
#[derive(Debug, Parser)]
#[command(name = "pdsim fleet", version, about, long_about)]
struct FleetArgs {
    /// Prefill engines.
    #[arg(long)]
    prefill: usize,
    /// Decode engines.
    #[arg(long)]
    decode: usize,
    /// KV connector of every engine: shfs, nixl, mooncake, sglang, none.
    #[arg(long, default_value = "shfs")]
    connector: Connector,
    /// Step-loop profile of every engine (see `pdsim --help`); without one, engines use the
    /// latency model (pdsim's defaults, or --zero-delay).
    #[arg(long)]
    profile: Option<Profile>,
    /// Profile of the prefills (overrides --profile).
    #[arg(long)]
    prefill_profile: Option<Profile>,
    /// Profile of the decodes (overrides --profile).
    #[arg(long)]
    decode_profile: Option<Profile>,
    /// Engines without a profile sleep no simulated time at all.
    #[arg(long)]
    zero_delay: bool,
    /// Simulated seconds per wall second.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// KV-cache blocks per engine (default: the profile's, else 65536).
    #[arg(long)]
    kv_cache_blocks: Option<usize>,
    /// Engines publish KV events (ZMQ PUB and replay sockets, written into the config).
    #[arg(long)]
    kv_events: bool,
    /// Served model name.
    #[arg(long, default_value = "pdsim")]
    model: String,
    /// Where to write the pdgate configuration (TOML).
    #[arg(long)]
    gateway_config: PathBuf,
    /// Also write the ready JSON here (written whole, once every engine listens).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Tokio worker threads (default: one per available core).
    #[arg(long)]
    worker_threads: Option<usize>,
}

/// Why pdsim did not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("--{0}: {1}")]
    Flag(&'static str, String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn secs(v: f64, name: &'static str) -> Result<Duration, StartError> {
    Duration::try_from_secs_f64(v).map_err(|e| StartError::Flag(name, e.to_string()))
}

fn ms(v: f64, name: &'static str) -> Result<Duration, StartError> {
    secs(v / 1000.0, name)
}

fn config(a: &Args) -> Result<SimConfig, StartError> {
    let mut c = SimConfig::new(a.role, a.connector);
    c.model = a.model.clone();
    c.listen = a.listen;
    c.side_channel_listen = a.side_channel_listen;
    c.bootstrap_listen = a.bootstrap_listen;
    c.advertise_host = a.advertise_host.clone();
    c.engine_id = a.engine_id.clone();
    c.kv_lease = secs(a.kv_lease_secs, "kv-lease-secs")?;
    c.handoff_timeout = secs(a.handoff_timeout_secs, "handoff-timeout-secs")?;
    c.latency = if a.zero_delay {
        LatencyModel {
            slots: a.slots,
            ..LatencyModel::default()
        }
    } else {
        LatencyModel {
            prefill_per_token: ms(a.prefill_ms_per_token, "prefill-ms-per-token")?,
            ttft: ms(a.ttft_ms, "ttft-ms")?,
            itl: ms(a.itl_ms, "itl-ms")?,
            slots: a.slots,
        }
    };
    for (name, v) in [
        ("fault-error-rate", a.fault_error_rate),
        ("fault-kv-events-drop-rate", a.fault_kv_events_drop_rate),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(StartError::Flag(name, "must be within [0, 1]".into()));
        }
    }
    if a.block_size == 0 {
        return Err(StartError::Flag("block-size", "must be at least 1".into()));
    }
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err(StartError::Flag(
            "time-scale",
            "must be a positive number".into(),
        ));
    }
    c.time_scale = a.time_scale;
    if a.max_model_len == Some(0) {
        return Err(StartError::Flag(
            "max-model-len",
            "must be at least 1".into(),
        ));
    }
    c.max_model_len = a.max_model_len;
    if !(1..=1024).contains(&a.data_parallel_size) {
        return Err(StartError::Flag(
            "data-parallel-size",
            "must be in 1..=1024".into(),
        ));
    }
    c.data_parallel_size = a.data_parallel_size;
    c.lora_modules = a.lora_modules.clone();
    c.step = match &a.profile {
        Some(p) => {
            if a.max_num_batched_tokens == 0 || a.max_num_seqs == 0 {
                return Err(StartError::Flag(
                    "max-num-batched-tokens",
                    "--max-num-batched-tokens and --max-num-seqs must be at least 1".into(),
                ));
            }
            Some(StepModel {
                profile: p.clone(),
                max_num_batched_tokens: a.max_num_batched_tokens,
                max_num_seqs: a.max_num_seqs,
            })
        }
        None => None,
    };
    let kv_cache_blocks = a
        .kv_cache_blocks
        .or_else(|| a.profile.as_ref().map(|p| p.kv_cache_blocks))
        .unwrap_or(65_536);
    c.cache = CacheConfig {
        block_size: a.block_size,
        kv_cache_blocks,
        enable_prefix_caching: !a.no_enable_prefix_caching,
        tokenizer: a.tokenizer.clone(),
        enable_prompt_tokens_details: a.enable_prompt_tokens_details,
    };
    if let Some(json) = &a.kv_events_config {
        c.kv_events = serde_json::from_str::<KvEventsConfig>(json)
            .map_err(|e| StartError::Flag("kv-events-config", e.to_string()))?;
    }
    c.faults = Faults {
        error_rate: a.fault_error_rate,
        error_status: a.fault_error_status,
        hang: a.fault_hang,
        first_byte_delay_ms: a.fault_first_byte_delay_ms,
        drop_after_chunks: a.fault_drop_after_chunks,
        dead: a.fault_dead,
        refuse_kv: a.fault_refuse_kv,
        crash_on_bad_kv_params: a.fault_crash_on_bad_kv_params,
        kv_events_drop_rate: a.fault_kv_events_drop_rate,
        kv_events_skip_seq: a.fault_kv_events_skip_seq,
        kv_events_stall: a.fault_kv_events_stall,
        ignore_kv: a.fault_ignore_kv,
        recompute_on_kv_failure: a.fault_recompute_on_kv_failure,
        advertise_side_channel_port: a.fault_advertise_side_channel_port,
    };
    Ok(c)
}

/// Writes `text` to `path` whole: readers never see a partial file.
fn write_whole(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

fn fleet_spec(a: &FleetArgs) -> Result<FleetSpec, StartError> {
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err(StartError::Flag(
            "time-scale",
            "must be a positive number".into(),
        ));
    }
    if a.prefill + a.decode == 0 {
        return Err(StartError::Flag(
            "prefill",
            "a fleet needs at least one engine".into(),
        ));
    }
    let mut spec = FleetSpec::new(a.prefill, a.decode, a.connector);
    spec.model = a.model.clone();
    spec.prefill_profile = a.prefill_profile.clone().or_else(|| a.profile.clone());
    spec.decode_profile = a.decode_profile.clone().or_else(|| a.profile.clone());
    if a.zero_delay {
        spec.latency = LatencyModel::default();
    }
    spec.time_scale = a.time_scale;
    spec.kv_cache_blocks = a.kv_cache_blocks;
    spec.kv_events = a.kv_events;
    Ok(spec)
}

fn run_fleet(args: &FleetArgs) -> Result<(), StartError> {
    let spec = fleet_spec(args)?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        rt.worker_threads(n.max(1));
    }
    let rt = rt.enable_all().build()?;
    rt.block_on(async move {
        let fleet = pdsim::fleet::start(&spec).await?;
        write_whole(&args.gateway_config, &fleet.gateway_toml())?;
        let ready = fleet.ready_json(&args.gateway_config.to_string_lossy());
        if let Some(path) = &args.ready_file {
            write_whole(path, &ready)?;
        }
        println!("{ready}");
        tracing::info!(
            prefill = spec.prefill,
            decode = spec.decode,
            connector = %spec.connector,
            "pdsim fleet serving"
        );
        shutdown_signal().await;
        fleet.shutdown().await;
        Ok(())
    })
}

fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> Result<(), StartError> {
    if std::env::args_os().nth(1).is_some_and(|a| a == "fleet") {
        let args = FleetArgs::parse_from(std::env::args_os().skip(1));
        init_tracing();
        return run_fleet(&args);
    }
    let args = Args::parse();
    init_tracing();
    let cfg = config(&args)?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        rt.worker_threads(n.max(1));
    }
    let rt = rt.enable_all().build()?;
    rt.block_on(async move {
        let handle = pdsim::spawn(cfg).await?;
        println!(
            "pdsim {} {} listening on {} (engine_id {}, side channel {:?}, bootstrap {:?})",
            handle.config().role,
            handle.config().connector,
            handle.base_url(),
            handle.engine_id(),
            handle.side_channel_port(),
            handle.bootstrap_port()
        );
        if let Some(ep) = handle.kv_events_endpoint() {
            println!("kv events published on {ep}");
        }
        if let Some(ep) = handle.kv_events_replay_endpoint() {
            println!("kv events replay on {ep}");
        }
        shutdown_signal().await;
        handle.shutdown().await;
        Ok(())
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
