//! The coalescing queue of one lock key: writes waiting in this process, of which only the
//! leader competes for the lock and then takes a batch.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::proxy::answer::Answer;
use crate::proxy::request::Idempotency;
use crate::session::{Scope, SessionId};

/// The writes of one kind (`W`, a committer's write: see `Committer`) to one thing on the
/// store, under one lock key: a queue's type says what it holds, so a batch is never mixed.
pub(super) struct Queue<W> {
    pub(super) session: SessionId,
    /// The turn of every write in the queue (it is part of the lock key).
    pub(super) turn: u64,
    /// Whether the queue's writes named their turn: writes without one (on a route whose
    /// turn is optional) are queued apart, at turn 0, and are not stale-checked.
    pub(super) turn_given: bool,
    pub(super) lock_key: String,
    /// What the queue's writes protect, as a path on the store: the document, or the
    /// serialize route's resource.
    pub(super) path: String,
    /// The keys of what the queue's writes protect.
    pub(super) scope: Scope,
    pub(super) state: Mutex<QueueState<W>>,
    /// The leader's last round met a lock backend error (a Redis Cluster failing over, or
    /// unreachable): a write that runs out of time is told `lock_unavailable`, not
    /// `session_busy`, wherever its deadline is noticed.
    pub(super) backend_failed: AtomicBool,
}

pub(super) struct QueueState<W> {
    pub(super) pending: VecDeque<Pending<W>>,
    pub(super) leading: bool,
}

impl<W> Default for QueueState<W> {
    fn default() -> Self {
        Self {
            pending: VecDeque::new(),
            leading: false,
        }
    }
}

pub(super) struct Pending<W> {
    pub(super) id: u64,
    pub(super) write: W,
    /// The client's idempotency key (digest) and the request's fingerprint, when it sent one.
    pub(super) idempotency: Option<Idempotency>,
    /// The idempotency record's key and the claim it holds, when the write has a key.
    pub(super) claim: Option<(String, Bytes)>,
    pub(super) deadline: Instant,
    /// How long the write may wait in all (its deadline, from when it was queued).
    pub(super) wait: std::time::Duration,
    pub(super) reply: oneshot::Sender<Answer>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// === impl Queue ===

impl<W> Queue<W> {
    pub(super) fn withdraw(&self, id: u64) -> bool {
        let mut st = lock(&self.state);
        let before = st.pending.len();
        st.pending.retain(|p| p.id != id);
        st.pending.len() != before
    }

    /// The latest deadline among the waiting writes, answering `expired()` (`session_busy`, or
    /// `lock_unavailable` when Redis is what kept them waiting) to those already past theirs;
    /// `None` (and the leader resigns) when nothing waits. The claims of the writes answered
    /// are added to `dropped`: nothing was written for them, and their clients may be gone.
    pub(super) fn next_deadline(
        &self,
        expired: impl Fn(std::time::Duration) -> Answer,
        dropped: &mut Vec<(String, Bytes)>,
    ) -> Option<Instant> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        let (due, keep): (VecDeque<Pending<W>>, VecDeque<Pending<W>>) =
            st.pending.drain(..).partition(|p| p.deadline <= now);
        st.pending = keep;
        for p in due {
            dropped.extend(p.claim);
            let _ = p.reply.send(expired(p.wait));
        }
        let latest = st.pending.iter().map(|p| p.deadline).max();
        if latest.is_none() {
            st.leading = false;
        }
        latest
    }

    pub(super) fn take(&self, max: usize) -> Vec<Pending<W>> {
        let mut st = lock(&self.state);
        let n = st.pending.len().min(max);
        st.pending.drain(..n).collect()
    }

    /// Puts writes taken into a batch back at the front of the queue, in their order.
    pub(super) fn requeue(&self, writes: Vec<Pending<W>>) {
        let mut st = lock(&self.state);
        for p in writes.into_iter().rev() {
            st.pending.push_front(p);
        }
    }

    pub(super) fn fail_all(&self, answer: &Answer) {
        let mut st = lock(&self.state);
        for p in st.pending.drain(..) {
            let _ = p.reply.send(answer.clone());
        }
    }

    pub(super) fn is_idle(&self) -> bool {
        let st = lock(&self.state);
        st.pending.is_empty() && !st.leading
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::StatusCode;

    use super::*;
    use crate::merge::Op;
    use crate::proxy::error::WriteError;
    use crate::session::Keys;

    fn queue() -> Queue<Op> {
        let session = SessionId::parse("s-1").expect("valid id");
        Queue {
            scope: Keys::new("t:").scope(&session, "/v1/sessions/s-1"),
            session,
            turn: 1,
            turn_given: true,
            lock_key: "t:session:{s-1}:1".into(),
            path: "/v1/sessions/s-1".into(),
            state: Mutex::new(QueueState::default()),
            backend_failed: AtomicBool::new(false),
        }
    }

    /// Queues one append with `deadline`, with a claim named after `id`; returns its answer's receiver.
    fn push(q: &Queue<Op>, id: u64, deadline: Instant) -> oneshot::Receiver<Answer> {
        let (reply, rx) = oneshot::channel();
        lock(&q.state).pending.push_back(Pending {
            id,
            write: Op::Append { messages: Vec::new() },
            idempotency: None,
            claim: Some((format!("claim-{id}"), Bytes::new())),
            deadline,
            wait: Duration::from_secs(60),
            reply,
        });
        rx
    }

    #[test]
    fn a_batch_takes_the_oldest_writes_up_to_its_size() {
        let q = queue();
        let later = Instant::now() + Duration::from_secs(60);
        let _rx: Vec<_> = (1..=5).map(|id| push(&q, id, later)).collect();
        let first: Vec<u64> = q.take(3).iter().map(|p| p.id).collect();
        assert_eq!(first, [1, 2, 3]);
        let rest: Vec<u64> = q.take(3).iter().map(|p| p.id).collect();
        assert_eq!(rest, [4, 5]);
        assert!(q.take(3).is_empty());
    }

    #[test]
    fn a_withdrawn_write_is_not_taken_and_only_once() {
        let q = queue();
        let later = Instant::now() + Duration::from_secs(60);
        let _a = push(&q, 1, later);
        let _b = push(&q, 2, later);
        assert!(q.withdraw(1));
        assert!(!q.withdraw(1), "a write withdrawn twice");
        let taken: Vec<u64> = q.take(10).iter().map(|p| p.id).collect();
        assert_eq!(taken, [2]);
        assert!(!q.withdraw(2), "a write already in a batch was withdrawn");
    }

    #[tokio::test]
    async fn writes_past_their_deadline_are_answered_busy_and_their_claims_dropped() {
        let q = queue();
        lock(&q.state).leading = true;
        let now = Instant::now();
        let mut late = push(&q, 1, now - Duration::from_millis(1));
        let _waiting = push(&q, 2, now + Duration::from_secs(5));
        let mut dropped = Vec::new();
        let next = q.next_deadline(|waited| Answer::from(WriteError::SessionBusy(waited)), &mut dropped);
        assert_eq!(next, Some(now + Duration::from_secs(5)));
        let answer = late.try_recv().expect("the late write is answered");
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(String::from_utf8_lossy(&answer.body).contains("session_busy"));
        assert_eq!(dropped.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["claim-1"]);
        assert!(!q.is_idle(), "the leader resigned with a write waiting");
    }

    #[tokio::test]
    async fn the_leader_resigns_when_nothing_waits() {
        let q = queue();
        lock(&q.state).leading = true;
        assert!(!q.is_idle());
        assert_eq!(
            q.next_deadline(|waited| Answer::from(WriteError::SessionBusy(waited)), &mut Vec::new()),
            None
        );
        assert!(q.is_idle());
    }

    #[test]
    fn a_failure_answers_every_waiting_write() {
        let q = queue();
        let later = Instant::now() + Duration::from_secs(60);
        let mut rx: Vec<_> = (1..=3).map(|id| push(&q, id, later)).collect();
        q.fail_all(&Answer::from(crate::proxy::error::WriteError::LockUnavailable(
            "down".into(),
        )));
        for r in &mut rx {
            assert_eq!(
                r.try_recv().map(|a| a.status).ok(),
                Some(StatusCode::SERVICE_UNAVAILABLE)
            );
        }
        assert!(q.take(10).is_empty());
    }
}
