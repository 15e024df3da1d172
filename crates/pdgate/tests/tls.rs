//! TLS on both sides, with certificates made in the test (rcgen): the client listener serves
//! HTTPS with HTTP/1.1 or HTTP/2 chosen by ALPN and picks up a renewed certificate without a
//! restart (and ignores a broken one); `https://` engines are verified against the configured CA
//! and shown the gateway's client certificate (mTLS). The engines are pdsim behind a TLS
//! terminator written here (pdsim itself speaks plain HTTP).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Fleet, completion, metric, sim, start_unready, text_of};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pdsim::{Connector, Role};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// A self-signed certificate for `localhost` and 127.0.0.1, as PEM files in a fresh directory.
struct Pem {
    dir: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    der: CertificateDer<'static>,
}

impl Pem {
    fn new(label: &str) -> Pem {
        let dir = std::env::temp_dir().join(format!("pdgate-tls-{label}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = Pem {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            dir,
            der: CertificateDer::from(Vec::new()),
        };
        pem.renew()
    }

    /// A new key and certificate in the same files.
    fn renew(mut self) -> Pem {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
            .unwrap();
        // Key first: a reader that sees the new certificate with the old key refuses the pair.
        std::fs::write(&self.key, made.signing_key.serialize_pem()).unwrap();
        std::fs::write(&self.cert, made.cert.pem()).unwrap();
        self.der = made.cert.der().clone();
        self
    }

    fn key_der(&self) -> PrivateKeyDer<'static> {
        use rustls::pki_types::pem::PemObject;
        PrivateKeyDer::from_pem_file(&self.key).unwrap()
    }
}

impl Drop for Pem {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(trusted: &CertificateDer<'static>) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    roots
}

/// A TLS client that trusts only `trusted` and offers `alpn`.
fn client(trusted: &CertificateDer<'static>, alpn: &[u8]) -> TlsConnector {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(trusted))
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    TlsConnector::from(Arc::new(config))
}

/// One completion over TLS to `fleet`'s gateway; the status, body and the protocol chosen.
async fn completion_over_tls(
    fleet: &Fleet,
    tls: &TlsConnector,
) -> std::io::Result<(u16, String, Option<Vec<u8>>)> {
    let tcp = TcpStream::connect(fleet.gateway.addr()).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let stream = tokio::time::timeout(Duration::from_secs(10), tls.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))??;
    let alpn = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let body = Full::new(Bytes::from(completion(false).to_string()));
    let io = TokioIo::new(stream);
    let response = if alpn.as_deref() == Some(b"h2".as_slice()) {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        let request = http::Request::post("https://localhost/v1/completions")
            .header("content-type", "application/json")
            .body(body)
            .unwrap();
        sender.send_request(request).await
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        let request = http::Request::post("/v1/completions")
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(body)
            .unwrap();
        sender.send_request(request).await
    }
    .map_err(std::io::Error::other)?;
    let status = response.status().as_u16();
    let bytes = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
        .await
        .map_err(|_| std::io::Error::other("body timed out"))?
        .map_err(std::io::Error::other)?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned(), alpn))
}

async fn https_fleet(pem: &Pem, reload: Duration) -> Fleet {
    let (cert, key) = (pem.cert.clone(), pem.key.clone());
    start_unready(
        vec![sim(Role::Prefill, Connector::Shfs)],
        vec![sim(Role::Decode, Connector::Shfs)],
        move |c| {
            c.security.tls_cert = Some(cert);
            c.security.tls_key = Some(key);
            c.security.reload_interval = reload;
            // Plain HTTP for /metrics, which the tests read beside the TLS listener.
            c.security.admin_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_serves_https_with_http1_and_http2_by_alpn() {
    let pem = Pem::new("alpn");
    let fleet = https_fleet(&pem, Duration::from_secs(5)).await;
    assert!(fleet.url("/").starts_with("https://"), "{}", fleet.url("/"));
    for alpn in [b"h2".as_slice(), b"http/1.1".as_slice()] {
        let (status, body, chosen) = completion_over_tls(&fleet, &client(&pem.der, alpn))
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(!text_of(&body).is_empty(), "{body}");
        assert_eq!(chosen.as_deref(), Some(alpn));
    }
    assert_eq!(fleet.prefill[0].stats().responses_ok, 2);
    // Plain HTTP on the TLS port gets no answer, and the listener stays up.
    let plain = reqwest::Client::new()
        .post(fleet.url("/v1/completions").replace("https://", "http://"))
        .json(&completion(false))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(plain.is_err(), "{plain:?}");
    // A client that trusts another certificate refuses the handshake.
    let other = Pem::new("other");
    assert!(
        completion_over_tls(&fleet, &client(&other.der, b"h2"))
            .await
            .is_err()
    );
    let (status, _, _) = completion_over_tls(&fleet, &client(&pem.der, b"h2"))
        .await
        .unwrap();
    assert_eq!(status, 200);
}

/// `pdgate_reloads_total{file="tls",result}`, read from the admin listener.
async fn tls_reloads(fleet: &Fleet, result: &str) -> f64 {
    let admin = fleet.gateway.admin_addr().expect("admin listener");
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric(
        &text,
        &format!("pdgate_reloads_total{{file=\"tls\",result=\"{result}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let pem = Pem::new("renew");
    let old = pem.der.clone();
    let fleet = https_fleet(&pem, Duration::from_millis(50)).await;
    let (status, _, _) = completion_over_tls(&fleet, &client(&old, b"h2"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let pem = pem.renew();
    let renewed = client(&pem.der, b"h2");
    let mut served = false;
    for _ in 0..200 {
        if let Ok((200, _, _)) = completion_over_tls(&fleet, &renewed).await {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "the renewed certificate was not served within 10 s");
    assert!(
        completion_over_tls(&fleet, &client(&old, b"h2"))
            .await
            .is_err(),
        "the old certificate is still served"
    );
    assert!(tls_reloads(&fleet, "applied").await >= 1.0);
    // A half-written renewal: once pdgate has read and rejected it, the loaded certificate stays.
    std::fs::write(&pem.cert, "-----BEGIN CERTIFICATE-----\nAAAA\n").unwrap();
    let mut rejected = false;
    for _ in 0..200 {
        if tls_reloads(&fleet, "rejected").await >= 1.0 {
            rejected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rejected, "the broken certificate was not read within 10 s");
    let (status, _, _) = completion_over_tls(&fleet, &renewed).await.unwrap();
    assert_eq!(status, 200);
    assert!(
        completion_over_tls(&fleet, &client(&old, b"h2"))
            .await
            .is_err(),
        "a rejected reload brought back no other certificate"
    );
}

/// Terminates TLS for the engine at `upstream`, requiring a client certificate issued by
/// `client_ca`; counts the handshakes that succeeded.
struct Terminator {
    url: String,
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Terminator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn terminator(upstream: String, server: &Pem, client_ca: &CertificateDer<'static>) -> Terminator {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(client_ca)),
        provider(),
    )
    .build()
    .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![server.der.clone()], server.key_der())
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let port = std_listener.local_addr().unwrap().port();
    let listener = TcpListener::from_std(std_listener).unwrap();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let counted = handshakes.clone();
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, upstream, counted) =
                (acceptor.clone(), upstream.clone(), counted.clone());
            connections.spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                let Ok(mut engine) = TcpStream::connect(upstream.as_str()).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut engine).await;
            });
        }
    });
    Terminator {
        url: format!("https://127.0.0.1:{port}"),
        handshakes,
        task,
    }
}

fn write_pem(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_engines_are_verified_and_shown_the_client_certificate() {
    let engine_cert = Pem::new("engine");
    let client_cert = Pem::new("client");
    let ca_dir = Pem::new("ca-bundle");
    // The CA bundle the gateway verifies engines with: the engines' certificate.
    let bundle = write_pem(
        &ca_dir.dir,
        "engines.pem",
        &std::fs::read_to_string(&engine_cert.cert).unwrap(),
    );
    for with_client_cert in [true, false] {
        let mut terminators = Vec::new();
        let (engine, client, bundle2) = (&engine_cert, &client_cert, bundle.clone());
        let fleet = start_unready(
            vec![sim(Role::Prefill, Connector::Shfs)],
            vec![sim(Role::Decode, Connector::Shfs)],
            |c| {
                for ep in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
                    let upstream = ep.url.trim_start_matches("http://").to_string();
                    let t = terminator(upstream, engine, &client.der);
                    ep.url = t.url.clone();
                    terminators.push(t);
                }
                c.security.engine_ca_file = Some(bundle2);
                if with_client_cert {
                    c.security.engine_client_cert = Some(client.cert.clone());
                    c.security.engine_client_key = Some(client.key.clone());
                }
            },
        )
        .await;
        // The health checks reach the engines over TLS too (with the client certificate).
        fleet.wait_ready(with_client_cert).await;
        let response = reqwest::Client::new()
            .post(fleet.url("/v1/completions"))
            .json(&completion(false))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        let handshakes: usize = terminators
            .iter()
            .map(|t| t.handshakes.load(Ordering::SeqCst))
            .sum();
        if with_client_cert {
            assert_eq!(status, 200, "{body}");
            assert!(!text_of(&body).is_empty(), "{body}");
            assert!(
                handshakes >= 2,
                "TLS connections to both engines: {handshakes}"
            );
            assert_eq!(fleet.decode[0].stats().responses_ok, 1);
        } else {
            // The engines refuse a gateway without a client certificate: no engine is reached.
            assert_eq!(status, 502, "{body}");
            assert_eq!(handshakes, 0);
            assert_eq!(fleet.decode[0].stats().responses_ok, 0);
        }
    }
}
