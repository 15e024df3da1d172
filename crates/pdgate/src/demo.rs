//! `pdgate demo`: simulated prefill/decode engines of several connectors and an encoder
//! (in-process pdsim, model `demo`) and a gateway in front of them. Works on a machine with
//! nothing else installed.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use pdsim::{Connector, LatencyModel, Role, SimConfig, SimHandle};

use crate::config::{Config, EndpointConfig};
use crate::{Error, Gateway, RunningGateway};

/// The model every demo engine serves.
pub const DEMO_MODEL: &str = "demo";

/// The demo fleet: (connector, role) of every engine started.
const FLEET: &[(Connector, Role)] = &[
    (Connector::Shfs, Role::Prefill),
    (Connector::Shfs, Role::Prefill),
    (Connector::Shfs, Role::Decode),
    (Connector::Mooncake, Role::Prefill),
    (Connector::Mooncake, Role::Decode),
    (Connector::Nixl, Role::Prefill),
    (Connector::Nixl, Role::Decode),
    (Connector::P2pNccl, Role::Prefill),
    (Connector::P2pNccl, Role::Decode),
    (Connector::Moriio, Role::Prefill),
    (Connector::Moriio, Role::Decode),
    (Connector::Trtllm, Role::Prefill),
    (Connector::Trtllm, Role::Decode),
    // Encoder disaggregation: multimodal chat requests are encoded here before their prefill.
    (Connector::None, Role::Encode),
];

/// A running demo: engines plus gateway. Dropping it stops everything.
pub struct Demo {
    /// The engines, in [`FLEET`] order.
    pub engines: Vec<SimHandle>,
    /// The gateway.
    pub gateway: RunningGateway,
}

impl std::fmt::Debug for Demo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Demo")
            .field("engines", &self.engines.len())
            .field("gateway", &self.gateway.addr())
            .finish()
    }
}

fn endpoint(engine: &SimHandle, connector: Connector) -> EndpointConfig {
    let mut labels = BTreeMap::new();
    // An encoder has no KV connector (it hands its items over through `ec_transfer_params`).
    if connector != Connector::None {
        labels.insert(
            kvtransfer::CONNECTOR_TYPE_IDENTIFIER.to_string(),
            connector.as_str().to_string(),
        );
    }
    // Connectors whose legs name their peer dial the port where pdsim serves its KV.
    let mut annotations = BTreeMap::new();
    let peer_port = match connector {
        Connector::P2pNccl => Some(kvtransfer::P2P_NCCL_KV_PORT),
        Connector::Moriio | Connector::MoriioRead => Some(kvtransfer::MORIIO_HANDSHAKE_PORT),
        _ => None,
    };
    if let (Some(key), Some(port)) = (peer_port, engine.side_channel_port()) {
        annotations.insert(key.to_string(), port.to_string());
    }
    EndpointConfig {
        url: engine.base_url(),
        model: Some(DEMO_MODEL.to_string()),
        labels,
        annotations,
        bootstrap_port: engine.bootstrap_port(),
        ..EndpointConfig::default()
    }
}

/// Starts the demo fleet and a gateway on `listen`. `latency` shapes the engines (the binary
/// uses a realistic model; tests use zero delay).
pub async fn start(listen: SocketAddr, latency: LatencyModel) -> Result<Demo, Error> {
    let mut engines = Vec::with_capacity(FLEET.len());
    let mut config = Config {
        http: crate::config::HttpConfig {
            listen,
            ..Default::default()
        },
        // A laptop demo has no load balancer to tell.
        shutdown: crate::config::ShutdownConfig {
            drain_delay: Duration::ZERO,
            ..Default::default()
        },
        // The demo shows where each request went.
        security: crate::config::SecurityConfig {
            expose_target_headers: true,
            ..crate::config::SecurityConfig::default()
        },
        ..Config::default()
    };
    for (connector, role) in FLEET {
        let mut sim = SimConfig::new(*role, *connector);
        sim.model = DEMO_MODEL.to_string();
        sim.latency = latency.clone();
        let engine = pdsim::spawn(sim).await.map_err(Error::Engine)?;
        let ep = endpoint(&engine, *connector);
        match role {
            Role::Prefill => config.prefill.push(ep),
            Role::Encode => config.encode.push(ep),
            _ => config.decode.push(ep),
        }
        engines.push(engine);
    }
    let gateway = Gateway::new(config, kvtransfer::Registry::with_builtins())?;
    let listener = crate::run::listen(listen).map_err(|e| Error::Bind(listen, e))?;
    let pods = gateway.config.pods()?;
    let gateway = RunningGateway::start(gateway, listener, pods).await?;
    Ok(Demo { engines, gateway })
}

/// Prints where everything is and how to try it.
pub fn print_banner(demo: &Demo) {
    let url = demo.gateway.base_url();
    println!("pdgate demo: gateway on {url}, model \"{DEMO_MODEL}\"");
    for (engine, (connector, role)) in demo.engines.iter().zip(FLEET) {
        println!(
            "  {:<8} {:<8} {}",
            role.as_str(),
            connector.as_str(),
            engine.base_url()
        );
    }
    println!(
        r#"
Try it (each request is prefilled on one engine and decoded on another):

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model":"{DEMO_MODEL}","messages":[{{"role":"user","content":"Hello!"}}],"max_tokens":16}}' -i

  curl -sN {url}/v1/completions -H 'content-type: application/json' \
    -d '{{"model":"{DEMO_MODEL}","prompt":"Once upon a time","max_tokens":16,"stream":true}}'

  # An image goes to the encoder first (encoder -> prefill -> decode; x-pdgate-connector shows
  # the prefill's connector, the encoder's /sim/stats its "ec" counters):
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model":"{DEMO_MODEL}","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"https://example.com/cat.png"}}}},{{"type":"text","text":"What is this?"}}]}}],"max_tokens":16}}' -i

  python3 -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="none"); print(c.chat.completions.create(model="{DEMO_MODEL}", messages=[{{"role":"user","content":"Hello!"}}], max_tokens=16).choices[0].message.content)'

  curl -s {url}/ready; curl -s {url}/metrics | grep pdgate_requests

Response headers prefill-target-pod, target-pod and x-pdgate-connector show where it went.
Press Ctrl-C to stop."#
    );
}

/// Runs the demo until `signal` completes.
pub async fn run(listen: SocketAddr, signal: impl Future<Output = ()>) -> Result<(), Error> {
    let demo = start(listen, LatencyModel::realistic()).await?;
    print_banner(&demo);
    let Demo { engines, gateway } = demo;
    gateway.run_until(signal, Duration::from_secs(10)).await;
    for engine in engines {
        engine.shutdown().await;
    }
    Ok(())
}
