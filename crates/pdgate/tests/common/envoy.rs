//! A client that speaks ext_proc to pdgate the way Envoy does (no Envoy can be installed
//! here): request headers, then the buffered body with `end_of_stream`, the mutations applied,
//! the request forwarded over plain HTTP to the destination named, then the response headers
//! and the response body chunk by chunk through the processor, each message answered within a
//! per-message timeout (Envoy's `message_timeout`). It keeps how long the processor took.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as ProtoHeaders, HeaderValue as ProtoHeader, Metadata,
};
pub use envoy_types::pb::envoy::service::ext_proc::v3 as ep;
use envoy_types::pb::google::protobuf::{Struct, value};
use ep::external_processor_client::ExternalProcessorClient;
pub use ep::processing_request::Request as Req;
pub use ep::processing_response::Response as Resp;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

/// Envoy's side of one ext_proc stream: each message sent waits for its answer within the
/// per-message timeout.
pub struct Stream {
    pub tx: Option<tokio::sync::mpsc::Sender<ep::ProcessingRequest>>,
    pub rx: tonic::Streaming<ep::ProcessingResponse>,
    pub timeout: Duration,
    pub metadata: Option<Metadata>,
    /// Time spent waiting for the processor's answers.
    pub waited: Duration,
}

/// Why a message got no usable answer.
#[derive(Debug)]
pub enum NoAnswer {
    /// Not within the per-message timeout.
    TimedOut,
    /// The processor ended the stream (with a gRPC status, or none).
    Closed(Option<tonic::Status>),
}

impl Stream {
    pub async fn open(addr: SocketAddr, timeout: Duration, metadata: Option<Metadata>) -> Stream {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("connect to the processor");
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let outbound = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let rx = tokio::time::timeout(Duration::from_secs(10), client.process(outbound))
            .await
            .expect("stream opened in time")
            .expect("stream opened")
            .into_inner();
        Stream {
            tx: Some(tx),
            rx,
            timeout,
            metadata,
            waited: Duration::ZERO,
        }
    }

    pub async fn send(&mut self, request: Req) -> Result<ep::ProcessingResponse, NoAnswer> {
        let message = ep::ProcessingRequest {
            // Envoy forwards the configured metadata namespaces with the first message.
            metadata_context: self.metadata.take(),
            request: Some(request),
            ..ep::ProcessingRequest::default()
        };
        let tx = self.tx.as_ref().expect("stream open");
        let sent = Instant::now();
        tx.send(message).await.map_err(|_| NoAnswer::Closed(None))?;
        let answer = tokio::time::timeout(self.timeout, self.rx.message()).await;
        self.waited += sent.elapsed();
        match answer {
            Err(_) => Err(NoAnswer::TimedOut),
            Ok(Ok(Some(answer))) => Ok(answer),
            Ok(Ok(None)) => Err(NoAnswer::Closed(None)),
            Ok(Err(status)) => Err(NoAnswer::Closed(Some(status))),
        }
    }
}

pub fn proto_headers(pseudo: &[(&str, &str)], headers: &HeaderMap) -> ProtoHeaders {
    let one = |k: &str, v: &[u8]| ProtoHeader {
        key: k.to_string(),
        value: String::new(),
        raw_value: v.to_vec(),
    };
    let mut out: Vec<ProtoHeader> = pseudo.iter().map(|(k, v)| one(k, v.as_bytes())).collect();
    out.extend(headers.iter().map(|(k, v)| one(k.as_str(), v.as_bytes())));
    ProtoHeaders { headers: out }
}

/// Applies a header mutation as Envoy does (set replaces, remove removes).
pub fn apply(headers: &mut HeaderMap, mutation: Option<&ep::HeaderMutation>) {
    let Some(m) = mutation else { return };
    for option in &m.set_headers {
        let h = option.header.as_ref().expect("a header to set");
        let raw = if h.raw_value.is_empty() {
            h.value.as_bytes().to_vec()
        } else {
            h.raw_value.clone()
        };
        headers.insert(
            HeaderName::try_from(h.key.as_str()).expect("header name"),
            HeaderValue::from_bytes(&raw).expect("header value"),
        );
    }
    for name in &m.remove_headers {
        headers.remove(name.as_str());
    }
}

pub fn replaced_body(common: &ep::CommonResponse) -> Option<Bytes> {
    match common.body_mutation.as_ref()?.mutation.as_ref()? {
        ep::body_mutation::Mutation::Body(b) => Some(Bytes::from(b.clone())),
        ep::body_mutation::Mutation::ClearBody(true) => Some(Bytes::new()),
        other => panic!("unexpected body mutation {other:?}"),
    }
}

/// What the client got instead of a forwarded request.
#[derive(Debug)]
pub enum Refused {
    /// An immediate response: the client gets it as it is.
    Immediate {
        status: u16,
        headers: HeaderMap,
        body: Value,
    },
    /// A message went unanswered within the per-message timeout (Envoy then fails the request).
    TimedOut,
    /// The processor closed the stream.
    Closed(Option<tonic::Status>),
}

impl From<NoAnswer> for Refused {
    fn from(n: NoAnswer) -> Self {
        match n {
            NoAnswer::TimedOut => Refused::TimedOut,
            NoAnswer::Closed(s) => Refused::Closed(s),
        }
    }
}

pub fn immediate(i: ep::ImmediateResponse) -> Refused {
    let mut headers = HeaderMap::new();
    apply(&mut headers, i.headers.as_ref());
    Refused::Immediate {
        status: u16::try_from(i.status.expect("status").code).expect("code"),
        headers,
        body: serde_json::from_slice(&i.body).expect("a JSON error body"),
    }
}

/// A request the processor decided: where it goes, and as what.
pub struct Decided {
    pub stream: Stream,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub metadata: Option<Struct>,
    /// Time the processor took for the request's messages (headers and body).
    pub decide_waited: Duration,
}

impl Decided {
    /// The destination named by the header.
    pub fn destination(&self) -> String {
        self.headers["x-gateway-destination-endpoint"]
            .to_str()
            .unwrap()
            .to_string()
    }

    /// The destination named in the `envoy.lb` metadata.
    pub fn metadata_destination(&self) -> Option<String> {
        let lb = self.metadata.as_ref()?.fields.get("envoy.lb")?;
        let Some(value::Kind::StructValue(s)) = &lb.kind else {
            return None;
        };
        match &s.fields.get("x-gateway-destination-endpoint")?.kind {
            Some(value::Kind::StringValue(v)) => Some(v.clone()),
            _ => None,
        }
    }

    /// Envoy's upstream request: the mutated headers and body, to the destination.
    pub async fn forward(&self, http: &reqwest::Client) -> reqwest::Response {
        let mut headers = self.headers.clone();
        headers.remove(http::header::CONTENT_LENGTH);
        headers.remove(http::header::HOST);
        http.post(format!("http://{}{}", self.destination(), self.path))
            .headers(headers)
            .body(self.body.clone())
            .send()
            .await
            .expect("the destination answered")
    }

    /// The response head through the processor: its headers as the client gets them.
    pub async fn head(&mut self, r: &reqwest::Response) -> Result<HeaderMap, Refused> {
        let mut headers = r.headers().clone();
        let status = r.status().as_u16().to_string();
        let proto = proto_headers(&[(":status", &status)], &headers);
        let answer = self
            .stream
            .send(Req::ResponseHeaders(ep::HttpHeaders {
                headers: Some(proto),
                end_of_stream: false,
                ..ep::HttpHeaders::default()
            }))
            .await?;
        match answer.response {
            Some(Resp::ResponseHeaders(h)) => {
                let common = h.response.unwrap_or_default();
                apply(&mut headers, common.header_mutation.as_ref());
                Ok(headers)
            }
            Some(Resp::ImmediateResponse(i)) => Err(immediate(i)),
            other => panic!("response headers answered with {other:?}"),
        }
    }

    /// One response body chunk through the processor: what the client gets.
    pub async fn chunk(&mut self, data: Bytes, end_of_stream: bool) -> Result<Bytes, Refused> {
        let answer = self
            .stream
            .send(Req::ResponseBody(ep::HttpBody {
                body: data.to_vec(),
                end_of_stream,
                ..ep::HttpBody::default()
            }))
            .await?;
        match answer.response {
            Some(Resp::ResponseBody(b)) => {
                let common = b.response.unwrap_or_default();
                Ok(replaced_body(&common).unwrap_or(data))
            }
            Some(Resp::ImmediateResponse(i)) => Err(immediate(i)),
            other => panic!("a response body answered with {other:?}"),
        }
    }
}

/// A request that went through: what the client got and what the engine was sent.
pub struct Relayed {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
    pub destination: String,
    pub metadata_destination: Option<String>,
    pub target_pod: String,
    pub prefiller: Option<String>,
    pub sent_body: Bytes,
    /// Time the processor took to answer every message.
    pub processor: Duration,
    /// Of it, the time it took for the request's headers and body (the decision).
    pub decide: Duration,
    /// Time of the forwarded request (the decode leg), head to the body's end.
    pub forward: Duration,
}

/// Envoy with the ext_proc filter in front of the engines.
pub struct Envoy {
    pub addr: SocketAddr,
    pub message_timeout: Duration,
    pub http: reqwest::Client,
}

impl Envoy {
    /// Envoy with pdgate's ext_proc service at `addr`.
    pub fn new(addr: SocketAddr) -> Envoy {
        Envoy {
            addr,
            // Far above any prefill here; one test lowers it.
            message_timeout: Duration::from_secs(10),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    /// Request headers, then the buffered body: the processor's decision.
    pub async fn decide(
        &self,
        path: &str,
        body: &Value,
        extra: &[(&str, &str)],
        metadata: Option<Metadata>,
    ) -> Result<Decided, Refused> {
        let mut stream = Stream::open(self.addr, self.message_timeout, metadata).await;
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        // Envoy's own request id.
        let id = uuid::Uuid::new_v4().to_string();
        headers.insert("x-request-id", HeaderValue::from_str(&id).unwrap());
        for (k, v) in extra {
            headers.insert(
                HeaderName::try_from(*k).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let pseudo = [
            (":method", "POST"),
            (":path", path),
            (":authority", "gateway.example"),
            (":scheme", "http"),
        ];
        let answer = stream
            .send(Req::RequestHeaders(ep::HttpHeaders {
                headers: Some(proto_headers(&pseudo, &headers)),
                end_of_stream: false,
                ..ep::HttpHeaders::default()
            }))
            .await?;
        match answer.response {
            Some(Resp::RequestHeaders(h)) => {
                apply(
                    &mut headers,
                    h.response.unwrap_or_default().header_mutation.as_ref(),
                );
            }
            Some(Resp::ImmediateResponse(i)) => return Err(immediate(i)),
            other => panic!("request headers answered with {other:?}"),
        }
        let sent = Bytes::from(serde_json::to_vec(body).unwrap());
        let answer = stream
            .send(Req::RequestBody(ep::HttpBody {
                body: sent.to_vec(),
                end_of_stream: true,
                ..ep::HttpBody::default()
            }))
            .await?;
        let (common, metadata) = match answer.response {
            Some(Resp::RequestBody(b)) => (b.response.unwrap_or_default(), answer.dynamic_metadata),
            Some(Resp::ImmediateResponse(i)) => return Err(immediate(i)),
            other => panic!("the request body answered with {other:?}"),
        };
        apply(&mut headers, common.header_mutation.as_ref());
        let body = replaced_body(&common).unwrap_or(sent);
        if let Some(len) = headers.get("content-length") {
            assert_eq!(len.to_str().unwrap(), body.len().to_string());
        }
        Ok(Decided {
            decide_waited: stream.waited,
            stream,
            path: path.to_string(),
            headers,
            body,
            metadata,
        })
    }

    /// The whole request as Envoy carries it.
    pub async fn request(
        &self,
        path: &str,
        body: &Value,
        extra: &[(&str, &str)],
        metadata: Option<Metadata>,
    ) -> Result<Relayed, Refused> {
        let mut decided = self.decide(path, body, extra, metadata).await?;
        let forwarded = Instant::now();
        let mut r = decided.forward(&self.http).await;
        let status = r.status().as_u16();
        let headers = decided.head(&r).await?;
        let mut out = Vec::new();
        while let Some(chunk) = r.chunk().await.expect("the destination's body") {
            out.extend_from_slice(&decided.chunk(chunk, false).await?);
        }
        out.extend_from_slice(&decided.chunk(Bytes::new(), true).await?);
        let processor = decided.stream.waited;
        let forward = forwarded
            .elapsed()
            .saturating_sub(processor - decided.decide_waited);
        let header = |name: &str| {
            decided
                .headers
                .get(name)
                .map(|v| v.to_str().unwrap().to_string())
        };
        Ok(Relayed {
            status,
            headers,
            body: String::from_utf8(out).unwrap(),
            destination: decided.destination(),
            metadata_destination: decided.metadata_destination(),
            target_pod: header("target-pod").expect("target-pod"),
            prefiller: header("x-prefiller-host-port"),
            sent_body: decided.body.clone(),
            processor,
            decide: decided.decide_waited,
            forward,
        })
    }
}
