//! The `pdgate` binary: serve the gateway, or run the demo.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use pdgate::config::DiscoveryKind;
use pdgate::{Config, Gateway, RunArgs, RunningGateway, TelemetryConfig};
use tracing::{error, info};

/// jemalloc: glibc malloc/free took a large share of the gateway's user-space instructions per
/// request, and jemalloc cuts it; mimalloc saved as much but held more memory with thousands of
/// open streams (the figures: docs/benchmarks.md).
/// Feature `system-allocator` keeps glibc's, which heap profilers (valgrind massif) can see into.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// OpenAI-compatible prefill/decode disaggregation gateway.
///
/// Every request is split into a prefill leg and a decode leg, shaped for the KV-transfer
/// connector of the chosen prefill endpoint (label `model.aibrix.ai/kv-connector-type`, else
/// `--kv-connector`). Try `pdgate demo` first.
#[derive(Debug, Parser)]
#[command(name = "pdgate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prove that each prefill/decode pair of a running deployment really moves KV.
    ///
    /// Sends a canary through each pair (every pair with --all-pairs, otherwise a sample in
    /// which every endpoint appears), with the same configuration or discovery as the gateway,
    /// and reports per pair whether the decode received the KV or recomputed the prompt (from
    /// the engine's own counters), the time per leg, and whether the answer equals the decode's
    /// answer to the prompt alone. Exits 1 when a pair fails, 2 on a configuration error.
    Check {
        #[command(flatten)]
        run: Box<RunArgs>,
        #[command(flatten)]
        check: CheckArgs,
    },
    /// Serve as Envoy's external processor (ext_proc, gRPC) instead of as a proxy.
    ///
    /// Envoy (Envoy Gateway's EnvoyExtensionPolicy, or a Gateway API Inference Extension
    /// InferencePool naming pdgate as its endpoint picker) sends each request's headers and
    /// buffered body here; pdgate chooses the pair as the proxy does, runs the prefill leg, and
    /// answers with the decode's body and its destination (`target-pod`,
    /// `x-gateway-destination-endpoint` and the `envoy.lb` metadata). The configuration, flags and
    /// discovery are the proxy's; `--listen` serves the gRPC service and, over HTTP/1.1,
    /// `/metrics`, `/health` and `/ready`.
    ExtProc {
        #[command(flatten)]
        run: Box<RunArgs>,
        #[command(flatten)]
        ext_proc: ExtProcArgs,
    },
    #[cfg(feature = "demo")]
    /// Start simulated prefill/decode engines (several connectors, model `demo`) and a gateway in
    /// front of them, and print ready-to-paste examples.
    Demo {
        /// Address of the demo gateway.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
    },
}

/// Who runs the prefill under `pdgate ext-proc`.
#[derive(Debug, clap::Args)]
struct ExtProcArgs {
    /// llm-d's sidecar form: name the prefill in `x-prefiller-host-port` and leave the prefill
    /// call to the sidecar on the decode pod.
    #[arg(long)]
    prefill_by_sidecar: bool,
}

/// How `pdgate check` samples pairs and what it sends.
#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// Check every prefill/decode pair (default: a sample in which every endpoint appears).
    #[arg(long)]
    all_pairs: bool,
    /// At most this many pairs.
    #[arg(long, default_value_t = 64)]
    max_pairs: usize,
    /// Words in each canary prompt (a few tokens each: keep it under the engines' context).
    #[arg(long, default_value_t = 48)]
    prompt_words: usize,
    /// Tokens each canary generates.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Bound on each step (the pair ready, each request, the counters settling).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Fail a pair whose decode exposes no counter of received KV (default: report "unknown").
    #[arg(long)]
    require_evidence: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// `pdgate check`: the deployment's pods, from its configuration or its discovery, checked pair
/// by pair.
async fn check(args: Box<RunArgs>, opts: CheckArgs) -> ExitCode {
    let config = match args.load() {
        Ok(config) => config,
        Err(e) => return fail(&pdgate::Error::from(e)),
    };
    let pods = match deployment_pods(&config).await {
        Ok(pods) => pods,
        Err(e) => return fail(&e),
    };
    let options = pdgate::check::CheckOptions {
        all_pairs: opts.all_pairs,
        max_pairs: opts.max_pairs,
        prompt_words: opts.prompt_words,
        max_tokens: opts.max_tokens,
        timeout: opts.timeout,
        require_evidence: opts.require_evidence,
    };
    let registry = kvtransfer::Registry::with_builtins();
    let report = match pdgate::check::run(config, registry, pods, &options).await {
        Ok(report) => report,
        Err(e) => return fail(&e),
    };
    if opts.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(e) => eprintln!("pdgate: {e}"),
        }
    } else {
        print!("{}", report.render());
    }
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The endpoints the gateway would route to: the configured ones, or the first complete list
/// from Kubernetes (bounded).
async fn deployment_pods(config: &Config) -> Result<Vec<kvtransfer::Pod>, pdgate::Error> {
    if config.discovery.kind != DiscoveryKind::Kubernetes {
        return Ok(config.pods()?);
    }
    let field = |message: String| pdgate::ConfigError::Field {
        field: "discovery".into(),
        message,
    };
    let client = pdkube::client_from_env()
        .await
        .map_err(|e| field(e.to_string()))?;
    let (tx, mut rx) = tokio::sync::watch::channel(std::sync::Arc::new(Vec::new()));
    let cancel = tokio_util::sync::CancellationToken::new();
    let discovery = tokio::spawn(pdkube::run(
        client,
        config.kubernetes.clone(),
        tx,
        cancel.clone(),
    ));
    let first = tokio::time::timeout(Duration::from_secs(30), rx.changed()).await;
    cancel.cancel();
    let _ = discovery.await;
    match first {
        Ok(Ok(())) => Ok(rx.borrow().as_ref().clone()),
        _ => Err(field("no pod list from the Kubernetes API server within 30s".into()).into()),
    }
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

/// How `serve` serves: as the proxy, or as Envoy's external processor.
enum Mode {
    Proxy,
    ExtProc(pdgate::ExtProcOptions),
}

async fn serve(args: RunArgs, config: Config, mode: Mode) -> Result<(), pdgate::Error> {
    let registry = kvtransfer::Registry::with_builtins();
    let kube_client = if config.discovery.kind == DiscoveryKind::Kubernetes {
        let client = pdkube::client_from_env()
            .await
            .map_err(|e| pdgate::ConfigError::Field {
                field: "discovery".into(),
                message: e.to_string(),
            })?;
        Some(client)
    } else {
        None
    };
    let gateway = Gateway::new(config, registry)?;
    let mut running = match mode {
        Mode::Proxy => RunningGateway::bind(gateway.clone()).await?,
        Mode::ExtProc(options) => RunningGateway::bind_ext_proc(gateway.clone(), options).await?,
    };
    info!(
        listen = %running.addr(),
        prefill = gateway.config.prefill.len(),
        decode = gateway.config.decode.len(),
        connector = %gateway.default_connector,
        "pdgate serving"
    );
    if let Some(client) = kube_client {
        let discovery = pdkube::run(
            client,
            gateway.config.kubernetes.clone(),
            running.pods().clone(),
            running.cancel_token(),
        );
        running.spawn_owned(async move {
            if let Err(e) = discovery.await {
                error!(error = %e, "kubernetes discovery stopped");
            }
        });
    } else if args.config.is_some() {
        let tx = running.pods().clone();
        let cancel = running.cancel_token();
        running.spawn_owned(pdgate::watch_config_file(
            args.clone(),
            gateway.clone(),
            tx,
            cancel,
            Duration::from_secs(1),
        ));
    }
    let deadline = gateway.config.shutdown.shutdown_timeout;
    running.run_until(shutdown_signal(), deadline).await;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let command = match cli.command {
        Some(Command::Check { run, check: opts }) => {
            // The report owns stdout; logs go to stderr, warnings only unless RUST_LOG says more.
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .init();
            return check(run, opts).await;
        }
        other => other,
    };
    #[cfg(feature = "demo")]
    let demo = match &command {
        Some(Command::Demo { listen }) => Some(*listen),
        _ => None,
    };
    // The configuration first: it says where spans go (`[telemetry]`). The demo exports none.
    let (run, mode) = match command {
        None => (Some(cli.run), Some(Mode::Proxy)),
        Some(Command::ExtProc { run, ext_proc }) => {
            let options = pdgate::ExtProcOptions {
                prefill_by_sidecar: ext_proc.prefill_by_sidecar,
            };
            (Some(*run), Some(Mode::ExtProc(options)))
        }
        #[cfg(feature = "demo")]
        Some(Command::Demo { .. }) => (None, None),
        Some(Command::Check { .. }) => (None, None),
    };
    let config = match &run {
        None => None,
        Some(run) => match run.load() {
            Ok(config) => Some(config),
            Err(e) => return fail(&pdgate::Error::from(e)),
        },
    };
    let telemetry_config = config
        .as_ref()
        .map_or_else(TelemetryConfig::default, |c| c.telemetry.clone());
    let log_format = run
        .as_ref()
        .map_or_else(pdgate::LogFormat::default, |r| r.log_format);
    let telemetry = match pdgate::telemetry::init(log_format, &telemetry_config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("pdgate: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match (run, config, mode) {
        (Some(run), Some(config), Some(mode)) => serve(run, config, mode).await,
        #[cfg(feature = "demo")]
        _ => match demo {
            Some(listen) => pdgate::demo::run(listen, shutdown_signal()).await,
            None => Ok(()), // `check` answered above
        },
        #[cfg(not(feature = "demo"))]
        _ => Ok(()), // `check` answered above
    };
    telemetry
        .shutdown(telemetry_config.otlp_export_timeout)
        .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn fail(e: &pdgate::Error) -> ExitCode {
    error!("{e}");
    eprintln!("pdgate: {e}");
    ExitCode::from(2)
}
