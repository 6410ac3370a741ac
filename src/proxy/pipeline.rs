//! The write path behind the edge: idempotency, coalescing, and the serialized
//! read-merge-write under the session lock.
//!
//! Writes to one lock key (`session:<id>:<turn>`) that wait in this process form a queue; only
//! its leader competes for the lock. Once granted, the leader takes every queued write, reads
//! the document once, merges the writes one after another, writes the result back once under
//! the store's `If-Match`, and answers each write on its own (group commit). A write waits at
//! most its budget for the lock, then gets `session_busy`.
//!
//! Writers of different turns hold different locks. Their commits of one document are
//! ordered by the document's commit slot in Redis (see `slot_take.lua`): taken before the
//! read, given back once the store answered. Every serialized write and every merge write to
//! a store without ETags goes through it; with a store that answers ETags, `If-Match` orders
//! merge writes and the slot is skipped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use http::header::{self, HeaderValue};
use http::{Request, StatusCode};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::answer::{Answer, Record};
use super::request::{Action, WriteRequest};
use crate::http::{etag_for, full, strip_hop_by_hop};
use crate::lock::{Lease, LockError, Locks, Settled, Slot};
use crate::merge::{self, Document, MergeError, Op, RandomIds, Snapshot};
use crate::metrics::Metrics;
use crate::records::{Entry, Records};
use crate::session::{is_stale, Keys, Scope, SessionId};
use crate::upstream::{Precondition, Upstream, UpstreamError, FENCING_TOKEN};

/// How many times a write re-reads the document under one grant after a concurrent writer
/// of another turn moved it.
const MAX_ATTEMPTS: u32 = 4;

#[derive(Clone, Debug)]
pub struct Settings {
    pub budget: Duration,
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
    /// Set once the store answered a read with an ETag: its `If-Match` then orders merge
    /// writes, and they skip the commit slot.
    etags_seen: AtomicBool,
}

struct Queue {
    session: SessionId,
    turn: u64,
    lock_key: String,
    /// The keys of what the queue's writes protect: the document, or the serialize route.
    scope: Scope,
    state: Mutex<QueueState>,
}

#[derive(Default)]
struct QueueState {
    pending: VecDeque<Pending>,
    leading: bool,
}

struct Pending {
    id: u64,
    write: WriteRequest,
    /// The idempotency record's key and the claim it holds, when the write has a key.
    claim: Option<(String, Bytes)>,
    deadline: Instant,
    reply: oneshot::Sender<Answer>,
}

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
                etags_seen: AtomicBool::new(false),
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
        let deadline = Instant::now() + s.settings.budget;
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
        let answer = self.enqueue(write, deadline, claim.clone()).await;
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

    /// How long a claim lives: as long as its write can still run (the wait for the lock,
    /// every store round trip of every attempt, the lease's slack), plus a margin.
    fn claim_ttl(&self) -> Duration {
        let s = &self.shared;
        let round_trips = 2 * (MAX_ATTEMPTS + 1);
        s.locks.settings().lease * 2
            + s.settings.budget
            + s.settings.upstream_timeout * round_trips
            + Duration::from_secs(10)
    }

    /// Claims an idempotency key (returning the claim stored), or answers from its record.
    async fn claim(&self, key: &str, fingerprint: &str) -> Claim {
        let s = &self.shared;
        let claim_ttl = self.claim_ttl();
        for _ in 0..2 {
            match s.records.get(key).await {
                Err(e) => return Claim::Answered(Answer::retryable("lock_unavailable", e)),
                Ok(Some(bytes)) => {
                    let Some(record) = Record::parse(&bytes) else {
                        return Claim::Answered(Answer::retryable(
                            "idempotency_record_unreadable",
                            "the idempotency record could not be read",
                        ));
                    };
                    if record.fingerprint != fingerprint {
                        return Claim::Answered(Answer::error(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "idempotency_key_reused",
                            "this Idempotency-Key was used for a different request",
                            None,
                        ));
                    }
                    return Claim::Answered(match record.done {
                        Some(stored) => {
                            s.metrics.idempotent_replay();
                            stored.answer().with_header(
                                http::HeaderName::from_static("idempotent-replayed"),
                                HeaderValue::from_static("true"),
                            )
                        }
                        None => Answer::retryable(
                            "request_in_progress",
                            "a request with this Idempotency-Key is in progress",
                        ),
                    });
                }
                Ok(None) => {
                    let claim = Record::pending(fingerprint);
                    match s.records.put_new(key, claim.clone(), claim_ttl).await {
                        Ok(true) => return Claim::Held(claim),
                        Ok(false) => continue,
                        Err(e) => return Claim::Answered(Answer::retryable("lock_unavailable", e)),
                    }
                }
            }
        }
        Claim::Answered(Answer::retryable(
            "request_in_progress",
            "a request with this Idempotency-Key is in progress",
        ))
    }

    async fn enqueue(&self, write: WriteRequest, deadline: Instant, claim: Option<(String, Bytes)>) -> Answer {
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
            Ok(Err(_)) => Answer::error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the write was dropped",
                None,
            ),
            Err(_) => {
                if queue.withdraw(id) {
                    unanswered(&s.locks, s.settings.budget)
                } else {
                    // Already taken into a batch under the lock: its answer is coming.
                    rx.await.unwrap_or_else(|_| {
                        Answer::error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal",
                            "the write was dropped",
                            None,
                        )
                    })
                }
            }
        }
    }
}

/// The outcome of claiming an idempotency key.
enum Claim {
    /// This request holds the key: the claim's exact value, to replace or drop it later only
    /// while it still holds.
    Held(Bytes),
    /// Answered from the key's record (a replay, a reuse with another payload, in progress).
    Answered(Answer),
}

/// The answer to a write whose budget ran out: `lock_unavailable` when Redis left its
/// commands unanswered all that time (a hung server is not contention), else `session_busy`.
fn unanswered(locks: &Locks, budget: Duration) -> Answer {
    if locks.stalled(budget / 2) {
        Answer::retryable(
            "lock_unavailable",
            format!("the lock backend did not answer within {} ms", budget.as_millis()),
        )
    } else {
        busy(budget)
    }
}

fn busy(budget: Duration) -> Answer {
    Answer::retryable(
        "session_busy",
        format!("the session's lock was not obtained within {} ms", budget.as_millis()),
    )
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// === impl Queue ===

impl Queue {
    fn withdraw(&self, id: u64) -> bool {
        let mut st = lock(&self.state);
        let before = st.pending.len();
        st.pending.retain(|p| p.id != id);
        st.pending.len() != before
    }

    /// The latest deadline among the waiting writes, answering `busy` (or `lock_unavailable`
    /// when Redis is what kept them waiting) to those already past theirs; `None` (and the leader resigns) when nothing waits.
    /// The claims of the writes answered `busy` are added to `dropped`: nothing was written
    /// for them, and their clients may be gone.
    fn next_deadline(&self, locks: &Locks, budget: Duration, dropped: &mut Vec<(String, Bytes)>) -> Option<Instant> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        let (due, keep): (VecDeque<Pending>, VecDeque<Pending>) = st.pending.drain(..).partition(|p| p.deadline <= now);
        st.pending = keep;
        for p in due {
            dropped.extend(p.claim);
            let _ = p.reply.send(unanswered(locks, budget));
        }
        let latest = st.pending.iter().map(|p| p.deadline).max();
        if latest.is_none() {
            st.leading = false;
        }
        latest
    }

    fn take(&self, max: usize) -> Vec<Pending> {
        let mut st = lock(&self.state);
        let n = st.pending.len().min(max);
        st.pending.drain(..n).collect()
    }

    fn fail_all(&self, answer: &Answer) {
        let mut st = lock(&self.state);
        for p in st.pending.drain(..) {
            let _ = p.reply.send(answer.clone());
        }
    }

    fn is_idle(&self) -> bool {
        let st = lock(&self.state);
        st.pending.is_empty() && !st.leading
    }
}

async fn lead_queue(s: Arc<Shared>, queue: Arc<Queue>, queue_key: String) {
    let fence_key = s.keys.fence_token(&queue.session);
    let mut dropped = Vec::new();
    while let Some(deadline) = queue.next_deadline(&s.locks, s.settings.budget, &mut dropped) {
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
        match s.locks.acquire(&queue.lock_key, &fence_key, deadline, &s.metrics).await {
            Err(LockError::Busy(_)) => continue,
            Err(LockError::Backend(e)) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("lock backend unavailable") {
                    tracing::warn!(lock = %queue.lock_key, error = %e, suppressed, "lock backend unavailable");
                }
                queue.fail_all(&Answer::retryable(
                    "lock_unavailable",
                    format!("the lock backend is unavailable: {e}"),
                ));
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
                let (answers, records) = commit(&s, &queue, &lease, &batch).instrument(span.clone()).await;
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
                for (p, a) in batch.into_iter().zip(answers) {
                    let _ = p.reply.send(a);
                }
            }
        }
    }
    s.queues.remove_if(&queue_key, |_, q| q.is_idle());
    // The gate goes when no leader holds or waits for it (only this map's reference is left).
    s.gates.remove_if(&queue.session, |_, g| Arc::strong_count(g) == 1);
}

/// Everything done under one grant: the read-merge-write (or the serialized forwards). Returns
/// one answer per write, in order, and the records to store before the lock is released (the
/// version snapshot of what was written, the idempotency results).
async fn commit(s: &Shared, queue: &Queue, lease: &Lease, batch: &[Pending]) -> (Vec<Answer>, Vec<Entry>) {
    let mut records = Vec::new();
    let answers = match &batch[0].write.action {
        Action::Merge { document, .. } => merge_batch(s, queue, lease, batch, document, &mut records).await,
        Action::Serialize { .. } => serialize_batch(s, queue, lease, batch).await,
        Action::Delete { document, .. } => delete_batch(s, queue, lease, batch, document).await,
    };
    records.extend(batch.iter().zip(&answers).filter_map(|(p, a)| {
        let idem = p.write.idempotency.as_ref()?;
        let (key, claim) = p.claim.clone()?;
        // A serialized write whose outcome is unknown cannot be made idempotent by turnlock
        // (the store's own write is forwarded as is): its 504 is the answer a retry gets.
        let unknown = matches!(p.write.action, Action::Serialize { .. }) && a.status == StatusCode::GATEWAY_TIMEOUT;
        let value = if a.is_final() || unknown {
            Record::done(&idem.fingerprint, a)?
        } else {
            // Nothing recorded: a retry may apply it (even if this client is gone).
            Bytes::new()
        };
        Some(Entry {
            key,
            value,
            ttl: s.settings.idempotency_ttl,
            expect: Some(claim),
        })
    }));
    (answers, records)
}

async fn merge_batch(
    s: &Shared,
    queue: &Queue,
    lease: &Lease,
    batch: &[Pending],
    path: &str,
    records: &mut Vec<Entry>,
) -> Vec<Answer> {
    let mut slot = SlotHold::new(queue.scope.clone());
    let (answers, outcome_unknown) = merge_attempts(s, queue, lease, batch, path, records, &mut slot).await;
    // When the outcome is unknown the slot is left to expire: the write may still land, and
    // no commit of this document is ordered after it until then.
    if !outcome_unknown {
        slot.release(s, lease, Settled::Unchanged).await;
    }
    answers
}

#[allow(clippy::too_many_arguments)]
async fn merge_attempts(
    s: &Shared,
    queue: &Queue,
    lease: &Lease,
    batch: &[Pending],
    path: &str,
    records: &mut Vec<Entry>,
    slot: &mut SlotHold,
) -> (Vec<Answer>, bool) {
    let started = Instant::now();
    let session = &queue.session;
    let mut attempt = 0;
    let mut force_slot = false;
    loop {
        attempt += 1;
        // Without ETags the document is read under its commit slot: what is read is then the
        // latest commit (or what the store holds after a change made behind turnlock's back,
        // such as a delete), and nothing is committed between this read and this write.
        if force_slot || !s.etags_seen.load(Ordering::Relaxed) {
            if let Err(answer) = slot.hold(s, lease).await {
                return (vec![answer; batch.len()], false);
            }
        }
        let fetched = match s.upstream.get_document(path).await {
            Ok(f) => f,
            Err(e) => return (vec![upstream_answer(&e); batch.len()], false),
        };
        if fetched.etag.is_some() {
            s.etags_seen.store(true, Ordering::Relaxed);
        } else if fetched.doc.is_some() && !slot.held() {
            // A document without an ETag from a store that gave them: read again under the slot.
            force_slot = true;
            continue;
        }
        let current = fetched.doc;
        let current_version = current.as_ref().map(merge::version_of).unwrap_or(0);
        let bases = load_bases(s, &queue.scope, batch, current.as_ref()).await;
        let (doc, results) = apply_batch(session, current.as_ref(), batch, &bases);
        let refusals = |results: Vec<Result<merge::Applied, MergeError>>, on_ok: &Answer| -> Vec<Answer> {
            results
                .into_iter()
                .map(|r| match r {
                    Ok(_) => on_ok.clone(),
                    Err(e) => merge_refusal(s, &e),
                })
                .collect()
        };
        let Some(mut next) = doc.filter(|_| results.iter().any(Result::is_ok)) else {
            let on_ok = Answer::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "nothing to write", None);
            return (refusals(results, &on_ok), false);
        };
        // The slot must outlive the write-back: extended when the read took long.
        if slot.held() {
            if let Err(answer) = slot.hold(s, lease).await {
                return (refusals(results, &answer), false);
            }
        }
        if !lease.check() {
            return (refusals(results, &lease_lost()), false);
        }
        // One write-back: the whole batch is one new version, whatever it merged.
        let new_version = current_version + 1;
        next.insert("version".into(), json!(new_version));
        // A document gets its life when turnlock first writes it (see `merge::LIFE`).
        next.entry(merge::LIFE).or_insert_with(|| json!(lease.fence()));
        let precondition = match (&current, fetched.etag) {
            (None, _) => Precondition::Absent,
            (Some(_), Some(tag)) => Precondition::IfMatch(tag),
            (Some(_), None) => Precondition::None,
        };
        let body = Bytes::from(serde_json::to_vec(&next).unwrap_or_default());
        if body.len() > s.settings.max_document_bytes {
            return (
                refusals(results, &too_large_document(body.len(), s.settings.max_document_bytes)),
                false,
            );
        }
        match s.upstream.put_document(path, body, &precondition, lease.fence()).await {
            Ok(etag) => {
                records.push(Entry {
                    key: queue.scope.history(new_version),
                    value: Bytes::from(serde_json::to_vec(&Snapshot::of(&next)).unwrap_or_default()),
                    ttl: s.settings.history_ttl,
                    expect: None,
                });
                let status = if current.is_none() {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                let etag = etag.unwrap_or_else(|| etag_for(new_version));
                let turn = merge::turn_of(&next);
                let answers = results
                    .into_iter()
                    .map(|r| match r {
                        Ok(applied) => Answer::json(
                            status,
                            &json!({"session": session.as_str(), "turn": turn, "version": new_version, "message_ids": applied.message_ids}),
                        )
                        .with_header(header::ETAG, etag.clone()),
                        Err(e) => merge_refusal(s, &e),
                    })
                    .collect();
                return (answers, false);
            }
            Err(UpstreamError::PreconditionFailed) => {
                // Decided now, not before the write-back: a re-read must start within the lease.
                if attempt < MAX_ATTEMPTS && started.elapsed() < s.locks.settings().lease / 2 {
                    continue;
                }
                return (refusals(results, &write_conflict()), false);
            }
            Err(e) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("write-back failed") {
                    tracing::warn!(error = %e, suppressed, "write-back to the context store failed");
                }
                return (refusals(results, &upstream_answer(&e)), e.outcome_unknown());
            }
        }
    }
}

fn lease_lost() -> Answer {
    Answer::retryable(
        "lease_lost",
        "the lock's lease was lost before the write; nothing was written",
    )
}

fn write_conflict() -> Answer {
    Answer::retryable(
        "write_conflict",
        "a concurrent write of another turn kept moving the session; retry",
    )
}

/// A writer's hold on a document's commit slot.
struct SlotHold {
    scope: Scope,
    /// When the slot was last taken or extended by this writer.
    since: Option<Instant>,
    /// The document's turn mark, as read when the slot was last taken.
    turn_mark: u64,
}

impl SlotHold {
    fn new(scope: Scope) -> Self {
        Self {
            scope,
            since: None,
            turn_mark: 0,
        }
    }

    fn held(&self) -> bool {
        self.since.is_some()
    }

    /// Takes the slot, or extends it when it was taken more than half a lease ago, so that
    /// it outlives a write-back started now (the slot lives the store timeout plus a lease).
    /// Waits for another writer's commit in flight for half a lease at the most.
    async fn hold(&mut self, s: &Shared, lease: &Lease) -> Result<(), Answer> {
        let half = s.locks.settings().lease / 2;
        if self.since.is_some_and(|t| t.elapsed() < half) {
            return Ok(());
        }
        let give_up = Instant::now() + half;
        let mut pause = Duration::from_millis(1);
        loop {
            let sent = Instant::now();
            match s.locks.take_slot(lease, &self.scope).await {
                Ok(Slot::Taken { turn_mark }) => {
                    self.since = Some(sent);
                    self.turn_mark = turn_mark;
                    return Ok(());
                }
                Ok(Slot::LeaseLost) => return Err(lease_lost()),
                Ok(Slot::InFlight { remaining }) => {
                    let now = Instant::now();
                    if now >= give_up {
                        return Err(Answer::retryable(
                            "write_conflict",
                            "a write of another turn to this document is in flight; retry",
                        ));
                    }
                    tokio::time::sleep(pause.min(remaining).min(give_up - now)).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                Err(e) => return Err(Answer::retryable("lock_unavailable", e)),
            }
        }
    }

    /// Gives the slot back (when held), recording what the store did. A failure is logged:
    /// the slot then expires by itself, and nothing is lost, but the document waits for it.
    async fn release(&mut self, s: &Shared, lease: &Lease, settled: Settled) {
        if self.since.take().is_none() {
            return;
        }
        match s.locks.release_slot(lease, &self.scope, settled).await {
            Ok(true) => {}
            Ok(false) => tracing::error!(
                slot = %self.scope.slot(),
                "the write-back outlived its commit slot: a write of another turn may have been ordered before it landed"
            ),
            Err(error) => tracing::warn!(
                slot = %self.scope.slot(),
                %error,
                "commit slot not given back; the document's next write waits until it expires"
            ),
        }
    }
}

/// Applies a batch's writes one after another to the current document. Consecutive appends
/// are merged as one (the document is copied once for them, not once per write), each write
/// still getting its own result.
fn apply_batch(
    session: &SessionId,
    current: Option<&Document>,
    batch: &[Pending],
    bases: &HashMap<u64, Snapshot>,
) -> (Option<Document>, Vec<Result<merge::Applied, MergeError>>) {
    // `None` until a write applies: the current document is not copied before then.
    let mut doc: Option<Document> = None;
    let mut results = Vec::with_capacity(batch.len());
    let mut i = 0;
    while i < batch.len() {
        let turn = batch[i].write.turn;
        let run = batch[i..]
            .iter()
            .take_while(|p| {
                p.write.turn == turn
                    && matches!(
                        &p.write.action,
                        Action::Merge {
                            op: Op::Append { .. },
                            ..
                        }
                    )
            })
            .count();
        if run > 1 {
            let mut counts = Vec::with_capacity(run);
            let mut messages = Vec::new();
            for p in &batch[i..i + run] {
                if let Action::Merge {
                    op: Op::Append { messages: m },
                    ..
                } = &p.write.action
                {
                    counts.push(m.len());
                    messages.extend(m.iter().cloned());
                }
            }
            let on = doc.as_ref().or(current);
            match merge::apply(session, on, turn, &Op::Append { messages }, None, &mut RandomIds) {
                Ok((next, applied)) => {
                    doc = Some(next);
                    let mut ids = applied.message_ids.into_iter();
                    for n in counts {
                        results.push(Ok(merge::Applied {
                            message_ids: ids.by_ref().take(n).collect(),
                        }));
                    }
                }
                Err(e) => results.extend((0..run).map(|_| Err(e.clone()))),
            }
            i += run;
            continue;
        }
        let p = &batch[i];
        i += 1;
        let Action::Merge { op, .. } = &p.write.action else {
            results.push(Err(MergeError::NotFound));
            continue;
        };
        let base = match op {
            Op::Put {
                base_version: Some(v), ..
            } => bases.get(v),
            _ => None,
        };
        match merge::apply(
            session,
            doc.as_ref().or(current),
            p.write.turn,
            op,
            base,
            &mut RandomIds,
        ) {
            Ok((next, applied)) => {
                doc = Some(next);
                results.push(Ok(applied));
            }
            Err(e) => results.push(Err(e)),
        }
    }
    (doc, results)
}

/// The snapshots of the versions that merged PUTs in the batch were based on. The current
/// version's is among them: a PUT that follows another write in the same batch no longer
/// finds its base as the document it is applied to. A base newer than the current document
/// cannot be of its present life (it was read before a delete, and stores may reuse version
/// numbers): its snapshot is never loaded, and the PUT is refused as based on an unknown
/// version.
async fn load_bases(
    s: &Shared,
    scope: &Scope,
    batch: &[Pending],
    current: Option<&Document>,
) -> HashMap<u64, Snapshot> {
    let current_version = current.map(merge::version_of).unwrap_or(0);
    let mut bases = HashMap::new();
    for p in batch {
        if let Action::Merge {
            op: Op::Put {
                base_version: Some(v), ..
            },
            ..
        } = &p.write.action
        {
            let v = *v;
            if v == 0 || v > current_version || bases.contains_key(&v) {
                continue;
            }
            if v == current_version {
                if let Some(doc) = current {
                    bases.insert(v, Snapshot::of(doc));
                }
                continue;
            }
            if let Ok(Some(bytes)) = s.records.get(&scope.history(v)).await {
                if let Ok(snap) = serde_json::from_slice::<Snapshot>(&bytes) {
                    bases.insert(v, snap);
                }
            }
        }
    }
    bases
}

fn merge_refusal(s: &Shared, e: &MergeError) -> Answer {
    let (status, extra) = match e {
        MergeError::StaleTurn { current, .. } => {
            s.metrics.stale_rejected();
            (StatusCode::CONFLICT, Some(json!({"current_turn": current})))
        }
        MergeError::Conflict { fields } => (StatusCode::CONFLICT, Some(json!({"fields": fields}))),
        MergeError::MessageConflict { ids } => (StatusCode::CONFLICT, Some(json!({"message_ids": ids}))),
        MergeError::BaseUnknown { base } => (StatusCode::CONFLICT, Some(json!({"base_version": base}))),
        MergeError::VersionMismatch { current, .. } => (
            StatusCode::PRECONDITION_FAILED,
            Some(json!({"current_version": current})),
        ),
        MergeError::UnknownThrough { .. } => (StatusCode::CONFLICT, None),
        MergeError::NotFound => (StatusCode::NOT_FOUND, None),
        MergeError::VersionRequired => (StatusCode::PRECONDITION_REQUIRED, None),
        MergeError::PreviousLife => (StatusCode::CONFLICT, Some(json!({"fields": [merge::LIFE]}))),
    };
    Answer::error(status, e.code(), e, extra)
}

/// A write that would make the document larger than the limit: a 4xx, since a retry of it can
/// never pass.
fn too_large_document(size: usize, limit: usize) -> Answer {
    Answer::error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "document_too_large",
        format!("the document would be {size} bytes, over the limit of {limit} bytes; nothing was written"),
        Some(json!({"size": size, "limit": limit})),
    )
}

fn upstream_answer(e: &UpstreamError) -> Answer {
    if let UpstreamError::Status { status, .. } = e {
        if *status == StatusCode::PAYLOAD_TOO_LARGE {
            return Answer::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "document_too_large",
                "the context store refused the document as too large (413); nothing was written",
                Some(json!({"upstream_status": 413})),
            );
        }
    }
    let extra = match e {
        UpstreamError::Status { status, .. } => Some(json!({"upstream_status": status.as_u16()})),
        _ => None,
    };
    let message = if e.outcome_unknown() {
        format!(
            "{e}; the outcome is unknown: the write may have been applied. A retry with the same \
             Idempotency-Key does not apply it twice"
        )
    } else {
        format!("{e}; nothing was written by this request")
    };
    let answer = Answer::error(e.status(), e.code(), message, extra);
    if matches!(e, UpstreamError::FencedOut) {
        return answer.with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    answer
}

/// Serialize mode: each write is forwarded unchanged, one after another under the grant and
/// under the resource's commit slot, after the stale check against turnlock's own turn mark.
/// The mark is raised only by a write the store accepted; writes of other turns to the same
/// resource, on any proxy, wait for the slot, so they reach the store one at a time.
async fn serialize_batch(s: &Shared, queue: &Queue, lease: &Lease, batch: &[Pending]) -> Vec<Answer> {
    let mut slot = SlotHold::new(queue.scope.clone());
    let mut answers = Vec::with_capacity(batch.len());
    for p in batch {
        // Taken anew for each write: the turn mark is read with it.
        slot.since = None;
        let (answer, settled) = serialize_one(s, lease, p, &mut slot).await;
        match settled {
            Some(settled) => slot.release(s, lease, settled).await,
            // Unknown outcome: the slot expires by itself, after the write can have landed,
            // and the write's turn counts as accepted (it may be stored).
            None => {
                slot.since = None;
                if let Err(error) = s.locks.raise_turn_mark(&queue.scope, p.write.turn).await {
                    tracing::warn!(%error, "turn mark not raised after an unknown outcome");
                }
            }
        }
        answers.push(answer);
    }
    answers
}

/// One serialized write; with what the store did, or `None` when its outcome is unknown.
async fn serialize_one(s: &Shared, lease: &Lease, p: &Pending, slot: &mut SlotHold) -> (Answer, Option<Settled>) {
    let Action::Serialize {
        method,
        path_and_query,
        headers,
        body,
        ..
    } = &p.write.action
    else {
        let answer = Answer::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "mixed batch", None);
        return (answer, Some(Settled::Unchanged));
    };
    if let Err(answer) = slot.hold(s, lease).await {
        return (answer, Some(Settled::Unchanged));
    }
    if is_stale(p.write.turn, slot.turn_mark) {
        let stale = MergeError::StaleTurn {
            turn: p.write.turn,
            current: slot.turn_mark,
        };
        return (merge_refusal(s, &stale), Some(Settled::Unchanged));
    }
    if !lease.check() {
        return (lease_lost(), Some(Settled::Unchanged));
    }
    let mut headers = headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(FENCING_TOKEN, HeaderValue::from(lease.fence()));
    let uri = match s.upstream.uri(path_and_query) {
        Ok(u) => u,
        Err(e) => {
            let answer = Answer::error(StatusCode::BAD_REQUEST, "invalid_path", e, None);
            return (answer, Some(Settled::Unchanged));
        }
    };
    let mut req = Request::new(full(body.clone()));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let started = Instant::now();
    let result = match s.upstream.send(req).await {
        Ok(res) => {
            let status = res.status();
            let mut res_headers = res.headers().clone();
            strip_hop_by_hop(&mut res_headers);
            res_headers.remove(header::CONTENT_LENGTH);
            s.upstream.body(res).await.map(|b| (status, res_headers, b))
        }
        Err(e) => Err(e),
    };
    s.metrics.upstream("forward", started.elapsed());
    match result {
        Ok((status, res_headers, body)) => {
            let settled = if status.is_success() {
                Settled::Accepted(p.write.turn)
            } else {
                Settled::Unchanged
            };
            let answer = Answer {
                status,
                headers: res_headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                body,
            };
            (answer, Some(settled))
        }
        Err(e) => {
            let settled = (!e.outcome_unknown()).then_some(Settled::Unchanged);
            (upstream_answer(&e), settled)
        }
    }
}

/// Deletes of one document, each forwarded under the document's commit slot: a write ordered
/// before a delete is deleted with the document; a write ordered after it starts the
/// document's next life (`201`, holding only what was written since). The store's answer is
/// passed through; on `2xx` or `404` the document's turn mark goes with it.
async fn delete_batch(s: &Shared, queue: &Queue, lease: &Lease, batch: &[Pending], path: &str) -> Vec<Answer> {
    let mut slot = SlotHold::new(queue.scope.clone());
    let mut answers = Vec::with_capacity(batch.len());
    for p in batch {
        let (answer, settled) = delete_one(s, lease, path, p, &mut slot).await;
        match settled {
            Some(settled) => slot.release(s, lease, settled).await,
            // Unknown outcome: the slot expires by itself, after the delete can have landed.
            None => slot.since = None,
        }
        answers.push(answer);
    }
    answers
}

/// One delete; with what the store did, or `None` when its outcome is unknown.
async fn delete_one(
    s: &Shared,
    lease: &Lease,
    path: &str,
    p: &Pending,
    slot: &mut SlotHold,
) -> (Answer, Option<Settled>) {
    if let Err(answer) = slot.hold(s, lease).await {
        return (answer, Some(Settled::Unchanged));
    }
    if !lease.check() {
        return (lease_lost(), Some(Settled::Unchanged));
    }
    let uri = match s.upstream.uri(path) {
        Ok(u) => u,
        Err(e) => {
            let answer = Answer::error(StatusCode::BAD_REQUEST, "invalid_path", e, None);
            return (answer, Some(Settled::Unchanged));
        }
    };
    let mut headers = match &p.write.action {
        Action::Delete { headers, .. } => headers.clone(),
        _ => http::HeaderMap::new(),
    };
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(FENCING_TOKEN, HeaderValue::from(lease.fence()));
    let mut req = Request::new(full(Bytes::new()));
    *req.method_mut() = http::Method::DELETE;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let started = Instant::now();
    let result = match s.upstream.send(req).await {
        Ok(res) => {
            let status = res.status();
            let mut res_headers = res.headers().clone();
            strip_hop_by_hop(&mut res_headers);
            res_headers.remove(header::CONTENT_LENGTH);
            s.upstream.body(res).await.map(|b| (status, res_headers, b))
        }
        Err(e) => Err(e),
    };
    s.metrics.upstream("delete", started.elapsed());
    match result {
        Ok((status, res_headers, body)) => {
            let settled = if status.is_success() || status == StatusCode::NOT_FOUND {
                Settled::Deleted
            } else {
                Settled::Unchanged
            };
            let answer = Answer {
                status,
                headers: res_headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                body,
            };
            (answer, Some(settled))
        }
        Err(e) => {
            let settled = (!e.outcome_unknown()).then_some(Settled::Unchanged);
            (upstream_answer(&e), settled)
        }
    }
}
