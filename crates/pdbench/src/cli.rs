//! Command line: `pdbench --url URL [load options]` and
//! `pdbench direct --prefill URL --decode URL [--connector shfs] [load options]`.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::BenchError;
use crate::dist::Dist;
use crate::metrics::EngineRole;
use crate::runner::{Config, Load, Slo, Target};
use crate::trace::{Order, TraceSpec, WorkloadKind};
use crate::workload::{Api, DirectConnector};

/// Load generator for OpenAI-compatible endpoints and prefill/decode (PD) gateways.
///
/// Closed loop (`--concurrency N`) or open loop (`--rate R`), bounded by `--requests` and/or
/// `--duration` (default: 1000 requests). Reports end-to-end latency, time to first token and
/// inter-token gaps (streams), throughput and errors by class, as a table or `--json`.
///
/// Cache-sensitive workloads (`--workload shared-prefix|multi-turn|random`) also report the
/// cached-token share from `usage.prompt_tokens_details.cached_tokens` and the trace's ORACLE
/// hit share: over the prompts as sent, in pdsim's word-token model (BOS, one token per word,
/// one per chat role marker), a request can reuse B x the longest run of its leading full
/// blocks of B tokens (at most floor((n-1)/B) blocks, like vLLM) already in an earlier prompt,
/// with an infinite cache; with `--oracle-engines E --oracle-cache-blocks C`, also with groups
/// pinned to E engines (greedy static assignment, largest working set first) each an LRU of C
/// blocks. Generated tokens are not counted as reusable.
///
/// Production traces (`--trace-file FILE`, the Mooncake format: JSON lines of `timestamp` ms,
/// `input_length`, `output_length`, `hash_ids` of 512-token blocks; gzipped or not) are
/// replayed open loop at their recorded times divided by `--rate-factor` and `--time-scale`;
/// each prompt is built from its hash ids (equal ids, equal text) and cut to `input_length`
/// tokens, `max_tokens` = `output_length` with `ignore_eos`. The report adds SLO attainment and
/// goodput (`--slo-ttft`, `--slo-itl`), the engines' prefill hit share next to the trace's
/// oracle, and each role's busy share (max/mean work per engine) with `--fleet`.
#[derive(Debug, Parser)]
#[command(name = "pdbench", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// Mode; without one, load the OpenAI endpoint at `--url`.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Base URL of the endpoint to load (a gateway or an engine), e.g. http://127.0.0.1:8000.
    /// Several (comma-separated or repeated): replicas of one gateway, request i to replica
    /// i mod n, as a client alternating between them would.
    #[arg(long, env = "PDBENCH_URL", value_delimiter = ',')]
    pub url: Vec<String>,
    /// Load options.
    #[command(flatten)]
    pub load: LoadArgs,
}

/// Modes other than loading one URL.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Perform the PD two-leg flow directly against a prefill and a decode engine: the
    /// baseline a gateway is measured against (prefill with max_tokens=1, stream=false and
    /// kv_transfer_params {do_remote_decode:true}, then decode with the returned params and
    /// remote_host set to the prefill's host).
    Direct {
        /// Prefill engine base URL.
        #[arg(long)]
        prefill: String,
        /// Decode engine base URL.
        #[arg(long)]
        decode: String,
        /// KV-transfer connector shaping the two legs.
        #[arg(long, value_enum, default_value_t = DirectConnector::Shfs)]
        connector: DirectConnector,
        /// Load options.
        #[command(flatten)]
        load: LoadArgs,
    },
}

/// Options shared by every mode.
#[derive(Debug, Args, Clone)]
pub struct LoadArgs {
    /// API to call.
    #[arg(long, value_enum, default_value_t = Api::Completions)]
    pub api: Api,
    /// Stream responses (SSE) and measure TTFT and inter-token gaps.
    #[arg(long)]
    pub stream: bool,
    /// Closed loop: number of clients, each sending its next request when the last ends.
    #[arg(long, short = 'c', conflicts_with = "rate")]
    pub concurrency: Option<usize>,
    /// Open loop: requests started per second, whatever the latency.
    #[arg(long, short = 'r')]
    pub rate: Option<f64>,
    /// Open loop: most requests open at once; requests due beyond it count as `overflow`.
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,
    /// Stop after N measured requests (default 1000 when --duration is not given).
    #[arg(long, short = 'n')]
    pub requests: Option<u64>,
    /// Stop issuing requests after S seconds (in-flight ones finish or time out).
    #[arg(long, short = 'd')]
    pub duration: Option<f64>,
    /// Prompt length in words: N, A..B (uniform) or normal:MEAN,STDDEV.
    #[arg(long, default_value = "128")]
    pub prompt_len: Dist,
    /// Output length (max_tokens): N, A..B (uniform) or normal:MEAN,STDDEV.
    #[arg(long, default_value = "16")]
    pub output_len: Dist,
    /// `model` field of each request (default: the first model the target's `/v1/models`
    /// lists; `pdsim` with a warning if it cannot be asked).
    #[arg(long)]
    pub model: Option<String>,
    /// Workload: `synthetic` (`r<id>` + `x` words of --prompt-len), `shared-prefix` (G groups
    /// x P prompts: S-word system prompt + Q-word question), `multi-turn` (N sessions x T
    /// turns on chat, each turn the whole history plus a Q-word user message, sent after the
    /// previous turn answered), `random` (unique prompts of S+Q words, the control). The
    /// trace bounds the run (--requests/--duration cut it short).
    #[arg(long, value_enum, default_value_t = WorkloadKind::Synthetic)]
    pub workload: WorkloadKind,
    /// shared-prefix: number of groups (G).
    #[arg(long, default_value_t = 16)]
    pub groups: usize,
    /// shared-prefix: prompts per group (P).
    #[arg(long, default_value_t = 8)]
    pub prompts_per_group: usize,
    /// multi-turn: sessions (N).
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    /// multi-turn: turns per session (T).
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// System prompt length in words (S; multi-turn: per session, 0 = none).
    #[arg(long, default_value_t = 1024)]
    pub system_len: u32,
    /// Question / user message length in words (Q).
    #[arg(long, default_value_t = 64)]
    pub question_len: u32,
    /// Send order of groups / session turns.
    #[arg(long, value_enum, default_value_t = Order::Interleaved)]
    pub order: Order,
    /// Oracle: block size in tokens (match the engines' --block-size).
    #[arg(long, default_value_t = 16)]
    pub oracle_block_size: usize,
    /// Capacity-limited oracle: engines (needs --oracle-cache-blocks).
    #[arg(long, requires = "oracle_cache_blocks")]
    pub oracle_engines: Option<usize>,
    /// Capacity-limited oracle: KV-cache blocks per engine.
    #[arg(long)]
    pub oracle_cache_blocks: Option<usize>,
    /// Engine base URL whose `/metrics` is read before and after the run (repeatable):
    /// prefix-cache hits/queries and prefill tokens computed.
    #[arg(long = "engine-metrics")]
    pub engine_metrics: Vec<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Unmeasured requests sent before the measured phase (opens connections).
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Closed loop: start the clients evenly spread over S seconds (part of the measured phase).
    #[arg(long, default_value_t = 0.0)]
    pub ramp: f64,
    /// Replay this trace file (Mooncake JSONL, gzipped or not) open loop at its recorded times;
    /// the trace bounds the run (--requests/--duration cut it short).
    #[arg(long, conflicts_with_all = ["concurrency", "rate"])]
    pub trace_file: Option<std::path::PathBuf>,
    /// Replay: send F times as fast as recorded.
    #[arg(long, default_value_t = 1.0, requires = "trace_file")]
    pub rate_factor: f64,
    /// Simulated seconds per wall second of the engines (pdsim --time-scale): replay send
    /// times are divided by F and every latency, duration and rate is reported in simulated
    /// time (wall x F).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// SLO on time to first token, milliseconds (needs --stream).
    #[arg(long)]
    pub slo_ttft: Option<f64>,
    /// SLO on each request's mean gap between tokens, milliseconds (needs --stream).
    #[arg(long)]
    pub slo_itl: Option<f64>,
    /// A fleet's ready file (`pdsim fleet --ready-file`: {"prefill":[url...],"decode":[url...]}):
    /// reads every engine's /metrics with its role, for the prefill hit share and each role's
    /// busy share; the capacity-limited oracle's engines default to the prefill count.
    #[arg(long)]
    pub fleet: Option<std::path::PathBuf>,
    /// Seed for the length distributions and the trace text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Tokio worker threads (default: the CPUs this process may run on).
    #[arg(long)]
    pub threads: Option<usize>,
}

fn seconds(name: &str, v: f64) -> Result<Duration, BenchError> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| BenchError::Config(format!("{name} must be a positive number of seconds")))
}

/// The engines of a fleet's ready file.
#[derive(Debug, serde::Deserialize)]
struct FleetFile {
    #[serde(default)]
    prefill: Vec<String>,
    #[serde(default)]
    decode: Vec<String>,
    /// KV-cache blocks of each prefill (pdsim's fleet writes it): the capacity-bounded
    /// oracle's cache when `--oracle-cache-blocks` is not given.
    #[serde(default)]
    prefill_kv_cache_blocks: Option<usize>,
}

fn millis(name: &str, v: Option<f64>) -> Result<Option<Duration>, BenchError> {
    v.map(|ms| {
        Duration::try_from_secs_f64(ms / 1000.0)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                BenchError::Config(format!("{name} must be a positive number of milliseconds"))
            })
    })
    .transpose()
}

impl LoadArgs {
    /// The run configuration for `target`.
    pub fn to_config(&self, target: Target) -> Result<Config, BenchError> {
        let replay = self
            .trace_file
            .as_deref()
            .map(crate::mooncake::Trace::load)
            .transpose()?
            .map(std::sync::Arc::new);
        let load = match (self.concurrency, self.rate) {
            _ if replay.is_some() => Load::Replay {
                rate_factor: self.rate_factor,
                max_in_flight: self.max_in_flight,
            },
            (_, Some(rate)) => Load::Open {
                rate,
                max_in_flight: self.max_in_flight,
            },
            (c, None) => Load::Closed {
                concurrency: c.unwrap_or(1),
            },
        };
        let duration = self
            .duration
            .map(|d| seconds("--duration", d))
            .transpose()?;
        let trace = self.workload != WorkloadKind::Synthetic || replay.is_some();
        let mut engine_metrics = self.engine_metrics.clone();
        let mut engine_roles = vec![None; engine_metrics.len()];
        let mut fleet_prefills = None;
        let mut fleet_blocks = None;
        if let Some(path) = &self.fleet {
            let bad = |why: String| BenchError::Config(format!("fleet {}: {why}", path.display()));
            let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
            let f: FleetFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            fleet_prefills = Some(f.prefill.len());
            fleet_blocks = f.prefill_kv_cache_blocks;
            engine_roles.extend(f.prefill.iter().map(|_| Some(EngineRole::Prefill)));
            engine_roles.extend(f.decode.iter().map(|_| Some(EngineRole::Decode)));
            engine_metrics.extend(f.prefill);
            engine_metrics.extend(f.decode);
        }
        let requests = match (self.requests, duration) {
            (None, None) if !trace => Some(1000),
            (r, _) => r,
        };
        if self.oracle_block_size == 0 {
            return Err(BenchError::Config(
                "--oracle-block-size must be at least 1".into(),
            ));
        }
        Ok(Config {
            target,
            api: self.api,
            stream: self.stream,
            model: self.model.clone(),
            trace: TraceSpec {
                kind: self.workload,
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                sessions: self.sessions,
                turns: self.turns,
                system_len: self.system_len,
                question_len: self.question_len,
                random_count: self.requests.and_then(|n| usize::try_from(n).ok()),
                order: self.order,
                seed: self.seed,
            },
            oracle_block_size: self.oracle_block_size,
            oracle_limit: self.oracle_cache_blocks.or(fleet_blocks).map(|c| {
                (
                    self.oracle_engines.or(fleet_prefills).unwrap_or(1).max(1),
                    c,
                )
            }),
            engine_metrics,
            engine_roles,
            replay,
            time_scale: self.time_scale,
            slo: Slo {
                ttft: millis("--slo-ttft", self.slo_ttft)?,
                itl: millis("--slo-itl", self.slo_itl)?,
            },
            progress: false,
            load,
            requests,
            duration,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            timeout: seconds("--timeout", self.timeout)?,
            seed: self.seed,
            warmup: self.warmup,
            ramp: if self.ramp == 0.0 {
                Duration::ZERO
            } else {
                seconds("--ramp", self.ramp)?
            },
        })
    }
}

impl Cli {
    /// The run configuration and the shared options (for output and runtime settings).
    pub fn into_config(self) -> Result<(Config, LoadArgs), BenchError> {
        match self.command {
            Some(Command::Direct {
                prefill,
                decode,
                connector,
                load,
            }) => {
                let cfg = load.to_config(Target::Direct {
                    prefill,
                    decode,
                    connector,
                })?;
                Ok((cfg, load))
            }
            None => {
                let target = match <[String; 1]>::try_from(self.url) {
                    Ok([url]) => Target::Url(url),
                    Err(urls) if urls.is_empty() => {
                        return Err(BenchError::Config(
                            "give --url URL, or use `pdbench direct`".into(),
                        ));
                    }
                    Err(urls) => Target::Replicas(urls),
                };
                let cfg = self.load.to_config(target)?;
                Ok((cfg, self.load))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<(Config, LoadArgs), BenchError> {
        Cli::try_parse_from(args)
            .map_err(|e| BenchError::Config(e.to_string()))?
            .into_config()
    }

    #[test]
    fn defaults_are_bounded_closed_loop() {
        let (cfg, args) = parse(&["pdbench", "--url", "http://127.0.0.1:1"]).expect("ok");
        assert_eq!(cfg.load, Load::Closed { concurrency: 1 });
        assert_eq!(cfg.requests, Some(1000));
        assert!(cfg.duration.is_none());
        assert!(!args.json);
    }

    #[test]
    fn open_loop_with_duration_only() {
        let (cfg, _) = parse(&[
            "pdbench",
            "--url",
            "http://h:1",
            "--rate",
            "50",
            "--duration",
            "2",
            "--stream",
            "--api",
            "chat",
            "--prompt-len",
            "10..20",
            "--output-len",
            "normal:64,8",
        ])
        .expect("ok");
        assert!(matches!(cfg.load, Load::Open { rate, .. } if rate == 50.0));
        assert_eq!(cfg.requests, None);
        assert_eq!(cfg.duration, Some(Duration::from_secs(2)));
        assert!(cfg.stream);
        assert_eq!(cfg.api, Api::Chat);
        assert_eq!(cfg.prompt_len, Dist::Uniform { lo: 10, hi: 20 });
    }

    #[test]
    fn direct_subcommand() {
        let (cfg, _) = parse(&[
            "pdbench",
            "direct",
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:2",
            "--concurrency",
            "8",
            "-n",
            "5",
        ])
        .expect("ok");
        assert!(matches!(
            cfg.target,
            Target::Direct {
                connector: DirectConnector::Shfs,
                ..
            }
        ));
        assert_eq!(cfg.load, Load::Closed { concurrency: 8 });
        assert_eq!(cfg.requests, Some(5));
    }

    #[test]
    fn trace_workloads_are_bounded_by_the_trace() {
        let (cfg, _) = parse(&[
            "pdbench",
            "--url",
            "http://h:1",
            "--workload",
            "shared-prefix",
            "--groups",
            "3",
            "--oracle-engines",
            "2",
            "--oracle-cache-blocks",
            "100",
            "--engine-metrics",
            "http://e:1",
            "--engine-metrics",
            "http://e:2",
        ])
        .expect("ok");
        assert_eq!(cfg.requests, None, "the trace is the bound");
        assert_eq!(cfg.trace.groups, 3);
        assert_eq!(cfg.oracle_limit, Some((2, 100)));
        assert_eq!(cfg.engine_metrics.len(), 2);
        assert!(cfg.model.is_none(), "asked from the target");
        assert!(parse(&["pdbench", "--url", "u", "--oracle-engines", "2"]).is_err());
    }

    #[test]
    fn trace_file_replay_with_fleet_roles() {
        let dir = std::env::temp_dir().join(format!("pdbench-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let trace = dir.join("t.jsonl");
        std::fs::write(
            &trace,
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":3,\"hash_ids\":[1,2]}\n",
        )
        .expect("write");
        let fleet = dir.join("fleet.json");
        std::fs::write(
            &fleet,
            r#"{"prefill":["http://p:1","http://p:2"],"decode":["http://d:1"],"gateway_config":"x"}"#,
        )
        .expect("write");
        let t = trace.to_str().expect("utf-8");
        let fl = fleet.to_str().expect("utf-8");
        let (cfg, _) = parse(&[
            "pdbench",
            "--url",
            "http://g:1",
            "--trace-file",
            t,
            "--rate-factor",
            "2",
            "--time-scale",
            "10",
            "--stream",
            "--slo-ttft",
            "500",
            "--slo-itl",
            "50",
            "--fleet",
            fl,
            "--oracle-cache-blocks",
            "1000",
        ])
        .expect("ok");
        assert_eq!(
            cfg.load,
            Load::Replay {
                rate_factor: 2.0,
                max_in_flight: 10_000
            }
        );
        assert_eq!(cfg.requests, None, "the trace is the bound");
        assert_eq!(cfg.replay.as_ref().expect("trace").requests.len(), 1);
        assert_eq!(cfg.time_scale, 10.0);
        assert_eq!(cfg.slo.ttft, Some(Duration::from_millis(500)));
        assert_eq!(cfg.slo.itl, Some(Duration::from_millis(50)));
        assert_eq!(cfg.engine_metrics.len(), 3);
        assert_eq!(
            cfg.engine_roles,
            [
                Some(EngineRole::Prefill),
                Some(EngineRole::Prefill),
                Some(EngineRole::Decode)
            ]
        );
        assert_eq!(cfg.oracle_limit, Some((2, 1000)), "engines: the prefills");
        // Without --oracle-cache-blocks, the fleet's own capacity bounds the oracle.
        std::fs::write(
            &fleet,
            r#"{"prefill":["http://p:1","http://p:2"],"decode":[],"prefill_kv_cache_blocks":64}"#,
        )
        .expect("write");
        let (cfg, _) =
            parse(&["pdbench", "--url", "u", "--trace-file", t, "--fleet", fl]).expect("ok");
        assert_eq!(cfg.oracle_limit, Some((2, 64)), "the fleet's blocks");
        assert!(parse(&["pdbench", "--url", "u", "--trace-file", t, "--rate", "3"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--rate-factor", "3"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--trace-file", "/nonexistent/x"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--slo-ttft", "-5"]).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn bad_combinations_are_refused() {
        assert!(parse(&["pdbench"]).is_err(), "no url");
        let (cfg, _) = parse(&["pdbench", "--url", "http://a:1,http://b:2"]).expect("replicas");
        assert!(
            matches!(&cfg.target, Target::Replicas(u) if u == &["http://a:1", "http://b:2"]),
            "{:?}",
            cfg.target
        );
        let (cfg, _) = parse(&["pdbench", "--url", "http://a:1"]).expect("one");
        assert!(matches!(&cfg.target, Target::Url(u) if u == "http://a:1"));
        assert!(parse(&["pdbench", "--url", "u", "-c", "2", "--rate", "3"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--duration", "0"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--timeout", "-1"]).is_err());
        assert!(parse(&["pdbench", "--url", "u", "--prompt-len", "0"]).is_err());
    }
}
