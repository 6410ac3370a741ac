//! A cap on the connections to the store: each connection holds a permit for as long as it
//! is open, so neither bursts of writers nor slow stores can open more than the cap; a
//! request past the cap waits (within its timeout) for a connection to come back. An
//! `https://` store is reached over TLS (rustls), verified against the given roots.

use std::pin::Pin;
use std::sync::Arc;
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
    permits: Arc<Semaphore>,
    tls: Option<tokio_rustls::TlsConnector>,
}

/// One open connection and its permit (given back when the connection is dropped).
pub struct CappedIo {
    io: Io,
    _permit: OwnedSemaphorePermit,
}

enum Io {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// === impl CappedConnector ===

impl CappedConnector {
    pub fn new(inner: HttpConnector, max: usize) -> Self {
        Self {
            inner,
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
}

impl tower::Service<Uri> for CappedConnector {
    type Response = CappedIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<CappedIo, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let permits = self.permits.clone();
        let mut inner = self.inner.clone();
        let tls = self.tls.clone();
        Box::pin(async move {
            let permit = permits.acquire_owned().await?;
            let https = dst.scheme() == Some(&http::uri::Scheme::HTTPS);
            let host = dst.host().unwrap_or_default().trim_matches(['[', ']']).to_owned();
            let io = tower::Service::call(&mut inner, dst).await?;
            let io = match (https, tls) {
                (false, _) => Io::Plain(io),
                (true, Some(tls)) => {
                    let name = rustls_pki_types::ServerName::try_from(host)?;
                    let stream = tls.connect(name, io.into_inner()).await?;
                    Io::Tls(Box::new(TokioIo::new(stream)))
                }
                (true, None) => return Err("an https:// store needs TLS settings".into()),
            };
            Ok(CappedIo { io, _permit: permit })
        })
    }
}

// === impl CappedIo ===

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
    ($self:ident, $io:ident => $call:expr) => {
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
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        delegate!(self, io => io.poll_write(cx, buf))
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
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        delegate!(self, io => io.poll_write_vectored(cx, bufs))
    }
}
