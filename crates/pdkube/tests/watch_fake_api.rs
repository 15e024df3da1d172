//! The watch loop against a fake API server on loopback.

mod fake_api;

use std::sync::Arc;
use std::time::Duration;

use fake_api::{FakeApi, pod_json};
use pdkube::{EndpointPod, KubeDiscoveryConfig, KubeDiscoveryError};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Generous bound on any single wait; passing tests take a fraction of it.
const WAIT: Duration = Duration::from_secs(30);

struct Discovery {
    rx: watch::Receiver<Arc<Vec<EndpointPod>>>,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<(), KubeDiscoveryError>>>,
}

impl Discovery {
    fn start(api: &FakeApi, config: KubeDiscoveryConfig) -> Discovery {
        let (tx, rx) = watch::channel(Arc::new(Vec::new()));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(pdkube::run(api.client(), config, tx, cancel.clone()));
        Discovery {
            rx,
            cancel,
            task: Some(task),
        }
    }

    /// Waits for the next published set; returns "name@ip:port/role" strings.
    async fn next(&mut self) -> Vec<String> {
        tokio::time::timeout(WAIT, self.rx.changed())
            .await
            .expect("a publish within the wait bound")
            .expect("discovery alive");
        describe(&self.rx.borrow_and_update())
    }

    /// Waits until a published set satisfies `pred`; returns it.
    async fn until(&mut self, pred: impl Fn(&[String]) -> bool) -> Vec<String> {
        loop {
            let set = self.next().await;
            if pred(&set) {
                return set;
            }
        }
    }

    async fn stop(mut self) {
        self.cancel.cancel();
        let task = self.task.take().expect("running");
        let result = tokio::time::timeout(WAIT, task)
            .await
            .expect("run ends after cancel")
            .expect("run did not panic");
        assert!(result.is_ok(), "{result:?}");
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn describe(pods: &[EndpointPod]) -> Vec<String> {
    pods.iter()
        .map(|p| {
            format!(
                "{}@{}:{}/{}",
                p.name,
                p.ip.as_deref().unwrap_or("-"),
                p.http_port,
                p.labels.get("role-name").map_or("-", String::as_str)
            )
        })
        .collect()
}

fn prefill(name: &str, ip: &str, ready: bool) -> serde_json::Value {
    pod_json(
        name,
        ip,
        ready,
        &[
            ("role-name", "prefill"),
            ("roleset-name", "rs"),
            ("model.aibrix.ai/name", "llama"),
            ("app", "engine"),
        ],
    )
}

fn decode(name: &str, ip: &str, ready: bool) -> serde_json::Value {
    pod_json(
        name,
        ip,
        ready,
        &[
            ("role-name", "decode"),
            ("roleset-name", "rs"),
            ("model.aibrix.ai/name", "llama"),
            ("model.aibrix.ai/port", "8100"),
            ("app", "engine"),
        ],
    )
}

fn fast() -> KubeDiscoveryConfig {
    KubeDiscoveryConfig {
        selector: Some("app=engine".to_owned()),
        debounce: Duration::from_millis(20),
        ..KubeDiscoveryConfig::default()
    }
}

#[tokio::test]
async fn list_then_watch_follows_readiness_ip_and_deletion() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    api.upsert(decode("d0", "10.0.0.2", false));
    let mut d = Discovery::start(&api, fast());

    assert_eq!(d.next().await, ["p0@10.0.0.1:8000/prefill"]);
    api.upsert(decode("d0", "10.0.0.2", true));
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p0@10.0.0.1:8000/prefill"]
    );
    api.upsert(prefill("p0", "10.0.0.9", true));
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p0@10.0.0.9:8000/prefill"]
    );
    api.delete("d0");
    assert_eq!(d.next().await, ["p0@10.0.0.9:8000/prefill"]);

    {
        let s = api.state();
        assert!(s.selectors.iter().all(|sel| sel == "app=engine"));
        assert!(!s.selectors.is_empty(), "selector sent to the API server");
        assert_eq!(s.namespaces.first().map(String::as_str), Some("llm"));
        assert_eq!(s.list_calls, 1);
    }
    d.stop().await;
}

#[tokio::test]
async fn bookmarks_and_dropped_connections_resume_without_relist() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    let mut d = Discovery::start(&api, fast());
    assert_eq!(d.next().await, ["p0@10.0.0.1:8000/prefill"]);

    api.bookmark();
    api.drop_watches();
    api.upsert(decode("d0", "10.0.0.2", true));
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p0@10.0.0.1:8000/prefill"]
    );
    api.drop_watches();
    api.delete("p0");
    assert_eq!(d.next().await, ["d0@10.0.0.2:8100/decode"]);

    {
        let s = api.state();
        assert_eq!(s.list_calls, 1, "resumed from resourceVersion, no relist");
        assert!(s.watch_calls >= 3, "watch calls: {}", s.watch_calls);
        assert_eq!(s.gone_sent, 0);
    }
    d.stop().await;
}

#[tokio::test]
async fn expired_resource_version_relists_and_replaces_the_set() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    api.upsert(decode("d0", "10.0.0.2", true));
    let mut d = Discovery::start(&api, fast());
    assert_eq!(d.next().await.len(), 2);

    // While the watch is away, p0 is deleted and p1 appears, and the history is compacted:
    // no watch event will ever say so; only a relist can.
    api.expire_history(|pods| {
        pods.remove("p0");
        pods.insert("p1".to_owned(), prefill("p1", "10.0.0.3", true));
    });
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p1@10.0.0.3:8000/prefill"]
    );
    {
        let s = api.state();
        assert!(s.gone_sent >= 1, "the watcher was told 410 Gone");
        assert!(s.list_calls >= 2, "and relisted");
    }
    // Watching resumes after the relist.
    api.upsert(prefill("p1", "10.0.0.4", true));
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p1@10.0.0.4:8000/prefill"]
    );
    d.stop().await;
}

#[tokio::test]
async fn losing_the_api_server_keeps_the_last_good_set() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    let mut d = Discovery::start(&api, fast());
    let good = d.next().await;
    assert_eq!(good, ["p0@10.0.0.1:8000/prefill"]);

    api.set_down(true);
    // Wait until the watcher has retried against the dead server at least twice.
    tokio::time::timeout(WAIT, async {
        while api.state().refused_calls < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("watcher retries while the API server is down");
    assert!(!d.rx.has_changed().expect("alive"), "nothing published");
    assert_eq!(describe(&d.rx.borrow()), good, "last good set kept");

    // Back up with a change made meanwhile.
    api.upsert(decode("d0", "10.0.0.2", true));
    api.set_down(false);
    assert_eq!(
        d.next().await,
        ["d0@10.0.0.2:8100/decode", "p0@10.0.0.1:8000/prefill"]
    );
    d.stop().await;
}

#[tokio::test]
async fn publishes_only_on_change_and_coalesces_bursts() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    let config = KubeDiscoveryConfig {
        debounce: Duration::from_millis(200),
        ..fast()
    };
    let mut d = Discovery::start(&api, config);
    assert_eq!(d.next().await, ["p0@10.0.0.1:8000/prefill"]);

    // Changes the mapping ignores: an annotation, a pod that stays unready.
    let mut annotated = prefill("p0", "10.0.0.1", true);
    annotated["metadata"]["annotations"] =
        serde_json::json!({"kubectl.kubernetes.io/restartedAt": "now"});
    api.upsert(annotated);
    api.upsert(decode("d9", "10.0.0.9", false));
    let quiet = tokio::time::timeout(Duration::from_secs(1), d.rx.changed()).await;
    assert!(
        quiet.is_err(),
        "no publish for changes that do not alter the set"
    );

    // A burst of five relevant changes lands in one debounce window: one publish with all.
    api.upsert_many(
        (1..=5)
            .map(|i| decode(&format!("d{i}"), &format!("10.0.1.{i}"), true))
            .collect(),
    );
    let set = d.next().await;
    assert_eq!(set.len(), 6, "{set:?}");
    let quiet = tokio::time::timeout(Duration::from_secs(1), d.rx.changed()).await;
    assert!(quiet.is_err(), "the burst was published once");
    d.stop().await;
}

#[tokio::test]
async fn roleset_pairing_drops_partnerless_pods() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    let config = KubeDiscoveryConfig {
        roleset_pairing: true,
        ..fast()
    };
    let mut d = Discovery::start(&api, config);
    assert_eq!(d.next().await, Vec::<String>::new());
    api.upsert(decode("d0", "10.0.0.2", true));
    let set = d.until(|s| s.len() == 2).await;
    assert_eq!(set, ["d0@10.0.0.2:8100/decode", "p0@10.0.0.1:8000/prefill"]);
    d.stop().await;
}

#[tokio::test]
async fn explicit_and_all_namespaces_reach_the_right_paths() {
    let api = FakeApi::start().await;
    api.upsert(prefill("p0", "10.0.0.1", true));
    for (ns, expect) in [("llm", "llm"), ("*", "*")] {
        let config = KubeDiscoveryConfig {
            namespace: Some(ns.to_owned()),
            ..fast()
        };
        let mut d = Discovery::start(&api, config);
        assert_eq!(d.next().await, ["p0@10.0.0.1:8000/prefill"]);
        d.stop().await;
        assert_eq!(
            api.state().namespaces.last().map(String::as_str),
            Some(expect)
        );
    }
}

#[tokio::test]
async fn invalid_config_fails_before_contacting_the_server() {
    let api = FakeApi::start().await;
    let (tx, _rx) = watch::channel(Arc::new(Vec::new()));
    let config = KubeDiscoveryConfig {
        selector: Some("a in (x".to_owned()),
        ..fast()
    };
    let err = pdkube::run(api.client(), config, tx, CancellationToken::new())
        .await
        .expect_err("invalid selector");
    assert!(err.to_string().contains("selector"), "{err}");
    let s = api.state();
    assert_eq!(s.list_calls + s.watch_calls, 0);
}

#[tokio::test]
async fn an_inference_pool_names_the_pods_and_their_port() {
    let api = FakeApi::start().await;
    let mut other = prefill("elsewhere", "10.0.0.9", true);
    other["metadata"]["labels"]["app"] = serde_json::json!("other");
    api.upsert_many(vec![
        prefill("p1", "10.0.0.1", true),
        decode("d1", "10.0.0.2", true),
        other,
    ]);
    let config = KubeDiscoveryConfig {
        inference_pool: Some("llama".to_owned()),
        inference_pool_refresh: Duration::from_millis(50),
        debounce: Duration::from_millis(20),
        ..KubeDiscoveryConfig::default()
    };
    let mut d = Discovery::start(&api, config);
    // No pool yet: no pod is watched, nothing is published.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!d.rx.has_changed().expect("alive"));
    assert!(api.state().pool_gets >= 2, "the pool is looked up again");
    assert_eq!(api.state().list_calls, 0);

    api.set_pool(
        "llama",
        serde_json::json!({"selector": {"matchLabels": {"app": "engine"}},
                           "targetPorts": [{"number": 8200}]}),
    );
    // The pool's selector picks the pods, its port replaces theirs (the decode's label says 8100).
    let set = d.next().await;
    assert_eq!(set, ["d1@10.0.0.2:8200/decode", "p1@10.0.0.1:8200/prefill"]);
    assert!(api.state().selectors.iter().any(|s| s == "app=engine"));

    // A changed pool: the pod watch starts anew with its selector and port.
    api.set_pool(
        "llama",
        serde_json::json!({"selector": {"matchLabels": {"app": "engine", "role-name": "prefill"}},
                           "targetPorts": [{"number": 9000}]}),
    );
    let set = d.until(|s| s == ["p1@10.0.0.1:9000/prefill"]).await;
    assert_eq!(set, ["p1@10.0.0.1:9000/prefill"]);
    d.stop().await;
}

#[tokio::test]
async fn an_inference_pool_with_all_namespaces_is_refused() {
    let config = KubeDiscoveryConfig {
        namespace: Some("*".to_owned()),
        inference_pool: Some("llama".to_owned()),
        ..KubeDiscoveryConfig::default()
    };
    let err = config.validate().expect_err("one namespace");
    assert!(err.to_string().contains("inference_pool"), "{err}");
}
