//! Error classification and bounded termination against a tiny scripted server on port 0.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use pdbench::{Config, Load, Report, Target};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A server whose behaviour is chosen by the first path segment: `/<mode>/v1/completions`.
struct Scripted {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const TOKEN: &str = "data: {\"choices\":[{\"index\":0,\"text\":\" t\"}]}\n\n";

async fn handle(Path(mode): Path<String>) -> Response {
    let sse = |body: String| {
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from(body))
            .map(IntoResponse::into_response)
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    };
    match mode.as_str() {
        "ok" => (
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"choices":[{"text":"a b"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
        )
            .into_response(),
        "e500" => (
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}"#,
        )
            .into_response(),
        "e429" => StatusCode::TOO_MANY_REQUESTS.into_response(),
        "stream_ok" => sse(format!("{TOKEN}{TOKEN}{TOKEN}data: [DONE]\n\n")),
        "stream_error" => sse(format!(
            "{TOKEN}data: {{\"error\":{{\"message\":\"kv load failed\",\"code\":500}}}}\n\n"
        )),
        "stream_truncated" => sse(format!("{TOKEN}{TOKEN}")),
        "bad_json" => "not json".into_response(),
        // Never answers; the client's timeout must end the request.
        _ => {
            std::future::pending::<()>().await;
            StatusCode::OK.into_response()
        }
    }
}

async fn scripted() -> Scripted {
    let app = Router::new()
        .route("/{mode}/v1/completions", post(handle))
        .route("/{mode}/v1/chat/completions", post(handle));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Scripted { addr, task }
}

fn cfg(server: &Scripted, mode: &str, stream: bool) -> Config {
    let mut c = Config::new(Target::Url(format!("http://{}/{mode}", server.addr)));
    c.stream = stream;
    c.load = Load::Closed { concurrency: 3 };
    c.requests = Some(9);
    c.prompt_len = pdbench::dist::Dist::Fixed(3);
    c.timeout = Duration::from_secs(20);
    c
}

async fn run(c: &Config) -> Report {
    tokio::time::timeout(
        Duration::from_secs(60),
        pdbench::run(c, CancellationToken::new()),
    )
    .await
    .expect("run terminates")
    .expect("run starts")
}

fn only(r: &Report, class: &str, n: u64) {
    assert_eq!(r.ok, 0, "{r}");
    assert_eq!(r.errors, n, "{r}");
    assert_eq!(r.errors_by_class.get(class), Some(&n), "{r}");
    assert_eq!(r.errors_by_class.len(), 1, "{r}");
}

#[tokio::test]
async fn successes_are_counted_with_usage() {
    let s = scripted().await;
    let r = run(&cfg(&s, "ok", false)).await;
    assert_eq!(r.ok, 9, "{r}");
    assert_eq!(r.output_tokens, 18);
    let r = run(&cfg(&s, "stream_ok", true)).await;
    assert_eq!(r.ok, 9, "{r}");
    assert_eq!(
        r.output_tokens, 27,
        "no usage chunk: token events are counted"
    );
    assert_eq!(r.itl_ms.expect("gaps").count, 18);
}

#[tokio::test]
async fn errors_are_classified() {
    let s = scripted().await;
    let r = run(&cfg(&s, "e500", false)).await;
    only(&r, "http_5xx", 9);
    assert_eq!(
        r.sample_error.as_deref(),
        Some(
            r#"500 Internal Server Error: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}"#
        ),
        "status and body of the first failure"
    );
    only(&run(&cfg(&s, "e429", true)).await, "http_4xx", 9);
    only(
        &run(&cfg(&s, "stream_error", true)).await,
        "stream_error",
        9,
    );
    only(
        &run(&cfg(&s, "stream_truncated", true)).await,
        "truncated",
        9,
    );
    // 404 for an unknown path is a status error too.
    let mut c = cfg(&s, "ok", false);
    c.target = Target::Url(format!("http://{}/ok/extra", s.addr));
    only(&run(&c).await, "http_4xx", 9);
}

#[tokio::test]
async fn direct_mode_needs_kv_params() {
    let s = scripted().await;
    let mut c = cfg(&s, "ok", false);
    c.target = Target::Direct {
        prefill: format!("http://{}/ok", s.addr),
        decode: format!("http://{}/ok", s.addr),
        connector: pdbench::DirectConnector::Shfs,
    };
    only(&run(&c).await, "protocol", 9);
    c.target = Target::Direct {
        prefill: format!("http://{}/bad_json", s.addr),
        decode: format!("http://{}/ok", s.addr),
        connector: pdbench::DirectConnector::Nixl,
    };
    only(&run(&c).await, "protocol", 9);
    c.target = Target::Direct {
        prefill: format!("http://{}/e500", s.addr),
        decode: format!("http://{}/ok", s.addr),
        connector: pdbench::DirectConnector::Shfs,
    };
    only(&run(&c).await, "http_5xx", 9);
}

#[tokio::test]
async fn hung_server_is_bounded_by_the_request_timeout() {
    let s = scripted().await;
    let mut c = cfg(&s, "hang", true);
    c.timeout = Duration::from_millis(200);
    c.requests = Some(6);
    only(&run(&c).await, "timeout", 6);

    // Open loop against a hung server: the in-flight cap turns extra arrivals into overflow.
    let mut c = cfg(&s, "hang", false);
    c.timeout = Duration::from_millis(300);
    c.load = Load::Open {
        rate: 1000.0,
        max_in_flight: 2,
    };
    c.requests = Some(20);
    let r = run(&c).await;
    assert_eq!(r.requests, 20, "{r}");
    assert_eq!(r.ok, 0, "{r}");
    let timeouts = r.errors_by_class.get("timeout").copied().unwrap_or(0);
    let overflow = r.errors_by_class.get("overflow").copied().unwrap_or(0);
    assert_eq!(timeouts + overflow, 20, "{r}");
    assert!(overflow >= 1, "{r}");
}

#[tokio::test]
async fn cancellation_ends_a_run_early() {
    let s = scripted().await;
    let mut c = cfg(&s, "hang", true);
    c.timeout = Duration::from_secs(3600);
    c.requests = Some(100);
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        trigger.cancel();
    });
    let r = tokio::time::timeout(Duration::from_secs(60), pdbench::run(&c, cancel))
        .await
        .expect("cancelled run returns")
        .expect("run starts");
    killer.await.expect("killer");
    assert!(r.cancelled, "{r}");
    assert_eq!(r.ok, 0);
}

#[tokio::test]
async fn refused_connections_are_connect_errors() {
    // Bind then drop a listener to get a port with nothing behind it.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut c = Config::new(Target::Url(format!("http://127.0.0.1:{port}")));
    c.requests = Some(4);
    c.timeout = Duration::from_secs(20);
    only(&run(&c).await, "connect", 4);
}

#[tokio::test]
async fn connections_closed_before_a_response_are_closed_errors() {
    // Accepts, reads the request, and hangs up without answering.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut sock, &mut buf).await;
            drop(sock);
        }
    });
    let mut c = Config::new(Target::Url(format!("http://{addr}")));
    c.requests = Some(4);
    c.timeout = Duration::from_secs(20);
    only(&run(&c).await, "closed", 4);
    task.abort();
}
