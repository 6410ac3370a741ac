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
//! atomic with the write), which is checked on top. The grant takes the slot with the lock
//! and the release gives both back, so an uncontended write costs two Redis round trips.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
use crate::merge::Op;
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
use self::slot::SlotHold;

/// How many times a write re-reads the document under one grant after a concurrent writer
/// of another turn moved it.
const MAX_ATTEMPTS: u32 = 4;

/// The pause before a batch queued again after meeting another turn's commit competes again:
/// that commit is in flight, and needs a store round trip to land.
const REQUEUE_PAUSE: Duration = Duration::from_millis(2);

/// The pause before a lock on a failing-over cluster shard is asked for again.
const FAILOVER_PAUSE: Duration = Duration::from_millis(100);

/// Documents whose message digests a proxy keeps (the hot ones: all are forgotten when more
/// are written, and relearned at their next commit). Few: a cache holds every message of its
/// document, so memory follows the documents' size times this number.
const DIGEST_CACHES: usize = 32;

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
    /// Whether each committed version's snapshot is kept (for merged PUTs based on it): only
    /// when a merged-PUT route exists.
    pub snapshots: bool,
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
    merges: DashMap<String, Arc<Queue<MergeWrite>>>,
    deletes: DashMap<String, Arc<Queue<http::HeaderMap>>>,
    serializes: DashMap<String, Arc<Queue<Forwarded>>>,
    /// One gate per session with a leader in this process: leaders of different turns of one
    /// session (different lock keys) take turns here instead of racing to the store and
    /// retrying on its 412s.
    gates: DashMap<SessionId, Arc<tokio::sync::Mutex<()>>>,
    tracker: TaskTracker,
    next_id: AtomicU64,
    /// What is known of the messages of the documents this proxy committed last (see
    /// [`crate::merge::DigestCache`]), by document; at most [`DIGEST_CACHES`] documents.
    digests: DashMap<String, Arc<Mutex<crate::merge::DigestCache>>>,
}

// === impl Shared ===

impl Shared {
    /// The message digests known of the document at `path`.
    fn digest_cache(&self, path: &str) -> Arc<Mutex<crate::merge::DigestCache>> {
        if let Some(cache) = self.digests.get(path) {
            return cache.clone();
        }
        if self.digests.len() >= DIGEST_CACHES {
            self.digests.clear();
        }
        self.digests.entry(path.to_owned()).or_default().clone()
    }
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
                merges: DashMap::new(),
                deletes: DashMap::new(),
                serializes: DashMap::new(),
                gates: DashMap::new(),
                tracker: TaskTracker::new(),
                next_id: AtomicU64::new(1),
                digests: DashMap::new(),
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
            match self.claim(key, fingerprint, deadline).await {
                Claim::Held(value) => claim = Some((key.clone(), value)),
                Claim::Answered(answer) => return answer,
            }
        }
        let answer = self.enqueue(write, deadline, wait, claim.clone()).await;
        if let Some((key, value)) = &claim {
            if !answer.is_final() {
                // Not recorded: let a retry apply it. Only this request's own claim is dropped
                // (an answer recorded meanwhile stays), once Redis takes it.
                idempotency::settle(s, vec![drop_claim(key.clone(), value.clone())]).await;
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
        let WriteRequest {
            session,
            turn,
            turn_given,
            action,
            idempotency,
            ..
        } = write;
        let head = Head {
            session,
            turn,
            turn_given,
            idempotency,
            claim,
            deadline,
            wait,
        };
        // What a write protects is named by its path on the store, not by the store's
        // address: proxies may reach one store under different names (a relay, a load
        // balancer, an IP or a host name), and must still share its commit order.
        match action {
            Action::Merge { op, document, store } => {
                self.enqueue_as::<MergeCommit>(head, document, MergeWrite { op, store })
                    .await
            }
            Action::Delete { document, headers } => self.enqueue_as::<DeleteCommit>(head, document, headers).await,
            // The resource is named by the route's path, whatever spelling the client sent.
            Action::Serialize {
                resource,
                method,
                path_and_query,
                headers,
                body,
                once,
            } => {
                let write = Forwarded {
                    method,
                    path_and_query,
                    headers,
                    body,
                    once,
                };
                self.enqueue_as::<SerializeCommit>(head, resource, write).await
            }
        }
    }

    /// Queues a write of kind `C` to `path` behind the writes waiting for the same lock key,
    /// starting the queue's leader when there is none, and waits for its answer.
    async fn enqueue_as<C: Committer>(&self, head: Head, path: String, write: C::Write) -> Answer {
        let s = &self.shared;
        let lock_key = s.keys.lock(&head.session, head.turn);
        // Writes without a turn (on a route whose turn is optional) share the lock of turn 0
        // but not its queue: they are not stale-checked.
        let given = if head.turn_given { "" } else { " untimed" };
        let queue_key = format!("{lock_key} {}{given} {path}", C::KIND);
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        let queue = C::queues(s)
            .entry(queue_key.clone())
            .or_insert_with(|| {
                Arc::new(Queue {
                    scope: s.keys.scope(&head.session, &path),
                    session: head.session.clone(),
                    turn: head.turn,
                    turn_given: head.turn_given,
                    lock_key,
                    path,
                    state: Mutex::new(QueueState::default()),
                    backend_failed: AtomicBool::new(false),
                })
            })
            .clone();
        let (deadline, wait) = (head.deadline, head.wait);
        let lead = {
            let mut st = lock(&queue.state);
            st.pending.push_back(Pending {
                id,
                write,
                idempotency: head.idempotency,
                claim: head.claim,
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
                .spawn(async move { lead_queue::<C>(shared, queue, queue_key).await });
        }
        match tokio::time::timeout_at(deadline, &mut rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Answer::from(WriteError::Internal("the write was dropped")),
            Err(_) => {
                if queue.withdraw(id) {
                    past_deadline(s, &queue.backend_failed, wait)
                } else {
                    // Already taken into a batch under the lock: its answer is coming.
                    rx.await
                        .unwrap_or_else(|_| Answer::from(WriteError::Internal("the write was dropped")))
                }
            }
        }
    }
}

/// What every queued write carries besides its kind's own payload.
struct Head {
    session: SessionId,
    turn: u64,
    turn_given: bool,
    idempotency: Option<crate::proxy::request::Idempotency>,
    claim: Option<(String, Bytes)>,
    deadline: Instant,
    wait: Duration,
}

/// One kind of write and how a batch of it is committed under the grant: a queue holds the
/// writes of one committer, so a batch is one kind of write by type.
trait Committer: Sized + Send + Sync + 'static {
    /// A write's own payload, besides what every write carries (see [`Pending`]).
    type Write: Send + Sync + 'static;
    /// The kind's name in queue keys.
    const KIND: &'static str;
    /// Whether a write's unknown outcome (504) is its final answer for its idempotency
    /// record: a request forwarded as is cannot be made idempotent by turnlock.
    const UNKNOWN_IS_FINAL: bool = false;
    /// The queues of this kind of write, by queue key.
    fn queues(s: &Shared) -> &DashMap<String, Arc<Queue<Self::Write>>>;
    /// Commits a batch under the grant and the document's commit `slot`: one answer per
    /// write, in order; the records to store before the lock is released are added to
    /// `records`, and what the store did is settled on `slot` (stored with the release).
    fn commit<'a>(
        s: &'a Shared,
        queue: &'a Queue<Self::Write>,
        lease: &'a Lease,
        batch: &'a [Pending<Self::Write>],
        records: &'a mut Vec<Entry>,
        slot: &'a mut SlotHold,
    ) -> impl Future<Output = Vec<Answer>> + Send + 'a;
}

/// Read-merge-write of a session document.
struct MergeCommit;
/// Deletes of a document, forwarded with the client's headers (credentials, preconditions).
struct DeleteCommit;
/// Writes forwarded unchanged under the lock (serialize mode).
struct SerializeCommit;

/// A serialized write, as the client sent it.
pub(super) struct Forwarded {
    pub(super) method: http::Method,
    pub(super) path_and_query: String,
    pub(super) headers: http::HeaderMap,
    pub(super) body: Bytes,
    /// Set on a route whose objects are created once (see `once`).
    pub(super) once: Option<crate::proxy::request::Once>,
}

/// A merge write: its change, and what the write-back keeps of its request in the store's
/// dialect (headers, credentials, the store's own `If-Match`).
pub(super) struct MergeWrite {
    pub(super) op: Op,
    pub(super) store: crate::upstream::StoreParts,
}

impl Committer for MergeCommit {
    type Write = MergeWrite;
    const KIND: &'static str = "merge";
    fn queues(s: &Shared) -> &DashMap<String, Arc<Queue<MergeWrite>>> {
        &s.merges
    }
    fn commit<'a>(
        s: &'a Shared,
        queue: &'a Queue<MergeWrite>,
        lease: &'a Lease,
        batch: &'a [Pending<MergeWrite>],
        records: &'a mut Vec<Entry>,
        slot: &'a mut SlotHold,
    ) -> impl Future<Output = Vec<Answer>> + Send + 'a {
        merge_batch(s, queue, lease, batch, records, slot)
    }
}

impl Committer for DeleteCommit {
    type Write = http::HeaderMap;
    const KIND: &'static str = "delete";
    fn queues(s: &Shared) -> &DashMap<String, Arc<Queue<http::HeaderMap>>> {
        &s.deletes
    }
    fn commit<'a>(
        s: &'a Shared,
        queue: &'a Queue<http::HeaderMap>,
        lease: &'a Lease,
        batch: &'a [Pending<http::HeaderMap>],
        _records: &'a mut Vec<Entry>,
        slot: &'a mut SlotHold,
    ) -> impl Future<Output = Vec<Answer>> + Send + 'a {
        delete_batch(s, queue, lease, batch, slot)
    }
}

impl Committer for SerializeCommit {
    type Write = Forwarded;
    const KIND: &'static str = "serialize";
    const UNKNOWN_IS_FINAL: bool = true;
    fn queues(s: &Shared) -> &DashMap<String, Arc<Queue<Forwarded>>> {
        &s.serializes
    }
    fn commit<'a>(
        s: &'a Shared,
        queue: &'a Queue<Forwarded>,
        lease: &'a Lease,
        batch: &'a [Pending<Forwarded>],
        _records: &'a mut Vec<Entry>,
        slot: &'a mut SlotHold,
    ) -> impl Future<Output = Vec<Answer>> + Send + 'a {
        serialize_batch(s, queue, lease, batch, slot)
    }
}

async fn lead_queue<C: Committer>(s: Arc<Shared>, queue: Arc<Queue<C::Write>>, queue_key: String) {
    let fence_key = s.keys.fence_token(&queue.session);
    // This leader's place in the lock's order across proxies, kept for as long as it leads.
    let waiter = format!("{:016x}", rand::random::<u64>());
    // Whether the last round ended with a place still taken in that order.
    let mut placed = false;
    let mut dropped = Vec::new();
    // Whether the last round met a lock backend error (`queue.backend_failed`): a write past
    // its deadline is told so.
    let backend_failed = |failed: bool| queue.backend_failed.store(failed, Ordering::Relaxed);
    while let Some(deadline) =
        queue.next_deadline(|waited| past_deadline(&s, &queue.backend_failed, waited), &mut dropped)
    {
        let drops: Vec<Entry> = dropped.drain(..).map(|(key, claim)| drop_claim(key, claim)).collect();
        idempotency::settle(&s, drops).await;
        let gate = s.gates.entry(queue.session.clone()).or_default().clone();
        let Ok(_turn) = tokio::time::timeout_at(deadline, gate.lock_owned()).await else {
            continue;
        };
        // One round: the writes past their deadline are answered between rounds, and the
        // session's other turns waiting at the gate get their turn.
        let round = deadline.min(Instant::now() + s.settings.budget);
        match s
            .locks
            .acquire_as(
                &queue.lock_key,
                &fence_key,
                round,
                &s.metrics,
                &waiter,
                Some(&queue.scope),
            )
            .await
        {
            Err(LockError::Busy(_)) => {
                backend_failed(false);
                placed = true;
                continue;
            }
            Err(LockError::Backend(e)) => {
                placed = true;
                if let Some(suppressed) = crate::telemetry::warn_allowed("lock backend unavailable") {
                    tracing::warn!(lock = %queue.lock_key, error = %e, suppressed, "lock backend unavailable");
                }
                if s.locks.waits_out_failovers() {
                    // A cluster: this session's shard is failing over (its primary gone, the
                    // slot moving, the cluster briefly down). Its writes wait for the new
                    // primary within their own deadline instead of bouncing; one past its
                    // deadline is answered `lock_unavailable`.
                    backend_failed(true);
                    drop(_turn);
                    tokio::time::sleep_until(deadline.min(Instant::now() + FAILOVER_PAUSE)).await;
                    continue;
                }
                queue.fail_all(&Answer::from(WriteError::LockUnavailable(format!(
                    "the lock backend is unavailable: {e}"
                ))));
            }
            Ok(lease) => {
                backend_failed(false);
                // A grant takes the waiter out of the order.
                placed = false;
                // The grant took the document's commit slot too, when it was free.
                let mut slot = SlotHold::from_grant(queue.scope.clone(), &lease);
                let batch = queue.take(s.settings.max_batch);
                if batch.is_empty() {
                    lease.release_with(&s.metrics, Vec::new(), slot.into_release()).await;
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
                let (answers, records, again) = commit::<C>(&s, &queue, &lease, &batch, &mut slot)
                    .instrument(span.clone())
                    .await;
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
                // The records and the commit slot go before the lock: with Redis, in the
                // release's own round trip; what a failed round trip carried is stored again
                // once Redis answers.
                let records = if s.locks.carries_records() {
                    records
                } else {
                    idempotency::settle(&s, records).await;
                    Vec::new()
                };
                let released = lease.release_with(&s.metrics, records, slot.into_release()).await;
                if !released.unsaved.is_empty() {
                    idempotency::settle_later(&s, released.unsaved, "the lock release failed".into());
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
    // Nothing waits any more: the place in the lock's order goes (else it lapses by itself).
    if placed {
        s.locks.leave(&queue.lock_key, &waiter).await;
    }
    C::queues(&s).remove_if(&queue_key, |_, q| q.is_idle());
    // The gate goes when no leader holds or waits for it (only this map's reference is left).
    s.gates.remove_if(&queue.session, |_, g| Arc::strong_count(g) == 1);
}

/// Everything done under one grant: the read-merge-write (or the serialized forwards). Returns
/// one answer per write, in order, the records to store before the lock is released (the
/// version snapshot of what was written, the idempotency results), and which writes are to be
/// queued again instead of answered (see [`conflicted`]).
async fn commit<C: Committer>(
    s: &Shared,
    queue: &Queue<C::Write>,
    lease: &Lease,
    batch: &[Pending<C::Write>],
    slot: &mut SlotHold,
) -> (Vec<Answer>, Vec<Entry>, Vec<bool>) {
    let mut records = Vec::new();
    let answers = C::commit(s, queue, lease, batch, &mut records, slot).await;
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
    records.extend(idempotency::results(s, settled, C::UNKNOWN_IS_FINAL));
    (answers, records, again)
}

/// Whether an answer says that another turn's commit came first (`write_conflict`: the
/// document moved past every re-read, or its commit slot stayed taken). Nothing was written
/// for such a write: it is queued again, to be re-read and re-merged under a later grant.
fn conflicted(a: &Answer) -> bool {
    a.status == http::StatusCode::SERVICE_UNAVAILABLE && a.code() == "write_conflict"
}

/// The entry that drops a claim, only while it still holds the claim's own value.
fn drop_claim(key: String, claim: Bytes) -> Entry {
    Entry {
        key,
        value: Bytes::new(),
        ttl: Duration::ZERO,
        expect: Some(claim),
    }
}

/// The answer to a write whose deadline passed while it waited: `lock_unavailable` when the
/// lock backend is what kept it waiting (its queue's last round met a backend error, or Redis
/// left commands unanswered), `session_busy` (load shedding) otherwise.
fn past_deadline(s: &Shared, backend_failed: &AtomicBool, waited: Duration) -> Answer {
    if backend_failed.load(Ordering::Relaxed) {
        Answer::from(WriteError::LockUnavailable(
            "the lock backend did not answer before the write's deadline".into(),
        ))
    } else {
        unanswered(&s.locks, s.settings.budget, waited)
    }
}
