//! Endpoints and the routable snapshot.
//!
//! Discovery produces pods; [`build_snapshot`] (pure) turns them into the routable set, which the
//! [`EndpointStore`] publishes atomically. In-flight counters live beside the snapshot, keyed by
//! endpoint, so they survive snapshot swaps and policies read them without locks. Choosing among
//! endpoints is [`policy`]'s; whether they are fit to choose is [`health`]'s.

pub mod adapters;
pub mod bootstrap;
pub mod engine_load;
pub mod health;
pub mod policy;
pub mod ranks;
pub mod reliability;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kvtransfer::{KvTransferAgent, Pod, Registry};

/// The role an engine plays.
/// Pod annotation (and what an `https://` endpoint URL sets): `https` reaches the engine over
/// TLS (`security.engine_ca_file`).
pub(crate) const ENGINE_SCHEME_ANNOTATION: &str = "pdgate.io/engine-scheme";

/// `http://host:port`, or `https://...` for a pod annotated [`ENGINE_SCHEME_ANNOTATION`];
/// `None` without an IP.
pub(crate) fn base_url(pod: &Pod) -> Option<String> {
    let mut url = pod.base_url()?;
    if pod.annotation(ENGINE_SCHEME_ANNOTATION) == Some("https") {
        // `http://...` -> `https://...`: the engine is reached over TLS.
        url.replace_range(..4, "https");
    }
    Some(url)
}

/// Internal: how a static endpoint's `api_key` reaches its [`Endpoint`] (which removes it from
/// its copy of the pod and keeps a sensitive header value).
pub(crate) const ENGINE_KEY_ANNOTATION: &str = "pdgate.internal/engine-api-key";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Encodes a multimodal request's items before its prefill (encoder disaggregation; role
    /// label `encode`).
    Encode,
    /// Computes the prompt's KV cache.
    Prefill,
    /// Streams the tokens.
    Decode,
}

impl Role {
    /// Label value and metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Encode => "encode",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role a pod's role label names (`prefill`, `decode`, `encode`); `None` for anything
    /// else (a combined pod, which pdgate does not route to).
    pub fn of_label(label: Option<&str>) -> Option<Role> {
        match label {
            Some("prefill") => Some(Role::Prefill),
            Some("decode") => Some(Role::Decode),
            Some("encode") => Some(Role::Encode),
            _ => None,
        }
    }
}

/// Live load of one endpoint, shared across snapshots.
#[derive(Debug, Default)]
pub struct Load {
    /// What it holds, in one word so that a cache-aware decision reads both halves with one
    /// load: the requests in the low 32 bits, and in the high 32 the prompt tokens it computes
    /// for them where pdgate predicted them (a cache-aware prefill's uncached tokens: work
    /// queued ahead of a new request; on a decode, the prompt tokens whose KV it holds). Guards add and subtract the same amounts, so both halves
    /// are exact (the tokens modulo 2^32, four billion).
    held: AtomicU64,
    /// What the engine holds beyond [`Load::held`], packed the same way: requests other
    /// gateways (or clients) sent it, and an estimate of the prompt tokens it computes for them.
    /// Written by [`engine_load`] from the engine's own metrics at each scrape (zero when that
    /// scrape is off or failed), so a decision reads both words with two relaxed loads.
    others: AtomicU64,
    total: AtomicU64,
    /// Predicted prompt tokens of every request ever sent ([`LoadGuard::computing`]): with
    /// [`Load::total`], the mean per request [`engine_load`] prices others' requests at.
    tokens_total: AtomicU64,
    /// Prompt tokens the engine's KV cache holds in all, as its metrics report it (vLLM's
    /// `vllm:cache_config_info`: `num_gpu_blocks` x `block_size`; [`engine_load`]); 0 while
    /// unknown.
    cache_tokens: AtomicU64,
    /// A small number no other live endpoint of the [`LoadTable`] has (0 outside one): per
    /// endpoint state elsewhere is a vector indexed by it, found without hashing a name.
    slot: u32,
}

impl Load {
    /// This endpoint's slot in its [`LoadTable`] (dense; reused once the endpoint is gone).
    pub(crate) fn slot(&self) -> usize {
        self.slot as usize
    }

    /// Requests currently held by this endpoint.
    pub fn in_flight(&self) -> usize {
        self.held().0 as usize
    }

    /// Prompt tokens it is computing for the requests it holds, as far as pdgate predicted
    /// them (see [`LoadGuard::computing`]).
    pub fn computing_tokens(&self) -> usize {
        self.held().1 as usize
    }

    /// The requests it holds and the prompt tokens it computes for them, read together.
    #[inline]
    pub fn held(&self) -> (u32, u32) {
        let held = self.held.load(Ordering::Relaxed);
        (held as u32, (held >> 32) as u32)
    }

    /// Requests ever sent to this endpoint.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// What the engine holds for others, as [`Load::held`] packs it: requests beyond this
    /// gateway's, and the prompt tokens estimated for them (`cache.engine_load_interval`; zero
    /// while off).
    #[inline]
    pub fn others(&self) -> (u32, u32) {
        let others = self.others.load(Ordering::Relaxed);
        (others as u32, (others >> 32) as u32)
    }

    /// This gateway's load plus the others' ([`Load::held`] + [`Load::others`]): the engine's
    /// whole load as far as pdgate knows it, for cost-based choices. One add of the two words:
    /// each half of the others' word is kept below 2^31 ([`Load::set_others`]), so the requests
    /// never carry into the tokens (this gateway holds fewer than 2^31 requests).
    #[inline]
    pub fn with_others(&self) -> (u32, u32) {
        let word = self
            .held
            .load(Ordering::Relaxed)
            .wrapping_add(self.others.load(Ordering::Relaxed));
        (word as u32, (word >> 32) as u32)
    }

    /// Replaces what the engine is known to hold for others (each capped below 2^31, see
    /// [`Load::with_others`]).
    pub(crate) fn set_others(&self, requests: u32, tokens: u32) {
        const MOST: u32 = (1 << 31) - 1;
        let word = u64::from(requests.min(MOST)) | u64::from(tokens.min(MOST)) << 32;
        self.others.store(word, Ordering::Relaxed);
    }

    /// Prompt tokens the engine's KV cache holds in all, where its metrics said (0: not
    /// known).
    pub fn cache_tokens(&self) -> u64 {
        self.cache_tokens.load(Ordering::Relaxed)
    }

    /// Records the prompt tokens the engine's KV cache holds in all, as its metrics report it.
    pub(crate) fn set_cache_tokens(&self, tokens: u64) {
        self.cache_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Requests ever sent here and their predicted prompt tokens, summed.
    pub(crate) fn sent(&self) -> (u64, u64) {
        (
            self.total.load(Ordering::Relaxed),
            self.tokens_total.load(Ordering::Relaxed),
        )
    }
}

/// Holds one unit of an endpoint's in-flight count (and the prompt tokens that request makes it
/// compute, where known) until dropped.
#[derive(Debug)]
pub struct LoadGuard {
    load: Arc<Load>,
    /// What it added to the endpoint's [`Load::held`].
    held: u64,
}

impl LoadGuard {
    /// Counts one more request on `load`.
    pub fn acquire(load: &Arc<Load>) -> LoadGuard {
        LoadGuard::computing(load, 0)
    }

    /// Counts one more request on `load`, which computes `tokens` prompt tokens for it (a
    /// prefill leg whose uncached tokens a cache-aware decision predicted; a decode leg, whose
    /// prompt's KV it holds).
    pub fn computing(load: &Arc<Load>, tokens: u32) -> LoadGuard {
        let held = 1 | u64::from(tokens) << 32;
        load.held.fetch_add(held, Ordering::Relaxed);
        load.total.fetch_add(1, Ordering::Relaxed);
        if tokens != 0 {
            load.tokens_total
                .fetch_add(u64::from(tokens), Ordering::Relaxed);
        }
        LoadGuard {
            load: load.clone(),
            held,
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.load.held.fetch_sub(self.held, Ordering::Relaxed);
    }
}

/// One routable engine, or one data-parallel rank of one ([`ranks`]).
#[derive(Debug)]
pub struct Endpoint {
    /// `host:port` (the pod's name), or `host:port#dp<rank>` for a rank: used in headers, logs,
    /// metrics, and as the key of its load, health and cache entries.
    pub name: String,
    /// The data-parallel rank every leg to this endpoint is pinned to (`X-data-parallel-rank`);
    /// `None` for an engine that declares one rank (it places requests itself).
    pub rank: Option<u32>,
    /// Where it is reached (`http://host:port`, parsed).
    pub addr: crate::engine::EngineAddr,
    /// The pod, as discovery (and bootstrap lookups) described it.
    pub pod: Pod,
    /// Encode, prefill or decode.
    pub role: Role,
    /// Models served; empty means any.
    pub models: Vec<String>,
    /// LoRA adapters served (learned from the engine's `/v1/models`): a request for an adapter
    /// of the fleet goes only to endpoints that hold it.
    pub adapters: adapters::EndpointAdapters,
    /// The connector, from the pod's label or else the global default (prefill and decode): a
    /// decode pairs only with prefills of its connector. `None` for an encoder (it hands its
    /// items over through `ec_transfer_params`, whatever the KV connector of the prefill).
    pub connector: Option<String>,
    /// The agent for a prefill endpoint.
    pub agent: Option<Arc<dyn KvTransferAgent>>,
    /// Live load.
    pub load: Arc<Load>,
    /// `Authorization` for this engine (its own `api_key`), over `security.engine_api_key`.
    pub authorization: Option<http::HeaderValue>,
}

/// An idle endpoint named `name` (`http://name`) for unit tests.
#[cfg(test)]
pub(crate) fn test_endpoint(name: &str, role: Role) -> Arc<Endpoint> {
    Arc::new(Endpoint {
        name: name.into(),
        rank: None,
        addr: crate::engine::EngineAddr::parse(&format!("http://{name}")).expect("address"),
        pod: kvtransfer::Pod::default(),
        role,
        models: vec![],
        adapters: adapters::EndpointAdapters::default(),
        connector: None,
        agent: None,
        load: Arc::new(Load::default()),
        authorization: None,
    })
}

impl Endpoint {
    /// Where engine I/O sends a leg for this endpoint.
    pub(crate) fn target(&self) -> crate::engine::client::Target<'_> {
        crate::engine::client::Target {
            name: &self.name,
            addr: &self.addr,
            authorization: self.authorization.as_ref(),
            rank: self.rank,
        }
    }

    /// The engine's own name (the pod's): the same for every rank of it.
    pub fn engine_name(&self) -> &str {
        &self.pod.name
    }

    /// Whether this endpoint serves `model` (`None`: the client named none): a LoRA adapter
    /// of the fleet only where it is held, any other name by the endpoint's models.
    pub fn serves(&self, model: Option<&str>) -> bool {
        match model {
            None => true,
            Some(m) => self
                .adapters
                .serves(m)
                .unwrap_or_else(|| self.models.is_empty() || self.models.iter().any(|x| x == m)),
        }
    }

    /// Whether this decode endpoint accepts KV from a prefill using `connector`.
    pub fn accepts_connector(&self, connector: &str) -> bool {
        self.connector.as_deref().is_none_or(|c| c == connector)
    }
}

/// The routable set at one instant. Immutable; replaced whole.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Encoder endpoints (encoder disaggregation); empty in a fleet without encoders.
    pub encode: Vec<Arc<Endpoint>>,
    /// Prefill endpoints.
    pub prefill: Vec<Arc<Endpoint>>,
    /// Decode endpoints.
    pub decode: Vec<Arc<Endpoint>>,
    /// Union of served model names (sorted).
    pub models: Vec<String>,
    /// Every LoRA adapter a routable endpoint serves, with its base model.
    pub adapters: Arc<adapters::AdapterParents>,
    /// Pods left out, with the reason (for logs and `/ready` diagnostics).
    pub excluded: Vec<(String, String)>,
    /// Pair a prefill only with a decode of the same `roleset-name`.
    pub roleset_pairing: bool,
    /// Every prefill pairs with every decode (one connector, no roleset pairing: the usual
    /// fleet), set by [`build_snapshot`]: [`Snapshot::pairs`] then compares nothing, where a
    /// decision over a large fleet would compare connector names once per candidate.
    pub(crate) every_pair: bool,
    /// Every endpoint of both roles declares the same models (or none), set by
    /// [`build_snapshot`]: whether one serves a model says whether all do.
    pub(crate) same_models: bool,
    /// The loads of [`Snapshot::prefill`] and [`Snapshot::decode`], in their order
    /// ([`Snapshot::index_loads`]): see [`Snapshot::loads_of`].
    pub(crate) loads: [Vec<Arc<Load>>; 2],
}

impl Snapshot {
    /// Whether decode `d` may take KV from prefill `p`: the connectors agree and, with roleset
    /// pairing, both belong to the same roleset.
    #[inline]
    pub fn pairs(&self, p: &Endpoint, d: &Endpoint) -> bool {
        if self.every_pair {
            return true;
        }
        self.pairs_by_labels(p, d)
    }

    fn pairs_by_labels(&self, p: &Endpoint, d: &Endpoint) -> bool {
        d.accepts_connector(p.connector.as_deref().unwrap_or_default())
            && (!self.roleset_pairing
                || (p.pod.label(kvtransfer::labels::ROLESET_NAME).is_some()
                    && p.pod.label(kvtransfer::labels::ROLESET_NAME)
                        == d.pod.label(kvtransfer::labels::ROLESET_NAME)))
    }

    /// The base model of `model` when it is an adapter of the fleet.
    pub fn adapter_parent(&self, model: &str) -> Option<&str> {
        self.adapters.get(model).map(String::as_str)
    }

    /// Whether every endpoint of both roles is a candidate for a request for `model`: both
    /// roles have endpoints, all serve `model`, and every prefill pairs with every decode (the
    /// usual fleet). A decision then weighs the snapshot's own lists instead of copying the
    /// qualifying endpoints out of them.
    #[inline]
    pub(crate) fn all_serve(&self, model: Option<&str>) -> bool {
        self.every_pair
            && self.same_models
            && !self.decode.is_empty()
            && self.prefill.first().is_some_and(|p| p.serves(model))
    }

    /// Records the loads of the prefill and decode lists as they are now (for
    /// [`Snapshot::loads_of`]); called whenever those lists are set.
    pub(crate) fn index_loads(&mut self) {
        let loads = |list: &[Arc<Endpoint>]| list.iter().map(|e| e.load.clone()).collect();
        self.loads = [loads(&self.prefill), loads(&self.decode)];
    }

    /// The loads of `list`, in its order, if `list` is this snapshot's prefill or decode list
    /// and [`Snapshot::index_loads`] recorded it. A large fleet's decision reads every
    /// candidate's load: from this list, one read into a contiguous array and one into the load,
    /// where through the endpoint a second dependent read (each a cache miss once the index
    /// walk has evicted the endpoints) came before it.
    #[inline]
    pub(crate) fn loads_of(&self, list: &[Arc<Endpoint>]) -> Option<&[Arc<Load>]> {
        [&self.prefill, &self.decode]
            .into_iter()
            .zip(&self.loads)
            .find(|(own, loads)| {
                std::ptr::eq(own.as_ptr(), list.as_ptr())
                    && own.len() == list.len()
                    && loads.len() == list.len()
            })
            .map(|(_, loads)| loads.as_slice())
    }

    /// Whether all prefills share one connector that every decode accepts, without roleset
    /// pairing (then every pair agrees).
    fn every_prefill_pairs_with_every_decode(&self) -> bool {
        let Some(first) = self.prefill.first() else {
            return true;
        };
        let connector = first.connector.as_deref().unwrap_or_default();
        !self.roleset_pairing
            && self
                .prefill
                .iter()
                .all(|p| p.connector.as_deref().unwrap_or_default() == connector)
            && self.decode.iter().all(|d| d.accepts_connector(connector))
    }

    /// Whether at least one prefill/decode pair can serve some request.
    pub fn has_routable_pair(&self) -> bool {
        self.prefill.iter().any(|p| {
            self.decode.iter().any(|d| {
                self.pairs(p, d)
                    && (p.models.is_empty()
                        || d.models.is_empty()
                        || p.models.iter().any(|m| d.models.contains(m)))
            })
        })
    }
}

/// Load counters keyed by endpoint name, kept across snapshots.
#[derive(Debug, Default)]
pub struct LoadTable(Mutex<Loads>);

#[derive(Debug, Default)]
struct Loads {
    by_name: HashMap<String, Arc<Load>>,
    /// Slots of counters dropped from `by_name` (nobody holds them any more).
    free: Vec<u32>,
}

impl LoadTable {
    fn get(&self, name: &str) -> Arc<Load> {
        let mut loads = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Loads { by_name, free } = &mut *loads;
        if let Some(load) = by_name.get(name) {
            return load.clone();
        }
        let slot = free
            .pop()
            .unwrap_or_else(|| u32::try_from(by_name.len()).unwrap_or(u32::MAX));
        let load = Arc::new(Load {
            slot,
            ..Load::default()
        });
        by_name.insert(name.to_string(), load.clone());
        load
    }

    fn retain(&self, keep: &BTreeSet<String>) {
        let mut loads = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Loads { by_name, free } = &mut *loads;
        // Keep counters still referenced by in-flight requests: they drain to zero on their own.
        by_name.retain(|k, v| {
            let keep = keep.contains(k) || Arc::strong_count(v) > 1;
            if !keep {
                free.push(v.slot);
            }
            keep
        });
    }
}

/// Inputs of [`build_snapshot`] besides the pods.
#[derive(Debug)]
pub struct SnapshotInputs<'a> {
    /// Agent registry.
    pub registry: &'a Registry,
    /// Global default connector (already validated).
    pub default_connector: &'a str,
    /// Models for endpoints that declare none.
    pub default_models: &'a [String],
    /// Endpoint names currently ejected by health checking.
    pub unhealthy: &'a BTreeSet<String>,
    /// Pair prefill and decode only within a roleset.
    pub roleset_pairing: bool,
    /// LoRA adapters learned per endpoint name, with their base models.
    pub adapters: &'a BTreeMap<String, adapters::AdapterParents>,
}

fn models_of(pod: &Pod, default_models: &[String]) -> Vec<String> {
    match pod.label(kvtransfer::labels::MODEL_NAME) {
        Some(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|m| m.trim().to_string())
            .filter(|m| !m.is_empty())
            .collect(),
        _ => default_models.to_vec(),
    }
}

/// Pure: pods in, routable snapshot out.
pub fn build_snapshot(pods: &[Pod], inputs: &SnapshotInputs<'_>, loads: &LoadTable) -> Snapshot {
    let mut snap = Snapshot {
        roleset_pairing: inputs.roleset_pairing,
        ..Snapshot::default()
    };
    let mut models = BTreeSet::new();
    let mut names = BTreeSet::new();
    let mut fleet_adapters = adapters::AdapterParents::new();
    let mut built: Vec<Endpoint> = Vec::new();
    for pod in pods {
        let Some(role) = Role::of_label(pod.label(kvtransfer::labels::ROLE_NAME)) else {
            snap.excluded.push((
                pod.name.clone(),
                "role is neither prefill, decode nor encode".into(),
            ));
            continue;
        };
        let Some(base_url) = base_url(pod) else {
            snap.excluded.push((pod.name.clone(), "no IP".into()));
            continue;
        };
        let addr = match crate::engine::EngineAddr::parse(&base_url) {
            Ok(addr) => addr,
            Err(e) => {
                snap.excluded.push((pod.name.clone(), e.to_string()));
                continue;
            }
        };
        if !pod.ready {
            snap.excluded.push((pod.name.clone(), "not ready".into()));
            continue;
        }
        if inputs.unhealthy.contains(&pod.name) {
            snap.excluded.push((pod.name.clone(), "unhealthy".into()));
            continue;
        }
        if !names.insert(pod.name.clone()) {
            snap.excluded
                .push((pod.name.clone(), "duplicate endpoint".into()));
            continue;
        }
        let label = pod
            .label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER)
            .unwrap_or_default();
        if role != Role::Encode && !label.trim().is_empty() && !inputs.registry.contains(label) {
            // A misspelt label must not quietly become the default connector: the engine would
            // be paired with peers that speak another transfer protocol.
            let mut names = inputs.registry.valid_agent_names();
            names.sort();
            let why = format!(
                "unknown KV connector label {}={label:?} (registered: {})",
                kvtransfer::CONNECTOR_TYPE_IDENTIFIER,
                names.join(", ")
            );
            tracing::warn!(endpoint = %pod.name, "{why}; endpoint excluded");
            snap.excluded.push((pod.name.clone(), why));
            continue;
        }
        // As AIBrix's `ResolveAgentForPod`: a pod without the label has the global default
        // connector, prefill and decode alike, so an unlabelled decode pairs only with prefills
        // of that connector.
        let connector = inputs
            .registry
            .resolve_connector_type(label, inputs.default_connector);
        let (connector, agent) = match role {
            Role::Prefill => match inputs.registry.resolve(&connector) {
                Ok(agent) => (Some(connector), Some(agent)),
                Err(e) => {
                    snap.excluded.push((pod.name.clone(), e.to_string()));
                    continue;
                }
            },
            Role::Decode => (Some(connector), None),
            Role::Encode => (None, None),
        };
        if agent.as_ref().is_some_and(|a| a.needs_bootstrap_lookup())
            && pod.mooncake_bootstrap.is_none()
        {
            snap.excluded.push((
                pod.name.clone(),
                "prefill without bootstrap information yet".into(),
            ));
            continue;
        }
        let mut pod = pod.clone();
        let authorization = match pod.annotations.remove(ENGINE_KEY_ANNOTATION) {
            None => None,
            Some(key) => match http::HeaderValue::from_str(&format!("Bearer {key}")) {
                Ok(mut v) => {
                    v.set_sensitive(true);
                    Some(v)
                }
                Err(_) => {
                    snap.excluded.push((
                        pod.name.clone(),
                        "api_key is not a valid header value".into(),
                    ));
                    continue;
                }
            },
        };
        let targets = match ranks::targets(&pod) {
            Ok(t) => t,
            Err(why) => {
                snap.excluded.push((pod.name.clone(), why));
                continue;
            }
        };
        let pod = &pod;
        let endpoint_models = models_of(pod, inputs.default_models);
        models.extend(endpoint_models.iter().cloned());
        for (name, rank) in targets {
            // Health and ejection are per rank: one rank failing leaves its peers routable.
            if rank.is_some() && inputs.unhealthy.contains(&name) {
                snap.excluded.push((name, "unhealthy".into()));
                continue;
            }
            names.insert(name.clone());
            let own = inputs.adapters.get(&name);
            if let Some(own) = own {
                fleet_adapters.extend(own.iter().map(|(a, p)| (a.clone(), p.clone())));
            }
            built.push(Endpoint {
                adapters: adapters::EndpointAdapters {
                    own: own.map(|o| o.keys().cloned().collect()).unwrap_or_default(),
                    fleet: Arc::default(),
                },
                load: loads.get(&name),
                name,
                rank,
                addr: addr.clone(),
                authorization: authorization.clone(),
                pod: pod.clone(),
                role,
                models: endpoint_models.clone(),
                connector: connector.clone(),
                agent: agent.clone(),
            });
        }
    }
    // Each endpoint knows the fleet's adapters, known once every endpoint is.
    let fleet = Arc::new(fleet_adapters);
    for mut endpoint in built {
        endpoint.adapters.fleet = fleet.clone();
        let endpoint = Arc::new(endpoint);
        match endpoint.role {
            Role::Encode => snap.encode.push(endpoint),
            Role::Prefill => snap.prefill.push(endpoint),
            Role::Decode => snap.decode.push(endpoint),
        }
    }
    snap.adapters = fleet;
    loads.retain(&names);
    snap.models = models.into_iter().collect();

    snap.index_loads();
    snap.every_pair = snap.every_prefill_pairs_with_every_decode();
    snap.same_models = {
        let mut all = snap.prefill.iter().chain(&snap.decode);
        let first = all.next().map(|e| (&e.models, &e.adapters.own));
        all.all(|e| Some((&e.models, &e.adapters.own)) == first)
    };
    snap
}

/// The published snapshot plus the load table behind it.
#[derive(Debug, Default)]
pub struct EndpointStore {
    current: ArcSwap<Snapshot>,
    loads: LoadTable,
}

impl EndpointStore {
    /// The current snapshot (lock-free).
    pub fn load(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Rebuilds from `pods` and publishes; returns the new snapshot.
    pub fn publish(&self, pods: &[Pod], inputs: &SnapshotInputs<'_>) -> Arc<Snapshot> {
        let snap = Arc::new(build_snapshot(pods, inputs, &self.loads));
        self.current.store(snap.clone());
        snap
    }
}

#[cfg(test)]
mod tests;
