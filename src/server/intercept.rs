//! Accepting intercepted connections (transparent mode): a connection's original destination
//! before a nat REDIRECT rule sent it here, telling HTTP from other protocols by its first
//! bytes, and passing what is not HTTP through to its destination as raw TCP.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::net::TcpStream;

/// How long an intercepted connection may take to send enough bytes to tell HTTP from
/// another protocol; a client silent that long is served as HTTP.
pub const SNIFF_WAIT: Duration = Duration::from_secs(1);
/// The destination a connection had before a nat REDIRECT rule sent it here, if any.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn original_dst(stream: &TcpStream) -> Option<SocketAddr> {
    let sock = socket2::SockRef::from(stream);
    let found = match stream.local_addr().ok()? {
        SocketAddr::V4(_) => sock.original_dst_v4(),
        SocketAddr::V6(_) => sock.original_dst_v6(),
    };
    found.ok()?.as_socket()
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn original_dst(_stream: &TcpStream) -> Option<SocketAddr> {
    None
}

/// A connection made to the proxy's own address was not redirected: it uses `--upstream`.
pub fn is_own(dst: SocketAddr, own: SocketAddr) -> bool {
    dst == own || (dst.port() == own.port() && (own.ip().is_unspecified() || dst.ip().is_loopback()))
}

/// Whether the first bytes of an intercepted connection are an HTTP/1 request line (a known
/// method and a space). Other protocols (Redis, TLS, databases) are told apart from their
/// first bytes; a client silent for [`SNIFF_WAIT`] is served as HTTP.
pub async fn speaks_http(stream: &TcpStream) -> bool {
    let deadline = tokio::time::Instant::now() + SNIFF_WAIT;
    let mut buf = [0u8; 16];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return true,
        };
        if n == 0 {
            return true;
        }
        if let Some(verdict) = http_request_line(&buf[..n]) {
            return verdict;
        }
        if tokio::time::Instant::now() >= deadline {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `Some(true)` for the start of an HTTP/1 request line, `Some(false)` for anything else,
/// `None` while too few bytes have come to tell. A request line is a method token (any: a
/// routes file may configure `PROPPATCH` or `MERGE`), a space, and a target that starts with
/// `/`, `*` or `http` (an authority after `CONNECT`). The HTTP/2 preface (`PRI * …`) counts:
/// the HTTP/1 server refuses it rather than letting it pass around the lock.
fn http_request_line(start: &[u8]) -> Option<bool> {
    const MAX_METHOD: usize = 20;
    let Some(space) = start.iter().position(|b| *b == b' ') else {
        let token_so_far = start.len() <= MAX_METHOD && start.iter().all(is_method_char);
        return if token_so_far { None } else { Some(false) };
    };
    let method = &start[..space];
    if method.is_empty() || method.len() > MAX_METHOD || !method.iter().all(is_method_char) {
        return Some(false);
    }
    match start.get(space + 1) {
        None => None,
        Some(_) if method == b"CONNECT" => Some(true),
        Some(b'/' | b'*' | b'h' | b'H') => Some(true),
        Some(_) => Some(false),
    }
}

fn is_method_char(b: &u8) -> bool {
    b.is_ascii_uppercase() || *b == b'-' || *b == b'_'
}

/// The local addresses of this process's raw TCP connections to original destinations: one
/// of them arriving back at the listener means the sidecar's own traffic is intercepted.
fn own_splices() -> &'static Mutex<HashSet<SocketAddr>> {
    static OWN: OnceLock<Mutex<HashSet<SocketAddr>>> = OnceLock::new();
    OWN.get_or_init(|| Mutex::new(HashSet::new()))
}

fn lock_splices() -> std::sync::MutexGuard<'static, HashSet<SocketAddr>> {
    match own_splices().lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Forwards a non-HTTP intercepted connection to its original destination as raw TCP,
/// bytes copied both ways, without the lock (there is no write to serialize).
pub async fn splice(mut client: TcpStream, peer: SocketAddr, dst: SocketAddr) {
    if lock_splices().contains(&peer) {
        tracing::error!(
            %dst,
            "the sidecar's own connections are being intercepted and sent back to it: run it as the \
             user id excluded by `turnlock init-iptables --proxy-uid`"
        );
        return;
    }
    let connect = tokio::time::timeout(SPLICE_CONNECT_TIMEOUT, TcpStream::connect(dst)).await;
    let mut upstream = match connect {
        Ok(Ok(s)) => s,
        Ok(Err(error)) => {
            tracing::debug!(%dst, %error, "raw TCP destination unreachable");
            return;
        }
        Err(_) => {
            tracing::debug!(%dst, "raw TCP destination did not answer");
            return;
        }
    };
    let local = upstream.local_addr().ok();
    if let Some(local) = local {
        lock_splices().insert(local);
    }
    tracing::debug!(%peer, %dst, "non-HTTP connection passed through as raw TCP");
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    if let Some(local) = local {
        lock_splices().remove(&local);
    }
}

/// Longest wait for a raw TCP destination to accept.
const SPLICE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_request_lines_are_told_from_other_protocols() {
        assert_eq!(http_request_line(b"GET / HTTP/1.1"), Some(true));
        assert_eq!(http_request_line(b"POST /v1"), Some(true));
        assert_eq!(http_request_line(b"PO"), None);
        assert_eq!(http_request_line(b"POST "), None);
        assert_eq!(http_request_line(b"PROPPATCH /d"), Some(true));
        assert_eq!(http_request_line(b"GET http://h/"), Some(true));
        assert_eq!(http_request_line(b"CONNECT h:443"), Some(true));
        assert_eq!(http_request_line(b"PRI * HTTP/2.0"), Some(true));
        assert_eq!(http_request_line(b"SET k v\r\n"), Some(false));
        assert_eq!(http_request_line(b"GET key\r\n"), Some(false));
        assert_eq!(http_request_line(b"*1\r\n$4\r\nPING"), Some(false));
        assert_eq!(http_request_line(b"PING\r\n"), Some(false));
        assert_eq!(http_request_line(&[0x16, 0x03, 0x01]), Some(false));
    }
}
