//! The HTTP edge: the one place where requests come in and answers go out.
//!
//! - [`listener`]: the accept loop (HTTP/1.1 and h2c, idle and header-read timeouts).
//! - [`edge`]: reads the body (size-limited), checks the head, and turns every error into an
//!   OpenAI-shaped answer with `x-request-id`, recording its outcome. It calls `security` for
//!   client keys, request-target checks and the body budget.
//! - [`routes`]: the operational routes (`/v1/models`, `/health`, `/ready`, `/metrics`).
//! - [`passthrough`]: the allow-listed paths, relayed to a decode endpoint (transfer fields
//!   stripped from the body).
//!
//! The PD routes (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/messages`)
//! hand the request's record to the PD flow in `pd`: `pd::plan` builds the request's `Exchange`
//! from it, `pd::legs::serve` runs it, and an error gives the record back to the edge.

pub(crate) mod edge;
pub(crate) mod listener;
pub(crate) mod passthrough;
pub(crate) mod routes;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::{MethodRouter, get, post};

use crate::metrics::RequestRecord;
use crate::pd::{self, Answer, Route};
use crate::security::auth;
use crate::state::Gateway;

/// The gateway's routes. A route asked with another method answers 405 through the edge.
pub(crate) fn router(gw: Arc<Gateway>) -> Router {
    let only = |r: MethodRouter<Arc<Gateway>>| r.fallback(edge::method_not_allowed);
    Router::new()
        .route("/v1/completions", only(post(completions)))
        .route("/v1/chat/completions", only(post(chat)))
        .route("/v1/responses", only(post(responses)))
        .route("/v1/messages", only(post(messages)))
        .route("/v1/models", only(get(routes::models)))
        .route("/health", only(get(routes::health)))
        .route("/ready", only(get(routes::ready)))
        .route("/metrics", only(get(routes::api_metrics)))
        .fallback(passthrough::passthrough)
        .with_state(gw)
}

/// The edge's checks and admission, the PD flow; every error answered by the edge.
async fn pd_route(gw: Arc<Gateway>, route: Route, request: Request) -> Answer {
    let record = RequestRecord::begin(gw.metrics.clone(), route.label(), request.headers());
    // Built only when exported or asked for in the logs (`telemetry`): at the default filter
    // the span is disabled and costs a cached interest check.
    let span = record.trace_span().clone();
    let mut record = Some(record);
    let result = async {
        let edge::Admitted {
            headers,
            body,
            slot,
            pass,
        } = edge::admit(&gw.edge, request).await?;
        let mut ex = pd::plan(&gw, &mut record, route, &headers, body, None).await?;
        let answer = pd::legs::serve(&mut ex).await;
        if answer.is_err() {
            // The edge records the error: the record comes back from the exchange.
            record = ex.into_record();
        }
        Ok(auth::hold(answer?, slot, pass))
    };
    let result = tracing::Instrument::instrument(result, span).await;
    edge::finish(record, result)
}

async fn completions(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    pd_route(gw, Route::Completions, request).await
}

async fn chat(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    pd_route(gw, Route::Chat, request).await
}

async fn responses(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    pd_route(gw, Route::Responses, request).await
}

async fn messages(State(gw): State<Arc<Gateway>>, request: Request) -> Answer {
    pd_route(gw, Route::Messages, request).await
}
