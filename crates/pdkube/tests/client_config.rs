//! Client construction: kubeconfig files and TLS set-up.

mod fake_api;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fake_api::{FakeApi, pod_json};
use pdkube::{KubeDiscoveryConfig, KubeDiscoveryError};
use tokio_util::sync::CancellationToken;

/// A kubeconfig file in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, contents: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!(
            "pdkube-{tag}-{}-{}.yaml",
            std::process::id(),
            uuid_like()
        ));
        std::fs::write(&path, contents).expect("write temp kubeconfig");
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn uuid_like() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

fn kubeconfig(server: &str, namespace: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
current-context: fake
clusters:
  - name: fake
    cluster:
      server: {server}
  - name: unreachable
    cluster:
      server: https://127.0.0.1:1
contexts:
  - name: fake
    context:
      cluster: fake
      user: dev
      namespace: {namespace}
  - name: other
    context:
      cluster: unreachable
      user: dev
users:
  - name: dev
    user:
      token: not-a-secret
"
    )
}

#[tokio::test]
async fn kubeconfig_client_watches_its_context_namespace() {
    let api = FakeApi::start().await;
    api.upsert(pod_json(
        "p0",
        "10.0.0.1",
        true,
        &[("role-name", "prefill")],
    ));
    let file = TempFile::new("ok", &kubeconfig(&api.url, "llm"));
    let client = pdkube::client_from_kubeconfig(&file.0, None)
        .await
        .expect("client from kubeconfig");
    assert_eq!(client.default_namespace(), "llm");

    let (tx, mut rx) = tokio::sync::watch::channel(Arc::new(Vec::new()));
    let cancel = CancellationToken::new();
    let config = KubeDiscoveryConfig {
        debounce: Duration::from_millis(10),
        ..KubeDiscoveryConfig::default()
    };
    let task = tokio::spawn(pdkube::run(client, config, tx, cancel.clone()));
    tokio::time::timeout(Duration::from_secs(30), rx.changed())
        .await
        .expect("published")
        .expect("alive");
    let names: Vec<String> = rx.borrow().iter().map(|p| p.name.clone()).collect();
    assert_eq!(names, ["p0"]);
    cancel.cancel();
    let result = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("ends")
        .expect("no panic");
    assert!(result.is_ok());
    assert_eq!(
        api.state().namespaces.first().map(String::as_str),
        Some("llm")
    );
}

#[tokio::test]
async fn kubeconfig_context_selection_and_errors() {
    let file = TempFile::new("ctx", &kubeconfig("http://127.0.0.1:9", "llm"));
    let other = pdkube::client_from_kubeconfig(&file.0, Some("other"))
        .await
        .expect("https context builds a TLS client without panicking");
    assert_eq!(other.default_namespace(), "default");

    let missing = pdkube::client_from_kubeconfig(&file.0, Some("nope")).await;
    assert!(matches!(missing, Err(KubeDiscoveryError::Kubeconfig(_))));

    let gone = std::env::temp_dir().join("pdkube-does-not-exist.yaml");
    let Err(err) = pdkube::client_from_kubeconfig(&gone, None).await else {
        panic!("a missing kubeconfig file must fail");
    };
    assert!(err.to_string().contains("kubeconfig"), "{err}");
}

#[test]
fn https_client_builds_with_the_ring_provider() {
    pdkube::install_crypto_provider();
    // Twice is fine: the second install is a no-op.
    pdkube::install_crypto_provider();
    let config = kube::Config::new("https://127.0.0.1:6443".parse().expect("uri"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Client construction spawns nothing but needs a runtime context for its tower stack.
    let _guard = rt.enter();
    assert!(kube::Client::try_from(config).is_ok());
}
