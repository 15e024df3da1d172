//! The PD exchange: one [`Exchange`] per request, in four steps.
//!
//! 1. [`view`]: parse the body once and read what the request is (model, stream, batch shape).
//! 2. [`select`]: choose the prefill/decode pair (and, on failure, another endpoint for a leg);
//!    [`encode`]: whether a multimodal request's items go to encoders before each prefill leg.
//!    [`plan`] builds the request's [`Exchange`] from them.
//! 3. [`legs`]: run the two legs the way the prefill's agent wants them ([`legs::serve`]),
//!    sequential (prefill, merge, decode) or concurrent (both at once, a failed prefill cancels
//!    the decode), or the decode alone, up to the decode's response head. Every failed attempt
//!    of a leg goes to [`retry`], the one place that decides the next step.
//! 4. [`relay`]: stream the decode body to the client, holding the loads, the running prefill
//!    and the metrics record until it ends.
//!
//! Engine aborts (a connector's quirk, asked of its agent) have one path: [`abort`].
//! Errors go back to the HTTP edge with the request's record, and the edge renders them.

pub(crate) mod abort;
#[doc(hidden)]
pub mod bench;
pub(crate) mod delegate;
pub(crate) mod encode;
mod exchange;
pub(crate) mod handover;
pub(crate) mod legs;
pub(crate) mod relay;
pub(crate) mod retry;
pub(crate) mod select;
pub(crate) mod usage;
pub(crate) mod view;

pub(crate) use exchange::{Exchange, plan};
pub(crate) use view::Route;

/// The answer to a client: axum's body type, which every route returns.
pub(crate) type Answer = http::Response<axum::body::Body>;
