//! The webhook's HTTPS server: `POST /inject` (pods opted in by annotation or label),
//! `POST /inject/namespace` (every pod of a namespace that opted in, unless the pod opts out),
//! `GET /healthz`, `/readyz` (503 while draining after SIGTERM) and `/metrics`. The certificate and key are read from the mounted files and
//! reloaded when they change (cert-manager renews them in place).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::pod::Scope;
use super::review;
use super::WebhookArgs;
use crate::config::{ConfigError, StartError};
use crate::http::{error, json, Body};

/// Largest AdmissionReview accepted (the API server caps objects at 3 MiB; a review holds the
/// object and may hold its old version).
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;
/// How long a client may take for the TLS handshake or to send a review.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// A running webhook server.
pub struct Running {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }

    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Loads the certificate and starts serving.
pub async fn start(args: WebhookArgs) -> Result<Running, StartError> {
    // The default Redis URL goes into every injected sidecar: one the sidecar would refuse
    // stops the injector here, not every pod at admission.
    if let Some(url) = &args.redis {
        crate::redis_url::check(url)
            .map_err(|reason| ConfigError(format!("--redis {}: {reason}", crate::redis_url::redact(url))))?;
    }
    let certs = Arc::new(Certs::load(args.tls_cert.clone(), args.tls_key.clone()).map_err(ConfigError)?);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError(format!("TLS setup: {e}")))?
        .with_no_client_auth()
        .with_cert_resolver(certs.clone());
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartError::bind(args.listen, e))?;
    let addr = listener.local_addr().map_err(|e| ConfigError(e.to_string()))?;
    let shutdown = CancellationToken::new();
    let every = Duration::from_secs(args.tls_reload_secs.max(1));
    tokio::spawn(reload_loop(certs, every, shutdown.clone()));
    let task = tokio::spawn(serve(listener, acceptor, Arc::new(args), shutdown.clone()));
    tracing::info!(%addr, "turnlock injector listening (HTTPS)");
    Ok(Running { addr, shutdown, task })
}

async fn serve(listener: TcpListener, acceptor: TlsAcceptor, args: Arc<WebhookArgs>, shutdown: CancellationToken) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(CLIENT_TIMEOUT)
        .keep_alive(true);
    let builder = Arc::new(builder);
    let graceful = Arc::new(GracefulShutdown::new());
    // On shutdown keep answering for the drain period (readiness already says no, so the
    // Service stops sending reviews here) before the listener closes: reviews the API server
    // sends meanwhile are answered instead of failing admissions during a rollout.
    let stop_accepting = CancellationToken::new();
    {
        let (shutdown, stop, drain) = (
            shutdown.clone(),
            stop_accepting.clone(),
            Duration::from_millis(args.drain_ms),
        );
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tracing::info!(
                ?drain,
                "shutting down: not ready; still answering reviews during the drain"
            );
            tokio::time::sleep(drain).await;
            stop.cancel();
        });
    }
    let stats = Stats::new();
    loop {
        let Some((stream, peer)) = crate::server::accept(&listener, &stop_accepting).await else {
            break;
        };
        let acceptor = acceptor.clone();
        let args = args.clone();
        let (draining, stats) = (shutdown.clone(), stats.clone());
        let builder = builder.clone();
        let graceful = graceful.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(CLIENT_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    tracing::debug!(%error, %peer, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = hyper::service::service_fn(move |req| {
                let (args, draining, stats) = (args.clone(), draining.clone(), stats.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(req, &args, draining.is_cancelled(), &stats).await) }
            });
            let conn = builder.serve_connection(TokioIo::new(tls), service).into_owned();
            if let Err(error) = graceful.watch(conn).await {
                tracing::debug!(%error, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if let Some(graceful) = Arc::into_inner(graceful) {
        let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    }
}

async fn handle(req: Request<Incoming>, args: &WebhookArgs, draining: bool, stats: &Stats) -> Response<Body> {
    let scope = match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => return json(StatusCode::OK, &json!({"status": "ok"})),
        (&Method::GET, "/readyz") if draining => {
            return json(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"status": "draining", "reason": "shutting down"}),
            )
        }
        (&Method::GET, "/readyz") => return json(StatusCode::OK, &json!({"status": "ok"})),
        (&Method::GET, "/metrics") => {
            let mut res = Response::new(crate::http::full(stats.encode()));
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            return res;
        }
        (&Method::POST, "/inject") => Scope::OptIn,
        (&Method::POST, "/inject/namespace") => Scope::Namespace,
        _ => {
            return error(
                StatusCode::NOT_FOUND,
                "not_found",
                "endpoints: POST /inject, POST /inject/namespace, GET /healthz, /readyz, /metrics",
                None,
            )
        }
    };
    let limited = http_body_util::Limited::new(req.into_body(), MAX_REVIEW_BYTES);
    let body = match tokio::time::timeout(CLIENT_TIMEOUT, limited.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", e, None),
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                "the review took too long to send",
                None,
            )
        }
    };
    match review::answer(&body, scope, args) {
        Ok(answer) => {
            let outcome = if answer["response"]["patch"].is_string() {
                "injected"
            } else if answer["response"]["allowed"] == false {
                "denied"
            } else {
                "unchanged"
            };
            stats.review(outcome);
            json(StatusCode::OK, &answer)
        }
        Err(e) => {
            stats.review("invalid");
            error(StatusCode::BAD_REQUEST, "invalid_review", e, None)
        }
    }
}

/// The webhook's metrics: reviews by outcome, and the build.
#[derive(Clone)]
struct Stats {
    inner: Arc<(prometheus_client::registry::Registry, Family<Outcome, Counter>)>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct Build {
    version: &'static str,
}

impl Stats {
    fn new() -> Self {
        let mut registry = prometheus_client::registry::Registry::with_prefix("turnlock_injector");
        let reviews = Family::<Outcome, Counter>::default();
        registry.register(
            "reviews",
            "Admission reviews answered, by outcome (injected, unchanged, denied, invalid)",
            reviews.clone(),
        );
        let build = Family::<Build, prometheus_client::metrics::gauge::Gauge>::default();
        build
            .get_or_create(&Build {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("build_info", "The running version (always 1)", build);
        Self {
            inner: Arc::new((registry, reviews)),
        }
    }

    fn review(&self, outcome: &'static str) {
        self.inner.1.get_or_create(&Outcome { outcome }).inc();
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.inner.0).is_err() {
            out.clear();
        }
        out
    }
}

// === impl Certs ===

/// The serving certificate, reloaded from its files when they change.
#[derive(Debug)]
struct Certs {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<(Option<SystemTime>, Arc<CertifiedKey>)>,
}

impl Certs {
    fn load(cert: PathBuf, key: PathBuf) -> Result<Self, String> {
        let loaded = read_pair(&cert, &key)?;
        let modified = modified(&cert, &key);
        Ok(Self {
            cert,
            key,
            current: RwLock::new((modified, Arc::new(loaded))),
        })
    }

    /// Re-reads the files if they changed; a broken renewal keeps the previous certificate.
    fn refresh(&self) {
        let modified = modified(&self.cert, &self.key);
        let known = match self.current.read() {
            Ok(g) => g.0,
            Err(p) => p.into_inner().0,
        };
        if modified == known {
            return;
        }
        match read_pair(&self.cert, &self.key) {
            Ok(loaded) => {
                let mut g = match self.current.write() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                *g = (modified, Arc::new(loaded));
                tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
            }
            Err(error) => tracing::warn!(%error, "cannot reload the serving certificate; keeping the old one"),
        }
    }
}

impl ResolvesServerCert for Certs {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(match self.current.read() {
            Ok(g) => g.1.clone(),
            Err(p) => p.into_inner().1.clone(),
        })
    }
}

async fn reload_loop(certs: Arc<Certs>, every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => certs.refresh(),
        }
    }
}

fn modified(cert: &Path, key: &Path) -> Option<SystemTime> {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    m(cert).max(m(key))
}

fn read_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read the certificate {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{} holds no certificate", cert.display()));
    }
    let key_der =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("cannot read the key {}: {e}", key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| format!("unusable key {}: {e}", key.display()))?;
    Ok(CertifiedKey::new(chain, signing))
}
