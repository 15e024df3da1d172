//! `shfs` (default): vLLM NixlConnector wire format with AIBrix semantics
//! (contracts §3).

use bytes::Bytes;

use crate::agent::{
    AgentError, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base, require_ip,
};
use crate::body::{BodyError, JsonBody, Nested, json_type_name, member_with_member};
use crate::context::RoutingContext;
use crate::pod::Pod;
use crate::rules::{KV_TRANSFER_PARAMS, apply_prefill_leg_rules, strip_client_transfer_fields};

/// The exact `kv_transfer_params` of an shfs prefill leg.
pub const SHFS_PREFILL_KV_TRANSFER_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The `shfs` agent: sequential; the prefill's `kv_transfer_params` are copied
/// verbatim to decode with `remote_host` set to the prefill pod IP.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShfsAgent;

impl KvTransferAgent for ShfsAgent {
    fn connector_type(&self) -> &'static str {
        crate::CONNECTOR_TYPE_SHFS
    }

    /// vLLM 0.32 takes `kv_transfer_params` on `/v1/responses` and `/v1/messages` too
    /// (NixlConnector checked on real engines).
    fn carries_responses_and_messages(&self) -> bool {
        true
    }

    fn accepts_ec_transfer_params(&self) -> bool {
        true
    }

    fn augment_prefill_request(
        &self,
        _ctx: &mut RoutingContext,
        _prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError> {
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        apply_prefill_leg_rules(&mut body);
        body.set_raw(
            KV_TRANSFER_PARAMS,
            Bytes::from_static(SHFS_PREFILL_KV_TRANSFER_PARAMS.as_bytes()),
        );
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        let mut decode = decode_base(ctx)?;
        let ip = require_ip(prefill_pod)?;
        let bad_response = |reason: String| AgentError::PrefillResponse {
            pod: prefill_pod.name.clone(),
            reason,
        };
        let host = serde_json::to_vec(ip).map_err(|source| BodyError::Serialize {
            key: "remote_host".into(),
            source,
        })?;
        // Only `kv_transfer_params` is used (with `remote_host` set to the prefill's address);
        // the rest of the response is validated and skipped.
        let params = match member_with_member(
            prefill_response,
            KV_TRANSFER_PARAMS,
            "remote_host",
            &host,
        )
        .map_err(|e| bad_response(e.to_string()))?
        {
            Nested::Object(params) => params,
            Nested::Other(raw) if raw != "null" => {
                return Err(AgentError::UnexpectedType {
                    pod: prefill_pod.name.clone(),
                    found: json_type_name(raw.as_bytes()),
                });
            }
            Nested::Other(_) | Nested::Absent => {
                tracing::warn!(
                    request_id = %ctx.request_id,
                    pod = %prefill_pod.name,
                    "prefill response has no kv_transfer_params; decode will recompute the prompt"
                );
                ctx.req_body = decode.to_bytes();
                return Ok(MergeOutcome::Recompute);
            }
        };
        decode.set_raw(KV_TRANSFER_PARAMS, params);
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}
