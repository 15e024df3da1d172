//! The spans of one request. Each is an `info_span!` carrying the request id; with export off
//! and the default log filter their callsites are disabled, so creating one is a cached
//! interest check and recording into one does nothing.

use http::header::HeaderMap;
use tracing::Span;
use tracing::field::Empty;

use crate::headers::Served;

/// The `request` span and the children it owns: `kv_handoff` (the prefill's end to the first
/// decode byte relayed) and `relay` (the decode body to the client). Held by the request's
/// metrics record, so the spans end when the outcome is recorded.
#[derive(Debug)]
pub(crate) struct RequestTrace {
    request: Span,
    handoff: Span,
    relay: Span,
    retries: u32,
    /// The endpoints serving, recorded once at the end (kept only while the span is enabled).
    prefill: String,
    decode: String,
}

impl Default for RequestTrace {
    fn default() -> Self {
        RequestTrace {
            request: Span::none(),
            handoff: Span::none(),
            relay: Span::none(),
            retries: 0,
            prefill: String::new(),
            decode: String::new(),
        }
    }
}

impl RequestTrace {
    /// Opens the request's span (a child of the client's trace when export is on and it sent a
    /// `traceparent`).
    pub(crate) fn start(request_id: &str, route: &'static str, headers: &HeaderMap) -> Self {
        let request = tracing::info_span!(
            "request",
            request_id,
            route,
            otel.kind = "server",
            connector = Empty,
            model = Empty,
            prefill = Empty,
            decode = Empty,
            prefill_policy = Empty,
            decode_policy = Empty,
            routing = Empty,
            predicted_cached_tokens = Empty,
            cached_tokens = Empty,
            retries = Empty,
            fallback = Empty,
            outcome = Empty,
            http.response.status_code = Empty,
            otel.status_code = Empty,
        );
        if super::exporting() {
            super::continue_client_trace(&request, headers);
        }
        RequestTrace {
            request,
            ..RequestTrace::default()
        }
    }

    /// The request span (the legs' spans are created inside it).
    pub(crate) fn span(&self) -> &Span {
        &self.request
    }

    /// What routing chose: the connector, the pair, the policies, and the decision (`pd`, or
    /// `decode_only` when the decode holds the prompt; cache-aware scoring adds its prediction).
    pub(crate) fn routed(&mut self, route: Routed<'_>) {
        let span = &self.request;
        if span.is_disabled() {
            return;
        }
        span.record("connector", route.connector);
        if let Some(m) = route.model {
            span.record("model", m);
        }
        if !route.decode_only {
            route.prefill.clone_into(&mut self.prefill);
        }
        route.decode.clone_into(&mut self.decode);
        span.record("prefill_policy", route.prefill_policy);
        span.record("decode_policy", route.decode_policy);
        span.record(
            "routing",
            if route.decode_only {
                "decode_only"
            } else {
                "pd"
            },
        );
        if let Some(n) = route.predicted_cached {
            span.record("predicted_cached_tokens", i64::from(n));
        }
    }

    /// A leg is tried again on another endpoint.
    pub(crate) fn retried(&mut self) {
        self.retries += 1;
    }

    /// The prefill leg ended: the KV handoff starts.
    pub(crate) fn prefill_done(&mut self, request_id: &str) {
        if self.request.is_disabled() {
            return;
        }
        self.handoff = tracing::info_span!(parent: &self.request, "kv_handoff", request_id);
    }

    /// The first decode byte was relayed: the handoff is over.
    pub(crate) fn first_byte(&mut self) {
        self.handoff = Span::none();
    }

    /// The decode's head is in: what served, and the relay of its body starts.
    pub(crate) fn relay_started(&mut self, request_id: &str, served: &Served, cached: Option<u32>) {
        let span = &self.request;
        if span.is_disabled() {
            return;
        }
        served.prefill.clone_into(&mut self.prefill);
        served.decode.clone_into(&mut self.decode);
        span.record("fallback", served.fallback);
        if let Some(n) = cached {
            span.record("cached_tokens", i64::from(n));
        }
        self.relay = tracing::info_span!(
            parent: &self.request,
            "relay",
            request_id,
            decode = served.decode.as_str(),
        );
    }

    /// The outcome is recorded: the request's spans end (with `status` and `outcome`).
    pub(crate) fn finish(&mut self, outcome: &'static str, status: u16) {
        self.handoff = Span::none();
        self.relay = Span::none();
        let span = &self.request;
        if span.is_disabled() {
            return;
        }
        // Each field once: an exporter keeps every value recorded.
        if !self.prefill.is_empty() {
            span.record("prefill", self.prefill.as_str());
        }
        if !self.decode.is_empty() {
            span.record("decode", self.decode.as_str());
        }
        span.record("outcome", outcome);
        span.record("retries", i64::from(self.retries));
        span.record("http.response.status_code", i64::from(status));
        span.record(
            "otel.status_code",
            if outcome == "success" { "OK" } else { "ERROR" },
        );
    }
}

/// Routing's choice, for [`RequestTrace::routed`].
pub(crate) struct Routed<'a> {
    pub(crate) connector: &'a str,
    pub(crate) model: Option<&'a str>,
    pub(crate) prefill: &'a str,
    pub(crate) decode: &'a str,
    pub(crate) prefill_policy: &'a str,
    pub(crate) decode_policy: &'a str,
    pub(crate) decode_only: bool,
    pub(crate) predicted_cached: Option<u32>,
}
