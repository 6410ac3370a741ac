//! The leader of a queue: competes for the session's lock in rounds, answers the writes past
//! their deadline between rounds, and commits a batch under each grant.

use super::*;

pub(super) async fn lead_queue<C: Committer>(s: Arc<Shared>, queue: Arc<Queue<C::Write>>, queue_key: String) {
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
pub(super) fn conflicted(a: &Answer) -> bool {
    a.status == http::StatusCode::SERVICE_UNAVAILABLE && a.code() == "write_conflict"
}

/// The entry that drops a claim, only while it still holds the claim's own value.
pub(super) fn drop_claim(key: String, claim: Bytes) -> Entry {
    Entry {
        key,
        value: Bytes::new(),
        ttl: Duration::ZERO,
        expect: Some(claim),
        refresh: false,
    }
}

/// The answer to a write whose deadline passed while it waited: `lock_unavailable` when the
/// lock backend is what kept it waiting (its queue's last round met a backend error, or Redis
/// left commands unanswered), `session_busy` (load shedding) otherwise.
pub(super) fn past_deadline(s: &Shared, backend_failed: &AtomicBool, waited: Duration) -> Answer {
    if backend_failed.load(Ordering::Relaxed) {
        Answer::from(WriteError::LockUnavailable(
            "the lock backend did not answer before the write's deadline".into(),
        ))
    } else {
        unanswered(&s.locks, s.settings.budget, waited)
    }
}
