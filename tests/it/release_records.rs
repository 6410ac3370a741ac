//! With Redis, what a write committed under the lock (its idempotency record, the version
//! snapshot for three-way merges) is stored in the same round trip as the lock's release.

use http::Method;
use serde_json::json;

use std::time::Duration;

use http::StatusCode;

use crate::support::{
    append, append_ids, client, get_doc, message_ids, proxy, proxy_args, put_doc, store, Monitor, RedisServer,
};

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
    let put = put_doc(&c, "r1", &copy).await;
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

/// The Redis record of a version's snapshot, parsed, and its size in bytes.
fn history_record(redis: &RedisServer, session: &str, version: u64) -> Option<(serde_json::Value, usize)> {
    let keys = redis.keys(&format!("turnlock:session:{{{session}}}:*:history:{version}"));
    let key = keys.first()?;
    match redis.cmd(&["GET", key]) {
        redis::Value::BulkString(bytes) => Some((serde_json::from_slice(&bytes).ok()?, bytes.len())),
        _ => None,
    }
}

/// Creates `session` with `n` messages (`s0`…) in one write: version 1.
async fn seed(agent: &turnlock::client::JsonClient, session: &str, n: usize) {
    let ids: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let r = append_ids(agent, session, 1, &ids).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
}

/// A growing document's appends store each version's snapshot as a link to the previous one
/// (what the batch appended), whichever proxy wrote it: the records stay small, and a merged
/// PUT based on any version of the chain is merged against that version exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_store_snapshots_as_links_and_puts_based_on_them_merge_exactly() {
    let redis = RedisServer::start();
    let store = store().await;
    let p1 = proxy(proxy_args(store.addr, Some(&redis))).await;
    let p2 = proxy(proxy_args(store.addr, Some(&redis))).await;
    let agents = [client(p1.addr), client(p2.addr)];
    seed(&agents[0], "chain", 300).await;
    let mut copies = vec![get_doc(&agents[0], "chain").await.json];
    for v in 2..=40u64 {
        let r = append(&agents[(v % 2) as usize], "chain", 1, &format!("m{v}")).await;
        assert!(r.status.is_success(), "{}", r.json);
        copies.push(get_doc(&agents[0], "chain").await.json);
    }
    assert_eq!(copies[39]["version"], 40);
    // Versions 1, 16 and 32 are whole; the others name the one before them and list only
    // the message their batch appended.
    for v in [1u64, 16, 32] {
        let (record, _) = history_record(&redis, "chain", v).expect("whole snapshot");
        assert!(record.get("after").is_none(), "version {v}: {record}");
        assert_eq!(record["message_ids"].as_array().map(Vec::len), Some(299 + v as usize));
    }
    for v in [2u64, 15, 17, 31, 33, 40] {
        let (record, size) = history_record(&redis, "chain", v).expect("link");
        assert_eq!(record["after"]["version"], v - 1, "version {v}: {record}");
        assert_eq!(record["message_ids"], json!([format!("m{v}")]), "version {v}: {record}");
        assert!(size < 1_000, "version {v}'s record is {size} bytes");
    }
    // A copy read at each of these versions, with one of its messages dropped and a field
    // set, PUT back: the drop and the field are applied, every later append is kept.
    for (n, v) in [3u64, 15, 16, 17, 31, 40].into_iter().enumerate() {
        let mut copy = copies[(v - 1) as usize].clone();
        assert_eq!(copy["version"], v);
        let dropped = copy["messages"].as_array_mut().expect("messages").remove(n);
        copy["state"] = json!({ format!("k{v}"): v });
        let r = agents[n % 2]
            .send(Method::PUT, "/v1/sessions/chain", Some(&copy), &[])
            .await
            .expect("put");
        assert!(r.status.is_success(), "PUT based on version {v}: {}", r.json);
        let doc = get_doc(&agents[0], "chain").await.json;
        let ids = message_ids(&doc);
        assert!(
            !ids.contains(&dropped["id"].as_str().unwrap_or_default().to_owned()),
            "{ids:?}"
        );
        assert!(ids.contains(&"m40".to_owned()), "{ids:?}");
        assert_eq!(doc["state"][format!("k{v}")], v, "{doc}");
    }
    p1.stop().await;
    p2.stop().await;
    store.stop().await;
}

/// A chain that does not hold together gives no base: a PUT based on such a version is
/// refused as based on an unknown version (409), never merged against a wrong one. A version
/// written past turnlock (the store numbered it) has no record: the next is stored whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_chain_refuses_the_put_and_a_version_written_past_turnlock_starts_a_new_one() {
    let redis = RedisServer::start();
    let store = store().await;
    let p = proxy(proxy_args(store.addr, Some(&redis))).await;
    let (agent, direct) = (client(p.addr), client(store.addr));
    seed(&agent, "gone", 300).await;
    for i in 2..=5 {
        assert!(append(&agent, "gone", 1, &format!("m{i}")).await.status.is_success());
    }
    let copy = get_doc(&agent, "gone").await.json;
    assert_eq!(copy["version"], 5);
    let keys = redis.keys("turnlock:session:{gone}:*:history:3");
    assert_eq!(keys.len(), 1, "{keys:?}");
    redis.cmd(&["DEL", &keys[0]]);
    assert!(append(&agent, "gone", 1, "m6").await.status.is_success());
    let mut dropping = copy.clone();
    dropping["messages"].as_array_mut().expect("messages").remove(0);
    let r = put_doc(&agent, "gone", &dropping).await;
    assert_eq!(
        (r.status, r.json["error"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{}",
        r.json
    );
    assert_eq!(message_ids(&get_doc(&direct, "gone").await.json).len(), 305);

    // Written straight to the store (which numbers it version 2): s1 dropped there.
    seed(&agent, "past", 300).await;
    let mut changed = get_doc(&direct, "past").await.json;
    changed["messages"].as_array_mut().expect("messages").remove(1);
    let r = put_doc(&direct, "past", &changed).await;
    assert!(r.status.is_success(), "{}", r.json);
    assert!(append(&agent, "past", 1, "m3").await.status.is_success());
    let copy = get_doc(&agent, "past").await.json;
    assert_eq!(copy["version"], 3);
    let (record, _) = history_record(&redis, "past", 3).expect("version 3's record");
    assert!(record.get("after").is_none(), "{record}");
    assert!(append(&agent, "past", 1, "m4").await.status.is_success());
    let mut dropping = copy.clone();
    dropping["messages"].as_array_mut().expect("messages").remove(0);
    let r = put_doc(&agent, "past", &dropping).await;
    assert!(r.status.is_success(), "{}", r.json);
    let ids = message_ids(&get_doc(&direct, "past").await.json);
    assert_eq!(ids.len(), 300, "{ids:?}");
    assert!(
        !ids.contains(&"s0".to_owned()) && !ids.contains(&"s1".to_owned()),
        "{ids:?}"
    );
    assert!(ids.contains(&"m4".to_owned()), "{ids:?}");
    p.stop().await;
    store.stop().await;
}

/// A link lives as long as a whole snapshot would: writing it renews the records below it in
/// its chain, so a PUT based on the newest version merges even after the chain's first
/// record would have expired on its own. A previous record about to expire is not linked to
/// (its renewal could come too late): that version is stored whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_renews_the_records_below_it() {
    let redis = RedisServer::start();
    let store = store().await;
    let mut args = proxy_args(store.addr, Some(&redis));
    args.history_ttl_secs = 2;
    let p = proxy(args).await;
    let agent = client(p.addr);
    seed(&agent, "renew", 300).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(append(&agent, "renew", 1, "m2").await.status.is_success());
    let (record, _) = history_record(&redis, "renew", 2).expect("version 2's record");
    assert_eq!(record["after"]["version"], 1, "{record}");
    let mut copy = get_doc(&agent, "renew").await.json;
    assert_eq!(copy["version"], 2);
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    // Version 1's record was written 2.3 s ago with a 2 s lifetime; version 2's link renewed
    // it. Version 2's has under a second left: version 3 is stored whole.
    assert!(append(&agent, "renew", 1, "m3").await.status.is_success());
    let (record, _) = history_record(&redis, "renew", 3).expect("version 3's record");
    assert!(record.get("after").is_none(), "{record}");
    copy["messages"].as_array_mut().expect("messages").remove(0);
    let r = put_doc(&agent, "renew", &copy).await;
    assert!(r.status.is_success(), "{}", r.json);
    let ids = message_ids(&get_doc(&agent, "renew").await.json);
    assert_eq!(
        (ids.len(), ids.first().map(String::as_str)),
        (301, Some("s1")),
        "{ids:?}"
    );
    p.stop().await;
    store.stop().await;
}
