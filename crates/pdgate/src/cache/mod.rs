//! Cache-aware routing: the prefix view of a request, a cache index per model, and the
//! bookkeeping of decisions.
//!
//! - [`config`]: the `[cache]` section ([`CacheConfig`]): block size and tokenizer per model,
//!   cost weights, the imbalance guard, TTLs, decode-only thresholds.
//! - [`view`]: the request's block keys, computed once on the hot path ([`PrefixView`]).
//! - [`score`]: choosing an endpoint by cost (pure).
//! - [`Cache`] (here): one [`ModelCache`] per model, each a `pdcache` index behind a mutex; a
//!   decision locks it once (match, choose, insert the chosen endpoints' keys).
//!
//! Approximate mode (endpoints without KV events): each decision inserts the request's keys for
//! the chosen endpoints with a TTL. Every endpoint is approximate until it publishes events.

pub(crate) mod config;
pub(crate) mod metrics;
pub(crate) mod score;
pub(crate) mod view;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use kvtransfer::JsonBody;
use pdcache::index::{CacheIndex, EndpointId, IndexConfig, Match};
use pdcache::subscribe::{Feed, SharedIndex, SubscriberConfig, SubscriberStats, Subscription};
use pdcache::tokenizer::HfTokenizer;

pub use config::{CacheConfig, ModelCacheConfig};
pub(crate) use metrics::CacheMetrics;
pub(crate) use view::PrefixView;

use crate::config::ConfigError;
use crate::endpoints::{Endpoint, Role, Snapshot};
use crate::pd::Route;

/// Pod annotation (and endpoint `kv_events`) naming where an engine publishes its KV events,
/// e.g. `tcp://10.0.0.5:5557`.
pub const KV_EVENTS_ANNOTATION: &str = "pdgate.io/kv-events";
/// Pod annotation (and endpoint `kv_events_replay`) naming the engine's replay socket.
pub const KV_EVENTS_REPLAY_ANNOTATION: &str = "pdgate.io/kv-events-replay";

/// Label of the index that serves requests naming no (configured) model.
const DEFAULT_MODEL: &str = "default";

/// The cache state of one model.
#[derive(Debug)]
pub(crate) struct ModelCache {
    /// Metrics label: a known model name, or [`DEFAULT_MODEL`].
    pub(crate) label: String,
    block_size: usize,
    tokenizer: Option<Arc<HfTokenizer>>,
    events_timeout: Duration,
    state: Mutex<IndexState>,
    index: SharedIndex,
}

/// The gateway's side of a model index: endpoint names to ids, which ids publish events, and
/// scratch space. Locked before the index (the subscribers lock only the index).
#[derive(Debug, Default)]
struct IndexState {
    ids: HashMap<String, EndpointId>,
    /// By endpoint id: whether its KV events feed the index (precise), so a decision inserts
    /// speculative entries for it (confirmed by the event) instead of approximate ones.
    precise: Vec<bool>,
    /// By endpoint id: whether its events still flow (see [`EventWatch`]).
    watches: Vec<Option<EventWatch>>,
    matches: Vec<Match>,
    /// Matched blocks by endpoint id, for the last [`Scorer::prepare`].
    blocks: Vec<u32>,
}

/// Whether an event-publishing endpoint's events still arrive. A decision sent to it should be
/// followed by a batch (the blocks it stored); when no batch arrived `timeout` after the first
/// unconfirmed decision, its events are taken as stopped and decisions fall back to
/// approximate entries for it (which outlive the speculative ones), until a batch arrives.
#[derive(Debug)]
struct EventWatch {
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
    fn new(stats: Arc<SubscriberStats>) -> Self {
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
    fn check(&mut self, expects: bool, now: Instant, timeout: Duration) -> EventsNow {
        let batches = self
            .stats
            .batches
            .load(std::sync::atomic::Ordering::Relaxed);
        self.check_with(batches, expects, now, timeout)
    }

    fn check_with(
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

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl IndexState {
    fn id(&mut self, index: &mut CacheIndex, name: &str) -> Option<EndpointId> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        let id = index.add_endpoint().ok()?;
        self.ids.insert(name.to_string(), id);
        Some(id)
    }

    fn is_precise(&self, id: EndpointId) -> bool {
        self.precise
            .get(usize::from(id.0))
            .copied()
            .unwrap_or(false)
    }

    fn set_precise(&mut self, id: EndpointId, on: bool) {
        let i = usize::from(id.0);
        if self.precise.len() <= i {
            self.precise.resize(i + 1, false);
        }
        self.precise[i] = on;
        if !on && let Some(w) = self.watches.get_mut(i) {
            *w = None;
        }
    }

    fn watch(&mut self, id: EndpointId, stats: Arc<SubscriberStats>) {
        let i = usize::from(id.0);
        if self.watches.len() <= i {
            self.watches.resize_with(i + 1, || None);
        }
        self.watches[i] = Some(EventWatch::new(stats));
    }
}

/// A locked model index, for one decision.
pub(crate) struct Scorer<'a> {
    state: MutexGuard<'a, IndexState>,
    index: MutexGuard<'a, CacheIndex>,
    events_timeout: Duration,
}

impl Scorer<'_> {
    /// Matches `view` against the index; [`Scorer::blocks`] then answers per endpoint.
    pub(crate) fn prepare(&mut self, view: &PrefixView) {
        let st = &mut *self.state;
        st.blocks.iter_mut().for_each(|b| *b = 0);
        self.index.match_prefix(&view.keys, &mut st.matches);
        for m in &st.matches {
            let i = usize::from(m.endpoint.0);
            if st.blocks.len() <= i {
                st.blocks.resize(i + 1, 0);
            }
            st.blocks[i] = m.blocks;
        }
    }

    /// Leading blocks of the prepared view that `ep` holds.
    pub(crate) fn blocks(&self, ep: &Endpoint) -> u32 {
        self.state
            .ids
            .get(&ep.name)
            .and_then(|id| self.state.blocks.get(usize::from(id.0)))
            .copied()
            .unwrap_or(0)
    }

    /// Entries the index holds for `ep`.
    pub(crate) fn entries(&self, ep: &Endpoint) -> usize {
        self.state
            .ids
            .get(&ep.name)
            .map_or(0, |id| self.index.endpoint_len(*id))
    }

    /// Records that `view` was sent to `ep`: its blocks will be in `ep`'s cache. Speculative
    /// (until the confirming event) where `ep` publishes events; approximate (with a TTL)
    /// elsewhere, and where its events stopped arriving. Precise mode needs token keys: text
    /// keys never match an event. Returns whether `ep`'s events were found stopped just now.
    pub(crate) fn record(&mut self, ep: &Endpoint, view: &PrefixView, now: Instant) -> bool {
        let Some(id) = self.state.id(&mut self.index, &ep.name) else {
            return false;
        };
        let events = if self.state.is_precise(id) {
            let timeout = self.events_timeout;
            let expects =
                view.kind == view::KeyKind::Tokens && saturate(view.keys.len()) > self.blocks(ep);
            self.state
                .watches
                .get_mut(usize::from(id.0))
                .and_then(Option::as_mut)
                .map_or(EventsNow::Flowing, |w| w.check(expects, now, timeout))
        } else {
            EventsNow::StillStopped
        };
        if view.keys.is_empty() {
            return events == EventsNow::Stopped;
        }
        match events {
            EventsNow::Flowing if view.kind == view::KeyKind::Tokens => {
                self.index.insert_speculative(id, &view.keys, now);
            }
            EventsNow::Flowing => {}
            EventsNow::Stopped | EventsNow::StillStopped => {
                self.index.insert_approximate(id, &view.keys, now);
            }
        }
        events == EventsNow::Stopped
    }
}

impl ModelCache {
    fn new(
        label: String,
        block_size: usize,
        tokenizer: Option<Arc<HfTokenizer>>,
        config: &CacheConfig,
        epoch: Instant,
    ) -> Self {
        let index = CacheIndex::new(
            IndexConfig {
                capacity_per_endpoint: config.capacity_per_endpoint,
                approximate_ttl: config.approximate_ttl,
                speculative_ttl: config.speculative_ttl,
                ..IndexConfig::default()
            },
            epoch,
        );
        ModelCache {
            label,
            block_size,
            tokenizer,
            events_timeout: config.events_timeout,
            state: Mutex::new(IndexState::default()),
            index: Arc::new(Mutex::new(index)),
        }
    }

    /// The prefix view of a request for this model.
    pub(crate) fn view(&self, body: &JsonBody, route: Route) -> PrefixView {
        PrefixView::read(body, route, self.block_size, self.tokenizer.as_deref())
    }

    /// Locks the index for one decision.
    pub(crate) fn lock(&self) -> Scorer<'_> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        Scorer {
            state,
            index,
            events_timeout: self.events_timeout,
        }
    }

    /// Drops the entries of endpoints not in `keep`.
    fn retain(&self, keep: &BTreeSet<&str>) {
        let Scorer {
            mut state,
            mut index,
            ..
        } = self.lock();
        let gone: Vec<(String, EndpointId)> = state
            .ids
            .iter()
            .filter(|(name, _)| !keep.contains(name.as_str()))
            .map(|(n, id)| (n.clone(), *id))
            .collect();
        for (name, id) in gone {
            index.remove_endpoint(id);
            state.set_precise(id, false);
            state.ids.remove(&name);
        }
    }

    /// The feed for `name`'s events, marking it precise.
    fn feed(&self, name: &str) -> Option<Feed> {
        let Scorer {
            mut state,
            mut index,
            ..
        } = self.lock();
        let id = state.id(&mut index, name)?;
        state.set_precise(id, true);
        Some(Feed {
            index: self.index.clone(),
            endpoint: id,
        })
    }

    /// Watches `name`'s subscription counters, to notice when its events stop.
    fn watch(&self, name: &str, stats: Arc<SubscriberStats>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = state.ids.get(name).copied() {
            state.watch(id, stats);
        }
    }

    fn stats(&self) -> pdcache::index::IndexStats {
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        index.expire(Instant::now());
        index.stats()
    }
}

/// Cache-aware routing state: an index per known model (configured or served by the fleet)
/// plus one for requests naming none or an unknown one.
#[derive(Debug)]
pub(crate) struct Cache {
    pub(crate) config: CacheConfig,
    models: RwLock<HashMap<String, Arc<ModelCache>>>,
    default: Arc<ModelCache>,
    /// Tokenizers by model (the global one under [`DEFAULT_MODEL`]), loaded at start-up.
    tokenizers: HashMap<String, Arc<HfTokenizer>>,
    configured: BTreeSet<String>,
    epoch: Instant,
    pub(crate) metrics: CacheMetrics,
    /// KV-event subscriptions by (model, endpoint): owned here, stopped when dropped.
    subscriptions: Mutex<HashMap<(String, String), Subscribed>>,
}

#[derive(Debug)]
struct Subscribed {
    address: String,
    role: Role,
    _subscription: Subscription,
    stats: Arc<SubscriberStats>,
}

fn load_tokenizer(field: String, path: &std::path::Path) -> Result<Arc<HfTokenizer>, ConfigError> {
    HfTokenizer::load(path)
        .map(Arc::new)
        .map_err(|e| ConfigError::Field {
            field,
            message: e.to_string(),
        })
}

impl Cache {
    /// Builds the state (loading tokenizers) for `config`; `models` are the gateway's
    /// configured model names (metrics labels).
    pub(crate) fn new(
        config: &CacheConfig,
        models: &[String],
        metrics: CacheMetrics,
    ) -> Result<Cache, ConfigError> {
        config.validate()?;
        let mut tokenizers = HashMap::new();
        if let Some(path) = &config.tokenizer {
            tokenizers.insert(
                DEFAULT_MODEL.to_string(),
                load_tokenizer("cache.tokenizer".into(), path)?,
            );
        }
        for (m, c) in &config.models {
            if let Some(path) = &c.tokenizer {
                tokenizers.insert(
                    m.clone(),
                    load_tokenizer(format!("cache.models.{m}.tokenizer"), path)?,
                );
            }
        }
        let configured: BTreeSet<String> =
            models.iter().chain(config.models.keys()).cloned().collect();
        let epoch = Instant::now();
        let default = Arc::new(ModelCache::new(
            DEFAULT_MODEL.into(),
            config.block_size,
            tokenizers.get(DEFAULT_MODEL).cloned(),
            config,
            epoch,
        ));
        Ok(Cache {
            config: config.clone(),
            models: RwLock::new(HashMap::new()),
            default,
            tokenizers,
            configured,
            epoch,
            metrics,
            subscriptions: Mutex::new(HashMap::new()),
        })
    }

    /// The index for `model`: its own when the model is known (configured or in the snapshot),
    /// else the default one.
    pub(crate) fn model(&self, model: Option<&str>, snap: &Snapshot) -> Arc<ModelCache> {
        let Some(m) = model else {
            return self.default.clone();
        };
        if let Some(mc) = self.models.read().unwrap_or_else(|p| p.into_inner()).get(m) {
            return mc.clone();
        }
        let known = self.configured.contains(m) || snap.models.iter().any(|x| x == m);
        if !known {
            return self.default.clone();
        }
        let mut models = self.models.write().unwrap_or_else(|p| p.into_inner());
        models
            .entry(m.to_string())
            .or_insert_with(|| {
                // Known models only (configured, or served by the fleet as discovery reports
                // it), as the request metrics label them: never a client's free text.
                let label = m.to_string();
                let tokenizer = self
                    .tokenizers
                    .get(m)
                    .or_else(|| self.tokenizers.get(DEFAULT_MODEL))
                    .cloned();
                Arc::new(ModelCache::new(
                    label,
                    self.config.block_size_for(Some(m)),
                    tokenizer,
                    &self.config,
                    self.epoch,
                ))
            })
            .clone()
    }

    /// Purges endpoints that left the routable set, and models no longer served.
    pub(crate) fn retain(&self, snap: &Snapshot) {
        self.purge(snap);
        self.subscribe(snap);
    }

    fn purge(&self, snap: &Snapshot) {
        let keep: BTreeSet<&str> = snap
            .prefill
            .iter()
            .chain(snap.decode.iter())
            .map(|e| e.name.as_str())
            .collect();
        self.default.retain(&keep);
        let mut models = self.models.write().unwrap_or_else(|p| p.into_inner());
        models.retain(|m, _| self.configured.contains(m) || snap.models.iter().any(|x| x == m));
        for mc in models.values() {
            mc.retain(&keep);
        }
    }

    /// Where `ep` publishes its KV events (and its replay socket): its `pdgate.io/kv-events`
    /// annotation (the endpoint's `kv_events`), else `kv_events_port` on its host.
    fn events_address(&self, ep: &Endpoint) -> Option<(String, Option<String>)> {
        let on_host = |port: Option<u16>| {
            let port = port?;
            let host = ep.pod.ip()?;
            Some(if host.contains(':') {
                format!("tcp://[{host}]:{port}")
            } else {
                format!("tcp://{host}:{port}")
            })
        };
        let address = ep
            .pod
            .annotation(KV_EVENTS_ANNOTATION)
            .map(str::to_string)
            .or_else(|| on_host(self.config.kv_events_port))?;
        let replay = ep
            .pod
            .annotation(KV_EVENTS_REPLAY_ANNOTATION)
            .map(str::to_string)
            .or_else(|| on_host(self.config.kv_events_replay_port));
        Some((address, replay))
    }

    /// Subscribes to the KV events of every routable endpoint that publishes them (once per
    /// model index it feeds) and drops the subscriptions of the others. Needs a tokio runtime
    /// (discovery's task); without one it does nothing.
    fn subscribe(&self, snap: &Snapshot) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        struct Wanted {
            key: (String, String),
            address: String,
            replay: Option<String>,
            role: Role,
            model: Arc<ModelCache>,
        }
        let mut wanted: Vec<Wanted> = Vec::new();
        for ep in snap.prefill.iter().chain(snap.decode.iter()) {
            let Some((address, replay)) = self.events_address(ep) else {
                continue;
            };
            let models: Vec<Option<&str>> = if ep.models.is_empty() {
                vec![None]
            } else {
                ep.models.iter().map(|m| Some(m.as_str())).collect()
            };
            for m in models {
                wanted.push(Wanted {
                    key: (m.unwrap_or_default().to_string(), ep.name.clone()),
                    address: address.clone(),
                    replay: replay.clone(),
                    role: ep.role,
                    model: self.model(m, snap),
                });
            }
        }
        let mut subs = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        subs.retain(|key, s| {
            wanted
                .iter()
                .any(|w| w.key == *key && w.address == s.address)
        });
        for Wanted {
            key,
            address,
            replay,
            role,
            model,
        } in wanted
        {
            if subs.contains_key(&key) {
                continue;
            }
            let Some(feed) = model.feed(&key.1) else {
                continue;
            };
            let subscription =
                Subscription::connect(&address, replay, feed, SubscriberConfig::default());
            let stats = subscription.stats().clone();
            model.watch(&key.1, stats.clone());
            subs.insert(
                key,
                Subscribed {
                    address,
                    role,
                    _subscription: subscription,
                    stats,
                },
            );
        }
    }

    /// Stops every subscription (shutdown).
    pub(crate) fn stop(&self) {
        self.subscriptions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Refreshes the index gauges (called when metrics are scraped).
    pub(crate) fn refresh_gauges(&self) {
        let models = self.models.read().unwrap_or_else(|p| p.into_inner());
        let mut by_label: HashMap<&str, (usize, usize)> = HashMap::new();
        for mc in std::iter::once(&self.default).chain(models.values()) {
            let s = mc.stats();
            let e = by_label.entry(mc.label.as_str()).or_default();
            e.0 += s.entries;
            e.1 += s.bytes;
        }
        for (label, (entries, bytes)) in by_label {
            self.metrics.set_index(label, entries, bytes);
        }
        let subs = self.subscriptions.lock().unwrap_or_else(|p| p.into_inner());
        for role in [Role::Prefill, Role::Decode] {
            let stats: Vec<&SubscriberStats> = subs
                .values()
                .filter(|s| s.role == role)
                .map(|s| s.stats.as_ref())
                .collect();
            self.metrics.set_events(role.as_str(), &stats);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Load;
    use bytes::Bytes;

    fn ep(name: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            name: name.into(),
            base_url: format!("http://{name}"),
            pod: kvtransfer::Pod::default(),
            role: Role::Prefill,
            models: vec![],
            connector: None,
            agent: None,
            load: Arc::new(Load::default()),
            authorization: None,
        })
    }

    fn cache() -> Cache {
        let mut registry = prometheus_client::registry::Registry::default();
        Cache::new(
            &CacheConfig::default(),
            &["m".to_string()],
            CacheMetrics::new(&mut registry),
        )
        .unwrap()
    }

    #[test]
    fn events_that_stop_after_a_decision_switch_it_to_approximate_until_they_resume() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let timeout = Duration::from_millis(100);
        let mut w = EventWatch::new(Arc::new(SubscriberStats::default()));
        // A decision that stores nothing new expects no event: no wait starts.
        assert_eq!(w.check_with(0, false, s(0), timeout), EventsNow::Flowing);
        assert_eq!(w.check_with(0, false, s(500), timeout), EventsNow::Flowing);
        // One that does, followed by a batch in time: still flowing.
        assert_eq!(w.check_with(0, true, s(600), timeout), EventsNow::Flowing);
        assert_eq!(w.check_with(1, false, s(650), timeout), EventsNow::Flowing);
        // No batch within the timeout of the first unconfirmed decision (at 700): stopped, once.
        assert_eq!(w.check_with(1, true, s(700), timeout), EventsNow::Flowing);
        assert_eq!(w.check_with(1, true, s(750), timeout), EventsNow::Flowing);
        assert_eq!(w.check_with(1, false, s(800), timeout), EventsNow::Flowing);
        assert_eq!(w.check_with(1, true, s(801), timeout), EventsNow::Stopped);
        assert_eq!(
            w.check_with(1, true, s(900), timeout),
            EventsNow::StillStopped
        );
        // A batch arrives: precise again.
        assert_eq!(w.check_with(2, true, s(950), timeout), EventsNow::Flowing);
        // A zero timeout never gives up on events.
        let mut w = EventWatch::new(Arc::new(SubscriberStats::default()));
        assert_eq!(
            w.check_with(0, true, s(0), Duration::ZERO),
            EventsNow::Flowing
        );
        assert_eq!(
            w.check_with(0, true, s(9000), Duration::ZERO),
            EventsNow::Flowing
        );
    }

    #[test]
    fn a_recorded_decision_is_matched_and_purged_with_its_endpoint() {
        let c = cache();
        let snap = Snapshot {
            prefill: vec![ep("a:1"), ep("b:1")],
            models: vec!["m".into()],
            ..Snapshot::default()
        };
        let mc = c.model(Some("m"), &snap);
        assert_eq!(mc.label, "m");
        let body = JsonBody::parse(Bytes::from(format!(
            r#"{{"prompt":"{}"}}"#,
            "z".repeat(640)
        )))
        .unwrap();
        let view = mc.view(&body, Route::Completions);
        assert_eq!(view.keys.len(), 10);
        let now = Instant::now();
        {
            let mut s = mc.lock();
            s.prepare(&view);
            assert_eq!(s.blocks(&snap.prefill[0]), 0);
            s.record(&snap.prefill[0], &view, now);
            s.prepare(&view);
            assert_eq!(s.blocks(&snap.prefill[0]), 10);
            assert_eq!(s.blocks(&snap.prefill[1]), 0);
        }
        // Unknown models share the default index; no label is minted for them.
        assert_eq!(c.model(Some("nope"), &snap).label, DEFAULT_MODEL);
        c.refresh_gauges();
        let gone = Snapshot {
            prefill: vec![ep("b:1")],
            models: vec!["m".into()],
            ..Snapshot::default()
        };
        c.retain(&gone);
        let mut s = mc.lock();
        s.prepare(&view);
        assert_eq!(s.blocks(&snap.prefill[0]), 0);
    }
}
