//! A cap on the connections to the store: each connection holds a permit for as long as it
//! is open, so neither bursts of writers nor slow stores can open more than the cap; a
//! request past the cap waits (within its timeout) for a connection to come back.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Opens TCP connections through [`HttpConnector`], at most `max` open at once.
#[derive(Clone)]
pub struct CappedConnector {
    inner: HttpConnector,
    permits: Arc<Semaphore>,
}

/// One open connection and its permit (given back when the connection is dropped).
pub struct CappedIo {
    io: TokioIo<TcpStream>,
    _permit: OwnedSemaphorePermit,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// === impl CappedConnector ===

impl CappedConnector {
    pub fn new(inner: HttpConnector, max: usize) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max.max(1))),
        }
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
        Box::pin(async move {
            let permit = permits.acquire_owned().await?;
            let io = tower::Service::call(&mut inner, dst).await?;
            Ok(CappedIo { io, _permit: permit })
        })
    }
}

// === impl CappedIo ===

impl Connection for CappedIo {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl Read for CappedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl Write for CappedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}
