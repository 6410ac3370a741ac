//! Tools of the fault tests: concurrent writers that keep a ledger of what they were told, and
//! an independent checker that reads the final documents straight from the store.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnlock::client::JsonClient;

use crate::support::try_append;

/// Status of `/readyz` on an admin address (0 when it does not answer).
pub async fn readyz(admin: SocketAddr) -> u16 {
    let c = JsonClient::new(format!("http://{admin}"));
    match tokio::time::timeout(Duration::from_secs(3), c.send(http::Method::GET, "/readyz", None, &[])).await {
        Ok(Ok(r)) => r.status.as_u16(),
        _ => 0,
    }
}

/// What `/status` says of a dependency (`redis`, `store`): `Some(up)` after its first
/// background check, `None` before it or when the admin server does not answer.
pub async fn dependency_up(admin: SocketAddr, dependency: &str) -> Option<bool> {
    let c = JsonClient::new(format!("http://{admin}"));
    match tokio::time::timeout(Duration::from_secs(3), c.send(http::Method::GET, "/status", None, &[])).await {
        Ok(Ok(r)) => r.json["dependencies"][dependency]["up"].as_bool(),
        _ => None,
    }
}

/// One acknowledged write.
#[derive(Clone, Debug)]
pub struct Ack {
    pub session: String,
    pub token: String,
    pub write_turn: u64,
    pub version: u64,
}

/// What the writers sent and what they were told.
#[derive(Default)]
pub struct Ledger {
    acked: Mutex<Vec<Ack>>,
    /// Writes whose outcome the client does not know (5xx, cut connections): each may appear
    /// at most once.
    unknown: Mutex<Vec<(String, String)>>,
    pub stale_refused: AtomicUsize,
    pub statuses: Mutex<HashMap<u16, usize>>,
}

impl Ledger {
    pub fn ack(&self, session: &str, token: &str, write_turn: u64, reply: &Value) {
        self.acked.lock().expect("ledger").push(Ack {
            session: session.to_owned(),
            token: token.to_owned(),
            write_turn,
            version: reply["version"].as_u64().unwrap_or(0),
        });
    }

    pub fn unknown(&self, session: &str, token: &str) {
        self.unknown
            .lock()
            .expect("ledger")
            .push((session.to_owned(), token.to_owned()));
    }

    pub fn status(&self, status: u16) {
        *self.statuses.lock().expect("ledger").entry(status).or_default() += 1;
    }

    pub fn acked(&self) -> Vec<Ack> {
        self.acked.lock().expect("ledger").clone()
    }

    pub fn acked_count(&self) -> usize {
        self.acked.lock().expect("ledger").len()
    }
}

/// Concurrent writers appending to a set of sessions, each write a unique token, sometimes
/// advancing the session's turn.
pub struct Writers {
    pub ledger: Arc<Ledger>,
    pub stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    /// `per_task` writes at the most, each task stops at `stop` or `deadline`.
    pub fn start(
        tag: &str,
        clients: Vec<JsonClient>,
        sessions: Vec<String>,
        tasks: usize,
        per_task: usize,
        deadline: Duration,
    ) -> Self {
        let ledger = Arc::new(Ledger::default());
        let stop = CancellationToken::new();
        let turns: Arc<Vec<AtomicU64>> = Arc::new(sessions.iter().map(|_| AtomicU64::new(1)).collect());
        let sessions = Arc::new(sessions);
        let until = Instant::now() + deadline;
        let tasks = (0..tasks)
            .map(|i| {
                let client = clients[i % clients.len()].clone();
                let (ledger, stop, turns, sessions) = (ledger.clone(), stop.clone(), turns.clone(), sessions.clone());
                let tag = tag.to_owned();
                tokio::spawn(async move {
                    for n in 0..per_task {
                        if stop.is_cancelled() || Instant::now() >= until {
                            return;
                        }
                        let j = (rand::random::<u32>() as usize) % sessions.len();
                        let session = &sessions[j];
                        let mut turn = turns[j].load(Ordering::SeqCst);
                        if rand::random::<u8>() % 8 == 0 {
                            turn += 1;
                            turns[j].fetch_max(turn, Ordering::SeqCst);
                        }
                        let token = format!("{tag}-{i}-{n}");
                        record(
                            &ledger,
                            &turns[j],
                            session,
                            turn,
                            &token,
                            try_append(&client, session, turn, &token, true, &[]).await,
                        );
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            })
            .collect();
        Self { ledger, stop, tasks }
    }

    /// Stops the writers and waits for them.
    pub async fn finish(self) -> Arc<Ledger> {
        self.stop.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
        self.ledger
    }
}

/// Files one write's outcome in the ledger.
pub fn record(
    ledger: &Ledger,
    turn_hint: &AtomicU64,
    session: &str,
    turn: u64,
    token: &str,
    result: Result<turnlock::client::Reply, String>,
) {
    match result {
        Ok(r) if r.status.is_success() => {
            ledger.status(r.status.as_u16());
            ledger.ack(session, token, turn, &r.json);
        }
        Ok(r) if r.json["error"] == "stale_turn" => {
            ledger.status(r.status.as_u16());
            ledger.stale_refused.fetch_add(1, Ordering::SeqCst);
            if let Some(current) = r.json["current_turn"].as_u64() {
                turn_hint.fetch_max(current, Ordering::SeqCst);
            }
        }
        Ok(r) => {
            ledger.status(r.status.as_u16());
            ledger.unknown(session, token);
        }
        Err(_) => {
            ledger.status(0);
            ledger.unknown(session, token);
        }
    }
}

/// What the checker found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub acknowledged: usize,
    pub lost: usize,
    pub duplicated: usize,
    pub stale_accepted: usize,
    pub turn_regressions: usize,
    pub unexplained: usize,
}

impl Counts {
    pub fn clean(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.stale_accepted == 0
            && self.turn_regressions == 0
            && self.unexplained == 0
    }
}

/// Reads every session's final document straight from the store and checks the ledger
/// against it: every acknowledged message exactly once, no message twice, no acknowledged write
/// whose turn was below a turn already accepted, the stored turn at least every acknowledged
/// turn, and nothing stored that no writer sent.
pub async fn check(store: SocketAddr, sessions: &[String], ledgers: &[&Ledger]) -> Counts {
    let store = JsonClient::new(format!("http://{store}"));
    let mut counts = Counts::default();
    let mut acked: Vec<Ack> = ledgers.iter().flat_map(|l| l.acked()).collect();
    let unknown: Vec<(String, String)> = ledgers
        .iter()
        .flat_map(|l| l.unknown.lock().expect("ledger").clone())
        .collect();
    counts.acknowledged = acked.len();
    for session in sessions {
        let reply = store
            .send(http::Method::GET, &format!("/v1/sessions/{session}"), None, &[])
            .await
            .expect("read the final document from the store");
        let doc = if reply.status == http::StatusCode::NOT_FOUND {
            json!({"turn": 0, "messages": []})
        } else {
            assert!(
                reply.status.is_success(),
                "store answered {} for {session}",
                reply.status
            );
            reply.json
        };
        let mut seen: HashMap<String, usize> = HashMap::new();
        let messages = doc["messages"].as_array().cloned().unwrap_or_default();
        // Messages are appended in the order writes were accepted: their turns never go down.
        let turns: Vec<u64> = messages.iter().filter_map(|m| m["turn"].as_u64()).collect();
        counts.turn_regressions += turns.windows(2).filter(|w| w[1] < w[0]).count();
        for m in messages {
            let token = m["content"].as_str().unwrap_or_default().to_owned();
            *seen.entry(token).or_default() += 1;
        }
        counts.duplicated += seen.values().filter(|&&n| n > 1).map(|n| n - 1).sum::<usize>();
        let mine: Vec<&Ack> = acked.iter().filter(|a| &a.session == session).collect();
        counts.lost += mine.iter().filter(|a| !seen.contains_key(&a.token)).count();
        let known = |t: &str| mine.iter().any(|a| a.token == t) || unknown.iter().any(|(s, u)| s == session && u == t);
        counts.unexplained += seen.keys().filter(|t| !known(t)).count();
        let stored_turn = doc["turn"].as_u64().unwrap_or(0);
        if mine.iter().any(|a| a.write_turn > stored_turn) {
            counts.turn_regressions += 1;
        }
    }
    // Accepted below a turn already accepted: order the acknowledgements by the version they
    // produced; a later version may never carry an older turn.
    acked.sort_by(|a, b| (&a.session, a.version).cmp(&(&b.session, b.version)));
    let mut highest: HashMap<&str, (u64, u64)> = HashMap::new();
    for a in &acked {
        let e = highest.entry(&a.session).or_insert((0, 0));
        if a.version > e.0 && a.write_turn < e.1 {
            counts.stale_accepted += 1;
            eprintln!(
                "stale write accepted: {a:?} after turn {} was accepted at version {}",
                e.1, e.0
            );
        }
        if a.version > e.0 {
            e.0 = a.version;
        }
        e.1 = e.1.max(a.write_turn);
    }
    counts
}

/// Prints the counts of one fault run and files them under the target directory, so the
/// figures in the documentation come from a run.
pub fn report(fault: &str, counts: &Counts) {
    let line = json!({
        "fault": fault,
        "acknowledged": counts.acknowledged,
        "lost": counts.lost,
        "duplicated": counts.duplicated,
        "stale_accepted": counts.stale_accepted,
        "turn_regressions": counts.turn_regressions,
        "unexplained": counts.unexplained,
    });
    eprintln!("FAULT-COUNTS {line}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fault-counts.jsonl");
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{line}");
    }
}

/// Session ids for one test.
pub fn sessions(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

/// Polls `f` every `every` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, every: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while started.elapsed() < timeout {
        if f().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(every).await;
    }
    None
}

/// A counter shared by a test's helpers.
pub fn counter() -> Arc<AtomicU64> {
    Arc::new(AtomicU64::new(0))
}
