//! Whether an endpoint's KV events still flow, judged from the decisions sent to it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdcache::subscribe::SubscriberStats;

/// Whether an event-publishing endpoint's events still arrive. A decision sent to it should be
/// followed by a batch (the blocks it stored); when no batch arrived `timeout` after the first
/// unconfirmed decision, its events are taken as stopped and decisions fall back to
/// approximate entries for it (which outlive the speculative ones), until a batch arrives.
#[derive(Debug)]
pub(crate) struct EventWatch {
    stats: Arc<SubscriberStats>,
    /// Batches applied when last looked at.
    seen: u64,
    /// The first decision since then that no batch followed.
    waiting_since: Option<Instant>,
    stopped: bool,
}

/// What [`EventWatch::check`] concluded for one decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventsNow {
    /// Events flow: speculative entries, confirmed by the events.
    Flowing,
    /// Events stopped just now (count it once).
    Stopped,
    /// Events are still stopped.
    StillStopped,
}

impl EventWatch {
    pub(crate) fn new(stats: Arc<SubscriberStats>) -> Self {
        let seen = stats.batches.load(std::sync::atomic::Ordering::Relaxed);
        EventWatch {
            stats,
            seen,
            waiting_since: None,
            stopped: false,
        }
    }

    /// Called for each decision sent to the endpoint; `expects` says whether the decision
    /// should make the engine publish (the prompt has full blocks the endpoint does not hold).
    pub(crate) fn check(&mut self, expects: bool, now: Instant, timeout: Duration) -> EventsNow {
        let batches = self
            .stats
            .batches
            .load(std::sync::atomic::Ordering::Relaxed);
        self.check_with(batches, expects, now, timeout)
    }

    pub(crate) fn check_with(
        &mut self,
        batches: u64,
        expects: bool,
        now: Instant,
        timeout: Duration,
    ) -> EventsNow {
        if batches != self.seen {
            self.seen = batches;
            self.waiting_since = None;
            self.stopped = false;
        }
        if self.stopped {
            return EventsNow::StillStopped;
        }
        match self.waiting_since {
            Some(t) if !timeout.is_zero() && now.saturating_duration_since(t) > timeout => {
                self.stopped = true;
                EventsNow::Stopped
            }
            Some(_) => EventsNow::Flowing,
            None => {
                if expects {
                    self.waiting_since = Some(now);
                }
                EventsNow::Flowing
            }
        }
    }
}
