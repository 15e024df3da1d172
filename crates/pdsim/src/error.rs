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
    #[error("The model `{requested}` does not exist. Valid aliases: {served}.")]
    ModelNotFound {
        /// The `model` the request named.
        requested: String,
        /// The served model name (vLLM lists every alias).
        served: String,
    },
    /// Loading remote KV failed. vLLM answers a bare 500 "Internal server error";
    /// the reason (this variant's `Display`) goes to the log and `SimStats::last_kv_error`.
    #[error("{0}")]
    KvLoad(String),
    /// The engine core died (fault `crash_on_bad_kv_params`): 500 now, and for every later request.
    #[error("EngineCore encountered an issue. See stack trace (above) for the root cause.")]
    EngineDead,
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
    /// A LoRA load or unload vLLM refuses: 400 `InvalidUserInput` (a missing field, a name
    /// already loaded) or 404 `NotFoundError` (unloading a name not loaded).
    #[error("{message}")]
    Lora {
        /// vLLM's message.
        message: String,
        /// vLLM's status.
        status: StatusCode,
    },
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
            ApiError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::KvLoad(_) | ApiError::EngineDead => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Handoff { status, .. } | ApiError::Lora { status, .. } => *status,
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

    fn info<'a>(&self, message: &'a str) -> Info<'a> {
        let status = self.status();
        let param = match self {
            ApiError::BadRequest { param, .. } => *param,
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        };
        let kind = match self {
            ApiError::Lora { .. } if status == StatusCode::BAD_REQUEST => "InvalidUserInput",
            _ => Self::kind(status),
        };
        Info {
            message,
            kind,
            param,
            code: status.as_u16(),
        }
    }

    /// The message clients see (a KV-load failure hides its reason, as vLLM does).
    fn public_message(&self) -> String {
        match self {
            ApiError::KvLoad(_) => "Internal server error".to_owned(),
            e => e.to_string(),
        }
    }

    /// The JSON body bytes (`{"error":{...}}`).
    pub fn to_json(&self) -> Vec<u8> {
        let message = self.public_message();
        let body = Body {
            error: self.info(&message),
        };
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }

    /// The payload of a mid-stream error event, spaced like Python's `json.dumps`
    /// (`{"error": {"message": ..., ...}}`), as vLLM writes it.
    pub(crate) fn to_event_json(&self) -> String {
        let message = self.public_message();
        let i = self.info(&message);
        let text = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned());
        let param = i.param.map_or_else(|| "null".to_owned(), text);
        format!(
            "{{\"error\": {{\"message\": {}, \"type\": {}, \"param\": {param}, \"code\": {}}}}}",
            text(i.message),
            text(i.kind),
            i.code
        )
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
        let nf = ApiError::ModelNotFound {
            requested: "nope".into(),
            served: "tiny".into(),
        };
        let v: serde_json::Value = serde_json::from_slice(&nf.to_json()).unwrap();
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(
            v["error"]["message"],
            "The model `nope` does not exist. Valid aliases: tiny."
        );
        let kv = ApiError::KvLoad("remote prefill gone".into());
        assert_eq!(kv.to_string(), "remote prefill gone");
        let want = serde_json::json!({"error":{"message":"Internal server error",
            "type":"InternalServerError","param":null,"code":500}});
        let v: serde_json::Value = serde_json::from_slice(&kv.to_json()).unwrap();
        assert_eq!(v, want);
        assert_eq!(
            kv.to_event_json(),
            r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#
        );
        let v: serde_json::Value = serde_json::from_str(&nf.to_event_json()).unwrap();
        assert_eq!(v["error"]["param"], "model");
        let v: serde_json::Value =
            serde_json::from_slice(&ApiError::Injected(StatusCode::BAD_GATEWAY).to_json()).unwrap();
        assert_eq!(v["error"]["code"], 502);
        assert_eq!(v["error"]["type"], "InternalServerError");
        assert!(v["error"]["param"].is_null());
    }
}
