//! The agent-facing proxy: configured writes go through the write pipeline, everything else
//! is forwarded to the store unchanged.
//!
//! What a request meets, in order:
//!
//! 1. `server::Connection` (per connection; the stack below it is made for the connection's
//!    `Conn`: peer, original destination): on the way out, `Connection: close` once shutdown
//!    began. hyper serves the stack through `TowerToHyperService`.
//! 2. `layers` ([`Edge`], one layer with a concrete future): a panic becomes a `500` JSON
//!    answer (the connection and process go on) → a trace span per request when debug
//!    logging is on → `turnlock_requests_total`, from the answer's route and error code.
//! 3. `transparent::ConnService` (the routing service): the proxy of the connection's store,
//!    chosen once per connection (per request only for intercepted connections, whose
//!    requests name their store by `Host`).
//! 4. [`Proxy`] (a `tower::Service` over any request body): the route match; not a write →
//!    `passthrough` (streaming forward); an ambiguous path → `400`.
//! 5. `request`: body limits and timeout, JSON, turn, session id → a `WriteRequest`.
//! 6. `pipeline`: idempotency claim → coalescing queue → lock → merge or forward commit →
//!    records with the release.
//! 7. `error`: every refusal or failure of a write made an answer in one place.

mod answer;
mod bulk;
mod dialect;
mod error;
mod factory;
mod layers;
mod named;
mod passthrough;
mod pipeline;
mod replicate;
mod request;

pub use self::error::{EdgeError, WriteError};
pub use self::factory::ProxyFactory;
pub use self::layers::{stack, Edge, Stack, StackBody};
pub use self::pipeline::{Pipeline, Settings as PipelineSettings};
pub use self::request::{Limits, BODY_READ_TIMEOUT, CONTEXT_REPLACE, IDEMPOTENCY_KEY, SESSION_TURN};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;

use crate::http::{Body, BoxError};
use crate::metrics::{ErrorCode, Metrics, RouteName};
use crate::routes::{Captures, Route, Routes};
use crate::upstream::Upstream;

#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

struct Inner {
    routes: Routes,
    upstream: Upstream,
    pipeline: Pipeline,
    metrics: Metrics,
    max_body: request::Limits,
}

impl Proxy {
    pub fn new(
        routes: Routes,
        upstream: Upstream,
        pipeline: Pipeline,
        metrics: Metrics,
        max_body: request::Limits,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                routes,
                upstream,
                pipeline,
                metrics,
                max_body,
            }),
        }
    }

    pub fn pipeline(&self) -> &Pipeline {
        &self.inner.pipeline
    }

    /// Whether nothing uses this proxy but the caller: no request in it, no write running.
    pub fn is_idle(&self) -> bool {
        Arc::strong_count(&self.inner) == 1 && self.inner.pipeline.is_idle()
    }

    /// Serves one request from the agent at `peer` (`None`: a caller in the same process,
    /// taken as loopback, whose request need not name a host). The answer names its route
    /// ([`RouteName`]) for the request metrics layer, unless it was forwarded.
    pub async fn handle(&self, req: Request<Body>, peer: Option<SocketAddr>) -> Response<Body> {
        let inner = &self.inner;
        if let Err(refused) = check_framing(&req, peer.is_some()) {
            let mut res = refused.into_response();
            res.extensions_mut().insert(RouteName("invalid"));
            return res;
        }
        if let Some((dialect, refused)) = write_by_override(&inner.routes, &req) {
            let mut res = dialect::refusal(dialect, refused.into());
            res.extensions_mut().insert(RouteName("invalid"));
            return res;
        }
        // A replication would replace sessions' documents as given; a write under a node's
        // path may land on one.
        if let Some(dialect) = replicate::is_replication(&inner.routes, &req) {
            let mut res = dialect::refusal(dialect, replicate::refusal());
            res.extensions_mut().insert(RouteName("invalid"));
            return res;
        }
        if let Some(dialect) = replicate::is_node_write(&inner.routes, &req) {
            let mut res = dialect::refusal(dialect, replicate::node_refusal());
            res.extensions_mut().insert(RouteName("invalid"));
            return res;
        }
        if let Some((dialect, why)) = replicate::unlocked_write(&inner.routes, &req) {
            let mut res = dialect::refusal(dialect, replicate::unlocked_refusal(why));
            res.extensions_mut().insert(RouteName("invalid"));
            return res;
        }
        // Writes naming their documents in the body: a bulk write (CouchDB's `_bulk_docs`), and
        // a `POST /{db}` with an `_id` (the `PUT` of that document). Boxed: other requests'
        // futures do not carry their state.
        if let Some(bulk) = bulk::is_bulk(self, &req) {
            let peer = peer.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
            let mut res = Box::pin(self.bulk(req, bulk, peer)).await;
            res.extensions_mut().insert(RouteName("bulk"));
            return res;
        }
        let req = if matches!(*req.method(), http::Method::POST | http::Method::PUT) {
            match Box::pin(named::as_document_write(&inner.routes, req, inner.max_body)).await {
                Ok(req) => req,
                Err((dialect, refused)) => {
                    let mut res = dialect::refusal(dialect, refused);
                    res.extensions_mut().insert(RouteName("invalid"));
                    return res;
                }
            }
        } else {
            req
        };
        // The route's captures are owned: the path is not copied to find them.
        let found = inner.routes.find(req.method(), req.uri().path());
        let (route_name, mut res) = match found {
            // A request the store's protocol does not read as a write of the document (an
            // S3 subresource or copy, a CouchDB `_security`): forwarded untouched.
            Ok(Some((route, captures)))
                if !route
                    .dialect
                    .not_a_write(req.method(), req.uri(), req.headers(), &captures.session) =>
            {
                // Boxed: a forwarded request's future does not carry a write's state.
                let peer = peer.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
                (route.name, Box::pin(self.write(route, captures, req, peer)).await)
            }
            Ok(_) => (
                "forward",
                self.forward(req, peer.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0))))
                    .await,
            ),
            Err(ambiguous) => (
                "ambiguous",
                dialect::refusal(
                    ambiguous.dialect,
                    EdgeError::AmbiguousPath(ambiguous.to_string()).into(),
                ),
            ),
        };
        // A forwarded answer names no route: that is the default (and costs no map).
        if route_name != "forward" {
            res.extensions_mut().insert(RouteName(route_name));
        }
        res
    }

    /// A write on `route`: parsed, then through the write pipeline.
    async fn write(&self, route: &Route, captures: Captures, req: Request<Body>, peer: SocketAddr) -> Response<Body> {
        let inner = &self.inner;
        let _in_flight = inner.metrics.write_in_flight();
        let (parts, body) = req.into_parts();
        match request::parse(route, &captures, &parts, body, inner.max_body).await {
            Ok(mut write) => {
                // A delete or a serialized write is the client's request, forwarded in its
                // turn: it names the client as any forwarded request does.
                if let request::Action::Delete { headers, .. } | request::Action::Serialize { headers, .. } =
                    &mut write.action
                {
                    append_forwarded_for(headers, peer);
                }
                let (session, turn, started) = (write.session.to_string(), write.turn, Instant::now());
                let answer = inner.pipeline.submit(write).await;
                let outcome = answer.code();
                let res = dialect::answer(route.dialect, &captures, answer);
                // The status the agent gets, in the route's dialect (S3's 412 for a stale turn).
                log_write(route.name, &session, turn, res.status(), outcome, started);
                res
            }
            Err(refusal) => dialect::refusal(route.dialect, refusal),
        }
    }

    /// Forwards a request as is (streaming both ways), minus hop-by-hop headers and
    /// `X-Fencing-Token`, plus `X-Forwarded-For`. An `Upgrade` request (WebSocket) keeps its
    /// upgrade headers and, when the store switches protocols, becomes a tunnel copying bytes
    /// both ways. The upstream timeout runs from the end of the client's body to the response
    /// head.
    async fn forward(&self, mut req: Request<Body>, peer: SocketAddr) -> Response<Body> {
        let upstream = &self.inner.upstream;
        let upgrade = passthrough::upgrade_requested(req.headers());
        let version = req.version();
        let method = req.method().clone();
        let client_upgrade = upgrade.as_ref().map(|_| {
            let outliving = req.extensions().get::<crate::server::Outliving>().cloned();
            (hyper::upgrade::on(&mut req), outliving)
        });
        let (mut parts, body) = req.into_parts();
        parts.uri = match upstream.uri_of(std::mem::take(&mut parts.uri)) {
            Ok(u) => u,
            Err(e) => return EdgeError::InvalidPath(e.to_string()).into_response(),
        };
        crate::http::strip_hop_by_hop(&mut parts.headers);
        if let Some(protocol) = upgrade {
            passthrough::keep_upgrade(&mut parts.headers, protocol);
        }
        parts.headers.remove(header::HOST);
        // turnlock's own header to the store: never the client's to set.
        parts.headers.remove(&crate::upstream::FENCING_TOKEN);
        append_forwarded_for(&mut parts.headers, peer);
        parts.version = http::Version::HTTP_11;
        if let Err(e) = upstream.sign_forwarded(&mut parts) {
            return forward_failed(&method, e);
        }
        // A request without a body (most reads) is sent as it is: nothing to report.
        let mut client = None;
        let (req, body_sent) = if http_body::Body::is_end_stream(&body) {
            let sent = futures_util::future::Either::Left(std::future::ready(true));
            (Request::from_parts(parts, body), sent)
        } else {
            // A body of unknown length is sent chunked, whatever the method: hyper's client
            // would send a GET's or a HEAD's as no body at all.
            if !parts.headers.contains_key(header::CONTENT_LENGTH) {
                parts
                    .headers
                    .insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
            }
            let watch = crate::upstream::SendWatch::default();
            parts.extensions.insert(watch.clone());
            let (body, sent) = passthrough::Reported::new(body, upstream.timeout(), BODY_READ_TIMEOUT, watch);
            client = Some(body.client());
            (
                Request::from_parts(parts, body.boxed()),
                futures_util::future::Either::Right(sent),
            )
        };
        match upstream.forward(req, body_sent).await {
            Ok(mut res) => {
                let switched = res.status() == StatusCode::SWITCHING_PROTOCOLS;
                let res_protocol = res.headers().get(header::UPGRADE).cloned();
                // A switch nobody asked for is refused by the pool (the client could not read
                // what follows).
                if let (true, Some((client, outliving))) = (switched, client_upgrade) {
                    passthrough::tunnel(client, hyper::upgrade::on(&mut res), outliving);
                }
                let (mut parts, body) = res.into_parts();
                crate::http::strip_hop_by_hop(&mut parts.headers);
                if let (true, Some(protocol)) = (switched, res_protocol) {
                    passthrough::keep_upgrade(&mut parts.headers, protocol);
                }
                // A length the store stated more than once (`5, 5`, or two headers), which
                // hyper read as one, goes on as one (RFC 9110 8.6: not forwarded as it came).
                // Hyper refused the answer if the values differ: the first is the length.
                let mut lengths = parts.headers.get_all(header::CONTENT_LENGTH).iter();
                if let Some(first) = lengths.next() {
                    if lengths.next().is_some() || first.as_bytes().contains(&b',') {
                        let one = first.as_bytes().split(|b| *b == b',').next().unwrap_or_default();
                        if let Ok(one) = HeaderValue::from_bytes(one.trim_ascii()) {
                            parts.headers.insert(header::CONTENT_LENGTH, one);
                        }
                    }
                }
                // A 204 has no length to state (RFC 9110 8.6), which hyper enforces for
                // every method but HEAD.
                if parts.status == StatusCode::NO_CONTENT {
                    parts.headers.remove(header::CONTENT_LENGTH);
                }
                // The answer is the proxy's (an HTTP/1.0 store's answer does not close a
                // keep-alive client's connection): HTTP/1.1 to an HTTP/1.0 client too, which
                // hyper writes as HTTP/1.0, keeping a connection the client asked to keep
                // where the length is known (an HTTP/1.0 answer would close it).
                parts.version = if version == http::Version::HTTP_10 {
                    http::Version::HTTP_11
                } else {
                    version
                };
                // An answer before the client's body was sent in full (an early 413): the
                // connection cannot carry another request until the rest of the body is
                // read, so it closes after this answer, and the answer says so.
                if !switched
                    && client
                        .as_ref()
                        .is_some_and(|c| c.get() != passthrough::ClientBody::Complete)
                {
                    parts
                        .headers
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                let mut body = passthrough::Answer::new(body, upstream.timeout());
                if let Err(e) = body.first_look() {
                    let e = crate::upstream::UpstreamError::InvalidAnswer(crate::upstream::error_chain(&*e));
                    return forward_failed(&method, e);
                }
                Response::from_parts(parts, body.boxed())
            }
            // The client's body broke (a bad chunk, a cut connection): its request, not the
            // store, failed; neither answered nor counted as store trouble.
            Err(_)
                if client
                    .as_ref()
                    .is_some_and(|c| c.get() == passthrough::ClientBody::Stalled) =>
            {
                EdgeError::BodyTimeout(BODY_READ_TIMEOUT).into_response()
            }
            Err(e)
                if client
                    .as_ref()
                    .is_some_and(|c| c.get() == passthrough::ClientBody::Failed) =>
            {
                EdgeError::Invalid {
                    code: "body_read_failed",
                    // The body's own error, not the forward's wrapping of it.
                    message: format!(
                        "could not read the request body: {}",
                        e.to_string().rsplit(": ").next().unwrap_or_default()
                    ),
                }
                .into_response()
            }
            Err(e) => forward_failed(&method, e),
        }
    }
}

/// The proxy's own answer to a forwarded request the store did not answer (or answered with
/// something that is not HTTP), logged: a warning at most every few seconds, with the
/// number of others since, as an outage would otherwise flood the log.
fn forward_failed(method: &http::Method, e: crate::upstream::UpstreamError) -> Response<Body> {
    let code = e.code();
    if let Some(suppressed) = crate::telemetry::warn_allowed("forward failed") {
        tracing::warn!(
            %method,
            code,
            error = %e,
            suppressed,
            "a forwarded request got no usable answer from the store; it was answered with the proxy's own error"
        );
    }
    let mut res = EdgeError::Forward(e).into_response();
    res.extensions_mut().insert(ErrorCode(code));
    res
}

// === impl Proxy as a Service ===

/// The proxy as a `tower::Service` over any request body (hyper's, or one built in memory):
/// the agent's address comes from the request's [`crate::server::Conn`]; a request without
/// one (an in-process caller) is taken as coming from loopback.
impl<B> tower::Service<Request<B>> for Proxy
where
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Response<Body>, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let peer = req.extensions().get::<crate::server::Conn>().map(|c| c.peer);
        let req = req.map(crate::http::boxed);
        Box::pin(async move { Ok(this.handle(req, peer).await) })
    }
}

/// The log line of each write, at info; a failure of turnlock, Redis or the store is also
/// warned about, at most once per [`crate::telemetry::WARN_EVERY`].
fn log_write(route: &str, session: &str, turn: u64, answered: StatusCode, outcome: &str, started: Instant) {
    let status = answered.as_u16();
    let outcome = match outcome {
        "" => "ok",
        code => code,
    };
    let took_ms = started.elapsed().as_millis() as u64;
    tracing::info!(route, session, turn, status, outcome, took_ms, "write");
    if answered.is_server_error() {
        if let Some(suppressed) = crate::telemetry::warn_allowed("write failed") {
            tracing::warn!(route, status, outcome, suppressed, "writes failing");
        }
    }
}

/// What HTTP asks of any server before a route is looked at: `CONNECT` is not served
/// (turnlock forwards requests to its store, it opens no tunnels: 501), nor a standard
/// method spelled in another case (`put`: methods are case-sensitive, so it is no write to
/// turnlock, and a store that reads it as `PUT` would take a write past the lock: 501); a
/// request read off a connection (`from_network`) names its host in one valid `Host`, which HTTP/1.1 requires
/// (RFC 9112 §3.2: 400 otherwise; a request built in memory, for the service used as a
/// library, need not); a body is framed by `Content-Length` or by `chunked` once (another
/// transfer coding, such as `gzip`, or `chunked` twice, would reach the store or the merge
/// still coded: 501, RFC 9112 §6.1).
fn check_framing(req: &Request<Body>, from_network: bool) -> Result<(), EdgeError> {
    use http::Method;
    const STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::TRACE,
        Method::CONNECT,
    ];
    let method = req.method();
    if method == Method::CONNECT {
        return Err(EdgeError::NotImplemented {
            code: "method_not_supported",
            message: "CONNECT is not supported: turnlock forwards requests to its store and opens no tunnels".into(),
        });
    }
    if !STANDARD.contains(method)
        && STANDARD
            .iter()
            .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str()))
    {
        return Err(EdgeError::NotImplemented {
            code: "method_not_supported",
            message: format!(
                "method {method:?} is not supported: methods are case-sensitive, and {:?} is spelled so",
                method.as_str().to_ascii_uppercase()
            ),
        });
    }
    if from_network {
        let mut hosts = req.headers().get_all(header::HOST).iter();
        let host = hosts.next();
        let valid = match host {
            None => req.version() != http::Version::HTTP_11,
            // Empty when the target has no authority (RFC 9110 §7.2).
            // A host and port (RFC 9110 §7.2): no user information.
            Some(h) => {
                h.is_empty() || (!h.as_bytes().contains(&b'@') && http::uri::Authority::try_from(h.as_bytes()).is_ok())
            }
        };
        if !valid || hosts.next().is_some() {
            return Err(EdgeError::Invalid {
                code: "invalid_host",
                message: "a request names its host in one valid Host header (HTTP/1.1 requires it)".into(),
            });
        }
    }
    let mut codings = 0;
    for line in req.headers().get_all(header::TRANSFER_ENCODING) {
        let line = line.to_str().unwrap_or("?");
        for coding in line.split(',') {
            codings += 1;
            if codings > 1 || !coding.trim().eq_ignore_ascii_case("chunked") {
                return Err(EdgeError::NotImplemented {
                    code: "unsupported_transfer_coding",
                    message: format!("Transfer-Encoding {line:?} is not supported: only chunked, once, is"),
                });
            }
        }
    }
    Ok(())
}

/// Appends the agent's address to `X-Forwarded-For`: every prior hop kept, from all the
/// header's lines, as their bytes came (not only valid UTF-8).
/// Named once: a header named by a string is parsed again at each use.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

fn append_forwarded_for(headers: &mut http::HeaderMap, peer: SocketAddr) {
    let ip = peer.ip();
    // The name hashed once: most requests come with no prior hop.
    let mut entry = match headers.entry(X_FORWARDED_FOR) {
        http::header::Entry::Vacant(vacant) => {
            vacant.insert(forwarded_ip(ip));
            return;
        }
        http::header::Entry::Occupied(entry) => entry,
    };
    let mut prior = entry
        .iter()
        .map(HeaderValue::as_bytes)
        .filter(|v| !v.iter().all(u8::is_ascii_whitespace));
    let value = match (prior.next(), prior.next()) {
        (None, _) => Some(forwarded_ip(ip)),
        (Some(first), second) => {
            let mut joined = first.to_vec();
            for hop in second.into_iter().chain(prior) {
                joined.extend_from_slice(b", ");
                joined.extend_from_slice(hop);
            }
            joined.extend_from_slice(format!(", {ip}").as_bytes());
            HeaderValue::from_bytes(&joined).ok()
        }
    };
    if let Some(v) = value {
        entry.insert(v);
    }
}

/// The header value of an agent's address, written once per thread for the last address seen
/// (an agent reaches its sidecar from one address).
fn forwarded_ip(ip: std::net::IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(std::net::IpAddr, HeaderValue)>> = const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((seen, value)) if *seen == ip => value.clone(),
            _ => {
                let value =
                    HeaderValue::from_str(&ip.to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
                *last = Some((ip, value.clone()));
                value
            }
        }
    })
}

/// Headers with which a client sends one method for another (CouchDB, and many frameworks,
/// obey them on a `POST`).
/// Named once: a lookup by `&str` parses the name again on every request.
static METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// A request whose method override would make it a write route's request (a `POST` a store
/// serves as the `PUT` of a session's document): refused, as the store would take it past
/// the lock. The agent sends the method itself.
/// Answered in the dialect of the route it would be.
fn write_by_override(
    routes: &crate::routes::Routes,
    req: &Request<Body>,
) -> Option<(&'static crate::routes::Dialect, EdgeError)> {
    // One pass over the names present (usually a handful): most requests name none of the
    // overrides, and a lookup of each would hash its name.
    if !req.headers().keys().any(|name| METHOD_OVERRIDES.contains(name)) {
        return None;
    }
    for name in &METHOD_OVERRIDES {
        // Every line and every item of a list: a store or framework may read any of them
        // (Express's method-override takes a list's first, others the last line).
        let named = req
            .headers()
            .get_all(name)
            .iter()
            .flat_map(|value| value.as_bytes().split(|b| *b == b','))
            .filter_map(|item| http::Method::from_bytes(item.trim_ascii().to_ascii_uppercase().as_slice()).ok());
        for method in named {
            if method == req.method() {
                continue;
            }
            let dialect = match routes.find(&method, req.uri().path()) {
                Ok(None) => continue,
                Ok(Some((route, _))) => route.dialect,
                Err(ambiguous) => ambiguous.dialect,
            };
            return Some((
                dialect,
                EdgeError::Invalid {
                    code: "method_override",
                    message: format!(
                        "{name} would make this {} a write on the session: send the method itself",
                        req.method()
                    ),
                },
            ));
        }
    }
    None
}
