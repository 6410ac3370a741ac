//! The write path behind the edge: idempotency, coalescing, and the serialized
//! read-merge-write under the session lock.
//!
//! Writes to one lock key (`session:<id>:<turn>`) that wait in this process form a queue; only
//! its leader competes for the lock. Once granted, the leader takes every queued write, reads
//! the document once, merges the writes one after another, writes the result back once under
//! the store's `If-Match` (or turnlock's version fence), and answers each write on its own
//! (group commit). A write waits at most its budget for the lock, then gets `session_busy`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
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
use crate::lock::{Lease, LockError, Locks, Reservation};
use crate::merge::{self, Document, MergeError, Op, RandomIds, Snapshot};
use crate::metrics::Metrics;
use crate::records::{Entry, Records};
use crate::session::{is_stale, Keys, SessionId};
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

struct Queue {
    session: SessionId,
    turn: u64,
    lock_key: String,
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
        if let Some((key, fingerprint)) = &idem {
            if let Some(answer) = self.claim(key, fingerprint).await {
                return answer;
            }
        }
        let answer = self.enqueue(write, deadline).await;
        if let Some((key, _)) = &idem {
            if !answer.is_final() {
                // Not recorded: let a retry apply it.
                let _ = s.records.delete(key).await;
            }
        }
        answer
    }

    /// Claims an idempotency key, or answers from its record.
    async fn claim(&self, key: &str, fingerprint: &str) -> Option<Answer> {
        let s = &self.shared;
        let claim_ttl = s.locks.settings().lease * 2 + s.settings.budget + Duration::from_secs(10);
        for _ in 0..2 {
            match s.records.get(key).await {
                Err(e) => return Some(Answer::retryable("lock_unavailable", e)),
                Ok(Some(bytes)) => {
                    let Some(record) = Record::parse(&bytes) else {
                        return Some(Answer::retryable(
                            "idempotency_record_unreadable",
                            "the idempotency record could not be read",
                        ));
                    };
                    if record.fingerprint != fingerprint {
                        return Some(Answer::error(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "idempotency_key_reused",
                            "this Idempotency-Key was used for a different request",
                            None,
                        ));
                    }
                    return Some(match record.done {
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
                Ok(None) => match s.records.put_new(key, Record::pending(fingerprint), claim_ttl).await {
                    Ok(true) => return None,
                    Ok(false) => continue,
                    Err(e) => return Some(Answer::retryable("lock_unavailable", e)),
                },
            }
        }
        Some(Answer::retryable(
            "request_in_progress",
            "a request with this Idempotency-Key is in progress",
        ))
    }

    async fn enqueue(&self, write: WriteRequest, deadline: Instant) -> Answer {
        let s = &self.shared;
        let lock_key = s.keys.lock(&write.session, write.turn);
        let queue_key = match &write.action {
            Action::Merge { document, .. } => format!("{lock_key} merge {document}"),
            Action::Serialize { .. } => format!("{lock_key} serialize"),
        };
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        let queue = s
            .queues
            .entry(queue_key.clone())
            .or_insert_with(|| {
                Arc::new(Queue {
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
                    busy(s.settings.budget)
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

    /// The latest deadline among the waiting writes, answering `busy` to those already past
    /// theirs; `None` (and the leader resigns) when nothing waits.
    fn next_deadline(&self, budget: Duration) -> Option<Instant> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        let (due, keep): (VecDeque<Pending>, VecDeque<Pending>) = st.pending.drain(..).partition(|p| p.deadline <= now);
        st.pending = keep;
        for p in due {
            let _ = p.reply.send(busy(budget));
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
    while let Some(deadline) = queue.next_deadline(s.settings.budget) {
        let gate = s.gates.entry(queue.session.clone()).or_default().clone();
        let Ok(_turn) = tokio::time::timeout_at(deadline, gate.lock_owned()).await else {
            continue;
        };
        match s.locks.acquire(&queue.lock_key, &fence_key, deadline, &s.metrics).await {
            Err(LockError::Busy(_)) => continue,
            Err(LockError::Backend(e)) => {
                tracing::warn!(lock = %queue.lock_key, error = %e, "lock backend unavailable");
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
    };
    records.extend(
        batch
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.is_final())
            .filter_map(|(p, a)| {
                let idem = p.write.idempotency.as_ref()?;
                Some(Entry {
                    key: s.keys.idempotency(&p.write.session, &idem.key_digest),
                    value: Record::done(&idem.fingerprint, a)?,
                    ttl: s.settings.idempotency_ttl,
                })
            }),
    );
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
    let started = Instant::now();
    let session = &queue.session;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let fetched = match s.upstream.get_document(path).await {
            Ok(f) => f,
            Err(e) => return vec![upstream_answer(&e); batch.len()],
        };
        let current = fetched.doc;
        let current_version = current.as_ref().map(merge::version_of).unwrap_or(0);
        let bases = load_bases(s, session, batch, current.as_ref()).await;
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
            return refusals(
                results,
                &Answer::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "nothing to write", None),
            );
        };
        if !lease.check() {
            return refusals(
                results,
                &Answer::retryable(
                    "lease_lost",
                    "the lock's lease was lost before the write; nothing was written",
                ),
            );
        }
        // One write-back: the whole batch is one new version, whatever it merged.
        let new_version = current_version + 1;
        next.insert("version".into(), json!(new_version));
        let fenced = fetched.etag.is_none();
        let precondition = match (&current, fetched.etag) {
            (None, _) => Precondition::Absent,
            (Some(_), Some(tag)) => Precondition::IfMatch(tag),
            (Some(_), None) => Precondition::None,
        };
        let vkey = s.keys.version_fence(session);
        let pkey = s.keys.version_pending(session);
        let retry_left = attempt < MAX_ATTEMPTS && started.elapsed() < s.locks.settings().lease / 2;
        if fenced {
            match s.locks.reserve_version(lease, &vkey, &pkey, current_version).await {
                Ok(Reservation::Reserved) => {}
                Ok(Reservation::NewerCommitted | Reservation::InFlight) if retry_left => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                Ok(Reservation::NewerCommitted | Reservation::InFlight) => {
                    return refusals(
                        results,
                        &Answer::retryable(
                            "write_conflict",
                            "a concurrent write of another turn kept moving the session; retry",
                        ),
                    );
                }
                Ok(Reservation::LeaseLost) => {
                    return refusals(
                        results,
                        &Answer::retryable(
                            "lease_lost",
                            "the lock's lease was lost before the write; nothing was written",
                        ),
                    );
                }
                Err(e) => return refusals(results, &Answer::retryable("lock_unavailable", e)),
            }
        }
        let body = Bytes::from(serde_json::to_vec(&next).unwrap_or_default());
        match s.upstream.put_document(path, body, &precondition, lease.fence()).await {
            Ok(etag) => {
                if fenced {
                    if let Err(e) = s.locks.settle_version(lease, &vkey, &pkey, Some(new_version)).await {
                        tracing::warn!(error = %e, "version fence not settled; its reservation expires with the lease");
                    }
                }
                records.push(Entry {
                    key: s.keys.history(session, new_version),
                    value: Bytes::from(serde_json::to_vec(&Snapshot::of(&next)).unwrap_or_default()),
                    ttl: s.settings.history_ttl,
                });
                let status = if current.is_none() {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                let etag = etag.unwrap_or_else(|| etag_for(new_version));
                let turn = merge::turn_of(&next);
                return results
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
            }
            Err(UpstreamError::PreconditionFailed) => {
                if fenced {
                    let _ = s.locks.settle_version(lease, &vkey, &pkey, None).await;
                }
                if retry_left {
                    continue;
                }
                return refusals(
                    results,
                    &Answer::retryable(
                        "write_conflict",
                        "a concurrent write of another turn kept moving the session; retry",
                    ),
                );
            }
            Err(e) => {
                // When the outcome is unknown the reservation is left to expire with the lease:
                // the write may still land, and nothing may be ordered after it meanwhile.
                if fenced && !e.outcome_unknown() {
                    let _ = s.locks.settle_version(lease, &vkey, &pkey, None).await;
                }
                tracing::warn!(error = %e, "write-back to the context store failed");
                return refusals(results, &upstream_answer(&e));
            }
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
            Op::Put { base_version, .. } => bases.get(base_version),
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
/// finds its base as the document it is applied to.
async fn load_bases(
    s: &Shared,
    session: &SessionId,
    batch: &[Pending],
    current: Option<&Document>,
) -> HashMap<u64, Snapshot> {
    let current_version = current.map(merge::version_of).unwrap_or(0);
    let mut bases = HashMap::new();
    for p in batch {
        if let Action::Merge {
            op: Op::Put { base_version, .. },
            ..
        } = &p.write.action
        {
            let v = *base_version;
            if v == 0 || bases.contains_key(&v) {
                continue;
            }
            if v == current_version {
                if let Some(doc) = current {
                    bases.insert(v, Snapshot::of(doc));
                }
                continue;
            }
            if let Ok(Some(bytes)) = s.records.get(&s.keys.history(session, v)).await {
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
        MergeError::BaseUnknown { base } => (StatusCode::CONFLICT, Some(json!({"base_version": base}))),
        MergeError::VersionMismatch { current, .. } => (
            StatusCode::PRECONDITION_FAILED,
            Some(json!({"current_version": current})),
        ),
        MergeError::UnknownThrough { .. } => (StatusCode::CONFLICT, None),
        MergeError::NotFound => (StatusCode::NOT_FOUND, None),
    };
    Answer::error(status, e.code(), e, extra)
}

fn upstream_answer(e: &UpstreamError) -> Answer {
    let extra = match e {
        UpstreamError::Status { status, .. } => Some(json!({"upstream_status": status.as_u16()})),
        _ => None,
    };
    let answer = Answer::error(
        e.status(),
        e.code(),
        format!("{e}; nothing was written by this request"),
        extra,
    );
    if matches!(e, UpstreamError::FencedOut) {
        return answer.with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    answer
}

/// Serialize mode: each write is forwarded unchanged, one after another under the grant,
/// after the stale check against turnlock's own turn mark.
async fn serialize_batch(s: &Shared, queue: &Queue, lease: &Lease, batch: &[Pending]) -> Vec<Answer> {
    let mark_key = s.keys.turn_mark(&queue.session);
    let mut answers = Vec::with_capacity(batch.len());
    for p in batch {
        let Action::Serialize {
            method,
            path_and_query,
            headers,
            body,
        } = &p.write.action
        else {
            answers.push(Answer::error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "mixed batch",
                None,
            ));
            continue;
        };
        let mark = match s.locks.turn_mark(&mark_key).await {
            Ok(m) => m,
            Err(e) => {
                answers.push(Answer::retryable("lock_unavailable", e));
                continue;
            }
        };
        if is_stale(p.write.turn, mark) {
            answers.push(merge_refusal(
                s,
                &MergeError::StaleTurn {
                    turn: p.write.turn,
                    current: mark,
                },
            ));
            continue;
        }
        if !lease.check() {
            answers.push(Answer::retryable(
                "lease_lost",
                "the lock's lease was lost before the write; nothing was written",
            ));
            continue;
        }
        let mut headers = headers.clone();
        strip_hop_by_hop(&mut headers);
        headers.remove(header::HOST);
        headers.remove(header::CONTENT_LENGTH);
        headers.insert(FENCING_TOKEN, HeaderValue::from(lease.fence()));
        let uri = match s.upstream.uri(path_and_query) {
            Ok(u) => u,
            Err(e) => {
                answers.push(Answer::error(StatusCode::BAD_REQUEST, "invalid_path", e, None));
                continue;
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
                if status.is_success() {
                    if let Err(e) = s.locks.raise_turn_mark(&mark_key, p.write.turn).await {
                        tracing::warn!(error = %e, "turn mark not raised");
                    }
                }
                answers.push(Answer {
                    status,
                    headers: res_headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    body,
                });
            }
            Err(e) => answers.push(upstream_answer(&e)),
        }
    }
    answers
}
