//! The context store behind the sidecar: a pooled keep-alive HTTP client, the document read
//! and the conditional write-back, and plain forwarding for everything else.
//!
//! Connection hygiene: the pool is capped ([`pool`]) and idle connections are closed after the
//! idle timeout by a background timer. A store (or a load balancer) may close an idle
//! keep-alive connection without saying so; a request that finds such a connection fails
//! before any answer, and what is safe to send twice is sent again on a fresh connection:
//! bodiless GET/HEAD/OPTIONS (turnlock's own document read included). A write-back that was
//! never written to a connection is retried by the client itself; one that may have been
//! sent is not (its outcome is unknown).

mod pool;
mod sigv4;

pub use self::sigv4::{SignError, Signer};

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use crate::http::{full, Body};
use crate::merge::Document;
use crate::metrics::Metrics;
use crate::routes::Dialect;

/// What the write-back of a merge keeps of the client's request, in the store's dialect.
#[derive(Clone, Debug)]
pub struct StoreParts {
    pub dialect: &'static Dialect,
    /// The client's end-to-end headers the dialect keeps (metadata, encryption, content type,
    /// credentials).
    pub headers: http::HeaderMap,
    /// `If-Match` with the store's own entity tag: the write applies only to that version.
    pub if_match: Option<http::HeaderValue>,
    /// `If-None-Match: *`: the write applies only if the document does not exist.
    pub if_none_match: bool,
}

impl Default for StoreParts {
    fn default() -> Self {
        Self {
            dialect: &crate::routes::dialect::HTTP,
            headers: http::HeaderMap::new(),
            if_match: None,
            if_none_match: false,
        }
    }
}

impl StoreParts {
    pub fn of(dialect: &'static Dialect, headers: &http::HeaderMap) -> Self {
        let if_none_match = headers
            .get(header::IF_NONE_MATCH)
            .is_some_and(|v| v.as_bytes().trim_ascii() == b"*");
        if dialect.answers_natively() {
            return Self {
                if_none_match,
                ..Self::default()
            };
        }
        let mut kept = http::HeaderMap::new();
        for (name, value) in headers {
            if dialect.keeps(name.as_str()) {
                kept.append(name.clone(), value.clone());
            }
        }
        Self {
            dialect,
            headers: kept,
            if_match: headers.get(header::IF_MATCH).cloned(),
            if_none_match,
        }
    }
}

/// The header carrying the fencing token of the lock grant a write was made under.
pub const FENCING_TOKEN: &str = "x-fencing-token";

/// The preference (RFC 7240) a write-back states: no document in the answer.
pub const PREFER: &str = "prefer";
pub const RETURN_MINIMAL: &str = "return=minimal";

/// Largest document accepted from the store.
const MAX_DOCUMENT_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("the context store did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection to the store failed after the request may have been sent.
    #[error("the context store is unreachable: {0}")]
    Unreachable(String),
    /// The request never left: no connection to the store could be made, or no request could
    /// be built. Nothing was written.
    #[error("the context store could not be reached: {0}")]
    NotSent(String),
    #[error("the context store refused the conditional write (412)")]
    PreconditionFailed,
    #[error("the context store refused the write: a newer lock grant already wrote this session")]
    FencedOut,
    #[error("the context store answered {status}")]
    Status { status: StatusCode, body: Bytes },
    #[error("the context store returned a document turnlock cannot read: {0}")]
    InvalidDocument(String),
}

impl UpstreamError {
    /// A client failure: `NotSent` when no connection could be made, else `Unreachable`.
    fn from_client(e: &hyper_util::client::legacy::Error) -> Self {
        if e.is_connect() {
            Self::NotSent(error_chain(e))
        } else {
            Self::Unreachable(error_chain(e))
        }
    }

    /// Whether the write may have landed even though no confirmation came back.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Self::Timeout(_) | Self::Unreachable(_))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::FencedOut => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "upstream_timeout",
            Self::Unreachable(_) | Self::NotSent(_) => "upstream_unavailable",
            Self::PreconditionFailed => "upstream_conflict",
            Self::FencedOut => "fenced_out",
            Self::Status { .. } => "upstream_error",
            Self::InvalidDocument(_) => "upstream_invalid_document",
        }
    }
}

/// The precondition of a write-back.
#[derive(Clone, Debug)]
pub enum Precondition {
    /// The store's entity tag as read.
    IfMatch(HeaderValue),
    /// The document must not exist yet.
    Absent,
    /// The store gives no entity tags: ordering is turnlock's own version fence.
    None,
}

/// A document the store sent, parsed: a JSON object whose `messages`, when present, is an array.
pub fn parse_document(bytes: &[u8]) -> Result<crate::merge::Document, UpstreamError> {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(serde_json::Value::Object(doc)) => {
            if doc.get("messages").is_some_and(|m| !m.is_array()) {
                Err(UpstreamError::InvalidDocument("`messages` is not an array".into()))
            } else {
                Ok(doc)
            }
        }
        Ok(_) => Err(UpstreamError::InvalidDocument("not a JSON object".into())),
        Err(e) => Err(UpstreamError::InvalidDocument(e.to_string())),
    }
}

/// A document as the store sent it.
#[derive(Debug)]
pub struct FetchedRaw {
    pub body: Option<Bytes>,
    pub etag: Option<HeaderValue>,
}

/// A document as read from the store.
#[derive(Debug)]
pub struct Fetched {
    pub doc: Option<Document>,
    pub etag: Option<HeaderValue>,
}

/// The connection pool's limits.
#[derive(Clone, Copy, Debug)]
pub struct PoolSettings {
    /// Most connections open to the store at once.
    pub max_connections: usize,
    /// How long an idle connection is kept before it is closed.
    pub idle_timeout: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 256,
            idle_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Clone)]
pub struct Upstream {
    client: Client<pool::CappedConnector, Body>,
    /// The same connector without keeping idle connections: a retry gets a fresh one.
    fresh: Client<pool::CappedConnector, Body>,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    base_path: String,
    timeout: Duration,
    metrics: Metrics,
    /// A `Via` entry added to every request (transparent mode: lets the sidecar recognize
    /// its own requests coming back to it).
    via: Option<HeaderValue>,
    /// The `Host` of every request, when it is not the authority of the URL (transparent
    /// mode: the name the client gave the store it reached at this address).
    host: Option<HeaderValue>,
    /// Signs turnlock's own requests (its read and write-back), for stores that require it.
    signer: Option<std::sync::Arc<Signer>>,
}

impl Upstream {
    pub fn new(base: &str, timeout: Duration, metrics: Metrics) -> Result<Self, String> {
        Self::with_pool(base, timeout, PoolSettings::default(), metrics)
    }

    /// Like [`Upstream::new`], with the pool's limits.
    pub fn with_pool(base: &str, timeout: Duration, pool: PoolSettings, metrics: Metrics) -> Result<Self, String> {
        Self::with_tls(base, timeout, pool, metrics, None)
    }

    /// Like [`Upstream::with_pool`]; an `https://` store is verified against the system's
    /// roots and, when given, the CA certificates (PEM) in `ca`.
    pub fn with_tls(
        base: &str,
        timeout: Duration,
        pool: PoolSettings,
        metrics: Metrics,
        ca: Option<&std::path::Path>,
    ) -> Result<Self, String> {
        let uri: Uri = base
            .parse()
            .map_err(|e| format!("invalid upstream URL {base:?}: {e}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("upstream URL {base:?} has no scheme"))?;
        let https = scheme == http::uri::Scheme::HTTPS;
        if scheme != http::uri::Scheme::HTTP && !https {
            return Err(format!("upstream URL {base:?}: the scheme must be http:// or https://"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream URL {base:?} has no host"))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let mut connector = pool::CappedConnector::new(connector, pool.max_connections);
        if https {
            connector = connector.with_tls(tls_config(ca).map_err(|e| format!("upstream URL {base:?}: {e}"))?);
        }
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(pool.idle_timeout)
            .pool_max_idle_per_host(pool.max_connections)
            .build(connector.clone());
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        Ok(Self {
            client,
            fresh,
            scheme,
            authority,
            base_path: uri.path().trim_end_matches('/').to_owned(),
            timeout,
            metrics,
            via: None,
            host: None,
            signer: None,
        })
    }

    /// The same upstream, signing turnlock's own requests with `signer`.
    pub fn with_signer(mut self, signer: Signer) -> Self {
        self.signer = Some(std::sync::Arc::new(signer));
        self
    }

    /// Signs one of turnlock's own requests, when configured to.
    fn sign(&self, req: &mut Request<Body>, body: &[u8]) -> Result<(), UpstreamError> {
        match &self.signer {
            Some(signer) => signer
                .sign(req, body)
                .map_err(|e| UpstreamError::NotSent(e.to_string())),
            None => Ok(()),
        }
    }

    /// Signs a request forwarded for a client, when turnlock signs for this store (the
    /// client's own signature names the sidecar's address, not the store's).
    pub fn sign_forwarded(&self, parts: http::request::Parts) -> Result<http::request::Parts, UpstreamError> {
        let Some(signer) = &self.signer else {
            return Ok(parts);
        };
        let mut parts = parts;
        // Not signed and not sent: a store (or a server in front of it) may answer or drop
        // `Expect: 100-continue` itself, and a signature covering it then no longer verifies.
        parts.headers.remove(header::EXPECT);
        let mut req = Request::from_parts(parts, ());
        signer
            .sign_forwarded(&mut req)
            .map_err(|e| UpstreamError::NotSent(e.to_string()))?;
        Ok(req.into_parts().0)
    }

    /// The same upstream, adding `via` to the `Via` header of every request.
    pub fn with_via(self, via: HeaderValue) -> Self {
        Self { via: Some(via), ..self }
    }

    /// The same upstream, named `host` in the `Host` header of every request.
    pub fn with_host(self, host: HeaderValue) -> Self {
        Self {
            host: Some(host),
            ..self
        }
    }

    /// The longest wait for the store.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn add_headers(&self, req: &mut Request<Body>) {
        if let Some(via) = &self.via {
            req.headers_mut().append(header::VIA, via.clone());
        }
        if let Some(host) = &self.host {
            req.headers_mut().insert(header::HOST, host.clone());
        }
    }

    /// The store's URI for a request URI as the agent sent it: its path and query kept as they
    /// are (not copied nor parsed again) when the store's URL has no path of its own.
    pub fn uri_of(&self, uri: &Uri) -> Result<Uri, http::Error> {
        match uri.path_and_query() {
            Some(pq) if self.base_path.is_empty() => Uri::builder()
                .scheme(self.scheme.clone())
                .authority(self.authority.clone())
                .path_and_query(pq.clone())
                .build(),
            pq => self.uri(pq.map_or("/", |p| p.as_str())),
        }
    }

    /// The store's URI for a request path (and query) as the agent sent it.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.base_path, path_and_query))
            .build()
    }

    /// Sends a request, waiting at most the timeout for the response head. The body streams.
    pub async fn send(&self, mut req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        self.add_headers(&mut req);
        Self::timed(&self.client, self.timeout, req).await
    }

    /// Like [`Upstream::send`], and a bodiless GET, HEAD or OPTIONS that failed without any
    /// answer (a connection the store had closed) is sent once more on a fresh connection.
    pub async fn send_safe(&self, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        let Some(mut again) = repeatable(&req) else {
            return self.send(req).await;
        };
        let started = Instant::now();
        match self.send(req).await {
            Err(first @ (UpstreamError::Unreachable(_) | UpstreamError::NotSent(_))) => {
                let left = self.timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(first);
                }
                tracing::debug!(error = %first, "store connection failed before an answer; retrying on a fresh one");
                self.metrics.upstream_retry();
                self.add_headers(&mut again);
                Self::timed(&self.fresh, left, again).await
            }
            other => other,
        }
    }

    /// Forwards an agent's request, counting the store's answer: a bodiless safe request as
    /// [`Upstream::send_safe`] does, any other with its body streaming from the client
    /// ([`Upstream::send_streaming`]).
    pub async fn forward(
        &self,
        req: Request<Body>,
        body_sent: impl std::future::Future<Output = bool>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let res = if repeatable(&req).is_some() {
            self.send_safe(req).await
        } else {
            self.send_streaming(req, body_sent).await
        };
        self.answered("forward", &res);
        res
    }

    fn answered(&self, op: &'static str, res: &Result<Response<Incoming>, UpstreamError>) {
        let status = res.as_ref().map_or(0, |r| r.status().as_u16());
        self.metrics.upstream_response(op, status);
    }

    async fn timed(
        client: &Client<pool::CappedConnector, Body>,
        timeout: Duration,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(timeout, client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(timeout)),
            Ok(Err(e)) => Err(UpstreamError::from_client(&e)),
            Ok(Ok(res)) => Ok(res),
        }
    }

    /// Sends a request whose body streams from the client. The timeout bounds the wait for
    /// the response head once `body_sent` resolved `true` (the whole body handed to the
    /// store), not the client's own upload; an answer that comes before the body is complete
    /// is taken. `body_sent` resolving `false` means the store stopped taking the body: a
    /// timeout as well.
    pub async fn send_streaming(
        &self,
        mut req: Request<Body>,
        body_sent: impl std::future::Future<Output = bool>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        self.add_headers(&mut req);
        let res = self.client.request(req);
        tokio::pin!(res);
        tokio::select! {
            r = &mut res => return r.map_err(|e| UpstreamError::from_client(&e)),
            sent = body_sent => if !sent {
                return Err(UpstreamError::Timeout(self.timeout));
            }
        }
        match tokio::time::timeout(self.timeout, res).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(UpstreamError::from_client(&e)),
            Ok(Ok(res)) => Ok(res),
        }
    }

    /// Reads the document at `path`, or `None` on 404.
    pub async fn get_document(&self, path: &str) -> Result<Fetched, UpstreamError> {
        self.get_document_with(path, &StoreParts::default()).await
    }

    /// [`Upstream::get_document`] with the client's credentials (its `Authorization`, when
    /// the store's dialect keeps it), or signed by turnlock when configured to.
    pub async fn get_document_with(&self, path: &str, store: &StoreParts) -> Result<Fetched, UpstreamError> {
        let raw = self.get_document_raw_with(path, store).await?;
        let doc = raw.body.as_deref().map(parse_document).transpose()?;
        Ok(Fetched { doc, etag: raw.etag })
    }

    /// Reads a document as the store sent it (`body` `None` when absent), unparsed.
    pub async fn get_document_raw(&self, path: &str) -> Result<FetchedRaw, UpstreamError> {
        self.get_document_raw_with(path, &StoreParts::default()).await
    }

    /// [`Upstream::get_document_raw`] with the client's credentials, or signed by turnlock
    /// when configured to (as [`Upstream::get_document_with`]).
    pub async fn get_document_raw_with(&self, path: &str, store: &StoreParts) -> Result<FetchedRaw, UpstreamError> {
        let started = Instant::now();
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(self.uri(path).map_err(|e| UpstreamError::NotSent(e.to_string()))?)
            .header(header::ACCEPT, "application/json")
            .body(crate::http::empty())
            .map_err(|e| UpstreamError::NotSent(e.to_string()))?;
        if let Some(auth) = store.headers.get(header::AUTHORIZATION) {
            req.headers_mut().insert(header::AUTHORIZATION, auth.clone());
        }
        self.sign(&mut req, b"")?;
        let res = self.send_safe(req).await;
        self.answered("get", &res);
        let result = match res {
            Err(e) => Err(e),
            Ok(res) if res.status() == StatusCode::NOT_FOUND => {
                // Drain so the connection returns to the pool.
                let _ = self.body(res).await;
                Ok(FetchedRaw { body: None, etag: None })
            }
            Ok(res) if res.status().is_success() => {
                let etag = res.headers().get(header::ETAG).cloned();
                let bytes = self.body(res).await?;
                Ok(FetchedRaw {
                    body: Some(bytes),
                    etag,
                })
            }
            Ok(res) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                Err(UpstreamError::Status { status, body })
            }
        };
        self.metrics.upstream("get", started.elapsed());
        result
    }

    /// Writes the document back under its precondition; returns the store's new entity tag.
    pub async fn put_document(
        &self,
        path: &str,
        doc: Bytes,
        precondition: &Precondition,
        fence: u64,
    ) -> Result<Option<HeaderValue>, UpstreamError> {
        self.put_document_with(path, doc, precondition, fence, &StoreParts::default())
            .await
    }

    /// [`Upstream::put_document`] in a store's dialect: with the client's headers the
    /// dialect keeps (metadata, encryption, content type, credentials), and the dialect's
    /// conflict statuses read as "the document moved".
    pub async fn put_document_with(
        &self,
        path: &str,
        doc: Bytes,
        precondition: &Precondition,
        fence: u64,
        store: &StoreParts,
    ) -> Result<Option<HeaderValue>, UpstreamError> {
        let started = Instant::now();
        let mut req = Request::builder()
            .method(Method::PUT)
            .uri(self.uri(path).map_err(|e| UpstreamError::NotSent(e.to_string()))?);
        if let Some(headers) = req.headers_mut() {
            headers.extend(store.headers.clone());
            headers
                .entry(header::CONTENT_TYPE)
                .or_insert(HeaderValue::from_static("application/json"));
        }
        req = req.header(FENCING_TOKEN, fence);
        // The answer's body is never read: a store that honours the preference (RFC 7240, as
        // the reference store does) does not send the whole document back. Not on a signed
        // write, whose store does not know it.
        if self.signer.is_none() {
            req = req.header(PREFER, RETURN_MINIMAL);
        }
        req = match precondition {
            Precondition::IfMatch(tag) => req.header(header::IF_MATCH, tag.clone()),
            Precondition::Absent => req.header(header::IF_NONE_MATCH, "*"),
            Precondition::None => req,
        };
        let mut req = req
            .body(full(doc.clone()))
            .map_err(|e| UpstreamError::NotSent(e.to_string()))?;
        self.sign(&mut req, &doc)?;
        let res = self.send(req).await;
        self.answered("put", &res);
        let result = match res {
            Err(e) => Err(e),
            Ok(res) if res.status().is_success() => {
                let etag = res.headers().get(header::ETAG).cloned();
                let _ = self.body(res).await;
                Ok(etag)
            }
            Ok(res) if store.dialect.is_conflict(res.status().as_u16()) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                if status == StatusCode::CONFLICT && is_fenced_out(&body) {
                    Err(UpstreamError::FencedOut)
                } else {
                    Err(UpstreamError::PreconditionFailed)
                }
            }
            Ok(res) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                if status == StatusCode::CONFLICT && is_fenced_out(&body) {
                    Err(UpstreamError::FencedOut)
                } else {
                    Err(UpstreamError::Status { status, body })
                }
            }
        };
        self.metrics.upstream("put", started.elapsed());
        result
    }

    /// Reads a whole response body, within the timeout and the size limit.
    pub async fn body(&self, res: Response<Incoming>) -> Result<Bytes, UpstreamError> {
        let limited = http_body_util::Limited::new(res.into_body(), MAX_DOCUMENT_BYTES);
        match tokio::time::timeout(self.timeout, limited.collect()).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(UpstreamError::Unreachable(e.to_string())),
            Ok(Ok(c)) => Ok(c.to_bytes()),
        }
    }

    /// Whether the store answers at all (any HTTP response counts).
    pub async fn ping(&self) -> bool {
        let Ok(uri) = self.uri("/") else { return false };
        let Ok(req) = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(crate::http::empty())
        else {
            return false;
        };
        match self.send(req).await {
            Ok(res) => {
                let _ = self.body(res).await;
                true
            }
            Err(_) => false,
        }
    }
}

/// A copy of a request that is safe to send twice (no body, a safe method), to send again.
fn repeatable(req: &Request<Body>) -> Option<Request<Body>> {
    use http_body::Body as _;
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe || req.body().size_hint().exact() != Some(0) {
        return None;
    }
    let mut again = Request::builder()
        .method(req.method().clone())
        .uri(req.uri().clone())
        .version(req.version())
        .body(crate::http::empty())
        .ok()?;
    *again.headers_mut() = req.headers().clone();
    Some(again)
}

/// Whether a store's 409 says the write's fencing token was older than one already stored
/// (the reference store's `--enforce-fencing` answer).
/// TLS to the store: the system's roots, plus the CA certificates of `ca` (PEM).
fn tls_config(ca: Option<&std::path::Path>) -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is left out, as other clients do.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca {
        let pem = std::fs::read(path).map_err(|e| format!("cannot read --upstream-ca {}: {e}", path.display()))?;
        let mut added = 0;
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            added += 1;
        }
        if added == 0 {
            return Err(format!("--upstream-ca {} holds no PEM certificate", path.display()));
        }
    }
    if roots.is_empty() {
        return Err(
            "no CA certificates to verify the store with: install the system's (ca-certificates) or give --upstream-ca"
                .into(),
        );
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(std::sync::Arc::new(config))
}

fn is_fenced_out(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["error"] == "stale_fencing_token")
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store port nobody listens on: the write never left, so its outcome is known.
    #[tokio::test]
    async fn a_refused_connection_is_not_an_unknown_outcome() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let upstream = Upstream::new(&format!("http://{addr}"), Duration::from_secs(2), Metrics::new()).expect("url");
        let err = upstream
            .put_document("/v1/sessions/s", Bytes::from_static(b"{}"), &Precondition::Absent, 1)
            .await
            .expect_err("nothing listens");
        assert!(matches!(err, UpstreamError::NotSent(_)), "{err:?}");
        assert!(!err.outcome_unknown());
        assert_eq!(err.code(), "upstream_unavailable");
    }
}
