//! The access log, off the request path: a finished request hands its [`AccessLine`] to a
//! bounded queue ([`AccessLog::send`], never waits) and the writer thread ([`AccessWriter`])
//! formats and writes it (target `pdgate::access`). When the writer falls behind, lines are
//! dropped and counted in `pdgate_access_log_dropped_total`; nothing a request does waits on it.
//!
//! The writer drains the queue on a clock ([`DRAIN_EVERY`]), not when a line arrives: a request
//! that queues its line wakes nothing (a wake-up per line, a worker thread unparked to write
//! one line, was most of what the log cost per request; see docs/benchmarks.md).
//!
//! Under pdgate's own logger (`telemetry::init`) the writer renders each line itself, byte for
//! byte as that logger's text or JSON format would ([`AccessLine::render`]; a test holds the two
//! equal): through `tracing`'s formatter a line cost several times the instructions of the rest
//! of its request's relaying (docs/benchmarks.md). Under any other subscriber (a library user's,
//! a test's) lines go through `tracing` as events.

use std::io::Write as _;
use std::sync::Mutex;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use tokio::sync::{mpsc, oneshot};

use crate::telemetry::LogFormat;

/// The access log's target: `RUST_LOG` filters it by this name.
const TARGET: &str = "pdgate::access";

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

/// Seconds to milliseconds, to the microsecond.
fn ms(seconds: f64) -> f64 {
    (seconds * 1e6).round() / 1e3
}

impl AccessLine {
    /// The line as a `tracing` event (what [`AccessLine::render`] writes without one).
    fn write(&self) {
        tracing::info!(
            target: TARGET,
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

    /// Appends the line to `out` as pdgate's logger writes the event [`AccessLine::write`] sends
    /// at time `at`, in `format` (text: values that are `str`s quoted as `Debug` quotes them,
    /// the `%` ones as they are; JSON: one object, fields in the order sent).
    fn render(&self, format: LogFormat, at: SystemTime, out: &mut Vec<u8>) {
        let at = humantime::format_rfc3339_micros(at);
        // Writes into a `Vec` cannot fail.
        match format {
            LogFormat::Text => {
                // Strings pushed as they are (each through `write!` cost more than the rest of
                // the line: docs/benchmarks.md).
                let field = |out: &mut Vec<u8>, key: &str, value: &str| {
                    out.push(b' ');
                    out.extend_from_slice(key.as_bytes());
                    out.push(b'=');
                    out.extend_from_slice(value.as_bytes());
                };
                let flag = |b: bool| if b { "true" } else { "false" };
                let _ = write!(out, "{at}  INFO {TARGET}: request");
                field(out, "request_id", &self.request_id);
                let _ = write!(out, " route={:?} status={}", self.route, self.status);
                let _ = write!(out, " outcome={:?}", self.outcome);
                field(out, "model", &self.model);
                field(out, "connector", self.connector);
                field(out, "prefill", &self.prefill);
                field(out, "decode", &self.decode);
                field(out, "fallback", flag(self.fallback));
                field(out, "decode_only", flag(self.decode_only));
                if let Some(n) = self.predicted_cached {
                    let _ = write!(out, " predicted_cached_tokens={n}");
                }
                let _ = write!(out, " total_ms={:?}", ms(self.total));
                if let Some(t) = self.ttft {
                    let _ = write!(out, " ttft_ms={:?}", ms(t));
                }
            }
            LogFormat::Json => {
                let text = |out: &mut Vec<u8>, key: &str, value: &str| {
                    out.extend_from_slice(b",\"");
                    out.extend_from_slice(key.as_bytes());
                    out.extend_from_slice(b"\":");
                    let _ = serde_json::to_writer(&mut *out, value);
                };
                let _ = write!(
                    out,
                    "{{\"timestamp\":\"{at}\",\"level\":\"INFO\",\"fields\":{{\"message\":\"request\""
                );
                text(out, "request_id", &self.request_id);
                text(out, "route", self.route);
                let _ = write!(out, ",\"status\":{}", self.status);
                text(out, "outcome", self.outcome);
                text(out, "model", &self.model);
                text(out, "connector", self.connector);
                text(out, "prefill", &self.prefill);
                text(out, "decode", &self.decode);
                let _ = write!(
                    out,
                    ",\"fallback\":{},\"decode_only\":{}",
                    self.fallback, self.decode_only
                );
                if let Some(n) = self.predicted_cached {
                    let _ = write!(out, ",\"predicted_cached_tokens\":{n}");
                }
                let _ = out.write_all(b",\"total_ms\":");
                let _ = serde_json::to_writer(&mut *out, &ms(self.total));
                if let Some(t) = self.ttft {
                    let _ = out.write_all(b",\"ttft_ms\":");
                    let _ = serde_json::to_writer(&mut *out, &ms(t));
                }
                let _ = write!(out, "}},\"target\":\"{TARGET}\"}}");
            }
        }
        out.push(b'\n');
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
    // Under pdgate's own logger, rendered here where its filter lets the target through; under
    // any other subscriber, sent to it as events.
    let own = crate::telemetry::own_log_format();
    let wanted = own.is_none() || tracing::event_enabled!(target: TARGET, tracing::Level::INFO);
    let mut out = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(line) => match own {
                Some(format) if wanted => {
                    out.clear();
                    line.render(format, SystemTime::now(), &mut out);
                    crate::telemetry::write_log(&out);
                }
                Some(_) => {}
                None => line.write(),
            },
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
    use std::sync::Arc;

    /// What pdgate's logger (`telemetry::init`'s format layer) writes for `line`'s event.
    fn through_tracing(line: &AccessLine, format: LogFormat) -> String {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let writer = move || {
            struct W(Arc<Mutex<Vec<u8>>>);
            impl std::io::Write for W {
                fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                    self.0.lock().expect("buffer").extend_from_slice(b);
                    Ok(b.len())
                }
                fn flush(&mut self) -> std::io::Result<()> {
                    Ok(())
                }
            }
            W(sink.clone())
        };
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer);
        match format {
            LogFormat::Text => {
                tracing::subscriber::with_default(builder.finish(), || line.write());
            }
            LogFormat::Json => {
                tracing::subscriber::with_default(builder.json().finish(), || line.write());
            }
        }
        let bytes = buf.lock().expect("buffer").clone();
        String::from_utf8(bytes).expect("utf-8")
    }

    #[test]
    fn rendered_lines_are_what_the_logger_writes() {
        let full = AccessLine {
            request_id: "req-1".into(),
            route: "chat_completions",
            status: 200,
            outcome: "success",
            model: "m \"quoted\" \\ ü".into(),
            connector: "nixl",
            prefill: "10.0.0.1:8000".into(),
            decode: "10.0.0.2:8000".into(),
            fallback: true,
            decode_only: false,
            predicted_cached: Some(48),
            total: 0.107_823_9,
            ttft: Some(0.1),
        };
        let bare = AccessLine {
            route: "completions",
            status: 502,
            outcome: "prefill_error",
            total: 2.0,
            ..AccessLine::default()
        };
        let at = SystemTime::now();
        let stamp = humantime::format_rfc3339_micros(at).to_string();
        for line in [&full, &bare] {
            for format in [LogFormat::Text, LogFormat::Json] {
                let logged = through_tracing(line, format);
                let mut out = Vec::new();
                line.render(format, at, &mut out);
                let rendered = String::from_utf8(out).expect("utf-8");
                // The logger's own clock: its stamp in place of ours.
                let theirs = match format {
                    LogFormat::Text => logged.split(' ').next().expect("a stamp").to_string(),
                    LogFormat::Json => {
                        let v: serde_json::Value = serde_json::from_str(&logged).expect("json");
                        v["timestamp"].as_str().expect("a stamp").to_string()
                    }
                };
                assert_eq!(theirs.len(), stamp.len(), "{logged}");
                assert_eq!(rendered.replacen(&stamp, &theirs, 1), logged);
            }
        }
    }

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
