//! The I/O half of discovery: list + watch pods, debounce, publish on change.

use std::collections::BTreeMap;
use std::future::pending;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod as KubePod;
use kube::api::DynamicObject;
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_pods};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{ALL_NAMESPACES, KubeDiscoveryConfig};
use crate::pods::{pair_rolesets, routable_from, skip_summary};
use crate::pool::{self, PoolView};
use crate::{EndpointPod, KubeDiscoveryError};

/// Builds a client from the environment: in-cluster service account when running in a pod,
/// else `$KUBECONFIG` / `~/.kube/config` (current context).
pub async fn client_from_env() -> Result<Client, KubeDiscoveryError> {
    install_crypto_provider();
    let config = kube::Config::infer()
        .await
        .map_err(KubeDiscoveryError::ClientConfig)?;
    Client::try_from(config).map_err(KubeDiscoveryError::Client)
}

/// Builds a client from an explicit kubeconfig file and optional context (default: the file's
/// current context). For a `--kubeconfig` flag; [`client_from_env`] covers the usual cases.
pub async fn client_from_kubeconfig(
    path: &std::path::Path,
    context: Option<&str>,
) -> Result<Client, KubeDiscoveryError> {
    install_crypto_provider();
    let kubeconfig =
        kube::config::Kubeconfig::read_from(path).map_err(KubeDiscoveryError::Kubeconfig)?;
    let options = kube::config::KubeConfigOptions {
        context: context.map(str::to_owned),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .map_err(KubeDiscoveryError::Kubeconfig)?;
    Client::try_from(config).map_err(KubeDiscoveryError::Client)
}

/// Installs rustls' ring provider as the process default unless one is installed already.
/// Without this, a process that links both ring and aws-lc-rs would panic on the first TLS
/// connection.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Pods known to the watch loop, keyed by (namespace, name), level-triggered.
#[derive(Debug, Default)]
struct Store {
    live: BTreeMap<(String, String), KubePod>,
    /// Objects of a (re)list in progress; swapped in whole at `InitDone`.
    relist: Option<BTreeMap<(String, String), KubePod>>,
    /// True once the first list completed; nothing is published before that.
    synced: bool,
}

fn key(pod: &KubePod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// Drops what the mapping never reads, to keep memory per pod small.
fn slim(pod: &mut KubePod) {
    pod.spec = None;
    pod.metadata.managed_fields = None;
    if let Some(status) = pod.status.as_mut() {
        status.container_statuses = None;
        status.init_container_statuses = None;
        status.ephemeral_container_statuses = None;
    }
}

impl Store {
    /// Applies one watcher event; returns true when the live set may have changed.
    fn apply(&mut self, event: Event<KubePod>) -> bool {
        match event.modify(slim) {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                match self.relist.as_mut() {
                    Some(buf) => {
                        buf.insert(key(&pod), pod);
                    }
                    None => {
                        self.live.insert(key(&pod), pod);
                    }
                }
                false
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    self.live = buf;
                }
                self.synced = true;
                true
            }
            Event::Apply(pod) => {
                self.live.insert(key(&pod), pod);
                self.synced
            }
            Event::Delete(pod) => {
                self.live.remove(&key(&pod));
                self.synced
            }
        }
    }
}

async fn wait_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => sleep_until(d).await,
        None => pending().await,
    }
}

/// Computes the endpoint set from the whole store; `port` (an InferencePool's target port)
/// replaces the pods' own.
fn endpoints(store: &Store, config: &KubeDiscoveryConfig, port: Option<u16>) -> Vec<EndpointPod> {
    let mut routable = routable_from(store.live.values(), &config.keys);
    if let Some(port) = port {
        for pod in &mut routable {
            pod.http_port = port;
        }
    }
    if config.roleset_pairing {
        pair_rolesets(routable)
    } else {
        routable
    }
}

/// Reads the InferencePool `name`.
async fn read_pool(api: &Api<DynamicObject>, name: &str) -> Result<PoolView, String> {
    let pool = api.get(name).await.map_err(|e| e.to_string())?;
    PoolView::from_spec(&pool.data["spec"])
}

/// Watch loop: list + watch pods with reconnect and backoff (kube's `watcher`, client-go's
/// backoff of 0.8 s doubling to 30 s with jitter), gather events for `config.debounce`, map the
/// whole store through [`routable_pods`] (and [`pair_rolesets`] when enabled), and send the new
/// set on `tx` only when it differs from the last one sent.
///
/// Nothing is sent before the first complete list. Watch errors (API server gone, 410 Gone,
/// dropped connections) are logged and retried; the last good set stays in `tx` meanwhile.
/// Returns `Ok(())` when `cancel` fires, and an error only for invalid configuration.
pub async fn run(
    client: Client,
    config: KubeDiscoveryConfig,
    tx: watch::Sender<Arc<Vec<EndpointPod>>>,
    cancel: CancellationToken,
) -> Result<(), KubeDiscoveryError> {
    config.validate()?;
    let pool_client = client.clone();
    let api: Api<KubePod> = match config.namespace.as_deref() {
        Some(ALL_NAMESPACES) => Api::all(client),
        Some(ns) => Api::namespaced(client, ns),
        None => Api::default_namespaced(client),
    };
    let pool_api: Option<(Api<DynamicObject>, &str)> =
        config.inference_pool.as_deref().map(|name| {
            let resource = pool::resource();
            let api = match config.namespace.as_deref() {
                Some(ns) => Api::namespaced_with(pool_client.clone(), ns, &resource),
                None => Api::default_namespaced_with(pool_client.clone(), &resource),
            };
            (api, name)
        });
    // The pool first: no pod is watched before its selector is known.
    let mut pool_view: Option<PoolView> = None;
    if let Some((api, name)) = &pool_api {
        loop {
            match read_pool(api, name).await {
                Ok(view) => {
                    pool_view = Some(view);
                    break;
                }
                Err(why) => warn!(pool = %name, "InferencePool not usable yet, retrying: {why}"),
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = tokio::time::sleep(config.inference_pool_refresh) => {}
            }
        }
    }
    let selector_of = |view: Option<&PoolView>| match view {
        Some(v) => Some(v.selector_with(config.selector.as_deref())),
        None => config.selector.clone(),
    };
    let watch = |selector: Option<String>| {
        let mut watcher_config = watcher::Config::default();
        if let Some(selector) = &selector {
            watcher_config = watcher_config.labels(selector);
        }
        info!(
            namespace = config.namespace.as_deref().unwrap_or("<client default>"),
            selector = selector.as_deref().unwrap_or(""),
            pool = config.inference_pool.as_deref().unwrap_or(""),
            "kubernetes discovery: watching pods"
        );
        watch_pods(api.clone(), watcher_config)
            .default_backoff()
            .boxed()
    };
    let mut events = watch(selector_of(pool_view.as_ref()));
    let mut store = Store::default();
    let mut last: Option<Arc<Vec<EndpointPod>>> = None;
    let mut deadline: Option<Instant> = None;
    let mut failing = false;
    let refresh = config.inference_pool_refresh;
    let mut pool_tick = tokio::time::interval_at(Instant::now() + refresh, refresh);
    pool_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => {
                debug!("kubernetes discovery cancelled");
                return Ok(());
            }
            _ = pool_tick.tick(), if pool_api.is_some() => {
                let Some((api, name)) = &pool_api else { continue };
                match read_pool(api, name).await {
                    Ok(view) if pool_view.as_ref() != Some(&view) => {
                        info!(pool = %name, selector = %view.selector, port = view.port,
                            "InferencePool changed: watching its pods anew");
                        events = watch(selector_of(Some(&view)));
                        // The last good set stays published until the new list completes.
                        store = Store::default();
                        deadline = None;
                        pool_view = Some(view);
                    }
                    Ok(_) => {}
                    Err(why) => warn!(pool = %name, "InferencePool unreadable; keeping the last good endpoint set: {why}"),
                }
            }
            () = wait_until(deadline) => {
                deadline = None;
                let next = endpoints(&store, &config, pool_view.as_ref().map(|v| v.port));
                if last.as_deref() != Some(&next) {
                    info!(
                        pods = store.live.len(),
                        routable = next.len(),
                        skipped = ?skip_summary(store.live.values(), &config.keys),
                        "kubernetes discovery: endpoint set changed"
                    );
                    let next = Arc::new(next);
                    tx.send_replace(next.clone());
                    last = Some(next);
                }
            }
            event = events.next() => match event {
                Some(Ok(event)) => {
                    // `Init` opens a re-list before any request is made; only what follows
                    // an answer from the API server means it is back.
                    if failing && !matches!(event, Event::Init) {
                        info!("kubernetes watch recovered");
                        failing = false;
                    }
                    if store.apply(event) && deadline.is_none() {
                        deadline = Some(Instant::now() + config.debounce);
                    }
                }
                Some(Err(error)) => {
                    failing = true;
                    warn!(%error, "kubernetes watch error; keeping the last good endpoint set");
                }
                // `watcher` streams never end; if one does, say so rather than spin or hang.
                None => return Err(KubeDiscoveryError::WatchEnded),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str) -> KubePod {
        KubePod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            ..KubePod::default()
        }
    }

    fn names(store: &Store) -> Vec<String> {
        store.live.keys().map(|(_, n)| n.clone()).collect()
    }

    #[test]
    fn nothing_changes_before_first_sync() {
        let mut s = Store::default();
        assert!(!s.apply(Event::Init));
        assert!(!s.apply(Event::InitApply(pod("a"))));
        assert!(names(&s).is_empty(), "partial list must not be visible");
        assert!(s.apply(Event::InitDone));
        assert_eq!(names(&s), ["a"]);
    }

    #[test]
    fn relist_replaces_store_atomically() {
        let mut s = Store::default();
        s.apply(Event::Init);
        s.apply(Event::InitApply(pod("a")));
        s.apply(Event::InitApply(pod("b")));
        s.apply(Event::InitDone);
        // 410 Gone -> relist: "a" was deleted while we were not watching.
        assert!(!s.apply(Event::Init));
        assert!(!s.apply(Event::InitApply(pod("b"))));
        assert_eq!(
            names(&s),
            ["a", "b"],
            "old set kept until the list completes"
        );
        assert!(s.apply(Event::InitDone));
        assert_eq!(names(&s), ["b"]);
    }

    #[test]
    fn apply_and_delete_after_sync() {
        let mut s = Store::default();
        s.apply(Event::Init);
        s.apply(Event::InitDone);
        assert!(s.apply(Event::Apply(pod("a"))));
        assert!(s.apply(Event::Apply(pod("a"))));
        assert_eq!(names(&s), ["a"]);
        assert!(s.apply(Event::Delete(pod("a"))));
        assert!(names(&s).is_empty());
    }

    #[test]
    fn slim_drops_spec() {
        let mut s = Store::default();
        let mut p = pod("a");
        p.spec = Some(Default::default());
        s.apply(Event::Init);
        s.apply(Event::InitApply(p));
        s.apply(Event::InitDone);
        assert!(s.live.values().all(|p| p.spec.is_none()));
    }
}
