//! The gateway's shared state, built once from a validated configuration. Every request and
//! background task reads it; nothing here does I/O.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvtransfer::{Pod, Registry};
use tokio_util::task::TaskTracker;

use crate::cache::{Cache, CacheMetrics};
use crate::config::{Config, ConfigError, PrefillFailurePolicy};
use crate::endpoints::health::Health;
use crate::endpoints::policy::{self, Policy};
use crate::endpoints::{EndpointStore, Snapshot, SnapshotInputs};
use crate::engine::EnginePool;
use crate::limits::{Admission, RetryBudget};
use crate::metrics::Metrics;

/// A set of pods published by a discovery source.
pub type PodSet = Arc<Vec<Pod>>;

/// What the request path (`pd`, `http`) reads of the configuration, read once when the state is
/// built: none of it changes while the gateway runs (a reload that changes one of these keys
/// says it needs a restart), so a request reads these plain values instead of reaching through
/// the whole [`Config`].
#[derive(Debug)]
pub(crate) struct Settings {
    /// Bound on a prefill leg run before its decode (`prefill_timeout`).
    pub(crate) prefill_timeout: Duration,
    /// Bound on a prefill leg run beside its decode: `prefill_timeout`, at most
    /// `reliability.concurrent_prefill_timeout`.
    pub(crate) concurrent_prefill_timeout: Duration,
    /// Bound on the wait for a decode's response head (`decode_timeout`).
    pub(crate) decode_timeout: Duration,
    /// Longest silence of a relayed stream (`stream_idle_timeout`).
    pub(crate) stream_idle_timeout: Duration,
    /// A decode 5xx later than this, its prefill silent, blames the prefill
    /// (`reliability.kv_wait_evidence`).
    pub(crate) kv_wait_evidence: Duration,
    /// What a prefill that failed for good leads to (`on_prefill_failure`).
    pub(crate) on_prefill_failure: PrefillFailurePolicy,
    /// The encoder legs' knobs.
    pub(crate) encode: EncodeSettings,
    /// Answers name the endpoints that served them (`security.expose_target_headers`).
    pub(crate) expose_target_headers: bool,
    /// `/metrics` is served on the API port (no `security.admin_listen`).
    pub(crate) metrics_on_api: bool,
    /// The paths relayed to a decode as they are (`security.passthrough`).
    passthrough: Vec<String>,
}

impl Settings {
    fn of(config: &Config) -> Self {
        let legs = &config.legs;
        let reliability = &config.reliability;
        Settings {
            prefill_timeout: legs.prefill_timeout,
            concurrent_prefill_timeout: legs
                .prefill_timeout
                .min(reliability.concurrent_prefill_timeout),
            decode_timeout: legs.decode_timeout,
            stream_idle_timeout: legs.stream_idle_timeout,
            kv_wait_evidence: reliability.kv_wait_evidence,
            on_prefill_failure: legs.on_prefill_failure,
            encode: EncodeSettings {
                timeout: legs.encode_timeout,
                max_items: legs.encode_max_items,
                on_failure: legs.on_encode_failure,
            },
            expose_target_headers: config.security.expose_target_headers,
            metrics_on_api: config.security.admin_listen.is_none(),
            passthrough: config.security.passthrough.clone(),
        }
    }

    /// Whether `path` (already canonical) may be relayed to an engine (`security.passthrough`).
    pub(crate) fn passes(&self, path: &str) -> bool {
        crate::security::guard::allows(&self.passthrough, path)
    }
}

/// The encoder legs' knobs (`pd::encode`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EncodeSettings {
    /// Bound on one encoder leg (`encode_timeout`).
    pub(crate) timeout: Duration,
    /// Most multimodal items of one request (`encode_max_items`).
    pub(crate) max_items: usize,
    /// What an item no encoder could encode leads to (`on_encode_failure`).
    pub(crate) on_failure: PrefillFailurePolicy,
}

/// What chooses the endpoints of a request (`pd::select`): the two policies, the cache index,
/// health (an endpoint being probed is held back), the per-endpoint bound, and what a failed
/// leg's next endpoint may use (`max_retries`, the retry budget).
#[derive(Debug)]
pub(crate) struct Routing {
    /// Prefill selection.
    pub(crate) prefill_policy: Box<dyn Policy>,
    /// Decode selection.
    pub(crate) decode_policy: Box<dyn Policy>,
    /// Cache-aware routing state, when a policy is `cache_aware`.
    pub(crate) cache: Option<Arc<Cache>>,
    /// Endpoint health (the gateway's).
    pub(crate) health: Arc<Health>,
    /// Metrics (the gateway's): refusals and retries.
    pub(crate) metrics: Arc<Metrics>,
    /// Requests one endpoint takes at once; 0 unbounded (`max_in_flight_per_endpoint`).
    pub(crate) max_in_flight_per_endpoint: usize,
    /// Other endpoints one leg may be retried on (`max_retries`).
    pub(crate) max_retries: usize,
    /// Bounds retries across requests.
    pub(crate) retry_budget: RetryBudget,
}

/// What sends legs to engines (`pd::legs`, `pd::encode`, `pd::abort`, the passthrough relay):
/// the pooled client, the engines' credentials, health and metrics for the outcomes, the tasks
/// background aborts run on, and whether a leg waiting on an endpoint taken out of rotation
/// gives up.
#[derive(Debug)]
pub(crate) struct Engines {
    /// Pooled engine client.
    pub(crate) client: EnginePool,
    /// Endpoint health (the gateway's).
    pub(crate) health: Arc<Health>,
    /// Metrics (the gateway's).
    pub(crate) metrics: Arc<Metrics>,
    /// Short background work spawned by requests (engine aborts), waited for at shutdown.
    pub(crate) tasks: TaskTracker,
    /// `Authorization` for engine legs (`security.engine_api_key`).
    pub(crate) engine_authorization: Option<http::HeaderValue>,
    /// Whether client `Authorization` headers go to engines.
    pub(crate) forward_client_authorization: bool,
    /// Legs waiting on an endpoint taken out of rotation are given up at once
    /// (`reliability.retry_on_ejection`).
    pub(crate) retry_on_ejection: bool,
}

/// What a request passes on its way in (`http::edge`, the ext_proc server): the client keys,
/// the body's limits and the memory budget of bodies being read, and the gateway-wide request
/// limit.
#[derive(Debug)]
pub(crate) struct Edge {
    /// The client API keys (none: the API is open).
    pub(crate) client_keys: Arc<crate::security::auth::ClientKeys>,
    /// Bounds the memory held by request bodies being read.
    pub(crate) body_budget: crate::security::budget::BodyBudget,
    /// The gateway-wide request limit.
    pub(crate) admission: Admission,
    /// Bound on reading a request body (`security.request_body_timeout`).
    pub(crate) request_body_timeout: Duration,
    /// Largest request body (`max_body_bytes`).
    pub(crate) max_body_bytes: usize,
}

/// Everything the request path shares. It owns the handles each component is given
/// ([`Routing`], [`Engines`], [`Edge`]), so a signature says what a component touches.
#[derive(Debug)]
pub struct Gateway {
    /// The validated configuration.
    pub config: Config,
    /// What requests read of it, read once.
    pub(crate) settings: Settings,
    /// KV-transfer agents by name.
    pub registry: Registry,
    /// The global default connector, normalised.
    pub default_connector: String,
    /// The routable snapshot.
    pub store: EndpointStore,
    /// Endpoint selection.
    pub(crate) routing: Routing,
    /// Engine legs.
    pub(crate) engines: Engines,
    /// The way in.
    pub(crate) edge: Edge,
    /// Metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// Endpoint health (active checks and passive outlier detection).
    pub(crate) health: Arc<Health>,
    /// The listener's TLS (`security.tls_cert`), if configured.
    pub(crate) server_tls: Option<crate::security::tls::ServerTls>,
    /// Set at the start of a graceful shutdown: `/ready` answers 503 from then on.
    pub(crate) draining: AtomicBool,
    /// Prefills whose bootstrap facts the reconciler must look up again now.
    pub(crate) requery: crate::endpoints::bootstrap::Requery,
}

impl Gateway {
    /// Validates `config` and builds the shared state (with an empty snapshot).
    pub fn new(config: Config, registry: Registry) -> Result<Arc<Gateway>, ConfigError> {
        config.validate(&registry)?;
        let default_connector = registry
            .validate_default(&config.discovery.kv_connector)
            .map_err(|e| ConfigError::Field {
                field: "kv_connector".into(),
                message: e.to_string(),
            })?;
        let policy = |field: &str, name: &str| {
            policy::by_name(name).ok_or_else(|| ConfigError::Field {
                field: field.into(),
                message: format!("unknown policy {name:?}"),
            })
        };
        let prefill_policy = policy("prefill_policy", &config.policy.prefill_policy)?;
        let decode_policy = policy("decode_policy", &config.policy.decode_policy)?;
        tracing::debug!(
            prefill = prefill_policy.name(),
            decode = decode_policy.name(),
            "policies"
        );
        let mut metrics = Metrics::new();
        let cache = if prefill_policy.cache_aware() || decode_policy.cache_aware() {
            let cache_metrics = CacheMetrics::new(metrics.registry_mut());
            Some(Arc::new(Cache::new(
                &config.cache,
                &config.models,
                cache_metrics,
                decode_policy.cache_aware(),
            )?))
        } else {
            None
        };
        let metrics = Arc::new(metrics);
        metrics
            .access_log
            .store(config.http.access_log, std::sync::atomic::Ordering::Relaxed);
        let client_keys = crate::security::auth::ClientKeys::new(&config.security, metrics.clone())
            .map_err(|e| ConfigError::Field {
                field: "security.api_keys_file".into(),
                message: e.to_string(),
            })?;
        for name in client_keys.client_names() {
            metrics.declare_client(name);
        }
        let mut connectors = registry.valid_agent_names();
        connectors.sort();
        metrics.declare_fleet(&connectors);
        let engine_authorization = config
            .security
            .engine_authorization()
            .map_err(|(field, message)| ConfigError::Field { field, message })?;
        let tls_error = |field: &str, e: crate::security::tls::TlsError| ConfigError::Field {
            field: format!("security.{field}"),
            message: e.to_string(),
        };
        let engine_tls = crate::security::tls::engine_connector(&config.security)
            .map_err(|e| tls_error("engine_ca_file", e))?;
        let server_tls = crate::security::tls::ServerTls::from_config(&config.security)
            .map_err(|e| tls_error("tls_cert", e))?;
        let health = Arc::new(
            Health::new(&config.health.clone(), metrics.clone())
                .with_half_open_probe(config.reliability.half_open_probe)
                .with_latency_outliers(config.reliability.latency_rule()),
        );
        let routing = Routing {
            prefill_policy,
            decode_policy,
            cache,
            health: health.clone(),
            metrics: metrics.clone(),
            max_in_flight_per_endpoint: config.limits.max_in_flight_per_endpoint,
            max_retries: config.legs.max_retries as usize,
            retry_budget: RetryBudget::new(&config.limits),
        };
        let engines = Engines {
            client: EnginePool::with_tls(config.pool, Some(engine_tls)),
            health: health.clone(),
            metrics: metrics.clone(),
            tasks: TaskTracker::new(),
            engine_authorization,
            forward_client_authorization: config.security.forwards_client_authorization(),
            retry_on_ejection: config.reliability.retry_on_ejection,
        };
        let edge = Edge {
            client_keys: Arc::new(client_keys),
            body_budget: crate::security::budget::BodyBudget::new(
                config.security.max_buffered_body_bytes,
                config.security.body_budget_wait,
            ),
            admission: Admission::new(&config.limits, metrics.clone()),
            request_body_timeout: config.security.request_body_timeout,
            max_body_bytes: config.http.max_body_bytes,
        };
        Ok(Arc::new(Gateway {
            server_tls,
            health,
            routing,
            engines,
            edge,
            draining: AtomicBool::new(false),
            requery: Default::default(),
            default_connector,
            registry,
            store: EndpointStore::default(),
            metrics,
            settings: Settings::of(&config),
            config,
        }))
    }

    /// Rebuilds and publishes the snapshot from `pods`.
    pub(crate) fn publish(&self, pods: &[Pod], unhealthy: &BTreeSet<String>) -> Arc<Snapshot> {
        let adapters = self.health.adapters();
        let inputs = SnapshotInputs {
            adapters: &adapters,
            registry: &self.registry,
            default_connector: &self.default_connector,
            default_models: &self.config.models,
            unhealthy,
            roleset_pairing: self.config.kubernetes.roleset_pairing,
        };
        let snapshot = self.store.publish(pods, &inputs);
        if let Some(cache) = &self.routing.cache {
            cache.retain(&snapshot);
        }
        snapshot
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts a graceful shutdown: `/ready` answers 503 from now on.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// The agent resolved for a pod's connector label (or the default), if it is registered.
    pub(crate) fn agent_for(&self, pod: &Pod) -> Option<Arc<dyn kvtransfer::KvTransferAgent>> {
        let label = pod
            .label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER)
            .unwrap_or_default();
        let connector = self
            .registry
            .resolve_connector_type(label, &self.default_connector);
        self.registry.resolve(&connector).ok()
    }
}
