//! The static source: the config file, watched. Its endpoint set is republished whenever the
//! file changes and validates; a reload that changes other keys logs which ones it cannot apply
//! to a running gateway.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::RunArgs;
use crate::metrics::Reloaded;
use crate::state::{Gateway, PodSet};

/// Keys a reload applies to the running gateway: the endpoint set.
const LIVE_KEYS: [&str; 2] = ["prefill", "decode"];

/// How long the config file must stay unchanged before it is read.
const SETTLE: Duration = Duration::from_millis(100);

/// Polls the config file and publishes its endpoint set whenever it changes and validates.
/// A bad edit is logged, counted (`pdgate_reloads_total{file="config",result="rejected"}`) and
/// ignored: the last good set keeps serving. Validates with `gateway`'s registry. Ends on `cancel`.
pub async fn watch_config_file(
    args: RunArgs,
    gateway: Arc<Gateway>,
    tx: watch::Sender<PodSet>,
    cancel: CancellationToken,
    interval: Duration,
) {
    let Some(path) = args.config.clone() else {
        return;
    };
    let mut last = crate::watch::stamp(&path);
    // What the gateway runs with; a reload applies its endpoint set only.
    let mut running = args.load().ok();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let now = crate::watch::stamp(&path);
        if now == last {
            continue;
        }
        // Editors and `echo >` write in several steps: read the file only once it has held
        // still for a moment, so a half-written file is never taken for the new endpoint set.
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(SETTLE) => {}
        }
        if crate::watch::stamp(&path) != now {
            continue;
        }
        last = now;
        let loaded = args
            .load()
            .and_then(|c| c.validate(&gateway.registry).map(|_| c))
            .and_then(|c| c.pods().map(|pods| (c, pods)));
        match loaded {
            Ok((config, pods)) => {
                if let Some(before) = &running {
                    let fixed: Vec<String> = before
                        .changed_keys(&config)
                        .into_iter()
                        .filter(|k| !LIVE_KEYS.contains(&k.as_str()))
                        .collect();
                    if !fixed.is_empty() {
                        warn!(file = %path.display(), keys = ?fixed, "config reload: these keys changed but take effect only at restart");
                    }
                }
                running = Some(config);
                gateway.metrics.count_reload(Reloaded::Config, true);
                let changed = tx.send_if_modified(|current| {
                    if current.as_slice() == pods.as_slice() {
                        false
                    } else {
                        *current = Arc::new(pods);
                        true
                    }
                });
                if changed {
                    info!(file = %path.display(), "config reloaded: endpoint set changed");
                }
            }
            Err(e) => {
                warn!(file = %path.display(), error = %e, "config reload rejected; keeping the last good endpoint set");
                gateway.metrics.count_reload(Reloaded::Config, false);
            }
        }
    }
}
