//! The span queue: finished spans go from the request path into a bounded channel without ever
//! waiting (a full queue drops the span and counts it), and one task exports them in batches.

use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{TelemetryConfig, count_dropped};

/// Spans sent in one export call at most.
const MAX_BATCH: usize = 512;
/// How long a batch waits to fill after its first span.
const BATCH_DELAY: Duration = Duration::from_millis(500);

/// The processor the tracer provider calls as spans end: a non-blocking `try_send`.
#[derive(Debug)]
pub(super) struct QueueProcessor {
    tx: mpsc::Sender<SpanData>,
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        match self.tx.try_send(span) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => count_dropped("queue_full", 1),
            // The export task has ended (shutdown): the span has nowhere to go.
            Err(TrySendError::Closed(_)) => count_dropped("export_failed", 1),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The export task, owned by [`super::Telemetry`].
#[derive(Debug)]
pub(super) struct ExportTask {
    handle: JoinHandle<()>,
    stop: CancellationToken,
}

impl ExportTask {
    /// Exports what is queued (bounded by `deadline`), then ends the task.
    pub(super) async fn shutdown(self, deadline: Duration) {
        self.stop.cancel();
        let mut handle = self.handle;
        if tokio::time::timeout(deadline, &mut handle).await.is_err() {
            warn!(
                ?deadline,
                "span export did not finish in time; the rest is dropped"
            );
            handle.abort();
        }
    }
}

/// The queue's processor and its export task (spawned on the current runtime).
pub(super) fn start<E: SpanExporter + 'static>(
    exporter: E,
    config: &TelemetryConfig,
) -> (QueueProcessor, ExportTask) {
    let (tx, rx) = mpsc::channel(config.otlp_queue_size);
    let stop = CancellationToken::new();
    let handle = tokio::spawn(run(rx, exporter, config.otlp_export_timeout, stop.clone()));
    (QueueProcessor { tx }, ExportTask { handle, stop })
}

/// Exports batches until `stop`, then what is left in the queue, each call within `limit`.
async fn run<E: SpanExporter>(
    mut rx: mpsc::Receiver<SpanData>,
    exporter: E,
    limit: Duration,
    stop: CancellationToken,
) {
    let mut failures = 0u64;
    loop {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let stopping = tokio::select! {
            biased;
            () = stop.cancelled() => true,
            n = rx.recv_many(&mut batch, MAX_BATCH) => n == 0,
        };
        if !stopping && batch.len() < MAX_BATCH {
            // Let the batch fill a little (or the stop come) before sending it.
            let fill = async {
                loop {
                    let room = MAX_BATCH - batch.len();
                    if room == 0 || rx.recv_many(&mut batch, room).await == 0 {
                        break;
                    }
                }
            };
            tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = fill => {}
                () = tokio::time::sleep(BATCH_DELAY) => {}
            }
        }
        if stop.is_cancelled() {
            rx.close();
            while let Ok(span) = rx.try_recv() {
                batch.push(span);
                if batch.len() == MAX_BATCH {
                    send(&exporter, std::mem::take(&mut batch), limit, &mut failures).await;
                }
            }
            send(&exporter, batch, limit, &mut failures).await;
            let _ = exporter.shutdown_with_timeout(limit);
            return;
        }
        send(&exporter, batch, limit, &mut failures).await;
    }
}

/// One export call; a failure drops the batch (counted, logged on the 1st, 100th, ... failure).
async fn send<E: SpanExporter>(
    exporter: &E,
    batch: Vec<SpanData>,
    limit: Duration,
    failures: &mut u64,
) {
    if batch.is_empty() {
        return;
    }
    let n = batch.len() as u64;
    let error = match tokio::time::timeout(limit, exporter.export(batch)).await {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {limit:?}"),
    };
    count_dropped("export_failed", n);
    if failures.is_multiple_of(100) {
        warn!(spans = n, failures = *failures + 1, %error, "span export failed; spans dropped");
    }
    *failures += 1;
}
