//! The context store behind the sidecar: a pooled keep-alive HTTP client, the document read
//! and the conditional write-back, and plain forwarding for everything else.
//!
//! Connection hygiene: the pool ([`pool`]) is capped ([`connect`]) and idle connections are closed after the
//! idle timeout by a background timer. A store (or a load balancer) may close an idle
//! keep-alive connection without saying so; a request that finds such a connection fails
//! before any answer, and what is safe to send twice is sent again on a fresh connection:
//! bodiless GET/HEAD/OPTIONS (turnlock's own document read included). A write-back that was
//! never written to a connection is sent again by the pool on the next one; one that may have
//! been sent is settled by the write pipeline under its commit slot (`merge_commit`), not here.

mod connect;
mod document;
mod error;
mod pool;
mod sigv4;
mod store_parts;
mod tls;
mod web_identity;

pub use self::connect::SendWatch;
pub use self::document::{parse_document, Fetched, FetchedRaw, Precondition};
pub(crate) use self::error::error_chain;
pub use self::error::UpstreamError;
pub use self::pool::Reserved;
pub use self::sigv4::{SignError, Signer};
pub use self::store_parts::StoreParts;
pub use self::web_identity::{StsError, WebIdentity, WebIdentityConfig};

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;

use crate::http::Body;
use crate::metrics::Metrics;

/// Largest document accepted from the store.
const MAX_DOCUMENT_BYTES: usize = 64 * 1024 * 1024;

/// The header carrying the fencing token of the lock grant a write was made under.
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("x-fencing-token");

/// The preference (RFC 7240) a write-back states: no document in the answer.
pub const PREFER: &str = "prefer";
pub const RETURN_MINIMAL: &str = "return=minimal";

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
    pool: pool::Pool,
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
        let mut connector = connect::CappedConnector::new(connector, pool.max_connections);
        if https {
            connector = connector.with_tls(tls::tls_config(ca).map_err(|e| format!("upstream URL {base:?}: {e}"))?);
        }
        let dst = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| format!("upstream URL {base:?}: {e}"))?;
        let pool = pool::Pool::new(connector, dst, pool.idle_timeout)?;
        Ok(Self {
            pool,
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
    pub fn sign_forwarded(&self, parts: &mut http::request::Parts) -> Result<(), UpstreamError> {
        let Some(signer) = &self.signer else {
            return Ok(());
        };
        // Not signed and not sent: a store (or a server in front of it) may answer or drop
        // `Expect: 100-continue` itself, and a signature covering it then no longer verifies.
        parts.headers.remove(header::EXPECT);
        let head = std::mem::replace(parts, Request::new(()).into_parts().0);
        let mut req = Request::from_parts(head, ());
        let signed = signer
            .sign_forwarded(&mut req)
            .map_err(|e| UpstreamError::NotSent(e.to_string()));
        *parts = req.into_parts().0;
        signed
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
    /// are (not copied nor parsed again) when the store's URL has no path of its own. A URI
    /// in origin form (`/path?query`, as agents send it) stays as it is, which is the form
    /// the request is written in, unless the request is signed (the signature covers the
    /// store's whole URI).
    pub fn uri_of(&self, uri: Uri) -> Result<Uri, http::Error> {
        if self.base_path.is_empty() && self.signer.is_none() && uri.scheme().is_none() && uri.authority().is_none() {
            return Ok(uri);
        }
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

    /// Sends a request, waiting at most the timeout for a store connection and, once the
    /// request is on one, at most the timeout for the response head. The body streams.
    pub fn send(
        &self,
        mut req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + '_ {
        self.add_headers(&mut req);
        // A request that gets no connection in time was never sent, and is answered so.
        let deadline = Instant::now() + self.timeout;
        self.pool.send(req, deadline, Some(self.timeout))
    }

    /// A store connection for a request still to be made, waited for as [`Upstream::send`]
    /// waits for one (a 502 saying nothing was sent when none comes in time).
    /// Counted as `op="connect"`, status 0, when none could be had: the request that was to
    /// follow never reached the store.
    pub async fn reserve(&self) -> Result<Reserved, UpstreamError> {
        self.counted(self.pool.reserve(Instant::now() + self.timeout).await)
    }

    /// A connection reserved, or its failure counted as `op="connect"`, status 0.
    fn counted(&self, reserved: Result<Reserved, UpstreamError>) -> Result<Reserved, UpstreamError> {
        if reserved.is_err() {
            self.metrics.upstream_response("connect", 0);
        }
        reserved
    }

    /// [`Upstream::send`] on the connection `reserved` holds, which stays there for the next
    /// request (see [`pool::Pool::send_keeping`]).
    pub async fn send_keeping(
        &self,
        reserved: &mut Reserved,
        mut req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        self.add_headers(&mut req);
        let deadline = Instant::now() + self.timeout;
        self.pool
            .send_keeping(reserved, req, deadline, Some(self.timeout))
            .await
    }

    /// Like [`Upstream::reserve`], a connection opened for the request (one the store cannot
    /// have closed while it was idle).
    pub async fn reserve_fresh(&self) -> Result<Reserved, UpstreamError> {
        self.counted(Box::pin(self.pool.reserve_fresh(Instant::now() + self.timeout)).await)
    }

    /// [`Upstream::send`] on a connection reserved for it ([`Upstream::reserve`]).
    pub fn send_reserved(
        &self,
        reserved: Reserved,
        mut req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + '_ {
        self.add_headers(&mut req);
        let deadline = Instant::now() + self.timeout;
        self.pool.send_reserved(reserved, req, deadline, Some(self.timeout))
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
                // Boxed: the retry is rare, and every read's future would carry its state.
                Box::pin(self.pool.send_fresh(again, Instant::now() + left, Some(left))).await
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
        let res = if is_repeatable(&req) {
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

    /// `sent`, given up after `timeout`. Not an `async fn`: the future it returns holds
    /// `sent` once, not twice (an `async fn` keeps its arguments beside what it awaits).
    fn timed<F>(sent: F, timeout: Duration) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>>
    where
        F: Future<Output = Result<Response<Incoming>, UpstreamError>>,
    {
        tokio::time::timeout(timeout, sent).map(move |r| r.unwrap_or(Err(UpstreamError::Timeout(timeout))))
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
        let watch = req.extensions().get::<SendWatch>().cloned();
        let res = self.pool.send(req, Instant::now() + self.timeout, None);
        tokio::pin!(res);
        tokio::select! {
            r = &mut res => return r,
            sent = body_sent => if !sent {
                return Err(UpstreamError::Timeout(self.timeout));
            }
        }
        match watch {
            Some(watch) => self.answer_after_taken(res, &watch).await,
            None => Self::timed(res, self.timeout).await,
        }
    }

    /// The answer's head, waited for at most the timeout after the store last took bytes of
    /// the request: the end of the client's body may still be in the buffers between proxy
    /// and store (megabytes, for a large upload), and a store reading it is not late.
    async fn answer_after_taken<F>(
        &self,
        mut res: std::pin::Pin<&mut F>,
        watch: &SendWatch,
    ) -> Result<Response<Incoming>, UpstreamError>
    where
        F: Future<Output = Result<Response<Incoming>, UpstreamError>>,
    {
        let tick = (self.timeout / 4).max(Duration::from_millis(10));
        let mut taken = watch.taken();
        let mut deadline = Instant::now() + self.timeout;
        loop {
            let next = (Instant::now() + tick).min(deadline);
            tokio::select! {
                answered = &mut res => return answered,
                _ = tokio::time::sleep_until(next) => {
                    if watch.moved(&mut taken) {
                        deadline = Instant::now() + self.timeout;
                    } else if Instant::now() >= deadline {
                        return Err(UpstreamError::Timeout(self.timeout));
                    }
                }
            }
        }
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

    /// Whether the store answers at all (any HTTP response counts); if not, why not.
    pub async fn ping(&self) -> Result<(), String> {
        let uri = self.uri("/").map_err(|e| e.to_string())?;
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(crate::http::empty())
            .map_err(|e| e.to_string())?;
        // On the check's own connection; sent again on a new one when the store has closed
        // that connection meanwhile (that is not an outage).
        self.add_headers(&mut req);
        let again = repeatable(&req);
        let sent = match (self.pool.probe(req, self.timeout, false).await, again) {
            (Err(UpstreamError::Unreachable(_) | UpstreamError::NotSent(_)), Some(again)) => {
                self.pool.probe(again, self.timeout, true).await
            }
            (other, _) => other,
        };
        match sent {
            Ok(res) => {
                let _ = self.body(res).await;
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Whether a request is safe to send twice: a safe method and no body.
fn is_repeatable(req: &Request<Body>) -> bool {
    use http_body::Body as _;
    matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) && req.body().size_hint().exact() == Some(0)
}

/// A copy of a request that is safe to send twice ([`is_repeatable`]), to send again.
fn repeatable(req: &Request<Body>) -> Option<Request<Body>> {
    if !is_repeatable(req) {
        return None;
    }
    // Field by field: a builder moves the whole request head at each step.
    let mut again = Request::new(crate::http::empty());
    *again.method_mut() = req.method().clone();
    *again.uri_mut() = req.uri().clone();
    *again.version_mut() = req.version();
    *again.headers_mut() = req.headers().clone();
    Some(again)
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
