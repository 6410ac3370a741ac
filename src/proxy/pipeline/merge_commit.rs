//! The merge commit: read the document once under its commit slot, apply the batch's writes in
//! order, write it back once (under the store's `If-Match` too, when it gives ETags).

use std::collections::HashMap;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;
use serde_json::json;
use tokio::time::Instant;

use super::errors::refused;
use super::queue::{Pending, Queue};
use super::slot::SlotHold;
use super::store_fields;
use super::{Shared, MAX_ATTEMPTS};
use crate::http::etag_for;
use crate::lock::{Lease, Settled};
use crate::merge::{self, Document, MergeError, Op, RandomIds, Snapshot};
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::proxy::request::Action;
use crate::redis_conn::Entry;
use crate::session::{Scope, SessionId};
use crate::upstream::StoreParts;
use crate::upstream::UpstreamError;

pub(super) async fn merge_batch(
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
pub(super) async fn merge_attempts(
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
    loop {
        attempt += 1;
        // The document is read under its commit slot, whether or not the store gives ETags:
        // writers of different turns hold different locks, and a store's `If-Match` may be
        // weak (an ETag of size and whole-second mtime) or checked apart from the write. What
        // is read is then the latest commit (or what the store holds after a change made
        // behind turnlock's back, such as a delete), and nothing is committed between this
        // read and this write; the store's precondition is checked on top.
        if let Err(answer) = slot.hold(s, lease).await {
            return (vec![answer; batch.len()], false);
        }
        let store = store_parts(batch);
        let dialect = store.dialect;
        let fetched = match s.upstream.get_document_with(path, store).await {
            Ok(f) => f,
            Err(e) => return (vec![Answer::from(WriteError::Upstream(e)); batch.len()], false),
        };
        // The store's own fields are the store's: out of the merge, put back on the write.
        let (mut current, managed) = store_fields::split(dialect, fetched.doc);
        let tag = store_fields::version_tag(dialect, fetched.etag.as_ref(), &managed);
        let mut bases = load_bases(s, &queue.scope, batch, current.as_ref()).await;
        changed_behind_our_back(s, &queue.scope, batch, &mut current, &mut bases).await;
        let current_version = current.as_ref().map(merge::version_of).unwrap_or(0);
        let (doc, results) = apply_batch(session, current.as_ref(), tag.as_ref(), batch, &bases);
        let refusals = |results: Vec<Result<merge::Applied, MergeError>>, on_ok: &Answer| -> Vec<Answer> {
            results
                .into_iter()
                .map(|r| match r {
                    Ok(_) => on_ok.clone(),
                    Err(e) => refused(s, e),
                })
                .collect()
        };
        let Some(mut next) = doc.filter(|_| results.iter().any(Result::is_ok)) else {
            let on_ok = Answer::from(WriteError::Internal("nothing to write"));
            return (refusals(results, &on_ok), false);
        };
        // The slot must outlive the write-back: extended when the read took long.
        if slot.held() {
            if let Err(answer) = slot.hold(s, lease).await {
                return (refusals(results, &answer), false);
            }
        }
        if !lease.check() {
            return (refusals(results, &Answer::from(WriteError::LeaseLost)), false);
        }
        // One write-back: the whole batch is one new version, whatever it merged.
        let new_version = current_version + 1;
        next.insert("version".into(), json!(new_version));
        // A document gets its life when turnlock first writes it (see `merge::LIFE`).
        next.entry(merge::LIFE).or_insert_with(|| json!(lease.fence()));
        store_fields::strip(dialect, &mut next);
        let precondition = store_fields::precondition(dialect, current.is_some(), fetched.etag);
        let body = match store_fields::for_store(dialect, &next, &managed) {
            Some(doc) => serde_json::to_vec(&doc),
            None => serde_json::to_vec(&next),
        };
        let body = Bytes::from(body.unwrap_or_default());
        if body.len() > s.settings.max_document_bytes {
            return (
                refusals(
                    results,
                    &Answer::from(WriteError::DocumentTooLarge {
                        size: body.len(),
                        limit: s.settings.max_document_bytes,
                    }),
                ),
                false,
            );
        }
        match s
            .upstream
            .put_document_with(path, body, &precondition, lease.fence(), store)
            .await
        {
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
                        Err(e) => refused(s, e),
                    })
                    .collect();
                return (answers, false);
            }
            Err(UpstreamError::PreconditionFailed) => {
                // Decided now, not before the write-back: a re-read must start within the lease.
                if attempt < MAX_ATTEMPTS && started.elapsed() < s.locks.settings().lease / 2 {
                    continue;
                }
                return (refusals(results, &Answer::from(WriteError::KeptMoving)), false);
            }
            Err(e) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("write-back failed") {
                    tracing::warn!(error = %e, suppressed, "write-back to the context store failed");
                }
                let unknown = e.outcome_unknown();
                return (refusals(results, &Answer::from(WriteError::Upstream(e))), unknown);
            }
        }
    }
}

/// What the write-back keeps of the batch's requests: the last merge write's (its headers,
/// and its store's dialect).
fn store_parts(batch: &[Pending]) -> &StoreParts {
    static NONE: std::sync::OnceLock<StoreParts> = std::sync::OnceLock::new();
    batch
        .iter()
        .rev()
        .find_map(|p| match &p.write.action {
            Action::Merge { store, .. } => Some(store),
            _ => None,
        })
        .unwrap_or_else(|| NONE.get_or_init(StoreParts::default))
}

/// The turn a write is merged at: its own, or — a write that named none, on a route whose
/// turn is optional — the stored turn, so it is never stale and moves no turn.
fn turn_at(p: &Pending, on: Option<&Document>) -> u64 {
    if p.write.turn_given {
        p.write.turn
    } else {
        on.map(merge::turn_of).unwrap_or(0)
    }
}

/// A write that names the store's own entity tag (`If-Match` in the store's format): refused
/// as the store would refuse it unless the document is still at that tag. A whole copy sent
/// to a foreign store without a turnlock `version` of its own (read as absent, or from a
/// document turnlock never wrote): its base is unknown, so it is merged without deletions.
/// `If-None-Match: *` on a PUT: refused when the document exists. Any other write as it is.
/// The store's own fields a copy carries (`_id`, `_rev`) are taken out before the merge: they
/// are the store's, never the application's, and never a conflict.
fn with_store_precondition<'a>(
    p: &'a Pending,
    op: &'a Op,
    on: Option<&Document>,
    etag: Option<&HeaderValue>,
    first: bool,
) -> Result<std::borrow::Cow<'a, Op>, MergeError> {
    let op = store_precondition(p, op, on, etag, first)?;
    Ok(match &p.write.action {
        Action::Merge { store, .. } => store_fields::without_managed(store.dialect, op),
        _ => op,
    })
}

fn store_precondition<'a>(
    p: &'a Pending,
    op: &'a Op,
    on: Option<&Document>,
    etag: Option<&HeaderValue>,
    first: bool,
) -> Result<std::borrow::Cow<'a, Op>, MergeError> {
    let Action::Merge { store, .. } = &p.write.action else {
        return Ok(std::borrow::Cow::Borrowed(op));
    };
    if store.if_none_match && matches!(op, Op::Put { .. } | Op::Replace { .. }) {
        if let Some(cur) = on {
            return Err(MergeError::VersionMismatch {
                expected: None,
                current: merge::version_of(cur),
            });
        }
    }
    let Some(wanted) = &store.if_match else {
        // A copy that names no version of its own has an unknown base: merged without
        // deletions (see `store_fields::without_deletions`).
        return Ok(match (op, on) {
            (
                Op::Put {
                    doc,
                    base_version: None,
                },
                Some(cur),
            ) if !store.dialect.answers_natively() => {
                std::borrow::Cow::Owned(store_fields::without_deletions(doc, cur))
            }
            _ => std::borrow::Cow::Borrowed(op),
        });
    };
    let Some(stored) = on else {
        return Err(MergeError::NotFound);
    };
    let current = merge::version_of(stored);
    // Only the first write of the batch can still see the document at the tag it names.
    let any = wanted.as_bytes() == b"*";
    let same = etag.is_some_and(|tag| store_fields::bare(tag.as_bytes()) == store_fields::bare(wanted.as_bytes()));
    if !any && (!first || !same) {
        return Err(MergeError::VersionMismatch {
            expected: None,
            current,
        });
    }
    // The store's tag says the document is still there, not that the client saw every
    // message of it: only the copy's own `version` makes what it lacks a deletion.
    Ok(match op {
        Op::Put {
            doc,
            base_version: None,
        } => std::borrow::Cow::Owned(store_fields::without_deletions(doc, stored)),
        other => std::borrow::Cow::Borrowed(other),
    })
}

/// Applies a batch's writes one after another to the current document. Consecutive appends
/// are merged as one (the document is copied once for them, not once per write), each write
/// still getting its own result.
/// `etag` is the one the store gave the current document (for writes naming the store's own).
pub(super) fn apply_batch(
    session: &SessionId,
    current: Option<&Document>,
    etag: Option<&HeaderValue>,
    batch: &[Pending],
    bases: &HashMap<u64, Snapshot>,
) -> (Option<Document>, Vec<Result<merge::Applied, MergeError>>) {
    // `None` until a write applies: the current document is not copied before then.
    let mut doc: Option<Document> = None;
    let mut results = Vec::with_capacity(batch.len());
    let mut i = 0;
    while i < batch.len() {
        let turn = turn_at(&batch[i], doc.as_ref().or(current));
        let run = batch[i..]
            .iter()
            .take_while(|p| {
                turn_at(p, doc.as_ref().or(current)) == turn
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
        let first = i == 0;
        i += 1;
        let Action::Merge { op, .. } = &p.write.action else {
            results.push(Err(MergeError::NotFound));
            continue;
        };
        let op = match with_store_precondition(p, op, doc.as_ref().or(current), etag, first) {
            Ok(op) => op,
            Err(e) => {
                results.push(Err(e));
                continue;
            }
        };
        let op = op.as_ref();
        let base = match op {
            Op::Put {
                base_version: Some(v), ..
            } => bases.get(v),
            _ => None,
        };
        match merge::apply(
            session,
            doc.as_ref().or(current),
            turn_at(p, doc.as_ref().or(current)),
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

/// A stored document that differs from what turnlock committed as its version (a writer
/// reached the store without the sidecar and kept the `version` it read) is a newer version:
/// a merged PUT based on that version is merged against what turnlock committed, so the
/// other writer's change is kept rather than taken as deleted by the client. Checked only
/// when a write of the batch is based on the current version (one Redis read).
async fn changed_behind_our_back(
    s: &Shared,
    scope: &Scope,
    batch: &[Pending],
    current: &mut Option<Document>,
    bases: &mut HashMap<u64, Snapshot>,
) {
    let Some(doc) = current.as_mut() else { return };
    let v = merge::version_of(doc);
    let based_on_current = batch.iter().any(|p| {
        matches!(
            &p.write.action,
            Action::Merge {
                op: Op::Put { base_version: Some(b), .. },
                ..
            } if *b == v && v > 0
        )
    });
    if !based_on_current {
        return;
    }
    let Ok(Some(bytes)) = s.records.get(&scope.history(v)).await else {
        return;
    };
    let Ok(committed) = serde_json::from_slice::<Snapshot>(&bytes) else {
        return;
    };
    if committed != Snapshot::of(doc) {
        doc.insert("version".into(), json!(v + 1));
        bases.insert(v, committed);
    }
}

/// The snapshots of the versions that merged PUTs in the batch were based on. The current
/// version's is among them: a PUT that follows another write in the same batch no longer
/// finds its base as the document it is applied to. A base newer than the current document
/// cannot be of its present life (it was read before a delete, and stores may reuse version
/// numbers): its snapshot is never loaded, and the PUT is refused as based on an unknown
/// version.
pub(super) async fn load_bases(
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
