//! `pdsim fleet`: engines in one process, the ready JSON and the gateway configuration.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// Ends the fleet process however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn fleet_reports_its_engines_writes_a_gateway_config_and_stops_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("pdsim-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("gateway.toml");
    let ready = dir.join("ready.json");
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_pdsim"))
            .args([
                "fleet",
                "--prefill",
                "2",
                "--decode",
                "1",
                "--connector",
                "mooncake",
            ])
            .args([
                "--profile",
                "llama-3.1-8b-h100",
                "--time-scale",
                "10",
                "--kv-events",
            ])
            .arg("--gateway-config")
            .arg(&toml)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--worker-threads", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    });
    let line = tokio::time::timeout(Duration::from_secs(20), line)
        .await
        .expect("the fleet reports within 20 s")
        .unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    let file: Value = serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    assert_eq!(v, file);
    assert_eq!(v["gateway_config"], toml.to_string_lossy().as_ref());
    let prefill: Vec<String> = serde_json::from_value(v["prefill"].clone()).unwrap();
    let decode: Vec<String> = serde_json::from_value(v["decode"].clone()).unwrap();
    assert_eq!((prefill.len(), decode.len()), (2, 1));
    let profile = pdsim::Profile::named("llama-3.1-8b-h100").unwrap();
    assert_eq!(
        v["prefill_kv_cache_blocks"], profile.kv_cache_blocks,
        "the profile's KV memory, for the oracle"
    );
    let config = std::fs::read_to_string(&toml).unwrap();
    assert_eq!(config.matches("[[prefill]]").count(), 2, "{config}");
    assert_eq!(config.matches("[[decode]]").count(), 1, "{config}");
    assert!(config.contains("kv_connector = \"mooncake\""), "{config}");
    // Mooncake prefills name their bootstrap port; every engine its event sockets.
    assert_eq!(config.matches("bootstrap_port = ").count(), 2, "{config}");
    assert_eq!(
        config.matches("kv_events = \"tcp://127.0.0.1:").count(),
        3,
        "{config}"
    );
    assert_eq!(config.matches("kv_events_replay = ").count(), 3, "{config}");
    for url in prefill.iter().chain(&decode) {
        assert!(config.contains(&format!("url = \"{url}\"")), "{config}");
        let (status, _, body) = common::post(
            format!("{url}/v1/completions"),
            &json!({"model": "pdsim", "prompt": "hello fleet", "max_tokens": 3}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let stats = common::get_json(&format!("{}/sim/stats", decode[0])).await;
    assert_eq!(stats["time_scale"], 10.0);
    assert!(stats["steps"].as_u64().unwrap() >= 3, "{stats}");
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let exit = tokio::task::spawn_blocking(move || {
        for _ in 0..100 {
            if let Some(s) = child.0.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    })
    .await
    .unwrap();
    assert!(
        exit.is_some_and(|s| s.success()),
        "the fleet ends on SIGTERM: {exit:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
