#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{Tracer as _, TracerProvider as _};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};

use super::*;

/// Records the names of the spans it exports; fails every call when `fail`.
#[derive(Clone, Debug, Default)]
struct Recording {
    names: Arc<Mutex<Vec<String>>>,
    fail: bool,
}

impl SpanExporter for Recording {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if self.fail {
            return Err(OTelSdkError::InternalFailure("collector down".into()));
        }
        let mut names = self.names.lock().unwrap();
        names.extend(batch.iter().map(|s| s.name.to_string()));
        Ok(())
    }
}

/// The drop counters are process-wide: tests that count the same reason take turns.
static COUNTED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn dropped(reason: &'static str) -> u64 {
    SPANS_DROPPED.get_or_create(&DropLabels { reason }).get()
}

fn config(queue: usize) -> TelemetryConfig {
    TelemetryConfig {
        otlp_queue_size: queue,
        otlp_export_timeout: Duration::from_secs(1),
        ..TelemetryConfig::default()
    }
}

/// A provider whose processor is the queue (of `size`) in front of `exporter`.
fn queue(exporter: Recording, size: usize) -> (SdkTracerProvider, export::ExportTask) {
    let (processor, task) = export::start(exporter, &config(size));
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .build();
    (provider, task)
}

/// Ends `n` spans named `name` through a provider whose processor is the queue.
fn end_spans(provider: &SdkTracerProvider, name: &'static str, n: usize) {
    let tracer = provider.tracer("test");
    for _ in 0..n {
        drop(tracer.start(name));
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_drops_and_counts_without_waiting() {
    let _turn = COUNTED.lock().await;
    let exporter = Recording::default();
    let (provider, task) = queue(exporter.clone(), 2);
    let before = dropped("queue_full");
    // No await between the spans: the export task cannot run, the queue holds two.
    end_spans(&provider, "burst", 5);
    assert_eq!(dropped("queue_full") - before, 3);
    task.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*exporter.names.lock().unwrap(), ["burst", "burst"]);
}

#[tokio::test(start_paused = true)]
async fn shutdown_flushes_what_is_queued() {
    let _turn = COUNTED.lock().await;
    let exporter = Recording::default();
    let (provider, task) = queue(exporter.clone(), 64);
    end_spans(&provider, "early", 2);
    tokio::time::sleep(Duration::from_secs(2)).await; // a batch goes out on its own
    assert_eq!(exporter.names.lock().unwrap().len(), 2);
    end_spans(&provider, "late", 3);
    task.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        *exporter.names.lock().unwrap(),
        ["early", "early", "late", "late", "late"]
    );
    // After the task ended, a span has nowhere to go: counted, not blocking.
    let before = dropped("export_failed");
    end_spans(&provider, "after", 1);
    assert_eq!(dropped("export_failed") - before, 1);
}

#[tokio::test(start_paused = true)]
async fn failed_exports_count_their_spans() {
    let _turn = COUNTED.lock().await;
    let exporter = Recording {
        fail: true,
        ..Recording::default()
    };
    let (provider, task) = queue(exporter, 64);
    let before = dropped("export_failed");
    end_spans(&provider, "lost", 4);
    task.shutdown(Duration::from_secs(5)).await;
    assert_eq!(dropped("export_failed") - before, 4);
}

#[test]
fn the_drop_metric_is_exported_at_zero() {
    let text = crate::metrics::Metrics::new().render();
    assert!(
        text.contains("pdgate_otel_spans_dropped_total{reason=\"queue_full\"}"),
        "{text}"
    );
}

#[test]
fn endpoints_and_values() {
    let http = TelemetryConfig::default();
    assert_eq!(http.traces_url("http://c:4318"), "http://c:4318/v1/traces");
    assert_eq!(http.traces_url("http://c:4318/"), "http://c:4318/v1/traces");
    assert_eq!(
        http.traces_url("http://c:4318/v1/traces"),
        "http://c:4318/v1/traces"
    );
    let grpc = TelemetryConfig {
        otlp_protocol: OtlpProtocol::Grpc,
        ..TelemetryConfig::default()
    };
    assert_eq!(grpc.traces_url("http://c:4317"), "http://c:4317");
    assert!(http.validate().is_ok());
    for bad in [
        TelemetryConfig {
            otlp_sample_ratio: 1.5,
            ..TelemetryConfig::default()
        },
        TelemetryConfig {
            otlp_queue_size: 0,
            ..TelemetryConfig::default()
        },
        TelemetryConfig {
            otlp_endpoint: Some("collector:4318".into()),
            ..TelemetryConfig::default()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    let parsed: crate::config::Config = crate::config::Config::from_toml(
        "[telemetry]\notlp_protocol = \"grpc\"\notlp_sample_ratio = 0.25\n",
    )
    .unwrap();
    assert_eq!(parsed.telemetry.otlp_protocol, OtlpProtocol::Grpc);
    assert_eq!(parsed.telemetry.otlp_sample_ratio, 0.25);
}

#[test]
fn logs_build_spans_only_when_asked() {
    let f = |d: &str| spans_in_logs(Some(d), &tracing_subscriber::EnvFilter::new(d));
    assert!(!f("info"));
    assert!(!f("warn,pdgate::access=info"));
    assert!(f("pdgate=debug"));
    assert!(f("info,pdgate[request]=info"));
}
