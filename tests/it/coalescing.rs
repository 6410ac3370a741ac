//! Coalescing (group commit): writes to one session that wait in one proxy are merged into a
//! single read-merge-write, and each still gets its own correct answer.
//!
//! To make the batch deterministic, each test holds the session's lock in Redis itself for a
//! moment, so every write queues behind it and the proxy's leader takes them all at once.

use std::time::Duration;

use http::Method;
use serde_json::{json, Value};
use turnlock::client::{JsonClient, Reply};

use crate::support::{
    append, client, get_doc, message_ids, metric, metrics, proxy, proxy_args, store, store_without_etags, RedisServer,
};

/// Writes queued behind the held lock.
const QUEUED: usize = 12;
/// How long the test holds the lock (the proxies' budget is longer).
const HELD_MS: u64 = 300;

fn hold_lock(redis: &RedisServer, session: &str, turn: u64) {
    let key = format!("turnlock:session:{{{session}}}:{turn}");
    let reply = redis.cmd(&["SET", &key, "held-by-the-test", "NX", "PX", &HELD_MS.to_string()]);
    assert_eq!(reply, redis::Value::Okay, "the test could not take the lock first");
}

/// How many read-merge-writes the proxy has made (its batch-size histogram's count).
async fn batch_count(admin: std::net::SocketAddr) -> f64 {
    let text = metrics(admin).await;
    assert!(
        text.contains("turnlock_write_batch_size_count"),
        "no batch size metric in /metrics"
    );
    metric(&text, "turnlock_write_batch_size_count ")
}

/// Fires `QUEUED` appends at once while the lock is held; returns their replies.
async fn queued_appends(c: &JsonClient, session: &str, turn: u64) -> Vec<Reply> {
    let tasks: Vec<_> = (0..QUEUED)
        .map(|i| {
            let (c, session) = (c.clone(), session.to_owned());
            tokio::spawn(async move { append(&c, &session, turn, &format!("q{i}")).await })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("task"));
    }
    replies
}

fn etag_version(r: &Reply) -> u64 {
    let tag = r.headers.get("etag").and_then(|v| v.to_str().ok()).expect("ETag");
    turnlock::http::version_from_etag(tag).expect("numeric ETag")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coalesced_batch_is_one_version_and_its_answers_match_the_store() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.lock_budget_ms = 2_000;
    args.lock_ttl_ms = 5_000;
    let proxy = proxy(args).await;
    let c = client(proxy.addr);
    let first = append(&c, "s1", 1, "first").await;
    assert_eq!(first.status.as_u16(), 201);

    let batches_before = batch_count(proxy.admin).await;
    hold_lock(&redis, "s1", 1);
    let replies = queued_appends(&c, "s1", 1).await;
    let batches = batch_count(proxy.admin).await - batches_before;
    assert_eq!(
        batches, 1.0,
        "all queued writes were to be merged into one read-merge-write"
    );

    let doc = get_doc(&c, "s1").await.json;
    let stored_version = doc["version"].as_u64().expect("version");
    assert_eq!(stored_version, 2, "one read-merge-write makes one new version");
    for r in &replies {
        assert!(r.status.is_success(), "{:?}", r.json);
        assert_eq!(r.json["version"].as_u64(), Some(stored_version), "{:?}", r.json);
        assert_eq!(etag_version(r), stored_version);
    }
    let ids = message_ids(&doc);
    assert_eq!(ids.len(), QUEUED + 1);
    for i in 0..QUEUED {
        assert!(ids.contains(&format!("q{i}")));
    }
    // The snapshot kept for three-way merges is the stored version's: a full-document PUT
    // based on it merges instead of failing as based on an unknown version.
    let mut put = doc.clone();
    put["state"] = json!({"k": "v"});
    let r = c
        .send(Method::PUT, "/v1/sessions/s1", Some(&put), &[])
        .await
        .expect("put");
    assert!(r.status.is_success(), "{:?}", r.json);
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_without_etags_stays_writable_after_a_coalesced_batch() {
    let redis = RedisServer::start();
    let store = store_without_etags().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.lock_budget_ms = 2_000;
    args.lock_ttl_ms = 5_000;
    let proxy = proxy(args).await;
    let c = client(proxy.addr);
    assert!(append(&c, "s2", 1, "first").await.status.is_success());
    hold_lock(&redis, "s2", 1);
    for r in queued_appends(&c, "s2", 1).await {
        assert!(r.status.is_success(), "{:?}", r.json);
    }
    // The version fence must agree with what the store holds, or every later write of the
    // session is refused as conflicting.
    for turn in 2..5 {
        let r = append(&c, "s2", turn, &format!("later-{turn}")).await;
        assert!(r.status.is_success(), "turn {turn}: {:?}", r.json);
    }
    let doc: Value = get_doc(&c, "s2").await.json;
    assert_eq!(message_ids(&doc).len(), QUEUED + 4);
    proxy.stop().await;
    store.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_based_on_the_stored_version_merges_after_an_append_in_the_same_batch() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.lock_budget_ms = 2_000;
    args.lock_ttl_ms = 5_000;
    let proxy = proxy(args).await;
    let c = client(proxy.addr);
    assert!(append(&c, "s3", 1, "first").await.status.is_success());
    let mut copy = get_doc(&c, "s3").await.json;
    copy["state"] = json!({"plan": "book the train"});

    let batches_before = batch_count(proxy.admin).await;
    hold_lock(&redis, "s3", 1);
    let appending = {
        let c = c.clone();
        tokio::spawn(async move { append(&c, "s3", 1, "appended").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let put = c
        .send(Method::PUT, "/v1/sessions/s3", Some(&copy), &[])
        .await
        .expect("put");
    let appended = appending.await.expect("task");
    assert!(appended.status.is_success(), "{:?}", appended.json);
    assert!(put.status.is_success(), "{:?}", put.json);
    assert_eq!(
        batch_count(proxy.admin).await - batches_before,
        1.0,
        "the append and the PUT were to be committed in one read-merge-write"
    );

    let doc = get_doc(&c, "s3").await.json;
    assert_eq!(doc["state"]["plan"], "book the train");
    assert_eq!(message_ids(&doc), vec!["first".to_owned(), "appended".to_owned()]);
    proxy.stop().await;
    store.stop().await;
}
