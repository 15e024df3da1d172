//! The access log, off the request path: a finished request hands its [`AccessLine`] to a
//! bounded queue ([`AccessLog::send`], never waits) and the writer thread ([`AccessWriter`])
//! formats and writes it (target `pdgate::access`). When the writer falls behind, lines are
//! dropped and counted in `pdgate_access_log_dropped_total`; nothing a request does waits on it.
//!
//! The writer drains the queue on a clock ([`DRAIN_EVERY`]), not when a line arrives: a request
//! that queues its line wakes nothing (a wake-up per line, a worker thread unparked to write
//! one line, was most of what the log cost per request; see docs/benchmarks.md).

use std::sync::Mutex;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::{mpsc, oneshot};

/// Lines waiting for the writer; more are dropped (and counted).
pub(crate) const ACCESS_LOG_QUEUE: usize = 8192;

/// How often the writer takes what is queued: a line is written at most this late, and the
/// queue holds [`ACCESS_LOG_QUEUE`] lines per period.
pub(crate) const DRAIN_EVERY: Duration = Duration::from_millis(50);

/// One finished request, as the access log writes it.
#[derive(Debug, Default)]
pub(crate) struct AccessLine {
    pub(crate) request_id: String,
    pub(crate) route: &'static str,
    pub(crate) status: u16,
    pub(crate) outcome: &'static str,
    pub(crate) model: String,
    pub(crate) connector: &'static str,
    /// The prefill engine the request touched last (the failing one, for an engine failure).
    pub(crate) prefill: String,
    /// The decode engine the request touched last (the failing one, for an engine failure).
    pub(crate) decode: String,
    pub(crate) fallback: bool,
    pub(crate) decode_only: bool,
    pub(crate) predicted_cached: Option<u32>,
    /// Seconds.
    pub(crate) total: f64,
    /// Seconds to the first relayed byte.
    pub(crate) ttft: Option<f64>,
}

impl AccessLine {
    fn write(&self) {
        let ms = |s: f64| (s * 1e6).round() / 1e3;
        tracing::info!(
            target: "pdgate::access",
            request_id = %self.request_id,
            route = self.route,
            status = self.status,
            outcome = self.outcome,
            model = %self.model,
            connector = %self.connector,
            prefill = %self.prefill,
            decode = %self.decode,
            fallback = self.fallback,
            decode_only = self.decode_only,
            predicted_cached_tokens = self.predicted_cached,
            total_ms = ms(self.total),
            ttft_ms = self.ttft.map(ms),
            "request"
        );
    }
}

/// The request path's side of the access log: the queue's sender and the drop counter.
#[derive(Debug)]
pub(crate) struct AccessLog {
    tx: mpsc::Sender<AccessLine>,
    /// Taken by the one writer ([`AccessLog::start_writer`]).
    rx: Mutex<Option<mpsc::Receiver<AccessLine>>>,
    dropped: Counter,
}

impl AccessLog {
    /// A queue of `capacity` lines; `dropped` counts the lines it could not take.
    pub(crate) fn new(capacity: usize, dropped: Counter) -> Self {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        AccessLog {
            tx,
            rx: Mutex::new(Some(rx)),
            dropped,
        }
    }

    /// Queues `line` for the writer, or drops and counts it when the queue is full (or no writer
    /// runs any more). Never waits.
    pub(crate) fn send(&self, line: AccessLine) {
        if self.tx.try_send(line).is_err() {
            self.dropped.inc();
        }
    }

    /// Starts the writer (once: `None` when it was started before, or when its thread cannot
    /// be started; lines are then dropped and counted). It runs on its own thread, not on the
    /// runtime: a stalled standard output (a full pipe, a slow log collector) blocks the writer
    /// only, never a runtime worker and the requests queued on it.
    pub(crate) fn start_writer(&self) -> Option<AccessWriter> {
        let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let (stop, stopped) = std_mpsc::channel::<()>();
        let (done_tx, done) = oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("pdgate-access-log".into())
            .spawn(move || {
                write_until_stopped(rx, &stopped);
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => Some(AccessWriter {
                stop: Some(stop),
                done: Some(done),
            }),
            Err(e) => {
                tracing::warn!("access log: no writer thread ({e}); lines are dropped");
                None
            }
        }
    }
}

/// The writer thread's loop: every [`DRAIN_EVERY`], the queued lines; on a stop (or its owner
/// gone), what is queued and nothing more.
fn write_until_stopped(mut rx: mpsc::Receiver<AccessLine>, stopped: &std_mpsc::Receiver<()>) {
    while let Err(std_mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(DRAIN_EVERY) {
        if !drain(&mut rx) {
            return;
        }
    }
    rx.close();
    drain(&mut rx);
}

/// Writes the queued lines, in one write; `false` once every sender is gone. `try_recv` never
/// registers a waker, so senders wake nothing.
fn drain(rx: &mut mpsc::Receiver<AccessLine>) -> bool {
    let _batch = crate::telemetry::Batch::open();
    loop {
        match rx.try_recv() {
            Ok(line) => line.write(),
            Err(mpsc::error::TryRecvError::Empty) => return true,
            Err(mpsc::error::TryRecvError::Disconnected) => return false,
        }
    }
}

/// The running writer, owned by the running gateway: [`AccessWriter::finish`] writes what is
/// queued and ends it; dropping it stops it after what is queued (its thread is not waited
/// for).
#[derive(Debug)]
pub(crate) struct AccessWriter {
    stop: Option<std_mpsc::Sender<()>>,
    done: Option<oneshot::Receiver<()>>,
}

impl AccessWriter {
    /// Writes the queued lines (within `deadline`) and ends the writer.
    pub(crate) async fn finish(mut self, deadline: Duration) {
        drop(self.stop.take());
        let Some(done) = self.done.take() else { return };
        if tokio::time::timeout(deadline, done).await.is_err() {
            tracing::warn!("access log: queued lines not written within the shutdown deadline");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_without_waiting() {
        let dropped = Counter::default();
        let log = AccessLog::new(2, dropped.clone());
        // No writer yet: the queue holds two lines, the third is dropped at once.
        for _ in 0..3 {
            log.send(AccessLine::default());
        }
        assert_eq!(dropped.get(), 1);
        let writer = log.start_writer().expect("first writer");
        assert!(log.start_writer().is_none(), "one writer only");
        // The writer empties the queue on a graceful stop; later lines are dropped.
        writer.finish(Duration::from_secs(5)).await;
        log.send(AccessLine::default());
        assert_eq!(dropped.get(), 2);
    }
}
