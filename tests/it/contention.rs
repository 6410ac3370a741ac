//! Three `turnlock proxy` processes sharing one real Redis, in front of one `turnlock store`
//! process, hammered by independent concurrent writers mixing appends, merged PUTs from stale
//! copies, compactions and deliberately stale turns. An independent checker then reads every
//! document straight from the store.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Mutex;
use turnlock::client::JsonClient;

use crate::support::*;

const WRITERS: usize = 16;
const SESSIONS: usize = 10;
const OPS_PER_WRITER: usize = 40;

#[derive(Default)]
struct Log {
    /// (session, message id) → the version its write was acknowledged at.
    acked: HashMap<(usize, String), u64>,
    /// Acknowledged compactions: (session, through id).
    compactions: Vec<(usize, String)>,
    /// Every acknowledged write: (session, write turn, version, turn after).
    commits: Vec<(usize, u64, u64, u64)>,
    stale_sent: usize,
    stale_rejected: usize,
    stale_accepted: usize,
    busy: usize,
    /// Every request sent (retries included).
    sent: usize,
    /// Acknowledged writes per proxy.
    acked_by: [usize; 3],
}

/// What one contended run found.
struct Outcome {
    lost: usize,
    duplicated: usize,
    resurrected: usize,
    stale_accepted: usize,
    acked_messages: usize,
    acked_writes: usize,
    compactions: usize,
    stale_rejected: usize,
    busy: usize,
    sent: usize,
    acked_by: [usize; 3],
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_proxies_lose_nothing_and_accept_no_stale_write() {
    let redis = RedisServer::start();
    let (_store, store_port) = Proc::store();
    let upstream = format!("http://127.0.0.1:{store_port}");
    let proxies: Vec<ProxyProc> = (0..3)
        .map(|_| ProxyProc::spawn(&upstream, Some(&redis.url()), &["--lock-budget-ms", "200"]))
        .collect();
    let o = run(&proxies, store_port, WRITERS, SESSIONS, OPS_PER_WRITER).await;
    let acked = o.acked_messages;
    assert!(
        acked > WRITERS * OPS_PER_WRITER / 3,
        "too few writes acknowledged to prove anything: {acked}"
    );
    assert!(o.compactions > 0, "no compaction was acknowledged");
    assert!(o.stale_rejected > 0, "no deliberately stale write was sent and refused");
    assert_eq!(o.lost, 0, "acknowledged messages lost");
    assert_eq!(o.duplicated, 0, "messages stored more than once");
    assert_eq!(o.resurrected, 0, "compacted messages came back");
    assert_eq!(o.stale_accepted, 0, "writes older than the stored turn were accepted");

    // Every proxy shows lock activity, and no lock is left in Redis.
    let mut acquired_total = 0.0;
    for p in &proxies {
        let text = metrics(p.admin).await;
        acquired_total += metric(&text, "turnlock_lock_acquire_total{outcome=\"acquired\"}");
        assert!(
            text.contains("turnlock_lock_wait_seconds_bucket"),
            "no lock wait histogram"
        );
    }
    assert!(acquired_total > 0.0, "no lock acquisition in /metrics");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(redis.lock_keys().is_empty(), "lock keys left in Redis");
}

/// With default settings, ordinary contention (24 writers of 8 sessions through 3 proxies,
/// appends, merged PUTs, compactions, stale turns, a store that takes its time) is absorbed: writes wait their turn
/// instead of being answered with a retryable 503, and every proxy gets its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn default_settings_absorb_ordinary_contention_without_retryable_answers() {
    let redis = RedisServer::start();
    let (_store, store_port) = Proc::store();
    // A store that takes 15 ms to write a document, as a small document service does: the
    // writers of one session queue behind each other for tens of milliseconds.
    let front = front_store(
        std::net::SocketAddr::from(([127, 0, 0, 1], store_port)),
        PutDelay::Every(Duration::from_millis(15)),
    )
    .await;
    let upstream = format!("http://{front}");
    let proxies: Vec<ProxyProc> = (0..3)
        .map(|_| ProxyProc::spawn(&upstream, Some(&redis.url()), &[]))
        .collect();
    let started = std::time::Instant::now();
    let o = run(&proxies, store_port, 24, 8, 30).await;
    let took = started.elapsed();
    let share = o.busy as f64 / o.sent.max(1) as f64;
    println!(
        "mixed contention: {} writes sent, {} retryable ({:.2}%), {} acknowledged ({:.0}/s), per proxy {:?}",
        o.sent,
        o.busy,
        share * 100.0,
        o.acked_writes,
        o.acked_writes as f64 / took.as_secs_f64(),
        o.acked_by
    );
    assert_eq!(o.lost, 0, "acknowledged messages lost");
    assert_eq!(o.duplicated, 0, "messages stored more than once");
    assert_eq!(o.resurrected, 0, "compacted messages came back");
    assert_eq!(o.stale_accepted, 0, "writes older than the stored turn were accepted");
    assert!(
        o.acked_writes > 24 * 30 / 2,
        "too few writes acknowledged: {}",
        o.acked_writes
    );
    assert!(
        share <= 0.01,
        "{} of {} writes answered with a retryable 503",
        o.busy,
        o.sent
    );
    // Every proxy takes turns: none is starved while the others write.
    let fair = o.acked_writes / 3;
    assert!(
        o.acked_by.iter().all(|n| *n >= fair / 2),
        "acknowledged writes per proxy: {:?}",
        o.acked_by
    );
}

/// `writers` concurrent writers of `sessions` sessions, `ops` steps each, spread over the
/// proxies; then an independent checker reads every document straight from the store.
async fn run(proxies: &[ProxyProc], store_port: u16, writers: usize, sessions: usize, ops: usize) -> Outcome {
    let clients: Vec<JsonClient> = proxies.iter().map(ProxyProc::client).collect();
    let log = Arc::new(Mutex::new(Log::default()));
    let mut tasks = Vec::new();
    for w in 0..writers {
        let clients = clients.clone();
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for op in 0..ops {
                let p = (w + op) % clients.len();
                let s = (w * 7 + op * 3) % sessions;
                writer_step(&clients[p], p, w, op, s, &log).await;
            }
        }));
    }
    let all = futures_util::future::join_all(tasks);
    tokio::time::timeout(Duration::from_secs(240), all)
        .await
        .expect("writers finished in time");

    // The independent checker reads straight from the store.
    let store = JsonClient::new(format!("http://127.0.0.1:{store_port}"));
    let log = log.lock().await;
    let mut lost = 0;
    let mut duplicated = 0;
    let mut resurrected = 0;
    for s in 0..sessions {
        let doc = get_doc(&store, &format!("c-{s}")).await.json;
        let ids = message_ids(&doc);
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for id in &ids {
            *counts.entry(id.as_str()).or_default() += 1;
        }
        duplicated += counts.values().filter(|c| **c > 1).count();
        // The versions at which this session's acknowledged compactions' `through` messages were stored.
        let compacted_through: Vec<u64> = log
            .compactions
            .iter()
            .filter(|(cs, _)| *cs == s)
            .filter_map(|(_, through)| log.acked.get(&(s, through.clone())).copied())
            .collect();
        for ((ms, id), v) in log.acked.iter().filter(|((ms, _), _)| *ms == s) {
            let _ = ms;
            let present = counts.contains_key(id.as_str());
            let covered = compacted_through.iter().any(|vm| *v <= *vm);
            let strictly_covered = compacted_through.iter().any(|vm| *v < *vm);
            if !present && !covered {
                lost += 1;
            }
            if present && strictly_covered {
                resurrected += 1;
            }
        }
    }
    // No write older than the stored turn was accepted: in version order, every acknowledged
    // write's turn is at least the turn stored before it.
    let mut stale_accepted = log.stale_accepted;
    for s in 0..sessions {
        let mut commits: Vec<(u64, u64, u64)> = log
            .commits
            .iter()
            .filter(|c| c.0 == s)
            .map(|c| (c.2, c.1, c.3))
            .collect();
        commits.sort();
        let mut turn_before: HashMap<u64, u64> = HashMap::new();
        let mut max_turn = 0;
        let mut i = 0;
        while i < commits.len() {
            let v = commits[i].0;
            turn_before.insert(v, max_turn);
            while i < commits.len() && commits[i].0 == v {
                max_turn = max_turn.max(commits[i].2);
                i += 1;
            }
        }
        stale_accepted += commits.iter().filter(|(v, t, _)| *t < turn_before[v]).count();
    }
    let acked = log.acked.len();
    println!(
        "contention: writes acknowledged={} messages acknowledged={acked} lost={lost} duplicated={duplicated} \
         compacted-back={resurrected} stale sent={} rejected={} accepted={stale_accepted} busy={} compactions={}",
        log.commits.len(),
        log.stale_sent,
        log.stale_rejected,
        log.busy,
        log.compactions.len()
    );
    Outcome {
        lost,
        duplicated,
        resurrected,
        stale_accepted,
        acked_messages: acked,
        acked_writes: log.commits.len(),
        compactions: log.compactions.len(),
        stale_rejected: log.stale_rejected,
        busy: log.busy,
        sent: log.sent,
        acked_by: log.acked_by,
    }
}

/// One step of one writer: an append, a merged PUT from the copy it read, a compaction, or a
/// deliberately stale write.
async fn writer_step(client: &JsonClient, proxy: usize, w: usize, op: usize, s: usize, log: &Mutex<Log>) {
    let session = format!("c-{s}");
    let path = format!("/v1/sessions/{session}");
    let read = client.send(Method::GET, &path, None, &[]).await;
    let doc = match read {
        Ok(r) if r.status == StatusCode::OK => r.json,
        _ => json!({"turn": 0, "version": 0, "messages": []}),
    };
    let stored_turn = doc["turn"].as_u64().unwrap_or(0);
    // Writers either stay on the stored turn or move to the next one.
    let turn = stored_turn + (op % 2) as u64;
    let id = format!("w{w}-o{op}");
    let kind = op % 7;
    let (req_path, body, ids, through, stale) = match kind {
        0..=2 => (
            format!("{path}/messages"),
            json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": id}]}),
            vec![id.clone()],
            None,
            false,
        ),
        3 | 4 => {
            let mut mine = doc.clone();
            mine["turn"] = json!(turn);
            mine[format!("w{w}")] = json!(op);
            match mine.get_mut("messages") {
                Some(Value::Array(list)) => list.push(json!({"id": id, "role": "assistant", "content": id})),
                _ => mine["messages"] = json!([{"id": id, "role": "assistant", "content": id}]),
            }
            (path.clone(), mine, vec![id.clone()], None, false)
        }
        5 => {
            // Compact through the second stored message we know was acknowledged.
            let known: HashSet<String> = {
                let log = log.lock().await;
                message_ids(&doc)
                    .into_iter()
                    .filter(|m| log.acked.contains_key(&(s, m.clone())))
                    .collect()
            };
            let Some(through) = message_ids(&doc).into_iter().filter(|m| known.contains(m)).nth(1) else {
                return;
            };
            (
                format!("{path}/compact"),
                json!({"turn": turn, "through": through, "summary": {"by": id}}),
                vec![],
                Some(through),
                false,
            )
        }
        _ => {
            if stored_turn < 2 {
                return;
            }
            (
                format!("{path}/messages"),
                json!({"turn": stored_turn - 2, "messages": [{"id": id, "role": "user", "content": "late"}]}),
                vec![id.clone()],
                None,
                true,
            )
        }
    };
    let method = if req_path == path { Method::PUT } else { Method::POST };
    for _attempt in 0..20 {
        let Ok(r) = client.send(method.clone(), &req_path, Some(&body), &[]).await else {
            return;
        };
        let mut log = log.lock().await;
        log.sent += 1;
        if stale {
            log.stale_sent += 1;
        }
        if r.status.is_success() {
            let version = r.json["version"].as_u64().unwrap_or(0);
            let turn_after = r.json["turn"].as_u64().unwrap_or(0);
            let write_turn = body["turn"].as_u64().unwrap_or(0);
            log.commits.push((s, write_turn, version, turn_after));
            log.acked_by[proxy] += 1;
            for m in &ids {
                log.acked.insert((s, m.clone()), version);
            }
            if let Some(t) = &through {
                log.compactions.push((s, t.clone()));
            }
            if stale {
                log.stale_accepted += 1;
            }
            return;
        }
        if r.json["error"] == "stale_turn" {
            if stale {
                log.stale_rejected += 1;
            }
            return;
        }
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            log.busy += 1;
            drop(log);
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        // 409 conflict (a field both changed) or unknown message: a refusal, not an ack.
        return;
    }
}
