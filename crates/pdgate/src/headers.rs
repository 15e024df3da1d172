//! Header names, the request id, and what a response says about who served it.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// The request id header, on both legs and on every answer.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Response header naming the prefill endpoint (AIBrix spelling).
pub const PREFILL_TARGET_HEADER: HeaderName = HeaderName::from_static("prefill-target-pod");
/// Response header naming the decode endpoint (AIBrix spelling).
pub const DECODE_TARGET_HEADER: HeaderName = HeaderName::from_static("target-pod");
/// Response header naming the connector used.
pub const CONNECTOR_HEADER: HeaderName = HeaderName::from_static("x-pdgate-connector");
/// Response header present when the decode served the request alone after a prefill failure.
pub const FALLBACK_HEADER: HeaderName = HeaderName::from_static("x-pdgate-fallback");

/// Response header present when the decode served the request alone because it already held
/// (almost) all of the prompt in its cache (cache-aware routing).
pub const DECODE_ONLY_HEADER: HeaderName = HeaderName::from_static("x-pdgate-decode-only");

/// Response header with the prompt tokens cache-aware routing predicted cached where the prompt
/// is computed (the prefill, or the decode alone).
pub const PREDICTED_CACHED_HEADER: HeaderName =
    HeaderName::from_static("x-pdgate-predicted-cached-tokens");

/// Client headers forwarded to engine legs. Everything else (hop-by-hop headers, `host`,
/// `content-length`, `x-data-parallel-rank`, ...) is dropped.
const FORWARDED: [HeaderName; 6] = [
    header::AUTHORIZATION,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("baggage"),
    HeaderName::from_static("openai-organization"),
    HeaderName::from_static("openai-project"),
];

/// The request id used on both legs: the client's `X-Request-Id` when it is sane, else fresh.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 128
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Sets `x-request-id` (a request id is always a valid header value: see [`request_id`]).
pub fn stamp_request_id(headers: &mut HeaderMap, request_id: &str) {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert(X_REQUEST_ID, v);
    }
}

/// The client headers worth forwarding to engines.
pub fn forwarded(incoming: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in &FORWARDED {
        for v in incoming.get_all(name) {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

/// Headers that describe one connection, not the message (and the request id, which the
/// gateway sets itself).
pub fn is_hop_header(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "upgrade"
            | "te"
            | "trailer"
            | "content-length"
            | "date"
            | "server"
            | "x-request-id"
    )
}

/// Copies an engine's response headers, without the hop-by-hop ones.
pub fn copy_end_to_end(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from.iter() {
        if !is_hop_header(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Whether an engine answered with a server-sent event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// What a PD response says about how it was served.
#[derive(Clone, Debug)]
pub struct Served {
    /// The prefill endpoint that ran the prefill leg.
    pub prefill: String,
    /// The decode endpoint whose answer is relayed.
    pub decode: String,
    /// The connector used.
    pub connector: &'static str,
    /// The decode served the request alone after a prefill failure.
    pub fallback: bool,
    /// The decode served the request alone by choice, and why (the `x-pdgate-decode-only`
    /// value): `cache-hit` (it held the prompt's prefix) or `route` (the prefill's connector
    /// cannot hand this route over, or the request needs one engine's state).
    pub decode_only: Option<&'static str>,
    /// Prompt tokens predicted cached (cache-aware routing only).
    pub predicted_cached: Option<u32>,
    /// Whether the answer names the endpoints (`prefill-target-pod`, `target-pod`):
    /// `security.expose_target_headers`.
    pub targets: bool,
}

impl Served {
    /// Writes the request id and the serving endpoints into `headers`.
    pub fn apply(&self, request_id: &str, headers: &mut HeaderMap) {
        const NAMES: [HeaderName; 4] = [
            X_REQUEST_ID,
            PREFILL_TARGET_HEADER,
            DECODE_TARGET_HEADER,
            CONNECTOR_HEADER,
        ];
        let values = [request_id, &self.prefill, &self.decode, self.connector];
        for (i, (name, v)) in NAMES.into_iter().zip(values).enumerate() {
            // An empty value: no prefill served (decode-only).
            if v.is_empty() || (!self.targets && (i == 1 || i == 2)) {
                continue;
            }
            if let Ok(v) = HeaderValue::from_str(v) {
                headers.insert(name, v);
            }
        }
        if self.fallback {
            headers.insert(FALLBACK_HEADER, HeaderValue::from_static("prefill-failed"));
        }
        if let Some(why) = self.decode_only {
            headers.insert(DECODE_ONLY_HEADER, HeaderValue::from_static(why));
        }
        if let Some(n) = self.predicted_cached {
            headers.insert(PREDICTED_CACHED_HEADER, HeaderValue::from(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_honoured_only_when_sane() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&h), "abc-123");
        h.insert("x-request-id", HeaderValue::from_static("a b"));
        assert_eq!(request_id(&h).len(), 32);
        assert_ne!(request_id(&HeaderMap::new()), request_id(&HeaderMap::new()));
    }

    #[test]
    fn served_names_the_endpoints() {
        let mut h = HeaderMap::new();
        Served {
            prefill: "p:1".into(),
            decode: "d:2".into(),
            connector: "shfs",
            fallback: true,
            decode_only: None,
            predicted_cached: None,
            targets: true,
        }
        .apply("id-1", &mut h);
        assert_eq!(h["x-request-id"], "id-1");
        assert_eq!(h["prefill-target-pod"], "p:1");
        assert_eq!(h["target-pod"], "d:2");
        assert_eq!(h["x-pdgate-fallback"], "prefill-failed");
        assert!(h.get(&DECODE_ONLY_HEADER).is_none());
        let mut h = HeaderMap::new();
        Served {
            prefill: String::new(),
            decode: "d:2".into(),
            connector: "shfs",
            fallback: false,
            decode_only: Some("cache-hit"),
            predicted_cached: Some(48),
            targets: true,
        }
        .apply("id-2", &mut h);
        assert!(h.get(&PREFILL_TARGET_HEADER).is_none());
        assert_eq!(h[&DECODE_ONLY_HEADER], "cache-hit");
        assert_eq!(h[&PREDICTED_CACHED_HEADER], "48");
        assert!(is_hop_header(&header::CONTENT_LENGTH) && !is_hop_header(&header::CONTENT_TYPE));
        let mut hidden = HeaderMap::new();
        Served {
            prefill: "p:1".into(),
            decode: "d:2".into(),
            connector: "shfs",
            fallback: false,
            decode_only: None,
            predicted_cached: None,
            targets: false,
        }
        .apply("id-1", &mut hidden);
        assert!(hidden.get("prefill-target-pod").is_none() && hidden.get("target-pod").is_none());
        assert_eq!(hidden["x-request-id"], "id-1");
    }
}
