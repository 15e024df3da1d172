//! `p2pnccl`: vLLM's P2pNcclConnector (contracts §10).
//!
//! The transfer is addressed by the request id alone: both legs carry the same `X-Request-Id`
//! `___prefill_addr_<P>___decode_addr_<D>_<32 hex>`, where `<P>` and `<D>` are the engines'
//! ZMQ addresses (`host:kv_port` of rank 0; rank `r` listens on `kv_port + r`). The prefill
//! reads `<D>` to push its KV there (or to serve it, in `GET` mode); the decode reads `<P>`.
//! Neither body carries transfer fields: the prefill leg is the usual one-token leg, the decode
//! leg is the client's body.

use crate::agent::{
    AgentError, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base, require_ip,
};
use crate::body::{JsonBody, json_type_name, trim_json_ws};
use crate::context::RoutingContext;
use crate::pod::{Pod, url_host};
use crate::rules::{apply_prefill_leg_rules, strip_client_transfer_fields};

/// Connector type (pod label value) of vLLM's P2pNcclConnector.
pub const CONNECTOR_TYPE_P2P_NCCL: &str = "p2pnccl";

/// Pod annotation: the engine's `kv_port` (`--kv-transfer-config`), the ZMQ port of its rank 0.
pub const P2P_NCCL_KV_PORT: &str = "model.aibrix.ai/kv-port";

/// vLLM's default `kv_port` (`KVTransferConfig.kv_port`).
pub const DEFAULT_P2P_NCCL_KV_PORT: u16 = 14579;

/// The marker before the prefill's ZMQ address in a request id.
pub const PREFILL_ADDR_MARKER: &str = "___prefill_addr_";
/// The marker before the decode's ZMQ address in a request id.
pub const DECODE_ADDR_MARKER: &str = "___decode_addr_";

/// A request id naming both engines' addresses, as vLLM's P2P NCCL proxy (and vllm-router)
/// writes it: `___prefill_addr_<prefill>___decode_addr_<decode>_<32 hex>`. The hex part is a
/// fresh v4 UUID, so no two requests share an id (a reused id would mix two transfers).
pub fn addressed_request_id(prefill: &str, decode: &str) -> String {
    format!(
        "{PREFILL_ADDR_MARKER}{prefill}{DECODE_ADDR_MARKER}{decode}_{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// The two addresses an addressed request id names, read as the engines read them: the prefill
/// address ends at the next `___`, the decode address at the last `_` (the UUID's separator).
/// `None` when either is missing or empty.
pub fn parse_addressed_request_id(id: &str) -> Option<(&str, &str)> {
    let after_p = &id[id.find(PREFILL_ADDR_MARKER)? + PREFILL_ADDR_MARKER.len()..];
    let prefill_end = after_p.find(DECODE_ADDR_MARKER)?;
    let prefill = &after_p[..prefill_end];
    let after_d = &after_p[prefill_end + DECODE_ADDR_MARKER.len()..];
    let decode = &after_d[..after_d.rfind('_')?];
    (!prefill.is_empty() && !decode.is_empty()).then_some((prefill, decode))
}

/// Splits a P2pNccl ZMQ address `host:port` (IPv6 hosts in brackets or not) the way vLLM's
/// `parse_request_id` does: the port is the digits after the last `:`.
pub fn split_zmq_address(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!host.is_empty()).then_some((host, port))
}

/// A pod's P2pNccl ZMQ address (`host:kv_port`, IPv6 in brackets).
fn zmq_address(pod: &Pod) -> Result<String, AgentError> {
    let host = url_host(require_ip(pod)?);
    let port = pod
        .annotation(P2P_NCCL_KV_PORT)
        .and_then(|v| v.trim().parse::<u16>().ok())
        .filter(|p| *p != 0)
        .unwrap_or(DEFAULT_P2P_NCCL_KV_PORT);
    Ok(format!("{host}:{port}"))
}

/// The `p2pnccl` agent: sequential; the request id carries both addresses, the bodies carry
/// nothing of the transfer.
#[derive(Clone, Copy, Debug, Default)]
pub struct P2pNcclAgent;

impl KvTransferAgent for P2pNcclAgent {
    fn connector_type(&self) -> &'static str {
        CONNECTOR_TYPE_P2P_NCCL
    }

    fn accepts_ec_transfer_params(&self) -> bool {
        true
    }

    /// A P2pNccl consumer expects every prompt from its producer: a plain request would wait for
    /// KV that no prefill sends.
    fn allows_decode_only(&self) -> bool {
        false
    }

    fn bind_decode(&self, ctx: &mut RoutingContext, decode_pod: &Pod) -> Result<(), AgentError> {
        require_ip(decode_pod)?;
        ctx.transfer.decode_pod = Some(decode_pod.clone());
        Ok(())
    }

    fn augment_prefill_request(
        &self,
        ctx: &mut RoutingContext,
        prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError> {
        let decode = ctx
            .transfer
            .decode_pod
            .as_ref()
            .ok_or(AgentError::MissingState("p2pnccl decode pod not bound"))?;
        let id = addressed_request_id(&zmq_address(prefill_pod)?, &zmq_address(decode)?);
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        apply_prefill_leg_rules(&mut body);
        ctx.transfer.leg_request_id = Some(id);
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    /// The decode gets the client's body under the same addressed id; the prefill's answer
    /// only has to be a JSON object (its KV went by the id, not by the answer).
    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        if ctx.transfer.leg_request_id.is_none() {
            return Err(AgentError::MissingState(
                "p2pnccl request id not set by augment",
            ));
        }
        let trimmed = trim_json_ws(prefill_response);
        if trimmed.first() != Some(&b'{') {
            return Err(AgentError::PrefillResponse {
                pod: prefill_pod.name.clone(),
                reason: format!("expected a JSON object, got {}", json_type_name(trimmed)),
            });
        }
        serde_json::from_slice::<serde::de::IgnoredAny>(trimmed).map_err(|e| {
            AgentError::PrefillResponse {
                pod: prefill_pod.name.clone(),
                reason: e.to_string(),
            }
        })?;
        let decode = decode_base(ctx)?;
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_differ() {
        let a = addressed_request_id("10.0.0.1:14579", "10.0.0.2:14580");
        let b = addressed_request_id("10.0.0.1:14579", "10.0.0.2:14580");
        assert_ne!(a, b);
        assert_eq!(
            parse_addressed_request_id(&a),
            Some(("10.0.0.1:14579", "10.0.0.2:14580"))
        );
        let v6 = addressed_request_id("[fd00::1]:14579", "[fd00::2]:14579");
        let (p, d) = parse_addressed_request_id(&v6).unwrap();
        assert_eq!(split_zmq_address(p), Some(("[fd00::1]", 14579)));
        assert_eq!(split_zmq_address(d), Some(("[fd00::2]", 14579)));
    }

    #[test]
    fn ids_without_both_addresses_are_refused() {
        assert_eq!(parse_addressed_request_id("plain-id"), None);
        assert_eq!(
            parse_addressed_request_id("___prefill_addr_1.1.1.1:1___decode_addr__x"),
            None
        );
        assert_eq!(
            parse_addressed_request_id("___decode_addr_1.1.1.1:1_x"),
            None
        );
        assert_eq!(split_zmq_address("host"), None);
        assert_eq!(split_zmq_address("host:0"), None);
        assert_eq!(split_zmq_address("host:99999"), None);
    }
}
