//! `sglang`: SGLang PD disaggregation (contracts §6). Both legs get the
//! identical body with the prefill's bootstrap host, port and a random room.

use serde_json::value::RawValue;

use crate::agent::{
    AgentError, Dispatch, EngineCall, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base,
    require_ip,
};
use crate::body::JsonBody;
use crate::context::RoutingContext;
use crate::pod::{Pod, url_host};
use crate::rules::strip_client_transfer_fields;

/// The `sglang` agent: concurrent, batch-capable; prefill and decode receive
/// the same body carrying `bootstrap_host`, `bootstrap_port`, `bootstrap_room`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SglangAgent;

/// Number of prompts in a batch field: `None` for a single prompt (a string
/// or one token-id array), `Some(len)` for an array of prompts.
fn prompt_count(body: &JsonBody, key: &str) -> Option<usize> {
    let items: Vec<&RawValue> = body.get(key)?.ok()?;
    match items.first().map(|v| v.get().as_bytes().first()) {
        // A flat token-id array is one prompt.
        Some(Some(b'-' | b'0'..=b'9')) => None,
        _ => Some(items.len()),
    }
}

/// How many bootstrap rooms a request needs: `None` for a single prompt
/// (scalar fields), `Some(k)` for a batch of `k` prompts in `prompt`, `text` or
/// `input_ids` (array fields of length `k`).
///
/// `n` does not count: SGLang itself repeats list-valued bootstrap fields
/// `n` times (and a scalar for every sample), so lists must have one entry per
/// prompt.
pub fn sglang_batch_size(body: &JsonBody) -> Option<usize> {
    ["prompt", "text", "input_ids"]
        .iter()
        .find_map(|k| prompt_count(body, k))
}

/// A random room id in `0..2^63` (SGLang's range), from a v4 UUID's random bits.
fn random_room() -> u64 {
    let (hi, lo) = uuid::Uuid::new_v4().as_u64_pair();
    // hi's fixed version nibble (bits 12..16) and lo's variant bits (62, 63 ->
    // 30, 31 after rotation) do not overlap, so all 63 kept bits are random.
    (hi ^ lo.rotate_left(32)) & (i64::MAX as u64)
}

/// Writes the bootstrap fields (arrays for a batch, as SGLang's own load
/// balancer does) into `body`.
fn add_bootstrap(
    body: &mut JsonBody,
    host: &str,
    port: u16,
    rooms: &[u64],
    batch: bool,
) -> Result<(), AgentError> {
    if batch {
        body.set("bootstrap_host", &vec![host; rooms.len()])?;
        body.set("bootstrap_port", &vec![port; rooms.len()])?;
        body.set("bootstrap_room", rooms)?;
    } else {
        body.set("bootstrap_host", host)?;
        body.set("bootstrap_port", &port)?;
        body.set("bootstrap_room", &rooms.first().copied().unwrap_or(0))?;
    }
    Ok(())
}

impl KvTransferAgent for SglangAgent {
    fn connector_type(&self) -> &'static str {
        crate::CONNECTOR_TYPE_SGLANG
    }

    fn dispatch(&self) -> Dispatch {
        Dispatch::Concurrent
    }

    /// SGLang decode servers in disaggregation mode wait for a bootstrap room: a plain request
    /// would never be served.
    fn allows_decode_only(&self) -> bool {
        false
    }

    /// SGLang validates sampling parameters its own way (not vLLM's list): only the gateway's
    /// own body, model and batch checks apply.
    fn check_request(
        &self,
        _body: &JsonBody,
        _endpoint: crate::checks::Endpoint,
    ) -> Result<(), crate::checks::EngineReject> {
        Ok(())
    }

    fn supports_batch(&self) -> bool {
        true
    }

    /// SGLang keeps decoding a request whose connection closed until it is told to stop.
    fn engine_abort(&self, request_id: &str) -> Option<EngineCall> {
        #[derive(serde::Serialize)]
        struct Abort<'a> {
            rid: &'a str,
        }
        let body = serde_json::to_vec(&Abort { rid: request_id }).ok()?;
        Some(EngineCall {
            path: "/abort_request",
            body: bytes::Bytes::from(body),
        })
    }

    fn augment_prefill_request(
        &self,
        ctx: &mut RoutingContext,
        prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError> {
        let host = url_host(require_ip(prefill_pod)?);
        let batch = sglang_batch_size(request);
        let rooms: Vec<u64> = (0..batch.unwrap_or(1)).map(|_| random_room()).collect();
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        add_bootstrap(
            &mut body,
            &host,
            prefill_pod.sglang_bootstrap_port(),
            &rooms,
            batch.is_some(),
        )?;
        ctx.transfer.bootstrap_room = rooms.first().copied();
        ctx.transfer.bootstrap_rooms = rooms;
        ctx.transfer.bootstrap_room_is_array = batch.is_some();
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    /// Ignores `prefill_response`; rebuilds the exact prefill body from the
    /// original body and the rooms augment stored.
    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        _prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        let mut decode = decode_base(ctx)?;
        let host = url_host(require_ip(prefill_pod)?);
        if ctx.transfer.bootstrap_rooms.is_empty() {
            return Err(AgentError::MissingState(
                "sglang bootstrap_room not set by augment",
            ));
        }
        add_bootstrap(
            &mut decode,
            &host,
            prefill_pod.sglang_bootstrap_port(),
            &ctx.transfer.bootstrap_rooms,
            ctx.transfer.bootstrap_room_is_array,
        )?;
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn body(s: &'static str) -> JsonBody {
        JsonBody::parse(Bytes::from_static(s.as_bytes())).unwrap()
    }

    #[test]
    fn batch_sizes() {
        assert_eq!(sglang_batch_size(&body(r#"{"prompt":"a"}"#)), None);
        assert_eq!(sglang_batch_size(&body(r#"{"prompt":[1,2,3]}"#)), None);
        assert_eq!(sglang_batch_size(&body(r#"{"prompt":["a","b"]}"#)), Some(2));
        assert_eq!(
            sglang_batch_size(&body(r#"{"prompt":[[1],[2],[3]]}"#)),
            Some(3)
        );
        assert_eq!(sglang_batch_size(&body(r#"{"prompt":"a","n":3}"#)), None);
        assert_eq!(
            sglang_batch_size(&body(r#"{"prompt":["a","b"],"n":2}"#)),
            Some(2)
        );
        assert_eq!(sglang_batch_size(&body(r#"{"text":["a"],"n":1}"#)), Some(1));
        assert_eq!(sglang_batch_size(&body(r#"{"messages":[],"n":1}"#)), None);
    }

    #[test]
    fn abort_names_the_request() {
        let call = SglangAgent.engine_abort("req-\"1").unwrap();
        assert_eq!(call.path, "/abort_request");
        let v: serde_json::Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(v["rid"], "req-\"1");
    }

    #[test]
    fn rooms_are_u63_and_vary() {
        let rooms: Vec<u64> = (0..32).map(|_| random_room()).collect();
        assert!(rooms.iter().all(|r| *r <= i64::MAX as u64));
        let distinct: std::collections::BTreeSet<_> = rooms.iter().collect();
        assert_eq!(distinct.len(), rooms.len());
    }
}
