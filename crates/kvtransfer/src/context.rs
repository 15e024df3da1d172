//! Per-request routing state shared between the gateway and the agents.

use bytes::Bytes;

use crate::body::{BodyError, JsonBody};
use crate::pod::Pod;

/// Protocol state an agent's `augment_prefill_request` leaves for its
/// `merge_prefill_response` (and for the gateway's logs and aborts).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferState {
    /// Mooncake transfer id shared by both legs (`xfer-<transfer key>`).
    pub transfer_id: Option<String>,
    /// SGLang bootstrap room (the first one for batches).
    pub bootstrap_room: Option<u64>,
    /// All SGLang bootstrap rooms, in order; one entry unless the request is a
    /// batch of prompts, in which case the body carries an array.
    pub bootstrap_rooms: Vec<u64>,
    /// Whether the bootstrap room went out as an array (batch request).
    pub bootstrap_room_is_array: bool,
    /// The data-parallel rank of the prefill engine serving this request: set by the gateway
    /// before augment when it chose one (it sends it as `X-data-parallel-rank`), and agents
    /// that name a rank (Mooncake) take it; else the Mooncake agent picks one itself.
    pub dp_rank: Option<u32>,
    /// The decode pod the prefill leg addresses, for connectors whose prefill names its decode
    /// (set by [`KvTransferAgent::bind_decode`](crate::KvTransferAgent::bind_decode)).
    pub decode_pod: Option<Pod>,
    /// The `X-Request-Id` both legs must carry instead of the request's own id, for connectors
    /// that route KV by addresses written into the id (P2pNccl, MoRIIO). `None`: the request id.
    pub leg_request_id: Option<String>,
    /// TensorRT-LLM `disagg_request_id` shared by the context and generation phases.
    pub disagg_request_id: Option<u64>,
}

/// Per-request routing context.
///
/// Holds the client body as received; an agent's `merge_prefill_response`
/// replaces [`req_body`](RoutingContext::req_body) with the decode body while
/// [`original_body`](RoutingContext::original_body) keeps returning the
/// client's body (parsed at most once).
#[derive(Debug)]
pub struct RoutingContext {
    /// Request id sent as `X-Request-Id` on both legs.
    pub request_id: String,
    /// What transfer ids (Mooncake's `transfer_id`) derive from: unique per request whatever
    /// the client sent as its request id. [`RoutingContext::new`] sets it to `request_id`; a
    /// gateway that takes `request_id` from the client replaces it with a key of its own.
    pub transfer_key: String,
    /// The client body as received; after merge, the decode body.
    pub req_body: Bytes,
    /// Per-request protocol state set by augment, read by merge.
    pub transfer: TransferState,
    parsed: Option<JsonBody>,
}

impl RoutingContext {
    /// A context for `req_body`; the body is parsed lazily by
    /// [`original_body`](RoutingContext::original_body).
    pub fn new(request_id: impl Into<String>, req_body: Bytes) -> Self {
        let request_id = request_id.into();
        RoutingContext {
            transfer_key: request_id.clone(),
            request_id,
            req_body,
            transfer: TransferState::default(),
            parsed: None,
        }
    }

    /// A context around an already parsed (and possibly already stripped)
    /// body: `req_body` is its current bytes. (The gateway reads what it needs
    /// of the request itself; the context carries only what agents use.)
    pub fn from_parsed(request_id: impl Into<String>, body: JsonBody) -> Self {
        RoutingContext {
            req_body: body.to_bytes(),
            parsed: Some(body),
            ..RoutingContext::new(request_id, Bytes::new())
        }
    }

    /// The client's body, parsed at most once. The first call parses
    /// [`req_body`](RoutingContext::req_body), so call it (or build the
    /// context with [`from_parsed`](RoutingContext::from_parsed)) before
    /// anything replaces `req_body`.
    ///
    /// # Errors
    /// The [`BodyError`] of parsing a body that is not a JSON object with
    /// unique keys. A failed parse is not cached.
    pub fn original_body(&mut self) -> Result<&JsonBody, BodyError> {
        let body = match self.parsed.take() {
            Some(body) => body,
            None => JsonBody::parse(self.req_body.clone())?,
        };
        Ok(self.parsed.insert(body))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn original_survives_req_body_replacement() {
        let mut ctx = RoutingContext::new("r", Bytes::from_static(br#"{"a":1}"#));
        assert!(ctx.original_body().unwrap().contains_key("a"));
        ctx.req_body = Bytes::from_static(br#"{"b":2}"#);
        assert!(ctx.original_body().unwrap().contains_key("a"));
    }

    #[test]
    fn invalid_body_errors_each_time() {
        let mut ctx = RoutingContext::new("r", Bytes::from_static(b"invalid json"));
        assert!(ctx.original_body().is_err());
        assert!(ctx.original_body().is_err());
    }

    #[test]
    fn from_parsed_keeps_the_parsed_body() {
        let body = JsonBody::parse(Bytes::from_static(br#"{"model":"m","stream":true}"#)).unwrap();
        let mut ctx = RoutingContext::from_parsed("r", body);
        assert_eq!(&ctx.req_body[..], br#"{"model":"m","stream":true}"#);
        ctx.req_body = Bytes::from_static(b"not json");
        assert!(ctx.original_body().unwrap().contains_key("stream"));
    }
}
