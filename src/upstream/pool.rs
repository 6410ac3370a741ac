//! The store's connections: HTTP/1.1 connections to its one address, kept open between
//! requests and reused most recently used first.
//!
//! A request takes an idle connection when one is ready, else opens one while the cap
//! ([`CappedConnector`]) allows, else waits for whichever comes first: a connection given back
//! (handed to the longest waiting request first) or a free permit. A connection goes back to the idle list as soon as it can take the next
//! request (for most answers, when the answer's head arrives: its body is already read); one
//! still streaming its answer's body goes back once that body is read. Idle connections are
//! closed after the idle timeout by a background timer, and a connection found closed at
//! checkout is dropped. A request that a reused connection never wrote (the store had closed
//! it) is sent again on the next connection: nothing was written, so it cannot apply twice.
//!
//! One store means one pool key: no per-request hashing of the store's address. Taking an
//! idle connection is not awaited and allocates nothing; only opening a connection or waiting
//! for one (a boxed future) does. Every future of the request path is kept small, as each
//! request's own future holds them and is moved whole more than once.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::connect::{CappedConnector, Slot};
use super::error::error_chain;
use super::UpstreamError;
use crate::http::Body;

/// A pool of connections to one store. Clones share the pool.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    connector: CappedConnector,
    /// The store's scheme and authority, as the connector takes them.
    dst: Uri,
    /// The `Host` of a request that names none.
    host: HeaderValue,
    state: Mutex<State>,
    /// The health check's own connection, kept from one check to the next ([`Pool::probe`]).
    probe: Mutex<Option<(Taken, Instant)>>,
    idle_timeout: Duration,
    reaper_started: AtomicBool,
}

#[derive(Default)]
struct State {
    /// Ready connections, the most recently used last.
    idle: Vec<Idle>,
    /// Requests waiting at the cap, the longest waiting first: a connection given back goes
    /// to the first of them still waiting, so they are served in the order they came.
    waiters: VecDeque<oneshot::Sender<Taken>>,
}

struct Idle {
    tx: SendRequest<Body>,
    slot: Slot,
    since: Instant,
}

/// A store connection taken for a request still to be made ([`Pool::reserve`]); back to the
/// pool when dropped unused.
pub struct Reserved {
    pool: Pool,
    conn: Option<Taken>,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.give_back(conn.tx, conn.slot);
        }
    }
}

/// A connection taken from the pool or just opened.
struct Taken {
    tx: SendRequest<Body>,
    slot: Slot,
    reused: bool,
}

// === impl Pool ===

impl Pool {
    /// A pool of connections to `dst` (`scheme://authority`), opened by `connector`.
    pub fn new(connector: CappedConnector, dst: Uri, idle_timeout: Duration) -> Result<Self, String> {
        let authority = dst.authority().ok_or_else(|| format!("store URL {dst} has no host"))?;
        // The authority as written, without a scheme's default port (as clients send it).
        let default_port = match dst.scheme_str() {
            Some("https") => 443,
            _ => 80,
        };
        let host = match authority.port_u16() {
            Some(port) if port == default_port => authority.host().to_owned(),
            _ => authority.as_str().to_owned(),
        };
        let host = HeaderValue::from_str(&host).map_err(|e| format!("store URL {dst}: {e}"))?;
        Ok(Self {
            shared: Arc::new(Shared {
                connector,
                dst,
                host,
                state: Mutex::new(State::default()),
                probe: Mutex::new(None),
                idle_timeout,
                reaper_started: AtomicBool::new(false),
            }),
        })
    }

    /// Sends `req` (its URI absolute or origin-form) on a pooled connection and waits for the
    /// answer's head. A reused connection found closed before it wrote the request is passed
    /// over for the next one.
    ///
    /// A request that finds no connection free and none can be opened by `deadline` fails
    /// as not sent (nothing was written), saying so. `answer_within` bounds the wait for the
    /// answer's head from the moment the request is handed to its connection: time spent
    /// waiting for a connection never shortens the store's time to answer (a write sent
    /// with almost no time left would time out with its outcome unknown, though applied).
    pub fn send(
        &self,
        req: Request<Body>,
        deadline: Instant,
        answer_within: Option<Duration>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + '_ {
        self.send_on(None, req, deadline, answer_within, None)
    }

    /// A connection for a request still to be made, waiting for one until `deadline` as
    /// [`Pool::send`] does: a write whose ordering must outlive the store's answer (a commit
    /// slot) takes its connection first, then makes sure of its order, then sends.
    pub async fn reserve(&self, deadline: Instant) -> Result<Reserved, UpstreamError> {
        let conn = match self.take_idle() {
            Some(conn) => conn,
            None => self.open_or_wait(deadline).await?,
        };
        Ok(self.reserved(conn))
    }

    /// Like [`Pool::send`], on `reserved` (or, when the store closed it meanwhile, on the next
    /// connection until `deadline`).
    pub fn send_reserved(
        &self,
        mut reserved: Reserved,
        req: Request<Body>,
        deadline: Instant,
        answer_within: Option<Duration>,
    ) -> impl Future<Output = Result<Response<Incoming>, UpstreamError>> + Send + '_ {
        self.send_on(reserved.conn.take(), req, deadline, answer_within, None)
    }

    /// Like [`Pool::send_reserved`], and the connection that carried the request stays in
    /// `reserved` for the next one (a write-back after its document's read: it does not
    /// queue at the cap a second time). It takes the next request once this answer's body
    /// is read; one the store closed meanwhile is passed over for another.
    pub async fn send_keeping(
        &self,
        reserved: &mut Reserved,
        req: Request<Body>,
        deadline: Instant,
        answer_within: Option<Duration>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut conn = reserved.conn.take();
        if let Some(c) = conn.as_mut() {
            if !c.tx.is_ready() && !matches!(tokio::time::timeout_at(deadline, c.tx.ready()).await, Ok(Ok(()))) {
                conn = None;
            }
        }
        self.send_on(conn, req, deadline, answer_within, Some(&mut reserved.conn))
            .await
    }

    /// Like [`Pool::send`], on a connection opened for this request (one that cannot be
    /// stale), given to the pool afterwards.
    pub async fn send_fresh(
        &self,
        req: Request<Body>,
        deadline: Instant,
        answer_within: Option<Duration>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut reserved = self.reserve_fresh(deadline).await?;
        self.send_on(reserved.conn.take(), req, deadline, answer_within, None)
            .await
    }

    /// Like [`Pool::reserve`], a connection opened for the request to come (one that cannot
    /// be stale): at the cap, a connection that served a request before (an idle one, else
    /// the first given back, in the order requests wait) is closed, as it may be as stale as
    /// the one that failed, and its place goes to the one opened for this request (not back
    /// to the cap, where the requests waiting there could take it turn after turn).
    pub async fn reserve_fresh(&self, deadline: Instant) -> Result<Reserved, UpstreamError> {
        loop {
            if let Some(permit) = self.shared.connector.try_permit() {
                let conn = Box::pin(self.open(permit)).await?;
                return Ok(self.reserved(conn));
            }
            let old = match self.take_idle() {
                Some(idle) => idle,
                None => match self.reserve(deadline).await?.conn.take() {
                    Some(conn) => conn,
                    None => return Err(self.none_in_time()),
                },
            };
            if !old.reused {
                // Opened for this request meanwhile (a place came free).
                return Ok(self.reserved(old));
            }
            let place = old.slot.take_permit();
            drop(old);
            if let Some(permit) = place {
                let conn = Box::pin(self.open(permit)).await?;
                return Ok(self.reserved(conn));
            }
            // It had closed meanwhile and given its place back: in line again (the wait is
            // bounded by `deadline`).
        }
    }

    /// `conn`, held for a request to come; back to this pool when dropped unused.
    fn reserved(&self, conn: Taken) -> Reserved {
        Reserved {
            pool: self.clone(),
            conn: Some(conn),
        }
    }

    /// Sends `req` on `conn`, or on a connection from the pool; the connection that carried
    /// it goes back to the pool, or into `keep` when given. The futures of this path are
    /// kept small (a request's own future holds them): taking an idle connection is not
    /// awaited, and opening one or waiting for one is boxed.
    async fn send_on(
        &self,
        conn: Option<Taken>,
        mut req: Request<Body>,
        deadline: Instant,
        answer_within: Option<Duration>,
        keep: Option<&mut Option<Taken>>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        self.prepare(&mut req);
        // A store may answer `HEAD` as it answers `GET`, body and all (nothing in the answer's
        // head says so): those bytes would be read as the next request's answer. The
        // connection is not used again after a `HEAD`.
        let head = req.method() == http::Method::HEAD;
        let upgrade_asked = req.headers().contains_key(header::UPGRADE);
        let mut conn = match conn.or_else(|| self.take_idle()) {
            Some(conn) => conn,
            None => self.open_or_wait(deadline).await?,
        };
        loop {
            // An upload's watcher learns which connection carries it.
            if let Some(watch) = req.extensions().get::<super::SendWatch>() {
                watch.watch(&conn.slot);
            }
            let sent = conn.tx.try_send_request(req);
            let (mut failed, reused, slot) = if conn.tx.is_closed() {
                // The connection's task ended as the request was handed over: it may have
                // gone into the connection's channel after the channel was emptied for the
                // last time (its sender and its closing receiver race there), and nothing
                // would ever take it out and answer it: it would wait out the timeout, never
                // sent. Dropping the connection's handle, the channel's last sender, frees
                // it: it comes back unsent (or with the error the connection ended with, had
                // it been taken; or answered, had the answer come just before the end).
                let Taken { tx, slot, reused } = conn;
                drop(tx);
                match sent.await {
                    Ok(res) => return taken(res, upgrade_asked, &slot),
                    Err(failed) => (failed, reused, slot),
                }
            } else {
                let answered = match answer_within {
                    Some(limit) => match tokio::time::timeout(limit, sent).await {
                        Ok(answered) => answered,
                        Err(_) => return Err(UpstreamError::Timeout(limit)),
                    },
                    None => sent.await,
                };
                match answered {
                    Ok(res) => {
                        // Refused: the connection is not given back (dropped, it closes).
                        let res = taken(res, upgrade_asked, &conn.slot)?;
                        if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                            // A tunnel now (its place given back).
                        } else if head {
                            // Dropped: the connection closes once its answer is read.
                        } else if let Some(keep) = keep {
                            *keep = Some(Taken { reused: true, ..conn });
                        } else if conn.slot.capped() {
                            self.give_back(conn.tx, conn.slot);
                        }
                        // Else opened outside the cap for a health check: closed once answered.
                        return Ok(res);
                    }
                    Err(failed) => (failed, conn.reused, conn.slot.clone()),
                }
            };
            let unsent = failed.take_message();
            let error = failed.into_error();
            match unsent {
                Some(unsent) if reused => {
                    tracing::debug!(error = %error, "pooled store connection closed before the request was written; using another");
                    // Its place under the cap is free for the next one (at the cap, the
                    // wait below would otherwise be for this dead connection's place).
                    slot.release();
                    req = unsent;
                    conn = match self.take_idle() {
                        Some(conn) => conn,
                        None => self.open_or_wait(deadline).await?,
                    };
                }
                Some(_) => return Err(UpstreamError::NotSent(error_chain(&error))),
                None if error.is_parse() || error.is_parse_status() || error.is_parse_too_large() => {
                    return Err(UpstreamError::InvalidAnswer(error_chain(&error)))
                }
                None => return Err(UpstreamError::Unreachable(error_chain(&error))),
            }
        }
    }

    /// Names the store in `Host` when the request names none, and puts its URI in origin
    /// form (the path and query only), as a request to a server (not a proxy) is written.
    fn prepare(&self, req: &mut Request<Body>) {
        if !req.headers().contains_key(header::HOST) {
            req.headers_mut().insert(header::HOST, self.shared.host.clone());
        }
        if req.uri().scheme().is_some() || req.uri().authority().is_some() {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = req.uri().path_and_query().cloned();
            if let Ok(uri) = Uri::from_parts(parts) {
                *req.uri_mut() = uri;
            }
        }
    }

    /// A new connection while the cap allows, else the first given back (or a permit freed
    /// by a connection that closed), until `deadline`. Boxed: its future is large (connect,
    /// TLS and handshake state) and every request's future would carry it.
    async fn open_or_wait(&self, deadline: Instant) -> Result<Taken, UpstreamError> {
        match Box::pin(tokio::time::timeout_at(deadline, self.open_or_wait_unbounded())).await {
            Ok(conn) => conn,
            Err(_) => Err(self.none_in_time()),
        }
    }

    /// Why a request got no connection: the store was never asked.
    fn none_in_time(&self) -> UpstreamError {
        UpstreamError::NotSent(format!(
            "no connection to the store could be had in time: {} are allowed (--upstream-max-connections) and none became free",
            self.shared.connector.max()
        ))
    }

    async fn open_or_wait_unbounded(&self) -> Result<Taken, UpstreamError> {
        if let Some(permit) = self.shared.connector.try_permit() {
            return self.open(permit).await;
        }
        let (handed, mut given) = oneshot::channel();
        {
            let mut state = self.shared.lock();
            // Given back since the look at the idle list: taken now.
            if let Some(conn) = state.take_idle(self.shared.idle_timeout) {
                return Ok(conn);
            }
            state.waiters.retain(|w| !w.is_closed());
            state.waiters.push_back(handed);
        }
        tokio::select! {
            conn = &mut given => match conn {
                Ok(conn) => Ok(conn),
                // The pool is going away.
                Err(_) => Err(UpstreamError::NotSent("the store's connection pool closed".to_owned())),
            },
            permit = self.shared.connector.permit() => {
                let permit = permit.map_err(|e| not_sent(&*e))?;
                // A connection handed over at the same moment is used, not dropped.
                given.close();
                if let Ok(conn) = given.try_recv() {
                    drop(permit);
                    return Ok(conn);
                }
                self.open(permit).await
            }
        }
    }

    /// The most recently used idle connection that is still open and within its idle time.
    fn take_idle(&self) -> Option<Taken> {
        self.shared.lock().take_idle(self.shared.idle_timeout)
    }

    /// Sends a health check on a connection of its own (with `fresh`, a new one), opened
    /// outside the cap and kept from one check to the next, as a load balancer's active
    /// checks keep theirs. The check never waits behind the requests queued at the cap, so a
    /// pool in full use is not taken for a store that is down; and no request follows a
    /// check's answer on the same connection, where anything a store sent after that answer
    /// (bytes beyond its framing) would be taken for the request's own answer.
    pub async fn probe(
        &self,
        req: Request<Body>,
        answer_within: Duration,
        fresh: bool,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let kept = if fresh {
            None
        } else {
            self.shared
                .probe
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .filter(|(c, since)| c.tx.is_ready() && since.elapsed() < self.shared.idle_timeout)
        };
        let conn = match kept.map(|(conn, _)| conn) {
            // Not counted as reused: a kept connection the store has closed fails the check
            // with `NotSent`, and the caller sends it again with `fresh`, never on the pool's.
            Some(conn) => Taken { reused: false, ..conn },
            None => Box::pin(self.open_permit(None)).await?,
        };
        let mut keep = None;
        let answered = self
            .send_on(
                Some(conn),
                req,
                Instant::now() + answer_within,
                Some(answer_within),
                Some(&mut keep),
            )
            .await;
        if let Some(conn) = keep {
            *self.shared.probe.lock().unwrap_or_else(PoisonError::into_inner) = Some((conn, Instant::now()));
        }
        answered
    }

    /// Opens a connection under `permit` and starts its task.
    async fn open(&self, permit: tokio::sync::OwnedSemaphorePermit) -> Result<Taken, UpstreamError> {
        self.open_permit(Some(permit)).await
    }

    /// Opens a connection, under `permit` or outside the cap, and starts its task.
    async fn open_permit(&self, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> Result<Taken, UpstreamError> {
        let io = self
            .shared
            .connector
            .connect_with(permit, self.shared.dst.clone())
            .await
            .map_err(|e| not_sent(&*e))?;
        let slot = io.slot();
        let (tx, conn) = http1::Builder::new().handshake(io).await.map_err(|e| not_sent(&e))?;
        tokio::spawn(async move {
            // With upgrades: a WebSocket answer (101) hands the connection to the tunnel.
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %error_chain(&e), "store connection ended");
            }
        });
        Ok(Taken {
            tx,
            slot,
            reused: false,
        })
    }

    /// Returns a connection after its answer's head: to the idle list now if it can take the
    /// next request, else once it can (its answer's body still streaming).
    fn give_back(&self, mut tx: SendRequest<Body>, slot: Slot) {
        if tx.is_ready() {
            self.park(tx, slot);
        } else if !tx.is_closed() {
            let pool = self.clone();
            tokio::spawn(async move {
                if tx.ready().await.is_ok() {
                    pool.park(tx, slot);
                }
            });
        }
    }

    /// To the first request still waiting for a connection, else to the idle list.
    fn park(&self, tx: SendRequest<Body>, slot: Slot) {
        self.start_reaper();
        let mut conn = Taken { tx, slot, reused: true };
        let mut state = self.shared.lock();
        while let Some(waiter) = state.waiters.pop_front() {
            match waiter.send(conn) {
                Ok(()) => return,
                // It stopped waiting (its request ended, or it opened a connection).
                Err(back) => conn = back,
            }
        }
        state.idle.push(Idle {
            tx: conn.tx,
            slot: conn.slot,
            since: Instant::now(),
        });
    }

    /// Starts the timer that closes idle connections past the idle timeout (once per pool,
    /// on the runtime that first gives a connection back). It ends with the pool.
    fn start_reaper(&self) {
        if self.shared.reaper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let period = (self.shared.idle_timeout / 2).max(Duration::from_millis(10));
        let shared: Weak<Shared> = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else { return };
                shared.close_expired();
            }
        });
    }
}

// === impl Shared ===

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the idle connections past the idle timeout, and forgets closed ones.
    fn close_expired(&self) {
        let expired: Vec<Idle> = {
            let mut state = self.lock();
            let (keep, expired) = std::mem::take(&mut state.idle)
                .into_iter()
                .partition(|entry| !entry.tx.is_closed() && entry.since.elapsed() < self.idle_timeout);
            state.idle = keep;
            expired
        };
        // Dropped outside the lock: each ends its connection's task, which closes the socket.
        drop(expired);
    }
}

/// Why an answer cannot be passed on, if it cannot: its head states its length two ways
/// (`Content-Length` and `Transfer-Encoding`, which RFC 9112 6.3 bids a client to treat as an
/// error: a store, or something in front of it, that frames one way and is read the other
/// desynchronizes the connection); its body is in a transfer coding other than `chunked`
/// once (hyper undoes `chunked` once, and `Transfer-Encoding` is not passed on, so the
/// client would get the coded bytes unannounced); or it switched protocols for a request
/// that asked for no upgrade (the client could not read what follows). Each is an answer
/// that is not HTTP the client could be given: to a write, the outcome is unknown (the
/// store had the request).
fn unreadable(res: &Response<Incoming>, upgrade_asked: bool) -> Option<UpstreamError> {
    let headers = res.headers();
    if headers.contains_key(header::TRANSFER_ENCODING) {
        if headers.contains_key(header::CONTENT_LENGTH) {
            return Some(UpstreamError::InvalidAnswer(
                "framed both by Content-Length and by Transfer-Encoding".to_owned(),
            ));
        }
        let codings: Vec<&[u8]> = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .collect();
        if !matches!(codings.as_slice(), [only] if only.eq_ignore_ascii_case(b"chunked")) {
            let named = codings
                .iter()
                .map(|c| String::from_utf8_lossy(c))
                .collect::<Vec<_>>()
                .join(", ");
            return Some(UpstreamError::InvalidAnswer(format!(
                "transfer coding \"{named}\" is not supported (only chunked, once)"
            )));
        }
    }
    if res.status() == http::StatusCode::SWITCHING_PROTOCOLS && !upgrade_asked {
        return Some(UpstreamError::InvalidAnswer(
            "it switched protocols (101) for a request that asked for no upgrade".to_owned(),
        ));
    }
    None
}

/// An answer as it is passed on: refused when it is not HTTP the client could be given
/// ([`unreadable`]: where it ends is in doubt, or the connection no longer speaks HTTP); a
/// switch of protocols gives the connection's place under the cap back (a tunnel now, no
/// longer one of the store connections requests share).
fn taken(res: Response<Incoming>, upgrade_asked: bool, slot: &Slot) -> Result<Response<Incoming>, UpstreamError> {
    if let Some(refused) = unreadable(&res, upgrade_asked) {
        return Err(refused);
    }
    if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        slot.release();
    }
    Ok(res)
}

/// A failure before anything was written to the store.
fn not_sent(e: &(dyn std::error::Error + 'static)) -> UpstreamError {
    UpstreamError::NotSent(error_chain(e))
}

// === impl State ===

impl State {
    /// The most recently used idle connection that is still open and within `idle_timeout`;
    /// closed or expired ones met on the way are dropped.
    fn take_idle(&mut self, idle_timeout: Duration) -> Option<Taken> {
        while let Some(entry) = self.idle.pop() {
            if entry.tx.is_ready() && entry.since.elapsed() < idle_timeout {
                return Some(Taken {
                    tx: entry.tx,
                    slot: entry.slot,
                    reused: true,
                });
            }
        }
        None
    }
}
