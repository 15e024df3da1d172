//! Prometheus metrics. Labels come from closed sets (route, role, connector, outcome) or from
//! the configured fleet (endpoint names), never from raw client input.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::error::{GatewayError, Leg, Source, UpstreamKind};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    connector: String,
    outcome: &'static str,
    /// A model the fleet is configured to serve, or empty: never a client's free text.
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConnectorLabels {
    connector: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LegLabels {
    leg: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    role: &'static str,
    endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabels {
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EjectionLabels {
    role: &'static str,
    endpoint: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    file: &'static str,
    result: &'static str,
}

/// The files pdgate re-reads while it runs (`pdgate_reloads_total{file}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The config file's endpoint set (`--config`).
    Config,
    /// The listener's TLS certificate and key.
    Tls,
    /// The client API key file.
    ApiKeys,
}

impl Reloaded {
    fn label(self) -> &'static str {
        match self {
            Reloaded::Config => "config",
            Reloaded::Tls => "tls",
            Reloaded::ApiKeys => "api_keys",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClientLabels {
    client: String,
    result: &'static str,
}

/// What happened to a named client's request at its limits (`pdgate_client_requests_total`).
pub const CLIENT_RESULTS: [&str; 3] = ["admitted", "rate_limited", "concurrency_limited"];

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 100 us .. ~105 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

/// All gateway metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Whether each finished request writes an access-log line (`access_log`).
    pub access_log: AtomicBool,
    /// The access log's queue to its writer thread.
    pub(crate) access: access::AccessLog,
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    duration: Histograms<RouteLabels>,
    ttft: Histograms<RouteLabels>,
    prefill: Histograms<ConnectorLabels>,
    handoff: Histograms<ConnectorLabels>,
    recomputes: Family<ConnectorLabels, Counter>,
    fallbacks: Family<ConnectorLabels, Counter>,
    retries: Family<LegLabels, Counter>,
    encodes: Family<OutcomeLabels, Counter>,
    in_flight: Family<EndpointLabels, Gauge>,
    computing: Family<EndpointLabels, Gauge>,
    endpoints: Family<RoleLabels, Gauge>,
    ejections: Family<RoleLabels, Counter>,
    endpoint_ejections: Family<EjectionLabels, Counter>,
    healthy: Family<EndpointLabels, Gauge>,
    discovery_changes: Counter,
    rejected: Family<ReasonLabels, Counter>,
    clients: Family<ClientLabels, Counter>,
    retry_budget: Gauge<f64, std::sync::atomic::AtomicU64>,
    retry_budget_capacity: Gauge<f64, std::sync::atomic::AtomicU64>,
    retries_refused: Family<LegLabels, Counter>,
    reloads: Family<ReloadLabels, Counter>,
    /// Requests holding an admission slot.
    pub admitted: Gauge,
    /// Requests waiting for an admission slot.
    pub queued: Gauge,
    /// The request path's series, resolved once.
    hot: handles::Hot,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Creates and registers every series.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pdgate");
        let requests = Family::<RequestLabels, Counter>::default();
        let duration: Histograms<RouteLabels> = Family::new_with_constructor(latency_histogram);
        let ttft: Histograms<RouteLabels> = Family::new_with_constructor(latency_histogram);
        let prefill: Histograms<ConnectorLabels> = Family::new_with_constructor(latency_histogram);
        let handoff: Histograms<ConnectorLabels> = Family::new_with_constructor(latency_histogram);
        let recomputes = Family::<ConnectorLabels, Counter>::default();
        let fallbacks = Family::<ConnectorLabels, Counter>::default();
        let retries = Family::<LegLabels, Counter>::default();
        let encodes = Family::<OutcomeLabels, Counter>::default();
        let in_flight = Family::<EndpointLabels, Gauge>::default();
        let computing = Family::<EndpointLabels, Gauge>::default();
        let endpoints = Family::<RoleLabels, Gauge>::default();
        registry.register(
            "requests",
            "Requests by route, connector and outcome class",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "End-to-end latency, until the last byte reached the client",
            duration.clone(),
        );
        registry.register(
            "ttft_seconds",
            "Time from request arrival to the first decode byte relayed",
            ttft.clone(),
        );
        registry.register(
            "prefill_duration_seconds",
            "Duration of the prefill leg",
            prefill.clone(),
        );
        registry.register(
            "kv_handoff_seconds",
            "Time from the end of the prefill leg to the first decode byte",
            handoff.clone(),
        );
        registry.register(
            "recomputes",
            "Prefills that answered without KV-transfer parameters (the decode recomputes)",
            recomputes.clone(),
        );
        registry.register(
            "fallbacks",
            "Requests sent to the decode alone after the prefill failed",
            fallbacks.clone(),
        );
        registry.register(
            "retries",
            "Legs retried on another endpoint",
            retries.clone(),
        );
        registry.register(
            "encodes",
            "Multimodal requests sent to encoders, by outcome: encoded, failed, fallback (the prefill encoded the items itself)",
            encodes.clone(),
        );
        registry.register(
            "endpoint_in_flight",
            "Requests in flight per endpoint",
            in_flight.clone(),
        );
        registry.register(
            "endpoint_computing_tokens",
            "Prompt tokens in flight per endpoint: as a cache-aware decision predicted them, else estimated from the request body",
            computing.clone(),
        );
        registry.register(
            "endpoints",
            "Routable endpoints per role",
            endpoints.clone(),
        );
        let ejections = Family::<RoleLabels, Counter>::default();
        let healthy = Family::<EndpointLabels, Gauge>::default();
        let discovery_changes = Counter::default();
        let rejected = Family::<ReasonLabels, Counter>::default();
        let clients = Family::<ClientLabels, Counter>::default();
        let retry_budget = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "retry_budget_tokens",
            "Retry tokens available (retry_budget_ratio per request, up to the capacity)",
            retry_budget.clone(),
        );
        let retry_budget_capacity = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "retry_budget_capacity",
            "Retry bucket capacity: retry_budget_ratio times the last window's requests, at least retry_budget_min",
            retry_budget_capacity.clone(),
        );
        let retries_refused = Family::<LegLabels, Counter>::default();
        registry.register(
            "retries_refused",
            "Retries not made because the retry budget was exhausted, by leg",
            retries_refused.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        // Every series from the start, at 0: a rejected reload shows as a change, not a new line.
        for file in [Reloaded::Config, Reloaded::Tls, Reloaded::ApiKeys] {
            for result in ["applied", "rejected"] {
                let _ = reloads.get_or_create(&ReloadLabels {
                    file: file.label(),
                    result,
                });
            }
        }
        registry.register(
            "reloads",
            "Watched files re-read after a change, by file (config, tls, api_keys) and result (applied, rejected: the previous contents keep serving)",
            reloads.clone(),
        );
        registry.register(
            "client_requests",
            "Requests of named clients ([[security.clients]]) by result at their limits",
            clients.clone(),
        );
        let admitted = Gauge::default();
        let queued = Gauge::default();
        registry.register(
            "ejections",
            "Endpoints ejected by passive outlier detection or failed active checks",
            ejections.clone(),
        );
        let endpoint_ejections = Family::<EjectionLabels, Counter>::default();
        registry.register(
            "endpoint_ejections",
            "Endpoints taken out of rotation, per endpoint and reason (see Cause)",
            endpoint_ejections.clone(),
        );
        registry.register(
            "endpoint_healthy",
            "1 when the endpoint passes health checking, 0 while it is unhealthy or ejected",
            healthy.clone(),
        );
        registry.register(
            "discovery_changes",
            "Routable endpoint set republished",
            discovery_changes.clone(),
        );
        registry.register(
            "admission_rejected",
            "Requests refused by admission control (429), by reason",
            rejected.clone(),
        );
        registry.register(
            "admission_in_flight",
            "Requests holding an admission slot",
            admitted.clone(),
        );
        registry.register(
            "admission_queued",
            "Requests waiting for an admission slot",
            queued.clone(),
        );
        registry.register(
            "otel_spans_dropped",
            "Finished spans not exported (OpenTelemetry), by reason: queue_full, export_failed",
            crate::telemetry::spans_dropped(),
        );
        let access_dropped = Counter::default();
        registry.register(
            "access_log_dropped",
            "Access-log lines dropped because the writer fell behind",
            access_dropped.clone(),
        );
        Metrics {
            access_log: AtomicBool::new(false),
            access: access::AccessLog::new(access::ACCESS_LOG_QUEUE, access_dropped),
            registry,
            ejections,
            endpoint_ejections,
            healthy,
            discovery_changes,
            rejected,
            clients,
            retry_budget,
            retry_budget_capacity,
            retries_refused,
            reloads,
            admitted,
            queued,
            hot: handles::Hot::default(),
            requests,
            duration,
            ttft,
            prefill,
            handoff,
            recomputes,
            fallbacks,
            retries,
            encodes,
            in_flight,
            computing,
            endpoints,
        }
    }

    /// Counts a re-read of a watched file: `applied`, or rejected (the previous contents stay).
    pub fn count_reload(&self, file: Reloaded, applied: bool) {
        self.reloads
            .get_or_create(&ReloadLabels {
                file: file.label(),
                result: if applied { "applied" } else { "rejected" },
            })
            .inc();
    }

    /// Counts a decode that will recompute the prompt.
    pub fn count_recompute(&self, connector: &str) {
        self.recomputes
            .get_or_create(&ConnectorLabels {
                connector: connector.to_string(),
            })
            .inc();
    }

    /// Counts a request's encoder legs by outcome (`encoded`, `failed`, `fallback`: a closed set).
    pub fn count_encode(&self, outcome: &'static str) {
        self.encodes.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// Counts a fallback to decode-only.
    pub fn count_fallback(&self, connector: &str) {
        self.fallbacks
            .get_or_create(&ConnectorLabels {
                connector: connector.to_string(),
            })
            .inc();
    }

    /// Counts a retried leg.
    pub fn count_retry(&self, leg: Leg) {
        self.retries
            .get_or_create(&LegLabels { leg: leg.as_str() })
            .inc();
    }

    /// Counts a retry the budget refused.
    pub fn count_retry_refused(&self, leg: Leg) {
        self.retries_refused
            .get_or_create(&LegLabels { leg: leg.as_str() })
            .inc();
    }

    /// Sets the retry tokens available (read at scrape time).
    pub fn set_retry_budget(&self, tokens: f64, capacity: f64) {
        self.retry_budget.set(tokens);
        self.retry_budget_capacity.set(capacity);
    }

    /// Counts an ejection of `role` endpoint `endpoint`, for `cause`.
    pub fn count_ejection(&self, role: &'static str, endpoint: &str, cause: Cause) {
        self.ejections.get_or_create(&RoleLabels { role }).inc();
        self.endpoint_ejections
            .get_or_create(&EjectionLabels {
                role,
                endpoint: endpoint.to_string(),
                reason: cause.as_str(),
            })
            .inc();
    }

    /// Sets an endpoint's health gauge.
    pub fn set_healthy(&self, role: &'static str, endpoint: &str, healthy: bool) {
        self.healthy
            .get_or_create(&EndpointLabels {
                role,
                endpoint: endpoint.to_string(),
            })
            .set(i64::from(healthy));
    }

    /// Forgets an endpoint that left the fleet.
    pub fn forget_endpoint(&self, role: &'static str, endpoint: &str) {
        self.healthy.remove(&EndpointLabels {
            role,
            endpoint: endpoint.to_string(),
        });
        for cause in Cause::ALL {
            self.endpoint_ejections.remove(&EjectionLabels {
                role,
                endpoint: endpoint.to_string(),
                reason: cause.as_str(),
            });
        }
    }

    /// Counts a republished endpoint set.
    pub fn count_discovery_change(&self) {
        self.discovery_changes.inc();
    }

    /// Counts a request refused by admission control.
    /// Creates the series of the closed label sets at 0 (admission reasons, roles, legs, and
    /// the fleet's `connectors`), so that dashboards and alerts see every family before the
    /// first event.
    pub fn declare_fleet(&self, connectors: &[String]) {
        for reason in [
            "queue_full",
            "queue_timeout",
            "endpoint_cap",
            "queued_prefill_tokens",
        ] {
            let _ = self.rejected.get_or_create(&ReasonLabels { reason });
        }
        for role in ["prefill", "decode"] {
            let _ = self.ejections.get_or_create(&RoleLabels { role });
        }
        for leg in [Leg::Prefill, Leg::Decode] {
            let _ = self.retries.get_or_create(&LegLabels { leg: leg.as_str() });
            let _ = self
                .retries_refused
                .get_or_create(&LegLabels { leg: leg.as_str() });
        }
        for connector in connectors {
            let labels = ConnectorLabels {
                connector: connector.clone(),
            };
            let _ = self.recomputes.get_or_create(&labels);
            let _ = self.fallbacks.get_or_create(&labels);
        }
    }

    /// Creates the series of client `name` at 0, so that dashboards see them before traffic.
    pub fn declare_client(&self, name: &str) {
        for result in CLIENT_RESULTS {
            let _ = self.clients.get_or_create(&ClientLabels {
                client: name.to_string(),
                result,
            });
        }
    }

    /// Counts one request of the named client `name` (`result` from [`CLIENT_RESULTS`]).
    pub fn count_client(&self, name: &str, result: &'static str) {
        self.clients
            .get_or_create(&ClientLabels {
                client: name.to_string(),
                result,
            })
            .inc();
    }

    pub fn count_rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// The registry, for metrics families owned by other modules (`cache`).
    pub(crate) fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Sets the fleet gauges: routable endpoints per role, and each one's requests in flight
    /// and predicted prompt tokens in computation (`fleet`: role, endpoint names with those
    /// two counts). Endpoints not named are dropped from both families.
    pub fn set_fleet<'a>(
        &self,
        fleet: impl IntoIterator<Item = (&'static str, Vec<(&'a str, usize, usize)>)>,
    ) {
        self.in_flight.clear();
        self.computing.clear();
        for (role, list) in fleet {
            self.endpoints
                .get_or_create(&RoleLabels { role })
                .set(list.len() as i64);
            for (name, n, tokens) in list {
                let labels = EndpointLabels {
                    role,
                    endpoint: name.to_string(),
                };
                self.in_flight.get_or_create(&labels).set(n as i64);
                self.computing.get_or_create(&labels).set(tokens as i64);
            }
        }
    }

    /// Renders the text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

pub(crate) mod access;
mod ejections;
mod handles;
mod record;
pub use ejections::Cause;

pub use record::RequestRecord;

#[cfg(test)]
mod tests;
