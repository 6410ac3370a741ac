//! A cap on the connections to the store: each connection holds a permit for as long as it
//! is open, so neither bursts of writers nor slow stores can open more than the cap; a
//! request past the cap waits (within its timeout) for a connection to come back. An
//! `https://` store is reached over TLS (rustls), verified against the given roots.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Opens TCP connections through [`HttpConnector`], at most `max` open at once; over TLS
/// when the store's URL is `https://`.
#[derive(Clone)]
pub struct CappedConnector {
    inner: HttpConnector,
    max: usize,
    permits: Arc<Semaphore>,
    tls: Option<tokio_rustls::TlsConnector>,
}

/// One open connection and its place under the cap (given back when the connection is
/// dropped, or earlier through [`Slot::release`]).
pub struct CappedIo {
    io: Io,
    slot: Slot,
}

/// A connection's place under the cap, shared by the connection and the pool: a connection
/// handed to a WebSocket tunnel gives its place back, as the tunnel may stay open for hours
/// and the cap is there for the requests to the store. It also tells how far the store has
/// taken what was sent on the connection ([`Slot::taken`]).
#[derive(Clone)]
pub struct Slot(Arc<Place>);

struct Place {
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    /// Bytes written to the connection so far.
    written: AtomicU64,
    /// The connection's socket while it is open, to ask the kernel how much of what was
    /// written the store has not yet taken; cleared (under the lock) before it closes.
    #[cfg(target_os = "linux")]
    socket: Mutex<Option<std::os::fd::RawFd>>,
}

enum Io {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where a request's body is being sent: the pool names the connection it sends the request
/// on, and whoever watches the upload reads [`Slot::taken`] of it.
#[derive(Clone, Default)]
pub struct SendWatch(Arc<Mutex<Option<Slot>>>);

impl SendWatch {
    /// The request goes out on the connection of `slot`.
    pub fn watch(&self, slot: &Slot) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(slot.clone());
    }

    /// [`Slot::taken`] of the connection the request went out on, once it has.
    pub fn taken(&self) -> Option<(u64, u32)> {
        let slot = self.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
        slot?.taken()
    }

    /// Whether the store took more of the request since `last` (the mark of the previous
    /// look, updated): a connection not known, or closed, never counts as progress.
    pub fn moved(&self, last: &mut Option<(u64, u32)>) -> bool {
        let now = self.taken();
        let moved = now.is_some() && now != *last;
        *last = now;
        moved
    }
}

// === impl CappedConnector ===

impl CappedConnector {
    pub fn new(inner: HttpConnector, max: usize) -> Self {
        Self {
            inner,
            max: max.max(1),
            permits: Arc::new(Semaphore::new(max.max(1))),
            tls: None,
        }
    }

    /// The same, reaching `https://` stores over TLS with `config`.
    pub fn with_tls(mut self, config: Arc<rustls::ClientConfig>) -> Self {
        self.inner.enforce_http(false);
        self.tls = Some(tokio_rustls::TlsConnector::from(config));
        self
    }

    /// The most connections open at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// A permit when one is free right now.
    pub fn try_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// Waits for a free permit.
    pub async fn permit(&self) -> Result<OwnedSemaphorePermit, BoxError> {
        Ok(self.permits.clone().acquire_owned().await?)
    }

    /// Opens one connection to `dst` under `permit`; without one, outside the cap (the
    /// health check's own).
    pub async fn connect_with(&self, permit: Option<OwnedSemaphorePermit>, dst: Uri) -> Result<CappedIo, BoxError> {
        let https = dst.scheme() == Some(&http::uri::Scheme::HTTPS);
        let host = dst.host().unwrap_or_default().trim_matches(['[', ']']).to_owned();
        let io = tower::Service::call(&mut self.inner.clone(), dst).await?;
        #[cfg(target_os = "linux")]
        let socket = std::os::fd::AsRawFd::as_raw_fd(io.inner());
        let io = match (https, &self.tls) {
            (false, _) => Io::Plain(io),
            (true, Some(tls)) => {
                let name = rustls_pki_types::ServerName::try_from(host)?;
                let stream = tls.connect(name, io.into_inner()).await?;
                Io::Tls(Box::new(TokioIo::new(stream)))
            }
            (true, None) => return Err("an https:// store needs TLS settings".into()),
        };
        Ok(CappedIo {
            io,
            slot: Slot(Arc::new(Place {
                permit: Mutex::new(permit),
                written: AtomicU64::new(0),
                #[cfg(target_os = "linux")]
                socket: Mutex::new(Some(socket)),
            })),
        })
    }
}

/// As a connector of hyper-util's client (the web-identity token exchange's).
impl tower::Service<Uri> for CappedConnector {
    type Response = CappedIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<CappedIo, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let permit = this.permit().await?;
            this.connect_with(Some(permit), dst).await
        })
    }
}

// === impl Slot ===

impl Slot {
    /// Gives the connection's place under the cap back now.
    pub fn release(&self) {
        drop(self.take_permit());
    }

    /// The connection's place under the cap, taken out to be handed to another (one opened
    /// to replace it); `None` when it holds none.
    pub fn take_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.0.permit.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Whether the connection holds a place under the cap (not one opened outside it, nor
    /// one whose place was given back).
    pub fn capped(&self) -> bool {
        self.0.permit.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    /// A mark that moves whenever the store takes more of what was sent on the connection:
    /// the bytes written to it, and those the kernel still holds for the store (not yet
    /// acknowledged). A store that reads slowly moves it although the connection cannot be
    /// written to for a while (the socket's buffer drains before it takes more); a store that
    /// stopped reading does not. `None` once the connection closed, or where the kernel is
    /// not asked.
    pub fn taken(&self) -> Option<(u64, u32)> {
        let written = self.0.written.load(Ordering::Relaxed);
        #[cfg(target_os = "linux")]
        {
            let socket = self.0.socket.lock().unwrap_or_else(PoisonError::into_inner);
            let fd = (*socket)?;
            let mut unsent: libc::c_int = 0;
            // SAFETY: `fd` is the connection's open socket: it is cleared under this lock
            // before the socket closes. `TIOCOUTQ` (`SIOCOUTQ` on a TCP socket) writes one
            // int to the pointer given, a live local.
            let asked = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut unsent) };
            (asked == 0).then(|| (written, u32::try_from(unsent).unwrap_or(0)))
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = written;
            None
        }
    }

    fn count_written(&self, polled: &Poll<std::io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = polled {
            self.0.written.fetch_add(*n as u64, Ordering::Relaxed);
        }
    }
}

// === impl CappedIo ===

impl CappedIo {
    pub fn slot(&self) -> Slot {
        self.slot.clone()
    }
}

impl Drop for CappedIo {
    /// The socket closes after this: [`Slot::taken`] no longer asks about it, and its place
    /// under the cap is free now, though the pool may still hold the connection's handle (an
    /// idle entry not yet looked at, a request about to try another connection): a request
    /// waiting at the cap opens the next one at once.
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        {
            *self.slot.0.socket.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        self.slot.release();
    }
}

impl Connection for CappedIo {
    fn connected(&self) -> Connected {
        match &self.io {
            Io::Plain(io) => io.connected(),
            Io::Tls(_) => Connected::new(),
        }
    }
}

/// Delegates one I/O call to the plain or the TLS stream.
macro_rules! delegate {
    ($self:expr, $io:ident => $call:expr) => {
        match &mut $self.get_mut().io {
            Io::Plain($io) => {
                let $io = Pin::new($io);
                $call
            }
            Io::Tls($io) => {
                let $io = Pin::new($io.as_mut());
                $call
            }
        }
    };
}

impl Read for CappedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, io => io.poll_read(cx, buf))
    }
}

impl Write for CappedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = delegate!(self.as_mut(), io => io.poll_write(cx, buf));
        self.slot.count_written(&polled);
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, io => io.poll_shutdown(cx))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(io) => io.is_write_vectored(),
            Io::Tls(io) => io.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = delegate!(self.as_mut(), io => io.poll_write_vectored(cx, bufs));
        self.slot.count_written(&polled);
        polled
    }
}
