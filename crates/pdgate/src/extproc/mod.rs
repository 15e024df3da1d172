//! `pdgate ext-proc`: the gateway as Envoy's external processor
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, over tonic), for the gateways Kubernetes
//! users already run (Envoy Gateway with AIBrix's `target-pod` patch, the Gateway API Inference
//! Extension's endpoint picker).
//!
//! The proxy carries the client's request and the decode leg; pdgate decides with the same
//! state as its own proxy (configuration, discovery, policies, cache index, health, metrics,
//! telemetry: one [`Gateway`]) and the same PD steps (`pd::plan`, the prefill legs,
//! `pd::delegate`), and names the decode in every form a proxy reads. [`stream`] is one
//! request's exchange of messages; [`wire`] the messages themselves.

pub(crate) mod stream;
pub(crate) mod wire;

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};

use crate::pd::delegate::PrefillBy;
use crate::state::Gateway;

pub use wire::subset_metadata;

/// How `pdgate ext-proc` serves.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtProcOptions {
    /// llm-d's form: name the prefill in `x-prefiller-host-port` for the sidecar on the decode
    /// pod and leave the prefill call to it (the decode gets the client's request).
    pub prefill_by_sidecar: bool,
}

/// The ext_proc service over one gateway.
struct Processor {
    gw: Arc<Gateway>,
    by: PrefillBy,
}

type Responses =
    Pin<Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = Responses;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Responses>, tonic::Status> {
        let inbound = request.into_inner();
        Ok(tonic::Response::new(Box::pin(stream::responses(
            self.gw.clone(),
            self.by,
            inbound,
        ))))
    }
}

/// The ext_proc service as routes of the gateway's HTTP listener (gRPC is HTTP/2, which the
/// listener serves with prior knowledge, beside HTTP/1.1 for the operational routes). Each
/// stream's state lives in its response stream, which the server drops when the proxy closes or
/// resets it.
pub(crate) fn router(gw: Arc<Gateway>, options: ExtProcOptions) -> axum::Router {
    let by = if options.prefill_by_sidecar {
        PrefillBy::Sidecar
    } else {
        PrefillBy::Gateway
    };
    let service = ExternalProcessorServer::new(Processor { gw, by });
    tonic::service::Routes::new(service).into_axum_router()
}
