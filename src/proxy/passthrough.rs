//! What pass-through forwarding needs beyond copying a request: knowing when the client's
//! body has been sent (the upstream timeout starts there), and WebSocket / `Upgrade` tunnels.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// A request body that reports when it has been read to its end (or failed, or was dropped),
/// and notices a store that stopped taking it.
pub struct Reported {
    inner: crate::http::Body,
    done: Option<oneshot::Sender<()>>,
    /// When the last frame was handed over and not yet followed by another poll: the store's
    /// side is not taking more. `None` while waiting for the client.
    handed: Arc<Mutex<Option<Instant>>>,
    /// Whether the client's body failed, and how ([`ClientBody`]).
    client: Arc<AtomicU8>,
    /// How long the client may send nothing while the store waits for more.
    idle: Duration,
    /// When the client must have sent more: armed while the store waits for the client.
    stalled_at: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// What became of the client's body, as [`Reported::client`] tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientBody {
    /// Still being sent.
    Fine = 0,
    /// It broke (a bad chunk, a connection cut mid-body).
    Failed = 1,
    /// The client sent nothing for the idle limit while the store waited for more.
    Stalled = 2,
    /// Sent to its end.
    Complete = 3,
}

/// How a forward learns what became of the client's body ([`Reported::client`]).
#[derive(Clone)]
pub struct ClientState(Arc<AtomicU8>);

impl ClientState {
    pub fn get(&self) -> ClientBody {
        match self.0.load(Ordering::Relaxed) {
            1 => ClientBody::Failed,
            2 => ClientBody::Stalled,
            3 => ClientBody::Complete,
            _ => ClientBody::Fine,
        }
    }
}

impl Reported {
    /// The body, and a future that resolves `true` once the body is complete, or `false` when
    /// the store took no more of it for `stall` although the client had sent more: no frame
    /// taken, and nothing more taken off the connection it is sent on (`watch`: a store that
    /// reads slowly but steadily takes bytes all along, while the connection's socket buffer,
    /// full, lets no new frame through for seconds at a time). A client
    /// that sends nothing for `idle` while the store waits for more fails the body (as
    /// nginx's `client_body_timeout` does): a stalled upload does not hold a store connection.
    pub fn new(
        inner: crate::http::Body,
        stall: Duration,
        idle: Duration,
        watch: crate::upstream::SendWatch,
    ) -> (Self, impl std::future::Future<Output = bool>) {
        let (tx, mut rx) = oneshot::channel();
        let handed = Arc::new(Mutex::new(None));
        let mut body = Self {
            inner,
            done: Some(tx),
            handed: handed.clone(),
            client: Arc::default(),
            idle,
            stalled_at: None,
        };
        if body.inner.is_end_stream() {
            body.complete();
        }
        let tick = (stall / 4).max(Duration::from_millis(10));
        let sent = async move {
            let mut taken = None;
            loop {
                tokio::select! {
                    _ = &mut rx => return true,
                    _ = tokio::time::sleep(tick) => {
                        let moved = watch.moved(&mut taken);
                        let mut since = lock(&handed);
                        match *since {
                            // The store took more since the last look: not stalled.
                            Some(_) if moved => *since = Some(Instant::now()),
                            Some(t) if t.elapsed() >= stall => return false,
                            _ => {}
                        }
                    }
                }
            }
        };
        (body, sent)
    }

    /// What became of the client's body: a forward that failed because it failed or stalled
    /// is the client's doing.
    pub fn client(&self) -> ClientState {
        ClientState(self.client.clone())
    }

    fn complete(&mut self) {
        self.client.store(ClientBody::Complete as u8, Ordering::Relaxed);
        self.finish();
    }

    fn finish(&mut self) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(());
        }
    }
}

fn lock(m: &Mutex<Option<Instant>>) -> std::sync::MutexGuard<'_, Option<Instant>> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl HttpBody for Reported {
    type Data = Bytes;
    type Error = crate::http::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        *lock(&self.handed) = None;
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if !matches!(polled, Poll::Pending) {
            self.stalled_at = None;
        }
        match &polled {
            Poll::Ready(Some(Err(_))) => {
                self.client.store(ClientBody::Failed as u8, Ordering::Relaxed);
                self.finish();
            }
            Poll::Ready(None) => self.complete(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.complete(),
            Poll::Ready(Some(Ok(_))) => *lock(&self.handed) = Some(Instant::now()),
            Poll::Pending => {
                let idle = self.idle;
                let stalled_at = self
                    .stalled_at
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                if stalled_at.as_mut().poll(cx).is_ready() {
                    self.client.store(ClientBody::Stalled as u8, Ordering::Relaxed);
                    self.finish();
                    return Poll::Ready(Some(Err(format!(
                        "the client sent none of its body for {} s",
                        idle.as_secs_f64()
                    )
                    .into())));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A store's answer body passed on to the client, given up when the store sends none of it
/// for the upstream timeout (as nginx's `proxy_read_timeout` does between two reads): the
/// client's answer is cut (it sees it end short) and the store's connection closed, instead
/// of both waiting on a store that stalled. No timer is armed while the body comes as fast as
/// it is read (most answers are whole when their head arrives).
pub struct Answer {
    inner: hyper::body::Incoming,
    /// Taken before the head went on ([`Answer::first_look`]), given first.
    first: Option<Frame<Bytes>>,
    limit: Duration,
    /// When the store must have sent more; armed while waiting for it.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl Answer {
    pub fn new(inner: hyper::body::Incoming, limit: Duration) -> Self {
        Self {
            inner,
            first: None,
            limit,
            stall: None,
            armed: false,
        }
    }

    /// Looks, without waiting, at what of the body already came: a body that failed before
    /// any of it was passed on (a chunked answer whose first chunk size is not a number) is
    /// the store's error to answer, as a 502, rather than a client connection closed with no
    /// answer at all. What came is kept and passed on first. Only for answers whose length
    /// the head does not state (their framing is read as the body comes).
    pub fn first_look(&mut self) -> Result<(), crate::http::BoxError> {
        if self.inner.size_hint().exact().is_some() {
            return Ok(());
        }
        let polled = futures_util::FutureExt::now_or_never(http_body_util::BodyExt::frame(&mut self.inner));
        match polled {
            Some(Some(Err(e))) => Err(e.into()),
            Some(Some(Ok(frame))) => {
                self.first = Some(frame);
                Ok(())
            }
            Some(None) | None => Ok(()),
        }
    }
}

impl HttpBody for Answer {
    type Data = Bytes;
    type Error = crate::http::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                let limit = this.limit;
                let deadline = tokio::time::Instant::now() + limit;
                let stall = this
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !this.armed {
                    stall.as_mut().reset(deadline);
                    this.armed = true;
                }
                if stall.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                if let Some(suppressed) = crate::telemetry::warn_allowed("store stalled mid-answer") {
                    tracing::warn!(
                        timeout_ms = limit.as_millis() as u64,
                        suppressed,
                        "the store sent none of an answer's body for the upstream timeout; the answer was cut"
                    );
                }
                Poll::Ready(Some(Err(format!(
                    "the context store sent none of its answer for {} ms",
                    limit.as_millis()
                )
                .into())))
            }
            Poll::Ready(Some(Err(error))) => {
                this.armed = false;
                if let Some(suppressed) = crate::telemetry::warn_allowed("store answer broke off") {
                    tracing::warn!(
                        error = %crate::upstream::error_chain(&error),
                        suppressed,
                        "a store's answer could not be read to its end (bad framing, or its connection ended); the answer was cut"
                    );
                }
                Poll::Ready(Some(Err(error.into())))
            }
            ready => {
                this.armed = false;
                ready.map(|frame| frame.map(|f| f.map_err(Into::into)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        if let Some(len) = self.first.as_ref().and_then(Frame::data_ref).map(|d| d.len() as u64) {
            // The upper bound first: a lower bound above it would not be a hint.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(len));
            }
            hint.set_lower(hint.lower().saturating_add(len));
        }
        hint
    }
}

/// The protocol a request asks to switch to (`Connection: upgrade` with `Upgrade: …`).
pub fn upgrade_requested(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if asks {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// Puts back the two hop-by-hop headers an upgrade needs on the next hop.
pub fn keep_upgrade(headers: &mut HeaderMap, protocol: HeaderValue) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, protocol);
}

/// Once both sides switched protocols, copies bytes both ways until either side closes; on
/// the account of the client's connection when the server gave one (`outliving`), so that a
/// shutdown drains the tunnel as it does connections.
pub fn tunnel(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    outliving: Option<crate::server::Outliving>,
) {
    let copy = async move {
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(both) => both,
            Err(error) => {
                tracing::debug!(%error, "upgrade did not complete");
                return;
            }
        };
        let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
        if let Err(error) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            tracing::debug!(%error, "upgraded connection ended with an error");
        }
    };
    match outliving {
        Some(outliving) => outliving.spawn(copy),
        None => drop(tokio::spawn(copy)),
    }
}
