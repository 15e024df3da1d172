//! Cache-aware routing's metrics (`pdgate_cache_*`). Labels: role and decision kind (closed
//! sets), model (configured names or `default`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use pdcache::subscribe::SubscriberStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    role: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabels {
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    role: &'static str,
    what: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

/// One counter of a subscription's stats.
type StatOf = fn(&SubscriberStats) -> &AtomicU64;

/// The roles and decision kinds whose counters are resolved once (a closed set each).
const ROLES: [&str; 2] = ["prefill", "decode"];
const KINDS: [&str; 4] = ["hit", "miss", "imbalance_override", "decode_only"];

/// One role's counters, resolved from the families on first use: the hot path then bumps an
/// atomic instead of hashing labels under the family's lock (three lookups per decision).
#[derive(Debug, Default)]
struct RoleCounters {
    decisions: [OnceLock<Counter>; KINDS.len()],
    predicted: OnceLock<Counter>,
    prompt: OnceLock<Counter>,
}

/// The `pdgate_cache_*` families.
#[derive(Debug, Clone)]
pub(crate) struct CacheMetrics {
    resolved: Arc<[RoleCounters; ROLES.len()]>,
    decisions: Family<DecisionLabels, Counter>,
    predicted: Family<RoleLabels, Counter>,
    prompt: Family<RoleLabels, Counter>,
    stopped: Family<RoleLabels, Counter>,
    entries: Family<ModelLabels, Gauge>,
    bytes: Family<ModelLabels, Gauge>,
    events: Family<EventLabels, Gauge>,
    lag: Family<EventLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl CacheMetrics {
    /// Registers the families in `registry` (the gateway's, prefixed `pdgate`).
    pub(crate) fn new(registry: &mut Registry) -> Self {
        let m = CacheMetrics {
            resolved: Arc::default(),
            decisions: Family::default(),
            predicted: Family::default(),
            prompt: Family::default(),
            stopped: Family::default(),
            entries: Family::default(),
            bytes: Family::default(),
            events: Family::default(),
            lag: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("cache");
        r.register(
            "decisions",
            "Cache-aware routing decisions by role and kind (hit, miss, imbalance_override, decode_only)",
            m.decisions.clone(),
        );
        r.register(
            "predicted_cached_tokens",
            "Prompt tokens predicted to be cached on the chosen endpoint",
            m.predicted.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of cache-aware decisions (the denominator of the predicted hit share)",
            m.prompt.clone(),
        );
        r.register(
            "events_stopped",
            "Times an endpoint's KV events were found stopped (no batch after a decision that stored blocks there within cache.events_timeout); it is then scored approximately until they resume",
            m.stopped.clone(),
        );
        r.register(
            "index_entries",
            "Entries in the cache index per model",
            m.entries.clone(),
        );
        r.register(
            "index_bytes",
            "Bytes allocated by the cache index per model",
            m.bytes.clone(),
        );
        r.register(
            "events",
            "KV-event counters of the live subscriptions by role: batches, events, blocks_stored, blocks_removed, dropped, gaps, replays, replay_failures, restarts, clears, orphaned",
            m.events.clone(),
        );
        r.register(
            "event_lag_seconds",
            "KV-event lag (receipt - the batch's timestamp) by role: last, max, mean",
            m.lag.clone(),
        );
        m
    }

    /// Sets the event gauges of `role` from its subscriptions' counters.
    pub(crate) fn set_events(&self, role: &'static str, stats: &[&SubscriberStats]) {
        let sum = |f: fn(&SubscriberStats) -> &AtomicU64| -> u64 {
            stats.iter().map(|s| f(s).load(Ordering::Relaxed)).sum()
        };
        let counters: [(&'static str, StatOf); 11] = [
            ("batches", |s| &s.batches),
            ("events", |s| &s.events),
            ("blocks_stored", |s| &s.blocks_stored),
            ("blocks_removed", |s| &s.blocks_removed),
            ("dropped", |s| &s.dropped),
            ("gaps", |s| &s.gaps),
            ("replays", |s| &s.replays),
            ("replay_failures", |s| &s.replay_failures),
            ("restarts", |s| &s.restarts),
            ("clears", |s| &s.clears),
            ("orphaned", |s| &s.orphaned),
        ];
        for (what, f) in counters {
            self.events
                .get_or_create(&EventLabels { role, what })
                .set(i64::try_from(sum(f)).unwrap_or(i64::MAX));
        }
        let last = stats
            .iter()
            .map(|s| s.lag_last_us.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        let max = stats
            .iter()
            .map(|s| s.lag_max_us.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        let count = sum(|s| &s.lag_count);
        let mean = if count == 0 {
            0.0
        } else {
            sum(|s| &s.lag_sum_us) as f64 / count as f64
        };
        for (what, us) in [("last", last as f64), ("max", max as f64), ("mean", mean)] {
            self.lag
                .get_or_create(&EventLabels { role, what })
                .set(us / 1e6);
        }
    }

    /// The decision counter of (`role`, `kind`), resolved once.
    fn decisions_of(&self, role: &'static str, kind: &'static str) -> Option<&Counter> {
        let r = ROLES.iter().position(|x| *x == role)?;
        let k = KINDS.iter().position(|x| *x == kind)?;
        Some(self.resolved[r].decisions[k].get_or_init(|| {
            self.decisions
                .get_or_create(&DecisionLabels { role, kind })
                .clone()
        }))
    }

    /// Counts a decision for `role` (`kind` from a closed set), with its predicted hit.
    pub(crate) fn decision(
        &self,
        role: &'static str,
        kind: &'static str,
        cached: u32,
        prompt: u32,
    ) {
        let Some(r) = ROLES.iter().position(|x| *x == role) else {
            self.decisions
                .get_or_create(&DecisionLabels { role, kind })
                .inc();
            return;
        };
        let resolved = &self.resolved[r];
        match self.decisions_of(role, kind) {
            Some(c) => {
                c.inc();
            }
            None => {
                self.decisions
                    .get_or_create(&DecisionLabels { role, kind })
                    .inc();
            }
        }
        resolved
            .predicted
            .get_or_init(|| self.predicted.get_or_create(&RoleLabels { role }).clone())
            .inc_by(u64::from(cached));
        resolved
            .prompt
            .get_or_init(|| self.prompt.get_or_create(&RoleLabels { role }).clone())
            .inc_by(u64::from(prompt));
    }

    /// Counts an endpoint of `role` whose KV events stopped.
    pub(crate) fn events_stopped(&self, role: &'static str) {
        self.stopped.get_or_create(&RoleLabels { role }).inc();
    }

    /// Counts a request served by the decode alone.
    pub(crate) fn decode_only(&self) {
        if let Some(c) = self.decisions_of("decode", "decode_only") {
            c.inc();
        }
    }

    /// Sets a model's index sizes.
    pub(crate) fn set_index(&self, model: &str, entries: usize, bytes: usize) {
        let l = ModelLabels {
            model: model.to_string(),
        };
        self.entries.get_or_create(&l).set(entries as i64);
        self.bytes.get_or_create(&l).set(bytes as i64);
    }
}
