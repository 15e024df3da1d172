//! A running gateway: bind, serve, follow discovery, drain.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvtransfer::Pod;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::state::{Gateway, PodSet};

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
    admin_addr: Option<SocketAddr>,
    /// The access log's writer: outlives the request tasks, so their last lines are written.
    access: Option<crate::metrics::access::AccessWriter>,
}

impl RunningGateway {
    /// Starts serving on `listener` with endpoints from `pods` (a discovery source keeps
    /// sending new sets; see [`RunningGateway::pods`]).
    pub async fn start(
        gateway: Arc<Gateway>,
        listener: TcpListener,
        pods: Vec<Pod>,
    ) -> std::io::Result<RunningGateway> {
        let app = crate::http::router(gateway.clone());
        RunningGateway::serve(gateway, listener, pods, app)
    }

    /// Starts as Envoy's external processor (`pdgate ext-proc`): the ext_proc service (gRPC)
    /// and the operational routes (`/metrics`, `/health`, `/ready`) on `listener`, with the same
    /// discovery, health checks and state as [`RunningGateway::start`]; no OpenAI routes.
    pub async fn start_ext_proc(
        gateway: Arc<Gateway>,
        listener: TcpListener,
        pods: Vec<Pod>,
        options: crate::extproc::ExtProcOptions,
    ) -> std::io::Result<RunningGateway> {
        let app = crate::http::routes::admin_router(gateway.clone())
            .merge(crate::extproc::router(gateway.clone(), options))
            .fallback({
                let gw = gateway.clone();
                move |uri: http::Uri, headers: http::HeaderMap| {
                    crate::http::routes::not_found(gw.clone(), uri, headers)
                }
            });
        RunningGateway::serve(gateway, listener, pods, app)
    }

    /// The tasks every mode runs, and `app` on `listener`.
    fn serve(
        gateway: Arc<Gateway>,
        listener: TcpListener,
        pods: Vec<Pod>,
        app: axum::Router,
    ) -> std::io::Result<RunningGateway> {
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let (tx, rx) = watch::channel(Arc::new(pods));
        let mut tasks = JoinSet::new();
        let access = gateway.metrics.access.start_writer();
        // Publish the first snapshot before accepting traffic (static pods need no lookups).
        let initial: Vec<Pod> = rx.borrow().iter().cloned().collect();
        gateway.publish(&initial, &BTreeSet::new());
        tasks.spawn(crate::discovery::reconcile(
            gateway.clone(),
            rx,
            cancel.clone(),
        ));
        tasks.spawn(crate::endpoints::health::run(
            gateway.health.clone(),
            gateway.engines.client.clone(),
            gateway.config.health.clone(),
            cancel.clone(),
        ));
        if let Some(cache) = &gateway.routing.cache
            && !cache.config.engine_load_interval.is_zero()
        {
            let gw = gateway.clone();
            tasks.spawn(crate::endpoints::engine_load::run(
                move || gw.store.load(),
                gateway.engines.client.clone(),
                gateway.engines.engine_authorization.clone(),
                cache.config.engine_load_interval,
                cancel.clone(),
            ));
        }
        tasks.spawn(gateway.edge.client_keys.clone().watch(
            gateway.config.security.reload_interval,
            gateway.metrics.clone(),
            cancel.clone(),
        ));
        let limits = crate::http::listener::ConnectionLimits::of(&gateway.config);
        let mut admin_addr = None;
        if let Some(admin) = gateway.config.security.admin_listen {
            let admin_listener = listen(admin)?;
            admin_addr = Some(admin_listener.local_addr()?);
            tasks.spawn(crate::http::listener::serve(
                admin_listener,
                crate::http::routes::admin_router(gateway.clone()),
                limits,
                None,
                cancel.clone(),
            ));
        }
        let tls = gateway.server_tls.clone();
        if let Some(tls) = &tls {
            tasks.spawn(tls.clone().watch(
                gateway.config.security.reload_interval,
                gateway.metrics.clone(),
                cancel.clone(),
            ));
        }
        tasks.spawn(crate::http::listener::serve(
            listener,
            app,
            limits,
            tls.map(|t| t.acceptor().clone()),
            cancel.clone(),
        ));
        Ok(RunningGateway {
            addr,
            admin_addr,
            gateway,
            cancel,
            tasks,
            pods: tx,
            access,
        })
    }

    /// Binds `config.http.listen` and starts with the configured static endpoints.
    pub async fn bind(gateway: Arc<Gateway>) -> Result<RunningGateway, crate::Error> {
        let pods = gateway.config.pods()?;
        let listener = listen(gateway.config.http.listen)
            .map_err(|e| crate::Error::Bind(gateway.config.http.listen, e))?;
        Ok(RunningGateway::start(gateway, listener, pods).await?)
    }

    /// Binds `config.http.listen` and starts as Envoy's external processor
    /// ([`RunningGateway::start_ext_proc`]) with the configured static endpoints.
    pub async fn bind_ext_proc(
        gateway: Arc<Gateway>,
        options: crate::extproc::ExtProcOptions,
    ) -> Result<RunningGateway, crate::Error> {
        let pods = gateway.config.pods()?;
        let addr = gateway.config.http.listen;
        let listener = listen(addr).map_err(|e| crate::Error::Bind(addr, e))?;
        Ok(RunningGateway::start_ext_proc(gateway, listener, pods, options).await?)
    }

    /// The address served.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's address (`security.admin_listen`), if any.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// `http://addr`, or `https://addr` when the listener serves TLS.
    pub fn base_url(&self) -> String {
        let scheme = if self.gateway.config.security.tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
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
    /// `config.shutdown.drain_delay` (load balancers stop sending), then stops accepting, lets in-flight
    /// requests finish up to `deadline`, then ends every task.
    pub async fn shutdown(mut self, deadline: Duration) {
        self.gateway.start_draining();
        info!(delay = ?self.gateway.config.shutdown.drain_delay, "draining: /ready now answers 503");
        tokio::time::sleep(self.gateway.config.shutdown.drain_delay).await;
        self.cancel.cancel();
        let drain = async {
            while self.tasks.join_next().await.is_some() {}
            self.gateway.engines.tasks.close();
            self.gateway.engines.tasks.wait().await;
        };
        let started = tokio::time::Instant::now();
        if tokio::time::timeout(deadline, drain).await.is_err() {
            warn!("shutdown deadline reached; aborting remaining work");
        }
        self.tasks.abort_all();
        if let Some(access) = self.access.take() {
            access
                .finish(deadline.saturating_sub(started.elapsed()))
                .await;
        }
        if let Some(cache) = &self.gateway.routing.cache {
            cache.stop();
        }
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
        if let Some(cache) = &self.gateway.routing.cache {
            cache.stop();
        }
    }
}
