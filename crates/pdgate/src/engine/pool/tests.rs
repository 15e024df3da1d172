//! Tests of the engine pool against small engines on loopback.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::*;

#[derive(Clone, Copy)]
enum Mode {
    /// Answers every request on a kept-alive connection.
    KeepAlive,
    /// Answers with `connection: close`, then closes.
    CloseAfterEach,
    /// Sends the head and one chunk of a stream, then waits for the client to leave.
    HoldStream,
    /// Sends the head and `BURST` chunks in one write, then waits for the client to leave.
    Burst,
    /// Answers on a kept-alive connection, then closes it.
    CloseWhenIdle,
}

const BURST: usize = 32;

/// A raw HTTP/1.1 engine on loopback that counts connections and records request heads.
struct Engine {
    authority: String,
    accepted: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<String>>>,
    _tasks: JoinSet<()>,
}

async fn engine(mode: Mode) -> Engine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let authority = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(AtomicUsize::new(0));
    let heads = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = JoinSet::new();
    let (a, c, h) = (accepted.clone(), closed.clone(), heads.clone());
    tasks.spawn(async move {
        let mut connections = JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            connections.spawn(serve(tcp, mode, c.clone(), h.clone()));
        }
    });
    Engine {
        authority,
        accepted,
        closed,
        heads,
        _tasks: tasks,
    }
}

async fn serve(
    mut tcp: TcpStream,
    mode: Mode,
    closed: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<String>>>,
) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = read_head(&mut tcp, &mut buf).await else {
            closed.fetch_add(1, Ordering::SeqCst);
            return;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        buf.drain(..end);
        heads.lock().unwrap().push(head);
        let burst;
        let reply: &[u8] = match mode {
            Mode::KeepAlive | Mode::CloseWhenIdle => {
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            }
            Mode::CloseAfterEach => {
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
            }
            Mode::HoldStream => {
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
            }
            Mode::Burst => {
                let mut all = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                for i in 0..BURST {
                    let event = format!("data: {i:02}\n\n");
                    all.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
                }
                burst = all;
                &burst
            }
        };
        tcp.write_all(reply).await.unwrap();
        match mode {
            Mode::KeepAlive => {}
            Mode::CloseAfterEach => return,
            Mode::CloseWhenIdle => {
                // After the client has read the answer and pooled the connection.
                tokio::time::sleep(Duration::from_millis(200)).await;
                drop(tcp);
                closed.fetch_add(1, Ordering::SeqCst);
                return;
            }
            Mode::HoldStream | Mode::Burst => {
                let mut rest = [0u8; 64];
                while matches!(tcp.read(&mut rest).await, Ok(n) if n > 0) {}
                closed.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
    }
}

/// Reads up to the end of a request head (requests here have no body); `None` on EOF.
async fn read_head(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        let mut chunk = [0u8; 1024];
        match tcp.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn pool(idle_timeout: Duration, max_idle_per_engine: usize) -> EnginePool {
    EnginePool::new(PoolConfig {
        connect_timeout: Duration::from_secs(5),
        idle_timeout,
        max_idle_per_engine,
    })
}

fn get(authority: &str) -> Request<Full<Bytes>> {
    Request::get(format!("http://{authority}/v1/models?x=1"))
        .body(Full::new(Bytes::new()))
        .unwrap()
}

async fn read_all(pool: &EnginePool, authority: &str) -> Bytes {
    let response = pool.request(get(authority)).await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap().to_bytes()
}

/// A streamed response from `engine` on a new pool, and its first frame.
async fn first_frame(engine: &Engine) -> (EnginePool, EngineBody, Bytes) {
    let pool = pool(Duration::from_secs(60), 16);
    let mut body = pool
        .request(get(&engine.authority))
        .await
        .unwrap()
        .into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    (pool, body, first)
}

async fn eventually(what: &str, check: impl Fn() -> bool) {
    for _ in 0..500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what} did not happen within 5 s");
}

#[tokio::test]
async fn a_connection_read_to_the_end_is_reused_with_origin_form_and_host() {
    let engine = engine(Mode::KeepAlive).await;
    let pool = pool(Duration::from_secs(60), 16);
    for _ in 0..3 {
        assert_eq!(read_all(&pool, &engine.authority).await, "ok");
    }
    assert_eq!(engine.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(pool.idle_connections(&engine.authority), 1);
    let head = engine.heads.lock().unwrap()[0].to_ascii_lowercase();
    assert!(
        head.starts_with("get /v1/models?x=1 http/1.1\r\n"),
        "{head}"
    );
    assert!(
        head.contains(&format!("\r\nhost: {}\r\n", engine.authority)),
        "{head}"
    );
}

#[tokio::test]
async fn a_body_dropped_before_its_end_closes_its_connection() {
    let engine = engine(Mode::HoldStream).await;
    let (pool, body, first) = first_frame(&engine).await;
    assert_eq!(first, "hello");
    drop(body);
    eventually("the engine seeing the connection close", || {
        engine.closed.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(pool.idle_connections(&engine.authority), 0);
}

#[tokio::test]
async fn connections_the_engine_closes_are_replaced() {
    let engine = engine(Mode::CloseAfterEach).await;
    let pool = pool(Duration::from_secs(60), 16);
    for _ in 0..20 {
        assert_eq!(read_all(&pool, &engine.authority).await, "ok");
    }
    assert_eq!(engine.accepted.load(Ordering::SeqCst), 20);
}

#[tokio::test]
async fn idle_timeout_and_idle_limit_close_connections() {
    let engine = engine(Mode::KeepAlive).await;
    let short = pool(Duration::from_millis(50), 16);
    read_all(&short, &engine.authority).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    read_all(&short, &engine.authority).await;
    assert_eq!(engine.accepted.load(Ordering::SeqCst), 2);
    let none = pool(Duration::from_secs(60), 0);
    read_all(&none, &engine.authority).await;
    read_all(&none, &engine.authority).await;
    assert_eq!(engine.accepted.load(Ordering::SeqCst), 4);
    assert_eq!(none.idle_connections(&engine.authority), 0);
    // Both connections of the no-idle pool were closed.
    eventually("the engine seeing both connections close", || {
        engine.closed.load(Ordering::SeqCst) >= 3
    })
    .await;
}

#[test]
fn socket_targets_take_bare_ipv6_literals_and_default_ports() {
    let target = |a: &str| {
        let a: Authority = a.parse().unwrap();
        let (host, port) = socket_target(&a, false);
        (host.to_string(), port)
    };
    assert_eq!(target("[fd00::2]:8001"), ("fd00::2".to_string(), 8001));
    assert_eq!(target("10.0.0.1:8000"), ("10.0.0.1".to_string(), 8000));
    assert_eq!(
        target("prefill-0.engines"),
        ("prefill-0.engines".to_string(), 80)
    );
    let a: Authority = "prefill-0.engines".parse().unwrap();
    assert_eq!(socket_target(&a, true).1, 443);
}

#[tokio::test]
async fn refused_connections_and_bad_targets_are_told_apart() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let pool = pool(Duration::from_secs(60), 16);
    let err = pool
        .request(get(&format!("127.0.0.1:{port}")))
        .await
        .unwrap_err();
    assert!(err.is_connect(), "{err}");
    let https = Request::get("https://127.0.0.1:1/")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = pool.request(https).await.unwrap_err();
    assert!(matches!(err, PoolError::Target(_)), "{err}");
}

#[tokio::test]
async fn events_already_read_are_handed_over_in_one_wake_up() {
    let engine = engine(Mode::Burst).await;
    let (_pool, mut body, first) = first_frame(&engine).await;
    assert_eq!(first, "data: 00\n\n");
    // The rest came in the same read: each is there at once, without the task waking again
    // (a connection driven by a task of its own hands over one chunk per wake-up).
    let ready = std::future::poll_fn(|cx| {
        let mut ready = Vec::new();
        while let Poll::Ready(Some(Ok(frame))) = Pin::new(&mut body).poll_frame(cx) {
            ready.push(frame.into_data().unwrap());
        }
        Poll::Ready(ready)
    })
    .await;
    assert_eq!(ready.len(), BURST - 1);
    assert_eq!(ready[BURST - 2], format!("data: {:02}\n\n", BURST - 1));
    drop(body);
    eventually("the engine seeing the connection close", || {
        engine.closed.load(Ordering::SeqCst) == 1
    })
    .await;
}

#[tokio::test]
async fn a_connection_the_engine_closed_while_idle_is_not_used() {
    let engine = engine(Mode::CloseWhenIdle).await;
    let pool = pool(Duration::from_secs(60), 16);
    assert_eq!(read_all(&pool, &engine.authority).await, "ok");
    assert_eq!(pool.idle_connections(&engine.authority), 1);
    eventually("the engine closing its connection", || {
        engine.closed.load(Ordering::SeqCst) == 1
    })
    .await;
    // Nobody polls an idle connection; taking it notices the close, and a new one is opened.
    assert_eq!(read_all(&pool, &engine.authority).await, "ok");
    assert_eq!(engine.accepted.load(Ordering::SeqCst), 2);
}
