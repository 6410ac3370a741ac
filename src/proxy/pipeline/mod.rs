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
mod leader;
mod merge_commit;
mod once;
mod queue;
mod slot;
mod store_fields;

use self::errors::unanswered;
use self::forward::{delete_batch, serialize_batch};
use self::idempotency::Claim;
use self::leader::{drop_claim, lead_queue, past_deadline};
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
    deletes: DashMap<String, Arc<Queue<DeleteWrite>>>,
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
            Action::Delete {
                document,
                query,
                headers,
                store,
            } => {
                let write = DeleteWrite { query, headers, store };
                self.enqueue_as::<DeleteCommit>(head, document, write).await
            }
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
                    scope: s.keys.scope(&head.session, &crate::routes::canonical_name(&path)),
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

/// A session delete: what of the client's request goes on to the store.
pub(super) struct DeleteWrite {
    /// The client's query string (CouchDB names the revision deleted with `?rev=`).
    pub(super) query: Option<String>,
    /// The client's headers (credentials, preconditions).
    pub(super) headers: http::HeaderMap,
    /// How the document is read back when the store answers 404, which does not always
    /// mean it is gone (CouchDB's answer to a revision it does not have).
    pub(super) store: crate::upstream::StoreParts,
}

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
    type Write = DeleteWrite;
    const KIND: &'static str = "delete";
    fn queues(s: &Shared) -> &DashMap<String, Arc<Queue<DeleteWrite>>> {
        &s.deletes
    }
    fn commit<'a>(
        s: &'a Shared,
        queue: &'a Queue<DeleteWrite>,
        lease: &'a Lease,
        batch: &'a [Pending<DeleteWrite>],
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
