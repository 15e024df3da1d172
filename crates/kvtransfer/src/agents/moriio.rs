//! `moriio` / `moriio-read`: vLLM's MoRIIOConnector (AMD MoRI-IO; contracts §11).
//!
//! Each leg's `kv_transfer_params` names the *other* engine: the prefill leg gets the decode's
//! host, HTTP port, handshake and notify ports (`do_remote_decode`), the decode leg the
//! prefill's (`do_remote_prefill`). Both legs carry the same `X-Request-Id` naming both engines
//! (`___prefill_addr_host:H,handshake:P,notify:N___decode_addr_..._<32 hex>`), which newer
//! connector versions read instead of the parameters.
//!
//! Write mode (`moriio`, the connector's default): the prefill writes into blocks the decode
//! allocates, so both legs go at once. Read mode (`moriio-read`,
//! `VLLM_MORIIO_CONNECTOR_READ_MODE`): the decode reads the prefill's blocks, so it waits for
//! the prefill's answer and its `remote_engine_id` and `remote_block_ids`.

use serde::Serialize;
use serde_json::value::RawValue;

use crate::agent::{
    AgentError, Dispatch, KvTransferAgent, MergeOutcome, PrefillRequest, decode_base, require_ip,
};
use crate::agents::p2p_nccl::{DECODE_ADDR_MARKER, PREFILL_ADDR_MARKER};
use crate::body::{JsonBody, json_type_name, top_level_member};
use crate::context::RoutingContext;
use crate::pod::Pod;
use crate::rules::{KV_TRANSFER_PARAMS, apply_prefill_leg_rules, strip_client_transfer_fields};

/// Connector type of vLLM's MoRIIOConnector in write mode (its default).
pub const CONNECTOR_TYPE_MORIIO: &str = "moriio";
/// Connector type of vLLM's MoRIIOConnector in read mode.
pub const CONNECTOR_TYPE_MORIIO_READ: &str = "moriio-read";

/// Pod annotation: the engine's MoRIIO `handshake_port` (`kv_connector_extra_config`).
pub const MORIIO_HANDSHAKE_PORT: &str = "model.aibrix.ai/moriio-handshake-port";
/// Pod annotation: the engine's base MoRIIO `notify_port` (`kv_connector_extra_config`).
pub const MORIIO_NOTIFY_PORT: &str = "model.aibrix.ai/moriio-notify-port";
/// Pod annotation: the engine's tensor-parallel size (default 1).
pub const MORIIO_TP_SIZE: &str = "model.aibrix.ai/tp-size";
/// Pod annotation: the engine's data-parallel size (default 1).
pub const MORIIO_DP_SIZE: &str = "model.aibrix.ai/dp-size";

/// `MoRIIOConstants.DEFAULT_HANDSHAKE_PORT`.
pub const DEFAULT_MORIIO_HANDSHAKE_PORT: u16 = 6301;
/// `MoRIIOConstants.DEFAULT_NOTIFY_PORT`.
pub const DEFAULT_MORIIO_NOTIFY_PORT: u16 = 61005;

fn port_annotation(pod: &Pod, key: &str, default: u16) -> u16 {
    pod.annotation(key)
        .and_then(|v| v.trim().parse::<u16>().ok())
        .filter(|p| *p != 0)
        .unwrap_or(default)
}

fn size_annotation(pod: &Pod, key: &str) -> u32 {
    pod.annotation(key)
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|n| *n != 0)
        .unwrap_or(1)
}

/// One engine as the other leg's parameters name it.
struct Peer<'a> {
    host: &'a str,
    http_port: u16,
    handshake: u16,
    notify: u16,
    tp: u32,
    dp: u32,
}

impl<'a> Peer<'a> {
    fn of(pod: &'a Pod) -> Result<Self, AgentError> {
        Ok(Peer {
            host: require_ip(pod)?,
            http_port: pod.http_port,
            handshake: port_annotation(pod, MORIIO_HANDSHAKE_PORT, DEFAULT_MORIIO_HANDSHAKE_PORT),
            notify: port_annotation(pod, MORIIO_NOTIFY_PORT, DEFAULT_MORIIO_NOTIFY_PORT),
            tp: size_annotation(pod, MORIIO_TP_SIZE),
            dp: size_annotation(pod, MORIIO_DP_SIZE),
        })
    }

    /// The connector's ZMQ address form, `host:IP,handshake:PORT,notify:PORT`.
    fn zmq_address(&self) -> String {
        format!(
            "host:{},handshake:{},notify:{}",
            self.host, self.handshake, self.notify
        )
    }
}

/// `kv_transfer_params` of one leg, in the order vLLM's MoRIIO proxy writes them.
#[derive(Serialize)]
struct Params<'a> {
    do_remote_decode: bool,
    do_remote_prefill: bool,
    remote_handshake_port: u16,
    remote_notify_port: u16,
    remote_engine_id: Option<&'a RawValue>,
    remote_block_ids: Option<&'a RawValue>,
    remote_host: &'a str,
    remote_port: u16,
    remote_dp_size: u32,
    remote_tp_size: u32,
}

impl<'a> Params<'a> {
    fn naming(peer: &Peer<'a>, prefill_leg: bool) -> Self {
        Params {
            do_remote_decode: prefill_leg,
            do_remote_prefill: !prefill_leg,
            remote_handshake_port: peer.handshake,
            remote_notify_port: peer.notify,
            remote_engine_id: None,
            remote_block_ids: None,
            remote_host: peer.host,
            remote_port: peer.http_port,
            remote_dp_size: peer.dp,
            remote_tp_size: peer.tp,
        }
    }
}

/// The MoRIIO agent, in write mode (`read == false`, concurrent legs) or read mode (sequential).
#[derive(Clone, Copy, Debug, Default)]
pub struct MoriioAgent {
    read: bool,
}

impl MoriioAgent {
    /// The write-mode agent (`moriio`).
    pub fn write() -> Self {
        MoriioAgent { read: false }
    }

    /// The read-mode agent (`moriio-read`).
    pub fn read() -> Self {
        MoriioAgent { read: true }
    }

    fn decode_pod<'c>(&self, ctx: &'c RoutingContext) -> Result<&'c Pod, AgentError> {
        ctx.transfer
            .decode_pod
            .as_ref()
            .ok_or(AgentError::MissingState("moriio decode pod not bound"))
    }
}

impl KvTransferAgent for MoriioAgent {
    fn accepts_ec_transfer_params(&self) -> bool {
        true
    }

    fn connector_type(&self) -> &'static str {
        if self.read {
            CONNECTOR_TYPE_MORIIO_READ
        } else {
            CONNECTOR_TYPE_MORIIO
        }
    }

    fn dispatch(&self) -> Dispatch {
        if self.read {
            Dispatch::Sequential
        } else {
            Dispatch::Concurrent
        }
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
        let prefill = Peer::of(prefill_pod)?;
        let decode_pod = self.decode_pod(ctx)?;
        let decode = Peer::of(decode_pod)?;
        let id = format!(
            "{PREFILL_ADDR_MARKER}{}{DECODE_ADDR_MARKER}{}_{}",
            prefill.zmq_address(),
            decode.zmq_address(),
            uuid::Uuid::new_v4().simple()
        );
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        apply_prefill_leg_rules(&mut body);
        body.set(KV_TRANSFER_PARAMS, &Params::naming(&decode, true))?;
        ctx.transfer.leg_request_id = Some(id);
        Ok(PrefillRequest::new(body.to_bytes()))
    }

    /// Write mode: called with an empty answer before both legs go; read mode: reads the
    /// prefill's `remote_engine_id` and `remote_block_ids` (an answer without
    /// `kv_transfer_params` lets the decode recompute).
    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        if ctx.transfer.leg_request_id.is_none() {
            return Err(AgentError::MissingState(
                "moriio request id not set by augment",
            ));
        }
        let mut decode = decode_base(ctx)?;
        let prefill = Peer::of(prefill_pod)?;
        let mut params = Params::naming(&prefill, false);
        let bad = |reason: String| AgentError::PrefillResponse {
            pod: prefill_pod.name.clone(),
            reason,
        };
        if self.read {
            let raw = top_level_member(prefill_response, KV_TRANSFER_PARAMS)
                .map_err(|e| bad(e.to_string()))?
                .unwrap_or("null");
            let found = json_type_name(raw.as_bytes());
            if raw == "null" {
                tracing::warn!(
                    request_id = %ctx.request_id,
                    pod = %prefill_pod.name,
                    "moriio read-mode prefill answered without kv_transfer_params; decode will recompute the prompt"
                );
                ctx.req_body = decode.to_bytes();
                return Ok(MergeOutcome::Recompute);
            }
            if !raw.starts_with('{') {
                return Err(AgentError::UnexpectedType {
                    pod: prefill_pod.name.clone(),
                    found,
                });
            }
            let got = JsonBody::parse(bytes::Bytes::copy_from_slice(raw.as_bytes()))
                .map_err(|e| bad(e.to_string()))?;
            let engine = got
                .get_raw("remote_engine_id")
                .filter(|r| r.starts_with('"'));
            let blocks = got
                .get_raw("remote_block_ids")
                .filter(|r| r.starts_with('['));
            let (Some(engine), Some(blocks)) = (engine, blocks) else {
                return Err(bad(
                    "kv_transfer_params needs a string remote_engine_id and an array remote_block_ids in read mode".into(),
                ));
            };
            let engine: &RawValue = serde_json::from_str(engine).map_err(|e| bad(e.to_string()))?;
            let blocks: &RawValue = serde_json::from_str(blocks).map_err(|e| bad(e.to_string()))?;
            params.remote_engine_id = Some(engine);
            params.remote_block_ids = Some(blocks);
            decode.set(KV_TRANSFER_PARAMS, &params)?;
        } else {
            decode.set(KV_TRANSFER_PARAMS, &params)?;
        }
        ctx.req_body = decode.to_bytes();
        Ok(MergeOutcome::KvAttached)
    }
}
