//! With Redis, what a write committed under the lock (its idempotency record, the version
//! snapshot for three-way merges) is stored in the same round trip as the lock's release.

use http::Method;
use serde_json::json;

use crate::support::{client, get_doc, message_ids, proxy, proxy_args, store, Monitor, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_stored_with_the_release_answer_retries_and_merges() {
    let redis = RedisServer::start();
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    let c = client(proxy.addr);
    let body = json!({"turn": 1, "messages": [{"id": "m1", "role": "user", "content": "hi"}]});
    let key = [("idempotency-key", "retry-1".to_owned())];

    let monitor = Monitor::start(&redis);
    let first = c
        .send(Method::POST, "/v1/sessions/r1/messages", Some(&body), &key)
        .await
        .expect("first");
    let commands = monitor.stop(&redis);
    assert_eq!(first.status.as_u16(), 201, "{:?}", first.json);
    // The script that deletes the lock key is the one that stores the record and the snapshot.
    let release = r#""DEL" "turnlock:session:{r1}:1""#;
    let runs = script_runs(&commands);
    let releasing: Vec<&Vec<&str>> = runs
        .iter()
        .filter(|run| run.iter().any(|l| l.ends_with(release)))
        .collect();
    assert_eq!(releasing.len(), 1, "one release of the lock: {commands:#?}");
    let stores = |what: &str| {
        releasing[0]
            .iter()
            .any(|l| l.contains(r#""SET" "turnlock:session:{r1}:"#) && l.contains(what))
    };
    assert!(
        stores(":idem:") && stores(":history:"),
        "the idempotency record and the version snapshot were stored in the release's own script: {commands:#?}"
    );
    assert!(redis.lock_keys().is_empty(), "the lock was released");
    assert_eq!(
        redis.keys("turnlock:session:{r1}:*:history:*").len(),
        1,
        "the version snapshot was stored"
    );

    let retry = c
        .send(Method::POST, "/v1/sessions/r1/messages", Some(&body), &key)
        .await
        .expect("retry");
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.json, first.json);
    assert_eq!(
        retry.headers.get("idempotent-replayed").and_then(|v| v.to_str().ok()),
        Some("true")
    );

    // A full-document PUT based on that version merges against its snapshot.
    let mut copy = get_doc(&c, "r1").await.json;
    copy["state"] = json!({"k": 1});
    let append = json!({"turn": 1, "messages": [{"id": "m2", "role": "user", "content": "more"}]});
    let r = c
        .send(Method::POST, "/v1/sessions/r1/messages", Some(&append), &[])
        .await
        .expect("append");
    assert!(r.status.is_success());
    let put = c
        .send(Method::PUT, "/v1/sessions/r1", Some(&copy), &[])
        .await
        .expect("put");
    assert!(put.status.is_success(), "{:?}", put.json);
    let doc = get_doc(&c, "r1").await.json;
    assert_eq!(message_ids(&doc), vec!["m1".to_owned(), "m2".to_owned()]);
    assert_eq!(doc["state"]["k"], 1);
    proxy.stop().await;
    store.stop().await;
}

/// The commands of each Lua script run, from `MONITOR` lines: Redis runs a script's commands
/// with nothing in between, so each run of consecutive `lua` lines is one script.
fn script_runs(lines: &[String]) -> Vec<Vec<&str>> {
    let mut runs: Vec<Vec<&str>> = Vec::new();
    let mut in_run = false;
    for line in lines {
        if line.contains(" lua] ") {
            if !in_run {
                runs.push(Vec::new());
            }
            if let Some(run) = runs.last_mut() {
                run.push(line);
            }
            in_run = true;
        } else {
            in_run = false;
        }
    }
    runs
}
