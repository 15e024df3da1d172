//! Errors answered to clients, in vLLM's `{"error":{message,type,param,code}}` shape.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error the engine answers with; rendered once, at the edge.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// A request vLLM rejects during validation (400 `BadRequestError`).
    #[error("{message}")]
    BadRequest {
        /// Human-readable reason.
        message: String,
        /// Offending parameter, when vLLM names one.
        param: Option<&'static str>,
    },
    /// The model is not served here (404 `NotFoundError`).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// A KV handoff failed (500 for vLLM connectors, 400 for SGLang, as the engines do).
    #[error("{message}")]
    Handoff {
        /// Human-readable reason.
        message: String,
        /// HTTP status the real engine uses.
        status: StatusCode,
    },
    /// The request was aborted through `/abort_request` or engine shutdown.
    #[error("{0}")]
    Aborted(String),
    /// An injected fault.
    #[error("simulated fault: injected error")]
    Injected(StatusCode),
}

#[derive(Serialize)]
struct Body<'a> {
    error: Info<'a>,
}

#[derive(Serialize)]
struct Info<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: u16,
}

impl ApiError {
    /// Convenience for a 400 without a named parameter.
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    /// Convenience for a failed handoff with the given status.
    pub(crate) fn handoff(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError::Handoff {
            message: message.into(),
            status,
        }
    }

    /// The HTTP status the engine answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Handoff { status, .. } => *status,
            ApiError::Aborted(_) => StatusCode::BAD_REQUEST,
            ApiError::Injected(s) => *s,
        }
    }

    fn kind(status: StatusCode) -> &'static str {
        match status.as_u16() {
            400 => "BadRequestError",
            401 => "UnauthorizedError",
            403 => "ForbiddenError",
            404 => "NotFoundError",
            408 => "TimeoutError",
            429 => "RateLimitError",
            501 => "NotImplementedError",
            503 => "ServiceUnavailableError",
            500..=599 => "InternalServerError",
            _ => "BadRequestError",
        }
    }

    /// The JSON body bytes (`{"error":{...}}`).
    pub fn to_json(&self) -> Vec<u8> {
        let status = self.status();
        let message = self.to_string();
        let param = match self {
            ApiError::BadRequest { param, .. } => *param,
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        };
        let body = Body {
            error: Info {
                message: &message,
                kind: Self::kind(status),
                param,
                code: status.as_u16(),
            },
        };
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), self.to_json()).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_matches_vllm() {
        let v: serde_json::Value =
            serde_json::from_slice(&ApiError::ModelNotFound("x".into()).to_json()).unwrap();
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["message"], "The model `x` does not exist.");
        let v: serde_json::Value =
            serde_json::from_slice(&ApiError::Injected(StatusCode::BAD_GATEWAY).to_json()).unwrap();
        assert_eq!(v["error"]["code"], 502);
        assert_eq!(v["error"]["type"], "InternalServerError");
        assert!(v["error"]["param"].is_null());
    }
}
