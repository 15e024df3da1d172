//! The request path's series, resolved once per label set: every request observes the same few
//! series (its route, its connector, its outcome), so their handles are kept and found by a
//! short scan instead of hashing a fresh label set (and cloning its strings) per observation.
//! A series is still created by its family on first use, so the exposition does not change.

use std::sync::{PoisonError, RwLock};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use super::{ConnectorLabels, Metrics, RequestLabels, RouteLabels};

/// Label sets kept per family; more (an unusual fleet) are looked up in the family each time.
const MAX_KEPT: usize = 64;

/// Handles of one family's series, by label set.
#[derive(Debug)]
pub(super) struct Handles<K, M> {
    kept: RwLock<Vec<(K, M)>>,
}

impl<K, M> Default for Handles<K, M> {
    fn default() -> Self {
        Handles {
            kept: RwLock::new(Vec::new()),
        }
    }
}

impl<K, M> Handles<K, M> {
    /// Runs `apply` on the series whose key `is` matches, resolved by `resolve` (and kept under
    /// `key()`) the first time.
    fn with(
        &self,
        is: impl Fn(&K) -> bool,
        key: impl FnOnce() -> K,
        resolve: impl FnOnce() -> M,
        apply: impl FnOnce(&M),
    ) {
        {
            let kept = self.kept.read().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, m)) = kept.iter().find(|(k, _)| is(k)) {
                apply(m);
                return;
            }
        }
        let m = resolve();
        apply(&m);
        let mut kept = self.kept.write().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < MAX_KEPT && !kept.iter().any(|(k, _)| is(k)) {
            kept.push((key(), m));
        }
    }
}

/// A `pdgate_requests_total` label set: route, connector, outcome, model.
type RequestKey = (&'static str, &'static str, &'static str, String);

/// The series every request observes.
#[derive(Debug, Default)]
pub(super) struct Hot {
    requests: Handles<RequestKey, Counter>,
    duration: Handles<&'static str, Histogram>,
    ttft: Handles<&'static str, Histogram>,
    prefill: Handles<&'static str, Histogram>,
    handoff: Handles<&'static str, Histogram>,
}

impl Metrics {
    /// Counts one finished request (`pdgate_requests_total`).
    pub(super) fn count_request(
        &self,
        route: &'static str,
        connector: &'static str,
        outcome: &'static str,
        model: &str,
    ) {
        self.hot.requests.with(
            |(r, c, o, m)| *r == route && *o == outcome && *c == connector && m == model,
            || (route, connector, outcome, model.to_string()),
            || {
                self.requests
                    .get_or_create(&RequestLabels {
                        route,
                        connector: connector.to_string(),
                        outcome,
                        model: model.to_string(),
                    })
                    .clone()
            },
            |c| {
                c.inc();
            },
        );
    }

    /// Observes a request's whole duration (`pdgate_request_duration_seconds`).
    pub(super) fn observe_duration(&self, route: &'static str, seconds: f64) {
        by_route(&self.hot.duration, &self.duration, route, seconds);
    }

    /// Observes a request's time to its first relayed byte (`pdgate_ttft_seconds`).
    pub(super) fn observe_ttft(&self, route: &'static str, seconds: f64) {
        by_route(&self.hot.ttft, &self.ttft, route, seconds);
    }

    /// Observes a prefill leg's duration (`pdgate_prefill_duration_seconds`).
    pub(super) fn observe_prefill_leg(&self, connector: &'static str, seconds: f64) {
        by_connector(&self.hot.prefill, &self.prefill, connector, seconds);
    }

    /// Observes a KV handoff (`pdgate_kv_handoff_seconds`).
    pub(super) fn observe_handoff(&self, connector: &'static str, seconds: f64) {
        by_connector(&self.hot.handoff, &self.handoff, connector, seconds);
    }
}

fn by_route(
    handles: &Handles<&'static str, Histogram>,
    family: &super::Histograms<RouteLabels>,
    route: &'static str,
    seconds: f64,
) {
    handles.with(
        |r| *r == route,
        || route,
        || family.get_or_create(&RouteLabels { route }).clone(),
        |h| h.observe(seconds),
    );
}

fn by_connector(
    handles: &Handles<&'static str, Histogram>,
    family: &super::Histograms<ConnectorLabels>,
    connector: &'static str,
    seconds: f64,
) {
    handles.with(
        |c| *c == connector,
        || connector,
        || {
            family
                .get_or_create(&ConnectorLabels {
                    connector: connector.to_string(),
                })
                .clone()
        },
        |h| h.observe(seconds),
    );
}
