//! Idle keep-alive connections that hold no buffers.
//!
//! hyper gives every HTTP/1 connection a read and a write buffer of 8 KiB each, and keeps
//! them while the connection waits for its next request. With a thousand keep-alive clients
//! that is most of the process's memory. Like nginx, which frees an idle keep-alive
//! connection's buffers, the server here lets hyper's connection end once it has been idle
//! for [`SHED_AFTER`] (its last answer written out, nothing more read), waits on the bare
//! socket for the client's next bytes, and only then starts a new hyper connection on it. A
//! new client gets no hyper connection before its first bytes either.
//!
//! The socket, [`IdleIo`], ends hyper's connection by reading as an end of stream at that
//! point, and only there. It never does while a request is being served (counted by
//! [`Activity`] from the moment hyper has its head until both its body and its answer's body
//! are done), while an answer is not fully written out, before the hyper connection served a
//! request, or once the connection became a tunnel (an upgrade). The first bytes of a
//! pipelined request that hyper had read go to the next connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// How long a keep-alive connection stays idle before it gives its buffers back: long
/// enough that a busy connection never does it, short beside an agent's pause between calls.
pub const SHED_AFTER: std::time::Duration = std::time::Duration::from_millis(5);

/// What the connection's service is doing, shared with its socket.
#[derive(Debug, Default)]
pub struct Activity {
    /// Busy guards alive: requests being served (until their answer's body is done) and
    /// request bodies hyper may still read.
    in_flight: AtomicUsize,
    /// Requests called on this connection.
    begun: AtomicUsize,
    /// The connection was upgraded: its reads belong to the tunnel.
    tunnel: AtomicBool,
    /// The socket read as an end of stream that the client did not send.
    idled: AtomicBool,
    /// Every answer is written out: hyper flushed its socket (which it does only with its own
    /// write buffer empty) since the last request ended.
    flushed: AtomicBool,
    /// The current request's body was dropped before its end: hyper closes the connection
    /// after the answer (unless the rest was already buffered), which the answer then says.
    unread: AtomicBool,
}

impl Activity {
    /// A request begins; it is served until the returned guard drops (carried by its
    /// answer's body).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.begun.fetch_add(1, Ordering::Relaxed);
        self.hold()
    }

    /// The connection is busy until the returned guard drops (carried by a request's body
    /// while hyper may still read it).
    pub fn hold(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Whether hyper's connection ended because the connection went idle (not because the
    /// client closed it, or hyper chose to close).
    pub fn idled(&self) -> bool {
        self.idled.load(Ordering::Relaxed)
    }

    /// Whether the body of the request just answered was dropped before its end; cleared.
    pub fn take_unread(&self) -> bool {
        self.unread.swap(false, Ordering::Relaxed)
    }

    /// The connection becomes a tunnel for good.
    pub fn tunnel(&self) {
        self.tunnel.store(true, Ordering::Relaxed);
    }

    /// No request in flight, every answer written out, at least one request served since
    /// `begun_before`, and not a tunnel.
    fn idle_after(&self, begun_before: usize) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0
            && self.flushed.load(Ordering::Relaxed)
            && self.begun.load(Ordering::Relaxed) != begun_before
            && !self.tunnel.load(Ordering::Relaxed)
    }
}

/// One request being served; see [`Activity::begin`].
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl InFlight {
    /// The connection this keeps busy.
    pub fn activity(&self) -> &Activity {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            // The answer's last bytes may still be in hyper's write buffer.
            self.0.flushed.store(false, Ordering::Relaxed);
        }
    }
}

/// A body (a request's, or its answer's) that keeps the connection busy until its last frame
/// was read or it is dropped.
pub struct Tracked<B> {
    body: B,
    busy: Option<InFlight>,
    /// A request's body: dropped before its end, it is marked unread on its connection.
    request: bool,
}

impl<B> Tracked<B> {
    /// A request's body; `busy` (when it has one) is held until its end.
    pub fn request(body: B, busy: Option<InFlight>) -> Self {
        Self {
            body,
            busy,
            request: true,
        }
    }

    /// An answer's body, holding its request's guard until its end.
    pub fn answer(body: B, request: InFlight) -> Self {
        Self {
            body,
            busy: Some(request),
            request: false,
        }
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        if let (true, Some(busy)) = (self.request, &self.busy) {
            busy.0.unread.store(true, Ordering::Relaxed);
        }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.body).poll_frame(cx));
        if frame.is_none() || self.body.is_end_stream() {
            self.busy = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The client's socket as hyper reads and writes it; see the module's documentation.
pub struct IdleIo {
    stream: TcpStream,
    activity: Arc<Activity>,
    /// Told when hyper's connection ended idle (see [`Trimmer`]).
    trimmer: Trimmer,
    /// Bytes hyper had read and not used when its connection ended.
    unread: Bytes,
    /// Requests begun before the current hyper connection started: one that has served none
    /// is never ended (hyper takes an end of stream before the first request as an error).
    begun_before: usize,
    /// When the connection last became idle (its last answer written out).
    idle_since: Instant,
    /// Wakes hyper's connection [`SHED_AFTER`] after it became idle, so that it reads and
    /// finds it still idle. Made while hyper serves the socket, dropped with hyper's state;
    /// moved lazily (at most one timer change per `SHED_AFTER` on a busy connection).
    timer: Option<Pin<Box<Sleep>>>,
    /// The timer holds the task's waker for its current deadline: it need not be polled
    /// again until it fires or moves (hyper's connection is always polled by this
    /// connection's task, so the waker stays the same).
    armed: bool,
    /// A request head on its way: the requests begun when its first bytes came, and when it
    /// must be complete ([`super::HEADER_READ_TIMEOUT`]); the next request beginning ends it.
    head: Option<(usize, Instant)>,
}

impl IdleIo {
    pub fn new(stream: TcpStream, activity: Arc<Activity>, trimmer: Trimmer) -> Self {
        Self {
            stream,
            activity,
            trimmer,
            unread: Bytes::new(),
            begun_before: 0,
            idle_since: Instant::now(),
            timer: None,
            armed: false,
            head: None,
        }
    }

    /// Takes the socket back from an ended hyper connection, with what hyper had read but not
    /// used (given first to the next connection).
    pub fn resume(mut self, unread: Bytes) -> Self {
        self.activity.idled.store(false, Ordering::Relaxed);
        // A copy: `unread` is a view of hyper's whole read buffer (even when empty).
        self.unread = if unread.is_empty() {
            Bytes::new()
        } else {
            Bytes::copy_from_slice(&unread)
        };
        self.begun_before = self.activity.begun.load(Ordering::Relaxed);
        // Made again when the connection is next busy.
        self.timer = None;
        self.armed = false;
        self
    }

    /// Waits until the client sends again (or closes).
    pub async fn readable(&self) -> io::Result<()> {
        if !self.unread.is_empty() {
            return Ok(());
        }
        // A read that found nothing cleared the socket's readiness, so this waits for bytes.
        self.stream.readable().await
    }

    /// Waits until a new client sends its first bytes (or closes). An accepted socket is taken
    /// as readable before anything arrived, so this looks at the bytes themselves.
    pub async fn first_bytes(&self) -> io::Result<()> {
        self.stream.peek(&mut [0u8; 1]).await.map(|_| ())
    }

    /// Whether the connection has been idle for [`SHED_AFTER`]; if not, makes sure the task is
    /// woken by then.
    fn idle_long_enough(&mut self, cx: &mut Context<'_>) -> bool {
        let due = self.idle_since + SHED_AFTER;
        if Instant::now() >= due {
            return true;
        }
        self.wake_at(due, cx);
        false
    }

    fn wake_at(&mut self, due: Instant, cx: &mut Context<'_>) {
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        // An earlier pending deadline stays: the check is made again when it fires.
        if timer.is_elapsed() || timer.deadline() > due {
            timer.as_mut().reset(due);
            self.armed = false;
        }
        if self.armed {
            return;
        }
        // Unconstrained: a poll the task's budget turned down would not hold the waker.
        let mut polled = tokio::task::unconstrained(timer.as_mut());
        if Pin::new(&mut polled).poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        } else {
            self.armed = true;
        }
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.unread.is_empty() {
            let n = this.unread.len().min(buf.remaining());
            buf.put_slice(&this.unread[..n]);
            this.unread.advance(n);
            this.head_arriving();
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.head_arriving();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.activity.idle_after(this.begun_before) && this.idle_long_enough(cx) => {
                // Nothing to read and nothing owed for a while: end hyper's connection, keep
                // the socket.
                this.activity.idled.store(true, Ordering::Relaxed);
                this.trimmer.0.notify_one();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.head_due() {
                Some(due) if Instant::now() >= due => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the request head took longer than the header read timeout",
                ))),
                Some(due) => {
                    this.wake_at(due, cx);
                    Poll::Pending
                }
                None => Poll::Pending,
            },
            other => other,
        }
    }
}

impl IdleIo {
    /// Bytes came: with no request being served they begin a request head, which has
    /// [`super::HEADER_READ_TIMEOUT`] from now to be complete (a slow client is cut off; the
    /// time a keep-alive connection waits for its next request is not counted).
    fn head_arriving(&mut self) {
        let begun = self.activity.begun.load(Ordering::Relaxed);
        if self.activity.in_flight.load(Ordering::Relaxed) == 0 && !matches!(self.head, Some((b, _)) if b == begun) {
            self.head = Some((begun, Instant::now() + super::HEADER_READ_TIMEOUT));
        }
    }

    /// When the head on its way must be complete; none once its request began.
    fn head_due(&mut self) -> Option<Instant> {
        match self.head {
            Some((begun, due)) if begun == self.activity.begun.load(Ordering::Relaxed) => Some(due),
            _ => {
                self.head = None;
                None
            }
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.stream).poll_flush(cx);
        if matches!(flushed, Poll::Ready(Ok(())))
            && self.activity.in_flight.load(Ordering::Relaxed) == 0
            && !self.activity.flushed.swap(true, Ordering::Relaxed)
        {
            // The last answer is written out: the connection is idle from now.
            self.idle_since = Instant::now();
            let due = self.idle_since + SHED_AFTER;
            self.wake_at(due, cx);
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.activity.idled() {
            // hyper closes what it thinks ended; the socket lives on.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Hands the memory that idle connections freed back to the system.
///
/// The allocator (glibc's) keeps freed memory in its heaps: after a burst of requests on many
/// connections the buffers they dropped stay resident. [`TRIM_AFTER`] after connections
/// went idle (at most once per `TRIM_AFTER`), the free pages are handed back.
#[derive(Clone, Default)]
pub struct Trimmer(Arc<tokio::sync::Notify>);

/// How long after connections went idle their freed memory is handed back.
pub const TRIM_AFTER: std::time::Duration = std::time::Duration::from_millis(250);

impl Trimmer {
    /// Hands free memory back after connections go idle, until `stop`.
    pub async fn run(self, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = self.0.notified() => {}
                _ = stop.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(TRIM_AFTER) => {}
                _ = stop.cancelled() => return,
            }
            let _ = tokio::task::spawn_blocking(release_free_memory).await;
        }
    }
}

fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
