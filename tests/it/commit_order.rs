//! The per-document commit order in Redis, over real sockets: a slow write-back is never
//! overtaken, serialized writes of different turns reach the store one at a time and in turn
//! order, deleted documents are written again from scratch, every key of a session expires,
//! turnlock's own header is never the client's, and fencing tokens keep growing when Redis
//! loses its counter.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use turnlock::client::{JsonClient, Reply};

use crate::support::relay::{OnPut, Relay};
use crate::support::*;

/// Appends until acknowledged; retryable answers (503) are counted in `retried`. Any other
/// refusal is returned as is.
async fn append_until_answered(c: &JsonClient, session: &str, turn: u64, id: &str, retried: &AtomicUsize) -> Reply {
    for _ in 0..200 {
        let r = append(c, session, turn, id).await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE {
            return r;
        }
        retried.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{session}/{id}: still refused after 200 attempts");
}

/// A store without ETags; the proxy `a` reaches it through a relay that holds PUTs, `b`
/// directly. A's write-back of turn 5 is held for 3 s (the lease is 2 s) while B writes turn
/// 6: B's write must be ordered after A's, so both are stored and the turn never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_write_back_without_etags_is_never_overtaken_by_the_next_turn() {
    const SESSIONS: usize = 6;
    let redis = RedisServer::start();
    let store = store_without_etags().await;
    let relay = Relay::start(store.addr).await;
    let proxy_a = proxy(proxy_args(relay.addr, Some(&redis))).await;
    let proxy_b = proxy(proxy_args(store.addr, Some(&redis))).await;
    let (a, b) = (client(proxy_a.addr), client(proxy_b.addr));
    let sessions = crate::support::ledger::sessions("slow", SESSIONS);
    for s in &sessions {
        assert_eq!(append(&b, s, 5, &format!("{s}-seed")).await.status, StatusCode::CREATED);
    }
    relay.on_put(OnPut::Hold);
    let mut slow = Vec::new();
    for s in &sessions {
        let (a, s) = (a.clone(), s.clone());
        slow.push(tokio::spawn(
            async move { append(&a, &s, 5, &format!("{}-a", s)).await },
        ));
    }
    assert!(
        relay.wait_held(SESSIONS, Duration::from_secs(10)).await,
        "A's write-backs never reached the relay"
    );
    let retried = Arc::new(AtomicUsize::new(0));
    let mut next = Vec::new();
    for s in &sessions {
        let (b, s, retried) = (b.clone(), s.clone(), retried.clone());
        next.push(tokio::spawn(async move {
            append_until_answered(&b, &s, 6, &format!("{}-b", s), &retried).await
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.release_held();
    let mut acked: HashMap<String, Vec<String>> = HashMap::new();
    for (s, t) in sessions.iter().zip(slow) {
        let r = t.await.expect("A task");
        if r.status.is_success() {
            acked.entry(s.clone()).or_default().push(format!("{s}-a"));
        }
    }
    for (s, t) in sessions.iter().zip(next) {
        let r = t.await.expect("B task");
        assert!(r.status.is_success(), "{s}: turn 6 refused: {}", r.json);
        acked.entry(s.clone()).or_default().push(format!("{s}-b"));
    }
    let direct = client(store.addr);
    let mut lost = 0;
    let mut acked_total = 0;
    for s in &sessions {
        let doc = get_doc(&direct, s).await.json;
        let stored = message_ids(&doc);
        for id in acked.get(s).into_iter().flatten() {
            acked_total += 1;
            if !stored.contains(id) {
                lost += 1;
                eprintln!("{s}: acknowledged {id} lost; stored {stored:?}");
            }
        }
        assert_eq!(doc["turn"], 6, "{s}: the turn went back: {doc}");
    }
    eprintln!(
        "slow write-back: {acked_total} acknowledged, {lost} lost, {} retryable answers",
        retried.load(Ordering::SeqCst)
    );
    assert_eq!(lost, 0);
    assert_eq!(acked_total, 2 * SESSIONS);
}

/// A document deleted through the sidecar (forwarded) or straight at the store is written
/// again: 201, holding only the new life's messages. With and without ETags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_session_is_written_again_from_scratch() {
    for etags in [false, true] {
        let redis = RedisServer::start();
        let store = if etags {
            store().await
        } else {
            store_without_etags().await
        };
        let p = proxy(proxy_args(store.addr, Some(&redis))).await;
        let (agent, direct) = (client(p.addr), client(store.addr));
        for (round, via) in [(1, &agent), (2, &direct)] {
            let s = format!("del-{round}");
            assert_eq!(append(&agent, &s, 1, "old-1").await.status, StatusCode::CREATED);
            assert_eq!(append(&agent, &s, 2, "old-2").await.status, StatusCode::OK);
            let r = via
                .send(Method::DELETE, &format!("/v1/sessions/{s}"), None, &[])
                .await
                .expect("delete");
            assert!(r.status.is_success(), "delete: {} {}", r.status, r.json);
            let r = append(&agent, &s, 1, "new-1").await;
            assert_eq!(
                r.status,
                StatusCode::CREATED,
                "etags {etags}, round {round}: {}",
                r.json
            );
            assert_eq!(message_ids(&get_doc(&direct, &s).await.json), ["new-1"]);
            assert_eq!(append(&agent, &s, 1, "new-2").await.status, StatusCode::OK);
            assert_eq!(message_ids(&get_doc(&direct, &s).await.json), ["new-1", "new-2"]);
        }
    }
}

/// A client's copy read before a delete, written back with its old version after the session
/// was re-created: the snapshot of that version from the previous life is never its base, so
/// the previous life's messages do not come back; the PUT is refused as based on an unknown
/// version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_based_on_a_previous_life_is_not_merged_into_the_next() {
    let redis = RedisServer::start();
    let store = store().await;
    let p = proxy(proxy_args(store.addr, Some(&redis))).await;
    let (agent, direct) = (client(p.addr), client(store.addr));
    for (turn, id) in [(1, "old-1"), (1, "old-2"), (1, "old-3")] {
        assert!(append(&agent, "life", turn, id).await.status.is_success());
    }
    let copy = get_doc(&agent, "life").await.json;
    assert_eq!(copy["version"], 3);
    let r = agent
        .send(Method::DELETE, "/v1/sessions/life", None, &[])
        .await
        .expect("delete");
    assert!(r.status.is_success(), "{}", r.json);
    assert_eq!(append(&agent, "life", 1, "new-1").await.status, StatusCode::CREATED);
    let r = put_doc(&agent, "life", &copy).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{}",
        r.json
    );
    assert_eq!(message_ids(&get_doc(&direct, "life").await.json), ["new-1"]);
}

/// After a delete, a version of the new life written straight to the store reaches a
/// version number the previous life had: the previous life's snapshot of that number is no
/// base, so a PUT of a copy read at that version is merged against the copy's own version (the
/// message it left out is deleted), and its answer names the version the store holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_the_previous_life_is_never_the_base_of_the_next() {
    let redis = RedisServer::start();
    let store = store().await;
    let p = proxy(proxy_args(store.addr, Some(&redis))).await;
    let (agent, direct) = (client(p.addr), client(store.addr));
    for id in ["old-1", "old-2", "old-3"] {
        assert!(append(&agent, "lives", 1, id).await.status.is_success());
    }
    let r = agent
        .send(Method::DELETE, "/v1/sessions/lives", None, &[])
        .await
        .expect("delete");
    assert!(r.status.is_success(), "{}", r.json);
    assert_eq!(append(&agent, "lives", 1, "new-1").await.status, StatusCode::CREATED);
    // A careful writer straight to the store adds a message under the store's If-Match.
    let mut doc = get_doc(&direct, "lives").await.json;
    assert_eq!(doc["version"], 1);
    doc["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"id": "d-1", "content": "direct"}));
    let r = direct
        .send(
            Method::PUT,
            "/v1/sessions/lives",
            Some(&doc),
            &[("if-match", "\"1\"".to_owned())],
        )
        .await
        .expect("direct put");
    assert!(r.status.is_success(), "{}", r.json);
    let mut copy = get_doc(&agent, "lives").await.json;
    assert_eq!(copy["version"], 2);
    copy["messages"]
        .as_array_mut()
        .expect("messages")
        .retain(|m| m["id"] != "d-1");
    let r = put_doc(&agent, "lives", &copy).await;
    assert!(r.status.is_success(), "{}", r.json);
    let stored = get_doc(&direct, "lives").await;
    assert_eq!(message_ids(&stored.json), ["new-1"]);
    assert_eq!(
        r.json["version"], stored.json["version"],
        "{} vs {}",
        r.json, stored.json
    );
}

/// A copy read before a delete, PUT back once the new life has reached (or passed) the
/// copy's version number: the version alone cannot tell the lives apart, the document's
/// `life` does. With and without store ETags, nothing of the previous life comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_read_before_a_delete_is_refused_when_the_new_life_reuses_its_version() {
    let redis = RedisServer::start();
    for (etags, store) in [(true, store().await), (false, store_without_etags().await)] {
        let p = proxy(proxy_args(store.addr, Some(&redis))).await;
        let (agent, direct) = (client(p.addr), client(store.addr));
        let session = format!("reuse-{etags}");
        for id in ["old-1", "old-2"] {
            assert!(append(&agent, &session, 1, id).await.status.is_success());
        }
        let patch = json!({"turn": 2, "state": {"secret": "old-life"}});
        let r = agent
            .send(Method::PATCH, &format!("/v1/sessions/{session}"), Some(&patch), &[])
            .await
            .expect("patch");
        assert!(r.status.is_success(), "{}", r.json);
        let mut copy = get_doc(&agent, &session).await.json;
        assert_eq!(copy["version"], 3);
        let r = agent
            .send(Method::DELETE, &format!("/v1/sessions/{session}"), None, &[])
            .await
            .expect("delete");
        assert!(r.status.is_success(), "{}", r.json);
        // Before any new life: the copy would undo the delete.
        let r = agent
            .send(Method::PUT, &format!("/v1/sessions/{session}"), Some(&copy), &[])
            .await
            .expect("put");
        assert_eq!(
            (r.status, r.json["error"].as_str()),
            (StatusCode::CONFLICT, Some("conflict")),
            "etags {etags}, document deleted: {}",
            r.json
        );
        assert_eq!(get_doc(&direct, &session).await.status, StatusCode::NOT_FOUND);
        for id in ["new-1", "new-2", "new-3", "new-4"] {
            assert!(append(&agent, &session, 1, id).await.status.is_success());
            let version = get_doc(&direct, &session).await.json["version"].as_u64();
            if version < Some(3) {
                continue;
            }
            // The new life is at the copy's version or past it: the copy must be refused.
            copy["turn"] = json!(10);
            if let Some(list) = copy["messages"].as_array_mut() {
                list.push(json!({"id": format!("client-{id}"), "role": "user", "content": "x"}));
            }
            let r = agent
                .send(Method::PUT, &format!("/v1/sessions/{session}"), Some(&copy), &[])
                .await
                .expect("put");
            assert_eq!(
                (r.status, r.json["error"].as_str()),
                (StatusCode::CONFLICT, Some("conflict")),
                "etags {etags}, new life at version {version:?}: {}",
                r.json
            );
        }
        let doc = get_doc(&direct, &session).await.json;
        assert_eq!(message_ids(&doc), ["new-1", "new-2", "new-3", "new-4"], "etags {etags}");
        assert_eq!(doc["state"].get("secret"), None, "etags {etags}: {doc}");
    }
}

/// Deletes racing appends through three proxies. A delete is ordered with the writes: an
/// append sent after the last delete was answered is in the final document, one answered
/// before the last delete was sent is not, nothing else is, and the session stays writable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deletes_racing_appends_through_three_proxies_lose_nothing_ordered_after_them() {
    for etags in [false, true] {
        let redis = RedisServer::start();
        let store = if etags {
            store().await
        } else {
            store_without_etags().await
        };
        let mut proxies = Vec::new();
        for _ in 0..3 {
            proxies.push(proxy(proxy_args(store.addr, Some(&redis))).await);
        }
        let clients: Vec<JsonClient> = proxies.iter().map(|p| client(p.addr)).collect();
        let origin = tokio::time::Instant::now();
        let retried = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for w in 0..6usize {
            let (c, retried, stop) = (clients[w % 3].clone(), retried.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                // (id, sent, answered), in ms since the origin, for each acknowledged append.
                let mut acked = Vec::new();
                for i in 0..400 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let id = format!("w{w}-{i}");
                    let sent = origin.elapsed();
                    let r = append(&c, "race", 1, &id).await;
                    if r.status.is_success() {
                        acked.push((id, sent, origin.elapsed()));
                    } else {
                        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.json);
                        retried.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                acked
            }));
        }
        let mut last_delete = (Duration::ZERO, Duration::ZERO);
        let mut deleted = 0;
        for d in 0..8usize {
            tokio::time::sleep(Duration::from_millis(150)).await;
            for _ in 0..50 {
                let sent = origin.elapsed();
                let r = clients[d % 3]
                    .send(Method::DELETE, "/v1/sessions/race", None, &[])
                    .await
                    .expect("delete");
                if r.status == StatusCode::SERVICE_UNAVAILABLE {
                    retried.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                assert!(
                    r.status.is_success() || r.status == StatusCode::NOT_FOUND,
                    "delete: {} {}",
                    r.status,
                    r.json
                );
                deleted += 1;
                last_delete = (sent, origin.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.store(true, Ordering::SeqCst);
        let mut acked = Vec::new();
        for w in writers {
            acked.extend(w.await.expect("writer"));
        }
        let stored = message_ids(&get_doc(&client(store.addr), "race").await.json);
        let (mut after, mut lost, mut resurrected) = (0, 0, 0);
        for (id, sent, answered) in &acked {
            if *sent > last_delete.1 {
                after += 1;
                if !stored.contains(id) {
                    lost += 1;
                    eprintln!("acknowledged after the last delete, lost: {id}");
                }
            } else if *answered < last_delete.0 && stored.contains(id) {
                resurrected += 1;
                eprintln!("deleted before the last delete, stored again: {id}");
            }
        }
        let known: Vec<&String> = acked.iter().map(|(id, _, _)| id).collect();
        let unknown: Vec<&String> = stored.iter().filter(|id| !known.contains(id)).collect();
        eprintln!(
            "deletes racing appends (etags {etags}): {deleted} deletes, {} appends acknowledged ({after} after the last delete), {lost} lost, {resurrected} resurrected, {} retryable answers",
            acked.len(),
            retried.load(Ordering::SeqCst)
        );
        assert_eq!(deleted, 8);
        assert!(after > 0, "no append was made after the last delete");
        assert_eq!((lost, resurrected), (0, 0));
        assert!(unknown.is_empty(), "stored but never acknowledged: {unknown:?}");
        assert!(
            retried.load(Ordering::SeqCst) * 10 <= acked.len(),
            "too many retryable answers"
        );
        let r = append(&clients[0], "race", 1, "final").await;
        assert!(r.status.is_success(), "the session was left unwritable: {}", r.json);
    }
}

/// Every Redis key a write leaves for a session expires; with a short TTL, a session idle past
/// it is written again correctly (a merge route on a store without ETags, a serialize route).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_session_expires_and_an_idle_session_is_written_again() {
    let redis = RedisServer::start();
    let store = store_without_etags().await;
    let events = EventStore::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let short = |upstream, routes: Option<String>| {
        let mut args = proxy_args(upstream, Some(&redis));
        args.routes = routes;
        args.session_ttl_secs = 1;
        args.history_ttl_secs = 1;
        args
    };
    let serialize = proxy(short(events.addr, Some(events.routes_file(dir.path())))).await;
    let merge = proxy(short(store.addr, None)).await;
    let (events_agent, agent) = (client(serialize.addr), client(merge.addr));
    let post_event = |turn: u64| {
        let c = events_agent.clone();
        async move {
            c.send(
                Method::POST,
                "/api/threads/ttl/events",
                Some(&json!({"turn": turn})),
                &[("x-turn", turn.to_string())],
            )
            .await
            .expect("event")
        }
    };
    assert_eq!(post_event(3).await.status, StatusCode::CREATED);
    assert_eq!(append(&agent, "ttl", 1, "m1").await.status, StatusCode::CREATED);
    let keys = redis.keys("turnlock:session:{ttl}:*");
    assert!(
        keys.len() >= 3,
        "expected a fence, a turn mark and a snapshot: {keys:?}"
    );
    for key in &keys {
        let ttl: i64 = match redis.cmd(&["PTTL", key]) {
            redis::Value::Int(n) => n,
            other => panic!("PTTL {key}: {other:?}"),
        };
        assert!(ttl > 0, "{key} never expires (PTTL {ttl})");
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        redis.keys("turnlock:session:{ttl}:*").is_empty(),
        "keys left after the TTL: {:?}",
        redis.keys("turnlock:session:{ttl}:*")
    );
    // Idle past the TTL: written again, from what the store holds.
    assert_eq!(post_event(3).await.status, StatusCode::CREATED);
    assert_eq!(append(&agent, "ttl", 1, "m2").await.status, StatusCode::OK);
    let doc = get_doc(&client(store.addr), "ttl").await.json;
    assert_eq!(message_ids(&doc), ["m1", "m2"]);
    assert_eq!(events.turns("ttl"), [3, 3]);
}

/// Serialized writes of mixed turns to one thread, over three proxies: none below a turn the
/// store already accepted is acknowledged, and the store never has two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialized_writes_of_mixed_turns_over_three_proxies_reach_the_store_in_order() {
    let redis = RedisServer::start();
    let events = EventStore::start(Duration::from_millis(20)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let routes = events.routes_file(dir.path());
    let mut proxies = Vec::new();
    for _ in 0..3 {
        let mut args = proxy_args(events.addr, Some(&redis));
        args.routes = Some(routes.clone());
        proxies.push(proxy(args).await);
    }
    let retried = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..16u64 {
        let c = client(proxies[w as usize % 3].addr);
        let retried = retried.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..6u64 {
                let turn = 1 + (w + i * 3) % 8 + i;
                for _ in 0..100 {
                    let r = c
                        .send(
                            Method::POST,
                            "/api/threads/mix/events",
                            Some(&json!({"turn": turn, "writer": w})),
                            &[("x-turn", turn.to_string())],
                        )
                        .await
                        .expect("event");
                    if r.status == StatusCode::SERVICE_UNAVAILABLE {
                        retried.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    if r.status.is_success() {
                        acked.push(turn);
                    } else {
                        assert_eq!(r.json["error"], "stale_turn", "{}", r.json);
                    }
                    break;
                }
            }
            acked
        }));
    }
    let mut acked = 0;
    for t in tasks {
        acked += t.await.expect("writer").len();
    }
    let turns = events.turns("mix");
    let stale = turns.windows(2).filter(|w| w[1] < w[0]).count();
    eprintln!(
        "serialize over 3 proxies: {acked} acknowledged, {} stored, {stale} stale, at most {} at the store at once, {} retryable answers",
        turns.len(),
        events.max_in_flight(),
        retried.load(Ordering::SeqCst)
    );
    assert!(acked > 0);
    assert_eq!(turns.len(), acked, "acknowledged and stored differ");
    assert_eq!(stale, 0, "a write below an accepted turn was stored: {turns:?}");
    assert_eq!(events.max_in_flight(), 1, "two writes at the store at once");
}

/// A client's `X-Fencing-Token` never reaches the store: removed from forwarded requests, and
/// replaced by turnlock's own on serialized writes and session deletes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_fencing_token_never_reaches_the_store() {
    let redis = RedisServer::start();
    let events = EventStore::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let routes = events.routes_file(dir.path());
    let mut args = proxy_args(events.addr, Some(&redis));
    args.routes = Some(routes);
    let p = proxy(args).await;
    let agent = client(p.addr);
    let forged = [("x-fencing-token", "999999999999999999".to_owned())];
    for method in [Method::GET, Method::DELETE, Method::PUT] {
        let r = agent
            .send(method.clone(), "/api/threads/forged", None, &forged)
            .await
            .expect("forward");
        assert_eq!(r.status, StatusCode::OK, "{method}");
    }
    let mut headers = forged.to_vec();
    headers.push(("x-turn", "1".into()));
    let r = agent
        .send(
            Method::POST,
            "/api/threads/forged/events",
            Some(&json!({"turn": 1})),
            &headers,
        )
        .await
        .expect("event");
    assert_eq!(r.status, StatusCode::CREATED);
    // A session delete is a write: turnlock's token, not the client's.
    let r = agent
        .send(Method::DELETE, "/v1/sessions/forged", None, &forged)
        .await
        .expect("delete");
    assert_eq!(r.status, StatusCode::OK);
    let seen = events.fencing_tokens();
    assert_eq!(seen.len(), 5, "{seen:?}");
    assert!(
        !seen.iter().any(|t| t.as_deref() == Some("999999999999999999")),
        "the client's token reached the store: {seen:?}"
    );
    assert!(seen[3].is_some(), "the serialized write carries turnlock's token");
    assert!(seen[4].is_some(), "the delete carries turnlock's token");
}

/// The fencing counter lost with Redis (restarted empty): the next grant's token is still
/// higher than any the store accepted, so a store enforcing fencing tokens takes the first
/// write after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_redis_restart() {
    let mut redis = RedisServer::start();
    let mut store_args = turnlock::store::StoreArgs::local();
    store_args.enforce_fencing = true;
    let store = turnlock::store::start(store_args).await.expect("store");
    let p = proxy(proxy_args(store.addr, Some(&redis))).await;
    let agent = client(p.addr);
    assert_eq!(append(&agent, "fr", 1, "m0").await.status, StatusCode::CREATED);
    for i in 1..6 {
        assert!(append(&agent, "fr", 1, &format!("m{i}")).await.status.is_success());
    }
    redis.restart();
    let mut first = None;
    for _ in 0..100 {
        let r = append(&agent, "fr", 2, "after").await;
        // Redis unreachable while the proxy reconnects is `lock_unavailable`, and commits wait
        // out the write-backs that may have been in flight before the restart
        // (`write_conflict`, or `session_busy` when the write's wait deadline ends first):
        // none is the store's answer.
        if ["lock_unavailable", "write_conflict", "session_busy"].contains(&r.json["error"].as_str().unwrap_or("")) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        first = Some(r);
        break;
    }
    let first = first.expect("the proxy never reached the restarted Redis");
    assert!(
        first.status.is_success(),
        "first write after the restart: {} {}",
        first.status,
        first.json
    );
}

/// A store with an append API of its own (`POST /api/threads/{id}/events`, no ETags) that
/// records the turn of every event it accepts, how many writes it had at once, and the
/// `X-Fencing-Token` of every request. Any other request is answered 200.
struct EventStore {
    addr: SocketAddr,
    state: Arc<EventState>,
}

#[derive(Default)]
struct EventState {
    turns: Mutex<HashMap<String, Vec<u64>>>,
    tokens: Mutex<Vec<Option<String>>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl EventStore {
    async fn start(delay: Duration) -> Self {
        let state = Arc::new(EventState::default());
        let st = state.clone();
        let addr = serve(move |req: Request<Incoming>| {
            let st = st.clone();
            async move { st.serve(req, delay).await }
        })
        .await;
        Self { addr, state }
    }

    /// A routes file: serialize `POST /api/threads/{session}/events` (turn in `X-Turn`).
    fn routes_file(&self, dir: &std::path::Path) -> String {
        let path = dir.join("routes.toml");
        std::fs::write(
            &path,
            "[[route]]\nmethod = \"POST\"\npath = \"/api/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
        )
        .expect("write routes");
        path.to_string_lossy().into_owned()
    }

    fn turns(&self, thread: &str) -> Vec<u64> {
        self.state
            .turns
            .lock()
            .expect("turns")
            .get(thread)
            .cloned()
            .unwrap_or_default()
    }

    fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    fn fencing_tokens(&self) -> Vec<Option<String>> {
        self.state.tokens.lock().expect("tokens").clone()
    }
}

impl EventState {
    async fn serve(&self, req: Request<Incoming>, delay: Duration) -> Response<Full<Bytes>> {
        let token = req
            .headers()
            .get("x-fencing-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let path = req.uri().path().to_owned();
        // The proxy's background health check reads `/`: not a request of the test's.
        if path != "/" {
            self.tokens.lock().expect("tokens").push(token);
        }
        let is_event = req.method() == Method::POST && path.ends_with("/events");
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        if !is_event {
            return Response::new(Full::new(Bytes::from_static(b"{}")));
        }
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        let turn = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["turn"].as_u64())
            .unwrap_or(0);
        let thread = path.split('/').nth(3).unwrap_or("").to_owned();
        self.turns.lock().expect("turns").entry(thread).or_default().push(turn);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        Response::builder()
            .status(StatusCode::CREATED)
            .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
            .expect("response")
    }
}

/// A session TTL of zero or past ten years is refused at startup, before anything is served.
#[tokio::test]
async fn a_session_ttl_out_of_range_is_refused_at_startup() {
    for bad in [0, 10 * 365 * 24 * 3600 + 1] {
        let mut args = turnlock::config::ProxyArgs::local("http://127.0.0.1:9".into());
        args.session_ttl_secs = bad;
        let refused = turnlock::sidecar::start(args).await.err().map(|e| e.to_string());
        assert!(
            refused.as_deref().is_some_and(|m| m.contains("--session-ttl-secs")),
            "{bad}: {refused:?}"
        );
    }
}
