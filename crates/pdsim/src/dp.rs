//! Data-parallel ranks (`--data-parallel-size`), as vLLM serves them behind one API server: each
//! rank is an engine core with its own prefix cache, queue (slots or step-loop scheduler) and
//! KV-event publisher (on the endpoint moved by its rank, batches carrying the rank). A request
//! runs on the rank its `X-data-parallel-rank` header names; an unpinned one goes where vLLM's
//! internal load balancer would send it: the rank with the fewest requests (waiting ones
//! weigh 4, as in vLLM's `DPLBAsyncMPClient`), ties taken in turn.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::kv_events::EventSink;
use crate::prefix_cache::PrefixCache;
use crate::stats::RankStats;
use crate::step_loop::StepLoop;

/// One data-parallel rank: an engine core.
pub(crate) struct DpRank {
    /// `None` with `--no-enable-prefix-caching`.
    pub cache: Option<Mutex<PrefixCache>>,
    /// The KV-event publisher, when events are on.
    pub events: Option<EventSink>,
    /// Concurrency slots of the per-request latency model.
    pub slots: Option<Arc<Semaphore>>,
    /// The scheduler of the step-loop engine model, when it is on.
    pub steps: Option<StepLoop>,
    /// Shared with the requests on this rank ([`OnRank`]).
    pub counters: Arc<RankCounters>,
}

/// What one rank did, for `/sim/stats` and the balancer.
#[derive(Debug, Default)]
pub(crate) struct RankCounters {
    /// Generation requests on this rank now (from rank choice to their end).
    pub in_flight: AtomicU64,
    /// Of those, waiting for a slot or in the scheduler's queue.
    pub waiting: AtomicU64,
    /// Generation requests ever placed here.
    pub requests: AtomicU64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens found in this rank's prefix cache.
    pub prefix_cache_hits: AtomicU64,
}

impl DpRank {
    pub fn new(cache: Option<PrefixCache>, slots: usize, step_model: bool) -> Self {
        DpRank {
            cache: cache.map(Mutex::new),
            events: None,
            // The step loop bounds concurrency itself (`max_num_seqs`, KV blocks).
            slots: (slots > 0 && !step_model).then(|| Arc::new(Semaphore::new(slots))),
            steps: None,
            counters: Arc::default(),
        }
    }

    /// Hands cache changes to this rank's event publisher (nothing when events are off).
    pub fn publish(&self, events: Vec<pdcache::events::KvEvent>) {
        if let Some(sink) = &self.events {
            sink.send(events);
        }
    }

    pub fn stats(&self) -> RankStats {
        let c = &self.counters;
        RankStats {
            in_flight: c.in_flight.load(Relaxed),
            waiting: c.waiting.load(Relaxed),
            requests: c.requests.load(Relaxed),
            prompt_tokens: c.prompt_tokens.load(Relaxed),
            prefix_cache_hits: c.prefix_cache_hits.load(Relaxed),
            cached_blocks: self
                .cache
                .as_ref()
                .and_then(|c| c.lock().ok().map(|c| c.len() as u64))
                .unwrap_or(0),
        }
    }
}

/// The rank a request runs on: the one `header` (`X-data-parallel-rank`) names, else the least
/// loaded (vLLM's score, waiting requests weighing 4), starting the scan at `turn` so that ties
/// rotate. A header that is not an integer is ignored, as vLLM does; an integer outside
/// `[0, ranks)` is vLLM's 400.
pub(crate) fn choose(
    ranks: &[DpRank],
    header: Option<&str>,
    turn: &AtomicUsize,
) -> Result<usize, ApiError> {
    let n = ranks.len().max(1);
    if let Some(rank) = header.and_then(|h| h.trim().parse::<i64>().ok()) {
        return usize::try_from(rank)
            .ok()
            .filter(|&r| r < n)
            .ok_or_else(|| ApiError::BadRequest {
                message: format!("data_parallel_rank {rank} is out of range [0, {n})."),
                param: None,
            });
    }
    let start = turn.fetch_add(1, Relaxed) % n;
    let score = |r: &DpRank| {
        let c = &r.counters;
        let waiting = c.waiting.load(Relaxed);
        let running = c.in_flight.load(Relaxed).saturating_sub(waiting);
        waiting * 4 + running
    };
    Ok((0..n)
        .map(|i| (start + i) % n)
        .min_by_key(|&i| ranks.get(i).map_or(u64::MAX, score))
        .unwrap_or(0))
}

/// Counts a request on its rank until dropped.
pub(crate) struct OnRank {
    rank: usize,
    counters: Arc<RankCounters>,
}

impl OnRank {
    /// Counts a request on rank `rank` of `ranks` (which must hold it: [`choose`]'s answer).
    pub fn new(ranks: &[DpRank], rank: usize) -> Self {
        let counters = ranks[rank].counters.clone();
        counters.in_flight.fetch_add(1, Relaxed);
        counters.requests.fetch_add(1, Relaxed);
        OnRank { rank, counters }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Drop for OnRank {
    fn drop(&mut self) {
        self.counters.in_flight.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(n: usize) -> Vec<DpRank> {
        (0..n).map(|_| DpRank::new(None, 0, false)).collect()
    }

    #[test]
    fn the_header_pins_and_unpinned_requests_go_to_the_least_loaded() {
        let r = ranks(4);
        let turn = AtomicUsize::new(0);
        assert_eq!(choose(&r, Some("2"), &turn).unwrap(), 2);
        assert_eq!(choose(&r, Some(" 3 "), &turn).unwrap(), 3);
        for bad in ["4", "-1"] {
            let err = choose(&r, Some(bad), &turn).unwrap_err();
            assert!(err.to_string().contains("out of range [0, 4)"), "{err}");
        }
        // Not an integer: ignored (vLLM), the balancer decides.
        assert!(choose(&r, Some("two"), &turn).unwrap() < 4);
        // Idle ranks are taken in turn.
        let picks: Vec<usize> = (0..4).map(|_| choose(&r, None, &turn).unwrap()).collect();
        let mut sorted = picks.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3], "{picks:?}");
        // A busy rank is avoided; a waiting request weighs 4 running ones.
        for (i, busy) in [5, 1, 0, 1].into_iter().enumerate() {
            r[i].counters.in_flight.store(busy, Relaxed);
        }
        assert_eq!(choose(&r, None, &turn).unwrap(), 2);
        r[2].counters.in_flight.store(1, Relaxed);
        r[2].counters.waiting.store(1, Relaxed);
        r[1].counters.in_flight.store(3, Relaxed);
        assert_eq!(choose(&r, None, &turn).unwrap(), 3);
    }
}
