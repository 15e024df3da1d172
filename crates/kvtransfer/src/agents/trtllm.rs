//! `trtllm`: TensorRT-LLM disaggregated serving (`trtllm-serve` context and generation
//! servers; contracts §12).
//!
//! The context leg is the client's body, not streamed, with
//! `disaggregated_params: {"request_type":"context_only","disagg_request_id":N}`. The context
//! server answers one choice whose `disaggregated_params` (`ctx_request_id`, `first_gen_tokens`,
//! the opaque transfer state, ...) the generation leg carries back verbatim with
//! `request_type` set to `"generation_only"`, together with the prompt's token ids the context
//! server tokenized (`prompt` for completions, `prompt_token_ids` for chat).

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::agent::{AgentError, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base};
use crate::body::JsonBody;
use crate::context::RoutingContext;
use crate::pod::Pod;
use crate::rules::strip_client_transfer_fields;

/// Connector type of TensorRT-LLM disaggregated serving.
pub const CONNECTOR_TYPE_TRTLLM: &str = "trtllm";

/// Body field carrying TensorRT-LLM's phase and transfer parameters.
pub const DISAGGREGATED_PARAMS: &str = "disaggregated_params";

/// The context server's answer, as far as the generation leg needs it.
#[derive(Deserialize)]
struct ContextAnswer<'a> {
    #[serde(borrow)]
    choices: Vec<ContextChoice<'a>>,
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ContextChoice<'a> {
    #[serde(borrow, default)]
    disaggregated_params: Option<&'a RawValue>,
    #[serde(default)]
    finish_reason: Option<String>,
}

/// A random disaggregated request id in `1..2^63`.
fn random_disagg_id() -> u64 {
    let (hi, lo) = uuid::Uuid::new_v4().as_u64_pair();
    ((hi ^ lo.rotate_left(32)) & (i64::MAX as u64)).max(1)
}

/// The `trtllm` agent: sequential; the context phase's `disaggregated_params` go to the
/// generation phase.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrtllmAgent;

impl KvTransferAgent for TrtllmAgent {
    fn connector_type(&self) -> &'static str {
        CONNECTOR_TYPE_TRTLLM
    }

    /// TensorRT-LLM validates requests its own way (not vLLM's list): only the gateway's own
    /// body, model and batch checks apply.
    fn check_request(
        &self,
        _body: &JsonBody,
        _endpoint: crate::checks::Endpoint,
    ) -> Result<(), crate::checks::EngineReject> {
        Ok(())
    }

    fn augment_prefill_request(
        &self,
        ctx: &mut RoutingContext,
        _prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError> {
        let id = random_disagg_id();
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        body.set_raw("stream", "false");
        body.remove("stream_options");
        body.set_raw(
            DISAGGREGATED_PARAMS,
            format!(r#"{{"request_type":"context_only","disagg_request_id":{id}}}"#),
        );
        ctx.transfer.disagg_request_id = Some(id);
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        let id = ctx
            .transfer
            .disagg_request_id
            .ok_or(AgentError::MissingState(
                "trtllm disagg_request_id not set by augment",
            ))?;
        let bad = |reason: String| AgentError::PrefillResponse {
            pod: prefill_pod.name.clone(),
            reason,
        };
        let answer: ContextAnswer<'_> =
            serde_json::from_slice(prefill_response).map_err(|e| bad(e.to_string()))?;
        let [choice] = answer.choices.as_slice() else {
            return Err(bad(format!(
                "context server returned {} choices, expecting 1",
                answer.choices.len()
            )));
        };
        let mut decode = decode_base(ctx)?;
        // Finished in the context phase (a stop on the first token): there is nothing to hand
        // over; the generation server serves the plain request.
        if !matches!(
            choice.finish_reason.as_deref(),
            None | Some("length" | "not_finished")
        ) {
            ctx.req_body = decode.to_bytes();
            return Ok(MergeOutcome::Recompute);
        }
        let raw = choice
            .disaggregated_params
            .ok_or_else(|| AgentError::MissingHandoff {
                pod: prefill_pod.name.clone(),
                what: "disaggregated_params",
            })?;
        let mut params = JsonBody::parse(Bytes::copy_from_slice(raw.get().as_bytes()))
            .map_err(|e| bad(format!("disaggregated_params: {e}")))?;
        if params
            .get_raw("ctx_request_id")
            .is_none_or(|v| v.trim() == "null")
        {
            return Err(AgentError::MissingHandoff {
                pod: prefill_pod.name.clone(),
                what: "disaggregated_params.ctx_request_id",
            });
        }
        params.set_raw("request_type", r#""generation_only""#);
        params.set_raw("disagg_request_id", id.to_string());
        decode.set_raw(DISAGGREGATED_PARAMS, params.to_bytes());
        if let Some(ids) = answer.prompt_token_ids.filter(|r| r.get().starts_with('[')) {
            let ids = Bytes::copy_from_slice(ids.get().as_bytes());
            if decode.contains_key("messages") {
                decode.set_raw("prompt_token_ids", ids);
            } else if decode.contains_key("prompt") {
                decode.set_raw("prompt", ids);
            }
        }
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn disagg_ids_are_positive_i64_and_vary() {
        let ids: std::collections::BTreeSet<u64> = (0..32).map(|_| random_disagg_id()).collect();
        assert_eq!(ids.len(), 32);
        assert!(ids.iter().all(|i| *i >= 1 && *i <= i64::MAX as u64));
    }
}
