//! REFERENCE ONLY, NOT A PRODUCT: the least a PD gateway can do for a streamed request, as the
//! floor `bench/compare.sh` measures pdgate against. No routing choice, no limits, no metrics, no
//! health, no error events after the head, no cancellation of the prefill, one prefill and one
//! decode engine (shfs): the prefill leg (`max_tokens` 1, not streamed, `do_remote_decode`), then
//! the decode's response body handed to hyper's server as it is, chunk by chunk.
//!
//! With a fourth argument `drive`, the decode leg runs on a connection of its own that the
//! relaying task drives itself (hyper's client connection polled from the response body instead
//! of its own task): hyper's decoder then runs until the engine's socket is empty and every
//! event already read reaches the client in one write. That is the relay pdgate's engine pool
//! would need for fewer writes than events (docs/benchmarks.md).
//!
//! `cargo run --release -p pdbench --example stream_floor -- LISTEN PREFILL_URL DECODE_URL [drive]`

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http1;
use hyper::{Request, Response, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};

type Engines = Client<HttpConnector, Full<Bytes>>;
type Answer = Response<Either<Either<Incoming, Driven>, Full<Bytes>>>;
type Decode = http1::Connection<TokioIo<tokio::net::TcpStream>, Full<Bytes>>;

const LIMIT: Duration = Duration::from_secs(30);

struct Floor {
    client: Engines,
    prefill: String,
    prefill_host: String,
    decode: String,
    drive: bool,
    ids: AtomicU64,
}

/// A decode body whose connection is polled by the task that reads the body.
struct Driven {
    conn: Option<Pin<Box<Decode>>>,
    body: Incoming,
    _sender: http1::SendRequest<Full<Bytes>>,
}

impl hyper::body::Body for Driven {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        // Decodes the next chunk already read (or reads), then hands it over.
        if let Some(conn) = this.conn.as_mut()
            && conn.as_mut().poll(cx).is_ready()
        {
            this.conn = None;
        }
        Pin::new(&mut this.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}

/// The decode leg on a new connection, returned with the connection inside its body.
async fn driven(url: &str, req: Request<Full<Bytes>>) -> Result<Response<Driven>, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{e}"))?;
    let authority = uri.authority().ok_or("no authority")?.to_string();
    let tcp = tokio::net::TcpStream::connect(&authority)
        .await
        .map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) = http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    let (mut parts, body) = req.into_parts();
    parts.uri = uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .map_err(|e| format!("{e}"))?;
    parts
        .headers
        .insert(header::HOST, authority.parse().map_err(|e| format!("{e}"))?);
    let mut conn = Some(Box::pin(conn));
    let mut sending = Box::pin(sender.send_request(Request::from_parts(parts, body)));
    let head = poll_fn(|cx| {
        if let Some(c) = conn.as_mut()
            && c.as_mut().poll(cx).is_ready()
        {
            conn = None;
        }
        sending.as_mut().poll(cx)
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok(head.map(|body| Driven {
        conn,
        body,
        _sender: sender,
    }))
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
    let request = post(&url, &id, &decode)?;
    if floor.drive {
        let head = tokio::time::timeout(LIMIT, driven(&url, request))
            .await
            .map_err(|_| "decode timed out")??;
        return Ok(head.map(|b| Either::Left(Either::Right(b))));
    }
    let leg = floor.client.request(request);
    let head = tokio::time::timeout(LIMIT, leg)
        .await
        .map_err(|_| "decode timed out")?;
    // The floor of the per-event path: the engine's body, untouched, is the client's body.
    Ok(head
        .map_err(|e| e.to_string())?
        .map(|b| Either::Left(Either::Left(b))))
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
    let (drive, args) = match args.as_slice() {
        [rest @ .., last] if last == "drive" => (true, rest),
        all => (false, all),
    };
    let [listen, prefill, decode] = args else {
        return Err("usage: stream_floor LISTEN PREFILL_URL DECODE_URL [drive]".into());
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
        drive,
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
