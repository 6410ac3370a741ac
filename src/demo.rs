//! `turnlock demo`: several simulated agent replicas write the same sessions at once, first
//! straight to the store (GET-modify-PUT, as agents do today), then through the sidecar.
//! Everything runs in this process on loopback: a reference store and a proxy with the
//! in-memory lock backend, so no Redis is needed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::client::JsonClient;
use crate::config::ProxyArgs;
use crate::store::StoreArgs;

/// `turnlock demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Simulated agent replicas writing at once.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// Sessions they share.
    #[arg(long, default_value_t = 4)]
    pub sessions: usize,
    /// Turns each replica writes per session.
    #[arg(long, default_value_t = 25)]
    pub writes: usize,
}

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunReport {
    pub name: &'static str,
    pub acknowledged: usize,
    pub lost: usize,
    pub duplicated: usize,
    pub stale_accepted: usize,
    pub stale_rejected: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

#[derive(Default)]
struct Tally {
    acked: Vec<(usize, String)>,
    latencies: Vec<Duration>,
    stale_rejected: usize,
    /// Per acknowledged write: (session, version it was stored at, its turn).
    commits: Vec<(usize, u64, u64)>,
}

pub async fn run(args: DemoArgs) -> Result<Vec<RunReport>, Box<dyn std::error::Error>> {
    let store = crate::store::start(StoreArgs::local()).await?;
    let store_url = format!("http://{}", store.addr);
    let proxy = crate::sidecar::start(ProxyArgs::local(store_url.clone())).await?;
    let proxy_url = format!("http://{}", proxy.addr);

    let direct = run_replicas("straight to the store", &store_url, "direct", &args).await;
    let proxied = run_replicas("through turnlock", &proxy_url, "proxied", &args).await;

    proxy.stop().await;
    store.stop().await;
    Ok(vec![direct, proxied])
}

async fn run_replicas(name: &'static str, base: &str, tag: &str, args: &DemoArgs) -> RunReport {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut tasks = Vec::new();
    for replica in 0..args.replicas {
        let client = JsonClient::new(base);
        let tally = tally.clone();
        let (sessions, writes, tag) = (args.sessions, args.writes, tag.to_owned());
        tasks.push(tokio::spawn(async move {
            for w in 0..writes {
                for s in 0..sessions {
                    let session = format!("{tag}-{s}");
                    let id = format!("r{replica}-w{w}");
                    agent_turn(&client, &session, s, &id, &tally).await;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let tally = tally.lock().await;
    let client = JsonClient::new(base);
    let mut stored: Vec<Vec<String>> = Vec::new();
    for s in 0..args.sessions {
        let ids = match client
            .send(Method::GET, &format!("/v1/sessions/{tag}-{s}"), None, &[])
            .await
        {
            Ok(r) => r.json["messages"]
                .as_array()
                .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        stored.push(ids);
    }
    let lost = tally.acked.iter().filter(|(s, id)| !stored[*s].contains(id)).count();
    let duplicated = stored
        .iter()
        .map(|ids| ids.len() - ids.iter().collect::<HashSet<_>>().len())
        .sum();
    let mut lat = tally.latencies.clone();
    lat.sort();
    RunReport {
        name,
        acknowledged: tally.acked.len(),
        lost,
        duplicated,
        stale_accepted: stale_accepted(&tally.commits),
        stale_rejected: tally.stale_rejected,
        p50_ms: percentile(&lat, 0.50),
        p99_ms: percentile(&lat, 0.99),
    }
}

/// One agent turn, as agents write today: read the context, append a message for the next
/// turn, write the whole document back. Retried (re-read) when refused as stale or busy.
async fn agent_turn(client: &JsonClient, session: &str, s: usize, id: &str, tally: &Mutex<Tally>) {
    let path = format!("/v1/sessions/{session}");
    for _ in 0..50 {
        let started = Instant::now();
        let mut doc = match client.send(Method::GET, &path, None, &[]).await {
            Ok(r) if r.status == StatusCode::OK => r.json,
            Ok(r) if r.status == StatusCode::NOT_FOUND => {
                json!({"session": session, "turn": 0, "version": 0, "messages": [], "state": {}})
            }
            _ => continue,
        };
        let turn = doc["turn"].as_u64().unwrap_or(0) + 1;
        doc["turn"] = json!(turn);
        if let Some(Value::Array(messages)) = doc.get_mut("messages") {
            messages.push(json!({"id": id, "role": "assistant", "content": format!("turn {turn} by {id}")}));
        }
        match client.send(Method::PUT, &path, Some(&doc), &[]).await {
            Ok(r) if r.status.is_success() => {
                let mut t = tally.lock().await;
                t.latencies.push(started.elapsed());
                t.acked.push((s, id.to_owned()));
                t.commits.push((s, r.json["version"].as_u64().unwrap_or(0), turn));
                return;
            }
            Ok(r) if r.json["error"] == "stale_turn" => tally.lock().await.stale_rejected += 1,
            Ok(r) if r.status.is_server_error() || r.status == StatusCode::CONFLICT => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            _ => return,
        }
    }
}

/// Writes accepted although an earlier-committed write (lower version) had a newer turn: the
/// turn went backwards. Commit order is the version order, not the order answers arrived in.
fn stale_accepted(commits: &[(usize, u64, u64)]) -> usize {
    let mut sorted = commits.to_vec();
    sorted.sort();
    let mut count = 0;
    let mut i = 0;
    while i < sorted.len() {
        let session = sorted[i].0;
        let mut max_turn = 0;
        while i < sorted.len() && sorted[i].0 == session {
            let version = sorted[i].1;
            let batch_max = max_turn;
            while i < sorted.len() && sorted[i].0 == session && sorted[i].1 == version {
                if sorted[i].2 < batch_max {
                    count += 1;
                }
                max_turn = max_turn.max(sorted[i].2);
                i += 1;
            }
        }
    }
    count
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// The table the demo prints.
pub fn table(reports: &[RunReport]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<24} {:>8} {:>6} {:>11} {:>15} {:>15} {:>8} {:>8}\n",
        "writes", "acked", "lost", "duplicated", "stale accepted", "stale rejected", "p50 ms", "p99 ms"
    ));
    for r in reports {
        out.push_str(&format!(
            "{:<24} {:>8} {:>6} {:>11} {:>15} {:>15} {:>8.2} {:>8.2}\n",
            r.name, r.acknowledged, r.lost, r.duplicated, r.stale_accepted, r.stale_rejected, r.p50_ms, r.p99_ms
        ));
    }
    out
}
