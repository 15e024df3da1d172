//! `pdbench` binary: parse the command line, run on a multi-thread tokio runtime, print.

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use pdbench::cli::Cli;

/// jemalloc, as in pdgate: a benchmark engine (or load generator) that spends less CPU per request
/// leaves more of a shared core to what is being measured.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Lowest open-file limit that makes sense for `connections` sockets (plus stdio and slack).
fn warn_on_fd_limit(connections: usize) {
    let Ok(limits) = std::fs::read_to_string("/proc/self/limits") else {
        return;
    };
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(soft) = soft
        && soft < connections + 64
    {
        eprintln!(
            "pdbench: warning: open-file limit {soft} is below the ~{} sockets this run may need; raise it with `ulimit -n`",
            connections + 64
        );
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (mut cfg, args) = match cli.into_config() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("pdbench: {e}");
            return ExitCode::from(2);
        }
    };
    // A live line only for a person watching: not in logs, not with --json.
    cfg.progress = !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let sockets = match cfg.load {
        pdbench::Load::Closed { concurrency } => concurrency,
        pdbench::Load::Open { max_in_flight, .. } | pdbench::Load::Replay { max_in_flight, .. } => {
            max_in_flight
        }
    };
    let direct = matches!(cfg.target, pdbench::Target::Direct { .. });
    warn_on_fd_limit(if direct { sockets * 2 } else { sockets });

    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(n) = args.threads {
        builder.worker_threads(n.max(1));
    }
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdbench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let cancel = CancellationToken::new();
        let on_signal = cancel.clone();
        let watcher = tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                on_signal.cancel();
            }
        });
        let r = pdbench::run(&cfg, cancel).await;
        watcher.abort();
        r
    });
    match result {
        Ok(report) => {
            for w in &report.warnings {
                eprintln!("pdbench: warning: {w}");
            }
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("pdbench: cannot serialise the report: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{report}");
            }
            if report.ok == 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("pdbench: {e}");
            ExitCode::from(2)
        }
    }
}
