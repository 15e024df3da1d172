//! The access log, off the request path: a finished request hands its [`AccessLine`] to a
//! bounded queue ([`AccessLog::send`], never waits) and the writer task ([`AccessWriter`])
//! formats and writes it (target `pdgate::access`). When the writer falls behind, lines are
//! dropped and counted in `pdgate_access_log_dropped_total`; nothing a request does waits on it.
//!
//! The writer drains the queue on a clock ([`DRAIN_EVERY`]), not when a line arrives: a request
//! that queues its line wakes nothing (a wake-up per line, a worker thread unparked to write
//! one line, was most of what the log cost per request; see docs/benchmarks.md).

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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

    /// Starts the writer task (once: `None` when it was started before). Call within the tokio
    /// runtime.
    pub(crate) fn start_writer(&self) -> Option<AccessWriter> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut clock = tokio::time::interval(DRAIN_EVERY);
            clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    () = stopped.cancelled() => break,
                    _ = clock.tick() => {
                        // `try_recv` never registers the task's waker, so senders wake nothing.
                        // The drain's lines leave in one write.
                        let _batch = crate::telemetry::Batch::open();
                        loop {
                            match rx.try_recv() {
                                Ok(line) => line.write(),
                                Err(mpsc::error::TryRecvError::Empty) => break,
                                Err(mpsc::error::TryRecvError::Disconnected) => return,
                            }
                        }
                    }
                }
            }
            // Graceful stop: what is queued is written, nothing more is taken.
            rx.close();
            let _batch = crate::telemetry::Batch::open();
            while let Ok(line) = rx.try_recv() {
                line.write();
            }
        });
        Some(AccessWriter { stop, task })
    }
}

/// The running writer task, owned by the running gateway: [`AccessWriter::finish`] writes what
/// is queued and ends it; dropping it ends it at once.
#[derive(Debug)]
pub(crate) struct AccessWriter {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl AccessWriter {
    /// Writes the queued lines (within `deadline`) and ends the task.
    pub(crate) async fn finish(mut self, deadline: Duration) {
        self.stop.cancel();
        if tokio::time::timeout(deadline, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("access log: queued lines not written within the shutdown deadline");
        }
    }
}

impl Drop for AccessWriter {
    fn drop(&mut self) {
        self.task.abort();
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
