//! Which handoff a request performs: decided once from the body, the role and
//! the connector, before any response head is sent.

use axum::http::StatusCode;
use serde_json::{Map, Value};

use crate::config::{Connector, Role};
use crate::engine::Engine;
use crate::error::ApiError;
use crate::kv::host_port;
use crate::request::GenRequest;

/// How this request loads its prompt's KV.
pub(crate) enum Consume {
    /// Compute locally (plain request, or a prefill).
    Local,
    /// A decode without KV params: compute locally and count it.
    Recompute,
    /// shfs / nixl: GET the prefill's side channel.
    Pull(String),
    /// mooncake: query the bootstrap server, then wait for the transfer.
    Mooncake {
        bootstrap: String,
        engine_id: String,
        transfer_id: String,
    },
    /// sglang: join the room on the prefill's bootstrap server.
    Sglang(String),
    /// The params are unusable; the request fails like a KV load failure.
    Fail(ApiError),
    /// The params are unusable and the `crash_on_bad_kv_params` fault is on: the engine dies.
    Crash(ApiError),
}

/// What a prefill does with its prompt's KV when it finishes.
pub(crate) enum Produce {
    Nothing,
    /// shfs / nixl: keep it for a pull and return `kv_transfer_params`.
    Params,
    /// mooncake: ship it under `transfer_id` if finished by length.
    Mooncake(String),
    /// sglang: rendezvous with the decode for this room, then publish.
    Sglang(u64),
    Fail(ApiError),
}

pub(crate) struct Plan {
    pub consume: Consume,
    pub produce: Produce,
}

pub(crate) fn kv_fail(message: impl Into<String>) -> ApiError {
    ApiError::handoff(StatusCode::INTERNAL_SERVER_ERROR, message)
}

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

/// Percent-encodes one URL path segment.
pub(crate) fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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

fn sglang_url(req: &GenRequest, engine: &Engine) -> Result<String, ApiError> {
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
    let ms = engine.cfg.handoff_timeout.as_millis();
    Ok(format!(
        "http://{}/room/{room}?timeout_ms={ms}",
        host_port(host, port)
    ))
}

/// Decides the handoff for one request; 400s here are answered before any head.
pub(crate) fn plan(
    engine: &Engine,
    req: &GenRequest,
    dp_rank: Option<&str>,
) -> Result<Plan, ApiError> {
    let role = engine.cfg.role;
    let kvp = req.kv_transfer_params.as_ref();
    let consume = if !role.consumes() {
        Consume::Local
    } else {
        let remote_prefill = kvp.is_some_and(|p| is_true(p, "do_remote_prefill"));
        match engine.cfg.connector {
            Connector::Shfs => match kvp {
                Some(p) if remote_prefill => match nixl_pull_url(p) {
                    Ok(url) => Consume::Pull(url),
                    Err(e) if engine.faults.load().crash_on_bad_kv_params => Consume::Crash(e),
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
            Connector::Sglang if req.bootstrap.any() => Consume::Sglang(sglang_url(req, engine)?),
            Connector::Sglang | Connector::None => Consume::Recompute,
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
        match engine.cfg.connector {
            Connector::Shfs if remote_decode => Produce::Params,
            Connector::Nixl if role == Role::Prefill => Produce::Params,
            Connector::Mooncake if remote_decode => {
                if let Some(rank) = dp_rank
                    && rank.trim() != "0"
                {
                    return Err(ApiError::BadRequest {
                        message: format!("data_parallel_rank {rank} is out of range [0, 1)."),
                        param: None,
                    });
                }
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

pub(crate) fn mooncake_worker(query: &[u8], engine_id: &str) -> Result<String, String> {
    let v: Value = serde_json::from_slice(query)
        .map_err(|e| format!("bootstrap /query answer is not JSON: {e}"))?;
    let ranks = v
        .as_object()
        .ok_or("bootstrap /query answer is not an object")?;
    let rank = ranks
        .values()
        .find(|r| r.get("engine_id").and_then(Value::as_str) == Some(engine_id))
        .ok_or_else(|| {
            format!("remote_engine_id {engine_id:?} is not served by that bootstrap server")
        })?;
    let addr = rank
        .pointer("/worker_addr/0/0")
        .and_then(Value::as_str)
        .ok_or("bootstrap /query answer has no worker_addr")?;
    addr.strip_prefix("tcp://")
        .map(str::to_owned)
        .ok_or_else(|| format!("worker_addr {addr:?} is not tcp://host:port"))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn mooncake_worker_matches_engine_id() {
        let q = br#"{"0":{"engine_id":"a","worker_addr":{"0":{"0":"tcp://h:1"}}},"1":{"engine_id":"b","worker_addr":{"0":{"0":"tcp://h:2"}}}}"#;
        assert_eq!(mooncake_worker(q, "b").unwrap(), "h:2");
        assert!(mooncake_worker(q, "c").unwrap_err().contains("not served"));
        assert!(mooncake_worker(b"{}", "a").is_err());
        assert!(
            mooncake_worker(
                br#"{"0":{"engine_id":"a","worker_addr":{"0":{"0":"h:1"}}}}"#,
                "a"
            )
            .is_err()
        );
        assert!(mooncake_worker(b"[]", "a").is_err());
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
}
