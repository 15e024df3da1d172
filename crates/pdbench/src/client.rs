//! One request, end to end: send, read (whole body or a timed SSE stream), classify.
//!
//! The HTTP client is hyper-util's pooled client (HTTP/1.1, keep-alive, `TCP_NODELAY`): one
//! connection per in-flight request, reused afterwards, so the client costs little per request.
//! Direct mode performs the PD two-leg flow itself (prefill, then decode with the prefill's
//! KV-transfer parameters), the baseline every gateway is measured against.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::BenchError;
use crate::sse::{Event, SseReader, find_u64_field};
use crate::stats::{ErrorClass, Sample};
use crate::trace::Prompt;
use crate::workload::{Bodies, DirectConnector, Input};

/// The pooled HTTP/1.1 client every request goes through.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Largest non-streamed response body read (bigger is a protocol error).
const MAX_BODY_BYTES: usize = 64 << 20;

/// Builds the pooled client; `max_idle` should cover the expected number of open connections.
pub fn http_client(max_idle: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(10)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(max_idle)
        .build(connector)
}

/// An engine or gateway address with the API path resolved.
#[derive(Debug, Clone)]
pub struct Endpoint {
    uri: Uri,
    host: String,
}

impl Endpoint {
    /// Parses a base URL like `http://127.0.0.1:8000` (a trailing `/` or `/v1` is tolerated)
    /// and appends `path`.
    pub fn new(base: &str, path: &str) -> Result<Self, BenchError> {
        let invalid = |reason: &str| BenchError::InvalidUrl {
            url: base.to_owned(),
            reason: reason.to_owned(),
        };
        let trimmed = base.trim().trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let uri: Uri = format!("{trimmed}{path}")
            .parse()
            .map_err(|_| invalid("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(invalid("only http:// is supported"));
        }
        let host = uri
            .host()
            .ok_or_else(|| invalid("no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Ok(Endpoint { uri, host })
    }

    /// The full request URI.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The host part (what direct mode writes into `remote_host`).
    pub fn host(&self) -> &str {
        &self.host
    }
}

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Route {
    /// Everything to one OpenAI endpoint (a gateway or a single engine).
    Single(Endpoint),
    /// Request `id` to replica `id mod n` (never empty).
    Replicas(Vec<Endpoint>),
    /// Direct PD: prefill leg, then decode leg.
    Direct {
        /// Prefill engine.
        prefill: Endpoint,
        /// Decode engine.
        decode: Endpoint,
        /// How the KV-transfer parameters are carried.
        connector: DirectConnector,
    },
}

/// What one request needs; shared by every request of a run.
#[derive(Debug)]
pub struct Requester {
    /// The pooled client.
    pub client: HttpClient,
    /// Body builder.
    pub bodies: Bodies,
    /// Target.
    pub route: Route,
    /// Streaming or not (must match `bodies`).
    pub stream: bool,
    /// Prefix of the `X-Request-Id` sent in direct mode.
    pub run_id: String,
    /// Read the generated text back (multi-turn histories).
    pub answers: bool,
    /// The first non-2xx answer: status and the start of its body.
    pub first_error: std::sync::OnceLock<String>,
}

/// Reusable per-worker scratch space.
#[derive(Debug, Default)]
pub struct Scratch {
    gaps: Vec<u64>,
}

impl Scratch {
    /// Takes back a recorded sample's gap buffer for the next request.
    pub fn recycle(&mut self, sample: Sample) {
        self.gaps = sample.gaps_us;
    }
}

impl Requester {
    /// Runs request number `id` with a prompt of `prompt_words` and `max_tokens` output tokens.
    /// Latency is measured from `started` (the intended start in open-loop mode).
    /// `trace` replaces the synthetic prompt when given.
    pub async fn execute(
        &self,
        id: u64,
        prompt_words: u32,
        trace: Option<&Prompt>,
        max_tokens: u32,
        started: Instant,
        scratch: &mut Scratch,
    ) -> Result<Sample, ErrorClass> {
        let words;
        let input = match trace {
            Some(p) => Input::Trace(p),
            None => {
                words = self.bodies.prompt(id, prompt_words);
                Input::Words(&words)
            }
        };
        let mut sample = Sample::default();
        let response = match &self.route {
            Route::Single(ep) => {
                let body = self.bodies.client_input(input, max_tokens);
                send(&self.client, ep.uri(), body, None).await?
            }
            Route::Replicas(eps) => {
                let ep = &eps[(id % eps.len() as u64) as usize];
                let body = self.bodies.client_input(input, max_tokens);
                send(&self.client, ep.uri(), body, None).await?
            }
            Route::Direct {
                prefill,
                decode,
                connector,
            } => {
                let rid = format!("{}-{id}", self.run_id);
                let body = self.bodies.prefill_input(input, *connector);
                let resp = send(&self.client, prefill.uri(), body, Some(&rid)).await?;
                let resp = self.check_status(resp).await?;
                let prefill_body = read_full(resp.into_body()).await?;
                sample.prefill = Some(started.elapsed());
                let (key, raw) = match connector {
                    DirectConnector::Shfs => (
                        "kv_transfer_params",
                        shfs_decode_params(&prefill_body, prefill.host())?,
                    ),
                    DirectConnector::Nixl => {
                        ("disagg_prefill_resp", nixl_decode_params(&prefill_body)?)
                    }
                };
                let body = self.bodies.decode_input(input, max_tokens, key, &raw);
                send(&self.client, decode.uri(), body, Some(&rid)).await?
            }
        };
        let response = self.check_status(response).await?;
        if self.stream {
            read_stream(
                response.into_body(),
                started,
                &mut sample,
                &mut scratch.gaps,
                self.answers,
            )
            .await?;
        } else {
            let body = read_full(response.into_body()).await?;
            sample.output_tokens = find_u64_field(&body, b"\"completion_tokens\"").unwrap_or(0);
            sample.prompt_tokens = find_u64_field(&body, b"\"prompt_tokens\"");
            sample.cached_tokens = find_u64_field(&body, b"\"cached_tokens\"");
            if self.answers {
                let v: serde_json::Value =
                    serde_json::from_slice(&body).map_err(|_| ErrorClass::Protocol)?;
                sample.answer = Some(crate::sse::generated_text(&v, false));
            }
        }
        sample.latency = started.elapsed();
        Ok(sample)
    }
}

async fn send(
    client: &HttpClient,
    uri: &Uri,
    body: Bytes,
    request_id: Option<&str>,
) -> Result<Response<Incoming>, ErrorClass> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(rid) = request_id {
        req = req.header("x-request-id", rid);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|_| ErrorClass::Protocol)?;
    client.request(req).await.map_err(|e| {
        if e.is_connect() {
            ErrorClass::Connect
        } else {
            ErrorClass::Closed
        }
    })
}

/// `GET uri`: status and (bounded) body, or why it failed.
pub async fn get(client: &HttpClient, uri: &str) -> Result<(u16, Bytes), String> {
    let uri: Uri = uri.parse().map_err(|_| format!("bad URL {uri}"))?;
    let req = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = read_full(resp.into_body())
        .await
        .map_err(|c| c.as_str().to_owned())?;
    Ok((status, body))
}

/// The first model id in `GET {base}/v1/models`.
pub async fn served_model(client: &HttpClient, base: &str) -> Result<String, String> {
    let b = base.trim().trim_end_matches('/');
    let b = b.strip_suffix("/v1").unwrap_or(b);
    let (status, body) = get(client, &format!("{b}/v1/models")).await?;
    if status != 200 {
        return Err(format!("HTTP {status}"));
    }
    let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| "no model listed".to_owned())
}

/// Bytes of an error body kept as the run's sample error.
const SAMPLE_ERROR_BYTES: usize = 300;

impl Requester {
    /// Passes a 2xx response through; otherwise drains its (bounded) body so the connection
    /// can be reused, keeps the first one as the run's sample error, and returns the class.
    async fn check_status(
        &self,
        resp: Response<Incoming>,
    ) -> Result<Response<Incoming>, ErrorClass> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = read_full(resp.into_body()).await.unwrap_or_default();
        if self.first_error.get().is_none() {
            let head = &body[..body.len().min(SAMPLE_ERROR_BYTES)];
            let _ = self
                .first_error
                .set(format!("{status}: {}", String::from_utf8_lossy(head)));
        }
        Err(ErrorClass::from_status(status.as_u16()))
    }
}

async fn read_full(body: Incoming) -> Result<Bytes, ErrorClass> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ErrorClass::Protocol),
        Err(_) => Err(ErrorClass::Truncated),
    }
}

async fn read_stream(
    mut body: Incoming,
    started: Instant,
    sample: &mut Sample,
    gaps: &mut Vec<u64>,
    answers: bool,
) -> Result<(), ErrorClass> {
    let mut reader = SseReader::default();
    if answers {
        reader.text = Some(String::new());
    }
    let mut last: Option<Instant> = None;
    let mut tokens = 0u64;
    let mut done = false;
    let mut error = false;
    gaps.clear();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ErrorClass::Truncated)?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        reader
            .feed(data, |ev| match ev {
                Event::Token => {
                    tokens += 1;
                    match last {
                        None => sample.ttft = Some(now.saturating_duration_since(started)),
                        Some(prev) => gaps.push(
                            u64::try_from(now.saturating_duration_since(prev).as_micros())
                                .unwrap_or(u64::MAX),
                        ),
                    }
                    last = Some(now);
                }
                Event::Done => done = true,
                Event::Error => error = true,
                Event::Other => {}
            })
            .map_err(|_| ErrorClass::Protocol)?;
        if error {
            return Err(ErrorClass::StreamError);
        }
    }
    if !done {
        return Err(ErrorClass::Truncated);
    }
    sample.output_tokens = reader.completion_tokens.unwrap_or(tokens);
    sample.prompt_tokens = reader.prompt_tokens;
    sample.cached_tokens = reader.cached_tokens;
    sample.answer = reader.text.take();
    sample.gaps_us = std::mem::take(gaps);
    Ok(())
}

#[derive(Deserialize)]
struct PrefillResponse<'a> {
    #[serde(borrow)]
    kv_transfer_params: Option<&'a RawValue>,
}

/// The decode leg's `kv_transfer_params` for shfs: the prefill's, verbatim except
/// `remote_host`, which becomes the prefill's host. No params is a protocol error here:
/// a baseline that silently recomputed the prompt would not be a PD baseline.
pub fn shfs_decode_params(prefill_body: &[u8], prefill_host: &str) -> Result<String, ErrorClass> {
    let resp: PrefillResponse<'_> =
        serde_json::from_slice(prefill_body).map_err(|_| ErrorClass::Protocol)?;
    let raw = resp.kv_transfer_params.ok_or(ErrorClass::Protocol)?;
    let mut params: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(raw.get()).map_err(|_| ErrorClass::Protocol)?;
    params.insert(
        "remote_host".to_owned(),
        serde_json::Value::String(prefill_host.to_owned()),
    );
    serde_json::to_string(&params).map_err(|_| ErrorClass::Protocol)
}

/// The decode leg's `disagg_prefill_resp` for nixl: the whole prefill response, trimmed.
pub fn nixl_decode_params(prefill_body: &[u8]) -> Result<String, ErrorClass> {
    let text = std::str::from_utf8(prefill_body).map_err(|_| ErrorClass::Protocol)?;
    let text = text.trim();
    // Must be a JSON object: it is spliced into the decode body as a value.
    let _: &RawValue = serde_json::from_str(text).map_err(|_| ErrorClass::Protocol)?;
    if !text.starts_with('{') {
        return Err(ErrorClass::Protocol);
    }
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_expose_host() {
        let e = Endpoint::new("http://127.0.0.1:8000/", "/v1/completions").expect("parse");
        assert_eq!(e.uri().to_string(), "http://127.0.0.1:8000/v1/completions");
        assert_eq!(e.host(), "127.0.0.1");
        let e = Endpoint::new("http://localhost:1/v1", "/v1/chat/completions").expect("parse");
        assert_eq!(e.uri().path(), "/v1/chat/completions");
        assert_eq!(e.host(), "localhost");
        let e = Endpoint::new("http://[::1]:9", "/v1/completions").expect("parse");
        assert_eq!(e.host(), "::1");
        assert!(Endpoint::new("https://x:1", "/v1/completions").is_err());
        assert!(Endpoint::new("not a url", "/v1/completions").is_err());
    }

    #[test]
    fn shfs_params_copy_verbatim_and_override_host() {
        let body = br#"{"id":"x","kv_transfer_params":{"remote_block_ids":[[3,1,2]],"remote_engine_id":"e","remote_host":"localhost","remote_port":5600,"do_remote_prefill":true}}"#;
        let out = shfs_decode_params(body, "127.0.0.9").expect("params");
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["remote_host"], "127.0.0.9");
        assert_eq!(v["remote_port"], 5600);
        assert_eq!(v["remote_block_ids"], serde_json::json!([[3, 1, 2]]));
        assert_eq!(v["do_remote_prefill"], true);
        assert_eq!(
            shfs_decode_params(br#"{"id":"x"}"#, "h"),
            Err(ErrorClass::Protocol)
        );
        assert_eq!(
            shfs_decode_params(br#"{"kv_transfer_params":null}"#, "h"),
            Err(ErrorClass::Protocol)
        );
        assert_eq!(
            shfs_decode_params(br#"{"kv_transfer_params":"str"}"#, "h"),
            Err(ErrorClass::Protocol)
        );
        assert_eq!(shfs_decode_params(b"nope", "h"), Err(ErrorClass::Protocol));
    }

    #[test]
    fn nixl_params_keep_bytes() {
        let body = b" {\"kv_transfer_params\":{\"a\":1},\"id\":9007199254740993}\n";
        assert_eq!(
            nixl_decode_params(body).expect("ok"),
            "{\"kv_transfer_params\":{\"a\":1},\"id\":9007199254740993}"
        );
        assert_eq!(nixl_decode_params(b"[1]"), Err(ErrorClass::Protocol));
        assert_eq!(nixl_decode_params(b"{"), Err(ErrorClass::Protocol));
    }
}
