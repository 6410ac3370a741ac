//! The agent-facing API contract of DESIGN.md, over real sockets: every outcome and status
//! code, pass-through, idempotency, the lock's budget, lease renewal and expiry, serialize
//! routes, metrics and readiness.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use turnlock::client::JsonClient;

use crate::support::*;

struct Stack {
    store: turnlock::store::RunningStore,
    proxy: turnlock::sidecar::Running,
    agent: JsonClient,
    direct: JsonClient,
}

async fn stack() -> Stack {
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, None)).await;
    Stack {
        agent: client(proxy.addr),
        direct: client(store.addr),
        store,
        proxy,
    }
}

/// Sends raw bytes with a content type, for the malformed-input cases.
async fn raw(
    addr: SocketAddr,
    method: Method,
    path: &str,
    content_type: &str,
    body: &'static [u8],
) -> (StatusCode, Value) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "turnlock")
        .header("content-type", content_type)
        .body(Full::new(Bytes::from_static(body)))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn append_creates_the_session_then_appends_with_version_and_etag() {
    let s = stack().await;
    let r = append_ids(&s.agent, "a1", 1, &["m1", "m2"]).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(
        (r.json["turn"].as_u64(), r.json["version"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(r.json["message_ids"], json!(["m1", "m2"]));
    assert_eq!(r.headers["etag"], "\"1\"");
    let r = append_ids(&s.agent, "a1", 2, &["m2", "m3"]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["version"], 2);
    let doc = get_doc(&s.direct, "a1").await.json;
    assert_eq!(message_ids(&doc), ["m1", "m2", "m3"]);
    assert_eq!(doc["turn"], 2);
    assert_eq!(doc["session"], "a1");
    s.proxy.stop().await;
    s.store.stop().await;
}

#[tokio::test]
async fn stale_turn_is_rejected_with_current_turn() {
    let s = stack().await;
    append_ids(&s.agent, "st", 7, &["a"]).await;
    let r = append_ids(&s.agent, "st", 5, &["late"]).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.json["error"], "stale_turn");
    assert_eq!(r.json["current_turn"], 7);
    assert_eq!(message_ids(&get_doc(&s.direct, "st").await.json), ["a"]);
    let r = send(
        &s.agent,
        Method::PATCH,
        "/v1/sessions/st",
        json!({"turn": 6, "state": {"x": 1}}),
        &[],
    )
    .await;
    assert_eq!(r.json["error"], "stale_turn");
}

#[tokio::test]
async fn turn_comes_from_the_body_or_the_header_and_they_must_agree() {
    let s = stack().await;
    let path = "/v1/sessions/h1/messages";
    let r = send(
        &s.agent,
        Method::POST,
        path,
        json!({"messages": [{"id": "a"}]}),
        &[("x-session-turn", "3".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.json["turn"], 3);
    let r = send(
        &s.agent,
        Method::POST,
        path,
        json!({"turn": 4, "messages": []}),
        &[("x-session-turn", "5".into())],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("turn_mismatch"))
    );
}

#[tokio::test]
async fn malformed_writes_get_specific_400s_and_change_nothing() {
    let s = stack().await;
    append_ids(&s.agent, "bad", 1, &["keep"]).await;
    let p = "/v1/sessions/bad/messages";
    let cases: Vec<(&'static [u8], &str)> = vec![
        (b"{\"turn\": 1, \"messages\": [", "malformed_json"),
        (b"[1, 2]", "invalid_body"),
        (b"{\"messages\": []}", "missing_turn"),
        (b"{\"turn\": -1, \"messages\": []}", "invalid_turn"),
        (b"{\"turn\": 1.5, \"messages\": []}", "invalid_turn"),
        (b"{\"turn\": \"7\", \"messages\": []}", "invalid_turn"),
        (b"{\"turn\": 1e300, \"messages\": []}", "invalid_turn"),
        (b"{\"turn\": 1}", "invalid_messages"),
        (b"{\"turn\": 1, \"messages\": [1]}", "invalid_messages"),
        (b"{\"turn\": 1, \"messages\": [{\"id\": 5}]}", "invalid_messages"),
    ];
    for (body, code) in cases {
        let (status, json) = raw(s.proxy.addr, Method::POST, p, "application/json", body).await;
        assert_eq!(
            (status, json["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some(code)),
            "{}",
            String::from_utf8_lossy(body)
        );
        assert!(json["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    for bad_id in ["a:b", "a*", "..", "a%2Fb", "x".repeat(200).as_str()] {
        let (status, json) = raw(
            s.proxy.addr,
            Method::POST,
            &format!("/v1/sessions/{bad_id}/messages"),
            "application/json",
            b"{\"turn\":1,\"messages\":[]}",
        )
        .await;
        assert_eq!(
            (status, json["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_session_id")),
            "{bad_id}"
        );
    }
    let (status, json) = raw(
        s.proxy.addr,
        Method::POST,
        p,
        "text/plain",
        b"{\"turn\":1,\"messages\":[]}",
    )
    .await;
    assert_eq!(
        (status, json["error"].as_str()),
        (StatusCode::UNSUPPORTED_MEDIA_TYPE, Some("unsupported_media_type"))
    );
    let (status, json) = raw(
        s.proxy.addr,
        Method::PATCH,
        "/v1/sessions/bad",
        "application/merge-patch+json",
        b"{\"turn\":1,\"messages\":[]}",
    )
    .await;
    assert_eq!(
        (status, json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("forbidden_field"))
    );
    let (status, json) = raw(
        s.proxy.addr,
        Method::POST,
        "/v1/sessions/bad/compact",
        "application/json",
        b"{\"turn\":1}",
    )
    .await;
    assert_eq!(
        (status, json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_through"))
    );
    let doc = get_doc(&s.direct, "bad").await.json;
    assert_eq!(
        (message_ids(&doc), doc["version"].as_u64()),
        (vec!["keep".to_string()], Some(1))
    );
}

#[tokio::test]
async fn bodies_over_the_limit_get_413_declared_or_streamed() {
    let store = store().await;
    let mut args = proxy_args(store.addr, None);
    args.max_body_bytes = 1024;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let big = "x".repeat(4096);
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/big/messages",
        json!({"turn": 1, "messages": [{"content": big}]}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("body_too_large"))
    );
    // Chunked (no Content-Length): the limit applies while streaming.
    let stream = tokio::net::TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let chunks = futures_util::stream::iter(
        (0..8).map(|_| Ok::<_, Infallible>(hyper::body::Frame::data(Bytes::from(vec![b' '; 512])))),
    );
    let req = Request::post("/v1/sessions/big/messages")
        .header("host", "t")
        .header("content-type", "application/json")
        .body(http_body_util::StreamBody::new(chunks))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(get_doc(&client(store.addr), "big").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn merged_put_from_a_stale_copy_keeps_everything_acknowledged() {
    let s = stack().await;
    append_ids(&s.agent, "mp", 1, &["a"]).await;
    let copy = get_doc(&s.agent, "mp").await.json;
    // Meanwhile another replica appends and changes its own field.
    append_ids(&s.agent, "mp", 1, &["b"]).await;
    send(
        &s.agent,
        Method::PATCH,
        "/v1/sessions/mp",
        json!({"turn": 1, "state": {"other": true}}),
        &[],
    )
    .await;
    let mut mine = copy.clone();
    mine["turn"] = json!(2);
    mine["plan"] = json!("mine");
    mine["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"id": "c", "role": "user"}));
    let r = send(&s.agent, Method::PUT, "/v1/sessions/mp", mine.clone(), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let doc = get_doc(&s.direct, "mp").await.json;
    assert_eq!(message_ids(&doc), ["a", "b", "c"]);
    assert_eq!(doc["state"], json!({"other": true}));
    assert_eq!(doc["plan"], "mine");
    // The same stale copy changing a field someone else changed too: 409 conflict.
    send(
        &s.agent,
        Method::PATCH,
        "/v1/sessions/mp",
        json!({"turn": 2, "plan": "theirs"}),
        &[],
    )
    .await;
    let mut clash = get_doc(&s.agent, "mp").await.json;
    clash["version"] = json!(r.json["version"]);
    clash["plan"] = json!("third");
    clash["turn"] = json!(2);
    let r = send(&s.agent, Method::PUT, "/v1/sessions/mp", clash, &[]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{}",
        r.json
    );
    assert_eq!(r.json["fields"], json!(["plan"]));
}

#[tokio::test]
async fn compaction_commutes_with_appends_and_stale_copies_do_not_bring_messages_back() {
    let s = stack().await;
    append_ids(&s.agent, "cp", 1, &["a", "b", "c"]).await;
    let copy = get_doc(&s.agent, "cp").await.json;
    let r = send(
        &s.agent,
        Method::POST,
        "/v1/sessions/cp/compact",
        json!({"turn": 1, "through": "b", "summary": {"text": "a, b"}}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    append_ids(&s.agent, "cp", 1, &["d"]).await;
    let mut mine = copy;
    mine["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"id": "e"}));
    let r = send(&s.agent, Method::PUT, "/v1/sessions/cp", mine, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let doc = get_doc(&s.direct, "cp").await.json;
    assert_eq!(message_ids(&doc), ["c", "d", "e"]);
    assert_eq!(doc["summary"], json!({"text": "a, b"}));
    let r = send(
        &s.agent,
        Method::POST,
        "/v1/sessions/cp/compact",
        json!({"turn": 1, "through": "zz"}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("unknown_message"))
    );
    let r = send(
        &s.agent,
        Method::POST,
        "/v1/sessions/none/compact",
        json!({"turn": 1, "through": "a"}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("session_not_found"))
    );
}

#[tokio::test]
async fn replacement_needs_if_match_and_the_current_version() {
    let s = stack().await;
    append_ids(&s.agent, "rp", 1, &["a"]).await;
    let doc = json!({"turn": 1, "messages": [{"id": "z"}], "state": {"fresh": true}});
    let replace = ("x-context-replace", "true".to_string());
    let r = send(
        &s.agent,
        Method::PUT,
        "/v1/sessions/rp",
        doc.clone(),
        std::slice::from_ref(&replace),
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PRECONDITION_REQUIRED, Some("precondition_required"))
    );
    let r = send(
        &s.agent,
        Method::PUT,
        "/v1/sessions/rp",
        doc.clone(),
        &[replace.clone(), ("if-match", "\"0\"".into())],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PRECONDITION_FAILED, Some("version_mismatch"))
    );
    assert_eq!(r.json["current_version"], 1);
    let r = send(
        &s.agent,
        Method::PUT,
        "/v1/sessions/rp",
        doc,
        &[replace, ("if-match", "\"1\"".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let stored = get_doc(&s.direct, "rp").await.json;
    assert_eq!(message_ids(&stored), ["z"]);
    assert_eq!(stored["state"], json!({"fresh": true}));
}

#[tokio::test]
async fn idempotency_key_replays_the_first_answer_and_refuses_reuse() {
    let s = stack().await;
    let key = ("idempotency-key", "retry-1".to_string());
    let body = json!({"turn": 1, "messages": [{"role": "user", "content": "no id: the retry must not add it twice"}]});
    let first = send(
        &s.agent,
        Method::POST,
        "/v1/sessions/ik/messages",
        body.clone(),
        std::slice::from_ref(&key),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(
        &s.agent,
        Method::POST,
        "/v1/sessions/ik/messages",
        body.clone(),
        std::slice::from_ref(&key),
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.json, first.json);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(message_ids(&get_doc(&s.direct, "ik").await.json).len(), 1);
    let other = json!({"turn": 1, "messages": [{"content": "different"}]});
    let r = send(&s.agent, Method::POST, "/v1/sessions/ik/messages", other, &[key]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("idempotency_key_reused"))
    );
    let metrics = String::from_utf8_lossy(
        &client(s.proxy.admin)
            .send(Method::GET, "/metrics", None, &[])
            .await
            .expect("metrics")
            .body,
    )
    .into_owned();
    assert!(metrics.contains("turnlock_idempotent_replays_total 1"), "{metrics}");
}

#[tokio::test]
async fn lock_not_obtained_within_the_wait_deadline_is_session_busy_with_retry_after() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.wait_deadline_ms = 400;
    let proxy = proxy(args).await;
    // Another owner holds the lock of turn 1 of this session.
    redis.cmd(&["SET", "turnlock:session:{busy}:1", "someone-else", "PX", "5000"]);
    let started = std::time::Instant::now();
    let r = append_ids(&client(proxy.addr), "busy", 1, &["x"]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("session_busy"))
    );
    assert!(r.headers.contains_key("retry-after"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(350),
        "answered busy after {waited:?}, before the wait deadline (many lock budgets)"
    );
    assert!(waited < Duration::from_secs(2), "waited far past the wait deadline");
    assert_eq!(get_doc(&client(store.addr), "busy").await.status, StatusCode::NOT_FOUND);
    // Another turn of the same session is a different lock.
    assert_eq!(
        append_ids(&client(proxy.addr), "busy", 2, &["y"]).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_write_asks_for_a_shorter_wait_and_never_a_longer_one() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.wait_deadline_ms = 600;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    redis.cmd(&["SET", "turnlock:session:{short}:1", "someone-else", "PX", "5000"]);
    let body = json!({"turn": 1, "messages": [{"role": "user", "content": "x"}]});
    let path = "/v1/sessions/short/messages";
    for (asked, at_least, below) in [("100", 80, 450), ("60000", 550, 2000)] {
        let started = std::time::Instant::now();
        let r = send(
            &agent,
            Method::POST,
            path,
            body.clone(),
            &[("x-wait-deadline-ms", asked.into())],
        )
        .await;
        let waited = started.elapsed();
        assert_eq!(r.json["error"], "session_busy", "{}", r.json);
        assert!(
            waited >= Duration::from_millis(at_least) && waited < Duration::from_millis(below),
            "asked for {asked} ms, answered after {waited:?}"
        );
    }
    for bad in ["0", "soon", "-5"] {
        let r = send(
            &agent,
            Method::POST,
            path,
            body.clone(),
            &[("x-wait-deadline-ms", bad.into())],
        )
        .await;
        assert_eq!(
            (r.status, r.json["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_wait_deadline"))
        );
    }
}

#[tokio::test]
async fn a_write_that_loses_the_race_to_another_turn_is_re_merged_not_answered_write_conflict() {
    let redis = RedisServer::start();
    let store = store().await;
    // Every write-back takes 150 ms, longer than the re-reads one grant allows (half a lease).
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(150))).await;
    let mut args = proxy_args(slow, Some(&redis));
    args.lock_ttl_ms = 200;
    let (a, b) = (proxy(args.clone()).await, proxy(args).await);
    let seed = append_ids(&client(a.addr), "race", 1, &["seed"]).await;
    assert_eq!(seed.status, StatusCode::CREATED, "{}", seed.json);
    // Turn 2 on B reads the document before turn 1's write-back on A lands, and writes after it.
    let first = {
        let agent = client(a.addr);
        tokio::spawn(async move { append_ids(&agent, "race", 1, &["one"]).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = append_ids(&client(b.addr), "race", 2, &["two"]).await;
    let first = first.await.expect("first writer");
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);
    assert_eq!(second.status, StatusCode::OK, "{}", second.json);
    let ids = message_ids(&get_doc(&client(store.addr), "race").await.json);
    assert_eq!(ids, ["seed", "one", "two"]);
    let requeued: f64 = [&a, &b]
        .iter()
        .map(|p| metric(&p.metrics.encode(), "turnlock_writes_requeued_total"))
        .sum();
    assert!(requeued >= 1.0, "no write was queued again");
}

#[tokio::test]
async fn an_expired_lease_of_a_dead_holder_is_taken_over() {
    let redis = RedisServer::start();
    let store = store().await;
    // With the default wait deadline: the write waits out the dead holder's lease.
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    redis.cmd(&["SET", "turnlock:session:{dead}:1", "crashed-owner", "PX", "400"]);
    let started = std::time::Instant::now();
    let r = append_ids(&client(proxy.addr), "dead", 1, &["x"]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the lock was taken while still leased"
    );
    assert!(redis.lock_keys().is_empty(), "lock left behind");
}

#[tokio::test]
async fn a_slow_write_keeps_its_lease_by_renewal() {
    let redis = RedisServer::start();
    let store = store().await;
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(700))).await;
    let mut args = proxy_args(slow, Some(&redis));
    args.lock_ttl_ms = 200;
    let proxy = proxy(args).await;
    let r = append_ids(&client(proxy.addr), "slow", 1, &["a"]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let metrics = proxy.metrics.encode();
    let renewed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("turnlock_lock_renewals_total{outcome=\"renewed\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        renewed >= 2.0,
        "lease not renewed during a write three leases long: {metrics}"
    );
    assert_eq!(message_ids(&get_doc(&client(store.addr), "slow").await.json), ["a"]);
}

#[tokio::test]
async fn upstream_down_or_silent_gives_502_or_504_and_releases_the_lock() {
    let redis = RedisServer::start();
    // Nothing listens on this port.
    let dead: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let proxy_dead = proxy(proxy_args(dead, Some(&redis))).await;
    let r = append_ids(&client(proxy_dead.addr), "u", 1, &["a"]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_GATEWAY, Some("upstream_unavailable"))
    );
    let r = client(proxy_dead.addr)
        .send(Method::GET, "/v1/sessions/u", None, &[])
        .await
        .expect("get");
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    // A store that accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let mut args = proxy_args(silent_addr, Some(&redis));
    args.upstream_timeout_ms = 300;
    let proxy_silent = proxy(args).await;
    let r = append_ids(&client(proxy_silent.addr), "u", 1, &["a"]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::GATEWAY_TIMEOUT, Some("upstream_timeout"))
    );
    assert!(redis.lock_keys().is_empty(), "lock left behind after upstream failure");
}

/// An upstream that echoes what it received, to check pass-through.
async fn echo_server() -> SocketAddr {
    serve(|req: Request<Incoming>| async move {
        let mut headers = serde_json::Map::new();
        for (k, v) in req.headers() {
            headers.insert(k.to_string(), json!(v.to_str().unwrap_or("")));
        }
        let method = req.method().to_string();
        let uri = req.uri().to_string();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let echo = json!({"method": method, "uri": uri, "headers": headers, "body": String::from_utf8_lossy(&body)});
        Response::builder()
            .status(218)
            .header("x-from-upstream", "yes")
            .body(Full::new(Bytes::from(echo.to_string())))
            .expect("response")
    })
    .await
}

#[tokio::test]
async fn reads_and_other_requests_pass_through_unchanged_but_hop_by_hop_headers() {
    let upstream = echo_server().await;
    let proxy = proxy(proxy_args(upstream, None)).await;
    let agent = client(proxy.addr);
    let r = agent
        .send(
            Method::DELETE,
            "/anything/at/all?x=1&y=%2F",
            Some(&json!({"k": "v"})),
            &[
                ("x-custom", "kept".into()),
                ("connection", "x-private".into()),
                ("x-private", "dropped".into()),
                ("authorization", "Bearer t".into()),
            ],
        )
        .await
        .expect("request");
    assert_eq!(r.status.as_u16(), 218);
    assert_eq!(r.headers["x-from-upstream"], "yes");
    assert_eq!(r.json["method"], "DELETE");
    assert_eq!(r.json["uri"], "/anything/at/all?x=1&y=%2F");
    assert_eq!(r.json["body"], "{\"k\":\"v\"}");
    let h = &r.json["headers"];
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["authorization"], "Bearer t");
    assert!(
        h.get("x-private").is_none() && h.get("connection").is_none(),
        "hop-by-hop headers forwarded: {h}"
    );
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    // A GET of a session is a read: forwarded, never locked.
    let r = agent
        .send(Method::GET, "/v1/sessions/s1", None, &[])
        .await
        .expect("get");
    assert_eq!(r.json["method"], "GET");
}

#[tokio::test]
async fn serialize_routes_forward_unchanged_under_the_lock_after_the_stale_check() {
    let upstream = echo_server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let routes = dir.path().join("routes.toml");
    std::fs::write(
        &routes,
        "[[route]]\nmethod = \"POST\"\npath = \"/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("write routes");
    let redis = RedisServer::start();
    let mut args = proxy_args(upstream, Some(&redis));
    args.routes = Some(routes.to_string_lossy().into_owned());
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let r = agent
        .send(
            Method::POST,
            "/threads/t1/events",
            Some(&json!({"e": 1})),
            &[("x-turn", "4".into())],
        )
        .await
        .expect("post");
    assert_eq!(r.status.as_u16(), 218);
    assert_eq!(r.json["body"], "{\"e\":1}");
    assert!(r.json["headers"]["x-fencing-token"]
        .as_str()
        .is_some_and(|t| t.parse::<u64>().is_ok()));
    let r = agent
        .send(
            Method::POST,
            "/threads/t1/events",
            Some(&json!({"e": 2})),
            &[("x-turn", "3".into())],
        )
        .await
        .expect("post");
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("stale_turn"))
    );
    assert_eq!(r.json["current_turn"], 4);
    let r = agent
        .send(Method::POST, "/threads/t1/events", Some(&json!({"e": 3})), &[])
        .await
        .expect("post");
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("missing_turn"))
    );
}

#[tokio::test]
async fn readiness_stays_through_dependency_outages_and_status_shows_them() {
    let mut redis = RedisServer::start();
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    let admin = client(proxy.admin);
    let get = |path: &'static str| {
        let admin = admin.clone();
        async move { admin.send(Method::GET, path, None, &[]).await.expect(path) }
    };
    assert_eq!(get("/healthz").await.status, StatusCode::OK);
    assert_eq!(get("/readyz").await.status, StatusCode::OK);
    let up = |status: &serde_json::Value, dep: &str| status["dependencies"][dep]["up"].as_bool();
    let mut seen = None;
    for _ in 0..50 {
        let s = get("/status").await.json;
        if up(&s, "redis") == Some(true) && up(&s, "store") == Some(true) {
            seen = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen.is_some(), "/status never showed both dependencies up");
    redis.kill();
    let mut down = false;
    for _ in 0..50 {
        assert_eq!(
            get("/readyz").await.status,
            StatusCode::OK,
            "not ready because Redis is down"
        );
        if up(&get("/status").await.json, "redis") == Some(false) {
            down = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(down, "/status never showed Redis down");
    redis.restart();
    let mut back = false;
    for _ in 0..50 {
        if up(&get("/status").await.json, "redis") == Some(true) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "/status did not show Redis back");
    store.stop().await;
    let mut store_down = false;
    for _ in 0..50 {
        assert_eq!(
            get("/readyz").await.status,
            StatusCode::OK,
            "not ready because the store is down"
        );
        if up(&get("/status").await.json, "store") == Some(false) {
            store_down = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store_down, "/status never showed the store down");
}

#[tokio::test]
async fn a_store_without_etags_is_ordered_by_the_commit_slot() {
    let redis = RedisServer::start();
    let store = store_without_etags().await;
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    let agent = client(proxy.addr);
    // Writers of different turns hold different locks; the fence must still order them.
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let agent = agent.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("m{i}");
            for _ in 0..50 {
                let r = append_ids(&agent, "nf", 1 + i % 3, &[&id]).await;
                if r.status.is_success() {
                    return Some(id);
                }
                if r.json["error"] == "stale_turn" {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            None
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        if let Some(id) = t.await.expect("task") {
            acked.push(id);
        }
    }
    let stored = message_ids(&get_doc(&client(store.addr), "nf").await.json);
    assert!(!acked.is_empty());
    for id in &acked {
        assert_eq!(
            stored.iter().filter(|s| *s == id).count(),
            1,
            "{id} lost or duplicated; stored {stored:?}"
        );
    }
    assert!(
        redis.keys("turnlock:session:{nf}:*:slot").is_empty(),
        "a commit slot outlived its writes"
    );
}

#[tokio::test]
async fn sigterm_finishes_in_flight_writes_releases_locks_and_exits_zero() {
    let redis = RedisServer::start();
    let store = store().await;
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(600))).await;
    let port = free_port();
    let mut proxy = Proc::spawn(&[
        "proxy",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin",
        &format!("127.0.0.1:{}", free_port()),
        "--upstream",
        &format!("http://{slow}"),
        "--redis",
        &redis.url(),
    ]);
    wait_for_port(port, Duration::from_secs(10));
    let agent = JsonClient::new(format!("http://127.0.0.1:{port}"));
    let write = tokio::spawn(async move { append_ids(&agent, "term", 1, &["in-flight"]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.signal("TERM");
    let r = write.await.expect("write task");
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "the in-flight write was not finished: {}",
        r.json
    );
    let mut exit = None;
    for _ in 0..100 {
        if let Some(status) = proxy.child.try_wait().expect("wait") {
            exit = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let exit = exit.expect("proxy still running 5 s after SIGTERM");
    assert!(exit.success(), "exit status {exit:?}");
    assert!(redis.lock_keys().is_empty(), "lock left behind at shutdown");
    assert_eq!(
        message_ids(&get_doc(&client(store.addr), "term").await.json),
        ["in-flight"]
    );
    // New connections are refused once it is gone.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn coalesced_writes_report_the_version_the_store_holds() {
    let s = stack().await;
    let mut tasks = Vec::new();
    for i in 0..32 {
        let agent = s.agent.clone();
        tasks.push(tokio::spawn(async move {
            append_ids(&agent, "co", 1, &[&format!("m{i}")]).await
        }));
    }
    let mut versions = std::collections::BTreeSet::new();
    let mut acked = 0;
    for t in tasks {
        let r = t.await.expect("task");
        if r.status.is_success() {
            acked += 1;
            versions.insert(r.json["version"].as_u64().expect("version"));
            assert_eq!(r.headers["etag"], format!("\"{}\"", r.json["version"]));
        }
    }
    let doc = get_doc(&s.direct, "co").await;
    let stored = doc.json["version"].as_u64().expect("stored version");
    assert_eq!(message_ids(&doc.json).len(), acked);
    // Every commit is one version: the answers name exactly the versions the store went through.
    assert_eq!(versions.iter().copied().max(), Some(stored));
    assert_eq!(
        versions.len() as u64,
        stored,
        "versions answered {versions:?}, store at {stored}"
    );
}

/// The lost-grant case a store without conditional writes cannot otherwise survive: writer A's
/// write-back is delayed in the network while its lock and commit slot vanish (as in a
/// failover that lost them) and writer B commits. A store that enforces fencing tokens refuses
/// A's late write; without that check, A's write overwrites B's acknowledged one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_enforcing_fencing_tokens_refuses_the_late_write_of_a_lost_grant() {
    for enforce in [true, false] {
        let redis = RedisServer::start();
        let mut store_args = turnlock::store::StoreArgs::local();
        store_args.no_etags = true;
        store_args.enforce_fencing = enforce;
        let store = turnlock::store::start(store_args).await.expect("store");
        let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(800))).await;
        let proxy_a = proxy(proxy_args(slow, Some(&redis))).await;
        let proxy_b = proxy(proxy_args(store.addr, Some(&redis))).await;
        let (a, b) = (client(proxy_a.addr), client(proxy_b.addr));
        assert_eq!(append_ids(&b, "fx", 1, &["b0"]).await.status, StatusCode::CREATED);
        let late = tokio::spawn(async move { append_ids(&a, "fx", 1, &["a1"]).await });
        tokio::time::sleep(Duration::from_millis(250)).await;
        // A's grant and commit slot are lost while its write-back is on its way.
        let slots = redis.keys("turnlock:session:{fx}:*:slot");
        assert_eq!(slots.len(), 1, "A holds the document's commit slot while it writes");
        redis.cmd(&["DEL", "turnlock:session:{fx}:1", &slots[0]]);
        let r = append_ids(&b, "fx", 1, &["b1"]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        let late = late.await.expect("late writer");
        let stored = message_ids(&get_doc(&client(store.addr), "fx").await.json);
        if enforce {
            assert_eq!(
                (late.status, late.json["error"].as_str()),
                (StatusCode::SERVICE_UNAVAILABLE, Some("fenced_out")),
                "{}",
                late.json
            );
            assert!(late.headers.contains_key("retry-after"));
            assert_eq!(stored, ["b0", "b1"]);
        } else {
            // Without the store's check the late write lands over B's: the failure this prevents.
            assert!(late.status.is_success(), "{}", late.json);
            assert!(
                !stored.contains(&"b1".to_string()),
                "expected the overwrite, stored {stored:?}"
            );
        }
    }
}

#[tokio::test]
async fn the_reference_store_enforces_fencing_tokens_when_asked() {
    let mut args = turnlock::store::StoreArgs::local();
    args.enforce_fencing = true;
    let store = turnlock::store::start(args).await.expect("store");
    let c = client(store.addr);
    let put = |token: &str| {
        let c = c.clone();
        let token = token.to_string();
        async move {
            c.send(
                Method::PUT,
                "/v1/sessions/f",
                Some(&json!({"x": 1})),
                &[("x-fencing-token", token)],
            )
            .await
            .expect("put")
        }
    };
    assert!(put("5").await.status.is_success());
    let r = put("4").await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("stale_fencing_token"))
    );
    assert!(put("5").await.status.is_success());
    assert!(put("9").await.status.is_success());
    assert_eq!(put("8").await.status, StatusCode::CONFLICT);
    assert_eq!(put("x").await.status, StatusCode::BAD_REQUEST);
    assert_eq!(get_doc(&c, "f").await.json["version"], 3);
}

#[tokio::test]
async fn a_redis_connection_cut_under_a_write_does_not_hold_up_the_session() {
    let redis = RedisServer::start();
    let store = store().await;
    // Each write-back takes 400 ms: the connection is cut while the document's commit slot is
    // held, so giving it back finds the connection gone.
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(400))).await;
    let proxy = proxy(proxy_args(slow, Some(&redis))).await;
    let seed = append_ids(&client(proxy.addr), "cut", 1, &["seed"]).await;
    assert_eq!(seed.status, StatusCode::CREATED, "{}", seed.json);
    let during = {
        let agent = client(proxy.addr);
        tokio::spawn(async move { append_ids(&agent, "cut", 2, &["during"]).await })
    };
    // Cut once the write holds the document's commit slot (its write-back is then under
    // way), however long a loaded machine took to get it there.
    for _ in 0..200 {
        if !redis.keys("turnlock:session:{cut}:*:slot").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        redis.keys("turnlock:session:{cut}:*:slot").len(),
        1,
        "the write holds the document's commit slot"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    redis.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
    let during = during.await.expect("writer");
    assert_eq!(during.status, StatusCode::OK, "{}", during.json);
    // The next write is not kept waiting for the slot to expire (the store timeout plus a lease).
    let started = std::time::Instant::now();
    let after = append_ids(&client(proxy.addr), "cut", 3, &["after"]).await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.json);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the next write waited {:?}",
        started.elapsed()
    );
    let ids = message_ids(&get_doc(&client(store.addr), "cut").await.json);
    assert_eq!(ids, ["seed", "during", "after"]);
}

/// A message's numbers are stored as the agent sent them: a double that takes all 17
/// significant digits comes back the same, not rounded to a neighbour.
#[tokio::test]
async fn numbers_in_messages_are_stored_as_sent() {
    let s = stack().await;
    let (status, _) = raw(
        s.proxy.addr,
        Method::POST,
        "/v1/sessions/n1/messages",
        "application/json",
        br#"{"turn":1,"messages":[{"id":"m1","content":[0.9424502837770503,2.2250738585072014e-308,-7.0e-10,123]}]}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, doc) = raw(s.store.addr, Method::GET, "/v1/sessions/n1", "application/json", b"").await;
    assert_eq!(status, StatusCode::OK);
    let stored = doc["messages"][0]["content"].to_string();
    assert_eq!(stored, "[0.9424502837770503,2.2250738585072014e-308,-7e-10,123]");
    s.proxy.stop().await;
    s.store.stop().await;
}
