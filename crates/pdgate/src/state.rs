//! The gateway's shared state, its start-up, and the reconciler that turns discovered pods into
//! the published snapshot (with Mooncake bootstrap lookups done here, off the request path).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvtransfer::{MooncakeBootstrap, Pod, Registry};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::admission::{Admission, RetryBudget};
use crate::client::{self, HttpClient};
use crate::config::{Config, ConfigError};
use crate::endpoints::{
    EndpointStore, MOONCAKE_BOOTSTRAP_PORT_ANNOTATION, Role, Snapshot, SnapshotInputs,
};
use crate::health::{Health, ProbeTarget};
use crate::metrics::Metrics;
use crate::policy::{self, Policy};

/// A set of pods published by a discovery source.
pub type PodSet = Arc<Vec<Pod>>;

/// Everything the request path shares.
#[derive(Debug)]
pub struct Gateway {
    /// The validated configuration.
    pub config: Config,
    /// KV-transfer agents by name.
    pub registry: Registry,
    /// The global default connector, normalised.
    pub default_connector: String,
    /// The routable snapshot.
    pub store: EndpointStore,
    /// Pooled engine client.
    pub client: HttpClient,
    /// Prefill selection.
    pub prefill_policy: Box<dyn Policy>,
    /// Decode selection.
    pub decode_policy: Box<dyn Policy>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Short background work spawned by requests (e.g. SGLang aborts), waited for at shutdown.
    pub tasks: TaskTracker,
    /// Endpoint health (active checks and passive outlier detection).
    pub health: Arc<Health>,
    /// The gateway-wide request limit.
    pub admission: Admission,
    /// Bounds retries across requests.
    pub retry_budget: RetryBudget,
    /// Set at the start of a graceful shutdown: `/ready` answers 503 from then on.
    pub draining: AtomicBool,
}

impl Gateway {
    /// Validates `config` and builds the shared state (with an empty snapshot).
    pub fn new(config: Config, registry: Registry) -> Result<Arc<Gateway>, ConfigError> {
        config.validate(&registry)?;
        let default_connector = registry
            .validate_default(&config.kv_connector)
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
        let metrics = Arc::new(Metrics::new());
        Ok(Arc::new(Gateway {
            health: Arc::new(Health::new(&config, metrics.clone())),
            admission: Admission::new(&config, metrics.clone()),
            retry_budget: RetryBudget::new(&config),
            draining: AtomicBool::new(false),
            prefill_policy: policy("prefill_policy", &config.prefill_policy)?,
            decode_policy: policy("decode_policy", &config.decode_policy)?,
            client: client::build(config.connect_timeout),
            default_connector,
            registry,
            store: EndpointStore::default(),
            metrics,
            tasks: TaskTracker::new(),
            config,
        }))
    }

    /// Rebuilds and publishes the snapshot from `pods`.
    pub fn publish(&self, pods: &[Pod], unhealthy: &BTreeSet<String>) -> Arc<Snapshot> {
        let inputs = SnapshotInputs {
            registry: &self.registry,
            default_connector: &self.default_connector,
            default_models: &self.config.models,
            unhealthy,
            roleset_pairing: self.config.kubernetes.roleset_pairing,
        };
        self.store.publish(pods, &inputs)
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// What active health checks probe for `pods`.
    pub fn probe_targets(&self, pods: &[Pod]) -> Vec<ProbeTarget> {
        pods.iter()
            .filter_map(|pod| {
                let role = match pod.label(kvtransfer::labels::ROLE_NAME) {
                    Some("prefill") => Role::Prefill,
                    Some("decode") => Role::Decode,
                    _ => return None,
                };
                let base = pod.base_url()?;
                let query_url = if self.is_mooncake_prefill(pod) {
                    let host = pod.url_host()?;
                    Some(format!("http://{host}:{}/query", bootstrap_port(pod)))
                } else {
                    None
                };
                Some(ProbeTarget {
                    name: pod.name.clone(),
                    role,
                    health_url: format!("{base}/health"),
                    query_url,
                })
            })
            .collect()
    }

    fn is_mooncake_prefill(&self, pod: &Pod) -> bool {
        pod.label(kvtransfer::labels::ROLE_NAME) == Some("prefill")
            && self.registry.resolve_connector_type(
                pod.label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER)
                    .unwrap_or_default(),
                &self.default_connector,
            ) == kvtransfer::CONNECTOR_TYPE_MOONCAKE
    }
}

/// Where a pod's Mooncake bootstrap server listens.
fn bootstrap_port(pod: &Pod) -> u16 {
    pod.annotations
        .get(MOONCAKE_BOOTSTRAP_PORT_ANNOTATION)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(kvtransfer::DEFAULT_MOONCAKE_BOOTSTRAP_PORT)
}

#[derive(Debug)]
struct CachedBootstrap {
    key: (Option<String>, u16),
    info: MooncakeBootstrap,
    fetched: Instant,
}

/// GET `/health` then `/query` on a Mooncake prefill, each bounded.
async fn lookup_bootstrap(gw: &Gateway, pod: &Pod) -> Result<MooncakeBootstrap, String> {
    let host = pod.url_host().ok_or("pod has no IP")?;
    let port = bootstrap_port(pod);
    let get = |url: String| async move {
        client::get(&gw.client, &url, Duration::from_secs(3), 1024 * 1024).await
    };
    let (status, _) = get(format!("http://{host}:{}/health", pod.http_port)).await?;
    if !status.is_success() {
        return Err(format!("/health answered {status}"));
    }
    let (status, body) = get(format!("http://{host}:{port}/query")).await?;
    kvtransfer::parse_mooncake_bootstrap(port, status.as_u16(), &body).map_err(|e| e.to_string())
}

/// Follows discovery: enriches pods with bootstrap information and publishes a new snapshot
/// whenever the result changes. Ends when `cancel` fires or discovery goes away.
pub async fn reconcile(
    gw: Arc<Gateway>,
    mut pods: watch::Receiver<PodSet>,
    cancel: CancellationToken,
) {
    let mut cache: HashMap<String, CachedBootstrap> = HashMap::new();
    let mut last = String::new();
    let mut last_targets = Vec::new();
    loop {
        let current = pods.borrow_and_update().clone();
        let targets = gw.probe_targets(&current);
        if targets != last_targets {
            gw.health.sync(targets.clone());
            last_targets = targets;
        }
        let mut enriched: Vec<Pod> = Vec::with_capacity(current.len());
        let mut missing = false;
        for pod in current.iter() {
            let mut pod = pod.clone();
            if gw.is_mooncake_prefill(&pod) && pod.mooncake_bootstrap.is_none() {
                let key = (pod.ip.clone(), bootstrap_port(&pod));
                let fresh = cache.get(&pod.name).is_some_and(|c| {
                    c.key == key && c.fetched.elapsed() < gw.config.bootstrap_refresh
                });
                if !fresh {
                    match lookup_bootstrap(&gw, &pod).await {
                        Ok(info) => {
                            cache.insert(
                                pod.name.clone(),
                                CachedBootstrap {
                                    key,
                                    info,
                                    fetched: Instant::now(),
                                },
                            );
                        }
                        Err(e) => {
                            warn!(pod = %pod.name, error = %e, "mooncake bootstrap lookup failed");
                            // Keep the last good answer only while the pod keeps its address.
                            if cache.get(&pod.name).is_some_and(|c| c.key != key) {
                                cache.remove(&pod.name);
                            }
                        }
                    }
                }
                pod.mooncake_bootstrap = cache.get(&pod.name).map(|c| c.info.clone());
                missing |= pod.mooncake_bootstrap.is_none();
            }
            enriched.push(pod);
        }
        cache.retain(|name, _| current.iter().any(|p| &p.name == name));
        let unhealthy = gw.health.unhealthy();
        let fingerprint = format!("{enriched:?}{unhealthy:?}");
        if fingerprint != last {
            let snap = gw.publish(&enriched, &unhealthy);
            gw.metrics.count_discovery_change();
            info!(
                prefill = snap.prefill.len(),
                decode = snap.decode.len(),
                excluded = snap.excluded.len(),
                "endpoint set updated"
            );
            for (name, why) in &snap.excluded {
                info!(endpoint = %name, reason = %why, "endpoint not routable");
            }
            last = fingerprint;
        }
        let wait = if missing {
            Duration::from_secs(1)
        } else {
            gw.config.bootstrap_refresh
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = pods.changed() => if changed.is_err() { return },
            _ = gw.health.changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Pending-connection backlog of the listening socket: bursts of thousands of new client
/// connections (stream soaks, reconnect storms) must not overflow the kernel's accept queue.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` with [`LISTEN_BACKLOG`] and `SO_REUSEADDR`.
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// A gateway serving on a socket, with the tasks it owns.
#[derive(Debug)]
pub struct RunningGateway {
    addr: SocketAddr,
    gateway: Arc<Gateway>,
    cancel: CancellationToken,
    tasks: JoinSet<()>,
    pods: watch::Sender<PodSet>,
}

impl RunningGateway {
    /// Starts serving on `listener` with endpoints from `pods` (a discovery source keeps
    /// sending new sets; see [`RunningGateway::pods`]).
    pub async fn start(
        gateway: Arc<Gateway>,
        listener: TcpListener,
        pods: Vec<Pod>,
    ) -> std::io::Result<RunningGateway> {
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let (tx, rx) = watch::channel(Arc::new(pods));
        let mut tasks = JoinSet::new();
        // Publish the first snapshot before accepting traffic (static pods need no lookups).
        let initial: Vec<Pod> = rx.borrow().iter().cloned().collect();
        gateway.publish(&initial, &BTreeSet::new());
        tasks.spawn(reconcile(gateway.clone(), rx, cancel.clone()));
        tasks.spawn(crate::health::run(
            gateway.health.clone(),
            gateway.client.clone(),
            gateway.config.clone(),
            cancel.clone(),
        ));
        let app = crate::server::router(gateway.clone());
        let idle = gateway.config.client_idle_timeout;
        tasks.spawn(crate::listener::serve(listener, app, idle, cancel.clone()));
        Ok(RunningGateway {
            addr,
            gateway,
            cancel,
            tasks,
            pods: tx,
        })
    }

    /// Binds `config.listen` and starts with the configured static endpoints.
    pub async fn bind(gateway: Arc<Gateway>) -> Result<RunningGateway, crate::Error> {
        let pods = gateway.config.pods()?;
        let listener = listen(gateway.config.listen)
            .map_err(|e| crate::Error::Bind(gateway.config.listen, e))?;
        Ok(RunningGateway::start(gateway, listener, pods).await?)
    }

    /// The address served.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://addr`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The shared state.
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// Where discovery sends new pod sets.
    pub fn pods(&self) -> &watch::Sender<PodSet> {
        &self.pods
    }

    /// Spawns a task owned by this gateway (ended at shutdown).
    pub fn spawn_owned<F>(&mut self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(task);
    }

    /// A token that fires when the gateway shuts down.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Drains: `/ready` answers 503 at once while requests are still served for
    /// `config.drain_delay` (load balancers stop sending), then stops accepting, lets in-flight
    /// requests finish up to `deadline`, then ends every task.
    pub async fn shutdown(mut self, deadline: Duration) {
        self.gateway.draining.store(true, Ordering::Release);
        info!(delay = ?self.gateway.config.drain_delay, "draining: /ready now answers 503");
        tokio::time::sleep(self.gateway.config.drain_delay).await;
        self.cancel.cancel();
        let drain = async {
            while self.tasks.join_next().await.is_some() {}
            self.gateway.tasks.close();
            self.gateway.tasks.wait().await;
        };
        if tokio::time::timeout(deadline, drain).await.is_err() {
            warn!("shutdown deadline reached; aborting remaining work");
        }
        self.tasks.abort_all();
    }

    /// Runs until `signal` completes, then shuts down gracefully.
    pub async fn run_until<F: std::future::Future<Output = ()>>(
        self,
        signal: F,
        deadline: Duration,
    ) {
        signal.await;
        info!("shutting down");
        self.shutdown(deadline).await;
    }
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.tasks.abort_all();
    }
}
