//! The designs turnlock is compared with, doing the same work against the same store:
//! a plain GET-modify-PUT (unsafe, but the floor), and that same read-merge-write under the
//! two common client-side Redis locks, the naive one (`SET NX EX` with a fixed 100 ms sleep
//! between attempts) and a polling lock with jittered exponential backoff.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use redis::Script;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::load::Http;
use crate::redis_conn::RedisConn;

/// The naive lock's lease, in seconds (`SET … NX EX 10`).
const NAIVE_LEASE_SECS: u64 = 10;
/// The naive lock's fixed pause between attempts.
pub const NAIVE_SLEEP: Duration = Duration::from_millis(100);
/// The backoff lock's first and longest pause between attempts.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(1);
pub const BACKOFF_MAX: Duration = Duration::from_millis(64);

/// One message as the benchmark's agents write it.
pub fn message(id: &str) -> Value {
    json!({"id": id, "role": "tool", "content": format!("result of tool call {id}")})
}

/// GET the document, append `msg`, PUT it back with no precondition: what agents do today
/// without coordination. Returns whether the store acknowledged the write.
pub async fn get_modify_put(http: &Http, store: &str, session: &str, turn: u64, msg: &Value) -> bool {
    let url = format!("{store}/v1/sessions/{session}");
    let mut doc = match http.get(&url).await {
        Ok(r) if r.status == StatusCode::OK => match serde_json::from_slice::<Value>(&r.body) {
            Ok(doc) => doc,
            Err(_) => return false,
        },
        Ok(r) if r.status == StatusCode::NOT_FOUND => {
            json!({"session": session, "turn": turn, "version": 0, "messages": [], "state": {}})
        }
        _ => return false,
    };
    match doc.get_mut("messages") {
        Some(Value::Array(messages)) => messages.push(msg.clone()),
        _ => return false,
    }
    let Ok(body) = serde_json::to_vec(&doc) else {
        return false;
    };
    matches!(
        http.send(Method::PUT, &url, Some(Bytes::from(body)), &[]).await,
        Ok(r) if r.status.is_success()
    )
}

/// GET the document, drop all but its last `keep` messages, PUT it back (under the caller's
/// lock); the ids dropped, when the store acknowledged.
pub async fn compact(http: &Http, store: &str, session: &str, keep: usize) -> Vec<String> {
    let url = format!("{store}/v1/sessions/{session}");
    let mut doc = match http.get(&url).await {
        Ok(r) if r.status == StatusCode::OK => match serde_json::from_slice::<Value>(&r.body) {
            Ok(doc) => doc,
            Err(_) => return Vec::new(),
        },
        _ => return Vec::new(),
    };
    let dropped: Vec<Value> = match doc.get_mut("messages") {
        Some(Value::Array(messages)) if messages.len() > keep => messages.drain(..messages.len() - keep).collect(),
        _ => return Vec::new(),
    };
    let Ok(body) = serde_json::to_vec(&doc) else {
        return Vec::new();
    };
    match http.send(Method::PUT, &url, Some(Bytes::from(body)), &[]).await {
        Ok(r) if r.status.is_success() => dropped
            .iter()
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// How a polling lock waits between attempts.
#[derive(Clone, Copy, Debug)]
pub enum Waiting {
    /// The naive lock: the same sleep every time.
    Fixed(Duration),
    /// Doubling pauses from `first` up to `max`, each jittered to between half and all of it.
    Backoff { first: Duration, max: Duration },
}

/// A client-side Redis lock that polls: `SET key token NX EX`, sleep, try again.
#[derive(Clone)]
pub struct PollingLock {
    conn: RedisConn,
    waiting: Waiting,
    release: Script,
}

impl PollingLock {
    pub fn new(conn: RedisConn, waiting: Waiting) -> Self {
        Self {
            conn,
            waiting,
            release: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
        }
    }

    /// Takes `key`, trying until `give_up`; returns whether it was granted.
    pub async fn acquire(&self, key: &str, token: &str, give_up: Instant) -> bool {
        let mut pause = match self.waiting {
            Waiting::Fixed(d) => d,
            Waiting::Backoff { first, .. } => first,
        };
        loop {
            let granted: Result<Option<String>, _> = self
                .conn
                .run(|mut c| async move {
                    redis::cmd("SET")
                        .arg(key)
                        .arg(token)
                        .arg("NX")
                        .arg("EX")
                        .arg(NAIVE_LEASE_SECS)
                        .query_async(&mut c)
                        .await
                })
                .await;
            if let Ok(Some(_)) = granted {
                return true;
            }
            let now = Instant::now();
            if now >= give_up {
                return false;
            }
            let sleep = match self.waiting {
                Waiting::Fixed(d) => d,
                Waiting::Backoff { max, .. } => {
                    let jittered = jitter(pause);
                    pause = (pause * 2).min(max);
                    jittered
                }
            };
            tokio::time::sleep(sleep.min(give_up - now)).await;
        }
    }

    pub async fn release(&self, key: &str, token: &str) {
        let script = &self.release;
        let _: Result<i64, _> = self
            .conn
            .run(|mut c| async move { script.key(key).arg(token).invoke_async(&mut c).await })
            .await;
    }
}

fn jitter(d: Duration) -> Duration {
    let nanos = d.as_nanos() as u64;
    Duration::from_nanos(nanos / 2 + rand::random::<u64>() % (nanos / 2 + 1))
}
