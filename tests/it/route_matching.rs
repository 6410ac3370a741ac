//! Write routes match every spelling a store may read as the same path: percent-encoded
//! unreserved characters, dot segments, duplicate and trailing slashes. Each such spelling of
//! a write is served under the lock with the stale check, or refused when stores could read it
//! as different writes; none reaches the store unlocked. Routes-file mistakes stop the proxy
//! at startup with a message saying what to fix.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::support::*;
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// A store with its own append API: answers 201 and remembers every request path it got,
/// with the fencing token the request carried (empty when none: not serialized).
async fn event_store() -> (SocketAddr, Arc<Mutex<Vec<(String, String)>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let log = log.clone();
                    async move {
                        let token = req
                            .headers()
                            .get("x-fencing-token")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned();
                        // The proxy's background health check reads `/`: not a write.
                        if req.uri().path() != "/" {
                            log.lock().expect("log").push((req.uri().to_string(), token));
                        }
                        let _ = req.into_body().collect().await;
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(201)
                                .body(Full::new(Bytes::from_static(b"{}")))
                                .expect("response"),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// Sends a request with its path exactly as given (no client-side normalization).
async fn send_raw(addr: SocketAddr, method: Method, path: &str, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "store")
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Proxy settings for these tests: a lock budget generous enough for a loaded machine, since
/// what they check is which requests are writes, not how fast the lock is.
fn args_for(upstream: SocketAddr, redis: Option<&RedisServer>) -> turnlock::config::ProxyArgs {
    let mut args = proxy_args(upstream, redis);
    args.lock_budget_ms = 2000;
    args
}

fn routes_file(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("routes.toml");
    std::fs::write(&path, text).expect("write routes");
    path.to_string_lossy().into_owned()
}

const EVENTS_ROUTE: &str = "[[route]]\nmethod = \"POST\"\npath = \"/api/threads/{session}/events/\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n";

#[tokio::test]
async fn every_spelling_of_a_serialize_route_is_locked_and_stale_checked() {
    let (store, seen) = event_store().await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = args_for(store, Some(&redis));
    args.routes = Some(routes_file(&dir, EVENTS_ROUTE));
    let proxy = proxy(args).await;

    // The route is configured with a trailing slash: its own path is a write.
    let (status, body) = send_raw(
        proxy.addr,
        Method::POST,
        "/api/threads/t1/events/",
        &[("x-turn", "10")],
        json!({}),
    )
    .await;
    assert_eq!(status, 201, "{body}");

    let spellings = [
        "/api/threads/t1/events/",
        "/api/threads/t1/events",
        "/api/threads/t1/%65vents",
        "/api/threads/%741/events",
        "/api//threads/t1/events",
        "/api/threads/t1/./events",
        "/api/x/../threads/t1/events",
        "/api/threads/t1/events;v=1",
        "/API/threads/t1/events",
        "/api/Threads/t1/EVENTS",
    ];
    for path in spellings {
        let (status, body) = send_raw(proxy.addr, Method::POST, path, &[("x-turn", "1")], json!({})).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (409, Some("stale_turn")),
            "{path}: {body}"
        );
        assert_eq!(body["current_turn"], 10, "{path}");
        let (status, body) = send_raw(proxy.addr, Method::POST, path, &[], json!({})).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (400, Some("missing_turn")),
            "{path}: {body}"
        );
    }
    // Read as two different sessions by two kinds of store: refused, never forwarded.
    let (status, body) = send_raw(
        proxy.addr,
        Method::POST,
        "/api/threads/t2%2F..%2Ft1/events",
        &[("x-turn", "11")],
        json!({}),
    )
    .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("ambiguous_path")),
        "{body}"
    );
    // A current turn under any spelling is forwarded as written, with a fencing token.
    for (i, path) in spellings.iter().enumerate() {
        let turn = (11 + i).to_string();
        let (status, body) = send_raw(proxy.addr, Method::POST, path, &[("x-turn", &turn)], json!({})).await;
        assert_eq!(status, 201, "{path}: {body}");
    }
    let seen = seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 1 + spellings.len(), "{seen:?}");
    assert!(
        seen.iter().all(|(_, token)| !token.is_empty()),
        "forwarded without the lock: {seen:?}"
    );
    assert_eq!(seen[3].0, "/api/threads/t1/%65vents", "forwarded unchanged");
}

#[tokio::test]
async fn every_spelling_of_a_canonical_write_is_served_as_that_write() {
    let store = store().await;
    let proxy = proxy(args_for(store.addr, None)).await;
    let append = |turn: u64, id: &str| json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": "x"}]});
    let (status, _) = send_raw(
        proxy.addr,
        Method::POST,
        "/v1/sessions/s1/messages",
        &[],
        append(10, "m0"),
    )
    .await;
    assert_eq!(status, 201);
    let spellings = [
        "/v1/sessions/s1/messages/",
        "/v1/sessions/s1/%6Dessages",
        "/v1//sessions/s1/messages",
        "/v1/sessions/s1/./messages",
    ];
    for path in spellings {
        let (status, body) = send_raw(proxy.addr, Method::POST, path, &[], append(1, "stale")).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (409, Some("stale_turn")),
            "{path}: {body}"
        );
    }
    for (i, path) in spellings.iter().enumerate() {
        let (status, body) = send_raw(proxy.addr, Method::POST, path, &[], append(10, &format!("m{}", i + 1))).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (status, doc) = send_raw(store.addr, Method::GET, "/v1/sessions/s1", &[], json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(message_ids(&doc), ["m0", "m1", "m2", "m3", "m4"]);
    assert_eq!(doc["turn"], 10);
    // A PUT to the document with a trailing slash is the merged PUT, not a blind overwrite.
    let (status, body) = send_raw(
        proxy.addr,
        Method::PUT,
        "/v1/sessions/s1/",
        &[],
        json!({"turn": 2, "messages": []}),
    )
    .await;
    assert_eq!((status, body["error"].as_str()), (409, Some("stale_turn")), "{body}");
}

#[tokio::test]
async fn a_header_route_refuses_a_disagreeing_session_turn_header() {
    let (store, seen) = event_store().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = args_for(store, None);
    args.routes = Some(routes_file(&dir, EVENTS_ROUTE));
    let proxy = proxy(args).await;
    let (status, body) = send_raw(
        proxy.addr,
        Method::POST,
        "/api/threads/t1/events",
        &[("x-turn", "5"), ("x-session-turn", "6")],
        json!({}),
    )
    .await;
    assert_eq!((status, body["error"].as_str()), (400, Some("turn_mismatch")), "{body}");
    let (status, _) = send_raw(
        proxy.addr,
        Method::POST,
        "/api/threads/t1/events",
        &[("x-turn", "5"), ("x-session-turn", "5")],
        json!({}),
    )
    .await;
    assert_eq!(status, 201);
    assert_eq!(seen.lock().expect("log").len(), 1);
}

#[test]
fn routes_file_mistakes_stop_the_proxy_with_a_clear_message() {
    let route = |extra: &str| format!("[[route]]\nmethod = \"POST\"\nturn = {{ header = \"X-Turn\" }}\n{extra}\n");
    for (text, needle) in [
        (
            route("path = \"/a/{session}/events?x=1\"\nmode = \"serialize\""),
            "query string",
        ),
        (
            route("path = \"/a/{thread}/events\"\nmode = \"serialize\""),
            "exactly one {session}",
        ),
        (
            route("path = \"/a/{session}/x{thread\"\nmode = \"serialize\""),
            "does not close",
        ),
        (
            route("path = \"/a/{session}/événements\"\nmode = \"serialize\""),
            "non-ASCII",
        ),
        (
            format!(
                "{}{}",
                route("path = \"/a/{session}/events\"\nmode = \"serialize\""),
                route("path = \"/a/{session}/events/\"\nmode = \"serialize\"")
            ),
            "already route #1",
        ),
        (
            route("path = \"/a/{session}/events\"\nmode = \"serialize\"\nkind = \"append\""),
            "`kind` and `document`",
        ),
        (
            "[[route]]\nmethod = \"POST\"\npath = \"/a/{session}\"\nturn = { body = \"\" }\nmode = \"serialize\"\n"
                .into(),
            "not a JSON pointer",
        ),
        ("session_prefix = \"/\"\n".into(), "session_prefix"),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = routes_file(&dir, &text);
        let (port, admin) = (free_port(), free_port());
        let mut child = std::process::Command::new(turnlock_bin())
            .args([
                "proxy",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin",
                &format!("127.0.0.1:{admin}"),
                "--routes",
                &path,
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run turnlock");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while child.try_wait().expect("wait").is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if child.try_wait().expect("wait").is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the proxy started with a routes file it should refuse: {text}");
        }
        let out = child.wait_with_output().expect("output");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{text}: {stderr}");
        assert!(stderr.contains(needle), "{stderr:?} lacks {needle:?}");
    }
}

#[tokio::test]
async fn an_object_stores_names_are_its_own_case_and_characters_included() {
    let (store, seen) = event_store().await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = args_for(store, Some(&redis));
    args.routes = Some(routes_file(
        &dir,
        "[store]\ndialect = \"s3\"\n\n[[route]]\nmethod = \"PUT\"\npath = \"/b/strands/session_{session}/obj.json\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    ));
    let proxy = proxy(args).await;
    // A session named with characters the canonical API refuses (an S3 key takes them) is
    // served as a session: locked, fenced and stale-checked.
    for name in ["tenant%3A42", "alice%20smith", "%C3%BC-1"] {
        let path = format!("/b/strands/session_{name}/obj.json");
        let (status, body) = send_raw(proxy.addr, Method::PUT, &path, &[("x-turn", "5")], json!({})).await;
        assert!((200..300).contains(&status), "{name}: {status} {body}");
        let (status, _) = send_raw(proxy.addr, Method::PUT, &path, &[("x-turn", "4")], json!({})).await;
        assert_eq!(status, 412, "{name}: an older turn must be refused");
    }
    // Another case is another object in S3: passed through, not taken for this route's write.
    let (status, body) = send_raw(
        proxy.addr,
        Method::PUT,
        "/b/Strands/session_x/obj.json",
        &[("x-turn", "1")],
        json!({}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let log = seen.lock().expect("log").clone();
    let other_case: Vec<_> = log.iter().filter(|(p, _)| p.contains("/Strands/")).collect();
    assert_eq!(other_case.len(), 1, "{log:?}");
    assert_eq!(other_case[0].1, "", "a write of another case was serialized: {log:?}");
    assert!(
        log.iter()
            .filter(|(p, _)| p.contains("/strands/"))
            .all(|(_, token)| !token.is_empty()),
        "{log:?}"
    );
}
