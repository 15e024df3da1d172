//! `nixl`: AWS Neuron NixlConnector (contracts §4).

use bytes::Bytes;

use crate::agent::{AgentError, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base};
use crate::body::{JsonBody, json_type_name, trim_json_ws};
use crate::context::RoutingContext;
use crate::pod::Pod;
use crate::rules::{apply_prefill_leg_rules, strip_client_transfer_fields};

/// Decode-body key carrying the whole prefill response.
pub const DISAGG_PREFILL_RESP: &str = "disagg_prefill_resp";

/// The `nixl` (Neuron) agent: sequential; the whole prefill response goes to
/// decode under `disagg_prefill_resp`, byte for byte.
#[derive(Clone, Copy, Debug, Default)]
pub struct NixlAgent;

impl KvTransferAgent for NixlAgent {
    fn connector_type(&self) -> &'static str {
        crate::CONNECTOR_TYPE_NIXL
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
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        let mut decode = decode_base(ctx)?;
        let trimmed = trim_json_ws(prefill_response);
        let bad = |reason: String| AgentError::PrefillResponse {
            pod: prefill_pod.name.clone(),
            reason,
        };
        if trimmed.first() != Some(&b'{') {
            return Err(bad(format!(
                "expected a JSON object, got {}",
                json_type_name(trimmed)
            )));
        }
        serde_json::from_slice::<serde::de::IgnoredAny>(trimmed).map_err(|e| bad(e.to_string()))?;
        decode.set_raw(DISAGG_PREFILL_RESP, Bytes::copy_from_slice(trimmed));
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}
