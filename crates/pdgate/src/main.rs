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
    #[cfg(feature = "demo")]
    /// Start simulated prefill/decode engines (several connectors, model `demo`) and a gateway in
    /// front of them, and print ready-to-paste examples.
    Demo {
        /// Address of the demo gateway.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
    },
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

async fn serve(args: RunArgs, config: Config) -> Result<(), pdgate::Error> {
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
    let gateway = Gateway::new(config, registry.clone())?;
    let mut running = RunningGateway::bind(gateway.clone()).await?;
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
            registry,
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
    // The configuration first: it says where spans go (`[telemetry]`). The demo exports none.
    let config = if cli.command.is_some() {
        None
    } else {
        match cli.run.load() {
            Ok(config) => Some(config),
            Err(e) => return fail(&pdgate::Error::from(e)),
        }
    };
    let telemetry_config = config
        .as_ref()
        .map_or_else(TelemetryConfig::default, |c| c.telemetry.clone());
    let telemetry = match pdgate::telemetry::init(cli.run.log_format, &telemetry_config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("pdgate: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        #[cfg(feature = "demo")]
        Some(Command::Demo { listen }) => pdgate::demo::run(listen, shutdown_signal()).await,
        None => match config {
            Some(config) => serve(cli.run, config).await,
            None => Ok(()), // not reached: without a command the configuration was loaded above
        },
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
