//! Files re-read when they change (API key files, TLS certificates).
//!
//! Polled, not notified: a modification time and size per file, checked every interval. That
//! works the same on every filesystem, including the symlink swaps of Kubernetes secret
//! volumes, where inotify watches see nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

/// A file's modification time and size: what "changed" means for every watched file.
pub(crate) fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Calls `reload` whenever any of `files` changes (modification time or size, checked every
/// `interval`), until `shutdown`. `reload` returns whether it took the new contents; when it
/// did not (a file half-written, unreadable), the next check tries again.
pub(crate) async fn on_change(
    files: &[PathBuf],
    interval: Duration,
    shutdown: CancellationToken,
    mut reload: impl FnMut() -> bool,
) {
    let stamps = || files.iter().map(|f| stamp(f)).collect::<Vec<_>>();
    let mut last = stamps();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let now = stamps();
        if now != last && reload() {
            last = now;
        }
    }
}
