//! Keep-alive connections that go idle between requests (the server then holds none of
//! hyper's buffers for them) are served exactly as before: pauses, requests split across
//! packets, pipelined requests split across the idle point, bodies that arrive after their
//! head, and tunnels that stay quiet. A client that half-closes or resets once its request is
//! sent still has it served in full.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PAUSE: Duration = Duration::from_millis(60);

/// Reads one response (head and a `content-length` body) from `conn`, keeping what follows
/// in `buf`; returns (status, body).
async fn response(conn: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, String) {
    let read = async {
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                let len: usize = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                while buf.len() < end + 4 + len {
                    fill(conn, buf).await;
                }
                let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
                buf.drain(..end + 4 + len);
                let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
                assert!(
                    !head.to_ascii_lowercase().contains("connection: close"),
                    "the connection is kept: {head}"
                );
                return (status, body);
            }
            fill(conn, buf).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("an answer in time")
}

async fn fill(conn: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let n = conn.read(&mut chunk).await.expect("read");
    assert!(
        n > 0,
        "the server closed the connection; got so far: {}",
        String::from_utf8_lossy(buf)
    );
    buf.extend_from_slice(&chunk[..n]);
}

fn get(session: &str) -> String {
    format!("GET /v1/sessions/{session} HTTP/1.1\r\nhost: store\r\n\r\n")
}

fn append(session: &str, turn: u64, id: &str) -> (String, String) {
    let body = json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": "hi"}]}).to_string();
    let head = format!(
        "POST /v1/sessions/{session}/messages HTTP/1.1\r\nhost: store\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    (head, body)
}

async fn send(conn: &mut TcpStream, bytes: &str) {
    conn.write_all(bytes.as_bytes()).await.expect("write");
}

async fn served(addr: SocketAddr) -> (TcpStream, Vec<u8>) {
    (TcpStream::connect(addr).await.expect("connect"), Vec::new())
}

#[tokio::test]
async fn a_keep_alive_connection_is_served_across_idle_pauses_split_and_pipelined_requests() {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    let (mut conn, mut buf) = served(proxy.addr).await;

    // A connection that waits before its first request, then pauses between requests.
    tokio::time::sleep(PAUSE).await;
    for turn in 1..=3u64 {
        let (head, body) = append("idle-1", turn, &format!("m{turn}"));
        send(&mut conn, &(head + &body)).await;
        let status = response(&mut conn, &mut buf).await.0;
        assert!((200..300).contains(&status), "append {turn}: {status}");
        tokio::time::sleep(PAUSE).await;
    }

    // A request head split across packets, after the connection went idle.
    let request = get("idle-1");
    let (first, rest) = request.split_at(12);
    send(&mut conn, first).await;
    tokio::time::sleep(PAUSE).await;
    send(&mut conn, rest).await;
    let (status, doc) = response(&mut conn, &mut buf).await;
    assert_eq!(status, 200);
    assert!(doc.contains("\"m3\""), "{doc}");

    // Two pipelined requests, the second split at the moment the first is answered.
    let second = get("idle-1");
    let (second_first, second_rest) = second.split_at(20);
    let (head, body) = append("idle-1", 4, "m4");
    send(&mut conn, &format!("{head}{body}{second_first}")).await;
    let status = response(&mut conn, &mut buf).await.0;
    assert!((200..300).contains(&status), "pipelined append: {status}");
    tokio::time::sleep(PAUSE).await;
    send(&mut conn, second_rest).await;
    let (status, doc) = response(&mut conn, &mut buf).await;
    assert_eq!(status, 200, "the pipelined read finished after the pause");
    assert!(doc.contains("\"m4\""), "{doc}");

    // Three pipelined in one packet.
    send(&mut conn, &format!("{0}{0}{0}", get("idle-1"))).await;
    for n in 0..3 {
        assert_eq!(response(&mut conn, &mut buf).await.0, 200, "pipelined read {n}");
    }

    // A write whose body arrives well after its head.
    let (head, body) = append("idle-1", 5, "m5");
    send(&mut conn, &head).await;
    tokio::time::sleep(PAUSE).await;
    let (body_first, body_rest) = body.split_at(body.len() / 2);
    send(&mut conn, body_first).await;
    tokio::time::sleep(PAUSE).await;
    send(&mut conn, body_rest).await;
    let status = response(&mut conn, &mut buf).await.0;
    assert!((200..300).contains(&status), "slow body: {status}");

    send(&mut conn, &get("idle-1")).await;
    let (_, doc) = response(&mut conn, &mut buf).await;
    let doc: serde_json::Value = serde_json::from_str(&doc).expect("json");
    assert_eq!(message_ids(&doc), ["m1", "m2", "m3", "m4", "m5"]);
    assert_eq!(doc["turn"], 5);
}

/// Longer than the header read timeout (10 s) that used to close idle keep-alive connections:
/// a client pool that keeps a connection for a while finds it open, not closed under its next
/// request.
#[tokio::test]
async fn a_keep_alive_connection_idle_past_the_header_timeout_is_kept_open() {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    let (mut conn, mut buf) = served(proxy.addr).await;
    let (head, body) = append("kept-1", 1, "m1");
    send(&mut conn, &(head + &body)).await;
    assert!((200..300).contains(&response(&mut conn, &mut buf).await.0));
    tokio::time::sleep(turnlock::server::HEADER_READ_TIMEOUT + Duration::from_secs(2)).await;
    send(&mut conn, &get("kept-1")).await;
    let (status, doc) = response(&mut conn, &mut buf).await;
    assert_eq!(status, 200, "{doc}");
    assert!(doc.contains("\"m1\""), "{doc}");
}

#[tokio::test]
async fn many_idle_connections_each_answer_again_after_a_pause() {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    let mut conns = Vec::new();
    for _ in 0..200 {
        let (mut conn, mut buf) = served(proxy.addr).await;
        send(&mut conn, &get("idle-many")).await;
        assert_eq!(response(&mut conn, &mut buf).await.0, 404);
        conns.push((conn, buf));
    }
    tokio::time::sleep(PAUSE).await;
    for (conn, _) in &mut conns {
        send(conn, &get("idle-many")).await;
    }
    for (conn, buf) in &mut conns {
        assert_eq!(response(conn, buf).await.0, 404);
    }
}

#[tokio::test]
async fn a_client_that_half_closes_after_its_requests_gets_every_answer() {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    // A write, then the client closes its sending side (RFC 9112 §9.6) and reads.
    let (mut conn, mut buf) = served(proxy.addr).await;
    let (head, body) = append("half", 1, "m1");
    send(&mut conn, &(head + &body)).await;
    conn.shutdown().await.expect("half-close");
    let status = response(&mut conn, &mut buf).await.0;
    assert!((200..300).contains(&status), "the write is answered: {status}");

    // Three pipelined reads, then the half-close: all three answered, by the proxy and by the
    // reference store.
    for addr in [proxy.addr, store.addr] {
        let (mut conn, mut buf) = served(addr).await;
        send(&mut conn, &get("half").repeat(3)).await;
        conn.shutdown().await.expect("half-close");
        for n in 0..3 {
            let (status, doc) = response(&mut conn, &mut buf).await;
            assert_eq!(status, 200, "{addr}: read {n}");
            let doc: serde_json::Value = serde_json::from_str(&doc).expect("json");
            assert_eq!(message_ids(&doc), ["m1"], "{addr}: applied once");
        }
    }
}

#[tokio::test]
async fn a_keyed_write_whose_client_resets_right_after_sending_is_finished_and_its_retry_replayed() {
    let redis = RedisServer::start();
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    for n in 0..5 {
        let session = format!("reset-{n}");
        let (head, body) = append(&session, 1, "m1");
        let head = head.replace("\r\n\r\n", &format!("\r\nidempotency-key: k-{n}\r\n\r\n"));
        let mut conn = TcpStream::connect(proxy.addr).await.expect("connect");
        send(&mut conn, &(head.clone() + &body)).await;
        // Gone at once, with a reset: the proxy still finishes (and records) the write.
        socket2::SockRef::from(&conn)
            .set_linger(Some(Duration::ZERO))
            .expect("linger");
        drop(conn);
        tokio::time::sleep(Duration::from_millis(300)).await;

        let (mut conn, mut buf) = served(proxy.addr).await;
        send(&mut conn, &(head + &body)).await;
        let status = response(&mut conn, &mut buf).await.0;
        assert!(
            (200..300).contains(&status),
            "write {n}: the retry is answered, not refused: {status}"
        );
        send(&mut conn, &get(&session)).await;
        let (_, doc) = response(&mut conn, &mut buf).await;
        let doc: serde_json::Value = serde_json::from_str(&doc).expect("json");
        assert_eq!(message_ids(&doc), ["m1"], "write {n}: applied once");
    }
}
