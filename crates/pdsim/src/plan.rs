//! Which handoff a request performs: decided once from the body, the role and
//! the connector, before any response head is sent.

use serde_json::{Map, Value};

use std::time::Duration;

use crate::config::{Connector, Role};
use crate::error::ApiError;
pub(crate) use crate::handoff::{Consume, Plan, PlanInput, Produce, kv_fail};
use crate::kv_pull::{host_port, seg};
use crate::request::GenRequest;

fn is_true(params: &Map<String, Value>, key: &str) -> bool {
    params.get(key).and_then(Value::as_bool) == Some(true)
}

fn need_str<'a>(
    params: &'a Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a str, ApiError> {
    params
        .get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            kv_fail(format!(
                "{what}: kv_transfer_params.{key} is missing or not a string"
            ))
        })
}

/// shfs / nixl decode: the side-channel URL named by vLLM NixlConnector params.
fn nixl_pull_url(params: &Map<String, Value>) -> Result<String, ApiError> {
    const WHAT: &str = "invalid KV transfer params";
    if !params.get("remote_block_ids").is_some_and(Value::is_array) {
        return Err(kv_fail(format!(
            "{WHAT}: kv_transfer_params.remote_block_ids is missing or not an array"
        )));
    }
    let engine_id = need_str(params, "remote_engine_id", WHAT)?;
    let request_id = need_str(params, "remote_request_id", WHAT)?;
    let host = need_str(params, "remote_host", WHAT)?;
    let port = params
        .get("remote_port")
        .and_then(Value::as_u64)
        .filter(|p| (1..=65535).contains(p))
        .ok_or_else(|| {
            kv_fail(format!(
                "{WHAT}: kv_transfer_params.remote_port is missing or not a port"
            ))
        })?;
    Ok(format!(
        "http://{}/kv/{}/{}",
        host_port(host, port),
        seg(engine_id),
        seg(request_id)
    ))
}

fn sglang_url(req: &GenRequest, handoff_timeout: Duration) -> Result<String, ApiError> {
    let b = &req.bootstrap;
    let bad = |m: &str| ApiError::bad(format!("disaggregated decode: {m}"));
    let host = b
        .host
        .as_ref()
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| bad("bootstrap_host is missing or not a string"))?;
    let port = b
        .port
        .as_ref()
        .and_then(Value::as_u64)
        .filter(|p| (1..=65535).contains(p))
        .ok_or_else(|| bad("bootstrap_port is missing or not a port"))?;
    let room = b
        .room
        .as_ref()
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("bootstrap_room is missing or not a non-negative integer"))?;
    let ms = handoff_timeout.as_millis();
    Ok(format!(
        "http://{}/room/{room}?timeout_ms={ms}",
        host_port(host, port)
    ))
}

/// Decides the handoff for one request; 400s here are answered before any head.
pub(crate) fn plan(input: PlanInput, req: &GenRequest, request_id: &str) -> Result<Plan, ApiError> {
    let role = input.role;
    let kvp = req.kv_transfer_params.as_ref();
    let consume = if !role.consumes() {
        Consume::Local
    } else {
        let remote_prefill = kvp.is_some_and(|p| is_true(p, "do_remote_prefill"));
        match input.connector {
            Connector::Shfs => match kvp {
                Some(p) if remote_prefill => match nixl_pull_url(p) {
                    Ok(url) => Consume::Pull(url),
                    Err(e) if input.crash_on_bad_kv_params => Consume::Crash(e),
                    Err(e) => Consume::Fail(e),
                },
                _ => Consume::Recompute,
            },
            Connector::Nixl => match &req.disagg_prefill_resp {
                Some(raw) => match serde_json::from_str::<Value>(raw.get()) {
                    Ok(Value::Object(resp)) => match resp.get("kv_transfer_params") {
                        Some(Value::Object(p)) => match nixl_pull_url(p) {
                            Ok(url) => Consume::Pull(url),
                            Err(e) => Consume::Fail(e),
                        },
                        _ => Consume::Fail(kv_fail(
                            "disagg_prefill_resp carries no kv_transfer_params object",
                        )),
                    },
                    _ => Consume::Fail(kv_fail("disagg_prefill_resp is not a JSON object")),
                },
                None if remote_prefill => Consume::Fail(kv_fail(
                    "connector nixl expects the prefill response under disagg_prefill_resp, not top-level kv_transfer_params",
                )),
                None => Consume::Recompute,
            },
            Connector::Mooncake => match kvp {
                Some(p) if remote_prefill => mooncake_consume(p),
                _ => Consume::Recompute,
            },
            Connector::Sglang if req.bootstrap.any() => {
                Consume::Sglang(sglang_url(req, input.handoff_timeout)?)
            }
            Connector::Sglang | Connector::None => Consume::Recompute,
            Connector::P2pNccl | Connector::Moriio | Connector::MoriioRead | Connector::Trtllm => {
                crate::addressed::consume(input, req, request_id)?
            }
        }
    };
    // A combined engine computing its own prompt is not a "recompute".
    let consume = match consume {
        Consume::Recompute if role != Role::Decode => Consume::Local,
        c => c,
    };
    let produce = if !role.produces() {
        Produce::Nothing
    } else {
        let remote_decode = kvp.is_some_and(|p| is_true(p, "do_remote_decode"));
        match input.connector {
            Connector::Shfs if remote_decode => Produce::Params,
            Connector::Nixl if role == Role::Prefill => Produce::Params,
            Connector::Mooncake if remote_decode => {
                match kvp
                    .and_then(|p| p.get("transfer_id"))
                    .and_then(Value::as_str)
                {
                    Some(t) if !t.is_empty() => Produce::Mooncake(t.to_owned()),
                    _ => Produce::Fail(kv_fail(
                        "kv_transfer_params.transfer_id is required for a mooncake prefill",
                    )),
                }
            }
            Connector::Sglang if role == Role::Prefill => {
                match req.bootstrap.room.as_ref().and_then(Value::as_u64) {
                    Some(room) => Produce::Sglang(room),
                    None => {
                        return Err(ApiError::bad(
                            "disaggregated prefill: bootstrap_room is missing or not a non-negative integer",
                        ));
                    }
                }
            }
            Connector::P2pNccl | Connector::Moriio | Connector::MoriioRead | Connector::Trtllm => {
                crate::addressed::produce(input, req, request_id)?
            }
            _ => Produce::Nothing,
        }
    };
    Ok(Plan { consume, produce })
}

fn mooncake_consume(p: &Map<String, Value>) -> Consume {
    const WHAT: &str = "invalid mooncake KV transfer params";
    let r = (|| {
        let bootstrap = need_str(p, "remote_bootstrap_addr", WHAT)?;
        if !bootstrap.starts_with("http://") {
            return Err(kv_fail(format!(
                "{WHAT}: remote_bootstrap_addr {bootstrap:?} must start with http://"
            )));
        }
        Ok(Consume::Mooncake {
            bootstrap: bootstrap.trim_end_matches('/').to_owned(),
            engine_id: need_str(p, "remote_engine_id", WHAT)?.to_owned(),
            transfer_id: need_str(p, "transfer_id", WHAT)?.to_owned(),
        })
    })();
    r.unwrap_or_else(Consume::Fail)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn nixl_url_needs_every_field_and_brackets_ipv6() {
        let full = serde_json::json!({"remote_block_ids":[[1]],"remote_engine_id":"e/1",
            "remote_request_id":"r","remote_host":"::1","remote_port":5600});
        assert_eq!(
            nixl_pull_url(&obj(full.clone())).unwrap(),
            "http://[::1]:5600/kv/e%2F1/r"
        );
        for key in [
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
        ] {
            let mut m = obj(full.clone());
            m.remove(key);
            let e = nixl_pull_url(&m).unwrap_err();
            assert!(e.to_string().contains(key), "{e}");
            assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        }
        let mut m = obj(full);
        m.insert("remote_port".into(), serde_json::json!(70000));
        assert!(nixl_pull_url(&m).is_err());
    }

    #[test]
    fn mooncake_consume_requires_http_scheme() {
        let p = obj(
            serde_json::json!({"remote_bootstrap_addr":"10.0.0.1:8998","remote_engine_id":"e","transfer_id":"t"}),
        );
        assert!(matches!(mooncake_consume(&p), Consume::Fail(_)));
        let p = obj(
            serde_json::json!({"remote_bootstrap_addr":"http://10.0.0.1:8998/","remote_engine_id":"e","transfer_id":"t"}),
        );
        match mooncake_consume(&p) {
            Consume::Mooncake { bootstrap, .. } => assert_eq!(bootstrap, "http://10.0.0.1:8998"),
            _ => panic!("expected a mooncake pull"),
        }
    }

    /// What a plan decides, by name, so a table can state it.
    pub(crate) fn kinds(p: &Plan) -> (&'static str, &'static str) {
        let c = match &p.consume {
            Consume::Local => "local",
            Consume::Recompute => "recompute",
            Consume::Pull(_) => "pull",
            Consume::Mooncake { .. } => "mooncake",
            Consume::Sglang(_) => "sglang",
            Consume::Wait(_) => "wait",
            Consume::Fail(_) => "fail",
            Consume::Crash(_) => "crash",
        };
        let d = match &p.produce {
            Produce::Nothing => "nothing",
            Produce::Params => "params",
            Produce::Mooncake(_) => "mooncake",
            Produce::Sglang(_) => "sglang",
            Produce::Keep { .. } => "keep",
            Produce::Fail(_) => "fail",
        };
        (c, d)
    }

    pub(crate) fn input(role: Role, connector: Connector, crash: bool) -> PlanInput {
        PlanInput {
            role,
            connector,
            crash_on_bad_kv_params: crash,
            handoff_timeout: Duration::from_secs(10),
        }
    }

    const NIXL_PARAMS: &str = r#""kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":5600}"#;

    /// connector, role, crash fault, body, data-parallel rank header -> (consume, produce),
    /// or the status of the error answered before any head.
    type Case<'a> = (
        Connector,
        Role,
        bool,
        &'a str,
        Result<(&'static str, &'static str), u16>,
    );

    /// connector x role x params -> (consume, produce), or the status of a 400 before any head.
    #[test]
    fn decision_table() {
        use Connector::{Mooncake, Nixl, Sglang, Shfs};
        use Role::{Both, Decode, Prefill};
        let nixl = format!("{{\"prompt\":\"x\",{NIXL_PARAMS}}}");
        let neuron = format!("{{\"prompt\":\"x\",\"disagg_prefill_resp\":{{{NIXL_PARAMS}}}}}");
        let both = format!(
            "{{\"prompt\":\"x\",{}}}",
            NIXL_PARAMS.replace(
                "\"do_remote_prefill\":true",
                "\"do_remote_prefill\":true,\"do_remote_decode\":true"
            )
        );
        let cases: Vec<Case<'_>> = vec![
            // Plain requests: every role computes; only a decode calls it a recompute.
            (
                Shfs,
                Both,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("local", "nothing")),
            ),
            (
                Shfs,
                Decode,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("recompute", "nothing")),
            ),
            (
                Connector::None,
                Decode,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("recompute", "nothing")),
            ),
            (
                Connector::None,
                Prefill,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#,
                Ok(("local", "nothing")),
            ),
            // shfs: the prefill is asked to keep KV; the decode pulls it.
            (
                Shfs,
                Prefill,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#,
                Ok(("local", "params")),
            ),
            (
                Shfs,
                Prefill,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("local", "nothing")),
            ),
            (Shfs, Decode, false, &nixl, Ok(("pull", "nothing"))),
            (
                Shfs,
                Decode,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#,
                Ok(("fail", "nothing")),
            ),
            (
                Shfs,
                Decode,
                true,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#,
                Ok(("crash", "nothing")),
            ),
            (
                Shfs,
                Decode,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":false}}"#,
                Ok(("recompute", "nothing")),
            ),
            // A prefill role never consumes, whatever the body says.
            (Shfs, Prefill, false, &nixl, Ok(("local", "nothing"))),
            // nixl (Neuron): the prefill keeps KV unasked; the decode reads disagg_prefill_resp.
            (
                Nixl,
                Prefill,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("local", "params")),
            ),
            (Nixl, Decode, false, &neuron, Ok(("pull", "nothing"))),
            (Nixl, Decode, false, &nixl, Ok(("fail", "nothing"))),
            (
                Nixl,
                Decode,
                false,
                r#"{"prompt":"x","disagg_prefill_resp":[1]}"#,
                Ok(("fail", "nothing")),
            ),
            (
                Nixl,
                Decode,
                false,
                r#"{"prompt":"x","disagg_prefill_resp":{}}"#,
                Ok(("fail", "nothing")),
            ),
            (
                Nixl,
                Decode,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("recompute", "nothing")),
            ),
            // mooncake: transfer_id is required of a prefill; the decode needs the bootstrap.
            (
                Mooncake,
                Prefill,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true,"transfer_id":"t"}}"#,
                Ok(("local", "mooncake")),
            ),
            (
                Mooncake,
                Prefill,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#,
                Ok(("local", "fail")),
            ),
            (
                Mooncake,
                Prefill,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true,"transfer_id":"t"}}"#,
                Ok(("local", "mooncake")),
            ),
            (
                Mooncake,
                Decode,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_bootstrap_addr":"http://h:1","remote_engine_id":"e","transfer_id":"t"}}"#,
                Ok(("mooncake", "nothing")),
            ),
            (
                Mooncake,
                Decode,
                false,
                r#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","transfer_id":"t"}}"#,
                Ok(("fail", "nothing")),
            ),
            // sglang: a room on both legs; a prefill without one is a 400.
            (
                Sglang,
                Prefill,
                false,
                r#"{"prompt":"x","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#,
                Ok(("local", "sglang")),
            ),
            (Sglang, Prefill, false, r#"{"prompt":"x"}"#, Err(400)),
            (
                Sglang,
                Decode,
                false,
                r#"{"prompt":"x","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#,
                Ok(("sglang", "nothing")),
            ),
            (
                Sglang,
                Decode,
                false,
                r#"{"prompt":"x","bootstrap_host":"h","bootstrap_port":1}"#,
                Err(400),
            ),
            (
                Sglang,
                Decode,
                false,
                r#"{"prompt":"x"}"#,
                Ok(("recompute", "nothing")),
            ),
            // A combined engine may do both sides at once.
            (Shfs, Both, false, &both, Ok(("pull", "params"))),
        ];
        for (i, (connector, role, crash, body, want)) in cases.into_iter().enumerate() {
            let req =
                crate::request::parse(crate::request::Endpoint::Completions, body.as_bytes(), "m")
                    .unwrap();
            let got = plan(input(role, connector, crash), &req, "r");
            match (got, want) {
                (Ok(p), Ok(w)) => assert_eq!(kinds(&p), w, "case {i}: {connector} {role} {body}"),
                (Err(e), Err(status)) => assert_eq!(e.status(), status, "case {i}"),
                (Ok(p), Err(_)) => panic!("case {i}: expected an error, got {:?}", kinds(&p)),
                (Err(e), Ok(_)) => panic!("case {i}: unexpected error {e}"),
            }
        }
    }

    #[test]
    fn sglang_url_carries_the_handoff_timeout() {
        let req = crate::request::parse(
            crate::request::Endpoint::Completions,
            br#"{"prompt":"x","bootstrap_host":"::1","bootstrap_port":8998,"bootstrap_room":42}"#,
            "m",
        )
        .unwrap();
        let mut i = input(Role::Decode, Connector::Sglang, false);
        i.handoff_timeout = Duration::from_millis(1500);
        match plan(i, &req, "r").unwrap().consume {
            Consume::Sglang(url) => assert_eq!(url, "http://[::1]:8998/room/42?timeout_ms=1500"),
            _ => panic!("expected an sglang join"),
        }
    }
}
