//! The gateway's one request error type and its classification (where it came from, whether a
//! retry is safe, its status class). Its OpenAI-shaped presentation is [`openai`]'s; the HTTP
//! edge renders it (`http::edge::render`), once. Configuration errors are [`ConfigError`]
//! (`error::config`, re-exported by `config`), apart from request errors.

mod config;
mod openai;

pub use config::ConfigError;
pub(crate) use config::field_error;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};

/// One of the engine requests of a PD request (a pass-through request has only a decode leg; a
/// multimodal request behind encoders has encoder legs first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Leg {
    /// An encoder engine encodes one multimodal item (encoder disaggregation).
    Encode,
    /// The prefill engine computes the prompt's KV cache.
    Prefill,
    /// The decode engine streams the tokens.
    Decode,
}

impl Leg {
    /// A bounded label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Encode => "encode",
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Leg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an engine exchange failed. Decides the status (502 or 504) and which retries are safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpstreamKind {
    /// No connection could be opened: nothing was sent, any other endpoint may take the leg.
    Connect,
    /// The engine did not answer (head or whole prefill) within the leg's timeout.
    Timeout,
    /// The exchange broke on an open connection (reset, malformed answer, body cut short).
    Broken,
    /// A relayed stream sent nothing for longer than the idle timeout.
    Silent,
    /// The gateway gave the leg up because its endpoint was taken out of rotation while the
    /// request waited (`reliability.retry_on_ejection`): the engine did not fail this request,
    /// another endpoint may take it.
    Released,
}

/// Where a failure came from. Decides the status class, the outcome label and whether a retry
/// is safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The client sent something we refuse.
    Client,
    /// An engine leg failed.
    Engine(Leg),
    /// No endpoint could serve the request.
    Routing,
    /// The gateway itself.
    Internal,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Source {
    /// A bounded label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Client => "client",
            Source::Engine(leg) => leg.as_str(),
            Source::Routing => "routing",
            Source::Internal => "internal",
        }
    }
}

/// Everything that can fail on the request path.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The request body or headers are invalid.
    #[error("{message}")]
    BadRequest {
        /// Human-readable reason.
        message: String,
        /// The offending parameter, when one is to blame.
        param: Option<&'static str>,
    },
    /// The request body exceeds the configured limit.
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// No such route.
    #[error("no route for {path}")]
    NotFound {
        /// The path asked for.
        path: String,
    },
    /// The route exists, not for this method.
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed {
        /// The method used.
        method: http::Method,
        /// The path asked for.
        path: String,
    },
    /// The request head is larger than the limit.
    #[error("request headers are larger than the limit of {limit} bytes")]
    HeadersTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// No endpoint serves the requested model at all.
    #[error("The model `{model}` does not exist.")]
    ModelNotFound {
        /// The requested model.
        model: String,
    },
    /// No routable endpoint for the request.
    #[error("no routable {what} endpoint for model {model:?}")]
    NoEndpoint {
        /// `prefill`, `decode` or `prefill/decode pair`.
        what: &'static str,
        /// The requested model.
        model: String,
    },
    /// The gateway is shedding load.
    #[error("the gateway is overloaded; retry later")]
    Overloaded {
        /// Seconds the client should wait.
        retry_after_secs: u64,
    },
    /// A named client went beyond one of its limits (`[[security.clients]]`).
    #[error("rate limit reached for client {client:?}: {limit}; retry later")]
    ClientLimit {
        /// The client's configured name.
        client: String,
        /// Which limit.
        limit: &'static str,
        /// Seconds the client should wait.
        retry_after_secs: u64,
    },
    /// No API key, or one that is not configured.
    #[error("{}", unauthorized_message(.missing))]
    Unauthorized {
        /// Whether no key was presented at all.
        missing: bool,
    },
    /// The memory for request bodies being read is in use (`security.max_buffered_body_bytes`).
    #[error("the gateway is reading too many request bodies; retry later")]
    Busy {
        /// Seconds the client should wait.
        retry_after_secs: u64,
    },
    /// An engine could not be reached, broke the exchange, or did not answer in time.
    #[error("{leg} engine {endpoint} {detail}")]
    Upstream {
        /// Which leg failed.
        leg: Leg,
        /// The endpoint name.
        endpoint: String,
        /// How it failed (decides status and retries; never read from `detail`).
        kind: UpstreamKind,
        /// Human-readable detail for the message.
        detail: String,
    },
    /// An engine answered with an error status; relayed as it came.
    #[error("{leg} engine answered {status}")]
    UpstreamStatus {
        /// Which leg answered.
        leg: Leg,
        /// The engine's status.
        status: StatusCode,
        /// The engine's body, relayed unchanged.
        body: Bytes,
        /// The engine's content type.
        content_type: Option<HeaderValue>,
    },
    /// The KV-transfer agent refused the request or the prefill answer.
    #[error("KV transfer: {0}")]
    Agent(#[from] kvtransfer::AgentError),
    /// A request an engine would refuse, refused before any leg with the engine's status,
    /// message and `param` (`kvtransfer::checks`).
    #[error("{0}")]
    Rejected(kvtransfer::EngineReject),
    /// The request body did not arrive within `request_body_timeout`.
    #[error("the request body did not arrive within {after:?}")]
    BodyTimeout {
        /// The limit.
        after: std::time::Duration,
    },
    /// A bug or an impossible state.
    #[error("internal error: {0}")]
    Internal(String),
}

fn unauthorized_message(missing: &bool) -> &'static str {
    if *missing {
        "You didn't provide an API key. Send it as `Authorization: Bearer KEY`."
    } else {
        "Incorrect API key provided."
    }
}

impl GatewayError {
    /// A 400 with a message and optional parameter name.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        GatewayError::BadRequest {
            message: message.into(),
            param,
        }
    }

    /// A body the gateway cannot read (not JSON, not an object, repeated keys, too deep):
    /// refused as the engine would refuse it, on every route (the one mapping of it).
    pub fn refused_body(refused: kvtransfer::Refused) -> Self {
        match refused {
            kvtransfer::Refused::TooDeep(reject) => GatewayError::Rejected(reject),
            kvtransfer::Refused::Body(e) => {
                GatewayError::Rejected(kvtransfer::reject_body_error(&e))
            }
        }
    }

    /// Where the failure came from.
    pub fn source_of(&self) -> Source {
        match self {
            GatewayError::BadRequest { .. }
            | GatewayError::PayloadTooLarge { .. }
            | GatewayError::ModelNotFound { .. }
            | GatewayError::NotFound { .. }
            | GatewayError::MethodNotAllowed { .. }
            | GatewayError::HeadersTooLarge { .. }
            | GatewayError::Rejected(_)
            | GatewayError::Unauthorized { .. }
            | GatewayError::ClientLimit { .. }
            | GatewayError::BodyTimeout { .. } => Source::Client,
            GatewayError::NoEndpoint { .. }
            | GatewayError::Overloaded { .. }
            | GatewayError::Busy { .. } => Source::Routing,
            GatewayError::Upstream { leg, .. } | GatewayError::UpstreamStatus { leg, .. } => {
                Source::Engine(*leg)
            }
            GatewayError::Agent(_) => Source::Engine(Leg::Prefill),
            GatewayError::Internal(_) => Source::Internal,
        }
    }

    /// Whether nothing was sent because no connection to the engine could be opened (so another
    /// endpoint may take the leg even where a resend would not be safe).
    pub fn is_connect_failure(&self) -> bool {
        matches!(
            self,
            GatewayError::Upstream {
                kind: UpstreamKind::Connect,
                ..
            }
        )
    }

    /// Whether the gateway gave the leg up because its endpoint was taken out of rotation (the
    /// engine did not fail this request).
    pub fn is_release(&self) -> bool {
        matches!(
            self,
            GatewayError::Upstream {
                kind: UpstreamKind::Released,
                ..
            }
        )
    }

    /// Whether the failed work may be retried on another endpoint (nothing reached the client).
    pub fn retryable(&self) -> bool {
        match self {
            GatewayError::Upstream { .. } => true,
            GatewayError::UpstreamStatus { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            GatewayError::Rejected(r) => {
                StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST)
            }
            GatewayError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            GatewayError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            GatewayError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            GatewayError::ModelNotFound { .. } | GatewayError::NotFound { .. } => {
                StatusCode::NOT_FOUND
            }
            GatewayError::NoEndpoint { .. } | GatewayError::Busy { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            GatewayError::Overloaded { .. } | GatewayError::ClientLimit { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            GatewayError::Upstream { kind, .. } => match kind {
                UpstreamKind::Timeout | UpstreamKind::Silent => StatusCode::GATEWAY_TIMEOUT,
                UpstreamKind::Connect | UpstreamKind::Broken | UpstreamKind::Released => {
                    StatusCode::BAD_GATEWAY
                }
            },
            GatewayError::UpstreamStatus { status, .. } => *status,
            GatewayError::Agent(_) => StatusCode::BAD_GATEWAY,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_504_and_retryable() {
        let err = GatewayError::Upstream {
            leg: Leg::Prefill,
            endpoint: "10.0.0.1:8000".into(),
            kind: UpstreamKind::Timeout,
            detail: "timed out".into(),
        };
        assert_eq!(err.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(err.retryable());
        assert!(!err.is_connect_failure());
        let refused = GatewayError::Upstream {
            leg: Leg::Decode,
            endpoint: "10.0.0.2:8000".into(),
            kind: UpstreamKind::Connect,
            // The wording plays no part in the classification.
            detail: "did not answer".into(),
        };
        assert!(refused.is_connect_failure() && refused.retryable());
        assert_eq!(refused.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(
            refused.source_of(),
            Source::Engine(Leg::Decode),
            "{refused}"
        );
        assert!(
            !GatewayError::UpstreamStatus {
                leg: Leg::Prefill,
                status: StatusCode::BAD_REQUEST,
                body: Bytes::new(),
                content_type: None
            }
            .retryable()
        );
    }
}
