//! TLS on both sides of the gateway (rustls, the `ring` provider).
//!
//! - Clients: `security.tls_cert` and `security.tls_key` (PEM) make the API listener serve
//!   HTTPS, HTTP/1.1 and HTTP/2 chosen by ALPN. The pair is re-read when either file changes
//!   (polled); a pair that does not load keeps the previous certificate, so a half-written
//!   renewal never takes the listener down.
//! - Engines: `https://` endpoint URLs are reached over TLS, verified against
//!   `security.engine_ca_file` (PEM bundle) or the system's roots, optionally presenting
//!   `security.engine_client_cert`/`engine_client_key` (mTLS).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::{Metrics, Reloaded};
use crate::security::guard::SecurityConfig;

/// Why TLS settings could not be loaded; names the file.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {message}")]
pub struct TlsError {
    what: &'static str,
    path: String,
    message: String,
}

impl TlsError {
    fn new(what: &'static str, path: &Path, message: impl std::fmt::Display) -> Self {
        TlsError {
            what,
            path: path.display().to_string(),
            message: message.to_string(),
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| TlsError::new("certificate file", path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new("certificate file", path, e))?;
    if certs.is_empty() {
        return Err(TlsError::new(
            "certificate file",
            path,
            "holds no PEM certificate",
        ));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::new("key file", path, e))
}

/// The listener's certificate and key, swapped whole when the files change.
struct ReloadingCert {
    current: ArcSwap<CertifiedKey>,
    cert: PathBuf,
    key: PathBuf,
}

impl ReloadingCert {
    fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
        let chain = read_certs(cert)?;
        let der = read_key(key)?;
        let signing = provider()
            .key_provider
            .load_private_key(der)
            .map_err(|e| TlsError::new("key file", key, e))?;
        let certified = CertifiedKey::new(chain, signing);
        // A key that does not belong to the certificate would fail every handshake: refuse it
        // here instead.
        certified.keys_match().map_err(|e| {
            TlsError::new(
                "key file",
                key,
                format!("does not match {}: {e}", cert.display()),
            )
        })?;
        Ok(certified)
    }
}

impl std::fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// HTTPS for the client listener.
#[derive(Clone)]
pub(crate) struct ServerTls {
    acceptor: TlsAcceptor,
    cert: Arc<ReloadingCert>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// The listener's TLS, when `tls_cert` and `tls_key` are set (validated as a pair).
    pub(crate) fn from_config(config: &SecurityConfig) -> Result<Option<Self>, TlsError> {
        let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
            return Ok(None);
        };
        let current = ReloadingCert::load(cert, key)?;
        let resolver = Arc::new(ReloadingCert {
            current: ArcSwap::from_pointee(current),
            cert: cert.clone(),
            key: key.clone(),
        });
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new("certificate file", cert, e))?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            cert: resolver,
        }))
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Re-reads the certificate and key whenever either file changes (polled every
    /// `interval`), until `shutdown`. A pair that does not load keeps the previous one.
    pub(crate) async fn watch(
        self,
        interval: Duration,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) {
        let cert = self.cert;
        let files = [cert.cert.clone(), cert.key.clone()];
        crate::watch::on_change(&files, interval, shutdown, || {
            match ReloadingCert::load(&cert.cert, &cert.key) {
                Ok(loaded) => {
                    info!(cert = %cert.cert.display(), "TLS certificate reloaded");
                    cert.current.store(Arc::new(loaded));
                    metrics.count_reload(Reloaded::Tls, true);
                    true
                }
                Err(e) => {
                    warn!(error = %e, "TLS certificate not reloaded; keeping the previous one");
                    metrics.count_reload(Reloaded::Tls, false);
                    false
                }
            }
        })
        .await;
    }
}

/// The TLS client for `https://` engines.
pub(crate) fn engine_connector(config: &SecurityConfig) -> Result<TlsConnector, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match &config.engine_ca_file {
        Some(path) => {
            for cert in read_certs(path)? {
                roots
                    .add(cert)
                    .map_err(|e| TlsError::new("CA file", path, e))?;
            }
        }
        None => {
            // Unreadable system certificates are skipped, as every TLS client does.
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new("CA file", Path::new("-"), e))?
        .with_root_certificates(roots);
    let mut client = match (&config.engine_client_cert, &config.engine_client_key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| TlsError::new("client key file", key, e))?,
        _ => builder.with_no_client_auth(),
    };
    // Engines are reached over HTTP/1.1 (the pool's connections).
    client.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(client)))
}
