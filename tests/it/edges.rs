//! The contract's edges over real sockets: unknown outcomes and retries, transient answers,
//! answers that are not text, messages without ids, edits and deletions in merged PUTs,
//! objects merged key by key, size limits, snapshot size, compaction, the idempotency
//! fingerprint and preconditions.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use turnlock::client::{JsonClient, Reply};

use crate::support::*;

fn key(k: &str) -> (&'static str, String) {
    ("idempotency-key", k.to_string())
}

/// One scripted answer: status, headers, body.
type Scripted = (u16, Vec<(&'static str, &'static str)>, Vec<u8>);

/// A store with its own API answering the n-th request with `script[n]` (the last one
/// repeats); counts the requests it answered with a 2xx.
async fn scripted_store(script: Vec<Scripted>) -> (SocketAddr, Arc<AtomicUsize>) {
    scripted_store_slow_first(script, Duration::ZERO).await
}

/// [`scripted_store`] whose first answer comes after `first_delay`.
async fn scripted_store_slow_first(script: Vec<Scripted>, first_delay: Duration) -> (SocketAddr, Arc<AtomicUsize>) {
    let applied = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(AtomicUsize::new(0));
    let script = Arc::new(script);
    let counter = applied.clone();
    let addr = serve(move |req: Request<Incoming>| {
        let (script, seen, applied) = (script.clone(), seen.clone(), counter.clone());
        async move {
            // The proxy's background health check reads `/`: not part of the script.
            if req.method() == Method::GET && req.uri().path() == "/" {
                return Response::new(Full::new(Bytes::new()));
            }
            let _ = req.into_body().collect().await;
            let seen_before = seen.fetch_add(1, Ordering::SeqCst);
            let n = seen_before.min(script.len() - 1);
            let (status, headers, body) = &script[n];
            // Applied at once; answered (the first time) later.
            if (200..300).contains(status) {
                applied.fetch_add(1, Ordering::SeqCst);
            }
            if seen_before == 0 {
                tokio::time::sleep(first_delay).await;
            }
            let mut b = Response::builder().status(*status);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            b.body(Full::new(Bytes::from(body.clone()))).expect("response")
        }
    })
    .await;
    (addr, applied)
}

/// A proxy with one serialize route, `POST /threads/{session}/events`, turn in `X-Turn`.
async fn serialize_proxy(upstream: SocketAddr, redis: &RedisServer) -> (turnlock::sidecar::Running, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let routes = dir.path().join("routes.toml");
    std::fs::write(
        &routes,
        "[[route]]\nmethod = \"POST\"\npath = \"/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("write routes");
    let mut args = proxy_args(upstream, Some(redis));
    args.routes = Some(routes.to_string_lossy().into_owned());
    (proxy(args).await, dir)
}

async fn put_doc(c: &JsonClient, session: &str, doc: &Value, headers: &[(&str, String)]) -> Reply {
    send(c, Method::PUT, &format!("/v1/sessions/{session}"), doc.clone(), headers).await
}

// === idempotency ===

#[tokio::test]
async fn a_retry_after_an_unknown_outcome_is_not_applied_twice() {
    let redis = RedisServer::start();
    let store = store().await;
    // The write-back and the proxy's attempt to settle it are both answered too late.
    let late = front_store(store.addr, PutDelay::FirstAnswers(2, Duration::from_millis(1500))).await;
    let mut args = proxy_args(late, Some(&redis));
    args.upstream_timeout_ms = 500;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let direct = client(store.addr);
    let body = json!({"turn": 1, "messages": [{"role": "user", "content": "book the 9:40 train"}]});
    let path = "/v1/sessions/slow-x/messages";
    let first = send(&agent, Method::POST, path, body.clone(), &[key("k-504")]).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "{}", first.json);
    let message = first.json["message"].as_str().unwrap_or_default();
    assert!(message.contains("outcome is unknown"), "{message}");
    assert!(!message.contains("nothing was written"), "{message}");
    // The first attempt did land.
    assert_eq!(message_ids(&get_doc(&direct, "slow-x").await.json).len(), 1);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retry = send(&agent, Method::POST, path, body, &[key("k-504")]).await;
    assert!(retry.status.is_success(), "{} {}", retry.status, retry.json);
    let stored = get_doc(&direct, "slow-x").await.json;
    assert_eq!(message_ids(&stored).len(), 1, "stored twice: {stored}");
    assert_eq!(retry.json["message_ids"], json!(message_ids(&stored)));
    proxy.stop().await;
    store.stop().await;
}

/// How the first write-backs of a write are answered, and the first answer the write gets:
/// the store applies each at once. Answered late once, the write-back is settled under the
/// commit slot (sent again: with ETags refused as already applied, which the document read
/// back confirms; without, stored again as the same bytes) and the write is answered as
/// applied. Answered late twice, its outcome is unknown (504).
const LATE_ANSWERS: [(bool, usize, StatusCode); 3] = [
    (true, 1, StatusCode::OK),
    (false, 1, StatusCode::OK),
    (true, 2, StatusCode::GATEWAY_TIMEOUT),
];

async fn reference_store(etags: bool) -> turnlock::store::RunningStore {
    if etags {
        store().await
    } else {
        store_without_etags().await
    }
}

#[tokio::test]
async fn a_compaction_retried_after_an_unknown_outcome_is_answered_not_refused() {
    for (etags, late, first) in LATE_ANSWERS {
        compaction_retried_after_a_late_answer(etags, late, first).await;
    }
}

async fn compaction_retried_after_a_late_answer(etags: bool, late: usize, first_answer: StatusCode) {
    let redis = RedisServer::start();
    let store = reference_store(etags).await;
    let direct = client(store.addr);
    let seeded = put_doc(
        &direct,
        "slow-c",
        &json!({"session": "slow-c", "turn": 1, "version": 1, "messages": [{"id": "m1"}, {"id": "m2"}, {"id": "m3"}]}),
        &[],
    )
    .await;
    assert!(seeded.status.is_success());
    let late = front_store(store.addr, PutDelay::FirstAnswers(late, Duration::from_millis(1500))).await;
    let mut args = proxy_args(late, Some(&redis));
    args.upstream_timeout_ms = 500;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let body = json!({"turn": 1, "through": "m2", "summary": "m1 and m2"});
    let path = "/v1/sessions/slow-c/compact";
    let first = send(&agent, Method::POST, path, body.clone(), &[key("k-compact")]).await;
    assert_eq!(first.status, first_answer, "etags {etags}, {late} late: {}", first.json);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retry = send(&agent, Method::POST, path, body, &[key("k-compact")]).await;
    assert_eq!(retry.status, StatusCode::OK, "etags {etags}: {}", retry.json);
    let stored = get_doc(&direct, "slow-c").await.json;
    assert_eq!(message_ids(&stored), ["m3"]);
    assert_eq!(stored["summary"], "m1 and m2");
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test]
async fn a_merged_put_retried_after_an_unknown_outcome_is_not_applied_twice() {
    for (etags, late, first) in LATE_ANSWERS {
        merged_put_retried_after_a_late_answer(etags, late, first).await;
    }
}

async fn merged_put_retried_after_a_late_answer(etags: bool, late: usize, first_answer: StatusCode) {
    let redis = RedisServer::start();
    let store = reference_store(etags).await;
    let direct = client(store.addr);
    // The version the client reads is written through turnlock (which keeps its snapshot).
    let plain = proxy(proxy_args(store.addr, Some(&redis))).await;
    let r = send(
        &client(plain.addr),
        Method::POST,
        "/v1/sessions/slow-p/messages",
        json!({"turn": 1, "messages": [{"id": "a", "content": ""}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    plain.stop().await;
    let late = front_store(store.addr, PutDelay::FirstAnswers(late, Duration::from_millis(1500))).await;
    let mut args = proxy_args(late, Some(&redis));
    args.upstream_timeout_ms = 500;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let mut doc = get_doc(&agent, "slow-p").await.json;
    doc["messages"][0]["content"] = json!("final text");
    doc["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"role": "assistant", "content": "no id"}));
    doc["state"] = json!({"k": 1});
    let first = put_doc(&agent, "slow-p", &doc, &[key("k-put")]).await;
    assert_eq!(first.status, first_answer, "etags {etags}, {late} late: {}", first.json);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retry = put_doc(&agent, "slow-p", &doc, &[key("k-put")]).await;
    assert_eq!(retry.status, StatusCode::OK, "etags {etags}: {}", retry.json);
    let stored = get_doc(&direct, "slow-p").await.json;
    assert_eq!(message_ids(&stored).len(), 2, "etags {etags}: {stored}");
    assert_eq!(stored["messages"][0]["content"], "final text");
    assert_eq!(stored["state"], json!({"k": 1}));
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test]
async fn a_slow_write_retried_on_another_proxy_while_it_runs_is_stored_once() {
    let redis = RedisServer::start();
    let store = store().await;
    let direct = client(store.addr);
    // The first write-back takes 15 s at the store, within a store timeout of 20 s.
    let late = front_store(store.addr, PutDelay::FirstAnswer(Duration::from_millis(15_000))).await;
    let mut args = proxy_args(late, Some(&redis));
    args.upstream_timeout_ms = 20_000;
    args.lock_budget_ms = 800;
    let (a, b) = (proxy(args.clone()).await, proxy(args).await);
    let body = json!({"turn": 1, "messages": [{"role": "user", "content": "slow, and retried"}]});
    let path = "/v1/sessions/slow-r/messages";
    let agent_a = client(a.addr);
    let first = {
        let body = body.clone();
        tokio::spawn(async move { agent_a.send(Method::POST, path, Some(&body), &[key("k-slow")]).await })
    };
    // The client gives up (its own timeout is 10 s) and retries on the other proxy at 14.9 s,
    // where it waits for the lock until the first write is done.
    tokio::time::sleep(Duration::from_millis(14_900)).await;
    let agent_b = client(b.addr);
    let retry = send(&agent_b, Method::POST, path, body.clone(), &[key("k-slow")]).await;
    assert!(
        retry.status.is_success() || retry.json["error"] == "request_in_progress",
        "{} {}",
        retry.status,
        retry.json
    );
    let _ = first.await;
    // Once the first write is done, the retry is answered from its record.
    let mut again = send(&agent_b, Method::POST, path, body.clone(), &[key("k-slow")]).await;
    for _ in 0..50 {
        if again.status.is_success() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        again = send(&agent_b, Method::POST, path, body.clone(), &[key("k-slow")]).await;
    }
    assert!(again.status.is_success(), "{} {}", again.status, again.json);
    let stored = get_doc(&direct, "slow-r").await.json;
    assert_eq!(message_ids(&stored).len(), 1, "stored twice: {stored}");
    a.stop().await;
    b.stop().await;
    store.stop().await;
}

#[tokio::test]
async fn an_idempotency_claim_lives_as_long_as_its_write_can_run() {
    let redis = RedisServer::start();
    let store = store().await;
    // Every PUT is answered after 1 s; each store request may take up to 10 s.
    let late = front_store(store.addr, PutDelay::FirstAnswer(Duration::from_millis(1000))).await;
    let mut args = proxy_args(late, Some(&redis));
    args.upstream_timeout_ms = 10_000;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let write = tokio::spawn(async move {
        send(
            &agent,
            Method::POST,
            "/v1/sessions/lt/messages",
            json!({"turn": 1, "messages": [{"id": "a"}]}),
            &[key("k-life")],
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let claims = redis.keys("*idem*");
    assert_eq!(claims.len(), 1, "{claims:?}");
    let ttl_ms = match redis.cmd(&["PTTL", &claims[0]]) {
        redis::Value::Int(n) => n,
        other => panic!("PTTL: {other:?}"),
    };
    // A write may take a store round trip per read and per write-back, over several attempts,
    // each up to the store timeout: its claim outlives all of them.
    assert!(
        ttl_ms > 50_000,
        "the claim expires in {ttl_ms} ms while its write may run for longer"
    );
    assert_eq!(write.await.expect("write").status, StatusCode::CREATED);
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test]
async fn a_record_replaces_only_its_own_claim() {
    let redis = RedisServer::start();
    let store = store().await;
    let late = front_store(store.addr, PutDelay::FirstAnswer(Duration::from_millis(800))).await;
    let proxy = proxy(proxy_args(late, Some(&redis))).await;
    let agent = client(proxy.addr);
    let write = tokio::spawn(async move {
        send(
            &agent,
            Method::POST,
            "/v1/sessions/cas/messages",
            json!({"turn": 1, "messages": [{"id": "a"}]}),
            &[key("k-cas")],
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claims = redis.keys("*idem*");
    assert_eq!(claims.len(), 1, "{claims:?}");
    // The claim is gone (expired, say) and another request claimed the key meanwhile.
    let other = r#"{"fingerprint":"another","claim":"someone-else"}"#;
    redis.cmd(&["SET", &claims[0], other, "PX", "60000"]);
    assert_eq!(write.await.expect("write").status, StatusCode::CREATED);
    match redis.cmd(&["GET", &claims[0]]) {
        redis::Value::BulkString(b) => assert_eq!(String::from_utf8_lossy(&b), other),
        v => panic!("GET: {v:?}"),
    }
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test]
async fn a_transient_429_is_not_recorded_and_the_retry_applies_once() {
    let redis = RedisServer::start();
    let (upstream, applied) = scripted_store(vec![
        (429, vec![("retry-after", "1")], b"{\"error\":\"slow down\"}".to_vec()),
        (201, vec![], b"{\"ok\":true}".to_vec()),
    ])
    .await;
    let (proxy, _dir) = serialize_proxy(upstream, &redis).await;
    let agent = client(proxy.addr);
    let headers = [("x-turn", "1".to_string()), key("k-429")];
    let r = send(&agent, Method::POST, "/threads/t/events", json!({"e": 1}), &headers).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let r = send(&agent, Method::POST, "/threads/t/events", json!({"e": 1}), &headers).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert!(r.headers.get("idempotent-replayed").is_none());
    let r = send(&agent, Method::POST, "/threads/t/events", json!({"e": 1}), &headers).await;
    assert_eq!(
        (r.status, r.headers["idempotent-replayed"].to_str().ok()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn an_answer_that_is_not_text_is_recorded_and_replayed_byte_for_byte() {
    let redis = RedisServer::start();
    let gzip: Vec<u8> = vec![0x1f, 0x8b, 0x08, 0x00, 0xff, 0xfe, 0x00, 0x80, 0x9c, 0x01];
    let (upstream, applied) = scripted_store(vec![(201, vec![("content-encoding", "gzip")], gzip.clone())]).await;
    let (proxy, _dir) = serialize_proxy(upstream, &redis).await;
    let agent = client(proxy.addr);
    let headers = [("x-turn", "1".to_string()), key("k-gzip")];
    let first = send(&agent, Method::POST, "/threads/g/events", json!({"e": 1}), &headers).await;
    assert_eq!(
        (first.status, first.body.as_ref()),
        (StatusCode::CREATED, gzip.as_slice())
    );
    let again = send(&agent, Method::POST, "/threads/g/events", json!({"e": 1}), &headers).await;
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
    assert_eq!(again.body.as_ref(), gzip.as_slice());
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.headers["content-encoding"], "gzip");
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_client_that_disconnects_does_not_leave_its_claim_pending() {
    let redis = RedisServer::start();
    let (upstream, applied) = scripted_store_slow_first(
        vec![
            (500, vec![], b"{\"error\":\"boom\"}".to_vec()),
            (201, vec![], b"{\"ok\":true}".to_vec()),
        ],
        Duration::from_millis(800),
    )
    .await;
    let (proxy, _dir) = serialize_proxy(upstream, &redis).await;
    let agent = client(proxy.addr);
    let headers = [("x-turn", "1".to_string()), key("k-gone")];
    // The client gives up (and closes its connection) while the store is still working.
    let gone = tokio::time::timeout(
        Duration::from_millis(200),
        send(&agent, Method::POST, "/threads/d/events", json!({"e": 1}), &headers),
    )
    .await;
    assert!(gone.is_err());
    // The write ends in a 500, which is not recorded: the retry applies it.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let r = send(&agent, Method::POST, "/threads/d/events", json!({"e": 1}), &headers).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn a_serialized_write_with_an_unknown_outcome_is_never_forwarded_twice() {
    let redis = RedisServer::start();
    let (upstream, applied) = scripted_store_slow_first(
        vec![(201, vec![], b"{\"ok\":true}".to_vec())],
        Duration::from_millis(1000),
    )
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let routes = dir.path().join("routes.toml");
    std::fs::write(
        &routes,
        "[[route]]\nmethod = \"POST\"\npath = \"/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("write routes");
    let mut args = proxy_args(upstream, Some(&redis));
    args.routes = Some(routes.to_string_lossy().into_owned());
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    let agent = client(proxy.addr);
    let headers = [("x-turn", "1".to_string()), key("k-unknown")];
    let r = send(&agent, Method::POST, "/threads/u/events", json!({"e": 1}), &headers).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let r = send(&agent, Method::POST, "/threads/u/events", json!({"e": 1}), &headers).await;
    assert_eq!(
        (r.status, r.headers["idempotent-replayed"].to_str().ok()),
        (StatusCode::GATEWAY_TIMEOUT, Some("true"))
    );
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    // The write may be stored: its turn counts as accepted, so an older turn is stale.
    let older = [("x-turn", "0".to_string())];
    let r = send(&agent, Method::POST, "/threads/u/events", json!({"e": 0}), &older).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("stale_turn")),
        "{}",
        r.json
    );
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn the_fingerprint_covers_turn_header_if_match_and_query_but_not_key_order() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let agent = client(proxy.addr);
    let path = "/v1/sessions/fp/messages";
    let a: Value =
        serde_json::from_str(r#"{"turn": 1, "messages": [{"id": "m1", "role": "user", "content": "x"}]}"#).unwrap();
    let b: Value =
        serde_json::from_str(r#"{"messages": [{"content": "x", "role": "user", "id": "m1"}], "turn": 1}"#).unwrap();
    let first = send(&agent, Method::POST, path, a, &[key("k-order")]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let same = send(&agent, Method::POST, path, b, &[key("k-order")]).await;
    assert_eq!(
        (same.status, same.headers["idempotent-replayed"].to_str().ok()),
        (StatusCode::CREATED, Some("true"))
    );
    // The turn in the header changes the request.
    let body = json!({"messages": [{"id": "m2"}]});
    let r = send(
        &agent,
        Method::POST,
        path,
        body.clone(),
        &[key("k-turn"), ("x-session-turn", "1".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = send(
        &agent,
        Method::POST,
        path,
        body,
        &[key("k-turn"), ("x-session-turn", "2".into())],
    )
    .await;
    assert_eq!(r.json["error"], "idempotency_key_reused");
    // So does the query string.
    let body = json!({"turn": 2, "messages": [{"id": "m3"}]});
    let r = send(&agent, Method::POST, path, body.clone(), &[key("k-query")]).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = send(&agent, Method::POST, &format!("{path}?dry=1"), body, &[key("k-query")]).await;
    assert_eq!(r.json["error"], "idempotency_key_reused");
    // A replace retried with a fresh If-Match is a new request, not a replay of the old 412.
    let replace = ("x-context-replace", "true".to_string());
    let doc = json!({"turn": 2, "messages": []});
    let r = put_doc(
        &agent,
        "fp",
        &doc,
        &[key("k-im"), replace.clone(), ("if-match", "\"1\"".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    let current = r.json["current_version"].as_u64().expect("current_version");
    let r = put_doc(
        &agent,
        "fp",
        &doc,
        &[key("k-im"), replace, ("if-match", format!("\"{current}\""))],
    )
    .await;
    assert_eq!(r.json["error"], "idempotency_key_reused", "{}", r.json);
    proxy.stop().await;
    s.stop().await;
}

// === messages in merged PUTs ===

#[tokio::test]
async fn stored_messages_without_ids_are_given_ids_once_and_never_multiply() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    let plain: Vec<Value> = (0..5)
        .map(|i| json!({"role": "user", "content": format!("old {i}")}))
        .collect();
    let seeded = put_doc(
        &direct,
        "idless",
        &json!({"session": "idless", "turn": 1, "version": 1, "messages": plain}),
        &[],
    )
    .await;
    assert!(seeded.status.is_success(), "{}", seeded.json);
    for round in 0..3 {
        let mut doc = get_doc(&agent, "idless").await.json;
        doc["state"] = json!({"round": round});
        let r = put_doc(&agent, "idless", &doc, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        let stored = get_doc(&direct, "idless").await.json;
        assert_eq!(
            stored["messages"].as_array().map(Vec::len),
            Some(5),
            "round {round}: {stored}"
        );
        assert_eq!(message_ids(&stored).len(), 5);
    }
    // A client whose message type drops `id`.
    for round in 0..3 {
        let mut doc = get_doc(&agent, "idless").await.json;
        for m in doc["messages"].as_array_mut().expect("messages") {
            m.as_object_mut().expect("message").remove("id");
        }
        doc["state"] = json!({"dropping": round});
        let r = put_doc(&agent, "idless", &doc, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        assert_eq!(message_ids(&get_doc(&direct, "idless").await.json).len(), 5);
    }
    // Ids given once can be compacted through.
    let ids = message_ids(&get_doc(&direct, "idless").await.json);
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/idless/compact",
        json!({"turn": 1, "through": ids[2], "summary": "s"}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(message_ids(&get_doc(&direct, "idless").await.json), ids[3..]);
    proxy.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn merged_put_applies_edits_and_deletions_or_refuses_them_never_a_silent_200() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    let r = send(&agent, Method::POST, "/v1/sessions/ed/messages", json!({"turn": 1, "messages": [{"id": "a", "content": ""}, {"id": "b", "content": "b"}, {"id": "c", "content": "c"}]}), &[]).await;
    assert_eq!(r.status, StatusCode::CREATED);
    // Streaming: the placeholder gets its final text.
    let mut doc = get_doc(&agent, "ed").await.json;
    doc["messages"][0]["content"] = json!("final text");
    let r = put_doc(&agent, "ed", &doc, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let stored = get_doc(&direct, "ed").await.json;
    assert_eq!(stored["messages"][0]["content"], "final text");
    // A deletion.
    let mut doc = stored.clone();
    doc["messages"].as_array_mut().expect("messages").remove(1);
    let r = put_doc(&agent, "ed", &doc, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(message_ids(&get_doc(&direct, "ed").await.json), ["a", "c"]);
    // Two clients edit `c` from the same copy: the second is refused, naming the message.
    let base = get_doc(&agent, "ed").await.json;
    let (mut one, mut two) = (base.clone(), base.clone());
    one["messages"][1]["content"] = json!("one");
    two["messages"][1]["content"] = json!("two");
    assert_eq!(put_doc(&agent, "ed", &one, &[]).await.status, StatusCode::OK);
    let r = put_doc(&agent, "ed", &two, &[]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{}",
        r.json
    );
    assert_eq!(r.json["message_ids"], json!(["c"]));
    assert_eq!(get_doc(&direct, "ed").await.json["messages"][1]["content"], "one");
    proxy.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn state_is_merged_key_by_key_so_only_the_same_key_conflicts() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    let r = send(
        &agent,
        Method::PATCH,
        "/v1/sessions/st",
        json!({"turn": 1, "state": {"a": 0, "b": 0, "nested": {"x": 0, "y": 0}}}),
        &[],
    )
    .await;
    assert!(r.status.is_success(), "{}", r.json);
    let base = get_doc(&agent, "st").await.json;
    let mut writers = Vec::new();
    for (i, path) in ["a", "b", "nested/x", "nested/y"].iter().enumerate() {
        let mut mine = base.clone();
        *mine["state"].pointer_mut(&format!("/{path}")).expect("key") = json!(i + 1);
        writers.push(mine);
    }
    for mine in &writers {
        let r = put_doc(&agent, "st", mine, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    }
    assert_eq!(
        get_doc(&direct, "st").await.json["state"],
        json!({"a": 1, "b": 2, "nested": {"x": 3, "y": 4}})
    );
    let mut late = base.clone();
    late["state"]["nested"]["x"] = json!(99);
    let r = put_doc(&agent, "st", &late, &[]).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.json["fields"], json!(["state.nested.x"]));
    proxy.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn agents_changing_their_own_keys_of_state_through_get_modify_put_never_conflict() {
    let redis = RedisServer::start();
    let s = store().await;
    let proxies = [
        proxy(proxy_args(s.addr, Some(&redis))).await,
        proxy(proxy_args(s.addr, Some(&redis))).await,
    ];
    let direct = client(s.addr);
    let r = send(
        &client(proxies[0].addr),
        Method::PATCH,
        "/v1/sessions/four",
        json!({"turn": 1, "state": {}}),
        &[],
    )
    .await;
    assert!(r.status.is_success());
    const ROUNDS: u64 = 40;
    let mut agents = Vec::new();
    for a in 0..4u64 {
        let agent = client(proxies[(a % 2) as usize].addr);
        agents.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for round in 1..=ROUNDS {
                let mut doc = get_doc(&agent, "four").await.json;
                doc["state"][format!("agent{a}")] = json!(round);
                statuses.push(put_doc(&agent, "four", &doc, &[]).await.status);
            }
            statuses
        }));
    }
    let mut conflicts = 0;
    for agent in agents {
        let statuses = agent.await.expect("agent");
        conflicts += statuses.iter().filter(|s| **s == StatusCode::CONFLICT).count();
        assert!(
            statuses.iter().all(|s| s.is_success() || *s == StatusCode::CONFLICT),
            "{statuses:?}"
        );
    }
    assert_eq!(conflicts, 0, "{conflicts} conflicts for writes to distinct keys");
    let state = &get_doc(&direct, "four").await.json["state"];
    for a in 0..4 {
        assert_eq!(state[format!("agent{a}")], ROUNDS, "{state}");
    }
    for p in proxies {
        p.stop().await;
    }
    s.stop().await;
}

// === sizes ===

#[tokio::test]
async fn a_document_the_proxy_served_can_be_put_back_and_too_large_is_a_clear_413() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    // 1.5 MiB: over the default body limit of 1 MiB, under the document limit.
    let big = "x".repeat(1536 * 1024);
    let r = put_doc(
        &direct,
        "big",
        &json!({"session": "big", "turn": 1, "version": 1, "messages": [], "state": {"blob": big}}),
        &[],
    )
    .await;
    assert!(r.status.is_success());
    let mut doc = get_doc(&agent, "big").await.json;
    doc["state"]["k"] = json!(1);
    let r = put_doc(&agent, "big", &doc, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    proxy.stop().await;
    // A write that would make the document larger than the proxy's document limit.
    let mut args = proxy_args(s.addr, None);
    args.max_document_bytes = 64 * 1024;
    let small = turnlock::sidecar::start(args).await.expect("proxy");
    let agent = client(small.addr);
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/grow/messages",
        json!({"turn": 1, "messages": [{"id": "a", "content": "y".repeat(40_000)}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/grow/messages",
        json!({"turn": 1, "messages": [{"id": "b", "content": "y".repeat(40_000)}]}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("document_too_large")),
        "{}",
        r.json
    );
    assert_eq!(r.json["limit"], 64 * 1024);
    assert!(r.json["size"].as_u64().is_some_and(|n| n > 80_000));
    assert_eq!(message_ids(&get_doc(&direct, "grow").await.json), ["a"]);
    small.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn a_store_refusing_a_document_as_too_large_is_a_413_not_a_502() {
    let mut store_args = turnlock::store::StoreArgs::local();
    store_args.max_body_bytes = 64 * 1024;
    let s = turnlock::store::start(store_args).await.expect("store");
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let agent = client(proxy.addr);
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/cap/messages",
        json!({"turn": 1, "messages": [{"id": "a", "content": "y".repeat(100_000)}]}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("document_too_large")),
        "{}",
        r.json
    );
    proxy.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn version_snapshots_stay_small_whatever_the_size_of_state() {
    let redis = RedisServer::start();
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, Some(&redis))).await;
    let agent = client(proxy.addr);
    let r = send(
        &agent,
        Method::PATCH,
        "/v1/sessions/heavy",
        json!({"turn": 1, "state": {"blob": "z".repeat(500_000)}}),
        &[],
    )
    .await;
    assert!(r.status.is_success(), "{}", r.json);
    let before = redis.info("memory", "used_memory").parse::<u64>().expect("used_memory");
    let writes = 100u64;
    for i in 0..writes {
        let r = send(
            &agent,
            Method::POST,
            "/v1/sessions/heavy/messages",
            json!({"turn": 1, "messages": [{"id": format!("m{i}"), "content": "hi"}]}),
            &[],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let after = redis.info("memory", "used_memory").parse::<u64>().expect("used_memory");
    let per_write = after.saturating_sub(before) / writes;
    println!("redis bytes per write with a 500 KB state: {per_write} ({before} -> {after})");
    assert!(per_write < 4_096, "each write keeps {per_write} bytes in Redis");
    proxy.stop().await;
    s.stop().await;
}

// === compaction ===

#[tokio::test]
async fn compaction_keeps_the_summary_refuses_unknown_fields_and_compacted_ids_stay_out() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    let ids: Vec<Value> = (1..=5)
        .map(|i| json!({"id": format!("m{i}"), "content": "c"}))
        .collect();
    send(
        &agent,
        Method::POST,
        "/v1/sessions/cp/messages",
        json!({"turn": 1, "messages": ids}),
        &[],
    )
    .await;
    let compact = "/v1/sessions/cp/compact";
    let r = send(
        &agent,
        Method::POST,
        compact,
        json!({"turn": 1, "through": "m1", "summary": {"text": "first"}}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let r = send(&agent, Method::POST, compact, json!({"turn": 1, "through": "m3"}), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    let doc = get_doc(&direct, "cp").await.json;
    assert_eq!(doc["summary"], json!({"text": "first"}));
    let r = send(
        &agent,
        Method::POST,
        compact,
        json!({"turn": 1, "through": "m4", "summry": "typo"}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("unknown_field"))
    );
    // A late retry of an append of a compacted message does not bring it back.
    let r = send(
        &agent,
        Method::POST,
        "/v1/sessions/cp/messages",
        json!({"turn": 1, "messages": [{"id": "m2", "content": "c"}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(message_ids(&get_doc(&direct, "cp").await.json), ["m4", "m5"]);
    proxy.stop().await;
    s.stop().await;
}

// === preconditions ===

#[tokio::test]
async fn preconditions_are_required_compared_strongly_and_honoured_by_the_store() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let (agent, direct) = (client(proxy.addr), client(s.addr));
    send(
        &agent,
        Method::POST,
        "/v1/sessions/pc/messages",
        json!({"turn": 1, "messages": [{"id": "a"}]}),
        &[],
    )
    .await;
    // A merged PUT with no version at all.
    let r = put_doc(
        &agent,
        "pc",
        &json!({"turn": 1, "messages": [{"id": "a"}], "x": 1}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PRECONDITION_REQUIRED, Some("precondition_required")),
        "{}",
        r.json
    );
    // ...which a new session does not need.
    let r = put_doc(&agent, "pc-new", &json!({"turn": 1, "messages": [{"id": "a"}]}), &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    // Body and If-Match disagree.
    let r = put_doc(
        &agent,
        "pc",
        &json!({"turn": 1, "version": 1, "x": 1}),
        &[("if-match", "\"2\"".into())],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("versions_disagree"))
    );
    let replace = ("x-context-replace", "true".to_string());
    let doc = json!({"turn": 1, "messages": [{"id": "z"}]});
    // A weak tag never matches for a replacement.
    let r = put_doc(&agent, "pc", &doc, &[replace.clone(), ("if-match", "W/\"1\"".into())]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PRECONDITION_FAILED, Some("version_mismatch"))
    );
    // `*`: any stored document.
    let r = put_doc(&agent, "pc", &doc, &[replace.clone(), ("if-match", "*".into())]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(message_ids(&get_doc(&direct, "pc").await.json), ["z"]);
    let r = put_doc(&agent, "absent", &doc, &[replace, ("if-match", "*".into())]).await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED, "{}", r.json);
    // The reference store answers a conditional GET.
    let etag = get_doc(&agent, "pc").await.headers["etag"]
        .to_str()
        .expect("etag")
        .to_owned();
    let r = direct
        .send(Method::GET, "/v1/sessions/pc", None, &[("if-none-match", etag.clone())])
        .await
        .expect("get");
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    assert_eq!(r.headers["etag"], etag.as_str());
    let r = direct
        .send(
            Method::GET,
            "/v1/sessions/pc",
            None,
            &[("if-none-match", "\"999\"".into())],
        )
        .await
        .expect("get");
    assert_eq!(r.status, StatusCode::OK);
    proxy.stop().await;
    s.stop().await;
}

/// Writes whose change could not be made as asked are refused, not answered 200: a patch of
/// turnlock's `life`, a merged PUT with a weak `If-Match` (compared strongly), and a merged PUT
/// naming one message id twice.
#[tokio::test]
async fn changes_that_cannot_be_made_are_refused_not_acknowledged() {
    let s = store().await;
    let proxy = proxy(proxy_args(s.addr, None)).await;
    let agent = client(proxy.addr);
    let body = json!({"turn": 1, "messages": [{"id": "a", "content": "A"}, {"id": "b", "content": "B"}]});
    let r = send(&agent, Method::POST, "/v1/sessions/nc/messages", body, &[]).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = send(
        &agent,
        Method::PATCH,
        "/v1/sessions/nc",
        json!({"turn": 1, "life": 1}),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("forbidden_field"))
    );
    let mut doc = get_doc(&agent, "nc").await.json;
    doc["messages"][0]["content"] = json!("edited");
    let unversioned = {
        let mut d = doc.clone();
        d.as_object_mut().expect("object").remove("version");
        d
    };
    let r = send(
        &agent,
        Method::PUT,
        "/v1/sessions/nc",
        unversioned,
        &[("if-match", "W/\"1\"".into())],
    )
    .await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::PRECONDITION_FAILED, Some("version_mismatch"))
    );
    let mut twice = doc.clone();
    if let Some(list) = twice["messages"].as_array_mut() {
        list.push(json!({"id": "a", "content": "again"}));
    }
    let r = send(&agent, Method::PUT, "/v1/sessions/nc", twice, &[]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_messages"))
    );
    let twice = json!({"turn": 1, "messages": [{"id": "c", "content": "C"}, {"id": "c", "content": "C2"}]});
    let r = send(&agent, Method::POST, "/v1/sessions/nc/messages", twice, &[]).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_messages"))
    );
    let stored = get_doc(&agent, "nc").await.json;
    assert_eq!(stored["version"], 1, "nothing was written: {stored}");
    assert_eq!(stored["messages"][0]["content"], "A");
    proxy.stop().await;
}

/// Refusals decided at the edge are counted under their own error code, a merged PUT under
/// `If-Match: *` never creates a session, and a turn header sent twice is refused.
#[tokio::test]
async fn edge_refusals_are_counted_by_code_and_ambiguous_preconditions_refused() {
    let store = store().await;
    let p = proxy(proxy_args(store.addr, None)).await;
    let c = client(p.addr);
    // A body that is not an object and an invalid wait deadline: refused at the edge.
    let bad = c
        .send(Method::POST, "/v1/sessions/e1/messages", Some(&json!("nope")), &[])
        .await
        .expect("answer");
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.json);
    let r = try_append(&c, "e1", 1, "a", true, &[("x-wait-deadline-ms", "0".into())])
        .await
        .expect("answer");
    assert_eq!(r.json["error"], "invalid_wait_deadline", "{}", r.json);
    let text = p.metrics.encode();
    for code in ["invalid_body", "invalid_wait_deadline"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("turnlock_requests_total{") && l.contains(&format!("error=\"{code}\""))),
            "{code} not counted under its code:\n{text}"
        );
    }

    // `If-Match: *` names a document that exists and no version: never a creation.
    let r = put_doc(
        &c,
        "absent",
        &json!({"turn": 1, "state": {}}),
        &[("if-match", "*".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::PRECONDITION_REQUIRED, "{}", r.json);
    // Nor with version 0, which names no stored document.
    let r = put_doc(
        &c,
        "absent",
        &json!({"turn": 1, "version": 0, "state": {}}),
        &[("if-match", "*".into())],
    )
    .await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED, "{}", r.json);
    assert_eq!(
        get_doc(&client(store.addr), "absent").await.status,
        StatusCode::NOT_FOUND
    );

    // Two turn headers: the store might read the other one.
    let r = try_append(
        &c,
        "e2",
        1,
        "a",
        true,
        &[("x-session-turn", "1".into()), ("x-session-turn", "9".into())],
    )
    .await
    .expect("answer");
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_turn")),
        "{}",
        r.json
    );
}
