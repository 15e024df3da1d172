//! Why an endpoint was taken out of rotation (`pdgate_endpoint_ejections_total{reason}`): a
//! closed set, from what health tells apart.

use crate::error::{GatewayError, UpstreamKind};

/// Why an endpoint was taken out of rotation: its active checks, its latency, or the cause of
/// the failure on real traffic that tripped the outlier rules (what passive health is told).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// Failed `unhealthy_threshold` active checks in a row.
    HealthCheck,
    /// A prefill far slower than its peers (the latency rule).
    LatencyOutlier,
    /// Answered a 5xx.
    ServerError,
    /// No connection could be opened.
    Connect,
    /// Did not answer within the leg's timeout.
    Timeout,
    /// Broke the exchange (reset, malformed answer, body or stream cut short).
    Broken,
    /// A relayed stream sent nothing past the idle timeout.
    Silent,
    /// Sent an SSE error event after its head.
    ErrorEvent,
    /// A concurrent prefill that never handed its KV over (its decode gave up waiting).
    KvWait,
}

impl Cause {
    /// Every cause, in label order.
    pub const ALL: [Cause; 9] = [
        Cause::HealthCheck,
        Cause::LatencyOutlier,
        Cause::ServerError,
        Cause::Connect,
        Cause::Timeout,
        Cause::Broken,
        Cause::Silent,
        Cause::ErrorEvent,
        Cause::KvWait,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::HealthCheck => "health_check",
            Cause::LatencyOutlier => "latency_outlier",
            Cause::ServerError => "5xx",
            Cause::Connect => "connect",
            Cause::Timeout => "timeout",
            Cause::Broken => "broken",
            Cause::Silent => "silent",
            Cause::ErrorEvent => "error_event",
            Cause::KvWait => "kv_wait",
        }
    }

    /// The cause of a failed engine exchange.
    pub fn of(err: &GatewayError) -> Cause {
        match err {
            GatewayError::Upstream { kind, .. } => match kind {
                UpstreamKind::Connect => Cause::Connect,
                UpstreamKind::Timeout => Cause::Timeout,
                UpstreamKind::Broken | UpstreamKind::Released => Cause::Broken,
                UpstreamKind::Silent => Cause::Silent,
            },
            GatewayError::UpstreamStatus { status, .. } if status.is_server_error() => {
                Cause::ServerError
            }
            _ => Cause::Broken,
        }
    }
}
