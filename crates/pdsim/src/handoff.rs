//! The vocabulary of a request's handoff: what the engine facts are ([`PlanInput`]), how the
//! request loads its prompt's KV ([`Consume`]) and what a prefill does with it ([`Produce`]).
//! [`crate::plan`] decides them; the addressed connectors ([`crate::addressed`]) add their own.

use std::time::Duration;

use axum::http::StatusCode;

use crate::config::{Connector, Role};
use crate::error::ApiError;

/// The engine facts a plan depends on; nothing else of the engine is read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanInput {
    pub role: Role,
    pub connector: Connector,
    /// The `crash_on_bad_kv_params` fault, read once per request.
    pub crash_on_bad_kv_params: bool,
    /// Bounds the sglang rendezvous the decode asks its prefill for.
    pub handoff_timeout: Duration,
}

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
    /// p2pnccl / moriio / trtllm: wait for the KV on the side channel of the address the
    /// request named ([`crate::addressed`]).
    Wait(String),
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
    /// p2pnccl / moriio / trtllm: keep it under `key` for the decode's wait, and answer as the
    /// connector does ([`crate::addressed`]).
    Keep {
        key: String,
        answer: Answer,
    },
    Fail(ApiError),
}

pub(crate) struct Plan {
    pub consume: Consume,
    pub produce: Produce,
}

pub(crate) fn kv_fail(message: impl Into<String>) -> ApiError {
    ApiError::handoff(StatusCode::INTERNAL_SERVER_ERROR, message)
}

/// What a prefill answers about the KV it kept, besides keeping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Nothing: the decode finds the KV by the key alone.
    Nothing,
    /// MoRIIO read mode: `kv_transfer_params` with the engine id and block ids.
    MoriioRead,
    /// TensorRT-LLM context phase: `disaggregated_params` in the choice, `prompt_token_ids`.
    Trtllm {
        /// The `disagg_request_id` the context request carried.
        disagg_request_id: Option<u64>,
    },
}
