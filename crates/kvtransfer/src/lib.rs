//! kvtransfer: how pdgate shapes the two HTTP legs of a prefill/decode
//! (PD) disaggregated LLM request for each KV-transfer connector.
//!
//! The gateway never moves KV bytes. For every request it picks a prefill pod
//! and a decode pod, asks the prefill pod's [`KvTransferAgent`] to build the
//! prefill body ([`KvTransferAgent::augment_prefill_request`]) and then the
//! decode body ([`KvTransferAgent::merge_prefill_response`]). Agents are pure:
//! bytes and pod facts in, bytes out; no sockets, no async runtime.
//!
//! # Modules
//! - [`body`]: [`JsonBody`], one parse of the client body, top-level edits,
//!   byte-preserving output (key order, number spelling, big integers). Bodies and
//!   prefill answers are read by a validating scanner first (`scan`, private); what it
//!   does not accept goes to serde_json, whose answer and error count.
//! - [`rules`]: the prefill-leg rules and the stripping of client-supplied
//!   transfer fields shared by all connectors.
//! - [`checks`]: what a vLLM engine would reject before doing any work
//!   ([`check_request`], [`EngineReject`]), so a gateway refuses it before
//!   the prefill leg runs.
//! - [`pod`]: [`Pod`] and Mooncake bootstrap facts
//!   ([`parse_mooncake_bootstrap`]).
//! - [`context`]: [`RoutingContext`], per-request state (id, bodies,
//!   [`TransferState`]).
//! - [`agent`]: the [`KvTransferAgent`] trait (with defaulted hooks for
//!   connector quirks: [`KvTransferAgent::engine_abort`],
//!   [`KvTransferAgent::needs_bootstrap_lookup`]), [`Dispatch`],
//!   [`MergeOutcome`], [`EngineCall`], [`AgentError`].
//! - [`agents`]: built-ins [`ShfsAgent`] (default, vLLM NixlConnector wire
//!   format), [`NixlAgent`] (Neuron), [`MooncakeAgent`], [`SglangAgent`], [`P2pNcclAgent`]
//!   (vLLM P2pNcclConnector), [`MoriioAgent`] (vLLM MoRIIOConnector, write and read mode),
//!   [`TrtllmAgent`] (TensorRT-LLM disaggregated serving).
//! - [`encoder`]: encoder disaggregation (EPD, vLLM's encoder-cache connector): a chat
//!   request's multimodal parts as encoder requests, the encoders' answers checked and merged
//!   into the prefill's `ec_transfer_params`.
//! - [`registry`]: [`Registry`], agents by connector name. Owned by whoever
//!   uses it (a gateway builds one at start-up); there is no process-wide one.
//!
//! # Example
//! ```
//! use bytes::Bytes;
//! use kvtransfer::{
//!     CONNECTOR_TYPE_IDENTIFIER, Dispatch, JsonBody, MergeOutcome, Pod, Registry, RoutingContext,
//!     strip_client_transfer_fields,
//! };
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let registry = Registry::with_builtins();
//! let default = registry.validate_default("shfs")?; // fail at start-up, not per request
//! let prefill = Pod::new("prefill-0", "10.0.0.7", 8000).with_label(CONNECTOR_TYPE_IDENTIFIER, "SHFS");
//! let agent = registry.resolve_agent_for_pod(Some(&prefill), &default)?;
//! assert_eq!(agent.dispatch(), Dispatch::Sequential);
//!
//! let client = Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#);
//! let mut body = JsonBody::parse(client)?;
//! strip_client_transfer_fields(&mut body);
//! let mut ctx = RoutingContext::from_parsed("req-1", body.clone());
//!
//! let leg = agent.augment_prefill_request(&mut ctx, &prefill, &body)?;
//! assert!(leg.body.starts_with(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false"#));
//!
//! // ... the gateway sends `leg` to the prefill pod and reads its response ...
//! let response = br#"{"id":"c","kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[[1,2]],"remote_host":"x","remote_port":5600}}"#;
//! assert_eq!(agent.merge_prefill_response(&mut ctx, response, &prefill)?, MergeOutcome::KvAttached);
//! assert_eq!(
//!     &ctx.req_body[..],
//!     br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[[1,2]],"remote_host":"10.0.0.7","remote_port":5600}}"#
//! );
//! # Ok(())
//! # }
//! ```

pub mod agent;
pub mod agents;
pub mod body;
pub mod checks;
pub mod context;
pub mod encoder;
pub mod pod;
pub mod registry;
pub mod rules;
mod scan;

pub use agent::{
    AgentError, DATA_PARALLEL_RANK_HEADER, Dispatch, EngineCall, KvTransferAgent, MergeOutcome,
    PrefillRequest,
};
pub use agents::*;
pub use body::{BodyError, JsonBody};
pub use checks::{
    EngineReject, Refused, check_depth, check_model, check_request, parse_bounded,
    reject_body_error,
};
pub use context::{RoutingContext, TransferState};
pub use pod::{
    BootstrapError, DEFAULT_HTTP_PORT, DEFAULT_MOONCAKE_BOOTSTRAP_PORT,
    DEFAULT_SGLANG_BOOTSTRAP_PORT, MooncakeBootstrap, MooncakeRank, Pod, parse_mooncake_bootstrap,
};
pub use registry::{AgentFactory, Registry, RegistryError};
pub use rules::{
    CLIENT_FORBIDDEN_HEADERS, KV_TRANSFER_PARAMS, apply_prefill_leg_rules,
    is_client_transfer_field, strip_client_transfer_fields,
};

/// Pod label selecting the pod's KV connector type.
pub const CONNECTOR_TYPE_IDENTIFIER: &str = "model.aibrix.ai/kv-connector-type";
/// `shfs`: vLLM NixlConnector wire format with AIBrix semantics (the default).
pub const CONNECTOR_TYPE_SHFS: &str = "shfs";
/// `nixl`: AWS Neuron NixlConnector (whole prefill response to decode).
pub const CONNECTOR_TYPE_NIXL: &str = "nixl";
/// `mooncake`: vLLM MooncakeConnector (concurrent legs, bootstrap server).
pub const CONNECTOR_TYPE_MOONCAKE: &str = "mooncake";
/// `sglang`: SGLang PD disaggregation (bootstrap host/port/room).
pub const CONNECTOR_TYPE_SGLANG: &str = "sglang";
/// The connector used when a pod's label is empty or unrecognised, unless
/// configured otherwise.
pub const DEFAULT_CONNECTOR_TYPE: &str = CONNECTOR_TYPE_SHFS;

/// AIBrix pod label and annotation keys (contracts §8).
pub mod labels {
    /// Label: `prefill` | `decode` (anything else: a combined pod).
    pub const ROLE_NAME: &str = "role-name";
    /// Label grouping the prefill and decode pods of one roleset.
    pub const ROLESET_NAME: &str = "roleset-name";
    /// Label: served model name.
    pub const MODEL_NAME: &str = "model.aibrix.ai/name";
    /// Label: engine HTTP port (default 8000).
    pub const MODEL_PORT: &str = "model.aibrix.ai/port";
    /// Label: engine kind, `vllm` (default), `sglang`, `trtllm`.
    pub const ENGINE: &str = "model.aibrix.ai/engine";
    /// Label: pod index inside a pod group; only `"0"` or absent is routable.
    pub const POD_GROUP_INDEX: &str = "stormservice.orchestration.aibrix.ai/pod-group-index";
    /// Annotation: SGLang bootstrap port (default 8998).
    pub const SGLANG_BOOTSTRAP_PORT: &str = "model.aibrix.ai/sglang-bootstrap-port";
    /// Annotation (pdgate's own): Mooncake bootstrap (`/query`) port (default 8998).
    pub const MOONCAKE_BOOTSTRAP_PORT: &str = "model.aibrix.ai/mooncake-bootstrap-port";
    /// Every bootstrap-port annotation: a configured `bootstrap_port` sets them all, so the
    /// gateway need not know which connector reads which.
    pub const BOOTSTRAP_PORTS: [&str; 2] = [MOONCAKE_BOOTSTRAP_PORT, SGLANG_BOOTSTRAP_PORT];
    /// Label: the pod's KV connector type (same as
    /// [`CONNECTOR_TYPE_IDENTIFIER`](crate::CONNECTOR_TYPE_IDENTIFIER)).
    pub const KV_CONNECTOR_TYPE: &str = crate::CONNECTOR_TYPE_IDENTIFIER;
}
