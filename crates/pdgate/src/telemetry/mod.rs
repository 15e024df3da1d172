//! Traces: logging set-up, the request's spans, and OpenTelemetry export (off by default).
//!
//! - [`RequestTrace`] (`trace`): the `request` span of one request, with its `kv_handoff` and
//!   `relay` children; the legs' `prefill` and `decode` spans are children of it.
//! - `export`: the span queue between the request path and the OTLP exporter (never blocks;
//!   drops counted in `pdgate_otel_spans_dropped_total`), and the task that empties it.
//! - [`init`]: the subscriber. Text (or JSON) logs filtered by `RUST_LOG` (default `info`), which
//!   show pdgate's spans only when `RUST_LOG` asks for `debug` or names a span (`[request]`):
//!   with neither, and no export, the spans are never built. With `otlp_endpoint` set, a second
//!   layer turns pdgate's spans into OpenTelemetry spans.
//!
//! W3C trace context: with export on, the `request` span continues the client's `traceparent`
//! (and `tracestate`) and each engine leg gets its own span's context; with export off the
//! client's headers are forwarded unchanged (`headers::forwarded`).

mod export;
mod out;
mod trace;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::{Deserialize, Serialize};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

pub(crate) use out::{Batch, write_log};

pub(crate) use trace::{RequestTrace, Routed};

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}
/// The OTLP transport.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// Protobuf over HTTP (`POST {endpoint}/v1/traces`), usually port 4318.
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    /// gRPC (tonic), usually port 4317.
    #[serde(rename = "grpc")]
    Grpc,
}

/// The `[telemetry]` section: OpenTelemetry trace export.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The OTLP collector (`http://host:4318` for HTTP, `http://host:4317` for gRPC); unset: no
    /// export. For HTTP, `/v1/traces` is appended unless the URL ends with it.
    pub otlp_endpoint: Option<String>,
    /// `http/protobuf` or `grpc`.
    pub otlp_protocol: OtlpProtocol,
    /// The `service.name` resource attribute.
    pub otlp_service_name: String,
    /// Share of new traces sampled (a client's `traceparent` decides for its own: parent-based).
    pub otlp_sample_ratio: f64,
    /// Finished spans waiting for export; more are dropped (and counted).
    pub otlp_queue_size: usize,
    /// Bound on one export call, and on the flush at shutdown.
    #[serde(
        deserialize_with = "crate::durations::de_duration",
        serialize_with = "crate::durations::ser_duration"
    )]
    pub otlp_export_timeout: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::HttpProtobuf,
            otlp_service_name: "pdgate".into(),
            otlp_sample_ratio: 1.0,
            otlp_queue_size: 2048,
            otlp_export_timeout: Duration::from_secs(10),
        }
    }
}

impl TelemetryConfig {
    /// Checks the values (field name and message on failure).
    pub(crate) fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..=1.0).contains(&self.otlp_sample_ratio) {
            return Err((
                "telemetry.otlp_sample_ratio",
                format!("must be within 0..=1, not {}", self.otlp_sample_ratio),
            ));
        }
        if self.otlp_queue_size == 0 {
            return Err(("telemetry.otlp_queue_size", "must be at least 1".into()));
        }
        if let Some(url) = &self.otlp_endpoint
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err((
                "telemetry.otlp_endpoint",
                format!("{url:?} is not an http:// URL"),
            ));
        }
        Ok(())
    }

    /// The URL spans are sent to.
    fn traces_url(&self, base: &str) -> String {
        match self.otlp_protocol {
            OtlpProtocol::Grpc => base.to_string(),
            OtlpProtocol::HttpProtobuf if base.ends_with("/v1/traces") => base.to_string(),
            OtlpProtocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
        }
    }
}

/// Set once, when the OpenTelemetry layer is installed: spans are exported and trace context
/// is continued and injected.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Set once, when [`init`] installs pdgate's own logger: its format. The access log then renders
/// its lines itself (`metrics::access`).
static OWN_LOG: OnceLock<LogFormat> = OnceLock::new();

/// The format of pdgate's own logger, if it is the process's subscriber.
pub(crate) fn own_log_format() -> Option<LogFormat> {
    OWN_LOG.get().copied()
}

/// Whether spans are exported (one relaxed load: the request path's only cost with export off).
pub(crate) fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DropLabels {
    reason: &'static str,
}

/// Spans lost on their way to the collector, by reason (`queue_full`, `export_failed`).
static SPANS_DROPPED: LazyLock<Family<DropLabels, Counter>> = LazyLock::new(|| {
    let family = Family::<DropLabels, Counter>::default();
    for reason in ["queue_full", "export_failed"] {
        let _ = family.get_or_create(&DropLabels { reason });
    }
    family
});

/// The process's dropped-span counters, for the metrics registry (`otel_spans_dropped`).
pub(crate) fn spans_dropped() -> Family<DropLabels, Counter> {
    SPANS_DROPPED.clone()
}

fn count_dropped(reason: &'static str, n: u64) {
    SPANS_DROPPED
        .get_or_create(&DropLabels { reason })
        .inc_by(n);
}

/// Whether a callsite is one of pdgate's spans (request, legs, handoff, relay).
fn is_pdgate_span(meta: &tracing::Metadata<'_>) -> bool {
    meta.is_span() && meta.target().starts_with("pdgate")
}

/// Whether `RUST_LOG` asks for pdgate's spans in the text logs: a `debug` (or `trace`) level, or
/// a span directive (`pdgate[request]=info`).
fn spans_in_logs(directives: Option<&str>, filter: &tracing_subscriber::EnvFilter) -> bool {
    directives.is_some_and(|d| d.contains('['))
        || filter
            .max_level_hint()
            .is_some_and(|l| l >= tracing::level_filters::LevelFilter::DEBUG)
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (bad endpoint, ...).
    #[error("OTLP exporter: {0}")]
    Exporter(String),
    /// A global subscriber was already set.
    #[error("logging: {0}")]
    Subscriber(String),
}

/// The telemetry a process runs: the export task, flushed by [`Telemetry::shutdown`].
#[derive(Debug, Default)]
pub struct Telemetry {
    export: Option<export::ExportTask>,
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports the spans still queued (within `deadline`), then stops the export task.
    pub async fn shutdown(self, deadline: Duration) {
        if let Some(task) = self.export {
            task.shutdown(deadline).await;
        }
        drop(self.provider);
    }
}

/// Sets the process's subscriber: logs in `format`, and OpenTelemetry export when `config` has
/// an endpoint (call within the tokio runtime: the export task runs on it).
pub fn init(format: LogFormat, config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    let directives = std::env::var(tracing_subscriber::EnvFilter::DEFAULT_ENV).ok();
    let filter = directives
        .as_deref()
        .and_then(|d| tracing_subscriber::EnvFilter::try_new(d).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    let with_spans = spans_in_logs(directives.as_deref(), &filter);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(out::LogOut);
    let fmt = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    // Per-layer: the text logs build pdgate's spans only when asked, so with export off and the
    // default filter the span callsites are disabled and cost nothing per request.
    // The hint matters: a filter without one lifts the process's maximum level to `trace`, and
    // every disabled `debug!`/`trace!` in the stack (hyper, h2) then costs a callsite check.
    let gate = tracing_subscriber::filter::filter_fn(move |m| with_spans || !is_pdgate_span(m))
        .with_max_level_hint(tracing::level_filters::LevelFilter::TRACE);
    let fmt = fmt.with_filter(tracing_subscriber::filter::FilterExt::and(filter, gate));
    let mut telemetry = Telemetry::default();
    let registry = tracing_subscriber::registry().with(fmt);
    // No `Option` layer for "no export": an absent layer counts as wanting every callsite, which
    // would build every span for nobody.
    let exporting = config.otlp_endpoint.is_some();
    let installed = match &config.otlp_endpoint {
        Some(base) => {
            let (layer, export, provider) = otel_layer(config, base)?;
            telemetry.export = Some(export);
            telemetry.provider = Some(provider);
            registry.with(layer).try_init()
        }
        None => registry.try_init(),
    };
    installed.map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    EXPORTING.store(exporting, Ordering::Relaxed);
    let _ = OWN_LOG.set(format);
    Ok(telemetry)
}

/// The layer that turns pdgate's spans (only those) into OpenTelemetry spans, the export task
/// behind it, and its tracer provider.
fn otel_layer<S>(
    config: &TelemetryConfig,
    base: &str,
) -> Result<
    (
        impl tracing_subscriber::Layer<S>,
        export::ExportTask,
        SdkTracerProvider,
    ),
    TelemetryError,
>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let url = config.traces_url(base);
    let built = match config.otlp_protocol {
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(config.otlp_export_timeout)
            .build(),
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(url)
            .with_timeout(config.otlp_export_timeout)
            .build(),
    };
    let mut exporter = built.map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.otlp_service_name.clone())
        .build();
    opentelemetry_sdk::trace::SpanExporter::set_resource(&mut exporter, &resource);
    let (processor, task) = export::start(exporter, config);
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.otlp_sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("pdgate");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_level(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(
            tracing_subscriber::filter::filter_fn(is_pdgate_span)
                .with_max_level_hint(tracing::level_filters::LevelFilter::INFO),
        );
    Ok((layer, task, provider))
}

static PROPAGATOR: LazyLock<TraceContextPropagator> = LazyLock::new(TraceContextPropagator::new);

struct Extract<'a>(&'a HeaderMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct Inject<'a>(&'a mut HeaderMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            if value.is_empty() {
                self.0.remove(&name);
            } else {
                self.0.insert(name, value);
            }
        }
    }
}

/// Makes `span` continue the trace of the client's `traceparent`/`tracestate` (export on).
pub(crate) fn continue_client_trace(span: &tracing::Span, headers: &HeaderMap) {
    if headers.contains_key("traceparent") {
        let cx = PROPAGATOR.extract(&Extract(headers));
        // Fails only when the span is disabled (not sampled by the filter): nothing to continue.
        let _ = span.set_parent(cx);
    }
}

/// Export on: replaces the forwarded `traceparent`/`tracestate` of an engine leg with the
/// current span's (the leg's), so the engine's spans hang under it. Export off: nothing (the
/// client's headers go through as forwarded).
pub(crate) fn inject_leg_context(headers: &mut HeaderMap) {
    if !exporting() {
        return;
    }
    let cx = tracing::Span::current().context();
    PROPAGATOR.inject_context(&cx, &mut Inject(headers));
}

#[cfg(test)]
mod tests;
