//! The KV-transfer agent interface: how one connector shapes the two legs.

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use crate::body::{BodyError, JsonBody};
use crate::checks::{self, EngineReject};
use crate::context::RoutingContext;
use crate::pod::Pod;
use crate::rules::strip_client_transfer_fields;

/// Header naming the data-parallel rank a request must run on (vLLM).
pub const DATA_PARALLEL_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The prefill leg an agent built: body bytes and extra headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillRequest {
    /// The prefill body to send (same path as the client used).
    pub body: Bytes,
    /// Extra headers for the prefill leg, e.g. `x-data-parallel-rank: 0`. Typed, so a
    /// gateway can set them without checking (or panicking on) names at request time.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl PrefillRequest {
    /// A prefill leg with `body` and no extra headers.
    pub fn new(body: Bytes) -> Self {
        PrefillRequest {
            body,
            headers: Vec::new(),
        }
    }
}

/// A call the gateway makes to an engine on a connector's behalf (e.g. SGLang's abort): a
/// `POST` of `body` (JSON) to `path` on the engine, bounded by the gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineCall {
    /// Request path on the engine, e.g. `/abort_request`.
    pub path: &'static str,
    /// JSON body.
    pub body: Bytes,
}

/// How the gateway schedules the two legs for an agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dispatch {
    /// Send prefill, await its response, merge it, then send decode.
    Sequential,
    /// Call augment, then merge with an empty prefill response, and send both
    /// legs at once; a prefill failure must cancel the decode.
    Concurrent,
}

/// What a merge achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MergeOutcome {
    /// The decode body carries what decode needs to pull the prefilled KV.
    KvAttached,
    /// The prefill gave no transfer parameters: decode gets the original body
    /// and recomputes the prompt (count it and warn).
    Recompute,
}

/// Errors from an agent's augment or merge.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The client's body is unusable (not an object, duplicate keys, invalid).
    /// A client error (400).
    #[error("client request body: {0}")]
    Body(#[from] BodyError),
    /// The prefill response is not the JSON the connector expects.
    #[error("prefill response from pod {pod}: {reason}")]
    PrefillResponse {
        /// Prefill pod name.
        pod: String,
        /// What was wrong.
        reason: String,
    },
    /// The prefill response's `kv_transfer_params` is neither an object nor null.
    #[error(
        "prefill response from pod {pod}: kv_transfer_params has unexpected type {found} (want object)"
    )]
    UnexpectedType {
        /// Prefill pod name.
        pod: String,
        /// JSON type found.
        found: &'static str,
    },
    /// The prefill pod has no IP to put in the decode parameters.
    #[error("prefill pod {pod:?} has no PodIP")]
    NoPodIp {
        /// Prefill pod name.
        pod: String,
    },
    /// A Mooncake prefill pod has no bootstrap facts (discovery has not
    /// queried its bootstrap server yet, or it lists no rank).
    #[error("prefill pod {pod:?} has no Mooncake bootstrap info (GET /query not done or empty)")]
    NoBootstrap {
        /// Prefill pod name.
        pod: String,
    },
    /// The prefill's answer says the transfer cannot go on (e.g. TensorRT-LLM's context phase
    /// answered without the parameters its generation phase needs).
    #[error("prefill pod {pod:?} answered without {what}")]
    MissingHandoff {
        /// Prefill pod name.
        pod: String,
        /// What was missing.
        what: &'static str,
    },
    /// Merge was called without the state augment leaves behind.
    #[error("merge called before augment: {0}")]
    MissingState(&'static str),
}

impl AgentError {
    /// Whether the client caused this (answer 400); otherwise the gateway or
    /// an engine is at fault (5xx).
    pub fn is_client_error(&self) -> bool {
        matches!(self, AgentError::Body(_))
    }
}

/// One KV-transfer connector: shapes the prefill leg and builds the decode
/// body. Agents are pure (no I/O) and stateless; per-request state lives in
/// [`RoutingContext::transfer`].
///
/// Two-phase contract: the gateway calls
/// [`augment_prefill_request`](KvTransferAgent::augment_prefill_request), sends
/// (or schedules) the prefill leg, then calls
/// [`merge_prefill_response`](KvTransferAgent::merge_prefill_response), which
/// writes the decode body into [`RoutingContext::req_body`].
pub trait KvTransferAgent: Send + Sync + std::fmt::Debug {
    /// The connector type this agent implements (`"shfs"`, ...).
    fn connector_type(&self) -> &'static str;

    /// Sequential: the gateway awaits the prefill then merges its body.
    /// Concurrent: the gateway calls augment then merge with an EMPTY
    /// `prefill_response` immediately and sends both legs at once (the agent
    /// must not need the response).
    fn dispatch(&self) -> Dispatch {
        Dispatch::Sequential
    }

    /// Whether `n > 1` or a prompt array can be served; the gateway answers 400
    /// otherwise (vLLM returns one set of transfer parameters per request).
    fn supports_batch(&self) -> bool {
        false
    }

    /// What a decode engine must be sent to drop `request_id` when the gateway gives it up (its
    /// concurrent prefill failed, or the client left before the stream's end). `None` (the
    /// default): closing the decode connection is enough, as for vLLM.
    fn engine_abort(&self, request_id: &str) -> Option<EngineCall> {
        let _ = request_id;
        None
    }

    /// Whether a decode engine of this connector can serve a plain request alone (no prefill
    /// leg, no transfer fields) when it already holds most of the prompt in its own cache
    /// (cache-aware "decode-only" serving). True for vLLM's connectors, whose consumers compute
    /// what they were not sent; a connector whose decode servers refuse requests without a
    /// transfer handshake says false.
    fn allows_decode_only(&self) -> bool {
        true
    }

    /// What the engines behind this connector would refuse in `body` sent to `endpoint`, checked
    /// by the gateway before the prefill leg runs (and pins KV that no decode pulls). The default
    /// is vLLM's validation ([`checks::check_request`] with vLLM's default limits); an engine
    /// that validates otherwise overrides it (the gateway checks the body, the model and the
    /// batch shape for every connector itself).
    ///
    /// # Errors
    /// The [`EngineReject`] the engine would answer with.
    fn check_request(
        &self,
        body: &JsonBody,
        endpoint: checks::Endpoint,
    ) -> Result<(), EngineReject> {
        checks::check_request(body, endpoint, &checks::Limits::default())
    }

    /// Whether a prefill of this connector can hand the KV of a `/v1/responses` or
    /// `/v1/messages` request to a decode. `false` (the default): those routes' decodes serve
    /// them alone. A connector says `true` only when its engines take its transfer fields on
    /// those routes too (vLLM's `kv_transfer_params` does).
    fn carries_responses_and_messages(&self) -> bool {
        false
    }

    /// Whether this connector's prefill engines take vLLM's `ec_transfer_params` (encoder
    /// disaggregation, [`crate::encoder`]): the gateway sends a multimodal request's items to
    /// encoders first only then. `false` (the default): the prefill encodes its items itself.
    /// vLLM's connectors say `true` (the field is vLLM's request field, whatever the KV
    /// connector); engines that do not have it (SGLang, TensorRT-LLM) say `false`.
    fn accepts_ec_transfer_params(&self) -> bool {
        false
    }

    /// Records what the prefill leg must know about the decode the gateway chose for it, before
    /// [`augment_prefill_request`](KvTransferAgent::augment_prefill_request). The default does
    /// nothing: most connectors let the decode find the prefill. A connector whose prefill
    /// addresses its decode (P2pNccl's request ids, MoRIIO's write mode) keeps the decode pod in
    /// [`TransferState::decode_pod`](crate::TransferState::decode_pod); the gateway calls this
    /// again whenever the request moves to another decode.
    ///
    /// # Errors
    /// [`AgentError`] when the decode pod lacks what the connector needs (its IP).
    fn bind_decode(&self, ctx: &mut RoutingContext, decode_pod: &Pod) -> Result<(), AgentError> {
        let _ = (ctx, decode_pod);
        Ok(())
    }

    /// Whether a prefill pod needs bootstrap facts looked up by discovery
    /// ([`Pod::mooncake_bootstrap`], from the pod's bootstrap server) before it can be routed to.
    /// Discovery does the I/O; the agent only says it needs it.
    fn needs_bootstrap_lookup(&self) -> bool {
        false
    }

    /// Builds the prefill leg for `request` (the client body, already parsed)
    /// bound for `prefill_pod`. May record state in `ctx.transfer`.
    ///
    /// # Errors
    /// [`AgentError`] when the pod lacks facts the connector needs.
    fn augment_prefill_request(
        &self,
        ctx: &mut RoutingContext,
        prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError>;

    /// Builds the decode body from the client's original body
    /// ([`RoutingContext::original_body`]) and the prefill response, and
    /// stores it in `ctx.req_body`.
    ///
    /// # Errors
    /// [`AgentError`] for an unusable original body, a malformed prefill
    /// response or missing pod facts; `ctx.req_body` is then unchanged.
    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError>;
}

/// The client's original body, stripped of client transfer fields: the base of
/// every decode body.
pub(crate) fn decode_base(ctx: &mut RoutingContext) -> Result<JsonBody, AgentError> {
    let mut body = ctx.original_body()?.clone();
    strip_client_transfer_fields(&mut body);
    Ok(body)
}

/// The prefill pod's IP or [`AgentError::NoPodIp`].
pub(crate) fn require_ip(pod: &Pod) -> Result<&str, AgentError> {
    pod.ip().ok_or_else(|| AgentError::NoPodIp {
        pod: pod.name.clone(),
    })
}
