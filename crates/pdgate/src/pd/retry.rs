//! Second chances, decided in one place: every failed attempt of a leg, before any decode byte
//! reached the client, ends in one [`Failure`], and [`Exchange::next`] turns it into the next
//! step ([`Next`]): the leg again elsewhere, both legs again, the decode alone (fallback), or
//! fail. The flows (`legs`) only carry the step out. Also here: blame by evidence
//! (a decode that gave up waiting for KV) and fresh bootstrap facts for a prefill.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::config::PrefillFailurePolicy;
use crate::endpoints::Endpoint;
use crate::endpoints::EndpointStore;
use crate::endpoints::bootstrap::Requery;
use crate::engine::client;
use crate::error::{GatewayError, Leg, UpstreamKind};
use crate::metrics::Cause;
use crate::pd::{Exchange, abort};

/// Longest a request waits for the reconciler to look a prefill's bootstrap facts up again.
pub(crate) const REQUERY_WAIT: Duration = Duration::from_secs(2);

/// How an attempt of a leg failed, before any decode byte reached the client.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The prefill failed, or by evidence never handed its KV over.
    Prefill(GatewayError),
    /// The decode leg failed: a connection that could not be opened (nothing was sent), a
    /// decode taken out of rotation while the request waited ([`UpstreamKind::Released`]), or
    /// any other failure.
    Decode(GatewayError),
    /// The decode refused the prefill's stale bootstrap facts; the prefill's endpoint with fresh
    /// ones ([`fresh_prefill`]).
    StaleFacts(Arc<Endpoint>),
}

/// What a request does after a [`Failure`]. The exchange was already moved (another endpoint,
/// a fresh routing context, the decode told to drop the request) when the step says so.
#[derive(Debug)]
pub(crate) enum Next {
    /// The failed leg again, on the endpoint the exchange now names.
    RetryLeg,
    /// Both legs again, on the endpoints the exchange now names.
    RetryBoth,
    /// The decode alone with the client's request (a fallback, or a decode-alone request moved
    /// to another decode).
    Alone,
    /// The request fails with this error.
    Fail(GatewayError),
}

/// Why a request leaves its prefill, for the log: a prefill taken out of rotation while the
/// request waited did not fail it.
pub(crate) fn why_moved(err: &GatewayError) -> &'static str {
    if err.is_release() {
        "prefill taken out of rotation while the request waited"
    } else {
        "prefill failed"
    }
}

impl Exchange {
    /// The one place a failed attempt becomes the next step.
    ///
    /// - A prefill failure that may be retried moves the request to another prefill
    ///   (`max_retries`, the retry budget): the leg again (sequential), or both legs again after
    ///   the decode dropped the request (concurrent). Otherwise, with `on_prefill_failure =
    ///   "fallback"` and a connector whose decode can serve a plain request, the decode serves
    ///   the client's request alone; a client error (the prefill refused the request) never
    ///   falls back.
    /// - A decode that could not be reached is retried on another decode (nothing was sent).
    /// - A decode taken out of rotation before its head moves the request, once, to another
    ///   decode: both legs again there (its KV may be gone), or the same plain request for a
    ///   decode serving alone.
    /// - Stale bootstrap facts: both legs again on the fresh ones, once.
    /// - Anything else fails the request; a concurrent pair's decode is told to drop it.
    pub(crate) async fn next(&mut self, failure: Failure) -> Next {
        match failure {
            Failure::Prefill(err) => self.after_prefill(err).await,
            Failure::Decode(err) => self.after_decode(err).await,
            Failure::StaleFacts(fresh) => {
                warn!(id = %self.request_id(), prefill = %self.prefill().name, decode = %self.decode().name, "decode failed on the prefill's stale bootstrap facts (its engine id changed); retrying once on fresh ones");
                let client = &self.engines().client;
                abort::abort_now(client, self.agent(), self.decode(), self.request_id()).await;
                if let Err(err) = self.switch_prefill(fresh) {
                    return Next::Fail(err);
                }
                self.engines().metrics.count_retry(Leg::Prefill);
                self.retried();
                Next::RetryBoth
            }
        }
    }

    async fn after_prefill(&mut self, err: GatewayError) -> Next {
        let concurrent = self.concurrent_pair();
        let next = if err.retryable() {
            self.retry_target(Leg::Prefill, false)
        } else {
            None
        };
        let why = why_moved(&err);
        if let Some(next) = next {
            if concurrent {
                warn!(id = %self.request_id(), from = %self.prefill().name, to = %next.name, error = %err, "{why} before the first decode byte; retrying both legs");
                // The decode must drop the request before the retry reuses its id.
                let client = &self.engines().client;
                abort::abort_now(client, self.agent(), self.decode(), self.request_id()).await;
            } else {
                warn!(id = %self.request_id(), from = %self.prefill().name, to = %next.name, "{why}; retrying on another prefill");
            }
            self.retried();
            return match self.switch_prefill(next) {
                Ok(()) if concurrent => Next::RetryBoth,
                Ok(()) => Next::RetryLeg,
                Err(err) => Next::Fail(err),
            };
        }
        let fallback = self.settings().on_prefill_failure == PrefillFailurePolicy::Fallback
            && self.agent().allows_decode_only()
            && !err.status().is_client_error();
        if !fallback {
            // The decode must drop the bootstrapped request before its id is given up.
            if concurrent {
                abort::abort_later(
                    self.engines(),
                    self.agent(),
                    self.decode(),
                    self.request_id(),
                );
            }
            return Next::Fail(err);
        }
        if concurrent {
            // ... and before its id is reused.
            let client = &self.engines().client;
            abort::abort_now(client, self.agent(), self.decode(), self.request_id()).await;
        }
        warn!(id = %self.request_id(), prefill = %self.prefill().name, error = %err, "{why}; decode serves the request alone");
        self.fall_back();
        Next::Alone
    }

    async fn after_decode(&mut self, err: GatewayError) -> Next {
        let decode = self.decode().clone();
        if err.is_connect_failure()
            && let Some(next) = self.retry_target(Leg::Decode, false)
        {
            warn!(id = %self.request_id(), from = %decode.name, to = %next.name, "decode unreachable; retrying on another decode");
            self.switch_decode(next);
            return Next::RetryLeg;
        }
        if err.is_release()
            && self.first_move()
            && let Some(next) = self.retry_target(Leg::Decode, true)
        {
            warn!(id = %self.request_id(), from = %decode.name, to = %next.name, "decode taken out of rotation before its answer; moving the request to another decode");
            self.retried();
            abort::abort_later(self.engines(), self.agent(), &decode, self.request_id());
            self.restart();
            self.switch_decode(next);
            return if self.alone() {
                Next::Alone
            } else {
                Next::RetryBoth
            };
        }
        if self.concurrent_pair() {
            abort::abort_later(self.engines(), self.agent(), &decode, self.request_id());
        }
        Next::Fail(err)
    }
}

impl Exchange {
    /// [`fresh_prefill`] for the exchange's prefill.
    pub(crate) async fn fresh_prefill(&self) -> Option<Arc<Endpoint>> {
        let gw = self.gw();
        fresh_prefill(&gw.requery, &gw.store, self.prefill()).await
    }
}

/// A decode failed on `prefill`'s KV with a bootstrap-based connector (Mooncake): asks for the
/// prefill's facts to be looked up again and waits (at most [`REQUERY_WAIT`]) for the round.
/// When they changed (the prefill restarted with a new engine id, the decode refused the old
/// one), gives the prefill's endpoint with the fresh facts: the failure was nobody's, and the
/// request can run again on it. `None`: the facts still hold (the failure stands).
pub(crate) async fn fresh_prefill(
    requery: &Requery,
    store: &EndpointStore,
    prefill: &Endpoint,
) -> Option<Arc<Endpoint>> {
    let ticket = requery.ask(&prefill.name);
    if !requery.wait(ticket, REQUERY_WAIT).await {
        return None;
    }
    let snapshot = store.load();
    let now = snapshot.prefill.iter().find(|p| p.name == prefill.name)?;
    (now.pod.mooncake_bootstrap.is_some()
        && now.pod.mooncake_bootstrap != prefill.pod.mooncake_bootstrap)
        .then(|| now.clone())
}

/// A decode gave up waiting for KV (a late 5xx or first-frame error event) while its concurrent
/// prefill had not answered: logged, counted against the prefill, and returned as the prefill's
/// (retryable) failure.
pub(crate) fn kv_wait_failure(ex: &Exchange, waited: Duration) -> GatewayError {
    let (engines, requery) = (ex.engines(), &ex.gw().requery);
    let prefill = ex.prefill();
    warn!(
        id = %ex.request_id(),
        prefill = %prefill.name,
        decode = %ex.decode().name,
        ?waited,
        "decode gave up waiting for KV while the prefill had not answered; blaming the prefill"
    );
    engines.health.observe(&prefill.name, Err(Cause::KvWait));
    if ex.agent().needs_bootstrap_lookup() {
        requery.ask(&prefill.name);
    }
    client::upstream(
        Leg::Prefill,
        prefill.target(),
        UpstreamKind::Timeout,
        format!("did not hand its KV over within {waited:?}"),
    )
}
