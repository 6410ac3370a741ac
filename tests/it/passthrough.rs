//! Pass-through forwarding over real sockets: the upstream timeout bounds the store's answer,
//! not the client's own upload, and WebSocket / `Upgrade` requests become tunnels.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A store that reads the whole body, waits `think`, and answers with the byte count.
async fn counting_store(think: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| async move {
                    let n = req.into_body().collect().await.map(|c| c.to_bytes().len()).unwrap_or(0);
                    tokio::time::sleep(think).await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(n.to_string()))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// Uploads `chunks` chunks of 1 KiB, one every `every`, chunked; returns (status, body).
async fn trickle(addr: SocketAddr, chunks: usize, every: Duration) -> (u16, String) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let frames = futures_util::stream::unfold(0usize, move |i| async move {
        if i == chunks {
            return None;
        }
        tokio::time::sleep(every).await;
        Some((Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b'x'; 1024]))), i + 1))
    });
    let req = Request::post("/uploads/big")
        .header("host", "store")
        .body(StreamBody::new(frames))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn an_upload_slower_than_the_upstream_timeout_is_forwarded() {
    let store = counting_store(Duration::ZERO).await;
    let mut args = proxy_args(store, None);
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    let started = Instant::now();
    // 15 chunks, 100 ms apart: 1.5 s of upload, five times the upstream timeout.
    let (status, body) = trickle(proxy.addr, 15, Duration::from_millis(100)).await;
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert_eq!((status, body.as_str()), (200, "15360"));
}

#[tokio::test]
async fn a_store_silent_after_the_upload_still_times_out() {
    let store = counting_store(Duration::from_secs(30)).await;
    let mut args = proxy_args(store, None);
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    let started = Instant::now();
    let (status, body) = trickle(proxy.addr, 5, Duration::from_millis(100)).await;
    let took = started.elapsed();
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("upstream_timeout"), "{body}");
    // The upload (~0.5 s) plus the timeout (0.3 s), not the store's 30 s.
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

/// A store that accepts connections and never reads from them.
async fn deaf_store() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    addr
}

#[tokio::test]
async fn a_store_that_stops_taking_the_upload_times_out() {
    let store = deaf_store().await;
    let mut args = proxy_args(store, None);
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    let started = Instant::now();
    // 64 MiB offered at once: far more than the socket buffers between proxy and store hold.
    let answer = upload_at_once(proxy.addr, "/uploads/huge", 64 * 1024 * 1024, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(answer.contains("upstream_timeout"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

/// POSTs `len` bytes to `path` through the proxy at `addr`, offered as fast as it takes them
/// (1 MiB writes), and returns the first bytes of the answer, which must come `within`.
async fn upload_at_once(addr: SocketAddr, path: &str, len: usize, within: Duration) -> String {
    let mut client = TcpStream::connect(addr).await.expect("connect");
    let head = format!("POST {path} HTTP/1.1\r\nhost: store\r\ncontent-length: {len}\r\n\r\n");
    client.write_all(head.as_bytes()).await.expect("head");
    let (mut read, mut write) = client.into_split();
    let upload = tokio::spawn(async move {
        let chunk = vec![b'x'; 1024 * 1024];
        for _ in 0..len / chunk.len() {
            if write.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(within, read.read(&mut answer))
        .await
        .expect("an answer in time")
        .expect("read");
    upload.abort();
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// A store that reads every body slowly but without pause (64 KiB every 20 ms, about
/// 3 MiB/s), then answers with the byte count.
async fn slow_reading_store() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Some(head) = read_head(&mut stream).await else {
                    return;
                };
                let len: usize = head
                    .to_ascii_lowercase()
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                    .unwrap_or(0);
                let mut buf = vec![0u8; 64 * 1024];
                let mut read = 0;
                while read < len {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read += n,
                    }
                }
                let body = read.to_string();
                let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_store_that_reads_an_upload_slowly_but_steadily_is_not_taken_for_stalled() {
    let store = slow_reading_store().await;
    let mut args = proxy_args(store, None);
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    // 16 MiB offered at once: the store takes about 5 s to read it, never pausing for more
    // than 20 ms; the socket buffers between proxy and store fill and drain all along.
    const LEN: usize = 16 * 1024 * 1024;
    let answer = upload_at_once(proxy.addr, "/uploads/slowly", LEN, Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with(&LEN.to_string()), "{answer}");
}

/// A WebSocket-style server on raw TCP: answers a request carrying `Upgrade: websocket` with
/// 101, then echoes every byte; anything else gets 426.
async fn upgrade_echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Some(head) = read_head(&mut stream).await else {
                    return;
                };
                let lower = head.to_ascii_lowercase();
                if !(lower.contains("\r\nupgrade: websocket") && lower.contains("\r\nconnection: upgrade")) {
                    let _ = stream
                        .write_all(b"HTTP/1.1 426 Upgrade Required\r\ncontent-length: 0\r\n\r\n")
                        .await;
                    return;
                }
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                          sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
                    )
                    .await;
                let mut buf = [0u8; 1024];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

/// Reads a request or response head (bounded: 16 KiB, 5 s).
async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    let deadline = Instant::now() + Duration::from_secs(5);
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, stream.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            _ => return None,
        }
    }
    String::from_utf8(head).ok()
}

/// Opens a WebSocket tunnel through the proxy at `addr`; returns it and the answer's head.
async fn open_tunnel(addr: SocketAddr) -> (TcpStream, String) {
    let mut client = TcpStream::connect(addr).await.expect("connect");
    client
        .write_all(
            b"GET /v1/sessions/s1/live HTTP/1.1\r\nhost: store\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\
              sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        .await
        .expect("send");
    let head = read_head(&mut client).await.expect("response head");
    (client, head)
}

/// Sends `msg` through the tunnel; true when it comes back within a second.
async fn echoes(client: &mut TcpStream, msg: &str) -> bool {
    if client.write_all(msg.as_bytes()).await.is_err() {
        return false;
    }
    let mut got = vec![0u8; msg.len()];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), client.read_exact(&mut got)).await,
        Ok(Ok(_)) if got == msg.as_bytes()
    )
}

#[tokio::test]
async fn a_websocket_tunnel_is_drained_at_shutdown_and_closed_when_the_grace_runs_out() {
    let store = upgrade_echo_server().await;
    let mut args = proxy_args(store, None);
    args.shutdown_grace_ms = 1500;
    let proxy = proxy(args).await;
    let (mut client, head) = open_tunnel(proxy.addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(echoes(&mut client, "before").await);

    let began = Instant::now();
    proxy.shutdown_token().cancel();
    let stopped = tokio::spawn(proxy.wait());
    // Past the linger (a quarter of the grace), while the drain runs: the tunnel still flows.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        echoes(&mut client, "during the drain").await,
        "tunnel cut before the grace ran out"
    );
    assert!(!stopped.is_finished(), "the proxy stopped with a tunnel open");

    // The grace runs out: the tunnel is closed and the proxy stops.
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(5), client.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "tunnel not closed: {closed:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("the proxy stops")
        .expect("join");
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_millis(4000),
        "stopped after {took:?} with a 1.5 s grace"
    );
}

#[tokio::test]
async fn a_websocket_upgrade_is_passed_through_and_bytes_flow_both_ways() {
    let store = upgrade_echo_server().await;
    let proxy = proxy(proxy_args(store, None)).await;
    let (mut client, head) = open_tunnel(proxy.addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(
        lower.contains("upgrade: websocket") && lower.contains("connection: upgrade"),
        "{head}"
    );
    assert!(
        lower.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    for round in 0..3 {
        // A quiet tunnel is not taken for an idle keep-alive connection.
        tokio::time::sleep(Duration::from_millis(60)).await;
        let msg = format!("frame {round} \u{1}\u{2}\u{ff}");
        client.write_all(msg.as_bytes()).await.expect("write");
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut got))
            .await
            .expect("echo in time")
            .expect("echo");
        assert_eq!(got, msg.as_bytes());
    }
}

#[tokio::test]
async fn open_websocket_tunnels_do_not_take_the_store_connections_requests_need() {
    let store = upgrade_echo_server().await;
    let mut args = proxy_args(store, None);
    args.upstream_max_connections = 1;
    args.upstream_timeout_ms = 1000;
    let proxy = proxy(args).await;
    let mut tunnels = Vec::new();
    for n in 0..3 {
        let (mut client, head) = open_tunnel(proxy.addr).await;
        assert!(
            head.starts_with("HTTP/1.1 101"),
            "tunnel {n} with one store connection allowed: {head}"
        );
        assert!(echoes(&mut client, "hello").await, "tunnel {n}");
        tunnels.push(client);
    }
    // A request beside the open tunnels reaches the store (which answers it 426) at once.
    let mut plain = TcpStream::connect(proxy.addr).await.expect("connect");
    plain
        .write_all(b"GET /v1/sessions/s1 HTTP/1.1\r\nhost: store\r\n\r\n")
        .await
        .expect("send");
    let head = read_head(&mut plain).await.expect("answer");
    assert!(head.starts_with("HTTP/1.1 426"), "{head}");
    for (n, client) in tunnels.iter_mut().enumerate() {
        assert!(echoes(client, "still open").await, "tunnel {n}");
    }
}

/// A store that switches protocols (101) for any request but the health check's `GET /`.
async fn switching_store() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                while let Some(head) = read_head(&mut stream).await {
                    if !head.starts_with("GET / ") {
                        let _ = stream
                            .write_all(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: other\r\nconnection: upgrade\r\n\r\nnot http")
                            .await;
                        return;
                    }
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_switch_nobody_asked_for_is_a_502_not_passed_on() {
    let running = proxy(proxy_args(switching_store().await, None)).await;
    let reply = get_doc(&client(running.addr), "s1").await;
    assert_eq!(reply.status.as_u16(), 502, "{}", reply.json);
    assert_eq!(reply.json["error"], "upstream_error", "{}", reply.json);
    // The proxy goes on serving.
    let again = get_doc(&client(running.addr), "s2").await;
    assert_eq!(again.status.as_u16(), 502, "{}", again.json);
}

/// A store that answers with the `X-Forwarded-For` it was sent.
async fn forwarded_for_store() -> SocketAddr {
    serve(|req: Request<Incoming>| async move {
        let xff: Vec<String> = req
            .headers()
            .get_all("x-forwarded-for")
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        Response::new(Full::new(Bytes::from(xff.join(" | "))))
    })
    .await
}

#[tokio::test]
async fn every_prior_forwarded_for_hop_is_kept() {
    let proxy = proxy(proxy_args(forwarded_for_store().await, None)).await;
    let answer = send_raw(
        proxy.addr,
        b"GET /x HTTP/1.1\r\nhost: s\r\nx-forwarded-for: 1.1.1.1\r\nx-forwarded-for: 2.2.2.2\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.ends_with("1.1.1.1, 2.2.2.2, 127.0.0.1"), "{answer}");
    let answer = send_raw(proxy.addr, b"GET /x HTTP/1.1\r\nhost: s\r\nconnection: close\r\n\r\n").await;
    assert!(answer.ends_with("\r\n\r\n127.0.0.1"), "{answer}");
}

#[tokio::test]
async fn a_session_delete_names_the_client_in_x_forwarded_for_as_a_forwarded_request_does() {
    let proxy = proxy(proxy_args(forwarded_for_store().await, None)).await;
    let answer = send_raw(
        proxy.addr,
        b"DELETE /v1/sessions/s1 HTTP/1.1\r\nhost: s\r\nx-forwarded-for: 1.1.1.1\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("1.1.1.1, 127.0.0.1"), "{answer}");
}

#[tokio::test]
async fn a_broken_client_body_is_the_clients_error_not_the_stores() {
    let proxy = proxy(proxy_args(counting_store(Duration::ZERO).await, None)).await;
    let answer = send_raw(
        proxy.addr,
        b"POST /uploads/a HTTP/1.1\r\nhost: s\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("body_read_failed"), "{answer}");
}

/// hyper's client sends a GET's body of unknown length as no body at all; a search API that
/// takes its query in a GET's body would get an empty one.
#[tokio::test]
async fn a_get_with_a_chunked_body_reaches_the_store_with_its_body() {
    let proxy = proxy(proxy_args(counting_store(Duration::ZERO).await, None)).await;
    for method in ["GET", "OPTIONS", "POST"] {
        let request =
            format!("{method} /search HTTP/1.1\r\nhost: s\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
        let answer = send_raw(proxy.addr, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{method}: {answer}");
        assert!(
            answer.ends_with("\r\n\r\n5"),
            "{method}: the store read the body: {answer}"
        );
    }
}

/// A client that stops sending its upload is cut off after the body timeout (408), as
/// nginx's `client_body_timeout` does, and the store connection it held serves the next
/// request: stalled uploads cannot take every connection to the store.
#[tokio::test]
async fn a_stalled_upload_is_cut_and_gives_its_store_connection_back() {
    let mut args = proxy_args(counting_store(Duration::ZERO).await, None);
    args.upstream_max_connections = 1;
    let proxy = proxy(args).await;
    let started = Instant::now();
    let answer = send_raw(
        proxy.addr,
        b"PUT /uploads/stalled HTTP/1.1\r\nhost: s\r\ncontent-length: 20\r\n\r\nabcde",
    )
    .await;
    let took = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(took >= turnlock::proxy::BODY_READ_TIMEOUT, "cut after {took:?}");
    assert!(took < turnlock::proxy::BODY_READ_TIMEOUT * 2, "cut after {took:?}");
    // The one store connection serves the next request.
    let answer = send_raw(
        proxy.addr,
        b"GET /after HTTP/1.1\r\nhost: s\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// A request naming an `Upgrade` that is not upgraded (the store refuses it, or the header
/// came without `Connection: upgrade`) is the connection's last: hyper closes it after the
/// answer, and the answer says so, so that a keep-alive client does not send its next request
/// into a closing connection.
#[tokio::test]
async fn an_upgrade_not_made_closes_the_connection_and_the_answer_says_so() {
    let store = upgrade_echo_server().await;
    let proxy = proxy(proxy_args(store, None)).await;
    let requests: [&[u8]; 2] = [
        // The store answers 426: it wants `Upgrade: websocket`.
        b"GET /v1/sessions/s1/live HTTP/1.1\r\nhost: store\r\nconnection: upgrade\r\nupgrade: other\r\n\r\n",
        // A stray `Upgrade` header, no `Connection: upgrade`.
        b"GET /v1/sessions/s1/live HTTP/1.1\r\nhost: store\r\nupgrade: websocket\r\n\r\n",
    ];
    for request in requests {
        let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
        client.write_all(request).await.expect("send");
        let head = read_head(&mut client).await.expect("response head");
        let lower = head.to_ascii_lowercase();
        assert!(!head.starts_with("HTTP/1.1 101"), "{head}");
        assert!(lower.contains("\r\nconnection: close"), "{head}");
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(_))), "the connection stayed open: {read:?}");
    }
}
