//! REFERENCE ONLY, NOT A PRODUCT: the least a PD gateway can do for a streamed request, as the
//! floor `bench/compare.sh` measures pdgate against. No routing choice, no limits, no metrics, no
//! health, no error events after the head, no cancellation of the prefill, one prefill and one
//! decode engine (shfs): the prefill leg (`max_tokens` 1, not streamed, `do_remote_decode`), then
//! the decode's response body handed to hyper's server as it is, chunk by chunk.
//!
//! `cargo run --release -p pdbench --example stream_floor -- LISTEN PREFILL_URL DECODE_URL`

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};

type Engines = Client<HttpConnector, Full<Bytes>>;
type Answer = Response<Either<Incoming, Full<Bytes>>>;

const LIMIT: Duration = Duration::from_secs(30);

struct Floor {
    client: Engines,
    prefill: String,
    prefill_host: String,
    decode: String,
    ids: AtomicU64,
}

fn post(url: &str, id: &str, body: &Value) -> Result<Request<Full<Bytes>>, String> {
    Request::post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())
}

async fn relay(floor: &Floor, req: Request<Incoming>) -> Result<Answer, String> {
    let path = req.uri().path().to_owned();
    if path == "/health" {
        return Ok(Response::new(Either::Right(Full::new(Bytes::new()))));
    }
    let body = Limited::new(req.into_body(), 16 << 20).collect().await;
    let mut decode: Value = serde_json::from_slice(&body.map_err(|e| e.to_string())?.to_bytes())
        .map_err(|e| e.to_string())?;
    let id = format!("floor-{}", floor.ids.fetch_add(1, Ordering::Relaxed));
    let mut prefill = decode.clone();
    let p = prefill.as_object_mut().ok_or("not a JSON object")?;
    p.remove("stream_options");
    p.insert("stream".into(), json!(false));
    p.insert("max_tokens".into(), json!(1));
    p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true}),
    );
    let url = format!("{}{path}", floor.prefill);
    let leg = floor.client.request(post(&url, &id, &prefill)?);
    let head = tokio::time::timeout(LIMIT, leg)
        .await
        .map_err(|_| "prefill timed out")?;
    let answer = head.map_err(|e| e.to_string())?.into_body().collect();
    let answer = tokio::time::timeout(LIMIT, answer)
        .await
        .map_err(|_| "prefill timed out")?;
    let answer: Value = serde_json::from_slice(&answer.map_err(|e| e.to_string())?.to_bytes())
        .map_err(|e| e.to_string())?;
    let mut params = answer
        .get("kv_transfer_params")
        .cloned()
        .ok_or("no kv_transfer_params")?;
    params["remote_host"] = json!(floor.prefill_host);
    decode["kv_transfer_params"] = params;
    let url = format!("{}{path}", floor.decode);
    let leg = floor.client.request(post(&url, &id, &decode)?);
    let head = tokio::time::timeout(LIMIT, leg)
        .await
        .map_err(|_| "decode timed out")?;
    // The floor of the per-event path: the engine's body, untouched, is the client's body.
    Ok(head.map_err(|e| e.to_string())?.map(Either::Left))
}

async fn serve(floor: Arc<Floor>, req: Request<Incoming>) -> Result<Answer, Infallible> {
    Ok(match relay(&floor, req).await {
        Ok(answer) => answer,
        Err(e) => {
            let mut r = Response::new(Either::Right(Full::new(Bytes::from(e))));
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, prefill, decode] = args.as_slice() else {
        return Err("usage: stream_floor LISTEN PREFILL_URL DECODE_URL".into());
    };
    let prefill_host = prefill
        .parse::<hyper::Uri>()?
        .host()
        .ok_or("prefill host")?
        .to_owned();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let floor = Arc::new(Floor {
        client: Client::builder(TokioExecutor::new()).build(connector),
        prefill: prefill.trim_end_matches('/').to_owned(),
        prefill_host,
        decode: decode.trim_end_matches('/').to_owned(),
        ids: AtomicU64::new(0),
    });
    let listener = tokio::net::TcpListener::bind(listen.as_str()).await?;
    loop {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        let floor = floor.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| serve(floor.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}
