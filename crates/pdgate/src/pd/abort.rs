//! Engine aborts: the one path by which a decode engine is told to drop a request, when its
//! agent asks for it ([`KvTransferAgent::engine_abort`]; SGLang's `POST /abort_request`). Other
//! connectors need nothing: closing the decode connection aborts a vLLM request.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http::header::HeaderMap;
use kvtransfer::{EngineCall, KvTransferAgent};
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::endpoints::Endpoint;
use crate::engine::EnginePool;
use crate::engine::client::{self, LegRequest};
use crate::engine::guarded::OnEnd;
use crate::error::Leg;
use crate::state::Engines;

/// Bound on one abort call.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Sends `call` for `request_id` to the decode `endpoint`, bounded; the outcome only logs.
async fn send(client: &EnginePool, endpoint: &Endpoint, request_id: &str, call: EngineCall) {
    let leg = LegRequest {
        leg: Leg::Decode,
        endpoint: endpoint.target(),
        path: call.path,
        method: Method::POST,
        body: call.body,
        request_id,
        headers: &HeaderMap::new(),
        extra: &[],
    };
    match client::send_within(client, leg, ABORT_TIMEOUT).await {
        Ok(_) => {}
        Err(e) => debug!(endpoint = %endpoint.name, error = %e, "engine abort failed"),
    }
}

/// Tells the decode to drop `request_id` and waits (bounded) until it answered: used before a
/// retry reuses the request id.
pub(crate) async fn abort_now(
    client: &EnginePool,
    agent: &dyn KvTransferAgent,
    decode: &Endpoint,
    request_id: &str,
) {
    if let Some(call) = agent.engine_abort(request_id) {
        send(client, decode, request_id, call).await;
    }
}

/// Tells the decode to drop `request_id` in the background (waited for at shutdown).
pub(crate) fn abort_later(
    engines: &Engines,
    agent: &dyn KvTransferAgent,
    decode: &Arc<Endpoint>,
    request_id: &str,
) {
    let Some(call) = agent.engine_abort(request_id) else {
        return;
    };
    spawn(
        &engines.tasks,
        engines.client.clone(),
        decode.clone(),
        request_id.to_string(),
        call,
    );
}

fn spawn(
    tasks: &TaskTracker,
    client: EnginePool,
    endpoint: Arc<Endpoint>,
    request_id: String,
    call: EngineCall,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    tasks.spawn_on(
        async move { send(&client, &endpoint, &request_id, call).await },
        &runtime,
    );
}

/// Sends the agent's abort when dropped while armed (the client left before the stream's end).
#[derive(Debug)]
pub(crate) struct AbortOnLeave {
    client: EnginePool,
    endpoint: Arc<Endpoint>,
    request_id: String,
    call: Option<EngineCall>,
    tasks: TaskTracker,
}

impl AbortOnLeave {
    /// A guard for `request_id` on `endpoint`, when the agent has an abort call (else `None`).
    pub(crate) fn new(
        engines: &Engines,
        agent: &dyn KvTransferAgent,
        endpoint: Arc<Endpoint>,
        request_id: &str,
    ) -> Option<Self> {
        let call = agent.engine_abort(request_id)?;
        Some(AbortOnLeave {
            client: engines.client.clone(),
            endpoint,
            request_id: request_id.to_string(),
            call: Some(call),
            tasks: engines.tasks.clone(),
        })
    }
}

impl Drop for AbortOnLeave {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            spawn(
                &self.tasks,
                self.client.clone(),
                self.endpoint.clone(),
                std::mem::take(&mut self.request_id),
                call,
            );
        }
    }
}

/// A clean end disarms the abort; an error or a drop before the end keeps it.
impl OnEnd for AbortOnLeave {
    fn ended(&mut self, clean: bool) {
        if clean {
            self.call = None;
        }
    }
}
