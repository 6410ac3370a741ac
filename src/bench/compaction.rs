//! The compactor of the hot session's `compacted` workload: it keeps the document at a
//! realistic size while the writers append, as agents compact their context.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::baselines::{self, PollingLock};
use super::load::Http;

/// Messages a compaction keeps.
pub const KEEP: usize = 200;
/// The pause between two compactions.
pub const EVERY: Duration = Duration::from_millis(100);

/// Where compactions go.
pub enum Target {
    /// Through this proxy (`POST …/compact`).
    Proxy(String),
    /// Straight to this store, as a GET-modify-PUT under the design's own lock.
    Store(String, PollingLock),
}

/// Compacts `session` every [`EVERY`] until `stop`, down to [`KEEP`] messages; the task
/// returns the ids it compacted away.
pub fn spawn(http: Http, target: Target, session: &str, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<String>> {
    let session = session.to_owned();
    let lock_key = format!("bench:lock:{session}");
    tokio::spawn(async move {
        let mut dropped = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(EVERY).await;
            match &target {
                Target::Proxy(proxy) => dropped.extend(through_proxy(&http, proxy, &session).await),
                Target::Store(store, polling) => {
                    let token = format!("{:032x}", rand::random::<u128>());
                    if polling
                        .acquire(&lock_key, &token, Instant::now() + Duration::from_secs(2))
                        .await
                    {
                        dropped.extend(baselines::compact(&http, store, &session, KEEP).await);
                        polling.release(&lock_key, &token).await;
                    }
                }
            }
        }
        dropped
    })
}

/// One compaction through turnlock down to [`KEEP`] messages; the ids it dropped.
async fn through_proxy(http: &Http, proxy: &str, session: &str) -> Vec<String> {
    let url = format!("{proxy}/v1/sessions/{session}");
    let ids: Vec<String> = match http.get(&url).await {
        Ok(r) if r.status == StatusCode::OK => serde_json::from_slice::<Value>(&r.body)
            .ok()
            .and_then(|d| {
                d["messages"]
                    .as_array()
                    .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
            })
            .unwrap_or_default(),
        _ => return Vec::new(),
    };
    if ids.len() <= KEEP {
        return Vec::new();
    }
    let through = ids.len() - KEEP - 1;
    let body = json!({"turn": 1, "through": ids[through], "summary": format!("{} messages compacted", through + 1)});
    match http
        .send(
            Method::POST,
            &format!("{url}/compact"),
            Some(Bytes::from(body.to_string())),
            &[],
        )
        .await
    {
        Ok(r) if r.status.is_success() => ids[..=through].to_vec(),
        _ => Vec::new(),
    }
}
