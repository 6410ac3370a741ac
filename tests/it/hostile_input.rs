//! Hostile and malformed input, sent as raw bytes over real sockets: each gets a clear 4xx
//! (a JSON error wherever turnlock, not the HTTP parser, answers), no lock is left behind,
//! and other sessions are not affected.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

const MAX_BODY: usize = 4096;

/// A parsed raw response: status, and the body as JSON when it is JSON.
#[derive(Debug)]
struct Raw {
    status: u16,
    json: Value,
    text: String,
}

/// Every response in `text`, in order.
fn responses(text: &str) -> Vec<Raw> {
    text.split("HTTP/1.")
        .skip(1)
        .map(|r| {
            let status = r.get(2..5).and_then(|s| s.parse().ok()).unwrap_or(0);
            let body = r.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
            let body = body.trim_end_matches("\r\n0\r\n\r\n");
            // Chunked bodies: the JSON object sits between the chunk framing lines.
            let json = body
                .find('{')
                .and_then(|start| body.rfind('}').map(|end| &body[start..=end]))
                .and_then(|j| serde_json::from_str(j).ok())
                .unwrap_or(Value::Null);
            Raw {
                status,
                json,
                text: r.to_owned(),
            }
        })
        .collect()
}

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding")) {
        r.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    r.push_str(body);
    r.into_bytes()
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_clear_4xx_and_leave_nothing_behind() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.max_body_bytes = MAX_BODY;
    let p = proxy(args).await;
    let c = client(p.addr);
    let canary = append(&c, "canary", 3, "canary-1").await;
    assert!(canary.status.is_success());
    let canary_before = get_doc(&client(store.addr), "canary").await.json;

    let w = "/v1/sessions/hostile/messages";
    let ok_body = r#"{"turn": 1, "messages": [{"id": "x", "content": "x"}]}"#;
    let big = format!(
        r#"{{"turn": 1, "messages": [{{"content": "{}"}}]}}"#,
        "a".repeat(MAX_BODY)
    );
    let long_id = format!("/v1/sessions/{}/messages", "s".repeat(300));
    let huge_header = "v".repeat(100 * 1024);
    let mut chunked_big = String::new();
    for _ in 0..8 {
        chunked_big.push_str(&format!("400\r\n{}\r\n", "a".repeat(0x400)));
    }
    chunked_big.push_str("0\r\n\r\n");
    // (case, request, expected status, expected error code; "" when the HTTP layer answers)
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed JSON",
            request("POST", w, &[JSON], r#"{"turn": 1, "messages": ["#),
            400,
            "malformed_json",
        ),
        (
            "truncated JSON",
            request("POST", w, &[JSON], r#"{"turn":1,"mess"#),
            400,
            "malformed_json",
        ),
        (
            "not an object",
            request("POST", w, &[JSON], "[1,2,3]"),
            400,
            "invalid_body",
        ),
        ("empty body", request("POST", w, &[JSON], ""), 400, "malformed_json"),
        (
            "text/plain",
            request("POST", w, &[("content-type", "text/plain")], ok_body),
            415,
            "unsupported_media_type",
        ),
        (
            "no content type",
            request("POST", w, &[], ok_body),
            415,
            "unsupported_media_type",
        ),
        (
            "form content type",
            request(
                "POST",
                w,
                &[("content-type", "application/x-www-form-urlencoded")],
                ok_body,
            ),
            415,
            "unsupported_media_type",
        ),
        (
            "missing turn",
            request("POST", w, &[JSON], r#"{"messages": []}"#),
            400,
            "missing_turn",
        ),
        (
            "negative turn",
            request("POST", w, &[JSON], r#"{"turn": -1, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "fractional turn",
            request("POST", w, &[JSON], r#"{"turn": 1.5, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "huge turn",
            request("POST", w, &[JSON], r#"{"turn": 18446744073709551616, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "turn past 2^53",
            request("POST", w, &[JSON], r#"{"turn": 9007199254740993, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "turn 1e300",
            request("POST", w, &[JSON], r#"{"turn": 1e300, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "turn as string",
            request("POST", w, &[JSON], r#"{"turn": "7", "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "turn null",
            request("POST", w, &[JSON], r#"{"turn": null, "messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "header turn not a number",
            request("POST", w, &[JSON, ("x-session-turn", "abc")], r#"{"messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "header turn negative",
            request("POST", w, &[JSON, ("x-session-turn", "-3")], r#"{"messages": []}"#),
            400,
            "invalid_turn",
        ),
        (
            "turns disagree",
            request(
                "POST",
                w,
                &[JSON, ("x-session-turn", "2")],
                r#"{"turn": 1, "messages": []}"#,
            ),
            400,
            "turn_mismatch",
        ),
        (
            "messages not an array",
            request("POST", w, &[JSON], r#"{"turn": 1, "messages": "hi"}"#),
            400,
            "invalid_messages",
        ),
        (
            "patch sets messages",
            request(
                "PATCH",
                "/v1/sessions/hostile",
                &[("content-type", "application/merge-patch+json")],
                r#"{"turn": 1, "messages": []}"#,
            ),
            400,
            "forbidden_field",
        ),
        (
            "replace without If-Match",
            request(
                "PUT",
                "/v1/sessions/hostile",
                &[JSON, ("x-context-replace", "true")],
                r#"{"turn": 1}"#,
            ),
            428,
            "precondition_required",
        ),
        (
            "garbage If-Match",
            request(
                "PUT",
                "/v1/sessions/hostile",
                &[JSON, ("x-context-replace", "true"), ("if-match", "\"abc")],
                r#"{"turn": 1}"#,
            ),
            400,
            "invalid_if_match",
        ),
        (
            "id with ':'",
            request("POST", "/v1/sessions/a:b/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with '*'",
            request("POST", "/v1/sessions/a*/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with '['",
            request("POST", "/v1/sessions/a[/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id '..'",
            request("POST", "/v1/sessions/../messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with %2F",
            request("POST", "/v1/sessions/a%2Fb/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id %2e%2e",
            request("POST", "/v1/sessions/%2e%2e/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with %3F",
            request("POST", "/v1/sessions/a%3F/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with %00",
            request("POST", "/v1/sessions/a%00/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id with a space",
            request("POST", "/v1/sessions/a%20b/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "unicode id (encoded)",
            request("POST", "/v1/sessions/s%C3%A9/messages", &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "id of 300 bytes",
            request("POST", &long_id, &[JSON], ok_body),
            400,
            "invalid_session_id",
        ),
        (
            "Idempotency-Key too long",
            request("POST", w, &[JSON, ("idempotency-key", &"k".repeat(300))], ok_body),
            400,
            "invalid_idempotency_key",
        ),
        (
            "declared body over the limit",
            request("POST", w, &[JSON], &big),
            413,
            "body_too_large",
        ),
        (
            "chunked body over the limit",
            request("POST", w, &[JSON, ("transfer-encoding", "chunked")], &chunked_big),
            413,
            "body_too_large",
        ),
        (
            "huge header value",
            request("POST", w, &[JSON, ("x-junk", &huge_header)], ok_body),
            431,
            "",
        ),
    ];
    let mut flood =
        String::from("POST /v1/sessions/hostile/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n");
    for i in 0..500 {
        flood.push_str(&format!("x-flood-{i}: {i}\r\n"));
    }
    flood.push_str(&format!("content-length: {}\r\n\r\n{ok_body}", ok_body.len()));
    let mut cases = cases;
    cases.push(("header flood", flood.into_bytes(), 431, ""));
    cases.push((
        "raw unicode in the path",
        "POST /v1/sessions/sé/messages HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n"
            .as_bytes()
            .to_vec(),
        400,
        "",
    ));
    cases.push((
        "not HTTP at all",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".to_vec(),
        400,
        "",
    ));

    let mut failures = Vec::new();
    for (name, bytes, status, code) in &cases {
        let text = send_raw(p.addr, bytes).await;
        let rs = responses(&text);
        let Some(r) = rs.first() else {
            // The HTTP layer may close instead of answering a head it will not parse.
            if code.is_empty() {
                continue;
            }
            failures.push(format!("{name}: no response"));
            continue;
        };
        if r.status != *status {
            failures.push(format!("{name}: status {} (expected {status}): {}", r.status, r.text));
        } else if !code.is_empty() && r.json["error"] != *code {
            failures.push(format!("{name}: error {} (expected {code})", r.json));
        } else if !code.is_empty() && !r.json["message"].is_string() {
            failures.push(format!("{name}: no message: {}", r.json));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // HTTP/1.0 and pipelined requests are served correctly.
    let v10 = format!(
        "POST /v1/sessions/hostile-ok/messages HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ok_body}",
        ok_body.len()
    );
    let rs = responses(&send_raw(p.addr, v10.as_bytes()).await);
    assert_eq!(rs.len(), 1);
    assert!((200..300).contains(&rs[0].status), "HTTP/1.0 write: {}", rs[0].text);
    let one = |id: &str, last: bool| {
        let body = format!(r#"{{"turn": 2, "messages": [{{"id": "{id}", "content": "{id}"}}]}}"#);
        format!(
            "POST /v1/sessions/hostile-pipe/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}\r\n{body}",
            body.len(),
            if last { "connection: close\r\n" } else { "" }
        )
    };
    let pipelined = format!("{}{}{}", one("p1", false), one("p2", false), one("p3", true));
    let rs = responses(&send_raw(p.addr, pipelined.as_bytes()).await);
    assert_eq!(rs.len(), 3, "pipelined requests: {rs:?}");
    assert!(rs.iter().all(|r| (200..300).contains(&r.status)), "{rs:?}");
    let ids = message_ids(&get_doc(&client(store.addr), "hostile-pipe").await.json);
    assert_eq!(ids, ["p1", "p2", "p3"]);

    // Nothing was written for the refused requests, and no lock is left.
    assert_eq!(get_doc(&client(store.addr), "hostile").await.status, 404);
    assert!(
        redis.lock_keys().is_empty(),
        "locks left behind: {:?}",
        redis.lock_keys()
    );
    // Other sessions were not affected and are still served.
    assert_eq!(get_doc(&client(store.addr), "canary").await.json, canary_before);
    let after = append(&c, "canary", 3, "canary-2").await;
    assert!(after.status.is_success(), "{}", after.json);
    p.stop().await;
}

/// A slowloris-style client trickling its request head is cut off, and meanwhile the proxy
/// serves everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_without_blocking_others() {
    let store = store().await;
    let p = proxy(proxy_args(store.addr, None)).await;
    let mut slow = Vec::new();
    for _ in 0..20 {
        slow.push(TcpStream::connect(p.addr).await.expect("connect"));
    }
    let head = b"POST /v1/sessions/slow/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\nx-slow: ";
    let started = tokio::time::Instant::now();
    let bound = turnlock::server::HEADER_READ_TIMEOUT * 3;
    let mut served = 0;
    let mut i = 0;
    // Trickle one byte per connection at a time, bounded in count and in time.
    while !slow.is_empty() && started.elapsed() < bound && i < 10_000 {
        let byte = [head[i % head.len()]];
        let mut alive = Vec::new();
        for mut s in slow.drain(..) {
            if s.write_all(&byte).await.is_ok() {
                let mut buf = [0u8; 512];
                match tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => {}
                    Ok(Ok(_)) => {} // answered (408): cut off
                    Err(_) => alive.push(s),
                }
            }
        }
        slow = alive;
        i += 1;
        if i % 10 == 0 {
            let r = try_append(&client(p.addr), "fast", 1, &format!("fast-{i}"), true, &[])
                .await
                .expect("others are served while slow clients trickle");
            assert!(r.status.is_success());
            served += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        slow.is_empty(),
        "{} slow clients still connected after {:?}",
        slow.len(),
        started.elapsed()
    );
    assert!(served > 0);
    eprintln!(
        "slow clients cut off after {:?}; {served} other writes served meanwhile",
        started.elapsed()
    );
    p.stop().await;
}

/// The admin port answers only what it serves, with JSON errors, and is not reachable on any
/// address but the one it is bound to (loopback by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_port_refuses_what_it_does_not_serve() {
    let store = store().await;
    let p = proxy(proxy_args(store.addr, None)).await;
    assert!(p.admin.ip().is_loopback(), "admin bound to {}", p.admin);
    let post = responses(&send_raw(p.admin, &request("POST", "/metrics", &[JSON], "{}")).await);
    assert_eq!(post[0].status, 405);
    assert_eq!(post[0].json["error"], "method_not_allowed");
    let unknown = responses(&send_raw(p.admin, &request("GET", "/shutdown", &[], "")).await);
    assert_eq!(unknown[0].status, 404);
    assert_eq!(unknown[0].json["error"], "not_found");
    let traversal = responses(&send_raw(p.admin, &request("GET", "/../metrics", &[], "")).await);
    assert!((400..500).contains(&traversal[0].status), "{}", traversal[0].text);
    // Another address of this host (still loopback here) finds nothing listening.
    let other = SocketAddr::from(([127, 0, 0, 2], p.admin.port()));
    assert!(
        TcpStream::connect(other).await.is_err(),
        "the admin port answers on {other}, not only on {}",
        p.admin
    );
    p.stop().await;
}

/// A client that sends a write's head and then trickles (or stops sending) its body is answered
/// 408 `body_timeout` once the body deadline passes, and holds no lock meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_is_refused_with_408() {
    let store = store().await;
    let p = proxy(proxy_args(store.addr, None)).await;
    let mut s = TcpStream::connect(p.addr).await.expect("connect");
    let head = b"POST /v1/sessions/trickle/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"turn\": 1,";
    s.write_all(head).await.expect("write head");
    // Meanwhile the same session is writable: a stalled body holds no lock.
    let r = try_append(&client(p.addr), "trickle", 1, "other", true, &[])
        .await
        .expect("append");
    assert!(r.status.is_success(), "{}", r.json);
    let started = tokio::time::Instant::now();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(turnlock::proxy::BODY_READ_TIMEOUT * 2, s.read(&mut buf))
        .await
        .expect("answered before twice the body deadline")
        .expect("read");
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body_timeout"), "{text}");
    assert!(started.elapsed() >= turnlock::proxy::BODY_READ_TIMEOUT / 2);
    assert_eq!(
        message_ids(&get_doc(&client(store.addr), "trickle").await.json),
        ["other"]
    );
    p.stop().await;
}

/// What HTTP itself refuses is answered before any route and never reaches the store: a
/// `CONNECT` or a standard method in another case (501), a request without one valid `Host`
/// where it needs one (400), a transfer coding other than `chunked` once (501: the body
/// would reach the store or the merge still coded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_http_itself_refuses_are_answered_before_any_route_and_never_forwarded() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let seen = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    // Counts what reaches the store, the health check's `GET /` aside.
    let store = serve(move |req: http::Request<hyper::body::Incoming>| {
        if req.uri().path() != "/" {
            counted.fetch_add(1, Ordering::SeqCst);
        }
        async { http::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"{}"))) }
    })
    .await;
    let p = proxy(proxy_args(store, None)).await;
    let chunked = "5\r\nhello\r\n0\r\n\r\n";
    let gzip = ("transfer-encoding", "gzip, chunked");
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "CONNECT",
            b"CONNECT store:443 HTTP/1.1\r\nhost: store:443\r\nconnection: close\r\n\r\n".to_vec(),
            501,
            "method_not_supported",
        ),
        (
            "no Host",
            b"GET /v1/sessions/a HTTP/1.1\r\nconnection: close\r\n\r\n".to_vec(),
            400,
            "invalid_host",
        ),
        (
            "two Hosts",
            b"GET /v1/sessions/a HTTP/1.1\r\nhost: a\r\nhost: b\r\nconnection: close\r\n\r\n".to_vec(),
            400,
            "invalid_host",
        ),
        (
            "two Hosts in HTTP/1.0",
            b"GET /v1/sessions/a HTTP/1.0\r\nhost: a\r\nhost: b\r\n\r\n".to_vec(),
            400,
            "invalid_host",
        ),
        (
            "a Host that names no host",
            b"GET /v1/sessions/a HTTP/1.1\r\nhost: a, b\r\nconnection: close\r\n\r\n".to_vec(),
            400,
            "invalid_host",
        ),
        (
            "a Host with user information",
            b"GET /v1/sessions/a HTTP/1.1\r\nhost: user@a\r\nconnection: close\r\n\r\n".to_vec(),
            400,
            "invalid_host",
        ),
        (
            "a write's method in lower case",
            request("put", "/v1/sessions/a", &[JSON], r#"{"turn": 1, "messages": []}"#),
            501,
            "method_not_supported",
        ),
        (
            "chunked twice, passed through",
            request(
                "POST",
                "/files/a",
                &[("transfer-encoding", "chunked, chunked")],
                chunked,
            ),
            501,
            "unsupported_transfer_coding",
        ),
        (
            "gzip-coded write",
            request("POST", "/v1/sessions/a/messages", &[JSON, gzip], chunked),
            501,
            "unsupported_transfer_coding",
        ),
        (
            "gzip-coded upload passed through",
            request("PUT", "/files/a", &[gzip], chunked),
            501,
            "unsupported_transfer_coding",
        ),
    ];
    for (name, bytes, status, code) in cases {
        let mut s = TcpStream::connect(p.addr).await.expect("connect");
        s.write_all(&bytes).await.expect("send");
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf).into_owned();
        // One answer: its status, and its body's JSON.
        let answered: u16 = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let json: Value = text
            .split_once("\r\n\r\n")
            .and_then(|(_, body)| serde_json::from_str(body).ok())
            .unwrap_or(Value::Null);
        assert_eq!(answered, status, "{name}: {text}");
        assert_eq!(json["error"], code, "{name}: {text}");
    }
    assert_eq!(seen.load(Ordering::SeqCst), 0, "a refused request reached the store");
    // Host is optional in HTTP/1.0: such a request is served.
    let mut s = TcpStream::connect(p.addr).await.expect("connect");
    s.write_all(b"GET /v1/sessions/a HTTP/1.0\r\n\r\n").await.expect("send");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200"),
        "{text}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    p.stop().await;
}
