//! A fleet: N prefill and M decode engines in one process, and the pdgate configuration that
//! routes to them (`pdsim fleet`).
//!
//! Every engine listens on loopback ports chosen by the system. An idle engine costs no CPU:
//! its listeners and step loop wait on their sockets and queues.

use std::fmt::Write;

use crate::config::{Connector, KvEventsConfig, LatencyModel, Role, SimConfig, StepModel};
use crate::profile::Profile;
use crate::{SimHandle, spawn};

/// What a fleet is made of.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Prefill engines.
    pub prefill: usize,
    /// Decode engines.
    pub decode: usize,
    /// The KV connector of every engine.
    pub connector: Connector,
    /// Served model name.
    pub model: String,
    /// Step-loop profile of the prefills (`None`: the latency model).
    pub prefill_profile: Option<Profile>,
    /// Step-loop profile of the decodes (`None`: the latency model).
    pub decode_profile: Option<Profile>,
    /// Per-request delays of engines without a profile.
    pub latency: LatencyModel,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    /// KV-cache blocks per engine (`None`: the profile's, else the engine default).
    pub kv_cache_blocks: Option<usize>,
    /// Publish KV events (PUB and replay sockets per engine, written into the config).
    pub kv_events: bool,
}

impl FleetSpec {
    /// `prefill` + `decode` engines of `connector`, latency-model engines, no events.
    pub fn new(prefill: usize, decode: usize, connector: Connector) -> Self {
        FleetSpec {
            prefill,
            decode,
            connector,
            model: "pdsim".to_owned(),
            prefill_profile: None,
            decode_profile: None,
            latency: LatencyModel::realistic(),
            time_scale: 1.0,
            kv_cache_blocks: None,
            kv_events: false,
        }
    }

    fn engine(&self, role: Role, index: usize) -> SimConfig {
        let mut c = SimConfig::new(role, self.connector);
        c.model = self.model.clone();
        c.engine_id = Some(format!("{role}-{index}"));
        c.time_scale = self.time_scale;
        c.latency = self.latency.clone();
        c.advertise_host = "127.0.0.1".to_owned();
        let profile = match role {
            Role::Prefill | Role::Encode => &self.prefill_profile,
            Role::Decode | Role::Both => &self.decode_profile,
        };
        if let Some(p) = profile {
            c.cache.kv_cache_blocks = p.kv_cache_blocks;
            c.step = Some(StepModel::new(p.clone()));
        }
        if let Some(b) = self.kv_cache_blocks {
            c.cache.kv_cache_blocks = b;
        }
        if self.kv_events {
            c.kv_events = KvEventsConfig {
                enable_kv_cache_events: true,
                endpoint: "tcp://*:0".to_owned(),
                replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
                ..KvEventsConfig::default()
            };
        }
        c
    }
}

/// A running fleet. Dropping it stops every engine.
pub struct Fleet {
    /// The prefill engines, in order.
    pub prefill: Vec<SimHandle>,
    /// The decode engines, in order.
    pub decode: Vec<SimHandle>,
    connector: Connector,
}

/// Starts every engine of `spec`; returns once all listen.
pub async fn start(spec: &FleetSpec) -> std::io::Result<Fleet> {
    let mut prefill = Vec::with_capacity(spec.prefill);
    for i in 0..spec.prefill {
        prefill.push(spawn(spec.engine(Role::Prefill, i)).await?);
    }
    let mut decode = Vec::with_capacity(spec.decode);
    for i in 0..spec.decode {
        decode.push(spawn(spec.engine(Role::Decode, i)).await?);
    }
    Ok(Fleet {
        prefill,
        decode,
        connector: spec.connector,
    })
}

/// `tcp://127.0.0.1:PORT` for a socket bound on any interface (`tcp://0.0.0.0:PORT`).
fn loopback(endpoint: &str) -> String {
    match endpoint.rsplit_once(':') {
        Some((_, port)) => format!("tcp://127.0.0.1:{port}"),
        None => endpoint.to_owned(),
    }
}

/// A TOML basic string.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

impl Fleet {
    /// The prefills' base URLs.
    pub fn prefill_urls(&self) -> Vec<String> {
        self.prefill.iter().map(SimHandle::base_url).collect()
    }

    /// The decodes' base URLs.
    pub fn decode_urls(&self) -> Vec<String> {
        self.decode.iter().map(SimHandle::base_url).collect()
    }

    /// A pdgate configuration (TOML) with every engine as a static endpoint: its name, model,
    /// bootstrap port (mooncake, sglang) and KV-event sockets (when they publish).
    pub fn gateway_toml(&self) -> String {
        let mut s =
            String::from("# Written by `pdsim fleet`: one entry per engine of the fleet.\n");
        let _ = writeln!(s, "kv_connector = {}", quoted(self.connector.as_str()));
        for (table, engines) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for e in engines {
                let _ = writeln!(s, "\n[[{table}]]");
                let _ = writeln!(s, "url = {}", quoted(&e.base_url()));
                let _ = writeln!(s, "name = {}", quoted(e.engine_id()));
                let _ = writeln!(s, "model = {}", quoted(&e.config().model));
                if let Some(p) = e.bootstrap_port() {
                    let _ = writeln!(s, "bootstrap_port = {p}");
                }
                if let Some(ep) = e.kv_events_endpoint() {
                    let _ = writeln!(s, "kv_events = {}", quoted(&loopback(ep)));
                }
                if let Some(ep) = e.kv_events_replay_endpoint() {
                    let _ = writeln!(s, "kv_events_replay = {}", quoted(&loopback(ep)));
                }
            }
        }
        s
    }

    /// `{"prefill":[url...],"decode":[url...],"gateway_config":path,
    /// "prefill_kv_cache_blocks":n}` (the first prefill's KV-cache blocks: a load generator's
    /// capacity-bounded oracle reads them).
    pub fn ready_json(&self, gateway_config: &str) -> String {
        serde_json::json!({
            "prefill": self.prefill_urls(),
            "decode": self.decode_urls(),
            "gateway_config": gateway_config,
            "prefill_kv_cache_blocks": self.prefill.first().map(|e| e.config().cache.kv_cache_blocks),
        })
        .to_string()
    }

    /// Stops every engine (bounded per engine).
    pub async fn shutdown(self) {
        let all = self.prefill.into_iter().chain(self.decode);
        futures_util::future::join_all(all.map(SimHandle::shutdown)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_interface_endpoints_become_loopback() {
        assert_eq!(loopback("tcp://0.0.0.0:5557"), "tcp://127.0.0.1:5557");
        assert_eq!(quoted("a\"b"), "\"a\\\"b\"");
    }
}
