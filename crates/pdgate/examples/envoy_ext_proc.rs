//! Plays Envoy's ext_proc filter for one request against a running `pdgate ext-proc`, as the
//! tests' client does (`tests/common/envoy.rs`): the request headers and the buffered body
//! through the processor, the request forwarded to the destination it named, and the response
//! streamed back through it. No Envoy can be installed on the CI machines: the real-vLLM
//! end-to-end (`tests/e2e/check_pd.py --ext-proc`) drives ext-proc mode through this.
//!
//! ```text
//! cargo run -p pdgate --example envoy_ext_proc -- 127.0.0.1:9002 /v1/completions \
//!     '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'
//! ```
//!
//! Prints one JSON object: `status`, `headers` (the response's, after the processor's
//! mutations), `body` (as the client got it), and, when the processor routed the request,
//! `destination`, `target_pod` and `prefill` (`prefill-target-pod`, shown when the gateway
//! exposes target headers). A processor's immediate response is printed the same way; a
//! timed-out or closed stream exits 1.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test tool: a panic is the report

#[allow(dead_code)] // the tests use more of the client than this tool does
#[path = "../tests/common/envoy.rs"]
mod envoy;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Map, Value, json};

fn headers_json(headers: &http::HeaderMap) -> Value {
    let mut map = Map::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        map.insert(name.as_str().to_string(), Value::String(value));
    }
    Value::Object(map)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, path, body] = args.as_slice() else {
        eprintln!("usage: envoy_ext_proc ADDR PATH BODY_JSON");
        std::process::exit(2);
    };
    let addr: SocketAddr = addr.parse().expect("ADDR is host:port");
    let body: Value = serde_json::from_str(body).expect("BODY_JSON is JSON");
    let mut envoy = envoy::Envoy::new(addr);
    // Real engines on CPU: the answer to the body message holds the whole prefill leg.
    envoy.message_timeout = Duration::from_secs(180);
    envoy.http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    let out = match envoy.request(path, &body, &[], None).await {
        Ok(r) => json!({
            "status": r.status,
            "headers": headers_json(&r.headers),
            "body": r.body,
            "destination": r.destination,
            "target_pod": r.target_pod,
            "prefill": r.headers.get("prefill-target-pod").map(|v| v.to_str().unwrap_or_default()),
        }),
        Err(envoy::Refused::Immediate {
            status,
            headers,
            body,
        }) => json!({
            "status": status,
            "headers": headers_json(&headers),
            "body": body.to_string(),
        }),
        Err(other) => {
            eprintln!("envoy_ext_proc: no answer: {other:?}");
            std::process::exit(1);
        }
    };
    println!("{out}");
}
