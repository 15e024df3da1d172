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
pub(crate) mod engine_tokens;
pub(crate) mod events;
pub(crate) mod metrics;
pub(crate) mod score;
mod scorer;
pub(crate) mod view;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtransfer::JsonBody;
use pdcache::index::{CacheIndex, EndpointId, IndexConfig};
use pdcache::keys::Space;
use pdcache::subscribe::{Feed, SharedIndex, SubscriberConfig, SubscriberStats, Subscription};
use pdcache::tokenizer::HfTokenizer;

pub use config::{CacheConfig, ModelCacheConfig};
pub(crate) use metrics::CacheMetrics;
use scorer::IndexState;
pub(crate) use scorer::Scorer;
pub(crate) use view::PrefixView;

use crate::endpoints::{Endpoint, Role, Snapshot};
use crate::error::ConfigError;
use crate::route::Route;

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
    /// Some endpoint publishes KV events into this index (set as subscriptions change).
    has_events: AtomicBool,
    events_timeout: Duration,
    state: Mutex<IndexState>,
    index: SharedIndex,
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
            has_events: AtomicBool::new(false),
            events_timeout: config.events_timeout,
            state: Mutex::new(IndexState::default()),
            index: Arc::new(Mutex::new(index)),
        }
    }

    /// The prefix view of a request for this model.
    pub(crate) fn view(&self, body: &JsonBody, route: Route) -> PrefixView {
        PrefixView::read(body, route, self.block_size, self.tokenizer.as_deref())
    }

    /// Whether this model has a local tokenizer (else [`Cache::engine_tokens`] may help).
    pub(crate) fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// Whether some endpoint publishes KV events for this model.
    pub(crate) fn has_events(&self) -> bool {
        self.has_events.load(Ordering::Relaxed)
    }

    /// The view of a prompt whose token ids an engine gave.
    pub(crate) fn token_view(&self, ids: &[u32]) -> PrefixView {
        PrefixView::from_tokens(ids, self.block_size)
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
        state.by_slot.clear();
        for (name, id) in gone {
            index.remove_endpoint(id);
            state.set_precise(id, false);
            state.ids.remove(&name);
        }
    }

    /// The feed for `name`'s events, marking it precise. `ranks`: the names of every
    /// data-parallel rank of its engine, by rank (empty for an engine of one rank), where a
    /// batch naming its rank goes.
    fn feed(&self, name: &str, ranks: &[String]) -> Option<Feed> {
        let Scorer {
            mut state,
            mut index,
            ..
        } = self.lock();
        let id = state.id(&mut index, name)?;
        state.set_precise(id, true);
        let ranks = ranks
            .iter()
            .map(|r| state.id(&mut index, r))
            .collect::<Option<Vec<EndpointId>>>()?;
        Some(Feed {
            index: self.index.clone(),
            endpoint: id,
            ranks,
        })
    }

    /// Watches `name`'s subscription counters, to notice when its events stop.
    fn watch(&self, name: &str, stats: Arc<SubscriberStats>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = state.ids.get(name).copied() {
            state.watch(id, stats);
        }
    }

    pub(crate) fn stats(&self) -> pdcache::index::IndexStats {
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
    /// `config` as a prefill is weighed: its in-flight requests at `prefill_load_weight`
    /// (their queued tokens already count).
    pub(crate) prefill_config: CacheConfig,
    /// `config` as the decode of a disaggregated request is weighed: its uncached tokens at
    /// `decode_cache_weight` (it receives the prompt's KV and computes none of it).
    pub(crate) decode_config: CacheConfig,
    /// By model name (known models only; foldhash: SipHash was half of a decision's model
    /// lookup).
    models: RwLock<HashMap<String, Arc<ModelCache>, foldhash::fast::RandomState>>,
    default: Arc<ModelCache>,
    /// Tokenizers by model (the global one under [`DEFAULT_MODEL`]), loaded at start-up.
    tokenizers: HashMap<String, Arc<HfTokenizer>>,
    configured: BTreeSet<String>,
    epoch: Instant,
    pub(crate) metrics: CacheMetrics,
    /// KV-event subscriptions by (model, endpoint): owned here, stopped when dropped.
    subscriptions: Mutex<HashMap<(String, String), Subscribed>>,
    /// Engine-tokenized prompts (`cache.engine_tokenize`).
    pub(crate) engine_tokens: Option<engine_tokens::EngineTokens>,
    /// What a decode caches can decide something ([`CacheConfig::decodes_read`]): its KV
    /// events are subscribed to and its entries written only then.
    pub(crate) decodes_read: bool,
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

/// The prefix view of a request: token keys from the local tokenizer, else (with
/// `cache.engine_tokenize`) from an engine's `/tokenize`, else approximate keys.
pub(crate) async fn view_of(
    cache: &Cache,
    client: &crate::engine::EnginePool,
    health: &crate::endpoints::health::Health,
    snap: &Snapshot,
    body: &JsonBody,
    route: Route,
    model: Option<&str>,
) -> PrefixView {
    let mc = cache.model(model, snap);
    let view = match &cache.engine_tokens {
        Some(et)
            if !mc.has_tokenizer()
                && cache
                    .config
                    .engine_tokenize
                    .unwrap_or_else(|| mc.has_events()) =>
        {
            // Boxed: the engine call's future stays off the request's own when the knob is off.
            match Box::pin(et.tokens(client, health, snap, body, route, model)).await {
                Some(ids) => mc.token_view(&ids),
                None => mc.view(body, route),
            }
        }
        _ => mc.view(body, route),
    };
    in_adapter_space(view, snap, model)
}

/// An adapter's blocks are its own (vLLM hashes its name into each): the view of a request for
/// an adapter of the fleet moves into the adapter's key space of its base model's index, where
/// its engines' events (`lora_name`) land too. Other views stay as they are.
fn in_adapter_space(mut view: PrefixView, snap: &Snapshot, model: Option<&str>) -> PrefixView {
    if let Some(adapter) = model.filter(|m| snap.adapter_parent(m).is_some()) {
        Space::adapter(adapter).apply(&mut view.keys);
    }
    view
}

impl Cache {
    /// Builds the state (loading tokenizers) for `config`; `models` are the gateway's
    /// configured model names (metrics labels); `decode_cache_aware`: the decode policy is
    /// `cache_aware`.
    pub(crate) fn new(
        config: &CacheConfig,
        models: &[String],
        metrics: CacheMetrics,
        decode_cache_aware: bool,
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
            prefill_config: CacheConfig {
                load_weight: config.prefill_load_weight,
                ..config.clone()
            },
            decode_config: CacheConfig {
                cache_weight: config.decode_cache_weight,
                ..config.clone()
            },
            models: RwLock::new(HashMap::default()),
            default,
            tokenizers,
            configured,
            epoch,
            metrics,
            subscriptions: Mutex::new(HashMap::new()),
            // Unset means "where events need it": decided per model on each request.
            engine_tokens: (config.engine_tokenize != Some(false)).then(|| {
                engine_tokens::EngineTokens::new(
                    config.engine_tokenize_cache,
                    config.engine_tokenize_timeout,
                )
            }),
            decodes_read: config.decodes_read(decode_cache_aware),
        })
    }

    /// The index for `model`: its own when the model is known (configured or in the snapshot),
    /// else the default one.
    /// A LoRA adapter shares its base model's index (in its own key space).
    pub(crate) fn model(&self, model: Option<&str>, snap: &Snapshot) -> Arc<ModelCache> {
        let Some(m) = model else {
            return self.default.clone();
        };
        let m = snap.adapter_parent(m).unwrap_or(m);
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
    /// annotation (the endpoint's `kv_events`), else `kv_events_port` on its host; for a
    /// data-parallel rank, moved as vLLM moves each rank's publisher
    /// ([`pdcache::ranks::rank_endpoint`]).
    fn events_address(&self, ep: &Endpoint) -> Option<(String, Option<String>)> {
        let (address, replay) = self.engine_events_address(ep)?;
        let Some(rank) = ep.rank else {
            return Some((address, replay));
        };
        let moved = |a: &str| pdcache::ranks::rank_endpoint(a, rank);
        Some((moved(&address)?, replay.as_deref().and_then(moved)))
    }

    /// Where `ep`'s engine (its rank 0) publishes its KV events and its replay socket.
    fn engine_events_address(&self, ep: &Endpoint) -> Option<(String, Option<String>)> {
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
    /// model index it feeds; a decode's only where its cache is read, [`Cache::decodes_read`])
    /// and drops the subscriptions of the others. Needs a tokio runtime (discovery's task);
    /// without one it does nothing.
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
            ranks: Vec<String>,
        }
        let mut wanted: Vec<Wanted> = Vec::new();
        // Unread, a decode's events would cost a socket, a decoding task and index entries
        // each, and decide nothing.
        let decodes: &[Arc<Endpoint>] = if self.decodes_read { &snap.decode } else { &[] };
        for ep in snap.prefill.iter().chain(decodes) {
            let Some((address, replay)) = self.events_address(ep) else {
                continue;
            };
            let models: Vec<Option<&str>> = if ep.models.is_empty() {
                vec![None]
            } else {
                ep.models.iter().map(|m| Some(m.as_str())).collect()
            };
            let ranks: Vec<String> = match ep.rank {
                None => Vec::new(),
                Some(_) => crate::endpoints::ranks::targets(&ep.pod)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(name, _)| name)
                    .collect(),
            };
            for m in models {
                wanted.push(Wanted {
                    key: (m.unwrap_or_default().to_string(), ep.name.clone()),
                    address: address.clone(),
                    replay: replay.clone(),
                    role: ep.role,
                    model: self.model(m, snap),
                    ranks: ranks.clone(),
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
            ranks,
        } in wanted
        {
            if subs.contains_key(&key) {
                continue;
            }
            let Some(feed) = model.feed(&key.1, &ranks) else {
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
        let fed: BTreeSet<String> = subs.keys().map(|(m, _)| m.clone()).collect();
        drop(subs);
        self.mark_event_models(&fed, snap);
    }

    /// Tells each model index whether events feed it (`fed`: the models of the subscriptions,
    /// "" for endpoints that name none), and warns once per change about a model whose events
    /// can never match: no tokenizer and `engine_tokenize = false`.
    fn mark_event_models(&self, fed: &BTreeSet<String>, snap: &Snapshot) {
        let fed: Vec<Arc<ModelCache>> = fed
            .iter()
            .map(|m| self.model((!m.is_empty()).then_some(m.as_str()), snap))
            .collect();
        let all: Vec<Arc<ModelCache>> = std::iter::once(self.default.clone())
            .chain(
                self.models
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .cloned(),
            )
            .collect();
        for mc in all {
            let on = fed.iter().any(|f| Arc::ptr_eq(f, &mc));
            let was = mc.has_events.swap(on, Ordering::Relaxed);
            if on && !was && !mc.has_tokenizer() && self.config.engine_tokenize == Some(false) {
                tracing::warn!(
                    model = mc.label.as_str(),
                    "endpoints publish KV events for this model, but it has no tokenizer and \
                     cache.engine_tokenize = false: its prompts get approximate keys, which never \
                     match the events, so its routing is approximate; configure a tokenizer or \
                     leave engine_tokenize unset"
                );
            }
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
mod tests;
