//! Config-file hot reload without dropping in-flight requests, and the demo fleet.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::*;
use pdgate::RunArgs;
use pdgate::{Gateway, RunningGateway};
use pdsim::{Connector, LatencyModel, Role};
use serde_json::json;
use tokio::net::TcpListener;

fn toml_for(prefill: &[&pdsim::SimHandle], decode: &[&pdsim::SimHandle]) -> String {
    let mut s = String::from("kv_connector = \"shfs\"\nmodels = [\"m\"]\ndrain_delay = 0\n");
    // The test follows requests by the endpoint headers (AIBrix's, off by default).
    s.push_str("[security]\nexpose_target_headers = true\n");
    for p in prefill {
        s.push_str(&format!("[[prefill]]\nurl = \"{}\"\n", p.base_url()));
    }
    for d in decode {
        s.push_str(&format!("[[decode]]\nurl = \"{}\"\n", d.base_url()));
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_the_config_file_swaps_endpoints_without_dropping_requests() {
    let slow = LatencyModel {
        itl: Duration::from_millis(10),
        ..LatencyModel::default()
    };
    let p = pdsim::spawn(sim(Role::Prefill, Connector::Shfs))
        .await
        .unwrap();
    let mut d1 = sim(Role::Decode, Connector::Shfs);
    d1.latency = slow;
    let d1 = pdsim::spawn(d1).await.unwrap();
    let d2 = pdsim::spawn(sim(Role::Decode, Connector::Shfs))
        .await
        .unwrap();

    let dir = std::env::temp_dir().join(format!("pdgate-reload-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("pdgate.toml");
    std::fs::write(&file, toml_for(&[&p], &[&d1])).unwrap();
    let args = RunArgs {
        config: Some(file.clone()),
        ..RunArgs::default()
    };
    let registry = kvtransfer::Registry::with_builtins();
    let gw = Gateway::new(args.load().unwrap(), registry).unwrap();
    let pods = gw.config.pods().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut running = RunningGateway::start(gw, listener, pods).await.unwrap();
    let tx = running.pods().clone();
    let cancel = running.cancel_token();
    running.spawn_owned(pdgate::watch_config_file(
        args,
        running.gateway().clone(),
        tx,
        cancel,
        Duration::from_millis(50),
    ));
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", running.base_url());

    // A long stream on d1 is in flight while the file moves traffic to d2.
    let mut long = completion(true);
    long["max_tokens"] = json!(60);
    let mut inflight = http.post(&url).json(&long).send().await.unwrap();
    assert_eq!(inflight.headers()["target-pod"], d1.addr().to_string());
    let first = inflight.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));

    // A bad edit is rejected (pdgate read it: the rejection is counted) and the last good set
    // keeps serving.
    let config_reloads = |result: &'static str| {
        let http = http.clone();
        let url = format!("{}/metrics", running.base_url());
        async move {
            let text = http.get(url).send().await.unwrap().text().await.unwrap();
            metric(
                &text,
                &format!("pdgate_reloads_total{{file=\"config\",result=\"{result}\"}}"),
            )
        }
    };
    std::fs::write(&file, "kv_connector = \"bogus\"\n").unwrap();
    let mut rejected = false;
    for _ in 0..200 {
        if config_reloads("rejected").await >= 1.0 {
            rejected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rejected, "the bad edit was not read within 10 s");
    let r = http
        .post(&url)
        .json(&completion(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["target-pod"], d1.addr().to_string());

    std::fs::write(&file, toml_for(&[&p], &[&d2])).unwrap();
    let mut moved = false;
    for _ in 0..100 {
        let r = http
            .post(&url)
            .json(&completion(false))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let target = r.headers().get("target-pod").cloned();
        assert_eq!(status, 200, "{:?}", r.text().await);
        if target.is_some_and(|t| t == d2.addr().to_string().as_str()) {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(moved, "traffic moved to the new decode");
    assert!(config_reloads("applied").await >= 1.0);
    // The stream that started before the reload completes intact.
    let mut rest = first.to_vec();
    while let Some(c) = inflight.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    assert!(!text_of(std::str::from_utf8(&rest).unwrap()).is_empty());
    running.shutdown(Duration::from_secs(5)).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_serves_every_connector() {
    let demo = pdgate::demo::start("127.0.0.1:0".parse().unwrap(), LatencyModel::default())
        .await
        .unwrap();
    let base = demo.gateway.base_url();
    let http = reqwest::Client::new();
    for _ in 0..100 {
        if http
            .get(format!("{base}/ready"))
            .send()
            .await
            .unwrap()
            .status()
            == 200
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut connectors = std::collections::BTreeSet::new();
    for i in 0..48 {
        let (path, body) = if i % 2 == 0 {
            (
                "/v1/chat/completions",
                json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": i % 4 == 0}),
            )
        } else {
            (
                "/v1/completions",
                json!({"model": "demo", "prompt": "hello", "max_tokens": 8}),
            )
        };
        let r = http
            .post(format!("{base}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        connectors.insert(
            r.headers()["x-pdgate-connector"]
                .to_str()
                .unwrap()
                .to_string(),
        );
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    assert_eq!(
        connectors.into_iter().collect::<Vec<_>>(),
        ["mooncake", "moriio", "nixl", "p2pnccl", "shfs", "trtllm"]
    );
    // Images go to the demo's encoder before the prefills of connectors that carry
    // `ec_transfer_params`; the others' prefills encode them themselves.
    for i in 0..24 {
        let body = json!({"model": "demo", "max_tokens": 8, "stream": i % 2 == 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("https://example.com/{i}.png")}},
            {"type": "text", "text": "what is this"}]}]});
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(!text_of(&r.text().await.unwrap()).is_empty());
    }
    let (mut served, mut pulled, mut local) = (0, 0, 0);
    for engine in &demo.engines {
        let s = engine.stats();
        assert_eq!(s.recomputed, 0);
        assert_eq!(s.ec.failed, 0, "{s:?}");
        served += s.ec.served;
        pulled += s.ec.pulled;
        local += s.ec.encoded_locally;
    }
    assert!(served > 0, "the encoder served no item");
    assert_eq!(served, pulled);
    assert_eq!(pulled + local, 24);
}

/// The example configuration (`deploy/pdgate.toml`, shown in the README), as written, with its four addresses pointed at pdsim
/// engines of the connectors it names: every request pairs a prefill with a decode of its own
/// connector (pdsim fails a handoff between connectors), both connectors serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_configuration_runs_as_written() {
    let readme = include_str!("../../../README.md");
    let toml = include_str!("../../../deploy/pdgate.toml");
    let in_readme = readme
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README has a TOML example");
    assert_eq!(
        in_readme, toml,
        "README.md shows deploy/pdgate.toml as it is"
    );
    let engine = |role, connector| {
        let mut c = sim(role, connector);
        c.model = "llama-3-8b".into();
        pdsim::spawn(c)
    };
    let shfs_p = engine(Role::Prefill, Connector::Shfs).await.unwrap();
    let moon_p = engine(Role::Prefill, Connector::Mooncake).await.unwrap();
    let shfs_d = engine(Role::Decode, Connector::Shfs).await.unwrap();
    let moon_d = engine(Role::Decode, Connector::Mooncake).await.unwrap();
    let bootstrap = moon_p.bootstrap_port().expect("mooncake bootstrap port");
    let text = toml
        .replace("http://10.0.0.1:8000", &shfs_p.base_url())
        .replace("http://10.0.0.4:8000", &moon_p.base_url())
        .replace("http://10.0.0.3:8000", &shfs_d.base_url())
        .replace("http://10.0.0.5:8000", &moon_d.base_url())
        .replace(
            "bootstrap_port = 8998",
            &format!("bootstrap_port = {bootstrap}"),
        );
    let config = pdgate::config::Config::from_toml(&text).expect("the README's TOML parses");
    let gw = Gateway::new(config, kvtransfer::Registry::with_builtins()).expect("and validates");
    let pods = gw.config.pods().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let running = RunningGateway::start(gw, listener, pods).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", running.base_url());
    // Mooncake prefills need their bootstrap facts before they route: wait (bounded).
    let mut ok = 0;
    for _ in 0..200 {
        let r = http
            .post(&url)
            .json(&json!({"model": "llama-3-8b", "prompt": "hello", "max_tokens": 2}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        if moon_p.stats().responses_ok == 0 && status != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        assert_eq!(status, 200, "{body}");
        ok += 1;
        if ok == 20 {
            break;
        }
    }
    assert_eq!(ok, 20);
    for (name, e) in [("shfs decode", &shfs_d), ("mooncake decode", &moon_d)] {
        let s = e.stats();
        assert!(s.responses_ok > 0, "{name} served nothing");
        assert_eq!(s.responses_error, 0, "{name} failed a handoff");
    }
    assert!(
        moon_d.stats().transfers_pulled > 0,
        "mooncake KV was pulled"
    );
    running.shutdown(Duration::from_secs(5)).await;
}
