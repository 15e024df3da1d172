//! The OpenAI-shaped presentation of a [`GatewayError`]: its `type`, the message a client may
//! see (no internal addresses), the JSON body and the SSE error event.

use bytes::Bytes;

use super::GatewayError;

/// Whether an endpoint name is an address (`host:port`, `[v6]:port`): pod names and configured
/// names have no `:port` tail.
fn is_address(name: &str) -> bool {
    name.rsplit_once(':')
        .is_some_and(|(_, port)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

impl GatewayError {
    /// The OpenAI error `type`.
    pub(crate) fn error_type(&self) -> &'static str {
        match self {
            GatewayError::BadRequest { .. }
            | GatewayError::PayloadTooLarge { .. }
            | GatewayError::MethodNotAllowed { .. }
            | GatewayError::HeadersTooLarge { .. }
            | GatewayError::BodyTimeout { .. }
            | GatewayError::Unauthorized { .. } => "invalid_request_error",
            GatewayError::Rejected(r) => r.error_type(),
            GatewayError::ClientLimit { .. } => "rate_limit_error",
            GatewayError::ModelNotFound { .. } | GatewayError::NotFound { .. } => "NotFoundError",
            GatewayError::NoEndpoint { .. }
            | GatewayError::Overloaded { .. }
            | GatewayError::Busy { .. } => "overloaded_error",
            GatewayError::Upstream { .. }
            | GatewayError::UpstreamStatus { .. }
            | GatewayError::Agent(_) => "upstream_error",
            GatewayError::Internal(_) => "internal_error",
        }
    }

    /// The message for the client: as `Display` (which the log gets), except that an endpoint
    /// named by its address (`host:port`, the default name of an unnamed static endpoint) is
    /// not shown: internal addresses stay inside.
    pub(crate) fn client_message(&self) -> String {
        match self {
            GatewayError::Upstream {
                leg,
                endpoint,
                detail,
                ..
            } if is_address(endpoint) => format!("{leg} engine {detail}"),
            _ => self.to_string(),
        }
    }

    /// The OpenAI-shaped JSON body `{"error":{message,type,param,code}}`.
    pub fn to_json(&self) -> Bytes {
        let param = match self {
            GatewayError::BadRequest { param, .. } => *param,
            GatewayError::Rejected(r) => r.param,
            _ => None,
        };
        // Field order as vLLM and OpenAI write it: message, type, param, code.
        #[derive(serde::Serialize)]
        struct Inner<'a> {
            message: String,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: u16,
        }
        #[derive(serde::Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        let body = Outer {
            error: Inner {
                message: self.client_message(),
                kind: self.error_type(),
                param,
                code: self.status().as_u16(),
            },
        };
        serde_json::to_vec(&body)
            .map(Bytes::from)
            .unwrap_or_else(|_| Bytes::from_static(br#"{"error":{"message":"internal error","type":"internal_error","param":null,"code":500}}"#))
    }

    /// One SSE event carrying this error, for failures after a stream has started.
    pub fn to_sse_event(&self) -> Bytes {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&self.to_json());
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Leg, UpstreamKind};
    use http::StatusCode;

    #[test]
    fn renders_openai_shape_with_matching_code() {
        let err = GatewayError::bad_request("`n` must be 1 for connector shfs", Some("n"));
        let v: serde_json::Value = serde_json::from_slice(&err.to_json()).unwrap();
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["param"], "n");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn fields_come_in_openai_order() {
        let text =
            String::from_utf8(GatewayError::Internal("x".into()).to_json().to_vec()).unwrap();
        let at = |k: &str| text.find(k).unwrap();
        assert!(
            at("\"message\"") < at("\"type\"")
                && at("\"type\"") < at("\"param\"")
                && at("\"param\"") < at("\"code\""),
            "{text}"
        );
    }

    #[test]
    fn clients_see_endpoint_names_but_not_addresses() {
        let failed = |endpoint: &str| GatewayError::Upstream {
            leg: Leg::Decode,
            endpoint: endpoint.into(),
            kind: UpstreamKind::Connect,
            detail: "refused the connection".into(),
        };
        for address in ["10.0.0.2:8000", "[fd00::2]:8001", "decode.svc:80"] {
            let err = failed(address);
            let body = String::from_utf8(err.to_json().to_vec()).unwrap();
            assert!(!body.contains(address), "{body}");
            assert!(
                body.contains("decode engine refused the connection"),
                "{body}"
            );
            // The log (Display) keeps the address.
            assert!(err.to_string().contains(address));
        }
        let named = String::from_utf8(failed("decode-7").to_json().to_vec()).unwrap();
        assert!(named.contains("decode engine decode-7 refused"), "{named}");
    }

    #[test]
    fn sse_event_is_one_data_line() {
        let ev = GatewayError::Internal("x".into()).to_sse_event();
        let s = std::str::from_utf8(&ev).unwrap();
        assert!(s.starts_with("data: {"));
        assert!(s.ends_with("}\n\n"));
        assert_eq!(s.matches('\n').count(), 2);
    }
}
