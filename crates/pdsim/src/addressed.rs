//! Handoffs where each engine is told where its peer is: vLLM's P2pNcclConnector (addresses in
//! the request id), MoRIIOConnector (the peer in `kv_transfer_params`, write and read mode) and
//! TensorRT-LLM (`disaggregated_params` phases with an opaque transfer state).
//!
//! Every one of them is served the same way here: the prefill keeps its prompt's KV under a key
//! both sides know (the request id, or TensorRT-LLM's `ctx_request_id`), and the decode waits
//! for it on the side channel of the address it was given (`GET /p2p/{key}`). A handoff the real
//! engine could not perform fails here too: a missing or malformed address, a request sent in
//! the wrong phase, a key already in use.

use serde_json::{Map, Value};

use crate::config::{Connector, Role};
use crate::error::ApiError;
pub(crate) use crate::handoff::Answer;
use crate::handoff::{Consume, PlanInput, Produce, kv_fail};
use crate::kv_pull::{host_port, seg};
use crate::request::GenRequest;

/// The marker before the prefill's address in an addressed request id.
const PREFILL_ADDR: &str = "___prefill_addr_";
/// The marker before the decode's address in an addressed request id.
const DECODE_ADDR: &str = "___decode_addr_";

/// What vLLM's `P2pNcclConnector.parse_request_id` reads: the address after `marker`, up to
/// `___` for the prefill's, up to the id's last `_` for the decode's; `host:port`.
fn address_in_id(id: &str, prefill: bool) -> Option<(&str, u64)> {
    let (marker, end) = if prefill {
        (PREFILL_ADDR, DECODE_ADDR)
    } else {
        (DECODE_ADDR, "_")
    };
    let rest = &id[id.find(marker)? + marker.len()..];
    let addr = if prefill {
        &rest[..rest.find(end)?]
    } else {
        &rest[..rest.rfind(end)?]
    };
    let (host, port) = addr.rsplit_once(':')?;
    let port: u64 = port.parse().ok().filter(|p| (1..=65535).contains(p))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then_some((host, port))
}

fn wait_url(host: &str, port: u64, key: &str, input: &PlanInput) -> String {
    format!(
        "http://{}/p2p/{}?timeout_ms={}",
        host_port(host, port),
        seg(key),
        input.handoff_timeout.as_millis()
    )
}

fn port_of(p: &Map<String, Value>, key: &str) -> Option<u64> {
    p.get(key)
        .and_then(Value::as_u64)
        .filter(|p| (1..=65535).contains(p))
}

fn is_true(p: &Map<String, Value>, key: &str) -> bool {
    p.get(key).and_then(Value::as_bool) == Some(true)
}

/// MoRIIO: the peer's host and handshake port from `kv_transfer_params` (a missing one is the
/// `KeyError` the connector raises).
fn moriio_peer(p: &Map<String, Value>) -> Result<(&str, u64), ApiError> {
    const WHAT: &str = "invalid MoRIIO KV transfer params";
    let host = p
        .get("remote_host")
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| {
            kv_fail(format!(
                "{WHAT}: kv_transfer_params.remote_host is missing or not a string"
            ))
        })?;
    let handshake = port_of(p, "remote_handshake_port").ok_or_else(|| {
        kv_fail(format!(
            "{WHAT}: kv_transfer_params.remote_handshake_port is missing or not a port"
        ))
    })?;
    port_of(p, "remote_notify_port").ok_or_else(|| {
        kv_fail(format!(
            "{WHAT}: kv_transfer_params.remote_notify_port is missing or not a port"
        ))
    })?;
    Ok((host, handshake))
}

/// The opaque transfer state a simulated TensorRT-LLM context server hands out: its side
/// channel's `host:port`, hex-encoded (the gateway must carry it, not read it).
pub(crate) fn opaque_state(host: &str, port: u16) -> String {
    format!("{host}:{port}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn read_opaque_state(hex: &str) -> Option<(String, u64)> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (host, port) = text.rsplit_once(':')?;
    let port: u64 = port.parse().ok().filter(|p| (1..=65535).contains(p))?;
    Some((host.to_owned(), port))
}

fn phase(req: &GenRequest) -> Option<&str> {
    req.disaggregated_params
        .as_ref()
        .map(|d| d.get("request_type").and_then(Value::as_str).unwrap_or(""))
}

/// How a consumer of an addressed connector loads its prompt.
///
/// # Errors
/// A request in the wrong phase for this server (TensorRT-LLM): a 400 before any head.
pub(crate) fn consume(
    input: PlanInput,
    req: &GenRequest,
    request_id: &str,
) -> Result<Consume, ApiError> {
    let kvp = req.kv_transfer_params.as_ref();
    Ok(match input.connector {
        Connector::P2pNccl => match address_in_id(request_id, true) {
            Some((host, port)) => Consume::Wait(wait_url(host, port, request_id, &input)),
            None => Consume::Fail(kv_fail(format!(
                "Request id {request_id} does not contain hostname and port"
            ))),
        },
        Connector::Moriio | Connector::MoriioRead => match kvp {
            Some(p) if is_true(p, "do_remote_decode") => Consume::Fail(kv_fail(
                "kv_transfer_params.do_remote_decode is set on a MoRIIO consumer (a prefill-phase request sent to a decode)",
            )),
            Some(p) if is_true(p, "do_remote_prefill") => {
                if input.connector == Connector::MoriioRead
                    && (!p.get("remote_block_ids").is_some_and(Value::is_array)
                        || !p.get("remote_engine_id").is_some_and(Value::is_string))
                {
                    return Ok(Consume::Fail(kv_fail(
                        "invalid MoRIIO KV transfer params: read mode needs remote_engine_id and remote_block_ids from the prefill",
                    )));
                }
                match moriio_peer(p) {
                    Ok((host, port)) => Consume::Wait(wait_url(host, port, request_id, &input)),
                    Err(e) => Consume::Fail(e),
                }
            }
            _ => Consume::Recompute,
        },
        Connector::Trtllm => match phase(req) {
            None => Consume::Recompute,
            Some("generation_only") => {
                let Some(d) = req.disaggregated_params.as_ref() else {
                    return Ok(Consume::Recompute);
                };
                let Some(ctx_id) = d.get("ctx_request_id").and_then(Value::as_u64) else {
                    return Ok(Consume::Fail(kv_fail(
                        "disaggregated_params.ctx_request_id is missing or not an integer",
                    )));
                };
                match d
                    .get("opaque_state")
                    .and_then(Value::as_str)
                    .and_then(read_opaque_state)
                {
                    Some((host, port)) => {
                        Consume::Wait(wait_url(&host, port, &ctx_id.to_string(), &input))
                    }
                    None => Consume::Fail(kv_fail(
                        "disaggregated_params.opaque_state is missing or unreadable",
                    )),
                }
            }
            Some(other) => {
                return Err(ApiError::bad(format!(
                    "a generation server cannot serve request_type {other:?} (want \"generation_only\")"
                )));
            }
        },
        _ => Consume::Recompute,
    })
}

/// What a producer of an addressed connector does with its prompt's KV.
pub(crate) fn produce(
    input: PlanInput,
    req: &GenRequest,
    request_id: &str,
) -> Result<Produce, ApiError> {
    let kvp = req.kv_transfer_params.as_ref();
    Ok(match input.connector {
        // The prefill pushes to (or is fetched by) the decode the id names: no id, no transfer.
        Connector::P2pNccl => match address_in_id(request_id, false) {
            Some(_) => Produce::Keep {
                key: request_id.to_owned(),
                answer: Answer::Nothing,
            },
            None => Produce::Fail(kv_fail(format!(
                "Request id {request_id} does not contain hostname and port"
            ))),
        },
        Connector::Moriio | Connector::MoriioRead => match kvp {
            Some(p) if is_true(p, "do_remote_prefill") => Produce::Fail(kv_fail(
                "kv_transfer_params.do_remote_prefill is set on a MoRIIO producer (a decode-phase request sent to a prefill)",
            )),
            Some(p) if is_true(p, "do_remote_decode") => match moriio_peer(p) {
                Ok(_) => Produce::Keep {
                    key: request_id.to_owned(),
                    answer: if input.connector == Connector::MoriioRead {
                        Answer::MoriioRead
                    } else {
                        Answer::Nothing
                    },
                },
                Err(e) => Produce::Fail(e),
            },
            _ => Produce::Nothing,
        },
        Connector::Trtllm => match phase(req) {
            None => Produce::Nothing,
            Some("context_only") if input.role == Role::Prefill => {
                let disagg_request_id = req
                    .disaggregated_params
                    .as_ref()
                    .and_then(|d| d.get("disagg_request_id"))
                    .and_then(Value::as_u64);
                let ctx_id = rand::random::<u64>() & (i64::MAX as u64);
                Produce::Keep {
                    key: ctx_id.to_string(),
                    answer: Answer::Trtllm { disagg_request_id },
                }
            }
            Some(other) => {
                return Err(ApiError::bad(format!(
                    "a context server cannot serve request_type {other:?} (want \"context_only\")"
                )));
            }
        },
        _ => Produce::Nothing,
    })
}

/// `body` (a complete answer) with the context phase's `disaggregated_params` in its first
/// choice, as `trtllm-serve` answers. Its top-level `prompt_token_ids` is null: pdsim's KV
/// digest is over the prompt as sent (text or ids), so a generation request must resend the
/// prompt as the context request had it (a real context server returns the ids it tokenized).
pub(crate) fn trtllm_context_body(body: &str, params: &Value, _prompt_ids: &[u32]) -> String {
    let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(body) else {
        return body.to_owned();
    };
    if let Some(Value::Object(choice)) = v
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .and_then(|c| c.first_mut())
    {
        choice.insert("disaggregated_params".into(), params.clone());
    }
    v.insert("prompt_token_ids".into(), Value::Null);
    v.remove("kv_transfer_params");
    serde_json::to_string(&v).unwrap_or_else(|_| body.to_owned())
}

#[allow(clippy::unwrap_used)]
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_both_addresses() {
        let id = "___prefill_addr_10.0.0.1:14579___decode_addr_[fd00::2]:14580_0123456789abcdef0123456789abcdef";
        assert_eq!(address_in_id(id, true), Some(("10.0.0.1", 14579)));
        assert_eq!(address_in_id(id, false), Some(("fd00::2", 14580)));
        assert_eq!(address_in_id("plain", true), None);
        assert_eq!(
            address_in_id("___prefill_addr_x___decode_addr_y_z", true),
            None
        );
    }

    /// connector, role, X-Request-Id, body -> (consume, produce), or the status answered
    /// before any head: every wrong handoff fails the way the engine would.
    #[test]
    fn decision_table() {
        use crate::plan::plan;
        use crate::plan::tests::{input, kinds};
        use Connector::{Moriio, MoriioRead, P2pNccl, Trtllm};
        use Role::{Decode, Prefill};
        let id = "___prefill_addr_10.0.0.1:14579___decode_addr_10.0.0.2:14579_0123456789abcdef0123456789abcdef";
        let moriio_p = r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_handshake_port":6301,"remote_notify_port":61005,"remote_host":"10.0.0.2","remote_port":8000}}"#;
        let moriio_d = r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_handshake_port":6301,"remote_notify_port":61005,"remote_host":"10.0.0.1","remote_port":8000}}"#;
        let moriio_d_read = r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_handshake_port":6301,"remote_notify_port":61005,"remote_host":"10.0.0.1","remote_port":8000,"remote_engine_id":"e","remote_block_ids":[1,2]}}"#;
        let no_host = moriio_d.replace(r#""remote_host":"10.0.0.1","#, "");
        let ctx = r#"{"prompt":"x","disaggregated_params":{"request_type":"context_only","disagg_request_id":7}}"#;
        let state = opaque_state("10.0.0.1", 9000);
        let gen_ok = format!(
            r#"{{"prompt":"x","disaggregated_params":{{"request_type":"generation_only","ctx_request_id":5,"opaque_state":"{state}"}}}}"#
        );
        let gen_no_state = r#"{"prompt":"x","disaggregated_params":{"request_type":"generation_only","ctx_request_id":5}}"#;
        let gen_no_ctx = format!(
            r#"{{"prompt":"x","disaggregated_params":{{"request_type":"generation_only","opaque_state":"{state}"}}}}"#
        );
        let plain = r#"{"prompt":"x"}"#;
        type Case<'a> = (
            Connector,
            Role,
            &'a str,
            &'a str,
            Result<(&'static str, &'static str), u16>,
        );
        let cases: Vec<Case<'_>> = vec![
            (P2pNccl, Prefill, id, plain, Ok(("local", "keep"))),
            (P2pNccl, Decode, id, plain, Ok(("wait", "nothing"))),
            // A missing address: the connector cannot parse the id.
            (P2pNccl, Prefill, "plain-id", plain, Ok(("local", "fail"))),
            (P2pNccl, Decode, "plain-id", plain, Ok(("fail", "nothing"))),
            (Moriio, Prefill, id, moriio_p, Ok(("local", "keep"))),
            (Moriio, Decode, id, moriio_d, Ok(("wait", "nothing"))),
            (Moriio, Decode, id, plain, Ok(("recompute", "nothing"))),
            // Wrong phase: each leg's parameters sent to the other side.
            (Moriio, Prefill, id, moriio_d, Ok(("local", "fail"))),
            (Moriio, Decode, id, moriio_p, Ok(("fail", "nothing"))),
            // A missing address.
            (Moriio, Decode, id, &no_host, Ok(("fail", "nothing"))),
            // Read mode needs what the prefill answered.
            (MoriioRead, Decode, id, moriio_d, Ok(("fail", "nothing"))),
            (
                MoriioRead,
                Decode,
                id,
                moriio_d_read,
                Ok(("wait", "nothing")),
            ),
            (Trtllm, Prefill, "r", ctx, Ok(("local", "keep"))),
            (Trtllm, Decode, "r", &gen_ok, Ok(("wait", "nothing"))),
            (Trtllm, Decode, "r", plain, Ok(("recompute", "nothing"))),
            (Trtllm, Decode, "r", gen_no_state, Ok(("fail", "nothing"))),
            (Trtllm, Decode, "r", &gen_no_ctx, Ok(("fail", "nothing"))),
            // Wrong phase: a 400 before any head (prefill) or a failed load (decode).
            (Trtllm, Prefill, "r", &gen_ok, Err(400)),
            (Trtllm, Decode, "r", ctx, Err(400)),
        ];
        for (i, (connector, role, rid, body, want)) in cases.into_iter().enumerate() {
            let req =
                crate::request::parse(crate::request::Endpoint::Completions, body.as_bytes(), "m")
                    .unwrap();
            let got = plan(input(role, connector, false), &req, rid);
            match (got, want) {
                (Ok(p), Ok(w)) => assert_eq!(kinds(&p), w, "case {i}: {connector} {role} {body}"),
                (Err(e), Err(status)) => assert_eq!(e.status(), status, "case {i}"),
                (Ok(p), Err(_)) => panic!("case {i}: expected an error, got {:?}", kinds(&p)),
                (Err(e), Ok(_)) => panic!("case {i}: unexpected error {e}"),
            }
        }
    }

    #[test]
    fn opaque_state_round_trips() {
        let s = opaque_state("127.0.0.1", 4321);
        assert_eq!(read_opaque_state(&s), Some(("127.0.0.1".into(), 4321)));
        assert_eq!(read_opaque_state("zz"), None);
        assert_eq!(read_opaque_state("abc"), None);
    }
}
