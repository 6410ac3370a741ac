//! The write path behind the edge: idempotency, coalescing, and the serialized
//! read-merge-write under the session lock.
//!
//! Writes to one lock key (`session:<id>:<turn>`) that wait in this process form a queue; only
//! its leader competes for the lock. Once granted, the leader takes every queued write, reads
//! the document once, merges the writes one after another, writes the result back once under
//! the store's `If-Match`, and answers each write on its own (group commit). A write waits its
//! turn until its wait deadline (`--wait-deadline-ms`, or shorter per request), then gets
//! `session_busy`: load shedding, not the answer to ordinary contention. The leader competes
//! for the lock in rounds of `--lock-budget-ms`, answering the writes past their deadline
//! between rounds. A write that met another turn's commit (the document moved, or its commit
//! slot stayed taken) is queued again at the front, and re-read and re-merged under a later
//! grant, within its deadline.
//!
//! Writers of different turns hold different locks. Their commits of one document are
//! ordered by the document's commit slot in Redis (see `slot_take.lua`): taken before the
//! read, given back once the store answered. Every write goes through it: the order of commits
//! never rests on the store's `If-Match` alone (a store's ETag may be weak, its check not
//! atomic with the write), which is checked on top.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::answer::Answer;
use super::error::WriteError;
use super::request::{Action, WriteRequest};
use crate::lock::{Lease, LockError, Locks};
use crate::metrics::Metrics;
use crate::records::{Entry, Records};
use crate::session::{Keys, SessionId};
use crate::upstream::Upstream;

mod errors;
mod forward;
mod idempotency;
mod merge_commit;
mod once;
mod queue;
mod slot;
mod store_fields;

use self::errors::unanswered;
use self::forward::{delete_batch, serialize_batch};
use self::idempotency::Claim;
use self::merge_commit::merge_batch;
use self::queue::{lock, Pending, Queue, QueueState};

/// How many times a write re-reads the document under one grant after a concurrent writer
/// of another turn moved it.
const MAX_ATTEMPTS: u32 = 4;

/// The pause before a batch queued again after meeting another turn's commit competes again:
/// that commit is in flight, and needs a store round trip to land.
const REQUEUE_PAUSE: Duration = Duration::from_millis(2);

#[derive(Clone, Debug)]
pub struct Settings {
    /// How long a leader competes for the lock in one round (and a holder waits for another
    /// turn's commit in flight) before it steps back; also how long Redis may leave commands
    /// unanswered before a write past its deadline is told `lock_unavailable`.
    pub budget: Duration,
    /// How long a write may wait for its turn before it is answered `session_busy`.
    pub wait: Duration,
    pub idempotency_ttl: Duration,
    pub history_ttl: Duration,
    pub max_batch: usize,
    /// The store's timeout per request: an idempotency claim lives as long as its write can.
    pub upstream_timeout: Duration,
    /// The largest document a write may produce.
    pub max_document_bytes: usize,
}

#[derive(Clone)]
pub struct Pipeline {
    shared: Arc<Shared>,
}

struct Shared {
    locks: Locks,
    records: Records,
    upstream: Upstream,
    keys: Keys,
    metrics: Metrics,
    settings: Settings,
    queues: DashMap<String, Arc<Queue>>,
    /// One gate per session with a leader in this process: leaders of different turns of one
    /// session (different lock keys) take turns here instead of racing to the store and
    /// retrying on its 412s.
    gates: DashMap<SessionId, Arc<tokio::sync::Mutex<()>>>,
    tracker: TaskTracker,
    next_id: AtomicU64,
}

// === impl Pipeline ===

// === impl Pipeline ===

impl Pipeline {
    pub fn new(
        locks: Locks,
        records: Records,
        upstream: Upstream,
        keys: Keys,
        metrics: Metrics,
        settings: Settings,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                locks,
                records,
                upstream,
                keys,
                metrics,
                settings,
                queues: DashMap::new(),
                gates: DashMap::new(),
                tracker: TaskTracker::new(),
                next_id: AtomicU64::new(1),
            }),
        }
    }

    /// Waits for every write already handed to a leader (for graceful shutdown).
    pub async fn drain(&self) {
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
    }

    /// Whether no write is running (no leader task alive).
    pub fn is_idle(&self) -> bool {
        self.shared.tracker.is_empty()
    }

    /// Runs one write to its answer.
    pub async fn submit(&self, write: WriteRequest) -> Answer {
        let s = &self.shared;
        let wait = write.wait.map_or(s.settings.wait, |w| w.min(s.settings.wait));
        let deadline = Instant::now() + wait;
        let idem = write
            .idempotency
            .as_ref()
            .map(|i| (s.keys.idempotency(&write.session, &i.key_digest), i.fingerprint.clone()));
        let mut claim = None;
        if let Some((key, fingerprint)) = &idem {
            match self.claim(key, fingerprint).await {
                Claim::Held(value) => claim = Some((key.clone(), value)),
                Claim::Answered(answer) => return answer,
            }
        }
        let answer = self.enqueue(write, deadline, wait, claim.clone()).await;
        if let Some((key, value)) = &claim {
            if !answer.is_final() {
                // Not recorded: let a retry apply it. Only this request's own claim is dropped
                // (an answer recorded meanwhile stays).
                let _ = s
                    .records
                    .compare_and_set(key, value, Bytes::new(), Duration::ZERO)
                    .await;
            }
        }
        answer
    }

    async fn enqueue(
        &self,
        write: WriteRequest,
        deadline: Instant,
        wait: Duration,
        claim: Option<(String, Bytes)>,
    ) -> Answer {
        let s = &self.shared;
        let lock_key = s.keys.lock(&write.session, write.turn);
        let (queue_key, protected) = match &write.action {
            // What a write protects is named by its path on the store, not by the store's
            // address: proxies may reach one store under different names (a relay, a load
            // balancer, an IP or a host name), and must still share its commit order.
            Action::Merge { document, .. } => (format!("{lock_key} merge {document}"), document.clone()),
            Action::Delete { document, .. } => (format!("{lock_key} delete {document}"), document.clone()),
            // The resource is named by the route's path, whatever spelling the client sent.
            Action::Serialize { resource, .. } => (format!("{lock_key} serialize {resource}"), resource.clone()),
        };
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        let queue = s
            .queues
            .entry(queue_key.clone())
            .or_insert_with(|| {
                Arc::new(Queue {
                    scope: s.keys.scope(&write.session, &protected),
                    session: write.session.clone(),
                    turn: write.turn,
                    lock_key,
                    state: Mutex::new(QueueState::default()),
                })
            })
            .clone();
        let lead = {
            let mut st = lock(&queue.state);
            st.pending.push_back(Pending {
                id,
                write,
                claim,
                deadline,
                wait,
                reply: tx,
            });
            !std::mem::replace(&mut st.leading, true)
        };
        if lead {
            let shared = self.shared.clone();
            let queue = queue.clone();
            // The leader runs on its own task: a client that disconnects does not cancel a
            // write that others in its batch are waiting for.
            s.tracker
                .spawn(async move { lead_queue(shared, queue, queue_key).await });
        }
        match tokio::time::timeout_at(deadline, &mut rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Answer::from(WriteError::Internal("the write was dropped")),
            Err(_) => {
                if queue.withdraw(id) {
                    unanswered(&s.locks, s.settings.budget, wait)
                } else {
                    // Already taken into a batch under the lock: its answer is coming.
                    rx.await
                        .unwrap_or_else(|_| Answer::from(WriteError::Internal("the write was dropped")))
                }
            }
        }
    }
}

async fn lead_queue(s: Arc<Shared>, queue: Arc<Queue>, queue_key: String) {
    let fence_key = s.keys.fence_token(&queue.session);
    let mut dropped = Vec::new();
    while let Some(deadline) =
        queue.next_deadline(|waited| unanswered(&s.locks, s.settings.budget, waited), &mut dropped)
    {
        for (key, claim) in dropped.drain(..) {
            let _ = s
                .records
                .compare_and_set(&key, &claim, Bytes::new(), Duration::ZERO)
                .await;
        }
        let gate = s.gates.entry(queue.session.clone()).or_default().clone();
        let Ok(_turn) = tokio::time::timeout_at(deadline, gate.lock_owned()).await else {
            continue;
        };
        // One round: the writes past their deadline are answered between rounds, and the
        // session's other turns waiting at the gate get their turn.
        let round = deadline.min(Instant::now() + s.settings.budget);
        match s.locks.acquire(&queue.lock_key, &fence_key, round, &s.metrics).await {
            Err(LockError::Busy(_)) => continue,
            Err(LockError::Backend(e)) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("lock backend unavailable") {
                    tracing::warn!(lock = %queue.lock_key, error = %e, suppressed, "lock backend unavailable");
                }
                queue.fail_all(&Answer::from(WriteError::LockUnavailable(format!(
                    "the lock backend is unavailable: {e}"
                ))));
            }
            Ok(lease) => {
                let batch = queue.take(s.settings.max_batch);
                if batch.is_empty() {
                    lease.release(&s.metrics).await;
                    continue;
                }
                s.metrics.batch(batch.len());
                let span = tracing::info_span!(
                    "write",
                    session = %queue.session,
                    turn = queue.turn,
                    fence = lease.fence(),
                    batch = batch.len(),
                    outcome = tracing::field::Empty,
                );
                let (answers, records, again) = commit(&s, &queue, &lease, &batch).instrument(span.clone()).await;
                let ok = answers.iter().filter(|a| a.status.is_success()).count();
                span.record(
                    "outcome",
                    if ok == answers.len() {
                        "ok"
                    } else if ok == 0 {
                        "refused"
                    } else {
                        "partial"
                    },
                );
                span.in_scope(|| tracing::debug!(ok, "batch committed"));
                // The records go before the lock: with Redis, in the release's own round trip.
                if s.locks.carries_records() {
                    lease.release_with(&s.metrics, records).await;
                } else {
                    if let Err(e) = s.records.put_entries(records).await {
                        tracing::warn!(error = %e, "idempotency records and version snapshot not stored");
                    }
                    lease.release(&s.metrics).await;
                }
                let mut retry = Vec::new();
                for ((p, a), again) in batch.into_iter().zip(answers).zip(again) {
                    if again {
                        retry.push(p);
                    } else {
                        let _ = p.reply.send(a);
                    }
                }
                if !retry.is_empty() {
                    s.metrics.requeued(retry.len());
                    queue.requeue(retry);
                    tokio::time::sleep(REQUEUE_PAUSE).await;
                }
            }
        }
    }
    s.queues.remove_if(&queue_key, |_, q| q.is_idle());
    // The gate goes when no leader holds or waits for it (only this map's reference is left).
    s.gates.remove_if(&queue.session, |_, g| Arc::strong_count(g) == 1);
}

/// Everything done under one grant: the read-merge-write (or the serialized forwards). Returns
/// one answer per write, in order, the records to store before the lock is released (the
/// version snapshot of what was written, the idempotency results), and which writes are to be
/// queued again instead of answered (see [`conflicted`]).
async fn commit(s: &Shared, queue: &Queue, lease: &Lease, batch: &[Pending]) -> (Vec<Answer>, Vec<Entry>, Vec<bool>) {
    let mut records = Vec::new();
    let answers = match &batch[0].write.action {
        Action::Merge { document, .. } => merge_batch(s, queue, lease, batch, document, &mut records).await,
        Action::Serialize { .. } => serialize_batch(s, queue, lease, batch).await,
        Action::Delete { document, .. } => delete_batch(s, queue, lease, batch, document).await,
    };
    let now = Instant::now();
    let again: Vec<bool> = batch
        .iter()
        .zip(&answers)
        .map(|(p, a)| p.deadline > now + REQUEUE_PAUSE && conflicted(a))
        .collect();
    let settled = batch
        .iter()
        .zip(&answers)
        .zip(&again)
        .filter(|(_, again)| !**again)
        .map(|(pa, _)| pa);
    records.extend(idempotency::results(s, settled));
    (answers, records, again)
}

/// Whether an answer says that another turn's commit came first (`write_conflict`: the
/// document moved past every re-read, or its commit slot stayed taken). Nothing was written
/// for such a write: it is queued again, to be re-read and re-merged under a later grant.
fn conflicted(a: &Answer) -> bool {
    a.status == http::StatusCode::SERVICE_UNAVAILABLE && a.code() == "write_conflict"
}
