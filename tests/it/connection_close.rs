//! Every answer says whether its connection stays open: a refusal that leaves the request's
//! body unread, and an HTTP/1.0 answer whose length is known only when the connection ends,
//! carry `Connection: close` and the connection then closes; an answer after a body read to
//! its end keeps the connection.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Sends `bytes` on a new connection to `addr`; returns the answer's head and whether the
/// server then closed the connection (within 2 s), reading until it did or went quiet.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> (String, bool) {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(bytes).await.expect("send");
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(2), conn.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            Err(_) => break false,
        }
    };
    let text = String::from_utf8_lossy(&got).into_owned();
    let head = text.split("\r\n\r\n").next().unwrap_or_default().to_ascii_lowercase();
    (head, closed)
}

fn says_close(head: &str) -> bool {
    head.lines().any(|l| l.trim() == "connection: close")
}

#[tokio::test]
async fn a_refusal_that_leaves_the_body_unread_says_connection_close_and_closes() {
    let store = store().await;
    let mut args = proxy_args(store.addr, None);
    args.max_body_bytes = 1024;
    let proxy = proxy(args).await;

    // Declared too large: refused before a byte of the body is read.
    let (head, closed) = exchange(
        proxy.addr,
        b"POST /v1/sessions/s1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          session-turn: 1\r\ncontent-length: 5000000\r\n\r\n{\"messages\":[",
    )
    .await;
    assert!(head.starts_with("http/1.1 413"), "{head}");
    assert!(says_close(&head) && closed, "closed {closed}: {head}");

    // Not JSON by its type: refused before its body (sent only in part) is read.
    let (head, closed) = exchange(
        proxy.addr,
        b"POST /v1/sessions/s1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\n\
          session-turn: 1\r\ncontent-length: 900\r\n\r\nhello",
    )
    .await;
    assert!(head.starts_with("http/1.1 415"), "{head}");
    assert!(says_close(&head) && closed, "closed {closed}: {head}");

    // An HTTP/1.0 client that asked for keep-alive is told `close` alone, in its version.
    let (head, closed) = exchange(
        proxy.addr,
        b"POST /v1/sessions/s1/messages HTTP/1.0\r\nhost: x\r\nconnection: keep-alive\r\n\
          content-type: application/json\r\nsession-turn: 1\r\ncontent-length: 5000000\r\n\r\n{",
    )
    .await;
    assert!(head.starts_with("http/1.0 413"), "{head}");
    assert!(!head.contains("keep-alive"), "{head}");
    assert!(says_close(&head) && closed, "closed {closed}: {head}");

    // The control: a body read to its end and refused keeps the connection, and says so.
    let body = "{not json";
    let request = format!(
        "POST /v1/sessions/s1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         session-turn: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (head, closed) = exchange(proxy.addr, request.as_bytes()).await;
    assert!(head.starts_with("http/1.1 400"), "{head}");
    assert!(!says_close(&head) && !closed, "closed {closed}: {head}");
}

/// A store that answers every request with a chunked body (its length unknown up front).
async fn chunked_store() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n\
                          5\r\nhello\r\n0\r\n\r\n",
                    )
                    .await;
                let _ = conn.read(&mut buf).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_http_1_0_answer_of_unknown_length_says_connection_close() {
    let proxy = proxy(proxy_args(chunked_store().await, None)).await;
    let (head, closed) = exchange(
        proxy.addr,
        b"GET /files/a HTTP/1.0\r\nhost: x\r\nconnection: keep-alive\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("http/1.0 200"), "{head}");
    assert!(!head.contains("keep-alive"), "{head}");
    assert!(says_close(&head) && closed, "closed {closed}: {head}");
}

/// An HTTP/1.0 client that asks for keep-alive keeps its connection when the store's answer
/// states its length, as it would talking to the store itself: the answer says `keep-alive`.
#[tokio::test]
async fn an_http_1_0_keep_alive_client_keeps_its_connection_when_the_length_is_known() {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    let (head, closed) = exchange(
        proxy.addr,
        b"GET /v1/sessions/ten-keep HTTP/1.0\r\nhost: x\r\nconnection: keep-alive\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("http/1.0 "), "{head}");
    assert!(head.contains("content-length:"), "{head}");
    assert!(
        head.contains("connection: keep-alive") && !closed,
        "closed {closed}: {head}"
    );
}
