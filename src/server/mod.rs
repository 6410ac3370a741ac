//! Serving HTTP on a listener until shutdown: HTTP/1.1 with keep-alive and pipelining, limits
//! on slow and oversized request heads, and a graceful drain.
//!
//! HTTP/1.1 only: agents talk to their store over HTTP/1.1, and an HTTP/1-only connection
//! costs a fifth less memory than one that can also be upgraded to h2c.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::http::Body;

mod idle;
mod intercept;

use self::idle::{Activity, IdleIo, InFlight, Tracked, Trimmer};

/// A request's body as the server hands it to its service: hyper's, tracked so that the
/// connection counts as busy while it may still be read (see `idle`).
pub type RequestBody = Tracked<Incoming>;

pub use self::intercept::{is_own, original_dst, speaks_http, splice, SNIFF_WAIT};

/// How long a client may take to send a request head (slow clients are cut off), and a new
/// connection its first request.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a keep-alive connection may wait for its next request before it is closed (as
/// nginx's default). Longer than the idle timeouts of common HTTP client pools, so that the
/// client, not the server, closes an idle connection: a server closing it first races the
/// client's next request on it. An idle connection holds no buffers (see `idle`).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(75);
/// Most header lines accepted in one request.
pub const MAX_HEADERS: usize = 100;
/// Largest request head buffered, in bytes.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Told of every request the HTTP parser itself answered or cut (it never reached the
/// service): its status (0 when the connection was cut unanswered) and error code.
pub type OnUnparsed = Arc<dyn Fn(u16, &'static str) + Send + Sync>;

/// What hyper did with a request it could not parse, from the error its connection ended
/// with: the answer it wrote (431 head too large, 414 URI too long, 400 anything else), or a
/// head that took too long (cut unanswered, status 0). `None` for everything else (the client
/// went away, an HTTP/2 preface closed unanswered).
fn unparsed(error: &hyper::Error) -> Option<(u16, &'static str)> {
    use std::error::Error as _;
    if error.is_parse() {
        if error.is_parse_version_h2() {
            return None;
        }
        if error.is_parse_too_large() {
            // hyper tells the two apart only in its message.
            return Some(if error.to_string().contains("URI") {
                (414, "uri_too_long")
            } else {
                (431, "head_too_large")
            });
        }
        if error.to_string().contains("internal error") {
            return None;
        }
        return Some((400, "malformed_request"));
    }
    let timed_out = error
        .source()
        .and_then(|e| e.downcast_ref::<std::io::Error>())
        .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut);
    timed_out.then_some((0, "head_timeout"))
}

/// What the handler learns about the connection a request came on.
#[derive(Clone, Copy, Debug)]
pub struct Conn {
    pub peer: SocketAddr,
    /// The address the client meant to reach before a nat REDIRECT rule sent it here
    /// (`SO_ORIGINAL_DST`); only looked up when asked for.
    pub original_dst: Option<SocketAddr>,
}

/// Work a request starts that outlives its answer (the tunnel of an upgraded connection), run
/// on its connection's account: the shutdown drain waits for it as for an open connection,
/// until the grace runs out and ends it. Found in the extensions of requests that ask for an
/// upgrade.
#[derive(Clone)]
pub struct Outliving {
    connections: tokio_util::task::TaskTracker,
    hard_stop: CancellationToken,
}

impl Outliving {
    pub fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        let hard_stop = self.hard_stop.clone();
        self.connections.spawn(async move {
            tokio::select! {
                _ = work => {}
                _ = hard_stop.cancelled() => {}
            }
        });
    }
}

/// Serves `handler` on `listener` until `shutdown` fires, then stops accepting and gives open
/// connections `grace` to finish their requests (answers then carry `Connection: close`);
/// connections still open after it are closed.
pub async fn serve<H, F>(listener: TcpListener, handler: H, shutdown: CancellationToken, grace: Duration)
where
    H: Fn(Request<RequestBody>, SocketAddr) -> F + Clone + Send + Sync + Unpin + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let make = move |conn: Conn| {
        let handler = handler.clone();
        tower::service_fn(move |req| {
            let answer = handler(req, conn.peer);
            async move { Ok::<_, Infallible>(answer.await) }
        })
    };
    serve_with(listener, make, false, None, shutdown, grace).await
}

/// Like [`serve`], with a `tower::Service` made once per connection by `make` (told the
/// connection's details); `original_dst` says whether to look up each accepted connection's
/// original destination (transparent interception); `on_unparsed` is told of the requests
/// the HTTP parser answered itself.
///
/// Around the service, per connection (`Connection`): `Connection: close` put on the
/// answer once shutdown began (the
/// drain); the request counted busy until its body and its answer's body are done, so that
/// a connection idle for 5 ms (`idle::SHED_AFTER`) holds none of hyper's buffers (see `idle`).
pub async fn serve_with<M, S, B>(
    listener: TcpListener,
    make: M,
    original_dst: bool,
    on_unparsed: Option<OnUnparsed>,
    shutdown: CancellationToken,
    grace: Duration,
) where
    M: Fn(Conn) -> S + Send + 'static,
    S: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible> + Clone + Send + Unpin + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::http::BoxError>,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        // The request head's timeout is the socket's (`idle::IdleIo`): hyper's would make and
        // drop a timer for every request.
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_HEAD_BYTES)
        // A client may close its sending side once its request is sent (RFC 9112 §9.6): it is
        // still answered, and the request is not dropped half-way (a write is then finished,
        // logged and counted as any other).
        .half_close(true)
        .keep_alive(true);
    let connections = tokio_util::task::TaskTracker::new();
    let trimmer = Trimmer::default();
    let trimming = tokio::spawn(trimmer.clone().run(shutdown.clone()));
    let own = listener.local_addr().ok();
    // Asks the connections still open after the linger to close once idle.
    let graceful = CancellationToken::new();
    // Cancels the connections still open when the grace runs out.
    let hard_stop = CancellationToken::new();
    loop {
        let Some((stream, peer)) = accept(&listener, &shutdown).await else {
            break;
        };
        let _ = stream.set_nodelay(true);
        let conn = Conn {
            peer,
            original_dst: if original_dst {
                self::intercept::original_dst(&stream)
            } else {
                None
            },
        };
        let draining = Arc::new(shutdown.clone());
        let outliving = Outliving {
            connections: connections.clone(),
            hard_stop: hard_stop.clone(),
        };
        let activity = Arc::new(Activity::default());
        let stack = make(conn);
        let builder = builder.clone();
        let trimmer = trimmer.clone();
        let (graceful, hard) = (graceful.clone(), hard_stop.clone());
        let on_unparsed = on_unparsed.clone();
        let intercepted = conn
            .original_dst
            .filter(|dst| !own.is_some_and(|own| self::intercept::is_own(*dst, own)));
        let task = async move {
            // Transparent mode: what is not HTTP goes to its destination as raw TCP.
            // (Boxed: their state is not carried by every connection's task.)
            if let Some(dst) = intercepted {
                if !Box::pin(self::intercept::speaks_http(&stream)).await {
                    tokio::select! {
                        _ = Box::pin(self::intercept::splice(stream, peer, dst)) => {}
                        _ = hard.cancelled() => {}
                    }
                    return;
                }
            }
            let mut io = IdleIo::new(stream, activity.clone(), trimmer);
            // No buffers either while a new client has not sent its first request.
            if !next_bytes(&io, true, &graceful).await {
                return;
            }
            loop {
                // With upgrades: a WebSocket request passed through becomes a tunnel.
                let service = Connection {
                    inner: TowerToHyperService::new(stack.clone()),
                    draining: draining.clone(),
                    outliving: outliving.clone(),
                    activity: activity.clone(),
                };
                // Boxed: an idle connection's task keeps only the socket, not hyper's state.
                let mut conn = Box::new(builder.serve_connection(TokioIo::new(io), service).with_upgrades());
                // Polled at each wake of the connection (each request, each store answer):
                // the connection first, and only `graceful`, as `hard_stop` follows it.
                let ended = tokio::select! {
                    biased;
                    ended = &mut *conn => ended,
                    _ = graceful.cancelled() => {
                        std::pin::Pin::new(&mut *conn).graceful_shutdown();
                        tokio::select! {
                            ended = &mut *conn => ended,
                            _ = hard.cancelled() => return,
                        }
                    }
                };
                // Ended idle (not closed, nor upgraded): wait for the client's next request
                // on the bare socket, holding none of hyper's buffers meanwhile. hyper takes
                // the idle end as an incomplete message when it holds the first bytes of a
                // pipelined request: they go to the next connection.
                let idled = activity.idled();
                match ended {
                    Ok(()) if idled => {}
                    Err(error) if idled && error.is_incomplete_message() => {}
                    Ok(()) => return,
                    Err(error) => {
                        if let (Some(told), Some((status, code))) = (&on_unparsed, unparsed(&error)) {
                            told(status, code);
                        }
                        tracing::debug!(%error, %peer, "connection ended with an error");
                        return;
                    }
                }
                let Some(parts) = conn.into_parts() else { return };
                let back = parts.io.into_inner();
                if graceful.is_cancelled() {
                    return;
                }
                io = back.resume(parts.read_buf);
                if !next_bytes(&io, false, &graceful).await {
                    return;
                }
            }
        };
        connections.spawn(task);
    }
    drop(listener);
    trimming.abort();
    connections.close();
    let began = tokio::time::Instant::now();
    // Keep-alive clients that send during the linger are answered with `Connection: close`
    // instead of finding their connection gone under a request (no wait when none is open).
    let _ = tokio::time::timeout(linger(grace), connections.wait()).await;
    graceful.cancel();
    let left = grace.saturating_sub(began.elapsed());
    if tokio::time::timeout(left, connections.wait()).await.is_err() {
        tracing::warn!(?grace, "connections still open after the grace period: closing them");
    }
    hard_stop.cancel();
}

/// Waits, holding none of hyper's buffers, for the client's first or next bytes: false when
/// the connection is to be closed instead (a new one stayed quiet for [`HEADER_READ_TIMEOUT`],
/// an idle keep-alive one for [`KEEP_ALIVE_TIMEOUT`], or the server closes its idle
/// connections; a client that closed reads as bytes, the end of its stream). `hard_stop` follows `graceful`, so this
/// needs only the latter.
async fn next_bytes(io: &IdleIo, first: bool, graceful: &CancellationToken) -> bool {
    let (bytes, wait) = if first {
        (
            futures_util::future::Either::Left(io.first_bytes()),
            HEADER_READ_TIMEOUT,
        )
    } else {
        (futures_util::future::Either::Right(io.readable()), KEEP_ALIVE_TIMEOUT)
    };
    tokio::select! {
        ready = tokio::time::timeout(wait, bytes) => matches!(ready, Ok(Ok(()))),
        _ = graceful.cancelled() => false,
    }
}

/// The service hyper calls on one connection: puts [`Outliving`] into the extensions of
/// requests asking for an upgrade, `Connection:
/// close` on each answer once shutdown began (the drain) or when the connection ends after it,
/// and counts the request as busy from the moment hyper has read its head (for `idle`).
struct Connection<S> {
    inner: TowerToHyperService<S>,
    draining: Arc<CancellationToken>,
    outliving: Outliving,
    activity: Arc<Activity>,
}

// === impl Connection ===

impl<S, R> hyper::service::Service<Request<Incoming>> for Connection<S>
where
    S: Service<Request<RequestBody>, Response = Response<R>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    R: http_body::Body + Send + 'static,
{
    type Response = Response<Tracked<R>>;
    type Error = Infallible;
    type Future = Answer<<TowerToHyperService<S> as hyper::service::Service<Request<RequestBody>>>::Future>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        // hyper keeps an HTTP/1.1 connection whose request named an `Upgrade` only if it is
        // upgraded: any other answer is its last, and says so.
        let asked_upgrade = req.headers().contains_key(http::header::UPGRADE);
        if asked_upgrade {
            req.extensions_mut().insert(self.outliving.clone());
        }
        // Busy from here (hyper has the head) until the answer's body is dropped, and while
        // the request's body may still be read.
        let request = self.activity.begin();
        let reading = (!http_body::Body::is_end_stream(req.body())).then(|| self.activity.hold());
        self.activity.take_unread();
        let version = req.version();
        Answer {
            answer: hyper::service::Service::call(&self.inner, req.map(|body| Tracked::request(body, reading))),
            version,
            asked_upgrade,
            draining: self.draining.clone(),
            request: Some(request),
        }
    }
}

pin_project_lite::pin_project! {
    /// The answer of [`Connection`]'s service on its way (a concrete future: nothing boxed
    /// per request).
    struct Answer<F> {
        #[pin]
        answer: F,
        version: http::Version,
        asked_upgrade: bool,
        draining: Arc<CancellationToken>,
        request: Option<InFlight>,
    }
}

impl<F, R> Future for Answer<F>
where
    F: Future<Output = Result<Response<R>, Infallible>>,
    R: http_body::Body,
{
    type Output = Result<Response<Tracked<R>>, Infallible>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let Ok(mut res) = std::task::ready!(this.answer.poll(cx));
        let Some(request) = this.request.take() else {
            // Polled again after it was ready: hyper never does.
            return std::task::Poll::Pending;
        };
        let activity = request.activity();
        let version = *this.version;
        // A body left unread (a refusal that did not need it) makes hyper close the
        // connection, and so does an HTTP/1.0 answer of unknown length (it ends with
        // the connection): the answer says so, as it does once the drain began.
        let ends_with_connection =
            version == http::Version::HTTP_10 && http_body::Body::size_hint(res.body()).exact().is_none();
        let upgrade_refused = *this.asked_upgrade && res.status() != http::StatusCode::SWITCHING_PROTOCOLS;
        if this.draining.is_cancelled() || activity.take_unread() || ends_with_connection || upgrade_refused {
            close_after(&mut res);
            if version == http::Version::HTTP_10 {
                // Else hyper, answering an HTTP/1.0 client that asked for keep-alive with
                // an HTTP/1.1 answer (a store's, or one of ours), adds `keep-alive` to it.
                *res.version_mut() = http::Version::HTTP_10;
            }
        }
        if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            activity.tunnel();
        }
        std::task::Poll::Ready(Ok(res.map(|body| Tracked::answer(body, request))))
    }
}

/// How long open connections keep being served (each answer closing its connection) after
/// shutdown began, before idle ones are closed: a quarter of the grace, at most 500 ms (less
/// when every connection has closed by then).
pub fn linger(grace: Duration) -> Duration {
    (grace / 4).min(Duration::from_millis(500))
}

/// Marks a response as the connection's last.
fn close_after<B>(res: &mut Response<B>) {
    res.headers_mut()
        .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
}

/// A server running on its own task: its address, and how to stop it.
pub struct Serving {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    pub fn new(addr: SocketAddr, shutdown: CancellationToken, task: tokio::task::JoinHandle<()>) -> Self {
        Self { addr, shutdown, task }
    }

    /// Shuts down gracefully and waits until it has.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }

    /// The token that starts the graceful shutdown (for signal handlers).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until the server has stopped (after its shutdown token fired).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// The next connection, or `None` once `shutdown` fires. Accept errors (out of descriptors, a
/// transient network error) are logged and retried after a pause instead of spinning.
pub async fn accept(
    listener: &TcpListener,
    shutdown: &CancellationToken,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok(a) => return Some(a),
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}
