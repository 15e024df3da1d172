//! A fake Kubernetes API server on loopback that speaks just enough list/watch JSON for
//! `kube::runtime::watcher`: paged-less lists with a resourceVersion, chunked watch streams of
//! `{"type":..,"object":..}` lines, BOOKMARK events, `410 Gone` for compacted history, dropped
//! connections and an "API server down" switch.

// Each test binary uses a different subset of the helpers.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Mutable state of the fake API server.
#[derive(Default)]
pub struct Inner {
    /// Current pods by name (single namespace).
    pub pods: BTreeMap<String, Value>,
    /// Current resourceVersion.
    pub rv: u64,
    /// Watch events still replayable: (resourceVersion, type, object).
    pub history: Vec<(u64, String, Value)>,
    /// Watches from a resourceVersion below this get `410 Gone`.
    pub compacted_at: u64,
    /// Every request answers 503 while set.
    pub down: bool,
    /// Bumped to end every open watch stream.
    pub drop_generation: u64,
    /// Successful list calls.
    pub list_calls: usize,
    /// Watch calls (any outcome but "down").
    pub watch_calls: usize,
    /// Requests refused while down.
    pub refused_calls: usize,
    /// `410 Gone` answers sent.
    pub gone_sent: usize,
    /// Label selectors seen on list and watch calls.
    pub selectors: Vec<String>,
    /// Namespaces seen in request paths (`*` for cluster-wide).
    pub namespaces: Vec<String>,
    /// InferencePools by name (`inference.networking.k8s.io/v1`), served by GET.
    pub pools: BTreeMap<String, Value>,
    /// GETs of InferencePools.
    pub pool_gets: usize,
}

/// Handle to a running fake API server; shuts it down on drop.
pub struct FakeApi {
    inner: Arc<Mutex<Inner>>,
    bump: watch::Sender<u64>,
    /// Base URL (`http://127.0.0.1:PORT`).
    pub url: String,
    shutdown: CancellationToken,
    server: Option<tokio::task::JoinHandle<()>>,
}

#[derive(Clone)]
struct App {
    inner: Arc<Mutex<Inner>>,
    bump: watch::Sender<u64>,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FakeApi {
    /// Binds 127.0.0.1:0 and serves until dropped.
    pub async fn start() -> FakeApi {
        let inner = Arc::new(Mutex::new(Inner {
            rv: 100,
            compacted_at: 100,
            ..Inner::default()
        }));
        let (bump, _) = watch::channel(0u64);
        let app = App {
            inner: inner.clone(),
            bump: bump.clone(),
        };
        let router = Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(namespaced))
            .route("/api/v1/pods", get(cluster_wide))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                get(inference_pool),
            )
            .with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr: SocketAddr = listener.local_addr().expect("local addr");
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(token.cancelled_owned())
                .await;
        });
        FakeApi {
            inner,
            bump,
            url: format!("http://{addr}"),
            shutdown,
            server: Some(server),
        }
    }

    /// A kube client pointed at this server, default namespace `llm`.
    pub fn client(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().expect("url"));
        config.default_namespace = "llm".to_owned();
        kube::Client::try_from(config).expect("client")
    }

    /// Reads the state.
    pub fn state(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    fn notify(&self) {
        self.bump.send_modify(|v| *v += 1);
    }

    /// Adds or replaces a pod and records the watch event.
    pub fn upsert(&self, mut pod: Value) {
        {
            let mut s = self.state();
            upsert_locked(&mut s, &mut pod);
        }
        self.notify();
    }

    /// Applies several upserts under one lock (they reach open watches back to back).
    pub fn upsert_many(&self, pods: Vec<Value>) {
        {
            let mut s = self.state();
            for mut pod in pods {
                upsert_locked(&mut s, &mut pod);
            }
        }
        self.notify();
    }

    /// Deletes a pod and records the watch event.
    pub fn delete(&self, name: &str) {
        {
            let mut s = self.state();
            if let Some(mut pod) = s.pods.remove(name) {
                s.rv += 1;
                let rv = s.rv;
                pod["metadata"]["resourceVersion"] = json!(rv.to_string());
                s.history.push((rv, "DELETED".to_owned(), pod));
            }
        }
        self.notify();
    }

    /// Sends a BOOKMARK at the current resourceVersion to open watches.
    pub fn bookmark(&self) {
        {
            let mut s = self.state();
            let rv = s.rv;
            let obj = json!({"apiVersion":"v1","kind":"Pod","metadata":{"resourceVersion": rv.to_string()}});
            s.history.push((rv, "BOOKMARK".to_owned(), obj));
        }
        self.notify();
    }

    /// Ends every open watch stream (the client sees a dropped connection).
    pub fn drop_watches(&self) {
        self.state().drop_generation += 1;
        self.notify();
    }

    /// Atomically: end open watches, apply `mutate` to the pod map, and forget the history, so a
    /// reconnecting watcher's resourceVersion is too old (`410 Gone`) and it must relist.
    pub fn expire_history(&self, mutate: impl FnOnce(&mut BTreeMap<String, Value>)) {
        {
            let mut s = self.state();
            s.drop_generation += 1;
            mutate(&mut s.pods);
            s.rv += 1;
            let rv = s.rv;
            for pod in s.pods.values_mut() {
                pod["metadata"]["resourceVersion"] = json!(rv.to_string());
            }
            s.history.clear();
            s.compacted_at = rv;
        }
        self.notify();
    }

    /// Creates or replaces the InferencePool `name` with `spec`.
    pub fn set_pool(&self, name: &str, spec: Value) {
        let mut s = self.state();
        s.rv += 1;
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": s.rv.to_string()},
            "spec": spec,
        });
        s.pools.insert(name.to_owned(), pool);
    }

    /// Switches the "API server down" mode; going down also drops open watches.
    pub fn set_down(&self, down: bool) {
        {
            let mut s = self.state();
            s.down = down;
            if down {
                s.drop_generation += 1;
            }
        }
        self.notify();
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.shutdown.cancel();
        // Open watch streams would keep graceful shutdown waiting: end the task outright.
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

fn upsert_locked(s: &mut Inner, pod: &mut Value) {
    s.rv += 1;
    let rv = s.rv;
    pod["metadata"]["resourceVersion"] = json!(rv.to_string());
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let kind = if s.pods.contains_key(&name) {
        "MODIFIED"
    } else {
        "ADDED"
    };
    s.pods.insert(name, pod.clone());
    s.history.push((rv, kind.to_owned(), pod.clone()));
}

/// A Kubernetes Pod object as JSON.
pub fn pod_json(name: &str, ip: &str, ready: bool, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": format!("uid-{name}"),
            "labels": labels,
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion":"v1","kind":"Status","metadata":{},"status":"Failure",
           "message": message,"reason": reason,"code": code})
}

async fn namespaced(
    State(app): State<App>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    handle(app, ns, q).await
}

async fn cluster_wide(
    State(app): State<App>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    handle(app, "*".to_owned(), q).await
}

async fn inference_pool(
    State(app): State<App>,
    Path((_ns, name)): Path<(String, String)>,
) -> Response {
    let mut s = lock(&app.inner);
    if s.down {
        s.refused_calls += 1;
        let body = status(503, "ServiceUnavailable", "apiserver is down");
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    s.pool_gets += 1;
    match s.pools.get(&name) {
        Some(pool) => axum::Json(pool.clone()).into_response(),
        None => {
            let body = status(
                404,
                "NotFound",
                &format!("inferencepools {name:?} not found"),
            );
            (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
        }
    }
}

/// Whether `obj` matches a selector of `k=v` terms (other kinds of terms match everything).
fn matches(selector: Option<&String>, obj: &Value) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    selector.split(',').all(|term| match term.split_once('=') {
        Some((k, v)) if !k.ends_with('!') => {
            obj["metadata"]["labels"][k.trim()].as_str() == Some(v.trim())
        }
        _ => true,
    })
}

async fn handle(app: App, ns: String, q: HashMap<String, String>) -> Response {
    let mut s = lock(&app.inner);
    if s.down {
        s.refused_calls += 1;
        let body = status(503, "ServiceUnavailable", "apiserver is down");
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    s.namespaces.push(ns);
    if let Some(sel) = q.get("labelSelector") {
        s.selectors.push(sel.clone());
    }
    if q.get("watch").map(String::as_str) != Some("true") {
        s.list_calls += 1;
        let selector = q.get("labelSelector");
        let items: Vec<Value> = s
            .pods
            .values()
            .filter(|p| matches(selector, p))
            .cloned()
            .collect();
        let body = json!({"apiVersion":"v1","kind":"PodList",
                          "metadata":{"resourceVersion": s.rv.to_string()},"items": items});
        return axum::Json(body).into_response();
    }
    s.watch_calls += 1;
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if from < s.compacted_at {
        s.gone_sent += 1;
        let event =
            json!({"type":"ERROR","object": status(410, "Expired", "too old resource version")});
        return Response::new(Body::from(format!("{event}\n")));
    }
    let start = s.history.partition_point(|(rv, _, _)| *rv <= from);
    let generation = s.drop_generation;
    let selector = q.get("labelSelector").cloned();
    drop(s);
    let rx = app.bump.subscribe();
    let stream = futures_util::stream::unfold(
        (app.inner.clone(), rx, start),
        move |(inner, mut rx, mut next)| {
            let selector = selector.clone();
            async move {
                loop {
                    {
                        let s = lock(&inner);
                        if s.drop_generation != generation || s.down {
                            return None;
                        }
                        if let Some((_, kind, obj)) = s.history.get(next) {
                            next += 1;
                            if kind != "BOOKMARK" && !matches(selector.as_ref(), obj) {
                                continue;
                            }
                            let line = format!("{}\n", json!({"type": kind, "object": obj}));
                            return Some((
                                Ok::<_, Infallible>(Bytes::from(line)),
                                (inner.clone(), rx, next),
                            ));
                        }
                    }
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            }
        },
    );
    Response::new(Body::from_stream(stream))
}
