//! One request's measurements ([`RequestRecord`]) and the closed set of outcomes it records.

use super::*;

/// Every outcome of `pdgate_requests_total` (a closed set). Each response is counted once,
/// under exactly one of them.
pub const OUTCOMES: [&str; 12] = [
    "success",
    "fallback",
    "client_error",
    "rejected",
    "routing_error",
    "timeout",
    "encode_error",
    "prefill_error",
    "decode_error",
    "decode_stream_error",
    "cancelled",
    "internal_error",
];

/// Outcome class of a request that failed with `err`; `head_sent`: the client already has a
/// 2xx head (the failure ended a relayed body).
fn outcome_of(err: &GatewayError, head_sent: bool) -> &'static str {
    let source = err.source_of();
    if head_sent {
        return match source {
            Source::Engine(Leg::Prefill) => "prefill_error",
            _ => "decode_stream_error",
        };
    }
    match err {
        GatewayError::Overloaded { .. }
        | GatewayError::ClientLimit { .. }
        | GatewayError::Busy { .. } => return "rejected",
        GatewayError::Upstream {
            kind: UpstreamKind::Timeout | UpstreamKind::Silent,
            ..
        } => return "timeout",
        _ => {}
    }
    if err.status().is_client_error() {
        // The gateway's own checks, an unknown model, or an engine refusing the request.
        return "client_error";
    }
    match source {
        Source::Client => "client_error",
        Source::Engine(Leg::Encode) => "encode_error",
        Source::Engine(Leg::Prefill) => "prefill_error",
        Source::Engine(Leg::Decode) => "decode_error",
        Source::Routing => "routing_error",
        Source::Internal => "internal_error",
    }
}

/// Outcome class of a relayed answer that ended cleanly, by the status the client got.
fn outcome_of_status(status: u16, fallback: bool) -> &'static str {
    match status {
        200..=399 if fallback => "fallback",
        200..=399 => "success",
        400..=499 => "client_error",
        _ => "decode_error",
    }
}

/// One request's measurements; records itself exactly once (a drop before completion counts as
/// cancelled by the client).
#[derive(Debug)]
pub struct RequestRecord {
    metrics: Arc<Metrics>,
    route: &'static str,
    connector: &'static str,
    model: String,
    start: Instant,
    prefill_done: Option<Instant>,
    first_byte_seen: bool,
    finished: bool,
    /// For the access log: the request id, the endpoints that served, the answer's status,
    /// the time to the first byte, whether the decode served alone.
    request_id: String,
    prefill: String,
    decode: String,
    status: u16,
    ttft: Option<f64>,
    fallback: bool,
    /// The client has the answer's head (set with the served endpoints).
    head_sent: bool,
    /// Cache-aware routing: the decode served alone by choice, and the predicted cached tokens.
    decode_only: bool,
    predicted_cached: Option<u32>,
    /// The request's spans, ended with the outcome.
    trace: crate::telemetry::RequestTrace,
}

impl RequestRecord {
    /// Starts measuring a request on `route`.
    pub fn start(metrics: Arc<Metrics>, route: &'static str) -> Self {
        RequestRecord {
            metrics,
            route,
            connector: "",
            model: String::new(),
            start: Instant::now(),
            prefill_done: None,
            first_byte_seen: false,
            finished: false,
            request_id: String::new(),
            prefill: String::new(),
            decode: String::new(),
            status: 200,
            ttft: None,
            fallback: false,
            head_sent: false,
            decode_only: false,
            predicted_cached: None,
            trace: crate::telemetry::RequestTrace::default(),
        }
    }

    /// Starts measuring a request on the route labelled `route` (a closed set), named by its
    /// `x-request-id` (or a new id), its spans started from the request's `headers`.
    pub(crate) fn begin(
        metrics: Arc<Metrics>,
        route: &'static str,
        headers: &http::HeaderMap,
    ) -> Self {
        let mut record = RequestRecord::start(metrics, route);
        record.request_id = crate::headers::request_id(headers);
        record.trace = crate::telemetry::RequestTrace::start(&record.request_id, route, headers);
        record
    }

    /// The request's spans.
    pub(crate) fn trace(&mut self) -> &mut crate::telemetry::RequestTrace {
        &mut self.trace
    }

    /// The request's span.
    pub(crate) fn trace_span(&self) -> &tracing::Span {
        self.trace.span()
    }

    /// The request id.
    pub(crate) fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The endpoints whose answer is relayed, its status, and whether the decode served alone.
    pub fn set_served(&mut self, served: &crate::headers::Served, status: u16) {
        self.prefill.clone_from(&served.prefill);
        self.decode.clone_from(&served.decode);
        self.status = status;
        self.head_sent = true;
        self.fallback = served.fallback;
        self.decode_only = served.decode_only.is_some();
        self.predicted_cached = served.predicted_cached;
    }

    /// Names the engines the request is sent to (the access log's `prefill` and `decode`, until
    /// the answer names the ones that served it); an empty name leaves the field as it is.
    pub(crate) fn touched(&mut self, prefill: &str, decode: &str) {
        if !prefill.is_empty() {
            prefill.clone_into(&mut self.prefill);
        }
        if !decode.is_empty() {
            decode.clone_into(&mut self.decode);
        }
    }

    /// Names the connector once routing chose it.
    pub fn set_connector(&mut self, connector: &'static str) {
        self.connector = connector;
    }

    /// Names the model once routing accepted it (only models of the fleet's configuration).
    pub fn set_model(&mut self, model: &str) {
        self.model = model.to_string();
    }

    /// Marks the end of the prefill leg (the first mark counts).
    pub fn prefill_done(&mut self) {
        if self.prefill_done.is_some() {
            return;
        }
        let now = Instant::now();
        self.trace.prefill_done(&self.request_id);
        self.prefill_done = Some(now);
        self.metrics
            .observe_prefill_leg(self.connector, (now - self.start).as_secs_f64());
    }

    /// Marks the first decode byte relayed.
    pub fn first_byte(&mut self) {
        if self.first_byte_seen {
            return;
        }
        self.first_byte_seen = true;
        self.trace.first_byte();
        let now = Instant::now();
        let ttft = (now - self.start).as_secs_f64();
        self.ttft = Some(ttft);
        self.metrics.observe_ttft(self.route, ttft);
        if let Some(p) = self.prefill_done {
            self.metrics
                .observe_handoff(self.connector, (now - p).as_secs_f64());
        }
    }

    fn finish(&mut self, outcome: &'static str) {
        if self.finished {
            return;
        }
        self.finished = true;
        debug_assert!(
            OUTCOMES.contains(&outcome),
            "outcome {outcome} not declared"
        );
        self.trace.finish(outcome, self.status);
        self.metrics
            .count_request(self.route, self.connector, outcome, &self.model);
        let total = self.start.elapsed().as_secs_f64();
        self.metrics.observe_duration(self.route, total);
        if self.metrics.access_log.load(Ordering::Relaxed) {
            // Written by the access log's own task: the request hands its line over and goes.
            self.metrics.access.send(super::access::AccessLine {
                request_id: std::mem::take(&mut self.request_id),
                route: self.route,
                status: self.status,
                outcome,
                model: std::mem::take(&mut self.model),
                connector: self.connector,
                prefill: std::mem::take(&mut self.prefill),
                decode: std::mem::take(&mut self.decode),
                fallback: self.fallback,
                decode_only: self.decode_only,
                predicted_cached: self.predicted_cached,
                total,
                ttft: self.ttft,
            });
        }
    }

    /// The relayed answer ended cleanly: counted by the status the client got (a decode's 5xx
    /// passed through is a `decode_error`, not a success).
    pub fn finish_ok(&mut self) {
        self.finish(outcome_of_status(self.status, self.fallback));
    }

    /// The request failed with `err`. Before the head, the client gets `err`'s status; after a
    /// 2xx head it keeps that status and the body ends early.
    pub fn finish_error(&mut self, err: &GatewayError) {
        let head_sent = self.head_sent && self.status < 400;
        if !head_sent {
            self.status = err.status().as_u16();
        }
        // An engine that failed the request is the one the log names for its leg.
        if let GatewayError::Upstream { leg, endpoint, .. } = err {
            match leg {
                // The access log names the prefill and decode; an encoder's name is in the error.
                Leg::Encode => {}
                Leg::Prefill => endpoint.clone_into(&mut self.prefill),
                Leg::Decode => endpoint.clone_into(&mut self.decode),
            }
        }
        self.finish(outcome_of(err, head_sent));
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        // 499: nginx's "client closed request".
        self.status = 499;
        self.finish("cancelled");
    }
}
